"""jbench: Jetson LLM benchmark orchestration and experiment tracking."""

from __future__ import annotations

from jbench.core.provenance import JBENCH_VERSION as __version__
from jbench.core.provenance import git_sha

__all__ = ["__version__", "git_sha"]
