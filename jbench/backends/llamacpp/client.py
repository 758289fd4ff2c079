"""Streaming OpenAI-compatible client for llama-server: requests, per-request records, latency metrics.

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
import math
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence


from jbench.analysis.stats import percentile
from jbench.core.results import PhaseResult
from jbench.backends.base import BackendError
from jbench.backends.serving.http import EventStream, HTTPClient, RequestError


# A fixed English paragraph; its tokens are cycled to build prompts of any length.
BASE_TEXT = (
    "The history of computing is a story of measurement. Engineers who build small machines for robots, "
    "cameras and vehicles care about how quickly a model answers the first word of a question, how steadily "
    "the following words arrive, and how much energy each of them costs. A careful benchmark records the "
    "configuration, the software build, the exact model file and the raw output behind every number, so that "
    "a result can be reproduced months later on another board, under another power mode, by another person."
)


PERCENTILES = (50, 90, 99)


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

    def token_gaps(self) -> tuple[float, ...]:
        """Seconds between consecutive token-carrying chunks (llama-server streams one token per chunk)."""
        times = self.token_times_s
        return tuple(b - a for a, b in zip(times, times[1:]))

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


class StreamingClient(HTTPClient):
    """A client of llama-server's HTTP API on host:port (the server, or the local end of a tunnel)."""

    def __init__(self, host: str, port: int, timeout: float = 300.0):
        super().__init__((host, port), timeout)

    def request(self, method: str, path: str, body: Optional[dict] = None) -> tuple[int, bytes]:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        return self.exchange(method, path, data, headers)

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
    def completion_body(prompt: Sequence[int], n_gen: int, seed: Optional[int] = None) -> dict:
        body = {
            "prompt": list(prompt),
            "max_tokens": n_gen,
            "n_predict": n_gen,
            "temperature": 0,
            "ignore_eos": True,
            "cache_prompt": False,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if seed is not None:
            body["seed"] = seed
        return body

    def complete(self, prompt: Sequence[int], n_gen: int, *, index: int = 0, worker: int = 0,
                 seed: Optional[int] = None) -> RequestRecord:
        """One streamed /v1/completions request, timed from the send to the stream's end.

        Each request gets a fresh connection, opened and primed with GET /health before the clock starts
        (llama-server closes a connection after a streamed response; through an SSH tunnel the priming
        request also opens the channel), so TTFT holds neither TCP nor channel setup."""
        data = json.dumps(self.completion_body(prompt, n_gen, seed)).encode()
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
        stream = EventStream(resp, clock)
        for now, obj in stream:
            choices = obj.get("choices")
            if choices:
                choice = choices[0]
                if choice.get("text") or choice.get("finish_reason") is None:
                    token_times.append(now)
            if "usage" in obj or "timings" in obj:
                final = obj
        end = stream.end()
        return token_times, final, end


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
