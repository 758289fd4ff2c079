"""The nightly job as a function CI can call: `run_nightly("orin_nano_super")` is `jbench nightly orin_nano_super`.

Steps: plan `+experiment=<exp> device=@CLASS sweep.rerun=true` (planning changes no device); run it
as a class sweep in which every unit runs the whole matrix (each unit is compared with its own history: units
of one class differ); the sweep leases the class (farm places or device entries) and releases it when it
returns, raises, or is interrupted, so the devices are free before regress and report run. Then regress this
sweep per unit (`device.unit`) and configuration -- over the history (change points, jbench.analysis.history) once
a configuration has enough nights, else against the previous night (jbench.analysis.regress); `mode`/`baseline`
choose -- confirm each regression found by measuring the previous and the new build again,
interleaved on that unit (jbench.confirm; on unless `confirm=False`: an alarm that is not confirmed is cleared), write
the HTML report (the sweep's, and the history's series plot), the markdown and the JUnit XML, and
tag the sweep's parent run with the verdict.

A dead unit does not stop the night (device entries of the class; a farm coordinator checks and quarantines its
places itself): every unit is connected first (`probe_units`), the reachable ones are measured, each missing one
is reported (a JUnit error, a markdown line, exit 4) and recorded on the parent run; a unit without a measurement
on `farm.quarantine_after_failures` nights in a row is quarantined -- skipped by the next nightlies, still
reported, until `--unquarantine UNIT` -- decided from the earlier nightly parent runs' tags (`unit_streaks`). A
class where no unit can be reached runs nothing (exit 2, one message naming each unit's reason).

What each night reported is recorded on its parent run (`jbench.nightly.reported`), and read back by the next
nights (`reported_in_store`): a change the history finds significant only after it left the newest nights, and
that no night reported, is reported then, with its first night (jbench.analysis.history.Reported).

The same-night control (jbench.sweeps.control; docs/farm.md): on a class with a reference build (`farm.reference`:
declared, or the last one accepted with `--promote-reference`) every covered configuration also runs the reference
build on the same unit, counterbalanced (T R R T), and a code change is judged on that night's paired ratio
(jbench.analysis.paired): a paired regression fails its first night; an absolute alarm whose paired ratio holds is
cleared ("environment change" when the reference moved too); configurations the control judged have a verdict
even before the history has enough nights. Promotions are recorded on the parent run. On a control night each
covered configuration's repetitions per build come from a noise budget (`farm.target_interval_pct`: its earlier
nights' within-night spread, read before any device is touched; without one, the configured count), recorded on
each run and on the parent run.

Exit codes (docs/cli.md): 0 clean, 1 regression, 2 nothing run (bad input, no unit reachable), 3 no verdict,
4 trials failed or a unit not measured. Precedence: 2 (stops before anything runs), then 1, then 4, then 3, then 0.
"""

from __future__ import annotations

import dataclasses
import logging
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from jbench.analysis.paired import ConfirmSettings, ControlVerdict, settle_by_control
from jbench.analysis.history import (DEFAULT_SETTINGS, ChangeKey, HistoryError, HistoryReport, Reported, history,
                                     max_nights, reported_changes)
from jbench.analysis.regress import (REGRESSION, NoData, RegressError,
                                     RegressReport, regress)
from jbench.core.results import Category, Status
from jbench.core.trial import short_label
from jbench.runner import scheduler as sched
from jbench.sweeps import control as ctl
from jbench.sweeps.plan import Plan
from jbench.core.exitcodes import ExitCode
from jbench.tracking.common import store_exists, writable_problem

log = logging.getLogger("jbench")

VERDICTS = {ExitCode.OK: "clean", ExitCode.FAILED: "regression", ExitCode.NO_VERDICT: "no verdict",
            ExitCode.TRIALS_FAILED: "trials failed"}


class NightlyError(Exception):
    """Nothing was run: bad input (class, config, overrides, output paths, baseline) or devices not ready."""


def exit_code(regress_code: int, failed_trials: int, missing_units: int = 0) -> int:
    """The nightly's code from regress's (0, 1 or 3), the count of FAILED trials and of units not measured. A
    regression is a measured verdict on the trials that ran, so it wins; failed trials and missing units come next
    (the matrix is incomplete: never green, and it outranks "no verdict" because something broke, which a missing
    baseline does not say)."""
    if regress_code == ExitCode.FAILED:
        return ExitCode.FAILED
    if failed_trials or missing_units:
        return ExitCode.TRIALS_FAILED
    return regress_code


# Tags of the nightly's parent run that later nights read back (the store is the memory, never this process).
TAG_REPORTED = "jbench.nightly.reported"  # the changes this night reported (chunks: .1, .2, ... when long)
TAG_MISSING = "jbench.nightly.missing"  # unit: why it was not measured; ...
TAG_STREAKS = "jbench.nightly.unit_failures"  # unit=nights in a row without a measurement, ...
TAG_QUARANTINED = "jbench.nightly.quarantined"  # units skipped as quarantined (this night included)
_CHUNK = 4900  # below MLflow's tag value limit
_NONE = "none"  # a recorded empty list (an absent tag: a night that recorded nothing)


