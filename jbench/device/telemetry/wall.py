"""Wall power: an external meter read from the controller, aligned to the device's clock.

Some users measure what the whole board draws at the socket, as MLPerf Power does. These samplers run
on the controller in a thread (like NvmlSampler) and stamp each reading with the controller's clock at
the midpoint of its request. `measure_clock_offset` measures device clock - controller clock over
round trips through the device connection, so the readings can be shifted onto the device clock that
the phase windows use.

Meters (wall_power.source):
- ptdaemon: a SPEC PTDaemon TCP server, driven the way MLPerf's power-dev server drives it
  (github.com/mlcommons/power-dev, ptd_client_server/lib/server.py: `Ptd.start`, `Session.start`,
  `Ptd.grab_power_data`, `Ptd.terminate`; replies as checked by compliance/check.py). With ranging a
  ranging run (auto ranges) precedes the testing run, which uses the largest volts and 1.1x the largest
  amps that the ranging run saw.
- shelly: Shelly Gen2+ RPC over HTTP, `GET /rpc/Switch.GetStatus?id=<channel>` (apower W, voltage V,
  current A, aenergy.total Wh; shelly-api-docs.shelly.cloud/gen2/ComponentsAndServices/Switch), digest
  authentication with SHA-256 when a password is set (.../gen2/General/Authentication, RFC 7616).
- tasmota: Tasmota's HTTP command API, `GET /cm?cmnd=Status 8` with optional `user`/`password`
  (tasmota.github.io/docs/Commands/#with-web-requests), reply StatusSNS.ENERGY {Power W, Voltage V,
  Current A, Total kWh} (tasmota.github.io/docs/JSON-Status-Responses/).

A sample is {"t", "power_w", "voltage_v", "current_a", "energy_j"?}; `energy_j` is the meter's own
cumulative counter in joules where it has one, with its resolution in `counter_resolution_j` (read
from the digits the meter sent). A meter that cannot be read says why in `problem`; it never
produces zeros.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import secrets
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Callable, Optional, Sequence

from jbench.core.schema import WallPowerConfig, WallPowerSection, typed
from jbench.device.connection import Connection, DeviceError
from jbench.device.telemetry.samplers import Sampler

log = logging.getLogger("jbench.telemetry.wall")

SOURCES = ("none", "ptdaemon", "shelly", "tasmota")

# The device's clock as epoch seconds; `date +%s.%N` costs no interpreter start (GNU date, as on L4T).
DEVICE_CLOCK_ARGV = ["date", "+%s.%N"]
DEVICE_CLOCK_FALLBACK_ARGV = ["python3", "-c", "import time; print(repr(time.time()))"]


class WallMeterError(Exception):
    """A wall meter that cannot be reached or answers something unexpected."""


# --------------------------------------------------------------------------------------------
# Clock offset between controller and device


@dataclass(frozen=True)
class ClockOffset:
    offset_s: float  # device clock - controller clock
    uncertainty_s: float  # half the round trip of the best exchange: the device read its clock inside it
    rtt_s: float
    rounds: int

    @staticmethod
    def combine(before: "ClockOffset", after: Optional["ClockOffset"]) -> "ClockOffset":
        """One offset for a trial measured before and after it: the mean, widened by half the drift."""
        if after is None:
            return before
        drift = after.offset_s - before.offset_s
        return ClockOffset((before.offset_s + after.offset_s) / 2,
                           max(before.uncertainty_s, after.uncertainty_s) + abs(drift) / 2,
                           min(before.rtt_s, after.rtt_s), before.rounds + after.rounds)


def _device_time(text: str) -> Optional[float]:
    try:
        value = float(text.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None
    return value if math.isfinite(value) and value > 0 else None


def measure_clock_offset(conn: Connection, rounds: int = 8, argv: Optional[Sequence[str]] = None,
                         timeout_s: float = 10.0) -> ClockOffset:
    """Device clock - controller clock from `rounds` round trips that read the device's clock.

    Each exchange brackets the device's reading between two controller readings t0, t1, so
    offset = device - (t0 + t1) / 2 is off by at most (t1 - t0) / 2. The exchange with the smallest
    round trip is kept (NTP's rule). Raises DeviceError when the device's clock cannot be read."""
    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    candidates = [list(argv)] if argv is not None else [DEVICE_CLOCK_ARGV, DEVICE_CLOCK_FALLBACK_ARGV]
    last_output = ""
    for cmd in candidates:
        best: Optional[tuple[float, float]] = None  # (rtt, offset)
        for _ in range(rounds):
            t0 = time.time()
            res = conn.run(cmd, timeout=timeout_s)
            t1 = time.time()
            device_t = _device_time(res.stdout) if res.ok else None
            if device_t is None:
                last_output = (res.stdout + res.stderr).strip()[:200]
                break  # e.g. a `date` without %N: try the next way of reading the clock
            rtt = t1 - t0
            if best is None or rtt < best[0]:
                best = (rtt, device_t - (t0 + t1) / 2)
        else:
            assert best is not None
            return ClockOffset(best[1], best[0] / 2, best[0], rounds)
    raise DeviceError(f"could not read the device's clock for the wall meter's alignment (last output: {last_output!r})")


# --------------------------------------------------------------------------------------------
# Samplers


def _resolution(value: Decimal) -> float:
    """The step of the last digit the meter sent (0.001 for "12.345")."""
    exponent = value.as_tuple().exponent
    return 10.0 ** exponent if isinstance(exponent, int) else math.nan


class WallSampler(Sampler):
    """Polls a meter every interval; samples carry the controller's clock until `shifted`."""

    kind = "wall"

    def __init__(self, interval_ms: int, timeout_s: float = 2.0):
        super().__init__()
        self.interval = interval_ms / 1000.0
        self.timeout_s = timeout_s
        self.meter = ""  # the meter's identity, as it reports it
        self.counter_resolution_j: Optional[float] = None
        self.failed_polls = 0
        self.last_error = ""

    def _finest(self, step_j: float) -> None:
        # A meter may drop trailing zeros ("12.5"): the finest step seen over the readings is its resolution.
        if math.isfinite(step_j) and (self.counter_resolution_j is None or step_j < self.counter_resolution_j):
            self.counter_resolution_j = step_j

    def _read(self) -> dict:
        """One reading (power_w and what else the meter has); raises WallMeterError."""
        raise NotImplementedError

    def probe(self) -> None:
        """Connect and identify the meter (raises WallMeterError with a clear reason)."""
        self._read()

    def _run(self) -> None:
        next_t = time.monotonic()
        while not self._stop.is_set():
            t0 = time.time()
            try:
                reading = self._read()
            except (WallMeterError, OSError, ValueError) as exc:
                self.failed_polls += 1
                self.last_error = str(exc)
                if not self.samples and self.failed_polls >= 3:
                    self.problem = f"wall meter {self.source}: {exc}"
                    return
            else:
                t1 = time.time()
                self.samples.append({"t": (t0 + t1) / 2, **reading})
            next_t += self.interval
            self._stop.wait(max(0.0, next_t - time.monotonic()))

    def shifted(self, offset_s: float) -> list[dict]:
        """The samples moved onto the device's clock (t + device - controller offset)."""
        return [{**s, "t": s["t"] + offset_s} for s in self.samples]


def _http_get(url: str, timeout_s: float, headers: Optional[dict] = None) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()
    except urllib.error.URLError as exc:
        raise WallMeterError(f"cannot reach {urllib.parse.urlsplit(url).netloc}: {exc.reason}") from None


def _digest_header(challenge: str, method: str, uri: str, user: str, password: str) -> str:
    """RFC 7616 digest response (qop=auth) to a WWW-Authenticate challenge; SHA-256 or MD5."""
    params: dict[str, str] = {}
    for part in urllib.request.parse_http_list(challenge.split(" ", 1)[1] if " " in challenge else ""):
        key, _, value = part.partition("=")
        params[key.strip().lower()] = value.strip().strip('"')
    algorithm = params.get("algorithm", "MD5").upper()
    h = {"SHA-256": hashlib.sha256, "MD5": hashlib.md5}.get(algorithm)
    if h is None:
        raise WallMeterError(f"unsupported digest algorithm {algorithm}")

    def hx(text: str) -> str:
        return h(text.encode()).hexdigest()

    realm, nonce, cnonce, nc = params.get("realm", ""), params.get("nonce", ""), secrets.token_hex(8), "00000001"
    ha1, ha2 = hx(f"{user}:{realm}:{password}"), hx(f"{method}:{uri}")
    response = hx(f"{ha1}:{nonce}:{nc}:{cnonce}:auth:{ha2}")
    return (f'Digest username="{user}", realm="{realm}", nonce="{nonce}", uri="{uri}", algorithm={algorithm}, '
            f'qop=auth, nc={nc}, cnonce="{cnonce}", response="{response}"')


class ShellySampler(WallSampler):
    """Shelly Gen2+ `Switch.GetStatus` (apower, voltage, current, aenergy.total in Wh)."""

    source = "shelly"

    def __init__(self, host: str, port: int = 80, channel: int = 0, password: Optional[str] = None,
                 interval_ms: int = 500, timeout_s: float = 2.0):
        super().__init__(interval_ms, timeout_s)
        self.base = f"http://{host}:{port}"
        self.uri = f"/rpc/Switch.GetStatus?id={int(channel)}"
        self.password = password
        self.channel = channel

    def _get_json(self, uri: str) -> Any:
        status, headers, body = _http_get(self.base + uri, self.timeout_s)
        if status == 401:
            # Every HTTP request repeats the challenge (Gen2 docs, "Authentication process").
            if not self.password:
                raise WallMeterError("the Shelly asks for a password: set wall_power.password_env to the name "
                                     "of an environment variable that holds it")
            challenge = next((v for k, v in headers.items() if k.lower() == "www-authenticate"), "")
            auth = _digest_header(challenge, "GET", uri, "admin", self.password)  # the user is always admin
            status, headers, body = _http_get(self.base + uri, self.timeout_s, {"Authorization": auth})
            if status == 401:
                raise WallMeterError("the Shelly refused the password (wall_power.password_env)")
        if status != 200:
            raise WallMeterError(f"Shelly answered HTTP {status} to {uri}: {body[:200]!r}")
        return json.loads(body, parse_float=Decimal)

    def probe(self) -> None:
        # Shelly.GetDeviceInfo needs no authentication (Gen2 docs) and names the device.
        info = self._get_json("/rpc/Shelly.GetDeviceInfo")
        self.meter = f"shelly {info.get('model', '?')} {info.get('id', '?')} fw {info.get('fw_id', info.get('ver', '?'))}"
        self._read()

    def _read(self) -> dict:
        st = self._get_json(self.uri)
        if "apower" not in st:
            raise WallMeterError(f"switch:{self.channel} has no power meter (no apower in Switch.GetStatus)")
        sample: dict = {"power_w": float(st["apower"])}
        for key, name in (("voltage", "voltage_v"), ("current", "current_a")):
            if st.get(key) is not None:
                sample[name] = float(st[key])
        total = (st.get("aenergy") or {}).get("total")
        if total is not None:
            sample["energy_j"] = float(total) * 3600.0  # Wh -> J
            self._finest(_resolution(total) * 3600.0)
        return sample


class TasmotaSampler(WallSampler):
    """Tasmota `Status 8`: StatusSNS.ENERGY {Power, Voltage, Current, Total (kWh)}."""

    source = "tasmota"

    def __init__(self, host: str, port: int = 80, channel: int = 0, user: Optional[str] = None,
                 password: Optional[str] = None, interval_ms: int = 500, timeout_s: float = 2.0):
        super().__init__(interval_ms, timeout_s)
        self.base = f"http://{host}:{port}"
        self.channel = channel
        self.user = user or "admin"
        self.password = password
        self.energy_res: Optional[int] = None

    def _command(self, cmnd: str) -> Any:
        query = {"cmnd": cmnd}
        if self.password:
            query = {"user": self.user, "password": self.password, **query}
        # The URL carries the password: it is never logged or put in an error message.
        status, _, body = _http_get(f"{self.base}/cm?{urllib.parse.urlencode(query, quote_via=urllib.parse.quote)}",
                                    self.timeout_s)
        try:
            reply = json.loads(body, parse_float=Decimal)
        except ValueError:
            raise WallMeterError(f"Tasmota answered HTTP {status} without JSON: {body[:120]!r}") from None
        if status == 401 or (isinstance(reply, dict) and "WARNING" in reply):
            raise WallMeterError("Tasmota asks for user and password: set wall_power.user and "
                                 "wall_power.password_env (the name of an environment variable that holds it)")
        if status != 200:
            raise WallMeterError(f"Tasmota answered HTTP {status}")
        return reply

    def _pick(self, value: Any) -> Any:
        # A plug with several channels sends a list per quantity.
        if isinstance(value, list):
            if self.channel >= len(value):
                raise WallMeterError(f"Tasmota has {len(value)} channels; wall_power.channel={self.channel}")
            return value[self.channel]
        return value

    def probe(self) -> None:
        st = self._command("Status 0").get("Status") or {}
        fw = (self._command("Status 2").get("StatusFWR") or {}).get("Version", "?")
        self.meter = f"tasmota {st.get('DeviceName') or st.get('FriendlyName') or '?'} fw {fw}"
        # EnergyRes: the decimals of the kWh values (docs/Commands, "Power Monitoring"); default 3.
        res = self._command("EnergyRes").get("EnergyRes")
        if isinstance(res, int):
            self.energy_res = res
            self.counter_resolution_j = 10.0 ** -res * 3.6e6
        self._read()

    def _read(self) -> dict:
        reading = (self._command("Status 8").get("StatusSNS") or {}).get("ENERGY")
        if not reading or reading.get("Power") is None:
            raise WallMeterError("Tasmota has no energy monitor (no StatusSNS.ENERGY.Power in Status 8)")
        sample: dict = {"power_w": float(self._pick(reading["Power"]))}
        for key, name in (("Voltage", "voltage_v"), ("Current", "current_a")):
            if reading.get(key) is not None:
                sample[name] = float(self._pick(reading[key]))
        total = reading.get("Total")
        if total is not None and not isinstance(total, list):
            sample["energy_j"] = float(total) * 3.6e6  # kWh -> J
            if self.energy_res is None:
                self._finest(_resolution(total) * 3.6e6)
        return sample


# --------------------------------------------------------------------------------------------
# SPEC PTDaemon


class PtdClient:
    """PTDaemon's line protocol: one command per line, one reply line per command ("\\r\\n" ends a
    line; power-dev lib/common.py `Proto`). `RL` replies with a header and then that many lines."""

    def __init__(self, host: str, port: int, timeout_s: float):
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as exc:
            raise WallMeterError(f"cannot reach PTDaemon at {host}:{port}: {exc}") from None
        self.buf = b""

    def line(self) -> str:
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise WallMeterError("PTDaemon closed the connection")
            self.buf += chunk
        raw, _, self.buf = self.buf.partition(b"\n")
        return raw.rstrip(b"\r").decode(errors="replace")

    def cmd(self, command: str) -> str:
        self.sock.sendall(command.encode() + b"\r\n")
        return self.line()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def parse_ptd_fields(reply: str) -> dict[str, float]:
    """`Watts,<w>,Volts,<v>,Amps,<a>,PF,<pf>` (also with `Time,<t>,` before and `Mark,<m>` after) -> values;
    -1 means "unknown" to PTDaemon and is left out."""
    parts = [p.strip() for p in reply.split(",")]
    out: dict[str, float] = {}
    for name, value in zip(parts, parts[1:]):
        if name in ("Watts", "Volts", "Amps", "PF") and name not in out:
            try:
                v = float(value)
            except ValueError:
                continue
            if math.isfinite(v) and v != -1.0:
                out[name] = v
    return out


class PtdSampler(WallSampler):
    """A PTDaemon session: optional ranging run, then the testing run that is sampled."""

    source = "ptdaemon"

    def __init__(self, host: str, port: int, interval_ms: int = 1000, timeout_s: float = 5.0, mark: str = "jbench"):
        super().__init__(interval_ms, timeout_s)
        self.host, self.port, self.mark = host, port, mark
        self.client: Optional[PtdClient] = None
        self.initial_ranges = ("Auto", "Auto")  # (volts, amps) to restore, as Ptd.terminate does
        self.ranges: Optional[tuple[str, str]] = None  # (volts, amps) of the testing run
        self.ranging = "off"
        self.uncertainty = ""

    def _expect(self, command: str, ok_prefix: str) -> str:
        assert self.client is not None
        reply = self.client.cmd(command)
        if not reply.startswith(ok_prefix):
            raise WallMeterError(f"PTDaemon answered {reply!r} to {command!r}")
        return reply

    def probe(self) -> None:
        self.client = PtdClient(self.host, self.port, self.timeout_s)
        if self.client.cmd("Hello") != "Hello, PTDaemon here!":
            raise WallMeterError(f"{self.host}:{self.port} is not PTDaemon (no 'Hello, PTDaemon here!')")
        self.meter = "ptdaemon " + self.client.cmd("Identify")
        # RR: Ranges,<amp autorange>,<amp range>,<volt autorange>,<volt range> (Ptd._get_initial_range).
        rr = self.client.cmd("RR").split(",")

        def initial(i: int) -> str:
            try:
                return rr[i + 1] if rr[i] == "0" and float(rr[i + 1]) > 0 else "Auto"
            except (ValueError, IndexError):
                return "Auto"

        self.initial_ranges = (initial(3), initial(1))

    def _go(self, phase: str) -> None:
        self._expect(f"Go,{int(self.interval * 1000)},0,{self.mark}_{phase}", "Starting untimed measurement")

    def _read(self) -> dict:
        assert self.client is not None
        reply = self.client.cmd("Watts")
        fields = parse_ptd_fields(reply)
        if "Watts" not in fields:
            raise WallMeterError(f"PTDaemon answered {reply!r} to 'Watts'")
        sample = {"power_w": fields["Watts"]}
        if "Volts" in fields:
            sample["voltage_v"] = fields["Volts"]
        if "Amps" in fields:
            sample["current_a"] = fields["Amps"]
        return sample

    def ranging_run(self, workload: Callable[[], Any]) -> tuple[str, str]:
        """MLPerf's ranging mode: auto ranges while the workload runs once; the testing run then uses
        the largest volts and 1.1x the largest amps seen (Session.start/stop in power-dev's server)."""
        self._expect("SR,V,Auto", "Range V changed")
        self._expect("SR,A,Auto", "Range A changed")
        self._go("ranging")
        WallSampler.start(self)  # sample the ranging run too (the testing run's start sets ranges first)
        try:
            workload()
        finally:
            polled = self.stop()
        assert self.client is not None
        # The samples PTDaemon logged during the run (Ptd.grab_power_data): "Last N samples" + N lines.
        header = self.client.cmd("RL")
        logged: list[dict[str, float]] = []
        if header.startswith("Last "):
            for _ in range(int(header.split(" ")[1])):
                logged.append(parse_ptd_fields(self.client.line()))
        self._expect("Stop", "Stopping untimed measurement")
        rows = logged or [{"Volts": s.get("voltage_v", -1), "Amps": s.get("current_a", -1)} for s in polled]
        volts = [r["Volts"] for r in rows if r.get("Volts", -1) > 0]
        amps = [r["Amps"] for r in rows if r.get("Amps", -1) > 0]
        if not volts or not amps:
            raise WallMeterError("the ranging run gave no volts/amps readings to set the ranges from")
        self.ranges = (f"{max(volts):g}", f"{max(amps) * 1.1:g}")
        self.ranging = f"ranging run: max {max(volts):g} V, {max(amps):g} A"
        # A fresh sampler state for the testing run.
        self.samples, self._stop = [], type(self._stop)()
        self.failed_polls = 0
        return self.ranges

    def start(self) -> "Sampler":
        """Start the testing run (at the ranging run's ranges when there was one) and sample it."""
        if self.ranges is not None:
            self._expect(f"SR,V,{self.ranges[0]}", "Range V changed")
            self._expect(f"SR,A,{self.ranges[1]}", "Range A changed")
            self.ranging += f"; testing run at {self.ranges[0]} V, {self.ranges[1]} A"
        else:
            self.ranging = "off: testing run at the meter's current ranges"
        self._go("testing")
        return super().start()

    def finish(self) -> None:
        """Stop the testing run, keep its uncertainty report, restore the initial ranges, close."""
        if self.client is None:
            return
        try:
            self.uncertainty = self.client.cmd("Uncertainty")
            self.client.cmd("Stop")
            self.client.cmd(f"SR,V,{self.initial_ranges[0]}")
            self.client.cmd(f"SR,A,{self.initial_ranges[1]}")
        except (WallMeterError, OSError) as exc:
            log.warning("PTDaemon: closing the session: %s", exc)
        finally:
            self.client.close()
            self.client = None


# --------------------------------------------------------------------------------------------
# Construction from the config


def _password(wall: WallPowerConfig) -> Optional[str]:
    if not wall.password_env:
        return None
    value = os.environ.get(wall.password_env)
    if value is None:
        raise WallMeterError(f"wall_power.password_env names {wall.password_env}, which is not set in the environment")
    return value


def make_wall_sampler(section: WallPowerSection) -> Optional[WallSampler]:
    """The sampler the wall_power section asks for; None for source=none. Raises WallMeterError for a
    section that cannot work (the message names the fix)."""
    wall = typed(WallPowerConfig, section, where="wall_power")
    source = wall.source
    if source == "none":
        return None
    if source not in SOURCES:
        raise WallMeterError(f"unknown wall_power.source '{source}'. Valid sources: {', '.join(SOURCES)}")
    host = wall.host
    if not host:
        raise WallMeterError(f"wall_power.source={source} needs wall_power.host (the meter's address)")
    interval_ms, timeout_s, channel = int(wall.interval_ms), float(wall.timeout_s), int(wall.channel)
    # Shelly and Tasmota answer HTTP on port 80 unless the section names another.
    if source == "shelly":
        return ShellySampler(host, int(wall.port or 80), channel, _password(wall), interval_ms, timeout_s)
    if source == "tasmota":
        return TasmotaSampler(host, int(wall.port or 80), channel, wall.user, _password(wall), interval_ms, timeout_s)
    if not wall.port:
        raise WallMeterError("wall_power.source=ptdaemon needs wall_power.port (PTDaemon's -p port)")
    return PtdSampler(host, int(wall.port), interval_ms, max(timeout_s, 5.0))


def wall_power_problem(section: WallPowerSection) -> Optional[str]:
    """Why a wall_power section cannot work, found without reaching the meter (None: it can). Planning calls
    this, so a bad section stops the sweep before any device is touched."""
    try:
        make_wall_sampler(section)
    except WallMeterError as exc:
        return str(exc)
    except (TypeError, ValueError) as exc:  # a port or interval that is not a number, a key no schema field
        return f"wall_power: {exc}"
    return None

