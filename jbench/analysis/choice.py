"""The decision over a sweep's trials: within a quality bar, the lowest-bit configuration (pure).

Input: rows, one per configuration (a list of mappings, or a DataFrame such as `jbench.tracking.runs_frame`
returns). A field is looked up by its plain name, then as `metrics.<name>`, `tags.<name>` and `params.<name>`, so
the sweep's own rows (`decode_tps`, `model.quant`) and a run table's columns (`metrics.decode_tps`,
`params.model.quant`) read alike. A row with a `status` other than FINISHED (or a resumed `FINISHED (earlier)` /
`EARLIER`) is left out.

The bar (`QualityBar`): an upper bound on the mean KL divergence against the reference (`quality_kld_mean`, nat)
and/or a lower bound on the share of tokens whose top choice is the reference's (`quality_same_top_pct`, %). A
figure counts with its uncertainty (`quality_kld_mean_err`, `quality_same_top_pct_err`: about one standard error,
as llama-perplexity prints it), by a one-sided 95 % bound (z = 1.645):

  * meets:        mean + 1.645 err <= max_kld          (same top: mean - 1.645 err >= min_same_top_pct)
  * within noise: the interval mean +- 1.645 err straddles the bar: the figures cannot say (more chunks would)
  * fails:        mean - 1.645 err >  max_kld          (same top: mean + 1.645 err <  min_same_top_pct)
  * unmeasured:   the row lacks a figure the bar names

A figure without its uncertainty is judged on the mean alone, and the reasons say so. Both bounds set: a row
meets the bar when it meets both (fails when either fails).

Among the rows that meet the bar the choice is the lowest-bit one, ranked by
  1. the weights' bits per weight: the files' real figure (`roofline_bits_per_weight`) when every row with quality
     figures has it, else the quant's nominal figure (`QUANT_ORDER`, below);
  2. the KV cache's bits per element (mean of `backend.cache_type_k` and `cache_type_v`, ggml type sizes): a
     kv_precision sweep's rows share their weights, so the cache type decides; a row without KV settings ranks
     after those with them;
  3. then the faster (`speed_metric`), the more tokens per joule, the lower mean KLD, the row's order.
Memory is not a rank: it is reported beside the choice (peak RSS, else RAM over idle).

Without a bar the answer is the Pareto front of speed (higher) against mean KLD (lower), `pareto_front`.
`quality.meaning` tags (what the figures measure: a requantized ladder's loss against its reference, not quality
against the original weights) are carried as the choice's caveats.
"""

from __future__ import annotations

import math
import re
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Optional, Union

import pandas as pd

from jbench.analysis.roofline import RooflineError, bytes_per_weight, dominant_ggml_type

__all__ = ["Z_ONE_SIDED_95", "QUANT_ORDER", "QualityBar", "Candidate", "Choice", "choose", "pareto_front",
           "field_value", "number", "nominal_bits", "kv_bits", "judge"]

Rows = Union[Sequence[Mapping[str, Any]], pd.DataFrame]
Better = Literal["higher", "lower"]

Z_ONE_SIDED_95 = 1.645  # one-sided 95 % bound of a normal mean

KLD, KLD_ERR = "quality_kld_mean", "quality_kld_mean_err"
SAME_TOP, SAME_TOP_ERR = "quality_same_top_pct", "quality_same_top_pct_err"
FILE_BPW = "roofline_bits_per_weight"
TPJ = "decode_tokens_per_joule"
# Memory shown beside a choice: the first a row has.
MEMORY = (("memory_peak_rss_mib", "peak RSS"), ("memory_ram_over_idle_mib", "RAM over idle"),
          ("memory_gpu_over_idle_mib", "GPU memory over idle"))
MEANING = "quality.meaning"

_PREFIXES = ("", "metrics.", "tags.", "params.")
_QUANT = ("model.quant", "quant", "model_quant")
_KV_K = ("backend.cache_type_k", "cache_type_k", "backend_cache_type_k")
_KV_V = ("backend.cache_type_v", "cache_type_v", "backend_cache_type_v")
_LABEL = ("label", "jbench.trial_label", "run")
_FINISHED = re.compile(r"^(FINISHED|EARLIER)\b")