def encode_changes(keys: Sequence[ChangeKey]) -> dict[str, str]:
    """The reported changes as tags (`TAG_REPORTED`, then `.1`, `.2`, ... while the list is long)."""
    text = ";".join("|".join(k) for k in dict.fromkeys(keys)) or _NONE
    chunks = [text[i:i + _CHUNK] for i in range(0, len(text), _CHUNK)]
    return {TAG_REPORTED if i == 0 else f"{TAG_REPORTED}.{i}": c for i, c in enumerate(chunks)}


def decode_changes(tags: dict[str, Any]) -> Optional[list[ChangeKey]]:
    """The changes a night's tags record, or None when it recorded none (a night before the record existed)."""
    first = tags.get(TAG_REPORTED)
    if not isinstance(first, str) or not first:
        return None
    parts, i = [first], 1
    while isinstance(tags.get(f"{TAG_REPORTED}.{i}"), str):
        parts.append(tags[f"{TAG_REPORTED}.{i}"])
        i += 1
    text = "".join(parts)
    if text == _NONE:
        return []
    return [tuple(e.split("|", 3)) for e in text.split(";") if e.count("|") == 3]  # type: ignore[misc]


def reported_in_store(parents: Any) -> Reported:
    """What the earlier nights reported, from their parent runs (a frame of `kinds=("sweep",)` runs)."""
    changes: set[ChangeKey] = set()
    judged: set[str] = set()
    if parents is None or len(parents) == 0:
        return Reported()
    for row in parents.to_dict("records"):
        tags = {k[len("tags."):]: v for k, v in row.items() if k.startswith("tags.") and isinstance(v, str)}
        keys = decode_changes(tags)
        if keys is None or not tags.get("jbench.sweep_id"):
            continue
        judged.add(tags["jbench.sweep_id"])
        changes.update(keys)
    return Reported(frozenset(changes), frozenset(judged))


def unit_streaks(parents: Any, device_class: str) -> dict[str, int]:
    """Nights in a row each unit of the class went without a measurement, as the newest earlier nightly of the
    class recorded them (`TAG_STREAKS`); {} without one."""
    if parents is None or len(parents) == 0 or "tags.jbench.nightly.class" not in parents.columns:
        return {}
    mine = parents[parents["tags.jbench.nightly.class"] == device_class]
    if "tags.jbench.nightly.verdict" in mine.columns:
        mine = mine[mine["tags.jbench.nightly.verdict"].notna()]
    if mine.empty:
        return {}
    text = mine.sort_values(["start_time", "run_id"]).iloc[-1].get(f"tags.{TAG_STREAKS}")
    out: dict[str, int] = {}
    for part in (text.split(",") if isinstance(text, str) else []):
        unit, _, count = part.partition("=")
        if unit and count.isdigit():
            out[unit] = int(count)
    return out


def next_streaks(units: Sequence[str], before: dict[str, int], failed: set[str]) -> dict[str, int]:
    """Each unit's run of nights without a measurement after tonight: one more for a unit that failed tonight,
    else 0."""
    return {u: before.get(u, 0) + 1 if u in failed else 0 for u in units}


def _night_failed(unit: str, outcomes: Sequence[Any]) -> bool:
    """A unit measured nothing tonight for device reasons: every trial of it FAILED as lost or a device fault."""
    mine = [o for o in outcomes if o.device == unit]
    return bool(mine) and all(o.status == Status.FAILED and o.category in (Category.DEVICE, Category.CONNECTION_LOST)
                              for o in mine)


def probe_units(members: Sequence[dict], profile: Any, owner: str) -> dict[str, str]:
    """Connect each unit (side by side) and close it again: {unit: why it cannot be used} for those that fail.
    Nothing on a device changes (no lease, no power state)."""
    from jbench.runner.session import DeviceSession

    found: dict[str, str] = {}

    def probe(member: dict) -> None:
        session = DeviceSession(member, profile, owner=owner)
        try:
            problems = session.connect()
        except Exception as exc:  # whatever breaks while connecting makes the unit unusable tonight, not the night
            problems = [f"{type(exc).__name__}: {exc}"]
        finally:
            session.close()
        if problems:
            found[str(member.get("name"))] = "; ".join(problems)

    sched.each(probe, list(members))
    return found


@dataclass
class NightlyResult:
    device_class: str
    experiment: str  # the MLflow experiment the sweep recorded to
    sweep_id: str
    parent_run_id: Optional[str]
    tracking_uri: str
    outcomes: list  # the sweep's TrialOutcomes (a trial once per unit)
    exit_code: int
    regress: Optional[RegressReport | HistoryReport] = None
    mode: str = ""  # history | pairwise (the one regress ran in)
    no_verdict_reason: str = ""
    markdown: str = ""
    junit_xml: str = ""
    report_html: Optional[Path] = None
    notes: list[str] = field(default_factory=list)
    confirmations: list = field(default_factory=list)  # jbench.confirm.Confirmation per alarmed unit x configuration
    control: Optional[ctl.ControlSetup] = None  # tonight's same-night control (on, or off with why)
    control_verdicts: list[ControlVerdict] = field(default_factory=list)  # per unit x configuration x rate
    promoted: Optional[ctl.Reference] = None  # the build accepted as the reference tonight (--promote-reference)
    budgets: dict = field(default_factory=dict)  # config hash -> NoiseBudget: repetitions per build tonight, and why
    missing: dict[str, str] = field(default_factory=dict)  # unit -> why it was not measured (unreachable, quarantined)
    quarantined: list[str] = field(default_factory=list)  # units quarantined (skipped, or from this night on)
    unit_failures: dict[str, int] = field(default_factory=dict)  # unit -> nights in a row without a measurement

    @property
    def verdict(self) -> str:
        return VERDICTS.get(self.exit_code, str(self.exit_code))

    @property
    def failed(self) -> list:
        return [o for o in self.outcomes if o.status == Status.FAILED]

    @property
    def units(self) -> list[str]:
        return sorted({o.device for o in self.outcomes if o.device})

    @property
    def regressed_units(self) -> list[str]:
        paired = {v.unit for v in self.control_verdicts if v.verdict == REGRESSION}
        if isinstance(self.regress, HistoryReport):
            return sorted(set(self.regress.regressed_units) | paired)
        return sorted({r.device for r in (self.regress.results if self.regress else []) if r.counts_as_regression}
                      | paired)


