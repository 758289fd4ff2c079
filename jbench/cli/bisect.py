"""`jbench bisect`: the first bad llama.cpp build between a good and a bad one (the work is `jbench.bisect`)."""

from __future__ import annotations

from typing import Optional

import click
from rich import box
from rich.markup import escape
from rich.table import Table

from jbench.cli.app import (_OVERRIDES, _config_dir_option, _fail, common_options, console,
                        err_console, main)
from jbench.core.exitcodes import ExitCode

HELP = """Find the first bad llama.cpp build for a failing configuration (OVERRIDES, as for `jbench run`).

\b
Builds: --builds DIR ... (oldest = known good first, newest = known bad last; each holds
llama-bench, a path on the device), or --repo PATH --good REF --bad REF (a llama.cpp git
checkout on this machine: the first-parent commits between are built with `jbench setup`'s
CMake configuration, cached per commit: here for the local device, on the device over SSH for
a `device=NAME` SSH entry: git archive, SFTP, CMake there, CUDA when it has nvcc and a GPU).
The device is handled as a sweep does: its lease is held for the whole bisection, and a
power.mode / power.jetson_clocks of the configuration is applied, verified and restored.
The ends are measured first, --end-trials trials each in the order G B B G ...; they differ
when a t-test with the trial as the unit says so (repetitions of one trial are not independent).
From their difference and noise follow the repetitions per build (bounded by --max-repetitions). Each midpoint is classified by the end its mean is closer to,
confirmed by a Welch t-test against the other end. Every build measured is a child run of one
"bisect" run (tags bisect.step, bisect.verdict, backend.build_commit).

\b
Exit codes:
  0  the first bad build was found
  2  bad input (builds, refs, overrides)
  3  no verdict: the ends do not differ significantly, or a midpoint was unclear
  130  interrupted (Ctrl-C, SIGTERM): the bisect run is recorded as KILLED

\b
Example:
  jbench bisect --builds good/bin mid/bin bad/bin model.quant=Q4_0 backend.n_gen=32
  jbench bisect --repo ~/src/llama.cpp --good b4000 --bad b4030 device=orin
      model.quant=Q4_0 power.mode=MAXN_SUPER power.jetson_clocks=true
"""


@main.command(context_settings=_OVERRIDES, help=HELP)
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
@click.option("--builds", "build_dirs", multiple=True, help="Build directories, oldest (known good) first, newest (known bad) last: "
              "`--builds A B C` or `--builds A --builds B ...`.")
@click.option("--repo", default=None, type=click.Path(file_okay=False),
              help="A llama.cpp git checkout on this machine.")
@click.option("--good", default=None, help="With --repo: the known good ref.")
@click.option("--bad", default=None, help="With --repo: the known bad ref.")
@click.option("--metric", type=click.Choice(["decode_tps", "prefill_tps"]), default="decode_tps", show_default=True)
@click.option("--alpha", type=float, default=0.01, show_default=True,
              help="Significance level of the ends' test and of each midpoint's test.")
@click.option("--repetitions", type=int, default=5, show_default=True,
              help="Repetitions of each end's first measurement.")
@click.option("--max-repetitions", type=int, default=30, show_default=True,
              help="Upper bound of the repetitions per build that the ends' noise asks for.")
@click.option("--end-trials", type=int, default=3, show_default=True,
              help="Trials of each end (at least 2): their spread is what the ends' difference is judged against.")
@click.option("--jobs", type=int, default=None,
              help="With --repo: parallel build jobs (default: all cores of the machine building).")
@common_options
@_config_dir_option
def bisect(overrides: tuple[str, ...], build_dirs: tuple[str, ...], repo: Optional[str], good: Optional[str],
           bad: Optional[str], metric: str, alpha: float, repetitions: int, max_repetitions: int,
           end_trials: int, jobs: Optional[int], results_dir: Optional[str], config_dirs: tuple[str, ...]) -> None:
    from jbench.sweeps.bisect import BisectError, Bisector, builds_from_repo, dir_builds
    from jbench.cli.app import _signals_as_interrupt
    from jbench.cli.run import _with_results_dir
    from jbench.config import ConfigError, check_overrides, user_config_dirs

    say = lambda m: err_console.print(f"[yellow]{escape(m)}[/]", highlight=False)  # noqa: E731
    # `--builds A B C`: click takes A as the option's value and B, C as overrides; a path is never an override.
    dirs, rest = list(build_dirs), []
    for word in overrides:
        if dirs and "=" not in word and not word.startswith(("+", "~")):
            dirs.append(word)
        else:
            rest.append(word)
    try:
        if dirs and repo:
            raise BisectError("give either --builds or --repo, not both")
        if repo:
            if not (good and bad):
                raise BisectError("--repo needs --good REF and --bad REF")
            builds = builds_from_repo(repo, good, bad, say, jobs)
        elif dirs:
            builds = dir_builds(dirs)  # looked into on the device (this machine, or over SSH)
        else:
            raise BisectError("give the builds: --builds GOOD_DIR ... BAD_DIR, or --repo PATH --good REF --bad REF")
        check_overrides(rest)
        job = Bisector(builds, _with_results_dir(rest, results_dir), user_config_dirs(list(config_dirs)),
                       metric=metric, alpha=alpha, repetitions=repetitions, max_repetitions=max_repetitions, end_trials=end_trials, say=say)
        console.print(f"bisecting {len(builds)} builds on {metric}", highlight=False)
        _signals_as_interrupt()
        result = job.run()
    except (BisectError, ConfigError) as exc:
        raise _fail(str(exc)) from None
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted: the bisect run is recorded as KILLED[/]")
        raise click.exceptions.Exit(ExitCode.INTERRUPTED) from None

    table = Table(box=box.SIMPLE_HEAD)
    for col in ("step", "build", "dir", "commit", "reps", metric, "verdict"):
        table.add_column(col)
    for s in result.steps:
        table.add_row(str(s.step), str(s.index), escape(s.build.label), escape(s.build_commit or "-"),
                      str(len(s.samples)), f"{s.mean:.2f} ± {s.std:.2f}", s.verdict)
    console.print(table)
    if result.outcome != "no_difference":
        console.print(f"repetitions per build: {result.repetitions} (the ends' difference and noise ask for "
                      f"{result.repetitions_raw})", highlight=False)
    console.print(f"recorded as the bisect run {result.parent_run_id}", highlight=False)
    if result.outcome == "found":
        fb = result.builds[result.first_bad]
        commit = next((s.build_commit for s in result.steps if s.index == result.first_bad and s.build_commit),
                      fb.commit)
        click.echo(f"FIRST BAD: build {result.first_bad}: {fb.label} (commit {commit or 'unknown'})")
        return
    click.echo(f"NO VERDICT: {result.message}", err=True)
    raise click.exceptions.Exit(ExitCode.NO_VERDICT)
