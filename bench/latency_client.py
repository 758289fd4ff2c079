"""The latency client's own overhead per streamed token (target: < 1 ms).

A stand-in streaming server on loopback answers POST /v1/completions with N server-sent-event chunks shaped
like llama-server's (same JSON fields and size, one HTTP chunk and one send() per token, final usage/timings
chunk, `data: [DONE]`) as fast as it can. Three figures per token:

- client:   jbench's StreamingClient.complete() (http.client + SSE parsing + per-token timestamps),
            wall time from the send to the stream's end / N;
- raw:      the same response read with a bare socket recv() loop, no HTTP or SSE parsing / N
            (what any client must pay for the bytes to arrive);
- overhead: client - raw, the per-token cost that jbench's client adds;
- parse:    StreamingClient.read_stream over the recorded response in memory (no socket at all) / N.

Both client and server run on this machine's cores, so "client" and "raw" include the server's own cost;
"overhead" and "parse" do not.

With --ssh, the client also reads the stream through jbench's SSH tunnel (TunnelForwarder: a loopback socket
forwarded over paramiko direct-tcpip channels) to an emulated Jetson (tests/emulated_jetson: a real sshd on
loopback), the path an SSH device's requests take: `ssh_tunnel_us_per_token_median`.

    .venv/bin/python bench/latency_client.py [--tokens 2000] [--reps 15] [--ssh] [--json FILE]
"""

from __future__ import annotations

import argparse
import io
import os
import json
import platform
import socket
import socketserver
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jbench.backends.llamacpp.client import StreamingClient  # noqa: E402
from jbench.device.tunnel import TunnelForwarder  # noqa: E402


def sse_chunks(n_tokens: int) -> list[bytes]:
    """The SSE events of one completion, shaped like llama-server's /v1/completions stream."""
    base = {"created": 1795244571, "model": "/root/.cache/jbench/models/gemma3_270m/Q4_0.gguf",
            "system_fingerprint": "b1-0c1e57098", "object": "text_completion",
            "id": "chatcmpl-XtqAATzr7sMFPfuXEOP0BXil7cDzXViI"}
    events = []
    for i in range(n_tokens):
        obj = {"choices": [{"text": f" tok{i % 97}", "index": 0, "logprobs": None, "finish_reason": None}], **base}
        events.append(f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode())
    final = {"choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}], **base,
             "usage": {"completion_tokens": n_tokens, "prompt_tokens": 8, "total_tokens": n_tokens + 8},
             "timings": {"prompt_n": 8, "prompt_ms": 1.0, "prompt_per_second": 8000.0, "predicted_n": n_tokens,
                         "predicted_ms": 1.0, "predicted_per_second": 1000.0}}
    events.append(f"data: {json.dumps(final, separators=(',', ':'))}\n\n".encode())
    events.append(b"data: [DONE]\n\n")
    return events


def http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class FakeStreamingServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, n_tokens: int):
        self.chunks = [http_chunk(e) for e in sse_chunks(n_tokens)] + [b"0\r\n\r\n"]
        super().__init__(("127.0.0.1", 0), _Handler)


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = b""
        while True:
            while b"\r\n\r\n" not in buf:
                data = sock.recv(65536)
                if not data:
                    return
                buf += data
            head, _, buf = buf.partition(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            while len(buf) < length:
                buf += sock.recv(65536)
            buf = buf[length:]
            if lines[0].startswith("GET /health"):
                body = b'{"status":"ok"}'
                sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(body), body))
                continue
            sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                         b"Connection: close\r\n\r\n")
            for chunk in self.server.chunks:  # one send() per token, as fast as possible
                sock.sendall(chunk)
            return


def raw_read(port: int, body: bytes) -> float:
    """Seconds from sending the request to the stream's terminator, reading with recv() only."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        req = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        t0 = time.perf_counter()
        s.sendall(req)
        tail = b""
        while True:
            data = s.recv(65536)
            if not data:
                break
            tail = (tail + data)[-16:]
            if tail.endswith(b"0\r\n\r\n"):
                break
        return time.perf_counter() - t0


class _Replay:
    def __init__(self, data: bytes):
        self._buf = io.BytesIO(data)

    def readline(self):
        return self._buf.readline()


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--ssh", action="store_true", help="also through the SSH tunnel to an emulated Jetson")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    n = args.tokens
    server = FakeStreamingServer(n)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    prompt = list(range(8))
    body = json.dumps(StreamingClient.completion_body(prompt, n)).encode()
    client = StreamingClient("127.0.0.1", port, timeout=60)
    for _ in range(2):  # warm both paths
        client.complete(prompt, n)
        raw_read(port, body)
    client_s, raw_s = [], []
    for _ in range(args.reps):  # interleaved, so background load hits both alike
        rec = client.complete(prompt, n)
        assert rec.output_tokens == n and rec.streamed_token_chunks == n
        client_s.append(rec.e2e_s)
        raw_s.append(raw_read(port, body))
    replay = b"".join(sse_chunks(n))
    parse_s = []
    for _ in range(args.reps):
        t = time.perf_counter()
        times, final, _ = StreamingClient.read_stream(_Replay(replay))
        parse_s.append(time.perf_counter() - t)
        assert len(times) == n and final["usage"]["completion_tokens"] == n
    tunnel_s: list[float] = []
    if args.ssh:
        from jbench.device.connect import connect
        from tests.emulated_jetson import EmulatedJetson

        with EmulatedJetson.start("orin_nano") as emu, connect(emu.device_config(name="bench")) as conn:
            fwd = TunnelForwarder(conn.transport(), port)
            try:
                tclient = StreamingClient("127.0.0.1", fwd.port, timeout=60)
                tclient.complete(prompt, n)
                for _ in range(args.reps):
                    tunnel_s.append(tclient.complete(prompt, n).e2e_s)
                tclient.close()
            finally:
                fwd.close()
    server.shutdown()
    client.close()

    def per_token_us(values: list[float]) -> float:
        return round(1e6 * statistics.median(values) / n, 2)

    figures = {
        "tokens_per_request": n,
        "repetitions": args.reps,
        "client_us_per_token_median": per_token_us(client_s),
        "raw_socket_us_per_token_median": per_token_us(raw_s),
        "client_overhead_us_per_token": round(per_token_us(client_s) - per_token_us(raw_s), 2),
        "parse_only_us_per_token_median": per_token_us(parse_s),
        "client_us_per_token_max": round(1e6 * max(client_s) / n, 2),
        **({"ssh_tunnel_us_per_token_median": per_token_us(tunnel_s)} if tunnel_s else {}),
        "target_us_per_token": 1000,
        "python": platform.python_version(),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
    }
    for key, value in figures.items():
        print(f"{key:34s} {value}")
    ok = figures["client_us_per_token_median"] < 1000
    print("PASS: client cost per token < 1 ms" if ok else "FAIL: client cost per token >= 1 ms")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