def _check_output(path: Optional[str | Path], *, directory: bool, option: str) -> None:

    problem = writable_problem(path, directory=directory) if path else None
    if problem:
        raise NightlyError(f"cannot write {path}: {problem}. Give a writable {option} path")


def plan_nightly(device_class: str, *, experiment: str = "nightly", overrides: Sequence[str] = (),
                 config_dirs: Sequence[str | Path] = (), results_dir: Optional[str | Path] = None) -> Plan:
    """The nightly's plan (no device touched); NightlyError names what is wrong."""
    from jbench.config import ConfigError, check_overrides, user_config_dirs
    from jbench.sweeps.plan import plan

    clashes = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] in ("device", "experiment")]
    if clashes:
        raise NightlyError(f"'{clashes[0]}': the nightly runs device=@{device_class} and +experiment={experiment}; "
                           "give the class as the argument and the experiment with --experiment")
    argv = [f"+experiment={experiment}", f"device=@{device_class}", *overrides,
            "sweep.rerun=true"]  # every night measures again: resume would skip what an earlier night finished
    if results_dir is not None:
        argv.append("tracking.results_dir='" + str(results_dir).replace("\\", "\\\\").replace("'", "\\'") + "'")
    try:
        check_overrides(argv)
        p = plan(argv, user_config_dirs([str(d) for d in config_dirs]))
    except ConfigError as exc:
        raise NightlyError(str(exc)) from None
    if p.problems:
        raise NightlyError(f"{len(p.problems)} problem(s) in the nightly sweep:\n"
                           + "\n".join(f"  - {x}" for x in p.problems))
    if not p.trials:
        raise NightlyError(f"experiment '{experiment}' has no trials")
    return p


def _check_baseline(uri: str, exp_name: str, baseline: Optional[str]) -> None:
    """A baseline that names a tag or a sweep must exist in the store before the devices are leased."""
    from jbench.analysis.regress import _parse_date

    if baseline is None or baseline in ("last", "all") or _parse_date(baseline) is not None:
        return
    found = False
    if store_exists(uri):
        from jbench.tracking.reader import runs_frame

        try:
            df = runs_frame(uri, [exp_name], kinds=None)
        except LookupError:
            df = None
        if df is not None and not df.empty:
            found = any(col in df.columns and (df[col] == baseline).any()
                        for col in ("tags.jbench.baseline", "tags.jbench.sweep_id"))
    if not found:
        raise NightlyError(f"--baseline '{baseline}' is not 'last', 'all', a date (YYYY-MM-DD), nor a jbench.baseline "
                           f"tag or sweep id in experiment '{exp_name}'")


