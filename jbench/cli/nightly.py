"""`jbench nightly CLASS`: the nightly job from the terminal, cron or CI (the work is `jbench.nightly`)."""

from __future__ import annotations

from typing import Optional

import click
from rich.markup import escape

from jbench.cli.app import _OVERRIDES, _config_dir_option, _fail, common_options, console, err_console, main
from jbench.core.exitcodes import ExitCode

HELP = """Lease, run the nightly experiment on every unit of DEVICE_CLASS, regress, report, release.

\b
Every unit runs the whole matrix (sweep.rerun=true) and is compared with its own history
(configurations per unit: tag device.unit). The devices are released when the sweep ends,
fails or is interrupted, before regress and report run.

\b
Confirmation (on by default): each regression found (over the history, or by the two-sweep
gate) is measured again before it fails the night: the build of the night before the change and the newest build
run interleaved (A B A B ..., --confirm-pairs) on that unit in the configuration's power
state; the alarm stands only when the paired difference is significant (--confirm-alpha)
and at least --confirm-threshold. Runs go to the experiment EXPERIMENT-confirm. When it
cannot run (the previous build's directory is gone, the build did not change), the alarm
stands with the reason.

\b
Same-night control: on a class with a reference build (farm.reference: a
backend.binary_dir kept on every unit, or "accepted", the default: the build
last accepted with --promote-reference) each configuration also runs the
reference on the same unit, counterbalanced (T R R T); a code change is judged
on the night's paired ratio test/reference, so a clear drop fails its first
night, and a drop of both builds is an environment change, not the build's.
It doubles the covered configurations' device time: farm.control_every=N runs it
every Nth night, farm.control_only=[{model.quant: Q4_0}] on some configurations.
Repetitions per build come from a noise budget: the earlier nights' within-night
spread sets how many the paired interval needs to be within +-farm.target_interval_pct
(default 1 %, null: backend.repetitions as configured), within farm.min_repetitions
and farm.max_repetitions (3, 30).

\b
A dead unit does not stop the night: the units that answer are measured, each one
that does not is a JUnit error and a markdown line (exit 4). A unit without a
measurement on farm.quarantine_after_failures nights in a row (default 3) is
quarantined: later nightlies skip it (still reported, exit 4) until
--unquarantine UNIT. (A farm coordinator's places are checked and quarantined by
the farm: `jbench farm unquarantine`.)

\b
Exit codes (when several apply, the first in this order wins: 2, 1, 4, 3, 0):
  0  clean: every unit x configuration was tested, none regressed, no trial failed
  1  regression on some unit (named in the summary and the JUnit failures); a change
     found only after it left the newest nights, never reported before, counts too;
     so does a paired regression against the same-night reference, on its first night
  2  nothing was run: unknown class, bad config or override, unwritable output path,
     unknown --baseline, no unit of the class reachable (or all quarantined), a
     unit that answers but is not ready (preflight), none leased from the farm
  3  no verdict: some configuration could not be tested (too few nights for the
     history, first night: no baseline; too few samples) and no same-night control
     judged it
  4  some trial FAILED, or some unit was not measured (unreachable, quarantined):
     recorded, regressed and reported anyway, never green
  130  interrupted (Ctrl-C, SIGTERM): runs KILLED, devices released

\b
Example:
  jbench nightly orin_nano_super --config-dir lab-conf --junit nightly.xml --markdown nightly.md
"""


@main.command(context_settings=_OVERRIDES, help=HELP)
@click.argument("device_class")
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
@click.option("--experiment", default="nightly", show_default=True, help="The experiment (+experiment=NAME).")
@click.option("--mode", type=click.Choice(["auto", "history", "pairwise"]), default="auto", show_default=True,
              help="As `jbench regress`: history (change points over every night) once a configuration has enough "
                   "nights, else pairwise against the previous night.")
@click.option("--baseline", default=None,
              help="Pairwise baseline: last | all | TAG (jbench.baseline) | sweep id | YYYY-MM-DD (implies pairwise).")
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False), default=None,
              help="Write JUnit XML here: one testcase per unit x configuration x rate, an error per failed trial.")