# The nominal order of quant names when the files' real bits per weight are not known: 8 x bytes per weight of
# the quant's main ggml type (gguf's GGML_QUANT_SIZES: Q4_0 and Q4_K_M -> 4.5, Q8_0 -> 8.5, F16 -> 16), then the
# mix's size suffix (a mixed file type keeps more tensors at larger types from _S to _M to _L to _XL; a plain
# type such as Q4_0 has none and comes first: llama-quantize's own size table orders Q4_0 < Q4_K_S < Q4_K_M), then
# the name.
QUANT_ORDER = "(8 x bytes per weight of the main ggml type, size suffix none < _S < _M < _L < _XL, name)"
_SUFFIX_RANK = {"": 0, "S": 1, "XS": 1, "XXS": 1, "M": 2, "L": 3, "XL": 4}


@dataclass(frozen=True)
class QualityBar:
    """The quality a configuration must keep: None leaves that figure unbounded."""

    max_kld: Optional[float] = None  # nat: mean KL divergence against the reference, at most
    min_same_top_pct: Optional[float] = None  # %: tokens whose top choice is the reference's, at least

    @property
    def empty(self) -> bool:
        return self.max_kld is None and self.min_same_top_pct is None

    def describe(self) -> str:
        parts = []
        if self.max_kld is not None:
            parts.append(f"mean KLD <= {_g(self.max_kld)} nat")
        if self.min_same_top_pct is not None:
            parts.append(f"same top >= {_g(self.min_same_top_pct)} %")
        return " and ".join(parts) + ", at one-sided 95 % bounds" if parts else "no bar"