class Nightly:
    """A planned nightly (the constructor checks every input and touches no device); `run()` does the rest."""

    def __init__(self, device_class: str, *, experiment: str = "nightly", baseline: Optional[str] = None,
                 mode: str = "auto",
                 overrides: Sequence[str] = (), config_dirs: Sequence[str | Path] = (),
                 results_dir: Optional[str | Path] = None, junit: Optional[str | Path] = None,
                 markdown: Optional[str | Path] = None, report_dir: Optional[str | Path] = None,
                 confirm: bool = True, confirm_settings: ConfirmSettings = ConfirmSettings(),
                 unquarantine: Sequence[str] = (), promote_reference: bool = False):
        for path, directory, option in ((junit, False, "--junit"), (markdown, False, "--markdown"),
                                        (report_dir, True, "--report-dir")):
            _check_output(path, directory=directory, option=option)
        if mode not in ("auto", "history", "pairwise"):
            raise NightlyError(f"mode '{mode}' is not auto, history or pairwise")
        if mode == "history" and baseline is not None:
            raise NightlyError("--baseline chooses the pairwise comparison; drop it or use --mode pairwise")
        problems = confirm_settings.problems() if confirm else []
        if problems:
            raise NightlyError("; ".join(problems))
        self.device_class, self.baseline, self.mode = device_class, baseline, mode
        self.confirm, self.confirm_settings = confirm, confirm_settings
        self.junit, self.markdown, self.report_dir = junit, markdown, report_dir
        self.plan = plan_nightly(device_class, experiment=experiment, overrides=overrides, config_dirs=config_dirs,
                                 results_dir=results_dir)
        from jbench.sweeps.sweep import SweepInputError, check_store

        try:
            self.store = check_store(self.plan.tracking, self.plan.experiment)
        except SweepInputError as exc:
            raise NightlyError(str(exc)) from None
        self.uri = self.store.uri
        self.experiment = self.plan.tracking.experiment_name or self.plan.experiment
        _check_baseline(self.uri, self.experiment, baseline)
        self.streaks, self.quarantined = self._quarantine(list(unquarantine))
        self.promote_reference = promote_reference
        # The same-night control, decided from the config and the earlier nights before a device is touched.
        farm = self.plan.pool.farm if self.plan.pool is not None else self.plan.trials[0].cfg.farm
        try:
            self.control = ctl.setup(self.plan, device_class, farm, None if self.store.spool else self._parents(self.uri))
            self.plan = ctl.with_control_rounds(self.plan, self.control, farm.control_rounds)
            # The noise budget: the covered configurations' repetitions from their earlier nights' spread.
            self.budgets = self._budgets(farm)
        except ValueError as exc:
            raise NightlyError(str(exc)) from None
        self.plan = ctl.control_plan(ctl.with_repetitions(self.plan, self.budgets), self.control)

    @property
    def probes_units(self) -> bool:
        """Device entries of the class are connected first and a dead one left out; a farm coordinator's lease
        checks (and quarantines) its places itself."""
        pool = self.plan.pool
        return pool is not None and not pool.coordinator and bool(pool.members)

    def _quarantine(self, unquarantine: list[str]) -> tuple[dict[str, int], dict[str, str]]:
        """(each unit's nights in a row without a measurement, {quarantined unit: why}) from the earlier nightlies'
        parent runs; NightlyError when every unit is quarantined or --unquarantine names no unit of the class."""
        if not self.probes_units:
            if unquarantine:
                raise NightlyError("--unquarantine is for device entries of a class; a farm's places are "
                                   "unquarantined with `jbench farm unquarantine PLACE`")
            return {}, {}
        names = [str(m.get("name")) for m in self.plan.pool.members]
        unknown = [u for u in unquarantine if u not in names]
        if unknown:
            raise NightlyError(f"--unquarantine {unknown[0]}: not a unit of {self.device_class} ({', '.join(names)})")
        # A server that does not answer (measuring into the spool) tells nothing of earlier nights: none quarantined.
        streaks = {} if self.store.spool else unit_streaks(self._parents(self.uri), self.device_class)
        after = self.plan.pool.farm.quarantine_after_failures
        quarantined = {u: (f"quarantined: no measurement on {streaks[u]} nights in a row (farm.quarantine_after_"
                           f"failures={after}); `jbench nightly {self.device_class} --unquarantine {u}` tries it again")
                       for u in names if after > 0 and streaks.get(u, 0) >= after and u not in unquarantine}
        if len(quarantined) == len(names):
            raise NightlyError(f"every unit of {self.device_class} is quarantined; nothing was run:\n"
                               + "\n".join(f"  - {u}: {why}" for u, why in quarantined.items()))
        return streaks, quarantined

    def _budgets(self, farm: Any) -> dict:
        """Each configuration's repetitions tonight (jbench.sweeps.control.budgets), the earlier nights read from
        the store only when the budget can use them; a store that does not answer costs the budget, not the night."""
        from jbench.tracking.reader import repetition_samples, runs_frame, with_current_hashes

        def read(problem: str = "") -> dict:
            runs = None
            if not problem and self.control.on and farm.target_interval_pct is not None and store_exists(self.uri):
                try:
                    runs = with_current_hashes(runs_frame(self.uri, [self.experiment]))
                except LookupError:  # no such experiment yet: no earlier night
                    runs = None
            return ctl.budgets(self.plan, self.control, farm, runs,
                               lambda ids, m: repetition_samples(self.uri, list(ids), m),
                               alpha=self.confirm_settings.alpha, store_problem=problem)

        if self.store.spool:
            return read("the store does not answer (the results go to the spool): no earlier night was read")
        try:
            return read()
        except ValueError:
            raise
        except Exception as exc:  # the store broke while reading: the configured counts run
            log.warning("the earlier nights' spread was not read: %s", exc)
            return read(f"the earlier nights were not read: {exc}")

    def _parents(self, uri_or_tracker: Any) -> Any:
        """The experiment's earlier sweep parent runs (None: no store or no such experiment yet)."""
        if isinstance(uri_or_tracker, str) and not store_exists(uri_or_tracker):
            return None
        from jbench.tracking.reader import runs_frame

        try:
            return runs_frame(uri_or_tracker, [self.experiment], kinds=("sweep",))
        except LookupError:
            return None
        except Exception as exc:  # a store that does not answer: nothing known of earlier nights
            log.warning("the earlier nightlies were not read: %s", exc)
            return None

    def _reachable(self, plan: Plan, missing: dict[str, str], say: Callable[[str], None]) -> Plan:
        """The plan narrowed to the units that answer now; the others go into `missing` with their reason.
        NightlyError when none answers (nothing was run)."""
        pool = plan.pool
        members = [m for m in pool.members if str(m.get("name")) not in missing]
        dead = probe_units(members, plan.trials[0].cfg.profile, owner="nightly-probe")
        for unit, why in dead.items():
            missing[unit] = f"unreachable: {why}"
            say(f"unit {unit} is not measured tonight: {why}")
        alive = [m for m in members if str(m.get("name")) not in dead]
        if not alive:
            raise NightlyError(f"no unit of {self.device_class} can be reached; nothing was run:\n"
                               + "\n".join(f"  - {u}: {why}" for u, why in missing.items()))
        return dataclasses.replace(plan, pool=dataclasses.replace(pool, members=alive))

    def run(self, *, on_trial_start: Callable[[Any], None] = lambda t: None,
            on_trial_end: Callable[[Any], None] = lambda o: None,
            say: Callable[[str], None] = lambda m: None) -> NightlyResult:
        """Sweep (leased and released by the class sweep), regress, report. KeyboardInterrupt propagates after
        the sweep recorded its runs as KILLED and gave the devices back."""
        from jbench.sweeps.sweep import PreflightError, run_sweep, tracker_factory

        tracker = tracker_factory(self.plan.tracking, self.store, say)
        missing = dict(self.quarantined)
        for unit, why in self.quarantined.items():
            say(f"unit {unit} is not measured tonight: {why}")
        plan = self._reachable(self.plan, missing, say) if self.probes_units else self.plan
        while True:
            try:
                swept = run_sweep(plan, tracker, on_trial_start=on_trial_start, on_trial_end=on_trial_end,
                                  every_unit=True)
                break
            except PreflightError as exc:
                before = len(missing)
                if self.probes_units:  # a unit that died since it was probed: the others still run
                    plan = self._reachable(plan, missing, say)
                if len(missing) == before:
                    raise NightlyError(f"the devices of {self.device_class} are not ready; nothing was run:\n{exc}"
                                       ) from None
        # The devices are released here: whatever regress and report do next, they hold nothing.
        result = NightlyResult(self.device_class, swept.experiment, swept.sweep_id, swept.parent_run_id,
                               swept.tracking_uri, swept.outcomes, ExitCode.NO_VERDICT, notes=list(swept.notes),
                               missing=missing)
        if self.probes_units:
            names = [str(m.get("name")) for m in self.plan.pool.members]
            failed = set(missing) | {u for u in names if _night_failed(u, swept.outcomes)}
            result.unit_failures = next_streaks(names, self.streaks, failed)
            after = self.plan.pool.farm.quarantine_after_failures
            result.quarantined = sorted(u for u, n in result.unit_failures.items() if after > 0 and n >= after)
            for u in result.quarantined:
                if u not in self.quarantined:
                    result.notes.append(f"unit {u} quarantined: no measurement on {result.unit_failures[u]} nights "
                                        f"in a row; the next nightlies skip it until `jbench nightly "
                                        f"{self.device_class} --unquarantine {u}`")
        t = swept.tracker
        report: Optional[RegressReport] = None
        history_runs = None
        if t is None or swept.parent_run_id is None:
            result.no_verdict_reason = "no trial ran"
        elif t.spooling is not None:
            result.no_verdict_reason = (f"the results went to the spool ({t.spool_uri}): run `jbench sync`, then "
                                        f"`jbench regress --experiment {swept.experiment}`")
        else:
            report, result.no_verdict_reason, df, history_runs = self._regress(t, swept.experiment, swept.sweep_id)
            result.mode = "history" if isinstance(report, HistoryReport) else "pairwise"
            result.control_verdicts = self._judge_control(t, swept, history_runs, say)
            self._tag_budgets(t, swept)
            if report is not None and result.control_verdicts:
                settle_by_control(report, result.control_verdicts)
            if report is not None and _unsettled(report) and self.confirm:
                result.confirmations = self._confirm(report, history_runs, swept.experiment, tracker, say,
                                                     on_trial_start, on_trial_end)
            if df is not None:
                result.report_html = self._report(t, df, swept, result, report)
        result.regress = report
        result.control = self.control
        result.budgets = self.budgets
        code = report.exit_code if report else ExitCode.NO_VERDICT
        if report is not None and report.exit_code == ExitCode.NO_VERDICT:
            result.no_verdict_reason = report.verdict_reason
        code = _with_control(code, result)
        result.exit_code = exit_code(code, len(result.failed), len(result.missing))
        if self.promote_reference and t is not None and swept.parent_run_id and t.spooling is None:
            result.promoted, why = ctl.tonight_build(history_runs[history_runs["tags.jbench.sweep_id"] == swept.sweep_id]
                                                     if history_runs is not None and len(history_runs) else None)
            result.notes.append(f"reference promoted: {result.promoted.describe()}; the next control nights measure "
                                "it beside the build under test" if result.promoted
                                else f"reference not promoted: {why}")
        elif self.promote_reference:
            result.notes.append("reference not promoted: no trial run was recorded in the store tonight")
        result.markdown = _markdown(result)
        result.junit_xml = _junit(result)
        for path, text in ((self.junit, result.junit_xml), (self.markdown, result.markdown)):
            if path:
                Path(path).write_text(text)
        if t is not None and swept.parent_run_id and t.spooling is None:
            self._tag_parent(t, result)
        return result

    def _regress(self, t: Any, experiment: str,
                 sweep_id: str) -> tuple[Optional[RegressReport | HistoryReport], str, Any, Any]:
        """(this sweep judged over its history or against the baseline, why there is no verdict, this sweep's
        trial runs, every trial run of the experiment). The reference build's runs (the same-night control) are
        never part of the build under test's series."""
        from jbench.tracking.reader import repetition_samples, runs_frame, with_current_hashes

        runs = with_current_hashes(runs_frame(t, [experiment]))
        df = runs
        if "tags.jbench.config_hash" in runs.columns:
            df = runs[~runs["tags.jbench.config_hash"].map(ctl.is_reference_hash)]
        mine = runs[runs["tags.jbench.sweep_id"] == sweep_id] if "tags.jbench.sweep_id" in runs.columns else runs.iloc[:0]
        loader = lambda run_ids, metric: repetition_samples(t, list(run_ids), metric)  # noqa: E731
        mode = self.mode
        if mode == "auto":
            enough = self.baseline is None and max_nights(df) >= DEFAULT_SETTINGS.min_nights
            mode = "history" if enough else "pairwise"
        try:
            if mode == "history":
                report = history(df, current=[sweep_id], reported=reported_in_store(self._parents(t)))
                if not report.results:
                    return None, "no finished trial runs to check", mine if len(mine) else None, runs
                return report, "", mine, runs
            return regress(df, loader, baseline=self.baseline or "last", current=[sweep_id]), "", mine, runs
        except NoData as exc:
            return None, str(exc), mine if len(mine) else None, runs
        except (RegressError, HistoryError) as exc:  # e.g. a baseline tag that matches none of this sweep's
            return None, str(exc), mine if len(mine) else None, runs

    def _judge_control(self, t: Any, swept: Any, runs: Any, say: Callable[[str], None]) -> list[ControlVerdict]:
        """The same-night control's verdicts (jbench.sweeps.control.judge), with each run of the night tagged test
        or reference; a store problem costs the tags, not the verdicts."""
        if not self.control.on:
            return []
        from jbench.tracking.reader import repetition_samples

        verdicts = ctl.judge(swept.outcomes, self.control, sweep_id=swept.sweep_id, runs=runs,
                             samples=lambda ids, m: repetition_samples(t, list(ids), m),
                             alpha=self.confirm_settings.alpha, min_effect=self.confirm_settings.min_effect)
        for v in verdicts:
            say(f"control: {v.describe()}")
        try:
            for o in swept.outcomes:
                if o.run_id:
                    role = ctl.REFERENCE if ctl.is_reference_hash(o.trial.config_hash) else ctl.TEST
                    t.log(o.run_id, tags={ctl.RUN_TAG: role})
        except Exception as exc:
            log.error("tagging the control's runs failed: %s", exc)
        return verdicts

    def _tag_budgets(self, t: Any, swept: Any) -> None:
        """Each run tagged with its configuration's repetitions per build tonight and why (the noise budget)."""
        try:
            for o in swept.outcomes:
                h = o.trial.config_hash
                b = self.budgets.get(h[:-len(ctl.REFERENCE_SUFFIX)] if ctl.is_reference_hash(h) else h)
                if o.run_id and b is not None:
                    t.log(o.run_id, tags={ctl.RUN_TAG_REPETITIONS: b.describe()[:_CHUNK]})
        except Exception as exc:
            log.error("tagging the runs with their repetitions failed: %s", exc)

    def _confirm(self, report: HistoryReport | RegressReport, runs: Any, experiment: str, tracker: Callable[[], Any],
                 say: Callable[[str], None], on_trial_start: Callable[[Any], None],
                 on_trial_end: Callable[[Any], None]) -> list:
        """Each alarm measured again (jbench.confirm); a confirmation that breaks leaves its alarm standing."""
        from jbench.sweeps.confirm import confirm

        say(f"{len(_unsettled(report))} regression(s): confirming them on their units")
        try:
            return confirm(report, runs, self.plan, experiment=experiment, tracker_factory=tracker,
                           settings=self.confirm_settings, say=say, on_trial_start=on_trial_start,
                           on_trial_end=on_trial_end)
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # the alarm is a measured verdict: never lost to the confirmation's failure
            log.error("the confirmation failed: %s", exc)
            for r in _unsettled(report):
                r.confirmation = f"not confirmed either way: the confirmation failed: {exc}"
            return []

    def _report(self, t: Any, df: Any, swept: Any, result: NightlyResult,
                report: Optional[RegressReport | HistoryReport] = None) -> Optional[Path]:
        """The HTML report of this sweep (with the history's series plot in history mode), attached to its parent
        run; a failure is a note, never the verdict's loss."""
        from jbench.reporting.report import build_report
        from jbench.tracking.reader import repetition_samples, telemetry_frame

        out = Path(self.report_dir or Path(t.results_dir) / "reports" / f"nightly-{self.device_class}-{swept.sweep_id}")
        try:
            tel = telemetry_frame(t, list(df["run_id"]))
            files = build_report(df, lambda ids, m: repetition_samples(t, list(ids), m),
                                 tel if tel is not None and len(tel) else None, out_dir=out,
                                 title=f"jbench nightly {self.device_class}: sweep {swept.sweep_id}")
            t.log_files(swept.parent_run_id, [("report", files.html_path), ("report", files.markdown_path),
                                              *(("report", png) for png in files.pngs.values())])
            if isinstance(report, HistoryReport):
                from jbench.reporting.history import build_history_report

                hist = build_history_report(report, out_dir=out / "history",
                                            title=f"jbench nightly {self.device_class}: history to {swept.sweep_id}")
                t.log_files(swept.parent_run_id, [("report/history", hist.html_path),
                                                  ("report/history", hist.markdown_path),
                                                  *(("report/history", png) for png in hist.pngs.values())])
            return files.html_path
        except Exception as exc:  # the verdict stands without the report
            log.error("the nightly report was not written: %s", exc)
            result.notes.append(f"report not written: {exc}")
            return None

    def _tag_parent(self, t: Any, result: NightlyResult) -> None:
        try:
            t.log(result.parent_run_id, tags={
                "jbench.nightly.verdict": result.verdict, "jbench.nightly.exit_code": result.exit_code,
                "jbench.nightly.class": self.device_class, "jbench.nightly.mode": result.mode,
                "jbench.nightly.baseline": self.baseline or ("history" if result.mode == "history" else "last"),
                "jbench.nightly.regressed_units": ",".join(result.regressed_units),
                "jbench.nightly.confirmations": "; ".join(f"{c.unit}/{c.config_hash}: {c.status}"
                                                          for c in result.confirmations)[:5000],
                "jbench.nightly.failed_trials": len(result.failed),
                **encode_changes(reported_changes(result.regress) if result.regress is not None else []),
                **({TAG_MISSING: "; ".join(f"{u}: {why}" for u, why in sorted(result.missing.items()))[:_CHUNK],
                    "jbench.nightly.missing_units": ",".join(sorted(result.missing))} if result.missing else {}),
                **_unit_tags(result), **_control_tags(result)})
            t.log_texts(result.parent_run_id, {"nightly/regress.md": result.markdown,
                                               "nightly/junit.xml": result.junit_xml})
        except Exception as exc:  # the verdict is in the exit code and the files whatever the store says
            log.error("tagging the sweep's parent run with the verdict failed: %s", exc)
            result.notes.append(f"parent run not tagged: {exc}")


