"""Compare two selections of runs (sweeps, runs or tags) configuration by configuration (pure).

Input: two run tables as `jbench.tracking.runs_frame` returns them (selection A, the reference, and
selection B), and optionally the repetition samples of their runs. FINISHED trial runs only; a run in both
selections is refused (a run is never its own baseline).

Matching: by the tag `jbench.config_hash` (the trial's configuration: device, backend settings, model,
quant, power state). Or along named keys (`along`, e.g. ("model.quant",)): A's and B's runs are matched on
every other identity key (from their params, `jbench.core.identity`), so two quants, power modes or
backends of one sweep are compared with everything else held equal. Identity keys only one side has (another
backend's settings) cannot be held equal; the comparison lists them (`not_held`).

Samples of a rate in a selection (per configuration): the per-repetition values of the rate
(`<metric>_rep`, e.g. `decode_tps_rep`) of every run of that configuration in the selection, pooled;
for a rate without a repetition series (tokens per joule), the per-run values of the metric.
`samples` maps a stepped metric name to {run_id: [values]} (`{"decode_tps_rep": {...}}`); a flat
{run_id: [values]} is read as `decode_tps_rep`, what `jbench.tracking.repetition_samples` returns by
default.

Statistics, per matched configuration and rate, A -> B: one test, `jbench.analysis.stats.ratio_test`, a Welch t
test on ln(samples) (a rate is positive and its noise multiplicative):
  * change_pct = 100 * (gmean_B / gmean_A - 1), geometric means of the pooled samples;
  * its confidence interval (default 95 %), exp of the Welch t interval of mean(ln B) - mean(ln A): a ratio,
    so never below -100 %;
  * p_value of the same test; significant = p < 1 - confidence, which holds exactly when the interval excludes
    no change (the interval and the verdict cannot contradict each other);
  * detectable_drop_pct / detectable_pct: the smallest drop / rise these samples could flag,
    100 * (1 - exp(-t * se)) and 100 * (exp(t * se) - 1), from their noise and number; they say what "not
    significant" is worth.
  A side with fewer than 2 samples, no variation on both sides, or a value <= 0: NaN, with the reason in `note`.
  (Mann-Whitney, which `regress` uses, cannot reach p < 0.05 with 3 vs 3 samples whatever the data: the
  smallest p it can give is 0.100.)
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import numpy as np
import pandas as pd

from jbench.analysis.stats import ratio_test
from jbench.core.identity import IdentityError, identity_items_from_flat, identity_sections
from jbench.core.trial import short_label

__all__ = [
    "CompareError",
    "Comparison",
    "compare",
    "rate_metrics",
    "samples_for",
]

CONFIG_HASH = "tags.jbench.config_hash"
BASE_RATES = ("prefill_tps", "decode_tps")
# Tokens-per-joule metric names: `<phase>_tokens_per_joule[_above_idle]` (also `_tokens_per_j`, `_tpj`) or bare.
TPJ_RE = re.compile(r"^metrics\.((?:[a-z0-9]+_)?(?:tokens_per_joule|tokens_per_j|tpj)(?:_above_idle)?)$")

# Serving trials (backend.scenario=serving): per-level rates, stepped by level in run order beside the level's load
# (`serving_level_load`); compared level by level, at the loads both sides ran.
SERVING_RATES = ("serving_output_tps", "serving_output_tokens_per_joule")
SERVING_LOAD = "serving_level_load"

Samples = Mapping[str, Mapping[str, Sequence[float]]]
SamplesArg = Union[None, Samples, Mapping[str, Sequence[float]], Callable[[list[str], str], Mapping[str, Sequence[float]]]]


class CompareError(ValueError):
    """The two selections cannot be compared; the message says why."""


# --------------------------------------------------------------------------------------------
# Samples out of run tables


def normalize_samples(samples: SamplesArg) -> Union[Samples, Callable]:
    """{stepped metric: {run_id: values}}; a flat {run_id: values} is decode_tps_rep; callables pass."""
    if samples is None:
        return {}
    if callable(samples) and not isinstance(samples, Mapping):
        return samples
    if not samples:
        return {}
    first = next(iter(samples.values()))
    if isinstance(first, Mapping):
        return samples  # type: ignore[return-value]
    return {"decode_tps_rep": samples}  # type: ignore[dict-item]


def rate_metrics(*frames: pd.DataFrame) -> list[str]:
    """The rates to compare: prefill_tps and decode_tps, then tokens-per-joule metrics, each when
    some run in every given frame has it."""
    def present(name: str) -> bool:
        col = f"metrics.{name}"
        return all(col in f.columns and f[col].notna().any() for f in frames)

    names = [m for m in BASE_RATES if present(m)]
    tpj = sorted({m.group(1) for f in frames for c in f.columns if (m := TPJ_RE.match(c))})
    return names + [m for m in tpj if present(m)]


def finished_trials(df: pd.DataFrame) -> pd.DataFrame:
    """FINISHED trial rows that carry a config hash."""
    if df is None or df.empty or CONFIG_HASH not in df.columns:
        return df.iloc[0:0] if df is not None else pd.DataFrame()
    keep = df[CONFIG_HASH].notna()
    if "status" in df.columns:
        keep &= df["status"] == "FINISHED"
    if "tags.jbench.kind" in df.columns:
        keep &= df["tags.jbench.kind"].fillna("trial") == "trial"
    return df[keep]


def _series(samples: Union[Samples, Callable], ids: list[str], name: str) -> Mapping[str, Sequence[float]]:
    """{run_id: values} of a stepped metric, from a loader (asked for these runs) or preloaded samples."""
    if callable(samples):
        return samples(ids, name) if ids else {}
    return samples.get(name, {})


def samples_for(rows: pd.DataFrame, metric: str, samples: SamplesArg) -> tuple[list[float], str]:
    """Pooled samples of a rate over the given runs, and their kind ("repetitions" or "runs").

    Repetition series (`<metric>_rep`) where recorded for these runs; else the per-run metric values."""
    norm = normalize_samples(samples)
    ids = list(rows["run_id"]) if "run_id" in rows.columns else []
    series = _series(norm, ids, f"{metric}_rep")
    pooled: list[float] = []
    for run_id in ids:
        pooled.extend(float(v) for v in series.get(run_id, ()) if v is not None and math.isfinite(float(v)))
    if pooled:
        return pooled, "repetitions"
    col = f"metrics.{metric}"
    if col not in rows.columns:
        return [], "runs"
    values = pd.to_numeric(rows[col], errors="coerce").dropna()
    return [float(v) for v in values if math.isfinite(v)], "runs"


def serving_samples(rows: pd.DataFrame, metric: str, samples: SamplesArg) -> dict[float, list[float]]:
    """{load: the metric's value at every level run at that load} over the given serving runs: a level run again (a
    capacity search's replicate, another trial of the configuration) adds a sample; a level without the figure (no
    energy in its window) adds none."""
    norm = normalize_samples(samples)
    ids = list(rows["run_id"]) if "run_id" in rows.columns else []
    loads, values = _series(norm, ids, SERVING_LOAD), _series(norm, ids, metric)
    out: dict[float, list[float]] = {}
    for run_id in ids:
        for load, v in zip(loads.get(run_id, ()), values.get(run_id, ())):
            if v is not None and math.isfinite(float(v)) and load is not None and math.isfinite(float(load)):
                out.setdefault(float(load), []).append(float(v))
    return out


def _load_label(rows: pd.DataFrame, load: float) -> str:
    kind = rows["params.serving.load"].dropna().iloc[-1] if "params.serving.load" in rows.columns and \
        rows["params.serving.load"].notna().any() else "concurrency"
    return f"{load:g} req/s" if kind == "rate" else f"{load:g} in flight"


def config_label(rows: pd.DataFrame) -> str:
    """A readable name for a configuration: the newest run's trial label, with its device."""
    last = rows.iloc[-1]
    label = last.get("tags.jbench.trial_label") if "tags.jbench.trial_label" in rows.columns else None
    if not isinstance(label, str) or not label:
        quant = last.get("tags.model.quant") if "tags.model.quant" in rows.columns else None
        label = f"model.quant={quant}" if isinstance(quant, str) else "(config)"
    return label


