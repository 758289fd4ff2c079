"""Confirming a nightly alarm by measuring again: the previous good build and the new build, interleaved.

After `jbench nightly` finds regressions (over the history, or with the two-sweep gate while a configuration has
too few nights for it), each alarmed unit x configuration is measured again before the alarm is reported (on by
default; `--no-confirm` turns it off). The builds come from the runs (jbench.analysis.paired.targets): A, the
build of the night before the change, and B, the newest night's. They run as one small sweep on that unit alone,
leased again (farm place or device entry), in the configuration's own power state (applied, verified and restored
by the sweep as in any sweep), in the order A B A B ... (`pairs` rounds). Each trial is a full measurement of the
configuration (its repetitions); the pairs go to the paired test (jbench.analysis.paired.paired_change), whose
verdicts are written back into the report (`settle`).

The runs are recorded in the experiment `<nightly experiment>-confirm` (never in the nightly's own: they would be
nights of its history), as a sweep whose parent run carries the verdicts (tags confirm.*). Anything that keeps the
confirmation from running (the previous build is gone from the unit, the unit is not free, a trial failed) leaves
the alarm standing, unconfirmed, with the reason.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import pandas as pd

from jbench.analysis.paired import (ConfirmSettings, PairedChange, Skipped, Target, direction, paired_change, settle,
                                     targets)
from jbench.analysis.history import HistoryReport
from jbench.analysis.regress import RegressReport
from jbench.core.results import Status
from jbench.sweeps.plan import Plan
from jbench.core.trial import Trial

log = logging.getLogger("jbench.confirm")

PREVIOUS, NEW = "previous", "new"
BUILD_KEY = "confirm.build"  # the trial point that tells A from B (and names the runs)


@dataclass
class Confirmation:
    """What happened to one alarmed unit x configuration."""

    unit: str
    config_hash: str
    label: str
    metrics: list[str]
    status: str  # confirmed | not confirmed | mixed | not run
    reason: str = ""  # not run: why
    target: Optional[Target] = None
    changes: list[PairedChange] = field(default_factory=list)
    sweep_id: str = ""
    parent_run_id: Optional[str] = None

    def describe(self) -> str:
        head = f"{self.unit} {self.label} [{self.config_hash}]: {self.status}"
        if self.status == "not run":
            return f"{head}: {self.reason}"
        t = self.target
        builds = f"previous {t.previous.describe()} vs new {t.new.describe()}" if t else ""
        return f"{head} ({builds}; sweep {self.sweep_id}): " + "; ".join(c.describe() for c in self.changes)


def with_changes(config: dict, changes: dict[str, Any]) -> dict:
    """A copy of a plain trial config with dotted keys set (the trial's typed view is made from it later)."""
    out = copy.deepcopy(config)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def confirmation_plan(nightly: Plan, target: Target, settings: ConfirmSettings, experiment: str) -> Plan:
    """The sweep that measures A and B interleaved on the target's unit: `pairs` rounds of [A, B]."""
    base = next((t for t in nightly.trials if t.config_hash == target.config_hash), None)
    if base is None:
        raise LookupError(f"configuration {target.config_hash} is not in tonight's plan")
    trials: list[Trial] = []
    for r in range(1, settings.pairs + 1):
        for which, build in ((PREVIOUS, target.previous), (NEW, target.new)):
            changes: dict[str, Any] = {"backend.binary_dir": build.binary_dir}
            if settings.repetitions:
                changes["backend.repetitions"] = settings.repetitions
            elif base.rounds > 1:  # the nightly split its repetitions over rounds: a pair gets them all
                changes["backend.repetitions"] = base.cfg.backend.repetitions * base.rounds
            config = with_changes(base.config, changes)
            trials.append(Trial(index=len(trials) + 1, config=config, choices=dict(base.choices),
                                point={**base.point, BUILD_KEY: which}, config_hash=base.config_hash,
                                round=r, rounds=settings.pairs))
    pool = nightly.pool
    if pool is not None:
        if pool.coordinator:
            if not target.place:  # any other place of the class would be another unit
                raise LookupError(f"the runs of unit {target.unit} do not record its farm place (tag farm.place)")
            pool = dataclasses.replace(pool, selector={**pool.selector, "name": target.place}, count=1)
        else:
            members = [m for m in pool.members if m.get("name") == target.unit]
            if not members:
                raise LookupError(f"unit {target.unit} is no longer a device entry of class {pool.device_class}")
            pool = dataclasses.replace(pool, members=members)
    tracking = dataclasses.replace(nightly.tracking, experiment_name=experiment)
    # Every round is measured (nothing is "already FINISHED"), and no round is dropped for noise.
    sweep = dataclasses.replace(nightly.sweep, rerun=True, rounds=settings.pairs)
    return dataclasses.replace(nightly, trials=trials, tracking=tracking, sweep=sweep, rounds=settings.pairs,
                               pool=pool, notes=[], problems=[])


def _pairs(outcomes: list, metric: str) -> tuple[list[float], list[float]]:
    """(A values, B values) by round; a round missing either side gives NaN there (the test leaves it out)."""
    by_round: dict[int, dict[str, float]] = {}
    for o in outcomes:
        if o.status != Status.FINISHED:
            continue
        which = o.trial.point.get(BUILD_KEY)
        value = o.metrics.get(metric)
        if which and value is not None:
            by_round.setdefault(o.trial.round, {})[which] = float(value)
    rounds = sorted(by_round)
    nan = float("nan")
    return ([by_round[r].get(PREVIOUS, nan) for r in rounds], [by_round[r].get(NEW, nan) for r in rounds])


def _status(changes: list[PairedChange]) -> str:
    confirmed = [c.confirmed for c in changes]
    return "confirmed" if all(confirmed) else "not confirmed" if not any(confirmed) else "mixed"


def confirm(report: HistoryReport | RegressReport, runs: pd.DataFrame, nightly: Plan, *, experiment: str,
            tracker_factory: Callable[[], Any], settings: ConfirmSettings = ConfirmSettings(),
            say: Callable[[str], None] = lambda m: None, on_trial_start: Callable[[Any], None] = lambda t: None,
            on_trial_end: Callable[[Any], None] = lambda o: None) -> list[Confirmation]:
    """Measure every alarm of `report` again (module doc) and settle its verdicts. Returns one Confirmation per
    unit x configuration. KeyboardInterrupt propagates (the sweep restored the unit)."""
    from jbench.farm.coordinator import CoordinatorError
    from jbench.farm.places import FarmError
    from jbench.sweeps.sweep import PreflightError, run_sweep

    found, skipped = targets(report, runs)
    out = [_not_run(s) for s in skipped]
    confirm_experiment = f"{experiment}-confirm"
    for target in found:
        say(f"confirming the regression of {target.label} on {target.unit}: previous build "
            f"{target.previous.binary_dir} vs new {target.new.binary_dir}, {settings.pairs} pairs")
        try:
            plan = confirmation_plan(nightly, target, settings, confirm_experiment)
            swept = run_sweep(plan, tracker_factory, every_unit=True, on_trial_start=on_trial_start,
                              on_trial_end=on_trial_end)
        except LookupError as exc:
            out.append(_not_run(target, f"cannot plan the confirmation: {exc}"))
            continue
        except PreflightError as exc:
            out.append(_not_run(target, f"the unit is not ready for the confirmation: {exc}"))
            continue
        except (FarmError, CoordinatorError) as exc:
            out.append(_not_run(target, f"the farm gave the unit back for no confirmation: {exc}"))
            continue
        changes = []
        for metric in target.metrics:
            a, b = _pairs(swept.outcomes, metric)
            changes.append(paired_change(a, b, direction(metric), metric=metric, alpha=settings.alpha,
                                         min_effect=settings.min_effect))
        settle(target.alarm, changes)
        failed = [o for o in swept.outcomes if o.status != Status.FINISHED]
        c = Confirmation(target.unit, target.config_hash, target.label, target.metrics, _status(changes),
                         target=target, changes=changes, sweep_id=swept.sweep_id, parent_run_id=swept.parent_run_id)
        if all(ch.n_pairs < 3 for ch in changes):
            c.status = "not run"
            c.reason = (f"{len(failed)} of {len(swept.outcomes)} confirmation trial(s) did not finish"
                        + (f" (first: {failed[0].error})" if failed else ""))
        out.append(c)
        _tag(tracker_factory, c, settings)
        say(f"  {c.describe()}")
    return out


def _not_run(what: Target | Skipped, reason: Optional[str] = None) -> Confirmation:
    reason = reason or getattr(what, "reason", "")
    alarm = what.alarm
    settle(alarm, [], not_run=reason)
    return Confirmation(alarm.unit, alarm.config_hash, alarm.label, list(alarm.metrics), "not run", reason,
                        target=what if isinstance(what, Target) else None)


def _tag(tracker_factory: Callable[[], Any], c: Confirmation, settings: ConfirmSettings) -> None:
    """The verdict on the confirmation sweep's parent run; a store problem costs the tags, not the verdict."""
    if not c.parent_run_id:
        return
    try:
        t = tracker_factory()
        tags = {"confirm.status": c.status, "confirm.unit": c.unit, "confirm.config_hash": c.config_hash,
                "confirm.pairs": settings.pairs, "confirm.alpha": settings.alpha,
                "confirm.threshold": settings.min_effect,
                "confirm.previous_build": c.target.previous.describe() if c.target else "",
                "confirm.new_build": c.target.new.describe() if c.target else ""}
        for ch in c.changes:
            tags[f"confirm.{ch.metric}"] = ch.describe()[:5000]
        t.log(c.parent_run_id, tags=tags)
    except Exception as exc:
        log.error("tagging the confirmation run failed: %s", exc)