def run_nightly(device_class: str, **kwargs: Any) -> NightlyResult:
    """Nightly(device_class, **options).run(): see Nightly. Raises NightlyError when nothing was run."""
    run_keys = ("on_trial_start", "on_trial_end", "say")  # Nightly's own options are the rest (unquarantine, ...)
    hooks = {k: kwargs.pop(k) for k in run_keys if k in kwargs}
    return Nightly(device_class, **kwargs).run(**hooks)


def _unsettled(report: HistoryReport | RegressReport) -> list:
    """The report's alarms nothing has judged yet (the same-night control settles those it measured)."""
    return [r for r in report.alarms() if r.confirmed is None]


def _with_control(code: int, result: NightlyResult) -> int:
    """Regress's code with the same-night control's verdicts: a paired regression fails the night (its first
    night included); a night on which the control decided every unit x configuration measured has a verdict even
    when the history or the two-sweep gate has none yet."""
    verdicts = result.control_verdicts
    if any(v.verdict == REGRESSION for v in verdicts):
        return ExitCode.FAILED
    if code == ExitCode.NO_VERDICT and verdicts:
        measured = {(o.device or "", o.trial.config_hash) for o in result.outcomes
                    if o.status == Status.FINISHED and not ctl.is_reference_hash(o.trial.config_hash)}
        decided = {(v.unit, v.config_hash) for v in verdicts if v.verdict != "no verdict"}
        if measured and measured <= decided:
            result.notes.append(f"{result.no_verdict_reason or 'the absolute series has no verdict yet'}; every "
                                "unit x configuration was judged against the same-night reference instead")
            result.no_verdict_reason = ""
            return ExitCode.OK
    return code