def _device(rows: pd.DataFrame) -> str:
    if "tags.device.name" in rows.columns:
        v = rows["tags.device.name"].dropna()
        if len(v):
            return str(v.iloc[-1])
    return ""


# --------------------------------------------------------------------------------------------
# Matching configurations


def identity_rows(df: pd.DataFrame) -> list[dict[str, str]]:
    """Each run's identity keys and values (dotted key -> param string), from its params; a run whose identity
    cannot be computed (a mandatory key missing) keeps its identity-section params as they are."""
    sections = tuple(f"params.{name}." for name in identity_sections())
    cols = [c for c in df.columns if c.startswith(sections)]
    columns = [df[c].tolist() for c in cols]
    out = []
    for i in range(len(df)):
        flat = {c[len("params."):]: v[i] for c, v in zip(cols, columns) if isinstance(v[i], str)}
        try:
            out.append(identity_items_from_flat(flat))
        except IdentityError:
            out.append(flat)
    return out


def _values(items: Sequence[Mapping[str, str]], key: str) -> list[str]:
    return sorted({str(it.get(key, "(unset)")) for it in items})


def differences(ia: Sequence[Mapping[str, str]], ib: Sequence[Mapping[str, str]],
                skip: Sequence[str] = ()) -> list[str]:
    """The identity keys whose values differ between A's runs and B's, as `key (A: v1; B: v2)`."""
    keys = sorted(set().union(*ia, *ib) - set(skip))
    return [f"{k} (A: {', '.join(_values(ia, k))}; B: {', '.join(_values(ib, k))})"
            for k in keys if _values(ia, k) != _values(ib, k)]


