"""What flows through one trial's stages: its typed config, the device, the backend, and the record
the stages fill in."""

from __future__ import annotations

import contextlib
import io
import logging
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Optional

from jbench.analysis.energy import WindowEnergy

from jbench.backends.base import Backend
from jbench.device.connection import Connection
from jbench.core.results import BackendResult, Result
from jbench.core.trial import Trial, TrialConfig
from jbench.runner.session import DeviceSession


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
    # The serving scenario's load windows priced by the Measure stage: level name -> its energy (WindowEnergy).
    load_energy: dict[str, WindowEnergy] = field(default_factory=dict)

    @property
    def conn(self) -> Connection:
        return self.session.connection
