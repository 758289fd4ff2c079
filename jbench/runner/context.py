"""What flows through one trial's stages: its typed config, the device, the backend, and the record
the stages fill in."""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

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
from jbench.device.power import PowerStrategy
from jbench.core.results import BackendResult, Result
from jbench.core.trial import Trial, wants_power_control


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
    """One trial's log lines, kept for its `trial.log` artifact and passed on to jbench's log with -v."""

    def __init__(self, trial: Trial):
        self.buffer = io.StringIO()
        self.logger = logging.getLogger(f"jbench.trial.{trial.index}")
        self.logger.setLevel(logging.DEBUG)
        self.logger.propagate = logging.getLogger("jbench").isEnabledFor(logging.DEBUG)
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
    `record`, the one Result the sweep logs for the trial."""

    trial: Trial
    cfg: TrialConfig
    conn: Connection
    backend: Backend
    power: Optional[PowerStrategy]
    log: logging.Logger
    max_cv: Optional[float] = None  # sweep.max_cv: a rate whose CV is above it marks the trial noisy
    record: Result = field(default_factory=Result)
    backend_result: Optional[BackendResult] = None
    actual_mode: Optional[str] = None  # the power mode the device reported after the power stage
    notes: list[str] = field(default_factory=list)  # said once per sweep (e.g. why energy is missing)
    noisy: bool = False
