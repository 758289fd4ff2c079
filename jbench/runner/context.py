"""What flows through one trial's stages: its typed config, the device, the backend, and the record
the stages fill in."""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass, field
from typing import Optional

from jbench.backends.base import Backend
from jbench.device.connection import Connection
from jbench.device.power import PowerStrategy
from jbench.core.results import BackendResult, Result
from jbench.core.trial import Trial, TrialConfig, trial_config


def typed_config(config: dict) -> TrialConfig:
    """The schema objects of a trial's plain config (jbench.core.trial.trial_config)."""
    return trial_config(config)


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
