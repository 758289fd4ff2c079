"""The nightly's same-night control: a pinned reference build measured beside the build under test.

Most of a night's noise on a unit (clocks, thermal state, background load) is shared by everything measured there
that night. So the nightly measures a reference build -- one kept on the device, never replaced in place -- on
the same unit, in the same power state, interleaved with the build under test and counterbalanced: in odd rounds
of the sweep a configuration runs test then reference, in even rounds reference then test, so with the nightly's
two rounds every configuration runs T R R T (A B B A) and a linear drift over the night falls on both builds
equally (a one-round plan is split into two rounds for it). The decisions are pure (jbench.analysis.paired:
`night_ratio`, `reference_shift`, `control_verdict`); this module plans the trials, reads the store for the
reference and its earlier nights, and judges a night's outcomes.

Which reference (`farm.reference`): a declared `backend.binary_dir`, or "accepted": the build last promoted with
`jbench nightly CLASS --promote-reference`, read from the nightly parent runs' tags (`TAG_PROMOTED`, every
promotion recorded there with its commit). A reference whose commit changed since it was declared or promoted was
replaced in place: the control is void that night (no verdict, with the reason).

Which nights (`farm.control_every`: every Nth night, from the earlier nightly parent runs' `TAG_CONTROL`) and which
configurations (`farm.control_only`, rules as `sweep.exclude`). Each reference trial costs what its test trial
costs: the control doubles the device time of the configurations it covers, on the nights it runs.

The noise budget (`farm.target_interval_pct`, docs/farm.md): on a control night each covered configuration's
repetitions per build are chosen from its earlier nights' within-night spread (`budgets`: the per-repetition series
`<metric>_rep` of its newest `BUDGET_NIGHTS` nights, both builds; jbench.analysis.paired.noise_budget does the
arithmetic) and set in the plan (`with_repetitions`); the count and why are tagged on each run
(`RUN_TAG_REPETITIONS`) and on the parent run (`TAG_REPETITIONS`).

Runs are told apart in the store: a reference trial's `jbench.config_hash` is its configuration's hash with
`REFERENCE_SUFFIX` (so `jbench regress`, compare and the history never pool it with the build under test, and the
reference's own absolute series is a series of its own), its label carries `control=reference`, and after the
sweep every run of a control night is tagged `jbench.control` = test | reference.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import pandas as pd

from jbench.analysis.paired import (ControlVerdict, NightRatio, NoiseBudget, ReferenceShift, Spread, control_verdict,
                                     direction, noise_budget, reference_shift_trials, trial_ratio,
                                     within_night_spread)
from jbench.core.results import Status
from jbench.core.schema import FarmConfig
from jbench.core.trial import Trial, short_label
from jbench.sweeps.confirm import with_changes
from jbench.sweeps.plan import Plan, replicate

REFERENCE_SUFFIX = "-reference"
ROLE_KEY = "control"  # the trial point key (and the run tag jbench.control) that says test or reference
TEST, REFERENCE = "test", "reference"
METRICS = ("decode_tps", "prefill_tps")  # the rates with a per-repetition series (`<metric>_rep`)

# Tags of the nightly's parent run.
TAG_CONTROL = "jbench.nightly.control"  # on | off: why
TAG_REFERENCE = "jbench.nightly.reference"  # the reference build's directory tonight
TAG_REFERENCE_COMMIT = "jbench.nightly.reference_commit"
TAG_PROMOTED = "jbench.nightly.promoted_reference"  # a promotion: the build under test accepted as the reference
TAG_PROMOTED_COMMIT = "jbench.nightly.promoted_reference_commit"
TAG_VERDICTS = "jbench.nightly.control_verdicts"
RUN_TAG = "jbench.control"  # on each trial run of a control night: test | reference
TAG_REPETITIONS = "jbench.nightly.repetitions"  # config hash=repetitions per build, ... (the noise budget)
RUN_TAG_REPETITIONS = "jbench.repetitions_budget"  # on each trial run: the count per build and why
BUDGET_NIGHTS = 7  # the newest earlier nights whose spread sizes tonight (older ones may predate a change)

_CLASS_TAG = "tags.jbench.nightly.class"


def reference_hash(config_hash: str) -> str:
    return config_hash + REFERENCE_SUFFIX


def is_reference_hash(config_hash: Any) -> bool:
    return isinstance(config_hash, str) and config_hash.endswith(REFERENCE_SUFFIX)


@dataclass(frozen=True)
class Reference:
    binary_dir: str
    commit: str = ""  # "" when unknown (a declared directory before its first night)
    source: str = "declared"  # declared | accepted (promoted on night `sweep_id`)
    sweep_id: str = ""

    def describe(self) -> str:
        how = "declared (farm.reference)" if self.source == "declared" else f"accepted on night {self.sweep_id}"
        return f"{self.binary_dir} (commit {self.commit or 'unknown'}, {how})"


@dataclass
class ControlSetup:
    """Tonight's control, decided before any device is touched: on (with the reference) or off (with why)."""

    reference: Optional[Reference]
    on: bool
    why_off: str = ""
    covered: list[str] = field(default_factory=list)  # config hashes of the build under test that get the control

    @property
    def tag(self) -> str:
        return "on" if self.on else f"off: {self.why_off}"


