"""The exit codes of every jbench command: one name per code, one meaning per name (docs/cli.md, "Exit codes")."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    # The command's verdict is "no": a regression (`regress`, `nightly`), a failed check (`devices check`, `doctor`).
    FAILED = 1
    # Bad input: one `error:` line naming the fix; nothing was run, no store created, nothing changed.
    BAD_INPUT = 2
    # No verdict: something could not be judged (too few nights or samples, no baseline, an unclear bisection step).
    NO_VERDICT = 3
    # Some trial FAILED (all are recorded); the rest of the work was done and reported.
    TRIALS_FAILED = 4
    # Ctrl-C or SIGTERM/SIGHUP: the current trial and the sweep are recorded as KILLED.
    INTERRUPTED = 130
