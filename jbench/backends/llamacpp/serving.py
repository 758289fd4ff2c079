"""llama.cpp's serving scenario: llama-server on the device with `serving.slots` parallel slots, load at several levels.

One server for the whole trial (a served model is loaded once and takes whatever load comes): after it is ready and
the warm-up requests went through one at a time, each level runs its requests (closed loop: N in flight; open loop:
constant or Poisson arrivals) through jbench.backends.serving.loadgen, with `grid` levels or the SLO-capacity search
(jbench.analysis.serving.CapacitySearch) choosing the next. The levels themselves (warm-up, grid or search, windows
on the device's clock) are jbench.backends.serving.levels', shared with every serving backend. Requests: client.py's streamed
/v1/completions with an exact token-id prompt per request (every prompt different, `cache_prompt` false, a fixed
seed), so no request reuses another's KV cache and a cache hit never hides a TTFT.
"""

from __future__ import annotations

import logging
import math
import threading
import zlib
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from jbench.analysis.serving import Level
from jbench.backends.llamacpp.client import RequestRecord, StreamingClient, build_prompt
from jbench.backends.llamacpp.server import LlamaServer, build_of, prompt_source_and_props
from jbench.backends.serving import levels, workload
from jbench.backends.serving.http import ClientPool
from jbench.backends.serving.process import request_failures
from jbench.backends.serving.levels import context_size, server_slots, validate

__all__ = ["validate", "server_slots", "context_size", "draft_metrics", "run_serving", "ServingRun"]
from jbench.core.results import LoadWindow
from jbench.core.schema import ServingConfig
from jbench.device.connection import Connection
from jbench.device.telemetry.wall import ClockOffset






def draft_metrics(records: Sequence[RequestRecord]) -> dict[str, float]:
    """Speculative decoding over completed requests, from the counters llama-server puts in each stream's final
    `timings` (draft_n: tokens the draft proposed, draft_n_accepted: those the target kept): the acceptance rate
    sum(accepted) / sum(drafted) and drafted tokens per output token. Empty (absent, never 0) when no request
    reported the counters (no speculation configured, or a build without them); no acceptance when nothing was
    drafted (0 / 0)."""
    counted = [r for r in records if _count(r, "draft_n") is not None and _count(r, "draft_n_accepted") is not None]
    if not counted:
        return {}
    drafted = sum(_count(r, "draft_n") for r in counted)
    accepted = sum(_count(r, "draft_n_accepted") for r in counted)
    output = sum(r.output_tokens for r in counted)
    out: dict[str, float] = {}
    if drafted > 0:
        out["draft_acceptance"] = accepted / drafted
    if output > 0:
        out["draft_tokens_per_output_token"] = drafted / output
    return out


def _count(record: RequestRecord, key: str) -> Optional[float]:
    value = record.server_timings.get(key)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) and value >= 0 else None


@dataclass
class ServingRun:
    levels: list[Level]
    windows: list[LoadWindow]
    records_jsonl: str
    server_log: str
    argv: list[str]
    build: dict[str, str]
    overhead: list[dict[str, float]]  # the load generator's own cost per level
    level_records: list[list[RequestRecord]]  # each level's completed requests, as the client recorded them
    clock: Optional[ClockOffset]
    peak_rss_kib: Optional[int] = None  # llama-server's peak resident set, read before it was stopped


class _Sender:
    """Sends one RequestSpec as a streamed completion: an exact token-id prompt, unique per request (a session's
    turns share their first tokens), `max_tokens` with ignore_eos, a fixed seed."""

    def __init__(self, address: tuple[str, int], prefix: Sequence[int], body: Sequence[int], seed: int,
                 timeout_s: float):
        self.address, self.prefix, self.body, self.seed, self.timeout_s = address, prefix, body, seed, timeout_s
        self.variant = 0
        self._lock = threading.Lock()
        self._clients = ClientPool(lambda: StreamingClient(*self.address, timeout=self.timeout_s))

    def _variant(self, spec: workload.RequestSpec) -> int:
        if spec.session is not None:
            return zlib.crc32(spec.session.encode())  # the same first tokens for every turn of a session
        with self._lock:
            self.variant += 1
            return self.variant

    def __call__(self, spec: workload.RequestSpec, worker: int) -> RequestRecord:
        client = self._clients.get(worker)
        if spec.text is not None:
            prompt: Sequence = client.tokenize(spec.text, add_special=True)
        else:
            prompt = build_prompt(self.prefix, self.body, spec.prefix_tokens + spec.input_tokens,
                                  variant=self._variant(spec))
        return client.complete(prompt, spec.output_tokens, index=spec.index, worker=worker, seed=self.seed)

    def abort(self) -> None:
        self._clients.abort()

    def close(self) -> None:
        self._clients.close()




def run_serving(conn: Connection, argv_for_port: Callable[[int], list[str]], cfg: ServingConfig, *,
                ready_timeout_s: float, timeout_s: float, log: Optional[logging.Logger] = None,
                stop: Optional[threading.Event] = None) -> ServingRun:
    """Start llama-server, warm it up, run the levels (jbench.backends.serving.levels), always stop it."""
    log = log or logging.getLogger("jbench.serving")
    server = LlamaServer(conn, argv_for_port, ready_timeout_s=ready_timeout_s, log=log)
    sender: Optional[_Sender] = None
    try:
        with request_failures(server):
            server.start()
            prefix, body, props = prompt_source_and_props(server, timeout_s)
            sender = _Sender(server.address, prefix, body, cfg.seed, timeout_s)
            levels.warm_up(cfg, sender)
            run = levels.run_levels(conn, cfg, sender, sender.abort, log=log, stop=stop, server_log=server.log_text)
    finally:
        if sender is not None:
            sender.abort()
            sender.close()
        server.stop()
    return ServingRun(levels=run.levels, windows=run.windows, records_jsonl=run.records_jsonl,
                      server_log=server.log_text(), argv=list(server.argv or []), build=build_of(props),
                      overhead=run.overhead, clock=run.clock, level_records=run.level_records,
                      peak_rss_kib=server.peak_rss_kib)
