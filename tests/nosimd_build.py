"""The SIMD-less llama-bench of tests/test_bisect.py, tests/test_bisect_remote.py and tests/test_confirm.py: a
llama.cpp build that really is slower, from the cached build's sources with SIMD disabled (x86-64's baseline SSE2
remains). Built once per cache ($JBENCH_CACHE_DIR-aware) with -j2 under nice, through ccache when it is installed
(jbench's own builds do: only ggml's CPU sources then compile again). The `nosimd_build` fixture (tests/conftest.py)
uses it; `make test` also starts `python -m tests.nosimd_build` in the background beside its parallel pass, so the
serial pass that needs the build finds it done. Whoever comes first builds; the others wait on the lock."""

from __future__ import annotations

import contextlib
import fcntl
import json
import platform
import signal
import sys
import time
from pathlib import Path

NOSIMD_FLAGS = ["-DGGML_NATIVE=OFF", "-DGGML_SSE42=OFF", "-DGGML_AVX=OFF", "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX2=OFF",
                "-DGGML_BMI2=OFF", "-DGGML_FMA=OFF", "-DGGML_F16C=OFF", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF",
                "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
                "-DGGML_AMX_BF16=OFF"]


@contextlib.contextmanager
def cache_lock(path: Path):
    """An exclusive lock on `path` (created), held by this process until the block ends (or it dies)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_nosimd_build(commit: str) -> Path:
    """The bin directory of the SIMD-less llama-bench of `commit` (the active build's), built when missing."""
    from jbench.core import paths
    from jbench.models.provision import (LLAMA_CPP_PYTHON_VERSION, cmake_args, compile_llamacpp, extract_sources,
                                         fetch_sdist)

    root = paths.llamacpp_builds_dir() / f"{LLAMA_CPP_PYTHON_VERSION}-{commit}-cpu-nosimd-{platform.machine()}"
    with cache_lock(root.with_name(root.name + ".lock")):
        if not (root / "bin" / "llama-bench").exists():
            src, _ = extract_sources(fetch_sdist(lambda m: None), lambda m: None)
            root.mkdir(parents=True, exist_ok=True)  # an interrupted build resumes where it stopped
            args = cmake_args(commit, False) + NOSIMD_FLAGS
            started = time.monotonic()
            # nice: the build shares the machine with the tests around it.
            compile_llamacpp(src, root, args, ("llama-bench",), 2, root / "build.log", nice=True)
            (root / "build.json").write_text(json.dumps({"build_commit": commit, "flavor": "cpu-nosimd",
                                                         "cmake_args": args,
                                                         "build_seconds": round(time.monotonic() - started, 1)}))
    return root / "bin"


def main() -> int:
    from jbench.models.provision import active_build

    # Started in the background by `make test` (a non-interactive shell: SIGINT ignored), it still ends, with the
    # build it runs, on the Ctrl-C that ends the tests.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)

    build = active_build()
    if build is None:
        print("nosimd_build: no llama.cpp build (run `jbench setup`); the tests that need one will say so",
              file=sys.stderr)
        return 1
    started = time.monotonic()
    bin_dir = ensure_nosimd_build(build["build_commit"])
    print(f"nosimd_build: {bin_dir} ready after {time.monotonic() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