@dataclass
class _Pairing:
    """Which configuration group each row of A and of B belongs to, and the groups' names."""

    group_a: list[str]
    group_b: list[str]
    labels: dict[tuple[str, str], str]  # (side, group) -> readable name
    not_held: list[str] = field(default_factory=list)


def _by_hash(ta: pd.DataFrame, tb: pd.DataFrame) -> _Pairing:
    """Groups by config hash, named by the identity keys that vary over both sides (`Q4_0`, `Q8_0 n_gen=128`), as
    a sweep's summary names its trials; the trial label where nothing varies."""
    ia, ib = identity_rows(ta), identity_rows(tb)
    varying = [k for k in sorted(set().union(*ia, *ib)) if len(_values([*ia, *ib], k)) > 1]
    labels = {}
    for side, t, items in (("a", ta, ia), ("b", tb, ib)):
        last = dict(zip(t[CONFIG_HASH], items))  # a configuration's newest run (rows are in start order)
        for h, rows in t.groupby(CONFIG_HASH, sort=False):
            it = last[h]
            labels[(side, h)] = short_label({k: it[k] for k in varying if k in it}) or config_label(rows)
    return _Pairing(list(ta[CONFIG_HASH]), list(tb[CONFIG_HASH]), labels)


def _along(ta: pd.DataFrame, tb: pd.DataFrame, along: Sequence[str]) -> _Pairing:
    """Groups by every identity key but `along` that both sides have; labels by the keys that vary."""
    ia, ib = identity_rows(ta), identity_rows(tb)
    keys_a, keys_b = set().union(*ia), set().union(*ib)
    for key in along:
        if key not in keys_a | keys_b:
            close = difflib.get_close_matches(key, sorted(keys_a | keys_b), n=1)
            diff = [d.split(" ", 1)[0] for d in differences(ia, ib)]
            raise CompareError(
                f"no run of A or B records '{key}'{f' (did you mean {close[0]}?)' if close else ''}: compare along "
                f"an identity key{', e.g. one where A and B differ: ' + ', '.join(diff[:5]) if diff else ''}")
    held = sorted((keys_a & keys_b) - set(along))
    varying = [k for k in held if len(_values([*ia, *ib], k)) > 1]
    groups: dict[str, list[str]] = {"a": [], "b": []}
    labels: dict[tuple[str, str], str] = {}
    along_of: dict[tuple[str, str], set[str]] = {}
    for side, items in (("a", ia), ("b", ib)):
        for it in items:
            g = json.dumps([it.get(k) for k in held])
            groups[side].append(g)
            along_of.setdefault((side, g), set()).add(short_label({k: it.get(k, "(unset)") for k in along}))
            labels[(side, g)] = short_label({k: it[k] for k in varying if k in it})
    for (side, g), values in along_of.items():
        if len(values) > 1:
            raise CompareError(
                f"{side.upper()} holds several values of {', '.join(along)} for one configuration "
                f"({', '.join(sorted(values))}): select one, e.g. {along[0]}=VALUE, or restrict it with --sweep")
    for (side, g), rest in list(labels.items()):
        (value,) = along_of[(side, g)]
        if side == "a" and ("b", g) in along_of:  # a matched pair reads "Q4_0 → Q8_0"
            (other,) = along_of[("b", g)]
            value = f"{value} → {other}"
        labels[(side, g)] = f"{value} {rest}".strip()
    return _Pairing(groups["a"], groups["b"], labels, sorted((keys_a ^ keys_b) - set(along)))