@dataclass(frozen=True)
class Candidate:
    """One row as the decision sees it."""

    key: Hashable  # the row's position in a list, its index label in a frame
    label: str
    quant: Optional[str] = None
    kv: Optional[str] = None  # "q8_0", or "K q8_0 / V f16"
    weight_bits: Optional[float] = None  # bits per weight by the basis the decision used
    kv_bits: Optional[float] = None
    kld: Optional[float] = None
    kld_err: Optional[float] = None
    same_top: Optional[float] = None
    same_top_err: Optional[float] = None
    speed: Optional[float] = None
    tokens_per_joule: Optional[float] = None
    memory_mib: Optional[float] = None
    memory_what: str = ""
    verdict: str = "unmeasured"  # meets | within_noise | fails | unmeasured
    notes: tuple[str, ...] = ()
    straddles: tuple[str, ...] = ()  # within noise: which figure's interval straddles the bar
    position: int = field(default=0, repr=False, compare=False)  # the row's place in the input: the last tie-break

    @property
    def measured(self) -> bool:
        return self.kld is not None or self.same_top is not None

    @property
    def kld_bound(self) -> Optional[float]:
        """The one-sided 95 % upper bound of the mean KLD (the mean when no uncertainty was recorded)."""
        if self.kld is None:
            return None
        return self.kld + Z_ONE_SIDED_95 * self.kld_err if self.kld_err is not None else self.kld

    @property
    def same_top_bound(self) -> Optional[float]:
        """The one-sided 95 % lower bound of the same-top share."""
        if self.same_top is None:
            return None
        return self.same_top - Z_ONE_SIDED_95 * self.same_top_err if self.same_top_err is not None else self.same_top

    def bits_text(self, kv: bool = True) -> str:
        """Bits per weight, and the KV types (`kv`: when they differ between the rows)."""
        parts = []
        if self.weight_bits is not None:
            parts.append(f"{self.weight_bits:.3g} bpw")
        if kv and self.kv is not None:
            parts.append(f"KV {self.kv}")
        return ", ".join(parts)

    def quality_text(self, bounds: bool = False) -> str:
        """The quality figures with their uncertainty; `bounds`: with their one-sided 95 % bounds."""
        parts = []
        if self.kld is not None:
            err = f" ± {_g(self.kld_err)}" if self.kld_err is not None else " (no uncertainty recorded)"
            bound = f" (95 % bound {_g(self.kld_bound)})" if bounds and self.kld_err is not None else ""
            parts.append(f"mean KLD {_g(self.kld)}{err} nat{bound}")
        if self.same_top is not None:
            err = f" ± {_g(self.same_top_err)}" if self.same_top_err is not None else ""
            bound = (f" (95 % bound {self.same_top_bound:.4g})" if bounds and self.same_top_err is not None
                     else "")
            parts.append(f"same top {self.same_top:.4g}{err} %{bound}")
        return ", ".join(parts) or "no quality figures"

    def speed_text(self, speed_metric: str) -> str:
        unit = " tok/s" if speed_metric.endswith("_tps") else ""
        return (f"{speed_metric.replace('_tps', '')} {self.speed:.1f}{unit}" if self.speed is not None
                else f"{speed_metric} not measured")

    def figures_text(self, speed_metric: str) -> str:
        parts = [self.speed_text(speed_metric)]
        parts.append(f"{self.tokens_per_joule:.3g} tok/J" if self.tokens_per_joule is not None
                     else "tok/J not measured")
        parts.append(f"{self.memory_what} {self.memory_mib:.0f} MiB" if self.memory_mib is not None
                     else "memory not measured")
        return ", ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key if isinstance(self.key, (int, str)) else str(self.key), "label": self.label,
                "quant": self.quant, "kv": self.kv, "weight_bits": self.weight_bits, "kv_bits": self.kv_bits,
                "quality_kld_mean": self.kld, "quality_kld_mean_err": self.kld_err, "kld_bound_95": self.kld_bound,
                "quality_same_top_pct": self.same_top, "quality_same_top_pct_err": self.same_top_err,
                "same_top_bound_95": self.same_top_bound, "speed": self.speed,
                "tokens_per_joule": self.tokens_per_joule, "memory_mib": self.memory_mib,
                "memory_what": self.memory_what or None, "verdict": self.verdict, "notes": list(self.notes),
                "straddles": list(self.straddles)}


# status of a Choice: a configuration chosen, none meets the bar, no row has quality figures, no bar given (the
# Pareto front instead), no finished row at all.
ChoiceStatus = Literal["chosen", "none_meets", "no_quality", "no_bar", "no_rows"]


