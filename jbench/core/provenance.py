"""Which jbench made a record: its version and the commit of its source tree (recorded on every run)."""

from __future__ import annotations

import subprocess
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

try:
    JBENCH_VERSION = version("jbench")
except PackageNotFoundError:  # running from a source tree that is not installed
    JBENCH_VERSION = "0.0.0+unknown"


def _git(here: Path, *args: str) -> "subprocess.CompletedProcess[str] | None":
    """One git call in the source tree, or None when git is missing, hangs, cannot be run or the tree is gone."""
    try:
        return subprocess.run(["git", "-C", str(here), *args], capture_output=True, text=True, errors="replace",
                              timeout=5)
    except (OSError, subprocess.SubprocessError, ValueError):  # ValueError: output that does not decode, bad args
        return None


@lru_cache(maxsize=1)
def git_sha() -> str:
    """The commit of the jbench source tree in use ("-dirty" when tracked files changed), or 'unknown' outside a
    git checkout. Never raises: it runs after devices are leased, where an exception would cost the sweep."""
    here = Path(__file__).resolve().parent
    head = _git(here, "rev-parse", "HEAD")
    if head is None or head.returncode != 0:
        return "unknown"
    status = _git(here, "status", "--porcelain", "--untracked-files=no")
    if status is None or status.returncode != 0:  # the commit is known; whether the tree is clean is not
        return head.stdout.strip() + "-unknown-state"
    return head.stdout.strip() + ("-dirty" if status.stdout.strip() else "")
