"""llama.cpp latency scenario: llama-server on the device, streaming completions from the controller.

The server runs on the device through the Connection (argument lists only):

1. a free port is picked ON THE DEVICE (a constant python3 snippet binds port 0 on 127.0.0.1 and prints it);
2. `llama-server` starts as a long-running process (Connection.stream_lines) behind a constant python3
   launcher that prints its pid and process group, then execs the server, so the pid is the server's;
   its log (stdout + stderr) is collected by a reader thread;
3. readiness: `GET /health` until 200 (llama-server answers 503 while it loads the model), bounded by
   `server_ready_timeout_s`; a server that exits first (bad flag, bind race, missing file) fails at once;
4. the server is ALWAYS stopped (`finally`): SIGTERM to its process group on the device, the stream closed
   (local: the process group is killed; SSH: the pty channel closes, which hangs the remote process up),
   then SIGKILL to the group if it is still alive after a grace period.

The controller reaches the port directly for a local device, and through the SSH connection's transport
(`direct-tcpip` channels behind a loopback listening socket, `TunnelForwarder`) for an SSH device; the server
itself listens on the device's 127.0.0.1 only.

Requests: `POST /v1/completions` (OpenAI-compatible) with `"stream": true`, a prompt given as a list of token
ids of exactly `n_prompt` tokens (built from the server's own `/tokenize`, so it is exact for the model's
tokenizer; each request's prompt is different and `cache_prompt` is false, so no request reuses another's
KV cache), `max_tokens` = `n_predict` = n_gen, temperature 0 and `ignore_eos` so that exactly n_gen tokens
come back. Definitions (controller clock, `time.perf_counter`):

- TTFT = arrival of the first streamed chunk that carries a generated token - the moment the request is sent;
- end-to-end (e2e) = arrival of the stream's end (`data: [DONE]`, or the last line) - the moment it is sent;
- output tokens = the server's final `usage.completion_tokens`, else its `timings.predicted_n`, else the number
  of streamed token chunks (the record says which: `tokens_source`);
- ITL = (e2e - TTFT) / (output tokens - 1);  output tok/s = output tokens / e2e.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import re
import select
import shlex
import socket
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence

from jbench.device.connection import CommandTimeout, Connection, DeviceError, LocalConnection
from jbench.trial import PhaseResult
from jbench.backends.base import BackendError

# Constant device-side snippets; values only ever travel as separate argv items.
FREE_PORT_SNIPPET = (
    "import socket\n"
    "s = socket.socket()\n"
    "s.bind(('127.0.0.1', 0))\n"
    "print(s.getsockname()[1])\n"
)
# Prints the pid (kept by exec) and the process group, then becomes the server.
LAUNCHER_SNIPPET = (
    "import os, sys\n"
    "print('@@jbench-server pid=%d pgid=%d' % (os.getpid(), os.getpgid(0)), flush=True)\n"
    "os.execvp(sys.argv[1], sys.argv[1:])\n"
)
_PID_LINE = re.compile(r"@@jbench-server pid=(\d+) pgid=(\d+)")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_BIND_FAILURE = re.compile(r"couldn't bind|could not bind|failed to bind|address already in use", re.I)
_MISSING = re.compile(r"FileNotFoundError|PermissionError|python3: (command )?not found")
_BUILD_INFO = re.compile(r"b(\d+)-([0-9a-fA-F]+)")

# A fixed English paragraph; its tokens are cycled to build prompts of any length.
BASE_TEXT = (
    "The history of computing is a story of measurement. Engineers who build small machines for robots, "
    "cameras and vehicles care about how quickly a model answers the first word of a question, how steadily "
    "the following words arrive, and how much energy each of them costs. A careful benchmark records the "
    "configuration, the software build, the exact model file and the raw output behind every number, so that "
    "a result can be reproduced months later on another board, under another power mode, by another person."
)

PERCENTILES = (50, 90, 99)


class RequestError(Exception):
    """A request the server refused or answered with something that is not a token stream."""

    def __init__(self, message: str, category: str = "unparseable_output"):
        super().__init__(message)
        self.category = category


# --------------------------------------------------------------------------------------------
# Pure functions


def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile (0..100) by linear interpolation between closest ranks (numpy's default, type 7)."""
    if not values:
        return math.nan
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def default_context(n_prompt: int, n_gen: int, depth: int, slots: int, multiple: int = 256) -> int:
    """llama-server -c: per slot n_prompt + n_gen + depth (+1 spare) rounded up to `multiple`, times the slots
    (with --parallel N and no unified KV cache llama-server gives each slot c / N)."""
    per_slot = n_prompt + n_gen + depth + 1
    per_slot = ((per_slot + multiple - 1) // multiple) * multiple
    return per_slot * max(1, slots)


def server_argv(server_bin: str, model_path: str, *, port: int, context: int, parallel: int, n_gpu_layers: int,
                cache_type_k: str, cache_type_v: str, flash_attn: Optional[str], threads: Optional[int] = None,
                n_batch: Optional[int] = None, n_ubatch: Optional[int] = None,
                extra_args: Sequence[str] = (), host: str = "127.0.0.1") -> list[str]:
    """llama-server's argument list. flash_attn: "on"/"off", or None to leave the build's default."""
    argv = [server_bin, "-m", model_path, "--host", host, "--port", str(port), "-c", str(context),
            "-ngl", str(n_gpu_layers), "-ctk", cache_type_k, "-ctv", cache_type_v, "--parallel", str(parallel)]
    if flash_attn is not None:
        argv += ["-fa", flash_attn]
    if threads is not None:
        argv += ["-t", str(threads)]
    if n_batch is not None:
        argv += ["-b", str(n_batch)]
    if n_ubatch is not None:
        argv += ["-ub", str(n_ubatch)]
    argv += [str(a) for a in extra_args]
    return argv


def build_prompt(prefix: Sequence[int], body: Sequence[int], n_tokens: int, variant: int) -> list[int]:
    """Exactly n_tokens token ids: the tokenizer's special prefix (BOS) then the body tokens cycled from a
    per-request offset, so that every request's prompt differs (no prompt-cache reuse across requests)."""
    if n_tokens <= len(prefix):
        return list(prefix[:n_tokens])
    if not body:
        raise ValueError("no body tokens to build a prompt from")
    start = variant % len(body)
    out = list(prefix)
    i = start
    while len(out) < n_tokens:
        out.append(body[i % len(body)])
        i += 1
    return out


@dataclass
class RequestRecord:
    """One streamed completion, as measured by the client. Times in seconds, relative to the send moment."""

    index: int
    worker: int
    sent_at: float  # time.perf_counter() when the request was sent (controller clock)
    ttft_s: float
    e2e_s: float
    token_times_s: list[float]  # arrival of each streamed chunk carrying a token, relative to sent_at
    output_tokens: int
    tokens_source: str  # "usage" | "timings" | "streamed"
    streamed_token_chunks: int
    prompt_tokens: Optional[int] = None  # as reported by the server
    cached_tokens: Optional[int] = None  # prompt tokens the server took from its cache (should be 0)
    server_timings: dict = field(default_factory=dict)

    @property
    def ttft_ms(self) -> float:
        return self.ttft_s * 1000.0

    @property
    def e2e_ms(self) -> float:
        return self.e2e_s * 1000.0

    @property
    def itl_ms(self) -> float:
        """(e2e - TTFT) / (output tokens - 1); NaN with fewer than two output tokens."""
        if self.output_tokens < 2:
            return math.nan
        return (self.e2e_s - self.ttft_s) * 1000.0 / (self.output_tokens - 1)

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.e2e_s if self.e2e_s > 0 else math.nan

    def to_json(self) -> str:
        d = asdict(self)
        d.update(ttft_ms=self.ttft_ms, e2e_ms=self.e2e_ms, itl_ms=self.itl_ms, output_tps=self.output_tps)
        return json.dumps(d, sort_keys=True)


def _stats(prefix: str, values: list[float]) -> dict[str, float]:
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return {}
    out = {f"{prefix}_p{q}": percentile(vals, q) for q in PERCENTILES}
    out[f"{prefix}_mean"] = sum(vals) / len(vals)
    return out


def latency_metrics(records: Sequence[RequestRecord], concurrency: int, wall_s: Optional[float] = None) -> dict[str, float]:
    """The latency metrics of docs/metrics.md ("Latency scenario") over the measured requests."""
    m: dict[str, float] = {}
    m.update(_stats("ttft_ms", [r.ttft_ms for r in records]))
    m.update(_stats("itl_ms", [r.itl_ms for r in records]))
    m.update(_stats("e2e_ms", [r.e2e_ms for r in records]))
    m.update(_stats("output_tps", [r.output_tps for r in records]))
    m["latency_requests"] = float(len(records))
    m["latency_concurrency"] = float(concurrency)
    if records:
        m["latency_output_tokens_mean"] = sum(r.output_tokens for r in records) / len(records)
    if wall_s and wall_s > 0 and records:
        m["latency_wall_s"] = wall_s
        m["latency_throughput_tps"] = sum(r.output_tokens for r in records) / wall_s
    prefill = [float(r.server_timings["prompt_per_second"]) for r in records
               if _finite(r.server_timings.get("prompt_per_second"))]
    decode = [float(r.server_timings["predicted_per_second"]) for r in records
              if _finite(r.server_timings.get("predicted_per_second"))]
    if prefill:
        m["server_prefill_tps"] = sum(prefill) / len(prefill)
    if decode:
        m["server_decode_tps"] = sum(decode) / len(decode)
    return m


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def latency_phases(records: Sequence[RequestRecord], n_prompt: int) -> dict[str, PhaseResult]:
    """Map requests onto the shared phase metrics (one request = one repetition).

    prefill: n_tokens = n_prompt, sample = TTFT, so prefill rate = n_prompt / TTFT (a proxy: TTFT also holds
    request handling, the first decode step and the network path).
    decode: n_tokens = n_gen - 1 (tokens after the first), sample = ITL * n_tokens, so the decode rate of a
    request is exactly 1000 / ITL_ms. No device-clock windows (end_time None): no energy windows."""
    if not records:
        return {}
    n_after_first = max(1, round(sum(r.output_tokens for r in records) / len(records)) - 1)
    prefill = PhaseResult("prefill", n_tokens=n_prompt, samples_ns=[max(1, round(r.ttft_s * 1e9)) for r in records])
    decode_samples = [max(1, round(r.itl_ms * 1e6 * n_after_first)) for r in records if not math.isnan(r.itl_ms)]
    phases = {"prefill": prefill}
    if decode_samples:
        phases["decode"] = PhaseResult("decode", n_tokens=n_after_first, samples_ns=decode_samples)
    return phases


# --------------------------------------------------------------------------------------------
# HTTP client (stdlib http.client)


class StreamingClient:
    """A client of llama-server's HTTP API on host:port (the server, or the local end of a tunnel)."""

    def __init__(self, host: str, port: int, timeout: float = 300.0):
        self.host, self.port, self.timeout = host, port, timeout
        self.conn = http.client.HTTPConnection(host, port, timeout=timeout)

    def close(self) -> None:
        self.conn.close()

    def abort(self) -> None:
        """Break a blocked read from another thread."""
        sock = self.conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _connect(self) -> None:
        if self.conn.sock is None:
            self.conn.connect()
            self.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def request(self, method: str, path: str, body: Optional[dict] = None) -> tuple[int, bytes]:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        try:
            self._connect()
            self.conn.request(method, path, body=data, headers=headers)
            resp = self.conn.getresponse()
            payload = resp.read()
        except (OSError, http.client.HTTPException):
            self.conn.close()
            raise
        if resp.will_close:
            self.conn.close()
        return resp.status, payload

    def health(self) -> tuple[int, str]:
        status, payload = self.request("GET", "/health")
        return status, payload.decode(errors="replace")

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        status, payload = self.request("POST", "/tokenize", {"content": text, "add_special": add_special})
        if status != 200:
            raise RequestError(f"/tokenize answered HTTP {status}: {payload[:300]!r}")
        tokens = json.loads(payload).get("tokens")
        if not isinstance(tokens, list):
            raise RequestError(f"/tokenize answered without a token list: {payload[:300]!r}")
        # Newer builds may answer {"id":..,"piece":..} objects when asked for pieces; we never ask.
        return [int(t["id"]) if isinstance(t, dict) else int(t) for t in tokens]

    def props(self) -> dict:
        try:
            status, payload = self.request("GET", "/props")
            return json.loads(payload) if status == 200 else {}
        except (OSError, http.client.HTTPException, ValueError):
            return {}

    @staticmethod
    def completion_body(prompt: Sequence[int], n_gen: int) -> dict:
        return {
            "prompt": list(prompt),
            "max_tokens": n_gen,
            "n_predict": n_gen,
            "temperature": 0,
            "ignore_eos": True,
            "cache_prompt": False,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    def complete(self, prompt: Sequence[int], n_gen: int, *, index: int = 0, worker: int = 0) -> RequestRecord:
        """One streamed /v1/completions request, timed from the send to the stream's end.

        Each request gets a fresh connection, opened and primed with GET /health before the clock starts
        (llama-server closes a connection after a streamed response; through an SSH tunnel the priming
        request also opens the channel), so TTFT holds neither TCP nor channel setup."""
        data = json.dumps(self.completion_body(prompt, n_gen)).encode()
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        clock = time.perf_counter
        self.conn.close()
        self.health()
        try:
            self._connect()
            sent_at = clock()
            self.conn.request("POST", "/v1/completions", body=data, headers=headers)
            resp = self.conn.getresponse()
            if resp.status != 200:
                body = resp.read()
                raise RequestError(f"/v1/completions answered HTTP {resp.status}: {body[:500]!r}",
                                   "backend_crash" if resp.status >= 500 else "unparseable_output")
            token_times, final, end = self.read_stream(resp, clock)
            resp.read()  # the chunked terminator, so the connection can be reused
            if resp.will_close:
                self.conn.close()
        except (OSError, http.client.HTTPException):
            self.conn.close()
            raise
        if not token_times:
            raise RequestError(f"request {index}: the stream carried no token")
        usage = final.get("usage") or {}
        timings = final.get("timings") or {}
        if isinstance(usage.get("completion_tokens"), int):
            n_out, source = usage["completion_tokens"], "usage"
        elif isinstance(timings.get("predicted_n"), int):
            n_out, source = timings["predicted_n"], "timings"
        else:
            n_out, source = len(token_times), "streamed"
        prompt_tokens = usage.get("prompt_tokens", timings.get("prompt_n"))
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", timings.get("cache_n"))
        return RequestRecord(
            index=index, worker=worker, sent_at=sent_at, ttft_s=token_times[0] - sent_at, e2e_s=end - sent_at,
            token_times_s=[t - sent_at for t in token_times], output_tokens=int(n_out), tokens_source=source,
            streamed_token_chunks=len(token_times),
            prompt_tokens=int(prompt_tokens) if isinstance(prompt_tokens, int) else None,
            cached_tokens=int(cached) if isinstance(cached, int) else None,
            server_timings={k: v for k, v in timings.items() if isinstance(v, (int, float))},
        )

    @staticmethod
    def read_stream(resp, clock: Callable[[], float] = time.perf_counter) -> tuple[list[float], dict, float]:
        """(arrival time of each chunk carrying a token, the last chunk with usage/timings, end time).

        A chunk carries a token when its choice has text or is not the final one (finish_reason null): a
        token that renders as empty text still counts, the final bookkeeping chunk does not."""
        token_times: list[float] = []
        final: dict = {}
        end = None
        readline = resp.readline
        while True:
            line = readline()
            if not line:
                break
            now = clock()
            end = now
            if not line.startswith(b"data:"):
                if line.startswith(b"error:"):
                    raise RequestError(f"server error in the stream: {line[:500]!r}", "backend_crash")
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            try:
                obj = json.loads(payload)
            except ValueError:
                raise RequestError(f"unparseable stream chunk: {payload[:300]!r}") from None
            if "error" in obj:
                raise RequestError(f"server error in the stream: {str(obj['error'])[:500]}", "backend_crash")
            choices = obj.get("choices")
            if choices:
                choice = choices[0]
                if choice.get("text") or choice.get("finish_reason") is None:
                    token_times.append(now)
            if "usage" in obj or "timings" in obj:
                final = obj
        if end is None:
            raise RequestError("empty response stream", "backend_crash")
        return token_times, final, end


# --------------------------------------------------------------------------------------------
# SSH tunnel


class TunnelForwarder:
    """A loopback listening socket on the controller; each connection is forwarded over a `direct-tcpip`
    channel of the SSH transport to remote_host:remote_port as the device sees it."""

    def __init__(self, transport, remote_port: int, remote_host: str = "127.0.0.1", open_timeout: float = 10.0):
        self.transport = transport
        self.remote = (remote_host, remote_port)
        self.open_timeout = open_timeout
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self._closed = threading.Event()
        self._pairs: set = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name="jbench-tunnel", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), name="jbench-tunnel-conn", daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        client.settimeout(None)
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            chan = self.transport.open_channel("direct-tcpip", self.remote, client.getpeername(),
                                               timeout=self.open_timeout)
        except Exception:  # server not listening yet, transport gone: the client sees a closed connection
            client.close()
            return
        pair = (client, chan)
        with self._lock:
            if self._closed.is_set():
                client.close()
                chan.close()
                return
            self._pairs.add(pair)
        try:
            while not self._closed.is_set():
                r, _, _ = select.select([client, chan], [], [], 0.5)
                if client in r:
                    data = client.recv(65536)
                    if not data:
                        break
                    chan.sendall(data)
                if chan in r:
                    data = chan.recv(65536)
                    if not data:
                        break
                    client.sendall(data)
        except (OSError, EOFError):
            pass
        finally:
            with self._lock:
                self._pairs.discard(pair)
            _quiet_close(chan)
            _quiet_close(client)

    def close(self) -> None:
        self._closed.set()
        _quiet_close(self._sock)
        with self._lock:
            pairs = list(self._pairs)
        for client, chan in pairs:
            _quiet_close(chan)
            try:
                client.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            _quiet_close(client)
        self._thread.join(timeout=2)


def _quiet_close(obj) -> None:
    try:
        obj.close()
    except Exception:  # closing something already dead is not an error worth reporting
        pass


# --------------------------------------------------------------------------------------------
# Server lifecycle


def pick_free_port(conn: Connection) -> int:
    """A port that was free on the device's loopback a moment ago (bound to 0 and released)."""
    try:
        res = conn.run(["python3", "-c", FREE_PORT_SNIPPET], timeout=30)
    except CommandTimeout as exc:
        raise BackendError("timeout", f"picking a free port on device '{conn.name}': {exc}") from None
    if res.returncode != 0 or not res.stdout.strip().isdigit():
        raise BackendError("backend_crash", f"could not pick a free port on device '{conn.name}' with python3 "
                           f"(exit {res.returncode}): {res.stderr.strip()[-300:]}", res.stdout, res.stderr)
    return int(res.stdout.strip())


class LlamaServer:
    """llama-server on the device, from start to a guaranteed stop. Use as a context manager, or call
    start() and stop() (stop() is idempotent and safe after a failed start)."""

    STOP_GRACE_S = 10.0
    BIND_ATTEMPTS = 3

    def __init__(self, conn: Connection, argv_for_port: Callable[[int], list[str]], *, ready_timeout_s: float,
                 log: Optional[logging.Logger] = None, max_log_lines: int = 5000):
        self.conn = conn
        self.argv_for_port = argv_for_port
        self.ready_timeout_s = ready_timeout_s
        self.log = log or logging.getLogger("jbench.latency")
        self.argv: Optional[list[str]] = None
        self.port: Optional[int] = None  # on the device
        self.pid: Optional[int] = None  # on the device
        self.pgid: Optional[int] = None
        self.address: Optional[tuple[str, int]] = None  # where the controller connects
        self._lines: deque[str] = deque(maxlen=max_log_lines)
        self._dropped = 0
        self._stream = None
        self._reader: Optional[threading.Thread] = None
        self._exited = threading.Event()
        self._pid_seen = threading.Event()
        self._forwarder: Optional[TunnelForwarder] = None
        self._stopped = False

    # -- log -------------------------------------------------------------------------------------

    def log_text(self) -> str:
        head = f"[jbench] {self._dropped} earlier server log lines dropped\n" if self._dropped else ""
        return head + "\n".join(self._lines) + ("\n" if self._lines else "")

    def _read(self, stream) -> None:
        try:
            for line in stream:
                line = _ANSI.sub("", line)
                if not self._pid_seen.is_set():
                    m = _PID_LINE.search(line)
                    if m:
                        self.pid, self.pgid = int(m.group(1)), int(m.group(2))
                        self._pid_seen.set()
                        continue
                if len(self._lines) == self._lines.maxlen:
                    self._dropped += 1
                self._lines.append(line)
        except Exception as exc:  # the stream broke (connection lost): the server counts as gone for us
            self._lines.append(f"[jbench] server log stream ended: {exc}")
        finally:
            self._exited.set()
            self._pid_seen.set()

    # -- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> "LlamaServer":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        for attempt in range(1, self.BIND_ATTEMPTS + 1):
            self._launch(pick_free_port(self.conn))
            try:
                self._wait_ready()
                return
            except _ServerExited:
                log = self.log_text()
                if attempt < self.BIND_ATTEMPTS and _BIND_FAILURE.search(log):
                    self.log.warning("llama-server could not bind port %s (taken since it was picked); retrying",
                                     self.port)
                    self._stop_process()
                    self._reset()
                    continue
                category = "missing_binary" if _MISSING.search(log) else "backend_crash"
                if _looks_oom(log):
                    category = "out_of_memory"
                raise BackendError(category, "llama-server exited before it was ready: " + _tail(log, 5),
                                   raw_output=log) from None

    def _reset(self) -> None:
        self._lines.clear()
        self._dropped = 0
        self._exited = threading.Event()
        self._pid_seen = threading.Event()
        self.pid = self.pgid = None
        self._stream = self._reader = None

    def _launch(self, port: int) -> None:
        self.port = port
        self.argv = self.argv_for_port(port)
        self.log.info("starting on device '%s': %s", self.conn.name, shlex.join(self.argv))
        try:
            self._stream = self.conn.stream_lines(["python3", "-c", LAUNCHER_SNIPPET, *self.argv])
        except OSError as exc:
            raise BackendError("missing_binary", f"cannot start python3 on device '{self.conn.name}': {exc}") from None
        self._reader = threading.Thread(target=self._read, args=(self._stream,), name="jbench-server-log", daemon=True)
        self._reader.start()
        self._pid_seen.wait(timeout=30)
        if self.pid is not None:
            self.log.info("llama-server pid %d (process group %d), port %d on the device", self.pid, self.pgid, port)
        if isinstance(self.conn, LocalConnection):
            self.address = ("127.0.0.1", port)
        elif hasattr(self.conn, "transport"):
            if self._forwarder is None or self._forwarder.remote[1] != port:
                if self._forwarder is not None:
                    self._forwarder.close()
                self._forwarder = TunnelForwarder(self.conn.transport(), port)
            self.address = ("127.0.0.1", self._forwarder.port)
        else:
            raise BackendError("device", f"device '{self.conn.name}': no way to reach a port on it "
                               f"({type(self.conn).__name__} has no SSH transport)")

    def _wait_ready(self) -> None:
        # Through a tunnel, every poll before the server listens is a refused direct-tcpip channel, which
        # paramiko logs at ERROR level: expected here, so those records are dropped while we wait.
        quiet = _RefusedChannelFilter() if self._forwarder is not None else None
        if quiet is not None:
            logging.getLogger("paramiko.transport").addFilter(quiet)
        try:
            self._poll_health()
        finally:
            if quiet is not None:
                logging.getLogger("paramiko.transport").removeFilter(quiet)

    def _poll_health(self) -> None:
        assert self.address is not None
        deadline = time.monotonic() + self.ready_timeout_s
        started = time.monotonic()
        last = "no answer yet"
        while True:
            if self._exited.is_set():
                raise _ServerExited()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BackendError(
                    "timeout",
                    f"llama-server did not become ready within {self.ready_timeout_s:g} s (last /health: {last}); "
                    "server log attached", raw_output=self.log_text())
            client = StreamingClient(*self.address, timeout=max(0.5, min(5.0, remaining)))
            try:
                status, body = client.health()
                if status == 200:
                    self.log.info("llama-server ready after %.2f s", time.monotonic() - started)
                    return
                last = f"HTTP {status} {body.strip()[:200]}"
            except (OSError, http.client.HTTPException) as exc:
                last = f"{type(exc).__name__}: {exc}"
            finally:
                client.close()
            self._exited.wait(min(0.1, max(0.0, deadline - time.monotonic())))

    def alive(self) -> bool:
        """Whether the server process still exists on the device (kill -0)."""
        if self.pid is None:
            return not self._exited.is_set()
        try:
            return self.conn.run(["kill", "-0", str(self.pid)], timeout=15).returncode == 0
        except DeviceError:
            return False

    def _signal(self, sig: str) -> None:
        targets = []
        if self.pgid is not None and self.pgid > 1:
            targets.append(f"-{self.pgid}")
        if self.pid is not None and self.pid > 1:
            targets.append(str(self.pid))
        if not targets:
            return
        try:
            self.conn.run(["kill", f"-{sig}", "--", *targets], timeout=15)
        except DeviceError as exc:
            self.log.warning("kill -%s on device '%s' failed: %s", sig, self.conn.name, exc)

    def _stop_process(self) -> None:
        stream, reader = self._stream, self._reader
        if stream is None:
            return
        try:
            if not self._exited.is_set():
                self._signal("TERM")
                self._exited.wait(self.STOP_GRACE_S)
        finally:
            try:
                stream.close()
            finally:
                if self.pid is not None and self.alive():
                    end = time.monotonic() + self.STOP_GRACE_S
                    while time.monotonic() < end and self.alive():
                        time.sleep(0.1)
                    if self.alive():
                        self.log.warning("llama-server pid %d survived SIGTERM; sending SIGKILL", self.pid)
                        self._signal("KILL")
                if reader is not None:
                    reader.join(timeout=5)

    def stop(self) -> None:
        """Stop the server and the tunnel; safe to call more than once and after a failed start."""
        if self._stopped:
            return
        self._stopped = True
        try:
            if self._forwarder is not None:
                self._forwarder.close()
        finally:
            self._stop_process()
            self.log.info("llama-server stopped")

    # -- queries ---------------------------------------------------------------------------------

    def client(self, timeout: float = 300.0) -> StreamingClient:
        assert self.address is not None, "server not started"
        return StreamingClient(*self.address, timeout=timeout)


class _ServerExited(Exception):
    pass


class _RefusedChannelFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not ("open FAILED" in msg and "Connection refused" in msg)


def _looks_oom(text: str) -> bool:
    text = text.lower()
    return any(s in text for s in ("out of memory", "failed to allocate", "cudamalloc failed", "bad_alloc"))


def _tail(text: str, n: int) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-n:])


