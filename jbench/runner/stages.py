"""The stages of one trial, in order: power state -> device state -> thermal gate -> measure -> analyses.

Each stage is a small class with one `run(ctx)` over the shared TrialContext. A stage that cannot do
its job raises (PowerStateError, BackendError, DeviceError, ConnectionLost); the sweep turns the
exception into a FAILED trial with its category in one place (Sweep._failure). A new per-trial analysis
is a Stage registered in the `jbench.analyses` entry-point group (jbench.registry), not an edit here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from jbench.core import registry
from jbench.device.jetson import jetson_fingerprint
from jbench.device.thermal import thermal_gate
from jbench.core.results import Result
from jbench.runner.context import TrialContext
from jbench.runner.measure import measure


class Stage(ABC):
    NAME: ClassVar[str]
    # Registered analyses run in ascending ORDER (then by name): a later one may read what earlier ones
    # added to ctx.record (the noise check reads the phase CVs).
    ORDER: ClassVar[int] = 100

    def applies(self, ctx: TrialContext) -> bool:
        """False skips the stage for this trial (e.g. no power control asked for)."""
        return True

    @abstractmethod
    def run(self, ctx: TrialContext) -> None:
        """Do the stage's work; add what it found to ctx.record."""


class PowerState(Stage):
    """Bring the device into the trial's power state (nvpmodel mode, jetson_clocks, fan) and verify it."""

    NAME = "power"

    def applies(self, ctx: TrialContext) -> bool:
        return ctx.cfg.wants_power_control

    def run(self, ctx: TrialContext) -> None:
        power, strategy = ctx.cfg.power, ctx.power
        assert strategy is not None, "the sweep's preflight gives every power-controlled device a strategy"
        strategy.log = ctx.log
        changes = strategy.apply(power.mode, power.jetson_clocks, allow_reboot=power.allow_reboot,
                                 reboot_timeout_s=power.reboot_timeout_s, fan=power.fan)
        snap = strategy.last
        ctx.actual_mode = snap.mode
        ctx.record.tags.update(power_state_tags(snap, changes))
        if snap.fan_pwm is not None:
            ctx.record.tags["power.fan_pwm"] = str(snap.fan_pwm)
        if strategy.rebooted:
            ctx.record.tags["jetson.rebooted"] = "power mode change"


def power_state_tags(snap: Any, changes: list[str]) -> dict[str, str]:
    """The power state as read back after applying it (a PowerStrategy's `last` snapshot) and what changed."""
    tags = {"power.mode_actual": str(snap.mode), "power.mode_id": str(snap.mode_id),
            "power.jetson_clocks_actual": str(snap.clocks_locked), "power.changes": "; ".join(changes) or "none"}
    # Every part of the lock as verified on the device (a half-locked device is visible, not hidden).
    tags.update({f"power.lock.{k}": str(v) for k, v in snap.locks.parts().items() if v is not None})
    return tags


class DeviceState(Stage):
    """The Jetson's facts as this trial starts (power mode, boot id, module, release): read per trial, since a
    sweep's trials run in different modes and a reboot may happen between them."""

    NAME = "device_state"

    def __init__(self) -> None:
        self._boot_ids: dict[str, str] = {}  # device -> boot id seen at its previous trial in this sweep

    def applies(self, ctx: TrialContext) -> bool:
        return ctx.cfg.device.profile is not None

    def run(self, ctx: TrialContext) -> None:
        paths = ctx.trial.config["device"]["paths"]
        tags = jetson_fingerprint(ctx.conn, paths)
        boot = ctx.conn.run(["cat", paths["boot_id"]], timeout=30)
        if boot.ok and boot.stdout.strip():
            boot_id = boot.stdout.strip()
            tags["jetson.boot_id"] = boot_id
            previous = self._boot_ids.get(ctx.cfg.device.name)
            if previous and previous != boot_id and "jetson.rebooted" not in ctx.record.tags:
                # Not by jbench's power stage: the device went down between trials (crash, power loss, a person).
                tags["jetson.rebooted"] = "since the previous trial (not by jbench)"
            self._boot_ids[ctx.cfg.device.name] = boot_id
        ctx.record.tags.update(tags)


class ThermalGate(Stage):
    """Wait (bounded) until the device is cool enough to start."""

    NAME = "thermal_gate"

    def run(self, ctx: TrialContext) -> None:
        ctx.record.tags.update(thermal_gate(ctx.conn, ctx.cfg.thermal, ctx.log))


class Measure(Stage):
    """The backend's run under telemetry; what the backend itself reported joins the record."""

    NAME = "measure"

    def run(self, ctx: TrialContext) -> None:
        measure(ctx)
        result = ctx.backend_result
        assert result is not None
        tags = {f"backend.{k}": str(v) for k, v in result.build.items()}
        # What the backend says it ran with (its own output), apart from the params that asked for it.
        tags.update({f"backend.reported.{k}": str(v) for k, v in result.info.items()
                     if k in ("backends", "gpu_info", "cpu_info", "flash_attn")})
        artifacts = {"raw/stdout.txt": result.raw_output, "raw/stderr.txt": result.raw_stderr}
        if result.findings:
            import json

            artifacts["backend_findings.json"] = json.dumps([f.as_dict() for f in result.findings], indent=2,
                                                            default=str)
        ctx.record.merge(Result(metrics=dict(result.metrics), tags={**result.tags, **tags},
                                findings=list(result.findings), artifacts=artifacts))


def default_stages() -> list[Stage]:
    """The stage list of every trial: the fixed device and measurement stages, then every registered
    analysis by ORDER."""
    analyses = [registry.load(registry.ANALYSES, name) for name in registry.targets(registry.ANALYSES)]
    analyses.sort(key=lambda cls: (cls.ORDER, cls.NAME))
    return [PowerState(), DeviceState(), ThermalGate(), Measure(), *(cls() for cls in analyses)]