@click.option("--markdown", "md_path", type=click.Path(dir_okay=False), default=None,
              help="Write the markdown summary here.")
@click.option("--report-dir", type=click.Path(file_okay=False), default=None,
              help="The HTML report's directory (default: RESULTS/reports/nightly-CLASS-SWEEP).")
@click.option("--confirm/--no-confirm", default=True, show_default=True,
              help="Measure each regression found again (previous vs new build, interleaved) before it fails the night.")
@click.option("--confirm-pairs", type=int, default=6, show_default=True, help="A B pairs of the confirmation.")
@click.option("--confirm-alpha", type=float, default=0.01, show_default=True,
              help="Significance level of the confirmation's paired t-test and of the same-night control's ratio.")
@click.option("--confirm-threshold", type=float, default=0.01, show_default=True,
              help="Smallest relative change (0.01 = 1 %) a confirmed (or same-night control) regression must have.")
@click.option("--promote-reference", is_flag=True, default=False,
              help="Accept tonight's build under test as the class's reference build (farm.reference=accepted) from "
                   "the next night on; recorded on the night's parent run.")
@click.option("--unquarantine", "unquarantine", multiple=True, metavar="UNIT",
              help="Measure this quarantined unit again tonight (repeatable); a measurement ends its quarantine.")
@common_options
@_config_dir_option
def nightly(device_class: str, overrides: tuple[str, ...], experiment: str, mode: str, baseline: Optional[str],
            junit_path: Optional[str], md_path: Optional[str], report_dir: Optional[str], confirm: bool,
            confirm_pairs: int, confirm_alpha: float, confirm_threshold: float, promote_reference: bool,
            unquarantine: tuple[str, ...], results_dir: Optional[str], config_dirs: tuple[str, ...]) -> None:
    from jbench.cli.app import _signals_as_interrupt
    from jbench.analysis.paired import ConfirmSettings
    from jbench.sweeps.nightly import Nightly, NightlyError

    try:
        job = Nightly(device_class, experiment=experiment, baseline=baseline, mode=mode, overrides=list(overrides),
                      config_dirs=list(config_dirs), results_dir=results_dir, junit=junit_path, markdown=md_path,
                      report_dir=report_dir, confirm=confirm,
                      confirm_settings=ConfirmSettings(pairs=confirm_pairs, alpha=confirm_alpha,
                                                       min_effect=confirm_threshold),
                      unquarantine=list(unquarantine), promote_reference=promote_reference)
    except NightlyError as exc:
        raise _fail(str(exc)) from None
    console.print(f"[bold]nightly {escape(device_class)}[/]: {len(job.plan.trials)} trial(s) of "
                  f"'{escape(job.plan.experiment)}' on every unit", highlight=False)

    def started(trial) -> None:
        console.print(f"{escape(trial.cfg.device.name)}: {escape(trial.short_label)}: running",
                      highlight=False)

    def ended(o) -> None:
        what = f"{o.status} ({o.wall_s:.0f} s)" if str(o.status) != "FAILED" else f"FAILED ({o.category}): {o.error}"
        console.print(f"{escape(o.device or '?')}: {escape(o.trial.short_label)}: {escape(what)}", highlight=False)

    _signals_as_interrupt()
    try:
        result = job.run(on_trial_start=started, on_trial_end=ended,
                         say=lambda m: err_console.print(f"[yellow]{escape(m)}[/]", highlight=False))
    except NightlyError as exc:
        raise _fail(str(exc)) from None
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted: the running trials and the sweep are recorded as KILLED; "
                          "the devices were released[/]")
        raise click.exceptions.Exit(ExitCode.INTERRUPTED) from None
    click.echo(result.markdown, nl=False)  # never hard-wrapped, in a pipe either
    if result.failed:
        err_console.print(f"[bold red]{len(result.failed)} of {len(result.outcomes)} trial(s) failed[/]")
    for unit, why in sorted(result.missing.items()):
        err_console.print(f"[bold red]unit {escape(unit)} not measured: {escape(why)}[/]", highlight=False)
    if result.exit_code == ExitCode.NO_VERDICT:
        click.echo(f"NO VERDICT: {result.no_verdict_reason}", err=True)
    raise click.exceptions.Exit(result.exit_code)
