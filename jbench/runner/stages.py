"""The stages of one trial: the fixed ones (power state -> device state -> thermal gate -> measure), then the
registered analyses in the order their declared metrics need.

Each stage is a small class with one `run(ctx)` over the shared TrialContext. A stage that cannot do its job raises
(PowerStateError, BackendError, DeviceError, ConnectionLost); the trial runner turns the exception into a FAILED
trial with its category in one place (jbench.runner.trials). A new per-trial analysis is a Stage registered in the
`jbench.analyses` entry-point group (jbench.core.registry) that declares the metrics it PROVIDES and REQUIRES (names
or fnmatch patterns; jbench's own stages take theirs from the declarations in jbench.core.metrics): analyses are ordered from those declarations (graphlib), and a
requirement no stage provides is an error when the stage list is built, not a silent NaN later.
"""

from __future__ import annotations

import fnmatch
import graphlib
import json
import shlex
from abc import ABC, abstractmethod
from typing import ClassVar

from jbench.core import metrics, registry
from jbench.core.results import Result
from jbench.device.jetson import jetson_fingerprint
from jbench.device.thermal import thermal_gate
from jbench.runner.context import TrialContext
from jbench.runner.measure import measure


class StageError(RuntimeError):
    """The stage list cannot be built: a stage requires a metric nothing provides, or requirements form a cycle."""


class Stage(ABC):
    NAME: ClassVar[str]
    # Metric names (or fnmatch patterns) this stage adds to the record, and those it reads from it.
    PROVIDES: ClassVar[tuple[str, ...]] = ()
    REQUIRES: ClassVar[tuple[str, ...]] = ()

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
        ctx.record.tags.update(ctx.session.apply(ctx.cfg.power, logger=ctx.log))
        assert ctx.session.strategy is not None and ctx.session.strategy.last is not None
        ctx.actual_mode = ctx.session.strategy.last.mode


class DeviceState(Stage):
    """The Jetson's facts as this trial starts (power mode, boot id, module, release): read per trial, since a
    sweep's trials run in different modes and a reboot may happen between them."""

    NAME = "device_state"

    def applies(self, ctx: TrialContext) -> bool:
        return ctx.cfg.device.profile is not None

    def run(self, ctx: TrialContext) -> None:
        paths = ctx.cfg.device.paths
        tags = jetson_fingerprint(ctx.conn, paths)
        boot = ctx.conn.run(["cat", paths.boot_id], timeout=30)
        if boot.ok and boot.stdout.strip():
            boot_id = boot.stdout.strip()
            tags["jetson.boot_id"] = boot_id
            previous = ctx.session.boot_id
            if previous and previous != boot_id and "jetson.rebooted" not in ctx.record.tags:
                # Not by jbench's power stage: the device went down between trials (crash, power loss, a person).
                tags["jetson.rebooted"] = "since the previous trial (not by jbench)"
            ctx.session.boot_id = boot_id
        ctx.record.tags.update(tags)


class ThermalGate(Stage):
    """Wait (bounded) until the device is cool enough to start."""

    NAME = "thermal_gate"

    def run(self, ctx: TrialContext) -> None:
        ctx.record.tags.update(thermal_gate(ctx.conn, ctx.cfg.thermal, ctx.log))


class Measure(Stage):
    """The backend's run under telemetry; what the backend itself reported joins the record."""

    NAME = metrics.MEASURE
    PROVIDES = tuple(metrics.provided_by(NAME))  # energy, telemetry, wall power, and the backend's own metrics

    def run(self, ctx: TrialContext) -> None:
        with ctx.quiet():  # on this machine: nothing else of jbench's runs while the benchmark does
            measure(ctx)
        result = ctx.backend_result
        assert result is not None
        tags = {f"backend.{k}": str(v) for k, v in result.build.items()}
        if result.command:  # what ran on the device, as the backend started it (argument list, shell-quoted here)
            tags["backend.command"] = shlex.join(result.command)[:4000]
        # What the backend says it ran with (its own output), apart from the params that asked for it.
        tags.update({f"backend.reported.{k}": str(v) for k, v in result.info.items()
                     if k in ("backends", "gpu_info", "cpu_info", "flash_attn")})
        artifacts = {"raw/stdout.txt": result.raw_output, "raw/stderr.txt": result.raw_stderr}
        if result.findings:
            artifacts["backend_findings.json"] = json.dumps([f.as_dict() for f in result.findings], indent=2,
                                                            default=str)
        ctx.record.merge(Result(metrics=dict(result.metrics), tags={**result.tags, **tags},
                                findings=list(result.findings), artifacts=artifacts, stepped=dict(result.stepped)))


FIXED = (PowerState, DeviceState, ThermalGate, Measure)


def _provides(stage: type[Stage], metric: str) -> bool:
    """Whether a stage's declared metrics cover a required one (either side may be a pattern)."""
    return any(fnmatch.fnmatchcase(metric, p) or fnmatch.fnmatchcase(p, metric) for p in stage.PROVIDES)


def order_analyses(analyses: list[type[Stage]]) -> list[type[Stage]]:
    """The analyses in an order where each runs after every analysis that provides a metric it requires (ties by
    NAME). A requirement that neither the fixed stages nor any analysis provides raises StageError."""
    graph: dict[type[Stage], set[type[Stage]]] = {}
    for stage in analyses:
        deps: set[type[Stage]] = set()
        for metric in stage.REQUIRES:
            providers = [a for a in analyses if a is not stage and _provides(a, metric)]
            if not providers and not any(_provides(f, metric) for f in FIXED):
                raise StageError(f"analysis '{stage.NAME}' requires metric '{metric}', which no stage provides "
                                 f"(declared: {', '.join(sorted(p for s in (*FIXED, *analyses) for p in s.PROVIDES))})")
            deps.update(providers)
        graph[stage] = deps
    sorter = graphlib.TopologicalSorter(graph)
    try:
        sorter.prepare()
    except graphlib.CycleError as exc:
        raise StageError(f"analyses require each other's metrics in a cycle: {[s.NAME for s in exc.args[1]]}") from None
    out: list[type[Stage]] = []
    while sorter.is_active():
        ready = sorted(sorter.get_ready(), key=lambda s: s.NAME)
        out.extend(ready)
        sorter.done(*ready)
    return out


def default_stages() -> list[Stage]:
    """The stage list of every trial: the fixed device and measurement stages, then every registered analysis in the
    order its declared metrics need."""
    analyses = [registry.load(registry.ANALYSES, name) for name in registry.targets(registry.ANALYSES)]
    return [cls() for cls in FIXED] + [cls() for cls in order_analyses(analyses)]