# --------------------------------------------------------------------------------------------
# Compare


@dataclass
class Comparison:
    table: pd.DataFrame  # one row per (configuration, rate); columns in TABLE_COLUMNS
    only_in_a: list[str] = field(default_factory=list)  # labels of configurations not compared
    only_in_b: list[str] = field(default_factory=list)
    metrics: list[str] = field(default_factory=list)
    confidence: float = 0.95
    along: list[str] = field(default_factory=list)  # keys compared along (empty: matched on the config hash)
    not_held: list[str] = field(default_factory=list)  # identity keys only one side has: not held equal

    TABLE_COLUMNS = ("config_hash", "config_hash_b", "device", "label", "metric", "samples", "n_a", "n_b",
                     "mean_a", "mean_b", "gmean_a", "gmean_b", "change_pct", "ci_low_pct", "ci_high_pct",
                     "p_value", "test", "significant", "detectable_drop_pct", "detectable_pct", "note")
    TEST = "two-sided Welch t test on ln(samples) (the ratio of geometric means)"
    INTERVAL = "exp of the Welch t interval of mean(ln B) - mean(ln A): the ratio B/A, in % change"
    DETECTABLE = ("detectable_drop_pct / detectable_pct: the smallest drop / rise these samples could flag, "
                  "100 * (1 - exp(-t * se)) and 100 * (exp(t * se) - 1), from their noise and number; a smaller real "
                  "change reads as no change")

    @property
    def alpha(self) -> float:
        """The significance level: a change is flagged when its interval excludes no change, p < alpha."""
        return 1.0 - self.confidence

    def to_dict(self) -> dict[str, Any]:
        """JSON-able (NaN -> None)."""
        rows = []
        for rec in self.table.to_dict(orient="records"):
            rows.append({k: _jsonable(v) for k, v in rec.items()})
        return {
            "confidence": self.confidence,
            "alpha": round(self.alpha, 12),
            "interval": self.INTERVAL,
            "test": self.TEST,
            "detectable": self.DETECTABLE,
            "along": list(self.along),
            "not_held_equal": list(self.not_held),
            "metrics": list(self.metrics),
            "rows": rows,
            "only_in_a": list(self.only_in_a),
            "only_in_b": list(self.only_in_b),
        }

    def heading(self) -> str:
        """What was matched with what ('' when configurations are matched by their hash)."""
        if not self.along:
            return ""
        return f"Along {', '.join(self.along)}: each configuration of A against the one of B that differs only there."

    def notes(self) -> list[str]:
        """The footer in words: the test, the smallest detectable change, what was not tested or compared."""
        notes = [f"* p < {self.alpha:.2g}: the {_conf(self.confidence)} interval excludes no change. One test: "
                 "Welch t on ln(rate); change and interval are the ratio of geometric means (gmean), so never "
                 "below -100 %."]
        tested = self.table[self.table["detectable_pct"].notna()] if len(self.table) else self.table
        if len(tested):
            sizes = sorted({f"{a} vs {b}" for a, b in zip(tested["n_a"], tested["n_b"])})
            lo = tested.loc[tested["detectable_pct"].idxmin()]
            hi = tested.loc[tested["detectable_pct"].idxmax()]
            span = _detectable(lo.detectable_drop_pct, lo.detectable_pct)
            if hi.detectable_pct > lo.detectable_pct:
                span += f" ({lo.label} {lo.metric}) to {_detectable(hi.detectable_drop_pct, hi.detectable_pct)} " \
                        f"({hi.label} {hi.metric})"
            notes.append(f"Smallest detectable change at these sample sizes ({', '.join(sizes)}) and the noise "
                         f"measured: {span} (column detectable: drop / rise); a smaller real change reads as "
                         "no change.")
        notes.append("Samples: per-repetition rates pooled over a configuration's runs (`runs`: one value per run "
                     "where no repetition series exists).")
        if len(self.table) and (self.table["samples"] == "levels").any():
            notes.append("Serving rows (`@ load`): one sample per level run at that load (the level as the unit, "
                         "never its requests, which share the server's state); one trial a side gives no interval: "
                         "run each configuration in 2 or more trials (sweep.rounds) or replicate its levels.")
        untested = [f"{r.label} {r.metric}: {r.note}" for r in self.table.itertuples(index=False) if r.note]
        if untested:
            notes.append("Not tested: " + "; ".join(untested))
        if self.not_held:
            notes.append(f"Not held equal (only one side has them): {', '.join(self.not_held)}")
        if self.only_in_a:
            notes.append(f"Only in A (not compared): {', '.join(self.only_in_a)}")
        if self.only_in_b:
            notes.append(f"Only in B (not compared): {', '.join(self.only_in_b)}")
        return notes

    def to_markdown(self) -> str:
        lines = [self.heading() + "\n"] if self.along else []
        lines += [f"| configuration | device | rate | n A | n B | gmean A | gmean B | change | "
                  f"{_conf(self.confidence)} CI | p | detectable |",
                  "|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|"]
        for r in self.table.itertuples(index=False):
            ci = "n/a" if math.isnan(r.ci_low_pct) else f"[{r.ci_low_pct:+.2f} %, {r.ci_high_pct:+.2f} %]"
            mark = " *" if r.significant else ""
            lines.append(
                f"| {r.label} | {r.device} | {r.metric} | {r.n_a} | {r.n_b} | {_fmt(r.gmean_a)} | "
                f"{_fmt(r.gmean_b)} | {_pct(r.change_pct)}{mark} | {ci} | {_fmt_p(r.p_value)} | "
                f"{_detectable(r.detectable_drop_pct, r.detectable_pct)} |")
        notes = self.notes()
        notes[0] = "\n\\" + notes[0]  # the leading * is the marker's, not markdown's
        return "\n".join(lines + notes) + "\n"


