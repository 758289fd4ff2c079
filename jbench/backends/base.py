"""The backend contract and registry.

A backend turns a Trial into a BackendResult by running commands on a device Connection. It never
talks to MLflow and never opens connections itself. New backends register through the
`jbench.backends` entry-point group (see pyproject.toml), so adding one needs no core edit.

A backend declares its config as a dataclass (`CONFIG`, the schema of conf/backend/<NAME>.yaml) and is
typed by it: `class MyBackend(Backend[MyConfig])`. `self.config` is that dataclass (a section given as a
plain mapping is converted once, in `__init__`); a trial's sections are read through `trial.cfg`, typed
the same way (`self.config_of(trial)` is the trial's backend section as this backend's CONFIG).
"""

from __future__ import annotations

import logging
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Mapping, Optional, Protocol, TypeVar, Union

from jbench.analysis.memory import BufferAccount
from jbench.core import registry
from jbench.core.results import BackendResult
from jbench.core.schema import typed
from jbench.core.trial import Trial
from jbench.device.connection import CommandResult, Connection

ConfigT = TypeVar("ConfigT")


class BackendError(Exception):
    """A trial-level failure. category is one of: unparseable_output, backend_crash, timeout,
    missing_binary, missing_model, out_of_memory."""

    def __init__(self, category: str, message: str, raw_output: str = "", raw_stderr: str = ""):
        super().__init__(message)
        self.category = category
        self.raw_output = raw_output
        self.raw_stderr = raw_stderr


# What a backend prints when it ran out of memory, lower case; the one list every backend checks
# (looks_oom). Where each comes from:
OOM_MARKERS: tuple[str, ...] = (
    "out of memory",  # CUDA's text for cudaErrorMemoryAllocation (ggml-cuda: "cudaMalloc failed: out of memory",
                      # "CUDA error: out of memory"; PyTorch "CUDA out of memory"; TensorRT "Cuda Runtime (out of memory)")
    "outofmemory",  # torch.OutOfMemoryError / torch.cuda.OutOfMemoryError (TensorRT-LLM's Python tools)
    "cudaerrormemoryallocation",  # the CUDA error's name, as TensorRT and TensorRT-LLM print it
    "cudamalloc failed",  # ggml-cuda: "allocating N MiB on device 0: cudaMalloc failed: ..."
    "failed to allocate",  # ggml/llama.cpp: "failed to allocate CUDA0 buffer of size N", "failed to allocate buffer"
    "unable to allocate",  # llama.cpp's model loader: "unable to allocate CUDA0 buffer"
    "not enough space in the buffer",  # ggml-alloc's ggml_tallocr_alloc: "not enough space in the buffer to allocate X"
    "cannot allocate memory",  # strerror(ENOMEM): mmap, fork, pinned host memory
    "bad_alloc",  # C++ std::bad_alloc
    "memoryerror",  # Python's MemoryError
    "cublas_status_alloc_failed",  # cuBLAS could not allocate its workspace
)
# Jetson's NvMap allocator refusing with ENOMEM (12): "NvMapMemAllocInternalTagged: 1075072515 error 12".
# TensorRT may retry after it, so it only counts in the output of a command that failed, as every marker here.
_NVMAP_ENOMEM = re.compile(r"nvmapmem\w*:[^\n]*\berror 12\b")
# The shell's notice for a child killed by SIGKILL, which is what the kernel's OOM killer sends:
# "Killed", or bash's "bash: line 1:  4242 Killed   llama-bench ...". The kernel's own line ("Out of
# memory: Killed process ...") goes to the kernel log, not to the command's output.
_KILLED = re.compile(r"(?m)^\s*(?:\S+: line \d+:\s+\d+\s+)?Killed(?:\s|$)")
SIGKILL_EXIT_CODES = (137, -9)  # 128 + SIGKILL from a shell; -9 from Python's subprocess