def _class_parents(parents: Optional[pd.DataFrame], device_class: str) -> pd.DataFrame:
    if parents is None or len(parents) == 0 or _CLASS_TAG not in parents.columns:
        return pd.DataFrame()
    mine = parents[parents[_CLASS_TAG] == device_class]
    return mine.sort_values(["start_time", "run_id"], kind="stable") if len(mine) else mine


def accepted_reference(parents: Optional[pd.DataFrame], device_class: str) -> Optional[Reference]:
    """The build last promoted for the class (`--promote-reference`), from the nightly parent runs' tags."""
    mine = _class_parents(parents, device_class)
    if mine.empty or f"tags.{TAG_PROMOTED}" not in mine.columns:
        return None
    promoted = mine[mine[f"tags.{TAG_PROMOTED}"].notna() & (mine[f"tags.{TAG_PROMOTED}"] != "")]
    if promoted.empty:
        return None
    row = promoted.iloc[-1]
    commit = row.get(f"tags.{TAG_PROMOTED_COMMIT}")
    return Reference(str(row[f"tags.{TAG_PROMOTED}"]), commit if isinstance(commit, str) else "", "accepted",
                     str(row.get("tags.jbench.sweep_id") or ""))


def _last_commit(parents: Optional[pd.DataFrame], device_class: str, binary_dir: str) -> str:
    """The commit a declared reference directory held on its newest earlier control night ("" before one)."""
    mine = _class_parents(parents, device_class)
    cols = (f"tags.{TAG_REFERENCE}", f"tags.{TAG_REFERENCE_COMMIT}")
    if mine.empty or not all(c in mine.columns for c in cols):
        return ""
    rows = mine[(mine[cols[0]] == binary_dir) & mine[cols[1]].notna() & (mine[cols[1]] != "")]
    return str(rows.iloc[-1][cols[1]]) if len(rows) else ""


def control_due(parents: Optional[pd.DataFrame], device_class: str, every: int) -> tuple[bool, str]:
    """Whether tonight is a control night with `farm.control_every` = every (the earlier nights' TAG_CONTROL)."""
    if every <= 0:
        return False, "farm.control_every=0"
    if every == 1:
        return True, ""
    mine = _class_parents(parents, device_class)
    tags = list(mine[f"tags.{TAG_CONTROL}"]) if f"tags.{TAG_CONTROL}" in mine.columns else []
    since = 0
    for tag in reversed(tags):
        if tag == "on":
            break
        since += 1
    else:
        return True, ""  # no earlier control night: the first one is tonight
    if since + 1 >= every:
        return True, ""
    return False, f"farm.control_every={every}: the last control night was {since + 1} night(s) ago"


