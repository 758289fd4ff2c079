"""The units of a device class (`device=@CLASS`): the device entries of that class, or the places a farm coordinator
leases (jbench.farm: reserve, wait, acquire, heartbeat, release). A unit is then held like any device, through its
own DeviceSession (jbench.runner.session); the farm lease, taken first, is given back after the units' sessions
closed (their power states restored)."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

from jbench.core.schema import DeviceConfig, FarmConfig, typed

log = logging.getLogger("jbench")


class UnitsError(Exception):
    """No unit of the class could be had: nothing ran."""


POOL_PREFIX = "@"  # device=@CLASS: every unit of a device class


@dataclass
class Pool:
    """The units a `device=@CLASS` sweep spreads its trials over. With a coordinator the units are the leased
    places matching `selector` (count None: every matching place); without one, `members`: the device entries
    of the config search path whose device_class is the class."""

    device_class: str
    members: list[dict] = field(default_factory=list)
    coordinator: Optional[str] = None
    selector: dict = field(default_factory=dict)
    count: Optional[int] = None
    farm: FarmConfig = field(default_factory=FarmConfig)  # heartbeat, timeouts, quarantine (a plain section is typed)
    config_dirs: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.farm = typed(FarmConfig, self.farm, where="farm")

    @property
    def name(self) -> str:
        return POOL_PREFIX + self.device_class


@dataclass
class Units:
    """The units held for a pool: their device entries, the farm place of each (by unit name), the farm lease."""

    devices: list[dict] = field(default_factory=list)
    places: dict[str, str] = field(default_factory=dict)
    farm: Any = None  # jbench.farm.FarmLease while leased (records trials for quarantine)

    def tags(self, pool: Pool, name: str, fingerprint: dict[str, str]) -> dict[str, str]:
        """Who ran a pool trial: the unit, its class, host, serial when the fingerprint has one, its farm place."""
        unit = next((typed(DeviceConfig, u, where="device") for u in self.devices if u.get("name") == name), None)
        tags = {"device.unit": name, "device.class": pool.device_class}
        if unit is not None and unit.host:
            tags["device.host"] = f"{unit.host}:{unit.port}"
        if fingerprint.get("jetson.serial"):
            tags["device.serial"] = fingerprint["jetson.serial"]
        if name in self.places:
            tags["farm.place"] = self.places[name]
        return tags


def take_units(pool: Pool, stack: contextlib.ExitStack, owner: str) -> Units:
    """The pool's units: the leased places matching the class (a coordinator is set), else the device entries whose
    device_class is the class. A farm lease joins `stack` (released when it unwinds). UnitsError: none to be had."""
    if not pool.coordinator:
        return Units([dict(m) for m in pool.members])
    from jbench import farm
    from jbench.farm.coordinator import Coordinator, CoordinatorError, iter_places
    from jbench.farm.places import FarmError

    try:
        count = pool.count
        if count is None:  # "all": every healthy place of the class the coordinator knows now
            probe = Coordinator(pool.coordinator)
            try:
                probe.open()
                count = len(list(iter_places(probe, {**pool.selector, "jbench_health": "ok"})))
            finally:
                probe.close()
            if count == 0:
                raise UnitsError(f"no healthy farm place matches {pool.selector} on {pool.coordinator} "
                                 "(see `jbench farm list`)")
        f = pool.farm
        leased = stack.enter_context(farm.lease(
            pool.coordinator, pool.selector, count=count, priority=f.priority, sweep_id=owner,
            config_dirs=pool.config_dirs, heartbeat_s=f.heartbeat_s, stale_after_s=f.stale_after_s,
            reserve_timeout_s=f.reserve_timeout_s, on_wait=lambda msg: log.warning("farm: %s", msg)))
    except (FarmError, CoordinatorError) as exc:  # no coordinator, no free place in time: nothing ran
        raise UnitsError(f"the farm gave no unit of {pool.name}: {exc}") from None
    return Units([dict(d) for d in leased.devices], {d["name"]: p for p, d in zip(leased.places, leased.devices)},
                 leased)