def _control_tags(result: NightlyResult) -> dict[str, str]:
    c = result.control
    tags: dict[str, str] = {}
    if c is not None:
        tags[ctl.TAG_CONTROL] = c.tag[:_CHUNK]
        if c.on and c.reference is not None:
            tags[ctl.TAG_REFERENCE] = c.reference.binary_dir
            tags[ctl.TAG_REFERENCE_COMMIT] = _reference_commit(result) or c.reference.commit
            tags[ctl.TAG_VERDICTS] = ctl.verdict_tags(result.control_verdicts) or _NONE
    if result.budgets:
        tags[ctl.TAG_REPETITIONS] = ctl.budget_tags(result.budgets)[:_CHUNK]
    if result.promoted is not None:
        tags[ctl.TAG_PROMOTED] = result.promoted.binary_dir
        tags[ctl.TAG_PROMOTED_COMMIT] = result.promoted.commit
    return {k: v for k, v in tags.items() if v}


def _reference_commit(result: NightlyResult) -> str:
    """The commit the reference's runs recorded tonight (one, else "")."""
    commits = {str(o.record.tags.get("backend.build_commit")) for o in result.outcomes
               if o.record is not None and ctl.is_reference_hash(o.trial.config_hash)
               and o.record.tags.get("backend.build_commit")}
    return commits.pop() if len(commits) == 1 else ""