# --------------------------------------------------------------------------------------------
# The scenario


@dataclass
class LatencyRun:
    records: list[RequestRecord]
    warmup_records: list[RequestRecord]
    wall_s: float
    server_log: str
    argv: list[str]
    build: dict[str, str]
    prompt_tokens: int

    def records_jsonl(self) -> str:
        lines = [json.dumps({"kind": "warmup", **json.loads(r.to_json())}, sort_keys=True) for r in self.warmup_records]
        lines += [json.dumps({"kind": "measured", **json.loads(r.to_json())}, sort_keys=True) for r in self.records]
        return "\n".join(lines) + "\n"


def prompt_tokens_source(client: StreamingClient) -> tuple[list[int], list[int]]:
    """(special prefix, body tokens) from the server's own tokenizer."""
    with_special = client.tokenize(BASE_TEXT, add_special=True)
    plain = client.tokenize(BASE_TEXT, add_special=False)
    prefix: list[int] = []
    if len(with_special) > len(plain) and with_special[len(with_special) - len(plain):] == plain:
        prefix = with_special[: len(with_special) - len(plain)]
    return prefix, plain


def run_requests(address: tuple[str, int], prompts: Sequence[Sequence[int]], n_gen: int, concurrency: int, *,
                 timeout_s: float, first_index: int = 0) -> tuple[list[RequestRecord], float]:
    """Send the prompts with `concurrency` requests in flight (one thread per worker, all released together;
    see StreamingClient.complete for the connection handling). (records, wall seconds from the first send
    to the last stream end)."""
    n = len(prompts)
    concurrency = max(1, min(concurrency, n)) if n else 1
    results: list[Optional[RequestRecord]] = [None] * n
    errors: list[BaseException] = []
    counter = iter(range(n))
    lock = threading.Lock()
    stop = threading.Event()
    barrier = threading.Barrier(concurrency)
    clients = [StreamingClient(*address, timeout=timeout_s) for _ in range(concurrency)]

    def worker(w: int) -> None:
        client = clients[w]
        try:
            barrier.wait(timeout=timeout_s)
            while not stop.is_set():
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                results[i] = client.complete(prompts[i], n_gen, index=first_index + i, worker=w)
        except BaseException as exc:  # reported to the main thread, which raises it
            if not stop.is_set():
                errors.append(exc)
            stop.set()
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(w,), name=f"jbench-latency-{w}", daemon=True)
               for w in range(concurrency)]
    deadline = time.monotonic() + timeout_s
    try:
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                if errors:
                    break
                if time.monotonic() > deadline:
                    raise BackendError("timeout", f"{n} latency requests did not finish within {timeout_s:g} s")
                t.join(timeout=0.1)
            if errors:
                break
    finally:
        stop.set()
        if errors or any(t.is_alive() for t in threads):
            for c in clients:
                c.abort()
        for t in threads:
            t.join(timeout=5)
        for c in clients:
            c.close()
    if errors:
        raise errors[0]
    done = [r for r in results if r is not None]
    if len(done) != n:
        raise BackendError("backend_crash", f"only {len(done)} of {n} latency requests completed")
    wall = (max(r.sent_at + r.e2e_s for r in done) - min(r.sent_at for r in done)) if done else 0.0
    return done, wall