def looks_oom(text: str, exit_code: Optional[int] = None) -> bool:
    """Whether a failed command's output (stderr, or stderr and stdout) says it ran out of memory.

    True on any of OOM_MARKERS (case-insensitive) or a Jetson NvMap ENOMEM line; also on the shell's
    `Killed` notice when the exit code says SIGKILL (137 or -9): the OOM killer's signature. Call it
    only for a command that failed: some of these lines are warnings in a run that recovers.
    """
    if not text:
        return False
    low = text.lower()
    if any(marker in low for marker in OOM_MARKERS) or _NVMAP_ENOMEM.search(low):
        return True
    return exit_code in SIGKILL_EXIT_CODES and _KILLED.search(text) is not None


@dataclass(frozen=True)
class Capabilities:
    quants: frozenset[str] = frozenset()  # empty: any quant the model source offers
    kv_types: frozenset[str] = frozenset({"f16"})
    flash_attention: bool = False
    context_depth: bool = False
    latency_scenario: bool = False
    # The model file is a GGUF file (llama.cpp): planning checks its header and size, so a directory, an empty,
    # foreign or truncated file stops the sweep before it runs (other backends read formats of their own).
    gguf_models: bool = False
    extra: dict = field(default_factory=dict)


@dataclass
class MemoryPass:
    """What a backend's memory pass measured (jbench.runner.memory): the process's peak resident set (KiB;
    None when the wrapper printed none), the backend's own buffer account from its log (None when it printed no
    buffer line), its stderr without the wrapper's marker, and the command it ran (the backend's own, unwrapped)."""

    command: list[str]
    raw_stderr: str
    peak_rss_kib: Optional[int] = None
    account: Optional[BufferAccount] = None


class Backend(ABC, Generic[ConfigT]):
    NAME: ClassVar[str]
    CAPABILITIES: ClassVar[Capabilities]
    # The dataclass schema of conf/backend/<NAME>.yaml (registered in Hydra's ConfigStore as <NAME>_schema);
    # the class's ConfigT.
    CONFIG: ClassVar[type]

    def __init__(self, config: Union[ConfigT, Mapping[str, Any]]):
        # A plain section (the planner's trial config, a test's dict) becomes the schema object here, once.
        self.config: ConfigT = typed(self.CONFIG, config, where="backend")

    def config_of(self, trial: Trial) -> ConfigT:
        """The trial's backend section as this backend's CONFIG (each trial of a sweep may set other values)."""
        cfg = trial.cfg.backend
        if not isinstance(cfg, self.CONFIG):
            raise TypeError(f"backend {self.NAME} got a trial whose backend section is a {type(cfg).__name__}")
        return cfg

    @abstractmethod
    def validate(self, trial: Trial) -> list[str]:
        """Problems with this trial found without touching a device (empty: valid)."""

    @abstractmethod
    def preflight(self, conn: Connection) -> list[str]:
        """Problems found on the device before any trial runs (binaries missing, ...)."""

    def reads_model_file(self, trial: Trial) -> bool:
        """Whether this trial reads its model file (model.files / path_template / the bundled file): if so,
        the planner (local device) or preflight (remote device) refuses the sweep when the file is missing."""
        return True

    def build_id(self, conn: Connection) -> Optional[str]:
        """What identifies the backend build on the device (part of a trial's identity: a different build
        is not "already FINISHED"); None when the backend cannot tell. Called once per device after a
        successful preflight."""
        return None

    @abstractmethod
    def run(self, trial: Trial, conn: Connection, log: logging.Logger, *, only_phase: Optional[str] = None,
            repetitions: Optional[int] = None) -> BackendResult:
        """Run the trial; raise BackendError for a failure that belongs to this trial.

        Phases carry device-clock end times where the backend can give them (PhaseResult.window).
        only_phase/repetitions run one phase with more repetitions: the energy pass for phases whose
        speed window is too short to integrate power over."""

    def memory_pass(self, trial: Trial, conn: Connection, log: logging.Logger) -> Optional[MemoryPass]:
        """Run the trial's workload once more to account for its memory (peak RSS, the backend's buffers); raise
        BackendError when that run fails. None: this backend reports no memory account."""
        return None

    @classmethod
    def buffer_settings(cls, cfg: Any) -> Optional[dict[str, str]]:
        """The settings of a trial's backend section (this backend's CONFIG) that shape its memory buffers, as
        strings, the context size as the backend computes it among them: the measured-buffer cache's key
        (jbench.models.memory_facts). None: the backend keeps no buffer account."""
        return None

    @classmethod
    def planned_build(cls, cfg: Any) -> Optional[str]:
        """The build id (as `build_id` reads it on the device) a trial's backend section will run, as far as planning
        can tell without a device; None: only the device can tell."""
        return None