def _matches(config: dict, rule: dict) -> bool:
    for key, want in rule.items():
        node: Any = config
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if not (node in want if isinstance(want, list) else node == want):
            return False
    return True


def _has_build_dir(trial: Trial) -> bool:
    return any(f.name == "binary_dir" for f in dataclasses.fields(trial.cfg.backend))


def setup(plan: Plan, device_class: str, farm: FarmConfig, parents: Optional[pd.DataFrame]) -> ControlSetup:
    """Tonight's control from the config and the earlier nights (nothing on a device). ValueError names a
    declared reference that cannot be used (a bad input: nothing runs)."""
    declared = farm.reference
    if declared is None or declared == "":
        return ControlSetup(None, False, "no reference build (farm.reference=null)")
    if declared == "accepted":
        ref = accepted_reference(parents, device_class)
        if ref is None:
            return ControlSetup(None, False, f"no accepted reference build for {device_class} yet: `jbench nightly "
                                             f"{device_class} --promote-reference` accepts tonight's build")
    else:
        ref = Reference(declared, _last_commit(parents, device_class, declared))
    tests = [t for t in plan.trials if not farm.control_only or any(_matches(t.config, r) for r in farm.control_only)]
    if not tests:
        return ControlSetup(ref, False, "farm.control_only matches no configuration of the matrix")
    if not all(_has_build_dir(t) for t in tests):
        if declared != "accepted":
            raise ValueError(f"farm.reference={declared}: the backend {tests[0].cfg.backend.name} has no build "
                             "directory (backend.binary_dir) to run a reference build from")
        return ControlSetup(ref, False, f"the backend {tests[0].cfg.backend.name} has no build directory")
    due, why = control_due(parents, device_class, farm.control_every)
    if not due:
        return ControlSetup(ref, False, why)
    return ControlSetup(ref, True, covered=sorted({t.config_hash for t in tests}))


def with_control_rounds(plan: Plan, control: ControlSetup, rounds: int) -> Plan:
    """A control night's plan with at least `rounds` rounds (farm.control_rounds), each configuration's repetitions
    spread over them as sweep.rounds spreads them. The paired ratio's interval comes from the trial-to-trial
    spread (jbench.analysis.paired.trial_ratio), so trials per build narrow it where repetitions cannot: on the
    GPU host 2 rounds found a 2 % decode step within three nights in 30-100 % of histories, 4 rounds in all of
    them (docs/PERFORMANCE.md). Unchanged when the control is off or the plan has that many rounds already."""
    if not control.on or control.reference is None or plan.rounds >= rounds:
        return plan
    base = []
    for t in plan.trials:
        if t.round != 1:
            continue
        reps = _repetitions(t)
        if reps is not None:
            total = reps * plan.rounds
            t = dataclasses.replace(t, index=0, config=with_changes(t.config, {"backend.repetitions": total})).with_cfg(
                dataclasses.replace(t.cfg, backend=dataclasses.replace(t.cfg.backend, repetitions=total)))
        base.append(t)
    return dataclasses.replace(plan, trials=replicate(base, rounds), rounds=rounds,
                               sweep=dataclasses.replace(plan.sweep, rounds=rounds))


def control_plan(plan: Plan, control: ControlSetup) -> Plan:
    """The nightly's plan with a reference trial beside each covered test trial: test first in odd rounds,
    reference first in even ones (module doc). Unchanged when the control is off."""
    if not control.on or control.reference is None:
        return plan
    trials = plan.trials
    rounds = plan.rounds
    if rounds == 1:  # counterbalancing needs an even number of passes: the repetitions are split over two
        trials, rounds = replicate([dataclasses.replace(t, index=0) for t in trials], 2), 2
    covered = set(control.covered)
    out: list[Trial] = []
    for t in trials:
        if t.config_hash not in covered:
            out.append(t)
            continue
        config = with_changes(t.config, {"backend.binary_dir": control.reference.binary_dir})
        cfg = dataclasses.replace(t.cfg, backend=dataclasses.replace(t.cfg.backend,
                                                                    binary_dir=control.reference.binary_dir))
        ref = Trial(index=0, config=config, choices=dict(t.choices), point={**t.point, ROLE_KEY: REFERENCE},
                    config_hash=reference_hash(t.config_hash), round=t.round, rounds=t.rounds).with_cfg(cfg)
        out += [t, ref] if t.round % 2 == 1 else [ref, t]
    numbered = [dataclasses.replace(t, index=i + 1).with_cfg(t.cfg) for i, t in enumerate(out)]
    sweep = dataclasses.replace(plan.sweep, rounds=rounds)
    return dataclasses.replace(plan, trials=numbered, rounds=rounds, sweep=sweep)