def run_latency_scenario(conn: Connection, argv_for_port: Callable[[int], list[str]], *, n_prompt: int, n_gen: int,
                         requests: int, concurrency: int, warmup_requests: int, ready_timeout_s: float,
                         timeout_s: float, log: Optional[logging.Logger] = None) -> LatencyRun:
    """Start llama-server, run warmup (sequential, not measured) and measured requests, always stop it."""
    log = log or logging.getLogger("jbench.latency")
    server = LlamaServer(conn, argv_for_port, ready_timeout_s=ready_timeout_s, log=log)
    try:
        server.start()
        client = server.client(timeout=timeout_s)
        try:
            prefix, body = prompt_tokens_source(client)
            props = client.props()
        finally:
            client.close()
        total = warmup_requests + requests
        prompts = [build_prompt(prefix, body, n_prompt, variant=i) for i in range(total)]
        warm: list[RequestRecord] = []
        if warmup_requests:
            warm, _ = run_requests(server.address, prompts[:warmup_requests], n_gen, 1, timeout_s=timeout_s)
            log.info("warmup: %d request(s), TTFT %s ms", len(warm), ", ".join(f"{r.ttft_ms:.1f}" for r in warm))
        records, wall = run_requests(server.address, prompts[warmup_requests:], n_gen, concurrency,
                                     timeout_s=timeout_s, first_index=warmup_requests)
    except (RequestError, OSError, http.client.HTTPException) as exc:
        server.stop()
        category = "timeout" if isinstance(exc, socket.timeout) else getattr(exc, "category", "backend_crash")
        raise BackendError(category, f"latency requests failed: {type(exc).__name__}: {exc}",
                           raw_output=server.log_text()) from None
    except BackendError as exc:
        server.stop()
        if not exc.raw_output:
            exc.raw_output = server.log_text()
        raise
    finally:
        server.stop()
    for r in records:
        if r.output_tokens != n_gen:
            log.warning("request %d returned %d tokens instead of %d (ITL uses the actual count)", r.index,
                        r.output_tokens, n_gen)
        if r.output_tokens < 2:
            raise BackendError("unparseable_output", f"request {r.index} returned {r.output_tokens} token(s): "
                               "ITL is undefined", raw_output=server.log_text())
        if r.prompt_tokens is not None and r.prompt_tokens != n_prompt:
            log.warning("request %d: the server reports %d prompt tokens, jbench sent %d", r.index, r.prompt_tokens,
                        n_prompt)
        if r.cached_tokens:
            log.warning("request %d: the server reused %d cached prompt tokens", r.index, r.cached_tokens)
    build = {}
    m = _BUILD_INFO.search(str(props.get("build_info", "")))
    if m:
        build = {"build_number": m.group(1), "build_commit": m.group(2)}
    return LatencyRun(records=records, warmup_records=warm, wall_s=wall, server_log=server.log_text(),
                      argv=list(server.argv or []), build=build, prompt_tokens=n_prompt)
