"""What a serving level sends: request lengths, arrival times, recorded traces. Pure and seeded (the only I/O is
reading a trace file), so the same configuration and seed give the same requests on every controller.

Lengths are token counts; the sender turns them into prompts (the server's tokenizer makes them exact). Arrival
offsets are seconds from the level's start: a spec with one is sent open loop (at its time, whatever is in flight),
a spec without one closed loop (as soon as a worker is free)."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

KINDS = ("fixed", "uniform", "normal")
PROCESSES = ("constant", "poisson")


@dataclass(frozen=True)
class LengthDist:
    """A distribution of token counts.

    fixed: always `mean`; uniform: an integer in [low, high] (both required); normal: `mean` +- `std`, rounded
    and clipped to [low, high] (low defaults to 1, high to unbounded)."""

    kind: str = "fixed"
    mean: int = 128
    low: Optional[int] = None
    high: Optional[int] = None
    std: float = 0.0

    def validate(self, name: str) -> list[str]:
        """One clear message per problem, each naming the setting (`name` is its prefix, e.g. serving.input)."""
        problems: list[str] = []
        if self.kind not in KINDS:
            problems.append(f"{name}.kind must be one of {', '.join(KINDS)}, not {self.kind!r}")
        if not _is_int(self.mean) or self.mean < 1:
            problems.append(f"{name}.mean must be an integer >= 1, not {self.mean!r}")
        for field in ("low", "high"):
            value = getattr(self, field)
            if value is not None and (not _is_int(value) or value < 1):
                problems.append(f"{name}.{field} must be an integer >= 1, not {value!r}")
        if _is_int(self.low) and _is_int(self.high) and self.low > self.high:
            problems.append(f"{name}.low ({self.low}) must be <= {name}.high ({self.high})")
        if self.kind == "uniform":
            for field in ("low", "high"):
                if getattr(self, field) is None:
                    problems.append(f"{name}.{field} is required for a uniform distribution")
        if self.kind == "normal":
            if not isinstance(self.std, (int, float)) or isinstance(self.std, bool) or not math.isfinite(self.std) \
                    or self.std < 0:
                problems.append(f"{name}.std must be a finite number >= 0, not {self.std!r}")
        elif self.kind in KINDS and self.std not in (0, 0.0):
            problems.append(f"{name}.std applies to a normal distribution only ({name}.kind is {self.kind})")
        return problems

    def sample(self, rng: random.Random, n: int) -> list[int]:
        """n token counts drawn from rng (the caller validated the distribution)."""
        if self.kind == "fixed":
            return [self.mean] * n
        if self.kind == "uniform":
            return [rng.randint(self.low, self.high) for _ in range(n)]
        if self.kind == "normal":
            low = self.low if self.low is not None else 1
            high = self.high if self.high is not None else math.inf
            return [int(min(max(round(rng.gauss(self.mean, self.std)), low), high)) for _ in range(n)]
        raise ValueError(f"unknown length distribution {self.kind!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class RequestSpec:
    """One request of a level, before it is sent."""

    index: int
    input_tokens: int  # prompt length in tokens (the sender builds the prompt); 0 when `text` is given instead
    output_tokens: int  # max_tokens (sent with ignore_eos where the server supports it)
    arrival_s: Optional[float] = None  # offset from the level's start (open loop / trace); None: closed loop
    text: Optional[str] = None  # a trace's own prompt text, when it gives one instead of a length
    session: Optional[str] = None  # multi-turn session id (a trace's); turns of one session share a prefix
    prefix_tokens: int = 0  # tokens shared with the previous turn of the same session


def synthetic_requests(n: int, input: LengthDist, output: LengthDist, seed: int) -> list[RequestSpec]:
    """n closed-loop requests with lengths drawn from the two distributions.

    Input and output lengths come from separate streams derived from the seed, so changing one distribution
    leaves the other's draws as they were."""
    for dist, name in ((input, "input"), (output, "output")):
        problems = dist.validate(name)
        if problems:
            raise ValueError("; ".join(problems))
    ins = input.sample(random.Random(f"jbench-serving-input-{seed}"), n)
    outs = output.sample(random.Random(f"jbench-serving-output-{seed}"), n)
    return [RequestSpec(index=i, input_tokens=a, output_tokens=b) for i, (a, b) in enumerate(zip(ins, outs))]


def arrival_offsets(n: int, rate_rps: float, process: str, seed: int) -> list[float]:
    """n arrival offsets (s, from the level's start) at rate_rps on average; the first is at 0.

    constant: every 1/rate_rps s; poisson: exponential gaps of mean 1/rate_rps (a Poisson process), seeded."""
    if not (isinstance(rate_rps, (int, float)) and math.isfinite(rate_rps) and rate_rps > 0):
        raise ValueError(f"the request rate must be a number > 0, not {rate_rps!r}")
    if process == "constant":
        return [i / rate_rps for i in range(n)]
    if process == "poisson":
        rng = random.Random(f"jbench-serving-arrivals-{seed}")
        out, t = [], 0.0
        for i in range(n):
            if i:
                t += rng.expovariate(rate_rps)
            out.append(t)
        return out
    raise ValueError(f"the arrival process must be one of {', '.join(PROCESSES)}, not {process!r}")