# --- the noise budget ------------------------------------------------------------------------------------------


def earlier_spreads(runs: Optional[pd.DataFrame], samples: Callable[[list[str], str], dict[str, list[float]]],
                    config_hash: str, *, nights: int = BUDGET_NIGHTS) -> list[Spread]:
    """The within-night spread of each unit x rate of a configuration over its newest `nights` earlier nights:
    the FINISHED trial runs of the build under test and of its reference, one group of repetitions per night,
    unit and build (the rounds of one build pooled, as the night's paired ratio pools them)."""
    cols = ("tags.jbench.config_hash", "tags.jbench.sweep_id", "status", "run_id")
    if runs is None or len(runs) == 0 or not all(c in runs.columns for c in cols):
        return []
    mine = runs[runs["tags.jbench.config_hash"].isin([config_hash, reference_hash(config_hash)])
                & (runs["status"] == "FINISHED") & runs["tags.jbench.sweep_id"].notna()]
    if mine.empty:
        return []
    order = mine.sort_values("start_time", kind="stable") if "start_time" in mine.columns else mine
    newest = list(dict.fromkeys(order["tags.jbench.sweep_id"]))[-nights:]
    mine = mine[mine["tags.jbench.sweep_id"].isin(newest)]
    keys = list(zip(mine["tags.jbench.sweep_id"], _units(mine), mine["tags.jbench.config_hash"], mine["run_id"]))
    out = []
    for metric in METRICS:
        series = samples([k[3] for k in keys], f"{metric}_rep")
        by_unit: dict[str, dict[str, dict[str, list[float]]]] = {}  # unit -> night -> build -> repetitions
        for night, u, h, run_id in keys:
            by_unit.setdefault(u, {}).setdefault(night, {}).setdefault(h, []).extend(series.get(run_id) or [])
        for u, per_night in sorted(by_unit.items()):
            spread = within_night_spread({n: list(builds.values()) for n, builds in per_night.items()},
                                         what=f"{metric} on {u}" if u else metric)
            if spread.dof:
                out.append(spread)
    return out


def _units(runs: pd.DataFrame) -> pd.Series:
    """Each run's unit (`device.unit`, else `device.name`) as a string."""
    unit = runs["tags.device.unit"] if "tags.device.unit" in runs.columns else None
    if unit is None or unit.isna().all():
        unit = runs["tags.device.name"] if "tags.device.name" in runs.columns else pd.Series("", index=runs.index)
    return unit.fillna("").astype(str)