def _jsonable(v: Any) -> Any:
    if isinstance(v, (np.floating, float)):
        return None if not math.isfinite(float(v)) else float(v)
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.bool_):
        return bool(v)
    return v


def _fmt(v: float) -> str:
    return "n/a" if v is None or not math.isfinite(v) else f"{v:.4g}"


def _pct(v: float) -> str:
    return "n/a" if v is None or not math.isfinite(v) else f"{v:+.2f} %"


def _detectable(drop_pct: float, rise_pct: float) -> str:
    return "n/a" if not math.isfinite(rise_pct) else f"-{drop_pct:.2f} % / +{rise_pct:.2f} %"


def _conf(confidence: float) -> str:
    return f"{100 * confidence:g} %"


def _fmt_p(p: float) -> str:
    if p is None or not math.isfinite(p):
        return "n/a"
    return f"{p:.2g}" if p < 0.001 else f"{p:.3f}"


def _gmean(xs: Sequence[float]) -> float:
    return math.exp(float(np.mean(np.log(xs)))) if xs and all(v > 0 for v in xs) else math.nan


def _distinct(labels: list[str], hashes: list[str]) -> list[str]:
    """Labels of configurations, each with its short hash where two share a label."""
    return [f"{lab} ({h[:8]})" if labels.count(lab) > 1 else lab for lab, h in zip(labels, hashes)]


