"""The in-house kernel engine's log and GEMV trace: weight bytes per decoded token, and what is wrong.

Input is the text an engine run printed (pure functions: nothing here reads files or runs commands).
Three kinds of lines are understood, anywhere in the text and in any order; everything else (other log
lines, blank lines, leading timestamps) is ignored and counted:

Plain log (regexes configurable through LogPatterns; named groups `tokens`, `ms`, `mode`, `mhz`):

    [engine] Prefill: 18 tokens in 110400 ms (0.2 tok/s)
    [engine] Decode: 16 tokens in 100064 ms (0.2 tok/s)
    Power: 0W mode, GPU @ 0 MHz

  Rates are computed from tokens and ms (18 / 110.4 s = 0.163 tok/s), never from the printed, rounded figure.

GEMV trace (one line per GEMV launch; type = ggml type id or name, M = output rows, K = input columns;
extra key=value fields are ignored):

    [GEMV #0] type=12 M=2560 K=2560

JSON lines (detected per line: a line whose text from its first `{` to its end is a JSON object with an
`event` key; leading timestamps allowed):

    {"event": "prefill", "tokens": 18, "ms": 110400.0, "power_w": 6.1, "gpu_mhz": 0}
    {"event": "decode",  "tokens": 16, "ms": 100064.0, "power_w": 6.0, "gpu_mhz": 0}
    {"event": "gemv", "type": 12, "M": 2560, "K": 2560, "index": 0}
    {"event": "power", "mode": "MAXN", "gpu_mhz": 1020}

  prefill/decode: `tokens` (int) and `ms` (number) required; `power_w` (mean board power in W) and
  `gpu_mhz` optional. gemv: `type`, `M`, `K` required, `index` optional (`i` accepted too). power:
  `mode` and/or `gpu_mhz`. Unknown events and malformed JSON are ignored like any other line.

One decoded token's GEMVs are a block that repeats token after token (see split_tokens). Summing
M x K x bytes_per_weight(type) over one block gives the weight bytes that token reads (exact, from the
gguf package's block sizes through analysis.roofline). KV-cache reads are not GEMVs and are not in
the trace, so the ceiling here is a weights-only upper bound.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional, Sequence, Union

from jbench.core.results import Finding
from jbench.analysis.roofline import RooflineError, decode_ceiling, ggml_type, tensor_bytes

SEVERITY_INFO = "info"
SEVERITY_WARNING = "warning"
SEVERITY_ERROR = "error"

# Per-kernel launch cost on Orin is about 5-10 us (domain notes); the midpoint prices a token's launches.
LAUNCH_OVERHEAD_US = 7.5


class TraceError(ValueError):
    """A trace or log that cannot be analysed; the message says what is missing and what to pass."""


# --------------------------------------------------------------------------------------------
# Parsed records


@dataclass(frozen=True)
class Gemv:
    """One GEMV launch. index is the `#i` of the trace (None when the line had none)."""

    type_id: int
    M: int
    K: int
    index: Optional[int] = None
    lineno: int = 0

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.type_id, self.M, self.K)

    @property
    def type_name(self) -> str:
        return ggml_type(self.type_id).name

    @property
    def weight_bytes(self) -> int:
        return gemv_bytes(self)


@dataclass(frozen=True)
class PhaseLine:
    """One Prefill or Decode line (plain log or JSON event)."""

    phase: str  # "prefill" | "decode"
    tokens: int
    ms: float
    power_w: Optional[float] = None
    gpu_mhz: Optional[float] = None
    lineno: int = 0

    @property
    def tps(self) -> Optional[float]:
        return self.tokens * 1000.0 / self.ms if self.ms > 0 else None


@dataclass(frozen=True)
class PowerLine:
    """`Power: <mode> mode, GPU @ <mhz> MHz` (or a JSON power event / gpu_mhz of a phase event)."""

    mode: Optional[str]
    gpu_mhz: Optional[float]
    lineno: int = 0


@dataclass
class ParsedTrace:
    gemvs: list[Gemv] = field(default_factory=list)
    prefill: list[PhaseLine] = field(default_factory=list)
    decode: list[PhaseLine] = field(default_factory=list)
    power: list[PowerLine] = field(default_factory=list)
    ignored_lines: int = 0  # non-blank lines that matched nothing
    warnings: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# Parsing

_FLOAT = r"\d+(?:\.\d*)?(?:[eE][+-]?\d+)?"


@dataclass(frozen=True)
class LogPatterns:
    """Regexes for the plain log (re.search, so timestamps and prefixes are fine).

    prefill/decode need named groups `tokens` and `ms`; power needs `mode` and/or `mhz`; gemv needs
    `fields` (the key=value text) and may have `index`.
    """

    prefill: str = rf"Prefill:\s*(?P<tokens>\d+)\s+tokens?\s+in\s+(?P<ms>{_FLOAT})\s*ms"
    decode: str = rf"Decode:\s*(?P<tokens>\d+)\s+tokens?\s+in\s+(?P<ms>{_FLOAT})\s*ms"
    power: str = rf"Power:\s*(?P<mode>[^,]*?)\s*mode\s*,\s*GPU\s*@\s*(?P<mhz>{_FLOAT})\s*MHz"
    gemv: str = r"\[GEMV(?:\s*#\s*(?P<index>\d+))?\s*\](?P<fields>.*)"

    def compiled(self) -> dict[str, re.Pattern[str]]:
        need = {"prefill": {"tokens", "ms"}, "decode": {"tokens", "ms"}, "gemv": {"fields"}}
        out: dict[str, re.Pattern[str]] = {}
        for f in fields(self):
            try:
                rx = re.compile(getattr(self, f.name))
            except re.error as exc:
                raise TraceError(f"LogPatterns.{f.name} is not a valid regex: {exc}") from None
            missing = need.get(f.name, set()) - set(rx.groupindex)
            if f.name == "power" and not ({"mode", "mhz"} & set(rx.groupindex)):
                missing = {"mode or mhz"}
            if missing:
                raise TraceError(f"LogPatterns.{f.name} lacks named group(s) {', '.join(sorted(missing))}")
            out[f.name] = rx
        return out


_KV_RE = re.compile(r"([A-Za-z_][\w]*)\s*=\s*([^\s,;]+)")


def _ggml_id(value: Any) -> int:
    """A ggml type id from an id or a name ("12", 12, "Q4_K")."""
    try:
        return int(ggml_type(value.strip() if isinstance(value, str) else value))
    except RooflineError as exc:
        raise TraceError(str(exc)) from None


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise TraceError(f"{what} must be an integer, got {value!r}")
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise TraceError(f"{what} must be an integer, got {value!r}") from None
    if isinstance(value, float) and value != n:
        raise TraceError(f"{what} must be an integer, got {value!r}")
    return n


def _float(value: Any, what: str) -> float:
    if isinstance(value, bool) or value is None:
        raise TraceError(f"{what} must be a number, got {value!r}")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise TraceError(f"{what} must be a number, got {value!r}") from None
    if not math.isfinite(x):
        raise TraceError(f"{what} must be finite, got {value!r}")
    return x


def _opt_float(d: Mapping[str, Any], key: str) -> Optional[float]:
    return None if d.get(key) is None else _float(d[key], key)


def _make_gemv(type_value: Any, m: Any, k: Any, index: Any, lineno: int) -> Gemv:
    g = Gemv(
        type_id=_ggml_id(type_value),
        M=_int(m, "M"),
        K=_int(k, "K"),
        index=None if index is None else _int(index, "index"),
        lineno=lineno,
    )
    if g.M <= 0 or g.K <= 0:
        raise TraceError(f"M and K must be positive, got M={g.M} K={g.K}")
    return g


def _parse_json_event(obj: Mapping[str, Any], lineno: int, out: ParsedTrace) -> bool:
    event = str(obj.get("event", "")).lower()
    if event in ("prefill", "decode"):
        rec = PhaseLine(
            phase=event,
            tokens=_int(obj.get("tokens"), "tokens"),
            ms=_float(obj.get("ms"), "ms"),
            power_w=_opt_float(obj, "power_w"),
            gpu_mhz=_opt_float(obj, "gpu_mhz"),
            lineno=lineno,
        )
        (out.prefill if event == "prefill" else out.decode).append(rec)
        if rec.gpu_mhz is not None or obj.get("mode") is not None:
            out.power.append(PowerLine(mode=_opt_str(obj.get("mode")), gpu_mhz=rec.gpu_mhz, lineno=lineno))
        return True
    if event == "gemv":
        for key in ("type", "M", "K"):
            if key not in obj:
                raise TraceError(f"gemv event lacks '{key}'")
        index = obj.get("index", obj.get("i"))
        out.gemvs.append(_make_gemv(obj["type"], obj["M"], obj["K"], index, lineno))
        return True
    if event == "power":
        out.power.append(PowerLine(mode=_opt_str(obj.get("mode")), gpu_mhz=_opt_float(obj, "gpu_mhz"), lineno=lineno))
        return True
    return False


def _opt_str(value: Any) -> Optional[str]:
    return None if value is None else str(value)


def json_event(line: str) -> Optional[dict]:
    """The engine's JSON-lines event on this line (an object with an `event` key, optionally after a
    prefix such as a timestamp), else None."""
    start = line.find("{")
    if start < 0 or not line.rstrip().endswith("}"):
        return None
    try:
        obj = json.loads(line[start:])
    except ValueError:
        return None
    return obj if isinstance(obj, dict) and "event" in obj else None


def parse_trace(text: str, patterns: Optional[LogPatterns] = None) -> ParsedTrace:
    """Every GEMV, Prefill/Decode and Power record in `text` (plain log and JSON lines, mixed freely).

    A line that matches nothing is counted in ignored_lines. A line that looks like a record but has a
    bad field (an unknown ggml type, M=abc) is ignored too, with a warning naming its line number.
    """
    rx = (patterns or LogPatterns()).compiled()
    out = ParsedTrace()
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        try:
            if _parse_line(line, lineno, rx, out):
                continue
        except TraceError as exc:
            out.warnings.append(f"line {lineno}: {exc}; line ignored")
        out.ignored_lines += 1
    return out


def _parse_line(line: str, lineno: int, rx: Mapping[str, re.Pattern[str]], out: ParsedTrace) -> bool:
    obj = json_event(line)
    if obj is not None:
        return _parse_json_event(obj, lineno, out)
    m = rx["gemv"].search(line)
    if m:
        kv = {k.lower(): v for k, v in _KV_RE.findall(m.group("fields"))}
        missing = [k for k in ("type", "m", "k") if k not in kv]
        if missing:
            raise TraceError(f"GEMV line lacks {', '.join(x if x == 'type' else x.upper() for x in missing)}")
        index = m.groupdict().get("index")
        out.gemvs.append(_make_gemv(kv["type"], kv["m"], kv["k"], index, lineno))
        return True
    for phase in ("prefill", "decode"):
        m = rx[phase].search(line)
        if m:
            rec = PhaseLine(phase=phase, tokens=_int(m.group("tokens"), "tokens"), ms=_float(m.group("ms"), "ms"),
                            lineno=lineno)
            (out.prefill if phase == "prefill" else out.decode).append(rec)
            return True
    m = rx["power"].search(line)
    if m:
        groups = m.groupdict()
        mode = groups.get("mode")
        mhz = groups.get("mhz")
        out.power.append(PowerLine(mode=mode.strip() if mode is not None else None,
                                   gpu_mhz=None if mhz is None else _float(mhz, "GPU MHz"), lineno=lineno))
        return True
    return False


# --------------------------------------------------------------------------------------------
# Splitting the GEMV sequence into decoded tokens

SPLIT_INDEX_RESET = "index-reset"
SPLIT_TOKEN_COUNT = "token-count"
SPLIT_PERIOD = "period"


def _split_at_resets(gemvs: Sequence[Gemv]) -> list[list[Gemv]]:
    blocks: list[list[Gemv]] = [[]]
    prev: Optional[int] = None
    for g in gemvs:
        # A launch index that does not grow (#0 after #252) starts the next token.
        if g.index is not None and prev is not None and g.index <= prev and blocks[-1]:
            blocks.append([])
        blocks[-1].append(g)
        if g.index is not None:
            prev = g.index
    return blocks


def _smallest_period(shapes: Sequence[tuple[int, int, int]]) -> int:
    n = len(shapes)
    for p in range(1, n + 1):
        if n % p == 0 and all(shapes[i] == shapes[i % p] for i in range(p, n)):
            return p
    return n


def split_tokens_with_method(
    gemvs: Sequence[Gemv], n_tokens: Optional[int] = None
) -> tuple[list[list[Gemv]], str]:
    """split_tokens, also naming the method used (SPLIT_INDEX_RESET, SPLIT_TOKEN_COUNT, SPLIT_PERIOD)."""
    gemvs = list(gemvs)
    if not gemvs:
        raise TraceError("no GEMV lines to split into tokens")
    blocks = _split_at_resets(gemvs)
    if len(blocks) > 1:
        return blocks, SPLIT_INDEX_RESET
    shapes = [g.shape for g in gemvs]
    n = len(gemvs)
    if n_tokens is not None:
        if n_tokens <= 0:
            raise TraceError(f"n_tokens must be >= 1, got {n_tokens}")
        if n % n_tokens:
            raise TraceError(
                f"cannot split {n} GEMVs into {n_tokens} decoded tokens: {n} is not a multiple of {n_tokens} "
                f"(was the trace cut short, or does it include prefill GEMVs?)"
            )
        per = n // n_tokens
        first = shapes[:per]
        bad = next((t for t in range(1, n_tokens) if shapes[t * per:(t + 1) * per] != first), None)
        if bad is not None:
            raise TraceError(
                f"cannot split {n} GEMVs into {n_tokens} decoded tokens: token {bad} "
                f"(GEMVs {bad * per}..{(bad + 1) * per - 1}) differs from token 0"
            )
        return [gemvs[t * per:(t + 1) * per] for t in range(n_tokens)], SPLIT_TOKEN_COUNT
    p = _smallest_period(shapes)
    if p == n:
        raise TraceError(
            f"cannot tell where one decoded token's GEMVs end: the {n} GEMVs have no '#0' index resets and "
            f"do not repeat as one block; pass the number of decoded tokens in the trace (n_tokens)"
        )
    return [gemvs[i:i + p] for i in range(0, n, p)], SPLIT_PERIOD


def split_tokens(gemvs: Sequence[Gemv], n_tokens: Optional[int] = None) -> list[list[Gemv]]:
    """The GEMV sequence cut into one block per decoded token.

    1. Index resets: when the trace's `#i` numbering restarts (an index not greater than the one before),
       each restart begins a token. Blocks are returned as they are, even if they differ (a cut-off last
       token); token_profile chooses among them.
    2. Else, with n_tokens: n_tokens equal blocks; TraceError unless the length divides and all blocks have
       the same (type, M, K) sequence.
    3. Else period detection: the smallest p such that the sequence is its first p shapes repeated.
       Within one token the layers repeat too, so a trace without an LM head (or any per-token GEMV
       outside the layers) and without index resets would be cut per layer: pass n_tokens then.

    Raises TraceError when there are no GEMVs, or with neither resets nor n_tokens the sequence does not
    repeat (one token, or a trace that changes from token to token): the message says to pass n_tokens.
    """
    return split_tokens_with_method(gemvs, n_tokens)[0]


# --------------------------------------------------------------------------------------------
# Per-token figures


def gemv_bytes(g: Gemv) -> int:
    """Weight bytes one GEMV reads: the M x K matrix at its ggml type (whole blocks, from gguf)."""
    try:
        return tensor_bytes(g.type_id, g.M * g.K)
    except RooflineError as exc:
        raise TraceError(f"GEMV at line {g.lineno} (type={g.type_id} M={g.M} K={g.K}): {exc}") from None


@dataclass(frozen=True)
class TypeBreakdown:
    type_name: str
    type_id: int
    launches: int
    weight_bytes: int


@dataclass(frozen=True)
class TokenProfile:
    """One decoded token's GEMVs.

    n_blocks: token blocks found in the trace; n_consistent: how many have the profile's exact shape
    sequence (the most common one); the rest (a cut-off last token, a different first token) are left out.
    """

    launches: int
    weight_bytes: int
    by_type: tuple[TypeBreakdown, ...]
    shapes: tuple[tuple[int, int, int], ...]
    n_blocks: int
    n_consistent: int
    split_method: str


def token_profile(blocks: Sequence[Sequence[Gemv]], split_method: str = "") -> TokenProfile:
    """Launches, weight bytes and the by-type breakdown of one token, from the most common block."""
    if not blocks or not any(blocks):
        raise TraceError("no token blocks to profile")
    sigs = [tuple(g.shape for g in b) for b in blocks]
    counts = Counter(sigs)
    # Most common shape sequence; ties go to the longer one (a cut-off token is a shorter prefix).
    best_sig = max(counts, key=lambda s: (counts[s], len(s)))
    block = blocks[sigs.index(best_sig)]
    per_type: dict[int, list[int]] = {}
    total = 0
    for g in block:
        b = gemv_bytes(g)
        total += b
        entry = per_type.setdefault(g.type_id, [0, 0])
        entry[0] += 1
        entry[1] += b
    by_type = tuple(
        TypeBreakdown(type_name=ggml_type(t).name, type_id=t, launches=v[0], weight_bytes=v[1])
        for t, v in sorted(per_type.items(), key=lambda kv: -kv[1][1])
    )
    return TokenProfile(
        launches=len(block), weight_bytes=total, by_type=by_type, shapes=best_sig,
        n_blocks=len(blocks), n_consistent=counts[best_sig], split_method=split_method,
    )


@dataclass(frozen=True)
class LayerPattern:
    """The repeating layer block inside one token: GEMVs [start, start + period*count) are `count` layers."""

    start: int
    period: int
    count: int

    @property
    def end(self) -> int:
        return self.start + self.period * self.count


def detect_layers(shapes: Sequence[tuple[int, int, int]]) -> Optional[LayerPattern]:
    """The block that repeats most (largest coverage, then shortest period) in one token's shapes.

    None when nothing repeats at least twice (a one-layer model). The start may be offset by GEMVs before
    the first layer (up to two periods), and the LM head or anything after the layers is left outside.
    """
    s_list = list(shapes)
    n = len(s_list)
    best: Optional[LayerPattern] = None
    for p in range(1, n // 2 + 1):
        for s in range(0, min(2 * p, n - 2 * p) + 1):
            block = s_list[s:s + p]
            r = 1
            while s_list[s + r * p:s + (r + 1) * p] == block:
                r += 1
            if r < 2:
                continue
            cover = r * p
            if best is None or cover > best.period * best.count:
                best = LayerPattern(start=s, period=p, count=r)
    return best


# --------------------------------------------------------------------------------------------
# Findings


@dataclass(frozen=True)
class TraceHints:
    """Optional model dimensions that make the fusion checks exact; any may be None (then inferred)."""

    d_model: Optional[int] = None
    kv_dim: Optional[int] = None  # n_head_kv * head_dim
    q_dim: Optional[int] = None  # n_head * head_dim
    n_ff: Optional[int] = None

    @classmethod
    def from_any(cls, hints: Union[None, "TraceHints", Mapping[str, Any]]) -> "TraceHints":
        if hints is None:
            return cls()
        if isinstance(hints, TraceHints):
            return hints
        aliases = {
            "d_model": "d_model", "n_embd": "d_model", "d": "d_model",
            "kv_dim": "kv_dim", "n_head_kv*head_dim": "kv_dim",
            "q_dim": "q_dim", "n_head*head_dim": "q_dim",
            "n_ff": "n_ff", "ff": "n_ff",
        }
        values: dict[str, int] = {}
        for key, value in hints.items():
            if key not in aliases:
                raise TraceError(f"unknown hint '{key}'; known: {', '.join(sorted(aliases))}")
            if value is not None:
                n = _int(value, f"hint {key}")
                if n <= 0:
                    raise TraceError(f"hint {key} must be positive, got {value!r}")
                values[aliases[key]] = n
        return cls(**values)


@dataclass(frozen=True)
class AnalysisOptions:
    """Thresholds of the findings.

    prefill_decode_ratio: prefill_per_token when prefill tok/s < ratio x decode tok/s (batched prefill is
      normally far faster per token than decode).
    far_below_fraction: far_below_ceiling when decode tok/s < this fraction of the bandwidth ceiling
      (the roofline module's MEMORY_BOUND_FRACTION, 0.3).
    launch_overhead_us: assumed cost of one kernel launch (Orin: ~5-10 us).
    many_launches: GEMV launches per token from which launch overhead is named as the suspect.
    """

    prefill_decode_ratio: float = 2.0
    far_below_fraction: float = 0.30
    launch_overhead_us: float = LAUNCH_OVERHEAD_US
    many_launches: int = 100


def _model_dim(shapes: Sequence[tuple[int, int, int]], hints: TraceHints) -> Optional[int]:
    if hints.d_model:
        return hints.d_model
    if not shapes:
        return None
    # Q, K, V, gate, up and the LM head all read the residual stream: K = d_model is the most common K.
    return Counter(k for _, _, k in shapes).most_common(1)[0][0]


def _qkv_matches(shapes: Sequence[tuple[int, int, int]], hints: TraceHints) -> list[int]:
    """Start indices of unfused Q, K, V triples (greedy, non-overlapping)."""
    d = _model_dim(shapes, hints)
    out: list[int] = []
    i = 0
    while i + 2 < len(shapes):
        (_, mq, kq), (_, mk, kk), (_, mv, kv) = shapes[i], shapes[i + 1], shapes[i + 2]
        ok = (
            kq == kk == kv == d
            and mk == mv
            and mk <= mq
            and mq % mk == 0  # n_head is a multiple of n_head_kv: q_dim = group x kv_dim
            and (hints.kv_dim is None or mk == hints.kv_dim)
            and (hints.q_dim is None or mq == hints.q_dim)
        )
        if ok:
            out.append(i)
            i += 3
        else:
            i += 1
    return out


def _gate_up_matches(shapes: Sequence[tuple[int, int, int]], hints: TraceHints, taken: set[int]) -> list[int]:
    """Start indices of unfused gate/up pairs: same (M, K) twice with K = d_model, M = n_ff, then down."""
    d = _model_dim(shapes, hints)
    out: list[int] = []
    i = 0
    while i + 1 < len(shapes):
        (_, ma, ka), (_, mb, kb) = shapes[i], shapes[i + 1]
        ok = i not in taken and i + 1 not in taken and ma == mb and ka == kb == d
        if ok:
            if hints.n_ff is not None:
                ok = ma == hints.n_ff
            else:
                nxt = shapes[i + 2] if i + 2 < len(shapes) else None
                # The down projection reads the n_ff activations: its K is the pair's M.
                ok = ma != ka and (nxt[2] == ma if nxt is not None else ma > ka)
        if ok:
            out.append(i)
            i += 2
        else:
            i += 1
    return out


def _per_layer(matches: list[int], layers: Optional[LayerPattern]) -> Optional[int]:
    if layers is None:
        return None
    return sum(1 for i in matches if layers.start <= i < layers.start + layers.period)


def fusion_findings(profile: TokenProfile, hints: Union[None, TraceHints, Mapping[str, Any]] = None) -> list[Finding]:
    """qkv_not_fused and gate_up_not_fused from one token's GEMV shapes."""
    h = TraceHints.from_any(hints)
    shapes = profile.shapes
    layers = detect_layers(shapes)
    n_layers = layers.count if layers else None
    findings: list[Finding] = []
    qkv = _qkv_matches(shapes, h)
    if qkv:
        _, mq, d = shapes[qkv[0]]
        mkv = shapes[qkv[0] + 1][1]
        findings.append(Finding(
            code="qkv_not_fused",
            severity=SEVERITY_WARNING,
            message=(
                f"Q, K and V are three GEMVs (M={mq}, {mkv}, {mkv}; K={d}) {len(qkv)} times per token"
                + (f" ({_per_layer(qkv, layers)} per layer, {n_layers} layers)" if layers else "")
                + f" instead of one GEMV of M={mq + 2 * mkv}: {2 * len(qkv)} extra launches per token; fuse QKV"
            ),
            evidence={
                "groups_per_token": len(qkv),
                "layers": n_layers,
                "per_layer": _per_layer(qkv, layers),
                "d_model": d,
                "q_dim": mq,
                "kv_dim": mkv,
                "shapes": [[mq, d], [mkv, d], [mkv, d]],
                "fused_M": mq + 2 * mkv,
                "extra_launches_per_token": 2 * len(qkv),
                "first_gemv_in_token": qkv[0],
            },
        ))
    taken = {j for i in qkv for j in (i, i + 1, i + 2)}
    gu = _gate_up_matches(shapes, h, taken)
    if gu:
        _, ff, d = shapes[gu[0]]
        findings.append(Finding(
            code="gate_up_not_fused",
            severity=SEVERITY_WARNING,
            message=(
                f"FFN gate and up are two GEMVs (M={ff}, K={d}) {len(gu)} times per token"
                + (f" ({_per_layer(gu, layers)} per layer, {n_layers} layers)" if layers else "")
                + f" instead of one GEMV of M={2 * ff}: {len(gu)} extra launches per token; fuse gate/up"
            ),
            evidence={
                "pairs_per_token": len(gu),
                "layers": n_layers,
                "per_layer": _per_layer(gu, layers),
                "d_model": d,
                "n_ff": ff,
                "shapes": [[ff, d], [ff, d]],
                "fused_M": 2 * ff,
                "extra_launches_per_token": len(gu),
                "first_gemv_in_token": gu[0],
            },
        ))
    return findings


_PARKED_MODE = re.compile(r"^(0+(\.0+)?\s*W|.*park.*)$", re.IGNORECASE)


def power_findings(power: Sequence[PowerLine]) -> list[Finding]:
    """gpu_clock_zero: a power line with GPU @ 0 MHz, or a 0W / parked power mode."""
    for p in power:
        zero_clock = p.gpu_mhz is not None and p.gpu_mhz == 0
        parked_mode = p.mode is not None and bool(_PARKED_MODE.match(p.mode.strip()))
        if zero_clock or parked_mode:
            what = " and ".join(
                x for x in (f"GPU @ {p.gpu_mhz:g} MHz" if zero_clock else "",
                            f"power mode {p.mode}" if parked_mode else "") if x
            )
            return [Finding(
                code="gpu_clock_zero",
                severity=SEVERITY_ERROR,
                message=(
                    f"the engine reports {what}: the GPU clock is parked (DVFS) or a minimal power mode is set, "
                    f"so tok/s can be ~100x below the ceiling; set the max nvpmodel mode and run jetson_clocks"
                ),
                evidence={"mode": p.mode, "gpu_mhz": p.gpu_mhz, "line": p.lineno},
            )]
    return []


def prefill_findings(prefill_tps: Optional[float], decode_tps: Optional[float], options: AnalysisOptions,
                     prefill_tokens: Optional[int] = None) -> list[Finding]:
    """prefill_per_token: prefill tok/s < prefill_decode_ratio x decode tok/s."""
    if not prefill_tps or not decode_tps:
        return []
    if prefill_tokens is not None and prefill_tokens < 2:
        return []  # one prompt token is a GEMV anyway; nothing to batch
    ratio = prefill_tps / decode_tps
    if ratio >= options.prefill_decode_ratio:
        return []
    return [Finding(
        code="prefill_per_token",
        severity=SEVERITY_WARNING,
        message=(
            f"prefill runs at {prefill_tps:.3g} tok/s, only {ratio:.2f}x decode ({decode_tps:.3g} tok/s; "
            f"threshold {options.prefill_decode_ratio:g}x): prefill looks like one GEMV pass per prompt token "
            f"instead of a batched GEMM; batch the prompt"
        ),
        evidence={"prefill_tps": prefill_tps, "decode_tps": decode_tps, "ratio": ratio,
                  "threshold_ratio": options.prefill_decode_ratio, "prefill_tokens": prefill_tokens},
    )]


def ceiling_findings(decode_tps: Optional[float], ceiling_tps: Optional[float], launches: Optional[int],
                     options: AnalysisOptions) -> list[Finding]:
    """far_below_ceiling: decode tok/s < far_below_fraction x ceiling.

    Evidence prices the launches (launches x launch_overhead_us) against the gap between measured and
    ceiling time per token; the message names launch overhead when launches >= many_launches and the
    launches explain at least a tenth of the gap, else says they cannot explain it.
    """
    if not decode_tps or not ceiling_tps:
        return []
    fraction = decode_tps / ceiling_tps
    if fraction >= options.far_below_fraction:
        return []
    measured_ms = 1000.0 / decode_tps
    ceiling_ms = 1000.0 / ceiling_tps
    gap_ms = measured_ms - ceiling_ms
    evidence: dict[str, Any] = {
        "decode_tps": decode_tps, "ceiling_tps": ceiling_tps, "fraction_of_ceiling": fraction,
        "threshold_fraction": options.far_below_fraction,
        "measured_ms_per_token": measured_ms, "ceiling_ms_per_token": ceiling_ms,
        "launches_per_token": launches, "launch_overhead_us": options.launch_overhead_us,
    }
    msg = (f"decode at {decode_tps:.3g} tok/s is {100 * fraction:.1f}% of the {ceiling_tps:.3g} tok/s "
           f"weight-bandwidth ceiling (< {100 * options.far_below_fraction:g}%)")
    if launches:
        launch_ms = launches * options.launch_overhead_us / 1000.0
        share = launch_ms / gap_ms if gap_ms > 0 else None
        evidence.update(launch_time_per_token_ms=launch_ms, launch_share_of_gap=share)
        many = launches >= options.many_launches
        evidence["many_launches"] = many
        if many and share is not None and share >= 0.1:
            msg += (f"; {launches} GEMV launches per token x ~5-10 us each (Orin) is ~{launch_ms:.2f} ms of the "
                    f"{gap_ms:.2f} ms gap: launch overhead is the usual suspect (fuse QKV and gate/up, CUDA graphs)")
        else:
            msg += (f"; {launches} GEMV launches per token x ~{options.launch_overhead_us:g} us is only "
                    f"~{launch_ms:.2f} ms of the {gap_ms:.2f} ms gap, so launch overhead does not explain it: "
                    f"check GPU clocks / power mode (jetson_clocks), a CPU fallback build, memory placement")
    return [Finding(code="far_below_ceiling", severity=SEVERITY_WARNING, message=msg, evidence=evidence)]


# --------------------------------------------------------------------------------------------
# The report


@dataclass(frozen=True)
class PhaseStats:
    """A phase summed over its lines (several runs: total tokens / total time)."""

    tokens: int
    ms: float
    lines: int
    tps: Optional[float]
    power_w: Optional[float] = None


def _phase_stats(lines: Sequence[PhaseLine]) -> Optional[PhaseStats]:
    if not lines:
        return None
    tokens = sum(x.tokens for x in lines)
    ms = sum(x.ms for x in lines)
    powers = [x.power_w for x in lines if x.power_w is not None]
    return PhaseStats(tokens=tokens, ms=ms, lines=len(lines), tps=tokens * 1000.0 / ms if ms > 0 else None,
                      power_w=sum(powers) / len(powers) if powers else None)


@dataclass(frozen=True)
class TraceReport:
    """Everything analyze_trace_text found. Rates in tok/s, bandwidths in B/s, bytes per decoded token.

    decode_tps / prefill_tps: the caller's figure when given, else the log's (tokens x 1000 / ms).
    implied_bandwidth_bytes_per_s = weight bytes per token x decode_tps (weights only).
    ceiling_tps = bandwidth_bytes_per_s / weight bytes per token (weights only: an upper bound).
    """

    token: Optional[TokenProfile]
    layers: Optional[LayerPattern]
    prefill: Optional[PhaseStats]
    decode: Optional[PhaseStats]
    power: Optional[PowerLine]
    decode_tps: Optional[float]
    prefill_tps: Optional[float]
    bandwidth_bytes_per_s: Optional[float]
    implied_bandwidth_bytes_per_s: Optional[float]
    ceiling_tps: Optional[float]
    fraction_of_ceiling: Optional[float]
    findings: tuple[Finding, ...]
    warnings: tuple[str, ...]
    n_gemv_lines: int
    ignored_lines: int

    @property
    def codes(self) -> list[str]:
        return [f.code for f in self.findings]

    def to_dict(self) -> dict[str, Any]:
        return report_to_dict(self)

    def summary(self) -> str:
        return format_summary(self)


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def report_to_dict(report: TraceReport) -> dict[str, Any]:
    """A plain, JSON-serialisable dict of the report."""
    tok = report.token
    out: dict[str, Any] = {
        "token": None if tok is None else {
            "launches": tok.launches,
            "weight_bytes": tok.weight_bytes,
            "by_type": {b.type_name: {"type_id": b.type_id, "launches": b.launches, "weight_bytes": b.weight_bytes}
                        for b in tok.by_type},
            "n_blocks": tok.n_blocks,
            "n_consistent": tok.n_consistent,
            "split_method": tok.split_method,
        },
        "layers": None if report.layers is None else {
            "start": report.layers.start, "gemvs_per_layer": report.layers.period, "count": report.layers.count},
        "prefill": None if report.prefill is None else vars(report.prefill).copy(),
        "decode": None if report.decode is None else vars(report.decode).copy(),
        "power": None if report.power is None else {"mode": report.power.mode, "gpu_mhz": report.power.gpu_mhz},
        "decode_tps": report.decode_tps,
        "prefill_tps": report.prefill_tps,
        "bandwidth_bytes_per_s": report.bandwidth_bytes_per_s,
        "implied_bandwidth_bytes_per_s": report.implied_bandwidth_bytes_per_s,
        "ceiling_tps": report.ceiling_tps,
        "fraction_of_ceiling": report.fraction_of_ceiling,
        "findings": [f.as_dict()
                     for f in report.findings],
        "warnings": list(report.warnings),
        "n_gemv_lines": report.n_gemv_lines,
        "ignored_lines": report.ignored_lines,
    }
    return _jsonable(out)


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def format_summary(report: TraceReport) -> str:
    """A few lines for a terminal."""
    lines: list[str] = []
    tok = report.token
    if tok is not None:
        types = ", ".join(f"{b.type_name} {_bytes(b.weight_bytes)} x{b.launches}" for b in tok.by_type)
        layer = (f", {report.layers.count} layers x {report.layers.period} GEMVs" if report.layers else "")
        lines.append(f"GEMV trace: {tok.n_blocks} token(s) ({tok.split_method}), {tok.launches} GEMVs/token{layer}, "
                     f"{_bytes(tok.weight_bytes)} weights/token ({types})")
    for name, ph in (("Prefill", report.prefill), ("Decode", report.decode)):
        if ph is not None:
            rate = f"{ph.tps:.3g} tok/s" if ph.tps is not None else "rate n/a"
            lines.append(f"{name}: {ph.tokens} tokens in {ph.ms:g} ms = {rate}")
    if report.implied_bandwidth_bytes_per_s is not None:
        lines.append(f"Implied weight bandwidth at {report.decode_tps:.3g} tok/s: "
                     f"{_bytes(report.implied_bandwidth_bytes_per_s)}/s")
    if report.ceiling_tps is not None:
        frac = (f" (measured {100 * report.fraction_of_ceiling:.1f}%)" if report.fraction_of_ceiling is not None
                else "")
        lines.append(f"Ceiling at {_bytes(report.bandwidth_bytes_per_s or 0)}/s: {report.ceiling_tps:.3g} tok/s{frac}")
    if report.power is not None:
        mhz = "?" if report.power.gpu_mhz is None else f"{report.power.gpu_mhz:g}"
        lines.append(f"Power: {report.power.mode or '?'} mode, GPU @ {mhz} MHz")
    if report.findings:
        lines.append("Findings:")
        lines.extend(f"  [{f.severity}] {f.code}: {f.message}" for f in report.findings)
    else:
        lines.append("Findings: none")
    lines.extend(f"warning: {w}" for w in report.warnings)
    return "\n".join(lines)


def analyze_trace_text(
    text: str,
    *,
    bandwidth_bytes_per_s: Optional[float] = None,
    decode_tps: Optional[float] = None,
    prefill_tps: Optional[float] = None,
    n_decode_tokens: Optional[int] = None,
    hints: Union[None, TraceHints, Mapping[str, Any]] = None,
    options: Optional[AnalysisOptions] = None,
    patterns: Optional[LogPatterns] = None,
) -> TraceReport:
    """Parse an engine's output and analyse it (the `jbench trace analyze FILE` entry point).

    Token split: split_tokens(gemvs, n_decode_tokens); its TraceError propagates (a trace that cannot be
    split has no per-token figures). When the split came from period detection and the block count is
    neither the log's decode token count nor prefill + decode, a warning says so (a trace without an LM
    head repeats per layer: pass n_decode_tokens). decode_tps / prefill_tps override the log's rates.
    Raises TraceError when the text holds no GEMV, Prefill, Decode or Power record.
    """
    opts = options or AnalysisOptions()
    parsed = parse_trace(text, patterns)
    if not (parsed.gemvs or parsed.prefill or parsed.decode or parsed.power):
        raise TraceError(
            f"no GEMV, Prefill, Decode or Power lines found ({parsed.ignored_lines} other lines); "
            f"is this the engine's output, and do the log patterns match it?"
        )
    warnings = list(parsed.warnings)
    prefill = _phase_stats(parsed.prefill)
    decode = _phase_stats(parsed.decode)
    d_tps = _float(decode_tps, "decode_tps") if decode_tps is not None else (decode.tps if decode else None)
    p_tps = _float(prefill_tps, "prefill_tps") if prefill_tps is not None else (prefill.tps if prefill else None)
    if decode is not None and decode.tps is None:
        warnings.append("decode line has 0 ms: no decode rate")

    token: Optional[TokenProfile] = None
    layers: Optional[LayerPattern] = None
    if parsed.gemvs:
        blocks, method = _split_for_report(parsed.gemvs, n_decode_tokens, decode, prefill, warnings)
        token = token_profile(blocks, method)
        if token.n_consistent < token.n_blocks:
            warnings.append(
                f"{token.n_blocks - token.n_consistent} of {token.n_blocks} token blocks differ from the most "
                f"common one ({token.launches} GEMVs) and were left out"
            )
        layers = detect_layers(token.shapes)

    implied = ceiling = fraction = None
    bw = None if bandwidth_bytes_per_s is None else _float(bandwidth_bytes_per_s, "bandwidth_bytes_per_s")
    if token is not None and token.weight_bytes > 0:
        if d_tps:
            implied = token.weight_bytes * d_tps
        if bw is not None:
            try:
                ceiling = decode_ceiling(token.weight_bytes, 0, 0, bw).ceiling_tps
            except RooflineError as exc:
                raise TraceError(str(exc)) from None
            if d_tps:
                fraction = d_tps / ceiling

    findings: list[Finding] = []
    findings += power_findings(parsed.power)
    findings += prefill_findings(p_tps, d_tps, opts, prefill.tokens if prefill else None)
    if token is not None:
        findings += fusion_findings(token, hints)
    findings += ceiling_findings(d_tps, ceiling, token.launches if token else None, opts)

    return TraceReport(
        token=token, layers=layers, prefill=prefill, decode=decode,
        power=parsed.power[-1] if parsed.power else None,
        decode_tps=d_tps, prefill_tps=p_tps, bandwidth_bytes_per_s=bw,
        implied_bandwidth_bytes_per_s=implied, ceiling_tps=ceiling, fraction_of_ceiling=fraction,
        findings=tuple(findings), warnings=tuple(warnings),
        n_gemv_lines=len(parsed.gemvs), ignored_lines=parsed.ignored_lines,
    )


def _split_for_report(gemvs: list[Gemv], n_decode_tokens: Optional[int], decode: Optional[PhaseStats],
                      prefill: Optional[PhaseStats], warnings: list[str]) -> tuple[list[list[Gemv]], str]:
    blocks, method = split_tokens_with_method(gemvs, n_decode_tokens)
    if method == SPLIT_PERIOD and decode is not None and decode.tokens > 0:
        # A period split cannot tell a token from a layer when the trace has no per-token GEMV (LM head):
        # say so when the log's token counts disagree, rather than guess which one is right.
        counts = {decode.tokens}
        if prefill is not None and prefill.tokens > 0:
            counts.add(decode.tokens + prefill.tokens)
        if len(blocks) not in counts:
            warnings.append(
                f"period detection split the trace into {len(blocks)} blocks of {len(blocks[0])} GEMVs, but the "
                f"log reports {decode.tokens} decoded tokens; if one token spans several blocks, pass "
                f"n_decode_tokens"
            )
    return blocks, method


__all__ = [
    "AnalysisOptions",
    "Finding",
    "Gemv",
    "LAUNCH_OVERHEAD_US",
    "LayerPattern",
    "LogPatterns",
    "ParsedTrace",
    "PhaseLine",
    "PhaseStats",
    "PowerLine",
    "SEVERITY_ERROR",
    "SEVERITY_INFO",
    "SEVERITY_WARNING",
    "SPLIT_INDEX_RESET",
    "SPLIT_PERIOD",
    "SPLIT_TOKEN_COUNT",
    "TokenProfile",
    "TraceError",
    "TraceHints",
    "TraceReport",
    "TypeBreakdown",
    "analyze_trace_text",
    "ceiling_findings",
    "detect_layers",
    "format_summary",
    "fusion_findings",
    "gemv_bytes",
    "parse_trace",
    "power_findings",
    "prefill_findings",
    "report_to_dict",
    "split_tokens",
    "split_tokens_with_method",
    "token_profile",
]
