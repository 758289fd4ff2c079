"""The `jbench` group and what every command shares: options (`-v`, `--results-dir`), one-line errors (`_fail`),
the consoles, MLflow's logging kept quiet. The commands live in this package's other modules.

Errors a user can cause end in one clear message (exit 2) naming the fix; tracebacks are reserved for bugs.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Optional

import click
from rich.console import Console

from jbench.core.provenance import JBENCH_VERSION as __version__
from jbench.core.errors import UserError
from jbench.core.exitcodes import ExitCode

# soft_wrap: messages are never hard-wrapped (a pipe is 80 columns to rich); tables still fit the width.
console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)


_OVERRIDES = {"ignore_unknown_options": True, "allow_extra_args": False}
_config_dir_option = click.option(
    "--config-dir",
    "config_dirs",
    multiple=True,
    type=click.Path(file_okay=False),
    help="Your own config directory (device/, model/, experiment/ ...), searched before jbench's. "
    "Repeatable; also $JBENCH_CONFIG_PATH.",
)


def _fail(message: str) -> "click.exceptions.Exit":
    # click.echo, not rich: a pipe must get the message whole (rich wraps at 80 columns there), and
    # nothing in a user's value may be read as markup.
    click.echo(click.style("error:", fg="red", bold=True) + f" {message}", err=True)
    return click.exceptions.Exit(ExitCode.BAD_INPUT)


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
        force=True,
    )
    # MLflow configures its own loggers when imported (announcing store migrations at INFO); jbench prints
    # its own progress, so they stay quiet unless -v is given (tracking/common.py silences its progress bars).
    if verbose:
        os.environ["MLFLOW_LOGGING_LEVEL"] = "DEBUG"
    else:
        os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    level = logging.DEBUG if verbose else logging.WARNING
    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(level)


# --- Options every command accepts, before or after the command name ---------------------------------------
# `jbench -v --results-dir R report` and `jbench report -v --results-dir R` mean the same: the group stores
# its values in the context object, and each command's own option falls back to them.


def _group_state(ctx: click.Context) -> dict:
    root = ctx.find_root()
    if root.obj is None:
        root.obj = {}
    return root.obj


def _verbose_callback(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    if value:
        _group_state(ctx)["verbose"] = True
        _setup_logging(True)
    return bool(value or _group_state(ctx).get("verbose"))


def _results_dir_callback(ctx: click.Context, param: click.Parameter, value: Optional[str]) -> Optional[str]:
    state = _group_state(ctx)
    if value is not None:
        state["results_dir"] = value
    return state.get("results_dir")


def common_options(fn: Optional[Callable] = None, *, results_dir: bool = True) -> Callable:
    """`-v/--verbose` and `--results-dir`, shared by every command. The command gets `results_dir`
    unless results_dir=False (a command that reads no store accepts the option and ignores it)."""
    if fn is None:
        return lambda f: common_options(f, results_dir=results_dir)
    fn = click.option("-v", "--verbose", is_flag=True, expose_value=False, callback=_verbose_callback,
                      is_eager=True, help="Show debug logs (also MLflow's).")(fn)
    fn = click.option("--results-dir", "results_dir", default=None, callback=_results_dir_callback,
                      expose_value=results_dir,
                      type=click.Path(file_okay=False),
                      help="Results directory (default: $JBENCH_RESULTS_DIR or ./results; for sweep and run, "
                           "tracking.results_dir); $MLFLOW_TRACKING_URI wins for the store when set.")(fn)
    return fn


class _Group(click.Group):
    """The `jbench` group: a UserError raised anywhere below a command is its one-line error (exit 2)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except UserError as exc:
            raise _fail(str(exc)) from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="jbench")
@click.option("-v", "--verbose", is_flag=True, help="Show debug logs (also MLflow's).")
@click.option("--results-dir", default=None, type=click.Path(file_okay=False),
              help="Results directory for every command (same as the command's own --results-dir).")
@click.pass_context
def main(ctx: click.Context, verbose: bool, results_dir: Optional[str]) -> None:
    """jbench: Jetson LLM benchmark orchestration and experiment tracking."""
    state = _group_state(ctx)
    state["verbose"] = verbose
    if results_dir is not None:
        state["results_dir"] = results_dir
    _setup_logging(verbose)


def _signals_as_interrupt() -> None:
    """SIGTERM (a CI job cancelled, `kill`) and SIGHUP (the SSH session to the controller dropped) unwind like
    Ctrl-C, so devices are restored and the sweep is recorded KILLED (a later run resumes it under its parent).

    Only the first one interrupts: when an SSH session drops, the kernel and then the login shell each send SIGHUP,
    and a second KeyboardInterrupt raised while the first unwinds would cut the recording of the KILLED runs short
    (leaving them RUNNING). After a hang-up the terminal is gone and every write to it fails (EIO), so jbench's
    output then goes to /dev/null instead of ending the unwinding in a traceback."""
    import signal

    terminals = [fd for fd in (0, 1, 2) if _isatty(fd)]
    unwinding: list[int] = []

    def handler(signum, frame):
        if signum == signal.SIGHUP:
            _drop_lost_terminal(terminals)
        if unwinding:
            logging.getLogger("jbench").info("signal %d while unwinding from signal %d: ignored", signum,
                                             unwinding[0])
            return
        unwinding.append(signum)
        raise KeyboardInterrupt(signal.Signals(signum).name)  # the runs' failure reason names it

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGHUP, handler)


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def _drop_lost_terminal(terminals: list[int]) -> None:
    """Point the standard streams that were a terminal and no longer are (hung up: its ioctls fail) at /dev/null.
    A terminal that still answers (`kill -HUP` from elsewhere) keeps jbench's output."""
    gone = [fd for fd in terminals if not _isatty(fd)]
    if not gone:
        return
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in gone:
            os.dup2(devnull, fd)
    finally:
        os.close(devnull)
