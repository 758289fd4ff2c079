"""A labgrid place <-> a jbench device entry, and the tags jbench reads and writes on places.

A place names its jbench device entry (device/<entry>.yaml in jbench's conf or the user's config dirs) in the
tag `jbench_device`; without it the place's own name is the entry. Sweeps select places on the tags `module`,
`sku`, `l4t`, `carrier` and `class` (any other tag works too: labgrid matches every key=value given).
The `jbench_*` tags are jbench's bookkeeping, visible to every labgrid user (`labgrid-client places -v`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

from jbench.farm.coordinator import PlaceInfo

SELECT_TAGS = ("module", "sku", "l4t", "carrier", "class")
DEVICE = "jbench_device"
HEALTH = "jbench_health"  # ok | quarantined: every reservation jbench makes asks for ok
QUARANTINE = "jbench_quarantine"  # the reason a place is quarantined
FAILURES = "jbench_failures"  # consecutive trials that failed for device reasons
OWNER = "jbench_owner"  # host:pid:sweep of the jbench controller holding the place
HEARTBEAT = "jbench_heartbeat"  # epoch seconds of that controller's last heartbeat
HEALTHY = "ok"
QUARANTINED = "quarantined"

_TAG_KEY = re.compile(r"[a-z][a-z0-9_]+\Z")  # labgrid's rule for tag keys


class FarmError(Exception):
    """A farm request jbench cannot carry out (the message names the fix)."""


def parse_selector(items: Iterable[str]) -> dict[str, str]:
    """`key=value` words (from the command line or a config list) -> a tag filter."""
    selector: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not value.strip():
            raise FarmError(f"tag filter '{item}' is not key=value: write e.g. module=orin_nano or class=orin-nano-8gb")
        if not _TAG_KEY.match(key):
            raise FarmError(f"tag key '{key}' is not a labgrid tag key: lower-case letters, digits and _, "
                            f"starting with a letter (e.g. module, sku, l4t, carrier, class)")
        selector[key] = value.strip()
    return selector


def device_entry(place: PlaceInfo) -> str:
    return place.tags.get(DEVICE) or place.name


def is_quarantined(place: PlaceInfo) -> bool:
    return place.tags.get(HEALTH) == QUARANTINED


def is_enrolled(place: PlaceInfo) -> bool:
    """A place jbench may hand out: `jbench farm add` (or `unquarantine`) marked it healthy."""
    return place.tags.get(HEALTH) == HEALTHY


def state(place: PlaceInfo) -> str:
    if is_quarantined(place):
        return "quarantined"
    if place.acquired:
        return "held"
    if place.reservation:
        return "allocated"
    return "free" if is_enrolled(place) else "not enrolled"


def resolve_device(entry: str, config_dirs: Iterable[str | Path] = ()) -> dict:
    """The device config dict of a jbench device entry, composed as a sweep composes it."""
    from omegaconf import OmegaConf

    from jbench.config import ConfigError, compose, user_config_dirs

    try:
        cfg, _ = compose([f"device={entry}"], user_config_dirs([str(d) for d in config_dirs]))
    except ConfigError as exc:
        raise FarmError(f"place's device entry '{entry}': {exc}. Give the place a `{DEVICE}` tag naming a "
                        f"device entry (device/NAME.yaml in your config dir, --config-dir)") from None
    return OmegaConf.to_container(cfg.device, resolve=True)
