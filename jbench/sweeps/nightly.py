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

Exit codes (docs/cli.md): 0 clean, 1 regression, 2 nothing run (bad input, devices not ready), 3 no verdict,
4 trials failed. Precedence: 2 (stops before anything runs), then 1, then 4, then 3, then 0.
"""

from __future__ import annotations

import logging
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from jbench.analysis.paired import ConfirmSettings
from jbench.analysis.history import DEFAULT_SETTINGS, HistoryError, HistoryReport, history, max_nights
from jbench.analysis.regress import (NoData, RegressError,
                                     RegressReport, regress)
from jbench.core.results import Status
from jbench.sweeps.plan import Plan
from jbench.core.exitcodes import ExitCode
from jbench.tracking.common import store_exists, writable_problem

log = logging.getLogger("jbench")

VERDICTS = {ExitCode.OK: "clean", ExitCode.FAILED: "regression", ExitCode.NO_VERDICT: "no verdict",
            ExitCode.TRIALS_FAILED: "trials failed"}


class NightlyError(Exception):
    """Nothing was run: bad input (class, config, overrides, output paths, baseline) or devices not ready."""


def exit_code(regress_code: int, failed_trials: int) -> int:
    """The nightly's code from regress's (0, 1 or 3) and the count of FAILED trials. A regression is a measured
    verdict on the trials that ran, so it wins; failed trials come next (the matrix is incomplete: never green,
    and it outranks "no verdict" because something broke, which a missing baseline does not say)."""
    if regress_code == ExitCode.FAILED:
        return ExitCode.FAILED
    if failed_trials:
        return ExitCode.TRIALS_FAILED
    return regress_code


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
        if isinstance(self.regress, HistoryReport):
            return self.regress.regressed_units
        return sorted({r.device for r in (self.regress.results if self.regress else []) if r.counts_as_regression})


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
                 confirm: bool = True, confirm_settings: ConfirmSettings = ConfirmSettings()):
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

    def run(self, *, on_trial_start: Callable[[Any], None] = lambda t: None,
            on_trial_end: Callable[[Any], None] = lambda o: None,
            say: Callable[[str], None] = lambda m: None) -> NightlyResult:
        """Sweep (leased and released by the class sweep), regress, report. KeyboardInterrupt propagates after
        the sweep recorded its runs as KILLED and gave the devices back."""
        from jbench.sweeps.sweep import PreflightError, run_sweep, tracker_factory

        tracker = tracker_factory(self.plan.tracking, self.store, say)
        try:
            swept = run_sweep(self.plan, tracker, on_trial_start=on_trial_start, on_trial_end=on_trial_end,
                              every_unit=True)
        except PreflightError as exc:
            raise NightlyError(f"the devices of {self.device_class} are not ready; nothing was run:\n{exc}") from None
        # The devices are released here: whatever regress and report do next, they hold nothing.
        result = NightlyResult(self.device_class, swept.experiment, swept.sweep_id, swept.parent_run_id,
                               swept.tracking_uri, swept.outcomes, ExitCode.NO_VERDICT, notes=list(swept.notes))
        t = swept.tracker
        report: Optional[RegressReport] = None
        if t is None or swept.parent_run_id is None:
            result.no_verdict_reason = "no trial ran"
        elif t.spooling is not None:
            result.no_verdict_reason = (f"the results went to the spool ({t.spool_uri}): run `jbench sync`, then "
                                        f"`jbench regress --experiment {swept.experiment}`")
        else:
            report, result.no_verdict_reason, df, history_runs = self._regress(t, swept.experiment, swept.sweep_id)
            result.mode = "history" if isinstance(report, HistoryReport) else "pairwise"
            if report is not None and report.alarms() and self.confirm:
                result.confirmations = self._confirm(report, history_runs, swept.experiment, tracker, say,
                                                     on_trial_start, on_trial_end)
            if df is not None:
                result.report_html = self._report(t, df, swept, result, report)
        result.regress = report
        result.exit_code = exit_code(report.exit_code if report else ExitCode.NO_VERDICT, len(result.failed))
        if report is not None and report.exit_code == ExitCode.NO_VERDICT:
            result.no_verdict_reason = report.verdict_reason
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
        trial runs, every trial run of the experiment)."""
        from jbench.tracking.reader import repetition_samples, runs_frame, with_current_hashes

        df = with_current_hashes(runs_frame(t, [experiment]))
        mine = df[df["tags.jbench.sweep_id"] == sweep_id] if "tags.jbench.sweep_id" in df.columns else df.iloc[:0]
        loader = lambda run_ids, metric: repetition_samples(t, list(run_ids), metric)  # noqa: E731
        mode = self.mode
        if mode == "auto":
            enough = self.baseline is None and max_nights(df) >= DEFAULT_SETTINGS.min_nights
            mode = "history" if enough else "pairwise"
        try:
            if mode == "history":
                report = history(df, current=[sweep_id])
                if not report.results:
                    return None, "no finished trial runs to check", mine if len(mine) else None, df
                return report, "", mine, df
            return regress(df, loader, baseline=self.baseline or "last", current=[sweep_id]), "", mine, df
        except NoData as exc:
            return None, str(exc), mine if len(mine) else None, df
        except (RegressError, HistoryError) as exc:  # e.g. a baseline tag that matches none of this sweep's
            return None, str(exc), mine if len(mine) else None, df

    def _confirm(self, report: HistoryReport | RegressReport, runs: Any, experiment: str, tracker: Callable[[], Any],
                 say: Callable[[str], None], on_trial_start: Callable[[Any], None],
                 on_trial_end: Callable[[Any], None]) -> list:
        """Each alarm measured again (jbench.confirm); a confirmation that breaks leaves its alarm standing."""
        from jbench.sweeps.confirm import confirm

        say(f"{len(report.alarms())} regression(s): confirming them on their units")
        try:
            return confirm(report, runs, self.plan, experiment=experiment, tracker_factory=tracker,
                           settings=self.confirm_settings, say=say, on_trial_start=on_trial_start,
                           on_trial_end=on_trial_end)
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # the alarm is a measured verdict: never lost to the confirmation's failure
            log.error("the confirmation failed: %s", exc)
            for r in report.alarms():
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
                "jbench.nightly.failed_trials": len(result.failed)})
            t.log_texts(result.parent_run_id, {"nightly/regress.md": result.markdown,
                                               "nightly/junit.xml": result.junit_xml})
        except Exception as exc:  # the verdict is in the exit code and the files whatever the store says
            log.error("tagging the sweep's parent run with the verdict failed: %s", exc)
            result.notes.append(f"parent run not tagged: {exc}")