def with_arrivals(specs: Sequence[RequestSpec], offsets: Sequence[float]) -> list[RequestSpec]:
    """The specs, each given the arrival offset of the same position (open loop)."""
    if len(specs) != len(offsets):
        raise ValueError(f"{len(specs)} requests but {len(offsets)} arrival offsets")
    return [dataclasses.replace(s, arrival_s=float(t)) for s, t in zip(specs, offsets)]


def load_trace(path: str | Path) -> list[RequestSpec]:
    """Requests from a JSONL trace, one request per line (blank lines ignored):

        {"arrival_s": 0.5 | "timestamp": <ms>, "input_tokens": 812 | "prompt": "...", "output_tokens": 64,
         "session": "conv-17"}

    `timestamp` (ms) is made relative to the first line's; `arrival_s` is taken as given (>= 0); a trace uses one of
    the two throughout. Turns of one session get prefix_tokens = the previous turn's input + output (a multi-turn
    conversation resends its history), at most the turn's own input. A turn given as prompt text carries its
    history in the text itself: prefix_tokens 0, and one session's turns are all text or all lengths.
    Raises ValueError("<file>:<line>: what is wrong") for bad JSON, missing fields, lengths < 1, mixed time keys
    and arrivals going backwards."""
    path = Path(path)
    specs: list[RequestSpec] = []
    time_key: Optional[str] = None
    first_ts: Optional[float] = None
    last_arrival = -math.inf
    sessions: dict[str, RequestSpec] = {}
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: a request must be a JSON object, not {type(obj).__name__}")

            keys = [k for k in ("arrival_s", "timestamp") if k in obj]
            if not keys:
                raise ValueError(f"{where}: missing \"arrival_s\" (seconds) or \"timestamp\" (ms)")
            if len(keys) == 2 or (time_key is not None and keys[0] != time_key):
                raise ValueError(f"{where}: mixes \"arrival_s\" and \"timestamp\"; a trace uses one of them")
            time_key = keys[0]
            raw = obj[time_key]
            if not _is_number(raw):
                raise ValueError(f"{where}: \"{time_key}\" must be a number, not {raw!r}")
            if time_key == "timestamp":
                first_ts = raw if first_ts is None else first_ts
                arrival = (raw - first_ts) / 1000.0
            else:
                if raw < 0:
                    raise ValueError(f"{where}: \"arrival_s\" must be >= 0, not {raw!r}")
                arrival = float(raw)
            if arrival < last_arrival:
                raise ValueError(f"{where}: arrivals go backwards ({_fmt_arrival(time_key, raw)} after "
                                 f"{last_arrival:g} s)")
            last_arrival = arrival

            text = obj.get("prompt")
            if "input_tokens" in obj:
                input_tokens = _length(obj["input_tokens"], "input_tokens", where)
            elif text is not None:
                input_tokens = 0
            else:
                raise ValueError(f"{where}: missing \"input_tokens\" or \"prompt\"")
            if text is not None and (not isinstance(text, str) or not text):
                raise ValueError(f"{where}: \"prompt\" must be a non-empty string")
            if "output_tokens" not in obj:
                raise ValueError(f"{where}: missing \"output_tokens\"")
            output_tokens = _length(obj["output_tokens"], "output_tokens", where)

            session = obj.get("session")
            if session is not None and not isinstance(session, (str, int)):
                raise ValueError(f"{where}: \"session\" must be a string, not {session!r}")
            session = None if session is None else str(session)
            prefix = 0
            if session is not None and session in sessions:
                prev = sessions[session]
                if (prev.text is None) != (text is None):
                    raise ValueError(f"{where}: session {session!r} mixes prompt text and input_tokens")
                if text is None:
                    prefix = min(prev.input_tokens + prev.output_tokens, input_tokens)
            spec = RequestSpec(index=len(specs), input_tokens=input_tokens, output_tokens=output_tokens,
                               arrival_s=arrival, text=text, session=session, prefix_tokens=prefix)
            if session is not None:
                sessions[session] = spec
            specs.append(spec)
    if not specs:
        raise ValueError(f"{path}: the trace holds no request")
    return specs


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _length(value: object, key: str, where: str) -> int:
    if not _is_int(value):
        raise ValueError(f"{where}: \"{key}\" must be an integer, not {value!r}")
    if value < 1:
        raise ValueError(f"{where}: \"{key}\" must be >= 1, not {value}")
    return value


def _fmt_arrival(key: str, raw: float) -> str:
    return f"timestamp {raw:g} ms" if key == "timestamp" else f"arrival_s {raw:g}"
