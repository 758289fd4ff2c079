"""The base of errors a user causes and can fix: any command that meets one prints its message on one `error:` line
and exits 2 (jbench.cli.app), wherever in jbench it was raised. Tracebacks stay for bugs."""

from __future__ import annotations


class UserError(Exception):
    """Bad input or a state the user must change; the message names the fix."""
