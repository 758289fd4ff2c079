"""The `jbench` command: one entry point for every job (the commands live in this package's modules).

Errors a user can cause end in one clear message (exit 2) naming the fix; a sweep with failed
trials exits 1 after recording them; tracebacks are reserved for bugs.
"""

from __future__ import annotations

import logging

import click
from rich.console import Console

from jbench import __version__

console = Console()
err_console = Console(stderr=True)

EXIT_FAILED_TRIALS = 1
EXIT_USER_ERROR = 2

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
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    return click.exceptions.Exit(EXIT_USER_ERROR)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="jbench")
@click.option("-v", "--verbose", is_flag=True, help="Show debug logs.")
def main(verbose: bool) -> None:
    """jbench: Jetson LLM benchmark orchestration and experiment tracking."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if not verbose:
        # MLflow announces store migrations at INFO; jbench prints its own progress.
        logging.getLogger("mlflow").setLevel(logging.WARNING)
        logging.getLogger("alembic").setLevel(logging.WARNING)



# Each module registers its commands on `main` (imported last: they import from here).
from jbench.cli import devices, results, run, tools  # noqa: E402,F401  (registers their commands)