def run_nightly(device_class: str, **kwargs: Any) -> NightlyResult:
    """Nightly(device_class, **options).run(): see Nightly. Raises NightlyError when nothing was run."""
    run_keys = ("on_trial_start", "on_trial_end", "say")
    hooks = {k: kwargs.pop(k) for k in run_keys if k in kwargs}
    return Nightly(device_class, **kwargs).run(**hooks)


# --- What the nightly writes ----------------------------------------------------------------------------------


def _label(outcome: Any) -> str:
    return getattr(outcome.trial, "short_label", "") or outcome.trial.label


def _markdown(result: NightlyResult) -> str:
    head = {ExitCode.OK: "OK: no regression", ExitCode.FAILED: "FAIL: performance regression on "
            + ", ".join(result.regressed_units), ExitCode.TRIALS_FAILED: f"FAIL: {len(result.failed)} trial(s) failed",
            ExitCode.NO_VERDICT: f"NO VERDICT: {result.no_verdict_reason}"}[result.exit_code]
    lines = [f"# jbench nightly {result.device_class}: {head}", "",
             f"Sweep `{result.sweep_id}` (experiment `{result.experiment}`) on {len(result.units)} unit(s): "
             f"{', '.join(result.units) or 'none'}; exit code {result.exit_code} ({result.verdict}).", ""]
    if result.failed:
        lines += ["Failed trials:", ""] + [f"- {o.device or '?'}: {_label(o)}: {o.category}: {o.error}"
                                           for o in result.failed] + [""]
    if result.exit_code == ExitCode.FAILED and result.failed:
        lines += [f"Also {len(result.failed)} trial(s) failed (exit code 1 wins over 4).", ""]
    if result.report_html:
        lines += [f"Report: {result.report_html}", ""]
    lines += [f"Note: {n}" for n in result.notes] + ([""] if result.notes else [])
    if result.confirmations:
        lines += ["Confirmation (the previous and the new build measured again, interleaved on the unit; an alarm "
                  "that is not confirmed does not fail the nightly):", ""]
        lines += [f"- {c.describe()}" for c in result.confirmations] + [""]
    if result.regress is not None:
        body = result.regress.to_markdown()
        lines += [body.split("\n", 1)[1].lstrip("\n")]  # its own heading is replaced by the nightly's
    return "\n".join(lines).rstrip("\n") + "\n"


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
    suite.set("errors", str(len(result.failed)))
    suite.set("tests", str(len(suite.findall("testcase"))))
    ET.SubElement(suite, "system-out").text = (f"verdict: {result.verdict} (exit code {result.exit_code})\n"
                                               + (f"{result.no_verdict_reason}\n" if result.no_verdict_reason else ""))
    ET.indent(suite)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suite, encoding="unicode") + "\n"
