"""The backend contract and registry.

A backend turns a Trial into a BackendResult by running commands on a device Connection. It never
talks to MLflow and never opens connections itself. New backends register through the
`jbench.backends` entry-point group (see pyproject.toml), so adding one needs no core edit.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Optional

from jbench import registry
from jbench.device.connection import Connection
from jbench.trial import Trial
from jbench.results import BackendResult


class BackendError(Exception):
    """A trial-level failure. category is one of: unparseable_output, backend_crash, timeout,
    missing_binary, missing_model, out_of_memory."""

    def __init__(self, category: str, message: str, raw_output: str = "", raw_stderr: str = ""):
        super().__init__(message)
        self.category = category
        self.raw_output = raw_output
        self.raw_stderr = raw_stderr


@dataclass(frozen=True)
class Capabilities:
    quants: frozenset[str] = frozenset()  # empty: any quant the model source offers
    kv_types: frozenset[str] = frozenset({"f16"})
    flash_attention: bool = False
    context_depth: bool = False
    latency_scenario: bool = False
    extra: dict = field(default_factory=dict)


class Backend(ABC):
    NAME: ClassVar[str]
    CAPABILITIES: ClassVar[Capabilities]
    # The dataclass schema of conf/backend/<NAME>.yaml (registered in Hydra's ConfigStore as <NAME>_schema).
    CONFIG: ClassVar[type]

    def __init__(self, config: dict):
        self.config = config

    @abstractmethod
    def validate(self, trial: Trial) -> list[str]:
        """Problems with this trial found without touching a device (empty: valid)."""

    @abstractmethod
    def preflight(self, conn: Connection) -> list[str]:
        """Problems found on the device before any trial runs (binaries missing, ...)."""

    @abstractmethod
    def run(self, trial: Trial, conn: Connection, log: logging.Logger, *, only_phase: Optional[str] = None,
            repetitions: Optional[int] = None) -> BackendResult:
        """Run the trial; raise BackendError for a failure that belongs to this trial.

        Phases carry device-clock end times where the backend can give them (PhaseResult.window).
        only_phase/repetitions run one phase with more repetitions: the energy pass for phases whose
        speed window is too short to integrate power over."""


def size_problems(cfg: dict) -> list[str]:
    """The token-count and repetition checks every llama-bench-like backend shares."""
    problems = [f"backend.{key} must be >= 0 (got {cfg[key]})" for key in ("n_prompt", "n_gen", "depth") if cfg[key] < 0]
    if cfg["n_prompt"] == 0 and cfg["n_gen"] == 0:
        problems.append("backend.n_prompt and backend.n_gen are both 0: nothing to measure")
    if cfg["repetitions"] < 1:
        problems.append(f"backend.repetitions must be >= 1 (got {cfg['repetitions']})")
    return problems


def backend_schemas() -> dict[str, type]:
    """name -> config dataclass of every registered backend that imports; a broken third-party
    backend is left out with a warning instead of breaking every command."""
    import logging

    out = {}
    for name in registry.targets(registry.BACKENDS):
        try:
            out[name] = backend_class(name).CONFIG
        except Exception as exc:  # ImportError, AttributeError from a plugin
            logging.getLogger("jbench").warning("backend '%s' is registered but cannot be loaded: %s", name, exc)
    return out


def backend_class(name: str) -> type[Backend]:
    """The Backend class registered under name (built-in or through the `jbench.backends` entry points)."""
    try:
        return registry.load(registry.BACKENDS, name)
    except KeyError as exc:
        raise KeyError(str(exc.args[0]).replace("Valid:", "Valid backends:")) from None