def compare(
    a: pd.DataFrame,
    b: pd.DataFrame,
    samples: SamplesArg = None,
    *,
    metrics: Optional[Sequence[str]] = None,
    confidence: float = 0.95,
    along: Sequence[str] = (),
) -> Comparison:
    """Per configuration in both A and B and per rate, B's change against A (see the module doc).

    along: identity keys to compare along (configurations matched on every other identity key); empty: matched
    on the config hash. Raises CompareError when a selection has no finished trial runs, when A and B share a
    run, or when no configuration of A matches one of B (the message says where they differ).
    """
    ta, tb = finished_trials(a), finished_trials(b)
    if ta.empty:
        raise CompareError("selection A has no finished trial runs with a jbench.config_hash")
    if tb.empty:
        raise CompareError("selection B has no finished trial runs with a jbench.config_hash")
    ids_a, ids_b = set(ta["run_id"]), set(tb["run_id"])
    if ids_a == ids_b:
        raise CompareError(
            f"A and B select the same {len(ids_a)} run(s): compared with itself a selection shows no change by "
            "construction. Give two different sweeps or runs, or two values of one key, e.g. "
            "`jbench compare model.quant=Q4_0 model.quant=Q8_0 --sweep ID`")
    shared = sorted(ids_a & ids_b)
    if shared:
        raise CompareError(
            f"{len(shared)} run(s) are in both A and B ({', '.join(r[:8] for r in shared[:3])}"
            f"{', ...' if len(shared) > 3 else ''}): a run cannot be its own baseline; give selections that do not "
            "overlap (e.g. narrow them with --sweep)")
    along = list(dict.fromkeys(along))
    pairing = _along(ta, tb, along) if along else _by_hash(ta, tb)
    ga, gb = pd.Series(pairing.group_a, index=ta.index), pd.Series(pairing.group_b, index=tb.index)
    common = set(ga) & set(gb)
    if not common:
        diff = differences(identity_rows(ta), identity_rows(tb), along)
        keys = [d.split(" ", 1)[0] for d in diff]
        counts = f"A ({ga.nunique()} configuration(s)) and B ({gb.nunique()})"
        where = f"; they differ in {'; '.join(diff[:3])}{f'; and {len(diff) - 3} more' if len(diff) > 3 else ''}"
        if along:
            raise CompareError(f"no configuration of A matches one of B along {', '.join(along)} between {counts}"
                               f"{where if diff else ''}: give selections that differ only in {', '.join(along)}")
        fix = (f": compare along it with --along {keys[0]}" if len(keys) == 1 else
               ": compare selections that ran the same configurations, or along one key with --along KEY "
               "(the others held equal)")
        raise CompareError(f"no configuration in common between {counts}{where if diff else ''}{fix}")
    names = list(metrics) if metrics is not None else rate_metrics(ta, tb)
    serving = [m for m in SERVING_RATES if metrics is None and all(
        f"metrics.{m}" in t.columns and t[f"metrics.{m}"].notna().any() for t in (ta, tb))]
    samples = normalize_samples(samples)
    if callable(samples):  # a loader: ask once per rate for every run of both selections
        ids = list(dict.fromkeys([*ta["run_id"], *tb["run_id"]]))
        wanted = [f"{m}_rep" for m in names] + ([SERVING_LOAD, *serving] if serving else [])
        samples = {name: dict(samples(ids, name)) for name in wanted}
    order = list(dict.fromkeys(g for g in ga if g in common))
    # configurations that share a label (another device, a key the label leaves out) get their short hash
    names_of = dict(zip(order, _distinct([pairing.labels[("a", g)] for g in order],
                                         [ta[ga == g][CONFIG_HASH].iloc[-1] for g in order])))
    records = []
    for g in order:
        ra, rb = ta[ga == g], tb[gb == g]
        label, device = names_of[g], _device(rb) or _device(ra)
        rows_of = []
        for m in names:
            xa, kind_a = samples_for(ra, m, samples)
            xb, kind_b = samples_for(rb, m, samples)
            rows_of.append((label, m, xa, xb, kind_a if kind_a == kind_b else f"{kind_a}/{kind_b}"))
        for m in serving:
            la, lb = serving_samples(ra, m, samples), serving_samples(rb, m, samples)
            for load in sorted(set(la) & set(lb)):
                rows_of.append((f"{label} @ {_load_label(rb, load)}", m, la[load], lb[load], "levels"))
        for row_label, m, xa, xb, kind in rows_of:
            if not xa and not xb:
                continue
            rt = ratio_test(xa, xb, confidence)
            records.append({
                "config_hash": ra[CONFIG_HASH].iloc[-1], "config_hash_b": rb[CONFIG_HASH].iloc[-1],
                "device": device, "label": row_label, "metric": m,
                "samples": kind,
                "n_a": len(xa), "n_b": len(xb),
                "mean_a": float(np.mean(xa)) if xa else math.nan, "mean_b": float(np.mean(xb)) if xb else math.nan,
                "gmean_a": _gmean(xa), "gmean_b": _gmean(xb),
                "change_pct": 100.0 * (rt.ratio - 1.0),
                "ci_low_pct": 100.0 * (rt.low - 1.0), "ci_high_pct": 100.0 * (rt.high - 1.0),
                "p_value": rt.p_value, "test": "welch-t-log" if not rt.reason else "n/a",
                "significant": bool(math.isfinite(rt.p_value) and rt.p_value < 1.0 - confidence),
                "detectable_drop_pct": 100.0 * rt.detectable_drop, "detectable_pct": 100.0 * rt.detectable,
                "note": rt.reason,
            })
    table = pd.DataFrame.from_records(records, columns=list(Comparison.TABLE_COLUMNS))

    def only(t: pd.DataFrame, groups: pd.Series, side: str, other: set) -> list[str]:
        left = [g for g in dict.fromkeys(groups) if g not in other]
        return _distinct([pairing.labels[(side, g)] for g in left],
                         [t[groups == g][CONFIG_HASH].iloc[-1] for g in left])

    return Comparison(table, only(ta, ga, "a", set(gb)), only(tb, gb, "b", set(ga)), [*names, *serving], confidence,
                      along, pairing.not_held)
