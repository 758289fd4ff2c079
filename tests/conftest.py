"""Shared fixtures. End-to-end tests use the real llama.cpp build and model from `jbench setup`
(`make setup` runs it); when they are missing the tests fail and say so, they never skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"  # test data copied into the repository, with provenance (data/README.md)


@pytest.fixture(scope="session")
def llama_build() -> dict:
    from jbench.provision import active_build

    build = active_build()
    if build is None:
        pytest.fail("no llama.cpp build: run `make setup` (or `jbench setup`) before the tests")
    return build


@pytest.fixture(scope="session")
def bundled_model() -> dict:
    from jbench.models import load_manifest

    files = load_manifest("gemma3_270m").get("files", {})
    for quant in ("Q4_K_M", "Q4_0", "Q8_0"):
        if quant not in files or not Path(files[quant]["path"]).exists():
            pytest.fail(f"bundled model {quant} missing: run `make setup` (or `jbench setup`) before the tests")
    return files


def jbench_cli(args: list[str], *, env_extra: dict | None = None, cwd: Path | None = None,
               timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the installed `jbench` command the way a user does."""
    env = dict(os.environ)
    env.update(env_extra or {})
    env.setdefault("COLUMNS", "200")
    exe = Path(sys.executable).with_name("jbench")
    return subprocess.run([str(exe), *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
from .emulated_jetson.fixtures import *  # noqa: F401,F403,E402  (emulated Jetson devices over real sshd)
