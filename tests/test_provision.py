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


def _tiny_project(root) -> "Path":
    """A real (tiny) CMake project: `tool` from two C sources; `-DVARIANT=...` changes one of them only,
    as the SIMD flags change ggml-cpu's sources and not the rest of llama.cpp."""
    from pathlib import Path

    src = Path(root) / "src"
    src.mkdir(parents=True)
    (src / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.14)\nproject(p C)\n"
        "add_library(variant STATIC variant.c)\n"
        "if (VARIANT)\n  target_compile_definitions(variant PRIVATE VARIANT=\"${VARIANT}\")\nendif()\n"
        "add_executable(tool main.c)\ntarget_link_libraries(tool variant)\n"
        "set_target_properties(tool PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)\n")
    (src / "main.c").write_text('#include <stdio.h>\nconst char *variant(void);\n'
                                'int main(void) { puts(variant()); return 0; }\n')
    (src / "variant.c").write_text('#ifndef VARIANT\n#define VARIANT "plain"\n#endif\n'
                                   'const char *variant(void) { return VARIANT; }\n')
    return src


def _ccache_stats(env: dict) -> dict:
    import subprocess

    out = subprocess.run(["ccache", "--print-stats"], env=env, capture_output=True, text=True, check=True).stdout
    return {k: int(v) for k, v in (line.split("\t") for line in out.splitlines() if "\t" in line)}


def test_builds_compile_through_ccache_kept_in_the_jbench_cache(tmp_path, monkeypatch):
    """compile_llamacpp with ccache installed (.ci/run installs it): the cache lives in $JBENCH_CACHE_DIR/ccache (a
    fresh cache directory starts cold); a second build of the same sources in another build directory with one
    source's flags changed compiles only that source, and the binaries are what the compiler makes."""
    import subprocess

    if not shutil.which("ccache"):
        pytest.fail("ccache is not installed: `apt-get install ccache` (.ci/run installs it)")
    cache = tmp_path / "cache"
    monkeypatch.setenv("JBENCH_CACHE_DIR", str(cache))
    monkeypatch.delenv("CCACHE_DIR", raising=False)  # .ci/run sets one for the whole run (next test)
    builds = provision.paths.llamacpp_builds_dir()
    src = _tiny_project(builds / "src")
    env = dict(os.environ, CCACHE_DIR=str(provision.ccache_dir()))
    assert provision.ccache_dir() == cache / "ccache"

    first = provision.compile_llamacpp(src, builds / "a", [], ("tool",), 1, tmp_path / "a.log")
    assert subprocess.run([str(first / "tool")], capture_output=True, text=True).stdout == "plain\n"
    stats = _ccache_stats(env)
    assert stats["cache_miss"] == 2, stats  # cold: both sources compiled
    assert (cache / "ccache").is_dir()

    second = provision.compile_llamacpp(src, builds / "b", ["-DVARIANT=nosimd"], ("tool",), 1,
                                        tmp_path / "b.log", nice=True)
    assert subprocess.run([str(second / "tool")], capture_output=True, text=True).stdout == "nosimd\n"
    after = _ccache_stats(env)
    hits = (after["direct_cache_hit"] + after["preprocessed_cache_hit"]) - (stats["direct_cache_hit"]
                                                                            + stats["preprocessed_cache_hit"])
    misses = after["cache_miss"] - stats["cache_miss"]
    assert (hits, misses) == (1, 1), after  # main.c from the cache (another build directory), variant.c compiled


def test_a_ccache_dir_the_user_set_is_the_one_builds_use(tmp_path, monkeypatch):
    monkeypatch.setenv("JBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CCACHE_DIR", str(tmp_path / "mine"))
    assert provision.ccache_dir() == tmp_path / "mine"
    if shutil.which("ccache"):
        _, env = provision._compiler_cache()
        assert env["CCACHE_DIR"] == str(tmp_path / "mine")
    monkeypatch.setenv("CCACHE_DIR", "")  # set but empty: as if unset
    assert provision.ccache_dir() == tmp_path / "cache" / "ccache"


def test_without_ccache_builds_compile_directly(monkeypatch):
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **kw: None if name == "ccache" else real_which(name, *a, **kw))
    assert provision._compiler_cache() == ([], None)