def earlier_trial_means(runs: Optional[pd.DataFrame], samples: Callable[[list[str], str], dict[str, list[float]]],
                        config_hash: str, unit: str, metric: str, sweep_id: str, *,
                        nights: int = BUDGET_NIGHTS) -> list[list[float]]:
    """ln trial means of `metric` on this unit over the configuration's newest `nights` earlier nights, one group
    per build and night (both builds): what trial_ratio pools its trial-to-trial spread from."""
    cols = ("tags.jbench.config_hash", "tags.jbench.sweep_id", "status", "run_id")
    if runs is None or len(runs) == 0 or not all(c in runs.columns for c in cols):
        return []
    mine = runs[runs["tags.jbench.config_hash"].isin([config_hash, reference_hash(config_hash)])
                & (runs["status"] == "FINISHED") & runs["tags.jbench.sweep_id"].notna()
                & (runs["tags.jbench.sweep_id"] != sweep_id)]
    if mine.empty:
        return []
    mine = mine[_units(mine) == unit]
    order = mine.sort_values("start_time", kind="stable") if "start_time" in mine.columns else mine
    newest = list(dict.fromkeys(order["tags.jbench.sweep_id"]))[-nights:]
    mine = mine[mine["tags.jbench.sweep_id"].isin(newest)]
    series = samples(list(mine["run_id"]), f"{metric}_rep")
    groups: dict[tuple[str, str], list[float]] = {}
    for night, h, run_id in zip(mine["tags.jbench.sweep_id"], mine["tags.jbench.config_hash"], mine["run_id"]):
        logs = [math.log(v) for v in (series.get(run_id) or []) if v is not None and math.isfinite(v) and v > 0]
        if logs:
            groups.setdefault((night, h), []).append(sum(logs) / len(logs))
    return [g for g in groups.values() if len(g) >= 2]


def budgets(plan: Plan, control: ControlSetup, farm: FarmConfig, runs: Optional[pd.DataFrame],
            samples: Callable[[list[str], str], dict[str, list[float]]], *, alpha: float = 0.01,
            store_problem: str = "") -> dict[str, NoiseBudget]:
    """Tonight's repetitions per build of each configuration of the plan (config hash -> NoiseBudget): from the
    spread on a control night's covered configurations, else the configured count with the reason. ValueError
    names bounds that contradict each other."""
    if farm.min_repetitions > farm.max_repetitions:
        raise ValueError(f"farm.min_repetitions={farm.min_repetitions} is above farm.max_repetitions="
                         f"{farm.max_repetitions}: give a range, e.g. 3 and 30")
    half = farm.target_interval_pct / 100 if farm.target_interval_pct is not None else None
    out: dict[str, NoiseBudget] = {}
    for t in plan.trials:
        h = t.config_hash
        if h in out or is_reference_hash(h):
            continue
        configured = _configured(t)
        if configured is None:
            continue  # a backend without a repetition count: nothing to size
        if half is None:
            out[h] = noise_budget([], configured=configured, half_width=None)
        elif not control.on or h not in control.covered:
            why = f"the same-night control is off ({control.why_off})" if not control.on else \
                "not covered by the same-night control (farm.control_only)"
            out[h] = NoiseBudget(configured, False, f"configured: {why}; the budget sizes the night's paired ratio")
        elif store_problem:
            out[h] = NoiseBudget(configured, False, f"configured: {store_problem}")
        else:
            out[h] = noise_budget(earlier_spreads(runs, samples, h), configured=configured, half_width=half,
                                  alpha=alpha, at_least=farm.min_repetitions, at_most=farm.max_repetitions)
    return out


def _repetitions(trial: Trial) -> Optional[int]:
    """The trial's backend.repetitions; None for a backend without a repetition count (base.TokenCounts)."""
    try:
        reps = trial.cfg.backend.repetitions
    except AttributeError:
        return None
    return reps if isinstance(reps, int) and not isinstance(reps, bool) else None


def _configured(trial: Trial) -> Optional[int]:
    """The configuration's repetitions per build and night as planned: each of its R rounds runs its share."""
    reps = _repetitions(trial)
    return reps * trial.rounds if reps is not None else None


