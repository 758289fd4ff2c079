"""Where jbench keeps its build cache and results on the controller."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path


def cache_dir() -> Path:
    """$JBENCH_CACHE_DIR, else $XDG_CACHE_HOME/jbench, else ~/.cache/jbench."""
    return _cache_dir(os.environ.get("JBENCH_CACHE_DIR"), os.environ.get("XDG_CACHE_HOME"), str(Path.home()))


@lru_cache(maxsize=8)
def _cache_dir(env: str | None, xdg: str | None, home: str) -> Path:
    if env:
        return Path(env).expanduser().resolve()
    base = Path(xdg).expanduser() if xdg else Path(home) / ".cache"
    return (base / "jbench").resolve()


def llamacpp_builds_dir() -> Path:
    return cache_dir() / "llama.cpp"


def models_dir() -> Path:
    return cache_dir() / "models"