def command_failure(tool: str, res: CommandResult, raw_output: Optional[str] = None,
                    raw_stderr: Optional[str] = None, *, check_stdout: bool = False) -> BackendError:
    """The BackendError for a backend command that exited non-zero: `out_of_memory` when its stderr (and
    stdout with check_stdout) looks like it (looks_oom), else `backend_crash`; the message names the tool
    and the exit code and ends with the last 5 lines of stderr. raw_output/raw_stderr default to the
    command's own output."""
    text = res.stderr + ("\n" + res.stdout if check_stdout else "")
    category = "out_of_memory" if looks_oom(text, res.returncode) else "backend_crash"
    tail = "\n".join(res.stderr.strip().splitlines()[-5:])
    return BackendError(category, f"{tool} exited with code {res.returncode}: {tail}",
                        res.stdout if raw_output is None else raw_output,
                        res.stderr if raw_stderr is None else raw_stderr)


def timeout_failure(tool: str, argv: list[str], limit_s: float,
                    limit_key: Optional[str] = "backend.timeout_s") -> BackendError:
    """The BackendError `timeout` for a backend command that ran past its limit, named as the user knows it: the
    backend's own command (its program by name, not jbench's wrapper that stamps output lines with the device's
    clock) and the setting whose limit was hit (None: a fixed limit of jbench's). The full path is in the trial's
    log."""
    import os
    import shlex

    shown = shlex.join([os.path.basename(str(argv[0])), *map(str, argv[1:])]) if argv else tool
    limit = f"{limit_key}={limit_s:g} s" if limit_key else f"{limit_s:g} s"
    return BackendError("timeout", f"{tool} did not finish within {limit}: {shown}")


def device_model_path(trial: Trial, conn: Connection, what: str = "model file") -> str:
    """The trial's model file (or checkpoint) as a path on the device, which must exist there;
    BackendError `missing_model` when the model cannot be resolved or the file is absent."""
    from jbench.models.store import ModelError, resolve_model_file

    try:
        path, _ = resolve_model_file(trial.cfg.model)
    except ModelError as exc:
        raise BackendError("missing_model", str(exc)) from None
    path = conn.expand_path(path)
    if not conn.exists(path):
        raise BackendError("missing_model", f"{what} {path} not found on device '{conn.name}'")
    return path


class TokenCounts(Protocol):
    """The common keys of a llama-bench-like backend's CONFIG (docs/backends.md)."""

    n_prompt: int
    n_gen: int
    depth: int
    repetitions: int


def size_problems(cfg: TokenCounts) -> list[str]:
    """The token-count and repetition checks every llama-bench-like backend shares."""
    problems = [f"backend.{key} must be >= 0 (got {value})"
                for key, value in (("n_prompt", cfg.n_prompt), ("n_gen", cfg.n_gen), ("depth", cfg.depth)) if value < 0]
    if cfg.n_prompt == 0 and cfg.n_gen == 0:
        problems.append("backend.n_prompt and backend.n_gen are both 0: nothing to measure")
    if cfg.repetitions < 1:
        problems.append(f"backend.repetitions must be >= 1 (got {cfg.repetitions})")
    return problems


def backend_class(name: str) -> type[Backend]:
    """The Backend class registered under name (built-in or through the `jbench.backends` entry points)."""
    try:
        return registry.load(registry.BACKENDS, name)
    except KeyError as exc:
        raise KeyError(str(exc.args[0]).replace("Valid:", "Valid backends:")) from None