# --- What the nightly writes ----------------------------------------------------------------------------------


def _unit_tags(result: NightlyResult) -> dict[str, str]:
    """The units' runs of failed nights and the quarantined ones (an absent tag: none; the next night reads it)."""
    tags = {TAG_STREAKS: ",".join(f"{u}={n}" for u, n in sorted(result.unit_failures.items()) if n),
            TAG_QUARANTINED: ",".join(result.quarantined)}
    return {k: v for k, v in tags.items() if v}


def _label(outcome: Any) -> str:
    return getattr(outcome.trial, "short_label", "") or outcome.trial.label


def _markdown(result: NightlyResult) -> str:
    broken = [f"{len(result.failed)} trial(s) failed"] if result.failed else []
    broken += [f"unit(s) not measured: {', '.join(sorted(result.missing))}"] if result.missing else []
    head = {ExitCode.OK: "OK: no regression", ExitCode.FAILED: "FAIL: performance regression on "
            + ", ".join(result.regressed_units), ExitCode.TRIALS_FAILED: "FAIL: " + "; ".join(broken),
            ExitCode.NO_VERDICT: f"NO VERDICT: {result.no_verdict_reason}"}[result.exit_code]
    lines = [f"# jbench nightly {result.device_class}: {head}", "",
             f"Sweep `{result.sweep_id}` (experiment `{result.experiment}`) on {len(result.units)} unit(s): "
             f"{', '.join(result.units) or 'none'}; exit code {result.exit_code} ({result.verdict}).", ""]
    if result.failed:
        lines += ["Failed trials:", ""] + [f"- {o.device or '?'}: {_label(o)}: {o.category}: {o.error}"
                                           for o in result.failed] + [""]
    if result.missing:
        lines += ["Units not measured (each one fails the night; see `jbench devices check`):", ""]
        lines += [f"- {u}: {why}" for u, why in sorted(result.missing.items())] + [""]
    if result.exit_code == ExitCode.FAILED and broken:
        lines += [f"Also {' and '.join(broken)} (exit code 1 wins over 4).", ""]
    if result.report_html:
        lines += [f"Report: {result.report_html}", ""]
    lines += [f"Note: {n}" for n in result.notes] + ([""] if result.notes else [])
    lines += _control_markdown(result)
    if result.confirmations:
        lines += ["Confirmation (the previous and the new build measured again, interleaved on the unit; an alarm "
                  "that is not confirmed does not fail the nightly):", ""]
        lines += [f"- {c.describe()}" for c in result.confirmations] + [""]
    if result.regress is not None:
        body = result.regress.to_markdown()
        lines += [body.split("\n", 1)[1].lstrip("\n")]  # its own heading is replaced by the nightly's
    return "\n".join(lines).rstrip("\n") + "\n"