@dataclass
class Choice:
    status: ChoiceStatus
    bar: Optional[QualityBar]
    speed_metric: str = "decode_tps"
    chosen: Optional[Candidate] = None
    reasons: list[str] = field(default_factory=list)
    runners_up: list[Candidate] = field(default_factory=list)  # the next ones that meet the bar, by rank
    within_noise: list[Candidate] = field(default_factory=list)  # rows whose interval straddles the bar
    closest: Optional[Candidate] = None  # none meets: the row nearest to meeting it
    front: list[Candidate] = field(default_factory=list)  # no bar: the speed/quality Pareto front, by speed
    caveats: list[str] = field(default_factory=list)  # the rows' quality.meaning tags, each once
    bits_basis: str = ""  # "file" (roofline_bits_per_weight) or "quant name" (QUANT_ORDER)
    candidates: list[Candidate] = field(default_factory=list)  # every finished row, judged

    @property
    def kv_varies(self) -> bool:
        """The rows differ in their KV-cache types (only then are they named beside the bits)."""
        return len({c.kv for c in self.candidates}) > 1

    @property
    def key(self) -> Optional[Hashable]:
        """The chosen row's key (its position in a list, its index label in a frame); None when nothing is."""
        return self.chosen.key if self.chosen is not None else None

    def headline(self) -> str:
        """One sentence: what was chosen, or why nothing was."""
        bar = self.bar.describe() if self.bar is not None else "no bar"
        if self.status == "no_rows":
            return "No finished trial: nothing to choose from."
        if self.status == "no_quality":
            return (f"No trial has quality figures ({KLD}, {SAME_TOP}; quality.enabled=true measures them): no "
                    "choice within a quality bar.")
        if self.status == "no_bar":
            front = "; ".join(f"{c.label} ({c.speed_text(self.speed_metric)}, "
                              f"{c.quality_text()})" for c in self.front)
            return (f"No quality bar set (quality.max_kld, quality.min_same_top_pct): the Pareto front of "
                    f"{self.speed_metric} (higher) against mean KLD (lower) is {front or 'empty'}.")
        if self.status == "none_meets":
            n = sum(c.measured for c in self.candidates)
            text = f"No configuration meets the quality bar ({bar}): none of {n} with quality figures."
            if self.closest is not None:
                text = text[:-1] + f"; closest: {self.closest.label} ({self.closest.quality_text(True)})."
            return text
        c = self.chosen
        assert c is not None
        bits = c.bits_text(self.kv_varies)
        return (f"Choice within the quality bar ({bar}): {c.label}" + (f" ({bits})" if bits else "")
                + f": {c.figures_text(self.speed_metric)}; {c.quality_text(True)}.")

    def lines(self) -> list[str]:
        """The headline, then the reasons, then the caveats."""
        return [self.headline(), *self.reasons, *(f"caveat: {c}" for c in self.caveats)]

    def message(self) -> str:
        return "\n".join(self.lines())

    def as_dict(self) -> dict[str, Any]:
        """Plain values (a JSON object)."""
        bar = None if self.bar is None else {"max_kld": self.bar.max_kld,
                                             "min_same_top_pct": self.bar.min_same_top_pct}
        return {"status": self.status, "bar": bar, "speed_metric": self.speed_metric,
                "chosen": self.chosen.as_dict() if self.chosen else None, "message": self.headline(),
                "reasons": list(self.reasons), "runners_up": [c.as_dict() for c in self.runners_up],
                "within_noise": [c.as_dict() for c in self.within_noise],
                "closest": self.closest.as_dict() if self.closest else None,
                "front": [c.as_dict() for c in self.front], "caveats": list(self.caveats),
                "bits_basis": self.bits_basis or None}


# --------------------------------------------------------------------------------------------
# Reading rows


def _items(rows: Rows) -> list[tuple[Hashable, Mapping[str, Any]]]:
    if isinstance(rows, pd.DataFrame):
        return [(idx, rec) for idx, rec in zip(rows.index, rows.to_dict("records"))]
    return list(enumerate(rows))


def _missing(v: Any) -> bool:
    if v is None or v is pd.NA or v is pd.NaT:
        return True
    return isinstance(v, float) and math.isnan(v)


def field_value(row: Mapping[str, Any], *names: str) -> Any:
    """The first of `names` the row has (each tried plain, then as metrics., tags., params.); None if none."""
    for name in names:
        for prefix in _PREFIXES:
            v = row.get(prefix + name)
            if not _missing(v) and v != "":
                return v
    return None


def number(row: Mapping[str, Any], *names: str) -> Optional[float]:
    """A finite float from the first of `names` the row has; None for missing, NaN, infinite or not a number."""
    for name in names:
        for prefix in _PREFIXES:
            v = row.get(prefix + name)
            try:
                f = float(v)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                continue
            if math.isfinite(f):
                return f
    return None


def _g(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.3g}"


def nominal_bits(quant: str) -> Optional[float]:
    """A quant name's nominal bits per weight (its main ggml type's); None for a name llama.cpp does not know."""
    try:
        return bytes_per_weight(dominant_ggml_type(quant)) * 8.0
    except (RooflineError, ValueError, KeyError):
        return None


def _quant_rank(quant: str) -> tuple:
    """QUANT_ORDER's key of a quant name (unknown names last)."""
    bits = nominal_bits(quant)
    m = re.search(r"_(XXS|XS|S|M|L|XL)$", quant.strip().upper())
    return (bits if bits is not None else math.inf, _SUFFIX_RANK[m.group(1)] if m else 0, quant)


