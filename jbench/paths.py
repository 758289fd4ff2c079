"""Where jbench keeps its build cache and results on the controller."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$JBENCH_CACHE_DIR, else $XDG_CACHE_HOME/jbench, else ~/.cache/jbench."""
    env = os.environ.get("JBENCH_CACHE_DIR")
    if env:
        return Path(env).expanduser().resolve()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return (base / "jbench").resolve()


def llamacpp_builds_dir() -> Path:
    return cache_dir() / "llama.cpp"


def models_dir() -> Path:
    return cache_dir() / "models"
