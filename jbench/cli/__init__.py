"""The `jbench` command: one entry point for every job. `jbench.cli.app` holds the group and what commands share;
each other module of this package registers its commands on that group when imported here.

Errors a user can cause end in one clear message (exit 2) naming the fix; tracebacks are reserved for bugs. Exit
codes: jbench.core.exitcodes.ExitCode, listed in docs/cli.md.
"""

from jbench.cli import advise, bisect, devices, farm, memory, nightly, run, stored, tools  # noqa: F401  (registers their commands)
from jbench.cli.app import main

__all__ = ["main"]