def kv_bits(cache_type_k: Optional[str], cache_type_v: Optional[str]) -> Optional[float]:
    """Bits per element of the KV cache: the mean of K's and V's ggml types (one alone when only one is set);
    None when neither is set or known."""
    bits = [nominal_bits(t) for t in (cache_type_k, cache_type_v) if t]
    bits = [b for b in bits if b is not None]
    return sum(bits) / len(bits) if bits else None


def _kv_text(k: Optional[str], v: Optional[str]) -> Optional[str]:
    if not k and not v:
        return None
    if k == v or not v:
        return str(k)
    if not k:
        return f"V {v}"
    return f"K {k} / V {v}"


# --------------------------------------------------------------------------------------------
# Judging a row against the bar

_ORDER = {"fails": 3, "unmeasured": 2, "within_noise": 1, "meets": 0}


def _judge_one(mean: Optional[float], err: Optional[float], bound: float, upper: bool) -> str:
    """One figure against one side of the bar: `upper` (at most `bound`: KLD) or lower (at least: same top)."""
    if mean is None:
        return "unmeasured"
    e = Z_ONE_SIDED_95 * err if err is not None else 0.0
    worst, best = (mean + e, mean - e) if upper else (mean - e, mean + e)
    ok = (lambda x: x <= bound) if upper else (lambda x: x >= bound)
    if ok(worst):
        return "meets"
    if not ok(best):
        return "fails"
    return "within_noise"


def judge(c: Candidate, bar: QualityBar) -> tuple[str, list[str], list[str]]:
    """A candidate's verdict against the bar, the notes that explain it, and the figures whose interval straddles
    the bar."""
    verdicts, notes, straddles = [], [], []
    if bar.max_kld is not None:
        v = _judge_one(c.kld, c.kld_err, bar.max_kld, upper=True)
        verdicts.append(v)
        if c.kld is not None and c.kld_err is None:
            notes.append(f"{KLD_ERR} not recorded: judged on the mean alone")
        if v == "within_noise":
            straddles.append(f"mean KLD {_g(c.kld)} ± {_g(c.kld_err)} nat: its interval (± {Z_ONE_SIDED_95} err, "
                         f"{_g(c.kld - Z_ONE_SIDED_95 * c.kld_err)} to {_g(c.kld_bound)}) straddles "
                         f"{_g(bar.max_kld)}")
    if bar.min_same_top_pct is not None:
        v = _judge_one(c.same_top, c.same_top_err, bar.min_same_top_pct, upper=False)
        verdicts.append(v)
        if c.same_top is not None and c.same_top_err is None:
            notes.append(f"{SAME_TOP_ERR} not recorded: judged on the mean alone")
        if v == "within_noise":
            straddles.append(f"same top {c.same_top:.4g} ± {_g(c.same_top_err)} %: its interval (to "
                         f"{c.same_top_bound:.4g}) straddles {_g(bar.min_same_top_pct)}")
    return (max(verdicts, key=_ORDER.__getitem__) if verdicts else "unmeasured"), notes, straddles


# --------------------------------------------------------------------------------------------
# Public functions


def pareto_front(rows: Rows, x: str, y: str, *, x_better: Better = "higher", y_better: Better = "lower") -> list:
    """The keys (list positions, or a frame's index labels) of the rows no other row dominates in (x, y): at least
    as good in both and better in one. Rows missing either figure (or NaN) are left out; equal points are all kept.
    Keys come in the rows' order."""
    for name, b in (("x_better", x_better), ("y_better", y_better)):
        if b not in ("higher", "lower"):
            raise ValueError(f"{name} must be 'higher' or 'lower', not {b!r}")
    sx, sy = (1.0 if x_better == "higher" else -1.0), (1.0 if y_better == "higher" else -1.0)
    pts = []
    for key, row in _items(rows):
        a, b = number(row, x), number(row, y)
        if a is not None and b is not None:
            pts.append((key, sx * a, sy * b))
    return [k for k, a, b in pts
            if not any(a2 >= a and b2 >= b and (a2 > a or b2 > b) for _, a2, b2 in pts)]


