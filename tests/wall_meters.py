"""Protocol-faithful wall meters for the tests, served for real on loopback.

Each meter draws a known power (`watts`, settable while it runs) and keeps its energy counter from
that power and its own clock, so every figure a test checks has a known value.

- PtdServer follows SPEC PTDaemon's TCP interface as MLPerf's power-dev drives and checks it
  (github.com/mlcommons/power-dev): lines end with "\\r\\n" (ptd_client_server/lib/common.py `Proto`);
  `Hello` -> "Hello, PTDaemon here!" and `Identify` (lib/server.py `Ptd.start`; the identity's model
  and `version=` are parsed by compliance/check.py); `RR` -> "Ranges,<amp auto>,<amp range>,<volt
  auto>,<volt range>" (`Ptd._get_initial_range`); `SR,V,..` -> "Range V changed", `SR,A,..` ->
  "Range A changed", `Go,<ms>,0,<mark>` -> "Starting untimed measurement, maximum 500000 samples at
  <ms>ms with 0 rampup samples", `Stop` -> "Stopping untimed measurement" or "Error: no measurement to
  stop" (compliance/check.py `check_reply`); `RL` -> "Last <n> samples" then n lines
  "Time,<MM-DD-YYYY HH:MM:SS.mmm>,Watts,..,Volts,..,Amps,..,PF,.." (`Ptd.grab_power_data`; the line
  format of README.md's ptd log); `Watts` -> "Watts,<w>,Volts,<v>,Amps,<a>,PF,<pf>"; `Uncertainty`.
  In auto range the meter reports the true volts and amps; in a fixed range a reading over the range
  is an error line, as a real analyzer's over-range is.
- ShellyServer follows Shelly's Gen2 RPC over HTTP (shelly-api-docs.shelly.cloud/gen2):
  `GET /rpc/Shelly.GetDeviceInfo` (never authenticated) and `GET /rpc/Switch.GetStatus?id=N` with
  apower, voltage, current, aenergy {total (Wh, 3 decimals), by_minute, minute_ts}
  (ComponentsAndServices/Switch); with a password, digest authentication per General/Authentication:
  401 with `WWW-Authenticate: Digest qop="auth", realm="<device id>", nonce=..., algorithm=SHA-256`,
  user admin, ha1 = SHA256(admin:realm:password), RFC 7616 response.
- TasmotaServer follows Tasmota's web command API (tasmota.github.io/docs/Commands/#with-web-requests):
  `GET /cm?cmnd=Status%208` (+ `user`, `password` when a web password is set; a missing or wrong one
  gives HTTP 401 and {"WARNING":"Need user=<username>&password=<password>"}); the reply shape of
  docs/JSON-Status-Responses: `EnergyRes` -> {"EnergyRes":3} (the kWh decimals, docs/Commands "Power
  Monitoring"), `Status 8` -> {"StatusSNS":{"Time":..,"ENERGY":{"TotalStartTime","Total" (kWh),
  "Yesterday","Today","Power","ApparentPower","ReactivePower","Factor","Voltage","Current"}}}.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VOLTS = 230.0


class _Meter:
    def __init__(self, watts: float):
        self.watts = watts
        self.t0 = time.time()
        self.energy_base_j = 0.0
        self._lock = threading.Lock()
        self.requests = 0

    def set_watts(self, watts: float) -> None:
        with self._lock:
            self.energy_base_j = self.energy_j()
            self.t0, self.watts = time.time(), watts

    def energy_j(self) -> float:
        return self.energy_base_j + self.watts * (time.time() - self.t0)


# ---------------------------------------------------------------------------------------------
# PTDaemon


class PtdServer(_Meter):
    def __init__(self, watts: float = 20.0, identify: str = "YokogawaWT310,C2PH13047V,F1.03,version=1.11.1-jbenchtest"):
        super().__init__(watts)
        self.identify = identify
        self.ranges = {"V": "Auto", "A": "Auto"}
        self.commands: list[str] = []
        self.log: list[str] = []  # samples logged since the last RL
        self.running: str | None = None
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def __enter__(self):
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self.sock.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _amps(self) -> float:
        return self.watts / VOLTS

    def _reading(self) -> str:
        amps = self._amps()
        if self.ranges["A"] != "Auto" and amps > float(self.ranges["A"]):
            return "Error: current over range"
        return f"Watts,{self.watts:.6f},Volts,{VOLTS:.6f},Amps,{amps:.6f},PF,0.950000"

    def _sampler(self, interval_s: float) -> None:
        while self.running and not self._stop.is_set():
            stamp = time.strftime("%m-%d-%Y %H:%M:%S", time.localtime()) + f".{int(time.time() * 1000) % 1000:03d}"
            self.log.append(f"Time,{stamp},{self._reading()}")
            time.sleep(interval_s)

    def _reply(self, cmd: str) -> list[str]:
        self.commands.append(cmd)
        if cmd == "Hello":
            return ["Hello, PTDaemon here!"]
        if cmd == "Identify":
            return [self.identify]
        if cmd == "RR":
            a_auto, a = ("1", "-1.0") if self.ranges["A"] == "Auto" else ("0", self.ranges["A"])
            v_auto, v = ("1", "-1.0") if self.ranges["V"] == "Auto" else ("0", self.ranges["V"])
            return [f"Ranges,{a_auto},{a},{v_auto},{v}"]
        m = re.fullmatch(r"SR,([VA]),(Auto|[0-9.]+)", cmd)
        if m:
            self.ranges[m.group(1)] = m.group(2)
            return [f"Range {m.group(1)} changed"]
        m = re.fullmatch(r"Go,(\d+),0,(.+)", cmd)
        if m:
            if self.running:
                return ["Error: measurement already running"]
            self.running, self.log = m.group(2), []
            threading.Thread(target=self._sampler, args=(int(m.group(1)) / 1000,), daemon=True).start()
            return [f"Starting untimed measurement, maximum 500000 samples at {m.group(1)}ms with 0 rampup samples"]
        if cmd == "Stop":
            if not self.running:
                return ["Error: no measurement to stop"]
            self.running = None
            return ["Stopping untimed measurement"]
        if cmd == "RL":
            lines, self.log = self.log, []
            return [f"Last {len(lines)} samples", *lines]
        if cmd == "Watts":
            return [self._reading()]
        if cmd == "Uncertainty":
            return ["Uncertainty,0.012%" if self.running else "Error: no measurement running"]
        return ["Unknown command"]

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        with conn:
            while not self._stop.is_set():
                try:
                    chunk = conn.recv(4096)
                except OSError:
                    return
                if not chunk:
                    return
                buf += chunk
                while b"\n" in buf:
                    raw, _, buf = buf.partition(b"\n")
                    self.requests += 1
                    out = self._reply(raw.rstrip(b"\r").decode())
                    conn.sendall(b"".join(line.encode() + b"\r\n" for line in out))


# ---------------------------------------------------------------------------------------------
# HTTP meters


class _HttpMeter(_Meter):
    def __init__(self, watts: float, password: str | None = None):
        super().__init__(watts)
        self.password = password
        meter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                meter.requests += 1
                status, body, headers = meter.handle(self.path, dict(self.headers))
                data = json.dumps(body).encode()
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()

    def handle(self, path: str, headers: dict) -> tuple[int, object, dict]:
        raise NotImplementedError


class ShellyServer(_HttpMeter):
    device_id = "shellyplusplugs-e465b8b3d4a4"

    def __init__(self, watts: float = 15.0, password: str | None = None):
        super().__init__(watts, password)
        self.nonce = str(int(time.time()))

    def _authorized(self, path: str, headers: dict) -> bool:
        auth = next((v for k, v in headers.items() if k.lower() == "authorization"), "")
        if not auth.startswith("Digest "):
            return False
        p = {k: v.strip('"') for k, v in re.findall(r'(\w+)=("[^"]*"|[^,\s]*)', auth[7:])}

        def h(text: str) -> str:
            return hashlib.sha256(text.encode()).hexdigest()

        ha1 = h(f"admin:{self.device_id}:{self.password}")
        expected = h(f"{ha1}:{p.get('nonce')}:{p.get('nc')}:{p.get('cnonce')}:auth:{h('GET:' + path)}")
        return (p.get("username") == "admin" and p.get("nonce") == self.nonce and p.get("uri") == path
                and p.get("response") == expected)

    def handle(self, path, headers):
        url = urllib.parse.urlsplit(path)
        if url.path == "/rpc/Shelly.GetDeviceInfo":
            return 200, {"name": None, "id": self.device_id, "mac": "E465B8B3D4A4", "model": "SNPL-00112EU",
                         "gen": 2, "fw_id": "20231107-164738/1.0.8-g", "ver": "1.0.8", "app": "PlugS",
                         "auth_en": self.password is not None, "auth_domain": self.device_id if self.password else None}, {}
        if self.password is not None and not self._authorized(path, headers):
            return 401, {"code": 401, "message": "unauthorized"}, {
                "WWW-Authenticate": f'Digest qop="auth", realm="{self.device_id}", nonce="{self.nonce}", algorithm=SHA-256'}
        if url.path != "/rpc/Switch.GetStatus":
            return 404, {"code": 404, "message": "No handler for " + url.path}, {}
        query = urllib.parse.parse_qs(url.query)
        if query.get("id") != ["0"]:
            return 500, {"code": -105, "message": f"Argument 'id', value {query.get('id')} not found!"}, {}
        now = time.time()
        total_wh = round(self.energy_j() / 3600.0, 3)
        return 200, {"id": 0, "source": "init", "output": True, "apower": round(self.watts, 1),
                     "voltage": VOLTS, "current": round(self.watts / VOLTS, 3),
                     "aenergy": {"total": total_wh, "by_minute": [0.0, 0.0, 0.0], "minute_ts": int(now // 60 * 60)},
                     "temperature": {"tC": 38.2, "tF": 100.8}}, {}


class TasmotaServer(_HttpMeter):
    def __init__(self, watts: float = 15.0, password: str | None = None, user: str = "admin"):
        super().__init__(watts, password)
        self.user = user

    def handle(self, path, headers):
        url = urllib.parse.urlsplit(path)
        if url.path != "/cm":
            return 404, {}, {}
        q = {k: v[0] for k, v in urllib.parse.parse_qs(url.query).items()}
        if self.password is not None and (q.get("user") != self.user or q.get("password") != self.password):
            return 401, {"WARNING": "Need user=<username>&password=<password>"}, {}
        cmnd = q.get("cmnd", "")
        if cmnd == "Status 0":
            return 200, {"Status": {"Module": 0, "DeviceName": "bench-plug", "FriendlyName": ["bench-plug"],
                                    "Topic": "tasmota_5A9AE8", "Power": 1}}, {}
        if cmnd == "Status 2":
            return 200, {"StatusFWR": {"Version": "13.2.0(tasmota)", "BuildDateTime": "2023-10-13T09:00:00"}}, {}
        if cmnd == "EnergyRes":
            return 200, {"EnergyRes": 3}, {}
        if cmnd == "Status 8":
            total_kwh = round(self.energy_j() / 3.6e6, 3)  # EnergyRes 3 (the default): 3 decimals of kWh
            return 200, {"StatusSNS": {"Time": time.strftime("%Y-%m-%dT%H:%M:%S"), "ENERGY": {
                "TotalStartTime": "2024-01-01T00:00:00", "Total": total_kwh, "Yesterday": 0.0, "Today": total_kwh,
                "Power": round(self.watts), "ApparentPower": round(self.watts / 0.95), "ReactivePower": 5,
                "Factor": 0.95, "Voltage": round(VOLTS), "Current": round(self.watts / VOLTS / 0.95, 3)}}}, {}
        return 200, {"Command": "Unknown"}, {}
