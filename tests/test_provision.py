"""`jbench setup` pieces: pinned source, commit from the changelog, CUDA decision, model cache."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from jbench.models import provision
from jbench.models.provision import SetupError, decide_cuda, llamacpp_commit_from_changelog

CHANGELOG = """# Changelog
## [Unreleased]

## [0.3.36]

- feat: update llama.cpp to ggml-org/llama.cpp@0c1e57098

## [0.3.35]

- feat: update llama.cpp to ggml-org/llama.cpp@4df29be4f
- feat: update llama.cpp to ggml-org/llama.cpp@adb55e514
"""


def test_commit_comes_from_the_pinned_versions_section():
    assert llamacpp_commit_from_changelog(CHANGELOG, "0.3.36") == "0c1e57098"
    assert llamacpp_commit_from_changelog(CHANGELOG, "0.3.35") == "4df29be4f"
    with pytest.raises(SetupError, match="no section for 0.3.99"):
        llamacpp_commit_from_changelog(CHANGELOG, "0.3.99")


def test_cuda_decision(monkeypatch):
    which = {"nvcc": "/usr/local/cuda/bin/nvcc"}
    monkeypatch.setattr(shutil, "which", lambda name: which.get(name))
    monkeypatch.setattr(provision, "gpu_visible", lambda: False)
    assert decide_cuda(None) == (False, "CPU build (nvcc found but no NVIDIA GPU visible; pass --cuda to force)")
    assert decide_cuda(True)[0] is True and decide_cuda(False)[0] is False
    monkeypatch.setattr(provision, "gpu_visible", lambda: True)
    assert decide_cuda(None)[0] is True
    which.clear()
    assert decide_cuda(None) == (False, "CPU build (no nvcc on PATH)")
    with pytest.raises(SetupError, match="nvcc is not on PATH"):
        decide_cuda(True)


@pytest.mark.e2e
def test_setup_is_cached_and_reports_requantized_files(bundled_model, llama_build):
    from .conftest import jbench_cli

    before = {q: e["path"] for q, e in bundled_model.items()}
    mtimes = {q: os.stat(p).st_mtime for q, p in before.items()}
    res = jbench_cli(["setup"])
    assert res.returncode == 0, res.stderr
    assert "already built" in res.stdout and "SHA-256 verified" in res.stdout
    assert "deriving" not in res.stdout  # cached by (source hash, quant, build commit)
    from jbench.models.store import load_manifest

    files = load_manifest("gemma3_270m")["files"]
    assert {q: os.stat(e["path"]).st_mtime for q, e in files.items() if q in mtimes} == mtimes
    for quant in ("Q4_0", "Q5_K_M", "Q6_K", "Q8_0", "F16"):
        assert files[quant]["requantized_from"] == "Q4_K_M"
        assert files[quant]["quantize_commit"] == llama_build["build_commit"]
    assert "requantized_from" not in files["Q4_K_M"]
    assert json.loads((provision.paths.llamacpp_builds_dir() / "active.json").read_text())["bin_dir"] == llama_build["bin_dir"]