def _control_markdown(result: NightlyResult) -> list[str]:
    c = result.control
    lines: list[str] = []
    if c is not None and c.on and c.reference is not None:
        lines += [f"Same-night control: reference build {c.reference.describe()}, measured beside the build under "
                  "test on each unit, counterbalanced (T R R T); a code change is judged on the paired ratio "
                  "test/reference:", ""]
        lines += [f"- {v.describe()}" for v in result.control_verdicts] or ["- no verdict: no finished pair"]
        lines.append("")
        labels = {o.trial.config_hash: short_label(o.trial.point) or f"{o.trial.cfg.model.name} "
                  f"{o.trial.cfg.model.quant}" for o in result.outcomes}
        lines += ["Repetitions per build (the noise budget, farm.target_interval_pct):", ""]
        lines += [f"- {labels.get(h, h)} [{h}]: {b.describe()}" for h, b in sorted(result.budgets.items())] + [""]
    elif c is not None:
        lines += [f"Same-night control: off ({c.why_off}).", ""]
    if result.promoted is not None:
        lines += [f"Reference promoted tonight: {result.promoted.describe()}.", ""]
    return lines


def _junit(result: NightlyResult) -> str:
    """Regress's JUnit, one case per unit x configuration x rate, plus an <error> case per FAILED trial."""
    suite_name = f"jbench.nightly.{result.device_class}"
    if result.regress is not None:
        suite = ET.fromstring(result.regress.to_junit_xml(suite_name, per_metric=True))
    else:
        suite = ET.Element("testsuite", name=suite_name, tests="0", failures="0", errors="0", skipped="0")
    for o in result.failed:
        case = ET.SubElement(suite, "testcase", classname=f"{suite_name}.{o.device or 'device'}",
                             name=f"{_label(o)} [{o.trial.config_hash}] trial")
        ET.SubElement(case, "error", message=f"{o.category}: {o.error}"[:500], type=str(o.category)).text = str(o.error)
    for v in result.control_verdicts:
        case = ET.SubElement(suite, "testcase", classname=f"{suite_name}.{v.unit}",
                             name=f"{v.label} [{v.config_hash}] {v.metric} vs reference")
        if v.verdict == REGRESSION:
            ET.SubElement(case, "failure", message=v.describe()[:500], type="paired regression").text = v.describe()
        elif v.verdict == "no verdict":
            ET.SubElement(case, "skipped", message=v.describe()[:500])
        ET.SubElement(case, "system-out").text = v.describe() + "\n"
    for unit, why in sorted(result.missing.items()):
        case = ET.SubElement(suite, "testcase", classname=f"{suite_name}.{unit}", name=f"unit {unit} measured")
        kind = "quarantined" if why.startswith("quarantined") else "unreachable"
        ET.SubElement(case, "error", message=why[:500], type=kind).text = why
    suite.set("errors", str(len(result.failed) + len(result.missing)))
    suite.set("failures", str(len(suite.findall("testcase/failure"))))
    suite.set("skipped", str(len(suite.findall("testcase/skipped"))))
    suite.set("tests", str(len(suite.findall("testcase"))))
    ET.SubElement(suite, "system-out").text = (f"verdict: {result.verdict} (exit code {result.exit_code})\n"
                                               + (f"{result.no_verdict_reason}\n" if result.no_verdict_reason else ""))
    ET.indent(suite)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suite, encoding="unicode") + "\n"