def _candidate(key: Hashable, row: Mapping[str, Any], speed_metric: str) -> Candidate:
    quant = field_value(row, *_QUANT)
    k, v = field_value(row, *_KV_K), field_value(row, *_KV_V)
    k, v = (str(k) if k is not None else None), (str(v) if v is not None else None)
    label = field_value(row, *_LABEL)
    if label is None:
        label = " ".join(str(p) for p in (quant, f"KV {_kv_text(k, v)}" if k or v else None) if p) or str(key)
    mem, what = None, ""
    for name, text in MEMORY:
        mem = number(row, name)
        if mem is not None:
            what = text
            break
    return Candidate(key=key, label=str(label), quant=str(quant) if quant is not None else None, kv=_kv_text(k, v),
                     kv_bits=kv_bits(k, v), kld=number(row, KLD), kld_err=number(row, KLD_ERR),
                     same_top=number(row, SAME_TOP), same_top_err=number(row, SAME_TOP_ERR),
                     speed=number(row, speed_metric), tokens_per_joule=number(row, TPJ), memory_mib=mem,
                     memory_what=what)


def choose(rows: Rows, bar: Optional[QualityBar], *, speed_metric: str = "decode_tps") -> Choice:
    """The lowest-bit configuration whose quality meets `bar` (module doc), with its speed, tokens per joule and
    memory, the runners-up, the rows within noise of the bar; or why there is none; without a bar (None or empty),
    the Pareto front of `speed_metric` against mean KLD."""
    items = [(k, r) for k, r in _items(rows)
             if field_value(r, "status") is None or _FINISHED.match(str(field_value(r, "status")))]
    cands = [_replace(_candidate(k, r, speed_metric), position=i) for i, (k, r) in enumerate(items)]
    measured_rows = [(c, r) for c, (_, r) in zip(cands, items) if c.measured]
    caveats = list(dict.fromkeys(str(field_value(r, MEANING)) for _, r in measured_rows
                                 if field_value(r, MEANING) is not None))
    if not cands:
        return Choice("no_rows", bar, speed_metric)
    if not measured_rows:
        return Choice("no_quality", bar, speed_metric, candidates=cands)

    # The weights' bits: the files' figure when every measured row has it, else the quant names' (QUANT_ORDER).
    use_file = all(number(r, FILE_BPW) is not None for _, r in measured_rows)
    ranked: list[Candidate] = []
    for c, (_, r) in zip(cands, items):
        bits = number(r, FILE_BPW) if use_file else (nominal_bits(c.quant) if c.quant else None)
        notes = ()
        if bits is None and c.measured:
            notes = (f"bits per weight unknown (no {FILE_BPW}, quant {c.quant or '(none)'} not a llama.cpp type): "
                     "ranked after the known ones",)
        ranked.append(_replace(c, weight_bits=bits, notes=notes))

    def rank(c: Candidate) -> tuple:
        # Q4_0 and Q4_K_M share 4.5 nominal bits: by quant name the size suffix keeps them apart.
        suffix = _quant_rank(c.quant)[1] if not use_file and c.quant else 0
        inf = math.inf
        return (c.weight_bits if c.weight_bits is not None else inf, suffix,
                c.kv_bits if c.kv_bits is not None else inf, -c.speed if c.speed is not None else inf,
                -c.tokens_per_joule if c.tokens_per_joule is not None else inf,
                c.kld if c.kld is not None else inf, c.position)

    basis = "file" if use_file else "quant name"
    basis_text = (f"bits per weight: the files' ({FILE_BPW})" if use_file
                  else f"bits per weight: the quant names' nominal figures {QUANT_ORDER}, since not every trial "
                       f"recorded {FILE_BPW}")

    if bar is None or bar.empty:
        measured = [c for c in ranked if c.measured]
        front_keys = pareto_front([{"s": c.speed, "k": c.kld} for c in measured], "s", "k")
        front = sorted((measured[i] for i in front_keys), key=lambda c: -(c.speed or 0.0))
        if not front and any(c.same_top is not None for c in measured):
            keys = pareto_front([{"s": c.speed, "t": c.same_top} for c in measured], "s", "t", y_better="higher")
            front = sorted((measured[i] for i in keys), key=lambda c: -(c.speed or 0.0))
        return Choice("no_bar", bar, speed_metric, front=front, caveats=caveats, bits_basis=basis,
                      candidates=ranked)

    judged = []
    for c in ranked:
        verdict, notes, straddles = judge(c, bar)
        judged.append(_replace(c, verdict=verdict, notes=c.notes + tuple(notes), straddles=tuple(straddles)))
    by_rank = sorted(judged, key=rank)
    kv = len({c.kv for c in judged}) > 1
    meets = [c for c in by_rank if c.verdict == "meets"]
    noise = [c for c in by_rank if c.verdict == "within_noise"]
    unmeasured = [c for c in by_rank if c.verdict == "unmeasured" and c.measured]
    if not meets:
        closest = _closest(judged, bar)
        reasons = [f"{c.label} meets within noise: {'; '.join(c.straddles)}; more chunks (quality.chunks) would "
                   "decide it" for c in noise]
        reasons += [f"{c.label}: lacks a figure the bar names ({c.quality_text()})" for c in unmeasured]
        return Choice("none_meets", bar, speed_metric, reasons=reasons, within_noise=noise, closest=closest,
                      caveats=caveats, bits_basis=basis, candidates=judged)

    chosen = meets[0]
    reasons = [f"lowest bits of {len(meets)} configuration(s) that meet the bar; {basis_text}; then the KV "
               f"cache's bits (cache_type_k/v), then the faster by {speed_metric}"]
    same_bits = [c for c in meets[1:] if (c.weight_bits, c.kv_bits) == (chosen.weight_bits, chosen.kv_bits)]
    if same_bits:
        reasons.append(f"tie on bits with {', '.join(c.label for c in same_bits)}: the faster by {speed_metric} "
                       "was chosen")
    reasons = [*reasons, *(f"{chosen.label}: {n}" for n in chosen.notes)]
    lower = [c for c in noise if rank(c) < rank(chosen)]
    reasons += [f"{c.label} ({c.bits_text(kv)}) meets within noise: {'; '.join(c.straddles)}; more chunks "
                "(quality.chunks) would decide whether it meets the bar" for c in lower]
    runners = meets[1:4]
    if runners:
        reasons.append("runners-up: " + "; ".join(
            f"{c.label} ({c.bits_text(kv)}; {c.figures_text(speed_metric)}; {c.quality_text()})" for c in runners))
    return Choice("chosen", bar, speed_metric, chosen=chosen, reasons=reasons, runners_up=runners,
                  within_noise=noise, caveats=caveats, bits_basis=basis, candidates=judged)


def _closest(judged: list[Candidate], bar: QualityBar) -> Optional[Candidate]:
    """None meets: the measured row whose worst figure is nearest to the bar (relative shortfall)."""
    def shortfall(c: Candidate) -> float:
        gaps = []
        if bar.max_kld is not None:
            gaps.append((c.kld_bound - bar.max_kld) / max(bar.max_kld, 1e-12) if c.kld is not None else math.inf)
        if bar.min_same_top_pct is not None:
            gaps.append((bar.min_same_top_pct - c.same_top_bound) / max(bar.min_same_top_pct, 1e-12)
                        if c.same_top is not None else math.inf)
        return max(gaps) if gaps else math.inf

    measured = [c for c in judged if c.measured and math.isfinite(shortfall(c))]
    return min(measured, key=shortfall) if measured else None


def _replace(c: Candidate, **changes: Any) -> Candidate:
    return replace(c, **changes)