def with_repetitions(plan: Plan, chosen: dict[str, NoiseBudget]) -> Plan:
    """The plan with each configuration's repetitions per build tonight: a trial of a plan of R rounds runs
    ceil(n / R) of them. Its configuration hash stays (the history's series goes on), as with sweep.rounds."""
    trials = []
    for t in plan.trials:
        b = chosen.get(t.config_hash)
        if b is None or not b.chosen:
            trials.append(t)
            continue
        share = max(1, -(-b.repetitions // t.rounds))
        cfg = dataclasses.replace(t.cfg, backend=dataclasses.replace(t.cfg.backend, repetitions=share))
        trials.append(dataclasses.replace(t, config=with_changes(t.config, {"backend.repetitions": share})
                                          ).with_cfg(cfg))
    return dataclasses.replace(plan, trials=trials)


def budget_tags(chosen: dict[str, NoiseBudget]) -> str:
    return "; ".join(f"{h}={b.repetitions}" + ("" if b.chosen else " (configured)")
                     for h, b in sorted(chosen.items()))


# --- judging a night ----------------------------------------------------------------------------------------------


def _trials(outcomes: Sequence[Any], metric: str) -> dict[tuple[str, str, str], list[list[float]]]:
    """{(unit, config hash of the build under test, role): each FINISHED trial's per-repetition rates that night}."""
    out: dict[tuple[str, str, str], list[list[float]]] = {}
    for o in outcomes:
        if o.status != Status.FINISHED or o.record is None:
            continue
        h = o.trial.config_hash
        role = REFERENCE if is_reference_hash(h) else TEST
        base = h[:-len(REFERENCE_SUFFIX)] if role == REFERENCE else h
        values = o.record.stepped.get(f"{metric}_rep") or []
        if values:
            out.setdefault((str(o.device or ""), base, role), []).append([float(v) for v in values])
    return out


def _labels(outcomes: Sequence[Any]) -> dict[str, str]:
    return {o.trial.config_hash: short_label(o.trial.point) or f"{o.trial.cfg.model.name} {o.trial.cfg.model.quant}"
            for o in outcomes if not is_reference_hash(o.trial.config_hash)}


def previous_reference(df: Optional[pd.DataFrame], unit: str, config_hash: str, sweep_id: str,
                       reference: Reference) -> tuple[str, list[str]]:
    """(the newest earlier night, its run ids) on which this unit measured this reference build (same directory
    and, when known, commit) for this configuration; ("", []) when there is none."""
    if df is None or len(df) == 0 or "tags.jbench.config_hash" not in df.columns:
        return "", []
    unit_col = df["tags.device.unit"] if "tags.device.unit" in df.columns else df.get("tags.device.name")
    rows = df[(df["tags.jbench.config_hash"] == reference_hash(config_hash)) & (unit_col == unit)
              & (df["tags.jbench.sweep_id"] != sweep_id) & (df["status"] == "FINISHED")]
    if "tags.backend.binary_dir" in rows.columns:
        rows = rows[rows["tags.backend.binary_dir"] == reference.binary_dir]
    if reference.commit and "tags.backend.build_commit" in rows.columns:
        rows = rows[rows["tags.backend.build_commit"] == reference.commit]
    if rows.empty:
        return "", []
    newest = rows.sort_values("start_time", kind="stable").iloc[-1]["tags.jbench.sweep_id"]
    return str(newest), list(rows[rows["tags.jbench.sweep_id"] == newest]["run_id"])


def replaced_in_place(tonight: pd.DataFrame, reference: Reference) -> str:
    """Why the reference is void tonight when its directory now holds another commit than the one accepted."""
    if not reference.commit or tonight is None or "tags.backend.build_commit" not in tonight.columns:
        return ""
    ref = tonight[tonight["tags.jbench.config_hash"].map(is_reference_hash)]
    commits = sorted({c for c in ref["tags.backend.build_commit"] if isinstance(c, str) and c})
    other = [c for c in commits if c != reference.commit]
    if not other:
        return ""
    return (f"the reference {reference.binary_dir} now holds commit {', '.join(other)}, not "
            f"{reference.commit} as when it was {'accepted' if reference.source == 'accepted' else 'last measured'}: "
            "it was replaced in place, so the control says nothing tonight (keep one directory "
            "per build; promote again with --promote-reference)")


def judge(outcomes: Sequence[Any], control: ControlSetup, *, sweep_id: str, runs: Optional[pd.DataFrame] = None,
          samples: Callable[[list[str], str], dict[str, list[float]]] = lambda ids, m: {},
          alpha: float = 0.01, min_effect: float = 0.01) -> list[ControlVerdict]:
    """The control's verdict per unit x covered configuration x rate for tonight's outcomes. `runs`: every trial
    run of the experiment (the reference's earlier nights, tonight's build commits); `samples(run_ids, metric)`:
    their per-repetition series (`<metric>_rep`)."""
    if not control.on or control.reference is None:
        return []
    tonight = runs[runs["tags.jbench.sweep_id"] == sweep_id] if runs is not None and len(runs) else None
    void = replaced_in_place(tonight, control.reference) if tonight is not None else ""
    labels = _labels(outcomes)
    out: list[ControlVerdict] = []
    for metric in METRICS:
        trials = _trials(outcomes, metric)
        units = sorted({u for (u, h, _) in trials if h in control.covered})
        for unit in units:
            for h in control.covered:
                test, ref = trials.get((unit, h, TEST), []), trials.get((unit, h, REFERENCE), [])
                if not test and not ref:
                    continue
                earlier = earlier_trial_means(runs, samples, h, unit, metric, sweep_id)
                paired = trial_ratio(test, ref, direction(metric), earlier=earlier, metric=metric, alpha=alpha,
                                     min_effect=min_effect)
                previous, ids = previous_reference(runs, unit, h, sweep_id, control.reference)
                before = list(samples(ids, f"{metric}_rep").values()) if ids else []
                shift = reference_shift_trials(before, ref, earlier=earlier, metric=metric, previous_sweep=previous,
                                               alpha=alpha, min_effect=min_effect)
                out.append(control_verdict(unit, h, labels.get(h, h), paired, shift, void=void))
    return out


def tonight_build(runs: Optional[pd.DataFrame]) -> tuple[Optional[Reference], str]:
    """The build under test tonight as a reference to promote, or why it cannot be (no finished run recorded
    where its build is, or the units ran different builds)."""
    if runs is None or len(runs) == 0 or "tags.backend.binary_dir" not in runs.columns:
        return None, "no finished run of the build under test records its directory (backend.binary_dir)"
    tests = runs[~runs["tags.jbench.config_hash"].map(is_reference_hash) & (runs["status"] == "FINISHED")]
    dirs = sorted({d for d in tests["tags.backend.binary_dir"] if isinstance(d, str) and d})
    if len(dirs) != 1:
        return None, ("no finished run of the build under test records its directory (backend.binary_dir)"
                      if not dirs else f"the units ran different builds ({', '.join(dirs)})")
    commits = sorted({c for c in tests.get("tags.backend.build_commit", pd.Series(dtype=object))
                      if isinstance(c, str) and c})
    return Reference(dirs[0], commits[0] if len(commits) == 1 else "", "accepted"), ""


def verdict_tags(verdicts: Sequence[ControlVerdict]) -> str:
    return "; ".join(f"{v.unit}/{v.config_hash}/{v.metric}: {v.verdict}"
                     + (f" {(v.paired.ratio - 1) * 100:+.2f} %" if math.isfinite(v.paired.ratio) else "")
                     for v in verdicts)[:4900]


__all__ = ["REFERENCE_SUFFIX", "ROLE_KEY", "TEST", "REFERENCE", "RUN_TAG", "TAG_CONTROL", "TAG_REFERENCE",
           "TAG_REFERENCE_COMMIT", "TAG_PROMOTED", "TAG_PROMOTED_COMMIT", "TAG_VERDICTS", "Reference", "ControlSetup",
           "ControlVerdict", "NightRatio", "ReferenceShift", "reference_hash", "is_reference_hash",
           "accepted_reference", "control_due", "setup", "control_plan", "judge", "previous_reference",
           "replaced_in_place", "tonight_build", "verdict_tags", "earlier_trial_means", "with_control_rounds", "TAG_REPETITIONS", "RUN_TAG_REPETITIONS",
           "BUDGET_NIGHTS", "earlier_spreads", "budgets", "with_repetitions", "budget_tags"]
