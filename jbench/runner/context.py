"""What flows through one trial's stages: its typed config, the device, the backend, and the record
the stages fill in."""

from __future__ import annotations

import contextlib
import io
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Optional

from jbench.backends.base import Backend, backend_class
from jbench.core.schema import (
    DeviceConfig,
    EnergyConfig,
    ModelConfig,
    PowerConfig,
    ProfileConfig,
    TelemetryConfig,
    ThermalConfig,
)
from jbench.device.connection import Connection
from jbench.core.results import BackendResult, Result
from jbench.core.trial import Trial, wants_power_control
from jbench.runner.session import DeviceSession


@dataclass
class TrialConfig:
    """A trial's resolved config as schema objects (attribute access, types checked by OmegaConf)."""

    device: DeviceConfig
    backend: Any  # the backend's own CONFIG dataclass (LlamaCppConfig, ...)
    model: ModelConfig
    power: PowerConfig
    telemetry: TelemetryConfig
    energy: EnergyConfig
    thermal: ThermalConfig
    profile: Optional[ProfileConfig] = None

    @property
    def wants_power_control(self) -> bool:
        return wants_power_control(self.power.mode, self.power.jetson_clocks, self.power.fan)


def _typed(schema: type, values: Optional[dict]) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), values or {}))


def typed_config(config: dict) -> TrialConfig:
    """The schema objects of a trial's plain config (OmegaConf.to_object on each section's schema)."""
    return TrialConfig(
        device=_typed(DeviceConfig, config["device"]),
        backend=_typed(backend_class(config["backend"]["name"]).CONFIG, config["backend"]),
        model=_typed(ModelConfig, config["model"]),
        power=_typed(PowerConfig, config.get("power")),
        telemetry=_typed(TelemetryConfig, config.get("telemetry")),
        energy=_typed(EnergyConfig, config.get("energy")),
        thermal=_typed(ThermalConfig, config.get("thermal")),
        profile=_typed(ProfileConfig, config["profile"]) if config.get("profile") else None,
    )


class TrialLog:
    """One trial's log lines on one device, kept for its `trial.log` artifact and passed on to jbench's log with -v.

    Each trial log has its own logger object, not one from logging's registry keyed by a name: two units running
    the same trial at once (a nightly over a class) would share a named logger and mix their lines."""

    def __init__(self, trial: Trial, unit: Optional[str] = None):
        self.buffer = io.StringIO()
        name = f"jbench.trial.{trial.index}" + (f".{unit}" if unit else "")
        self.logger = logging.Logger(name, logging.DEBUG)  # unregistered: garbage once the trial is recorded
        parent = logging.getLogger("jbench")
        if parent.isEnabledFor(logging.DEBUG):
            self.logger.parent = parent  # -v: the lines reach the terminal too
        else:
            self.logger.propagate = False
        self.handler = logging.StreamHandler(self.buffer)
        self.handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        self.logger.addHandler(self.handler)

    def text(self) -> str:
        return self.buffer.getvalue()

    def close(self) -> None:
        self.logger.removeHandler(self.handler)


@dataclass
class TrialContext:
    """The state of one trial as it passes through the stages (power, thermal gate, measure, analyses).

    Stages read the typed config and what earlier stages left (backend_result, actual_mode) and add to
    `record`, the one Result the run layer records for the trial."""

    trial: Trial
    cfg: TrialConfig
    session: DeviceSession
    backend: Backend
    log: logging.Logger
    max_cv: Optional[float] = None  # sweep.max_cv: a rate whose CV is above it marks the trial noisy
    # Held around a measurement on this machine: nothing else of jbench's (the recorder) runs meanwhile.
    quiet: Callable[[], ContextManager[None]] = contextlib.nullcontext
    record: Result = field(default_factory=Result)
    backend_result: Optional[BackendResult] = None
    actual_mode: Optional[str] = None  # the power mode the device reported after the power stage
    notes: list[str] = field(default_factory=list)  # said once per sweep (e.g. why energy is missing)
    noisy: bool = False

    @property
    def conn(self) -> Connection:
        return self.session.connection
