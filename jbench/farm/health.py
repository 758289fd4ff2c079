"""The quick health check before a leased device is used, and quarantine.

Quick: reachable, the L4T tools present, sudo works without a prompt (the `devices check` items), and the
module and L4T release the device reports match the place's `module` / `l4t` tags. A failing device is
quarantined: tagged on its place (`jbench_health=quarantined`, `jbench_quarantine=<reason>`), so no jbench
reservation (they all ask for `jbench_health=ok`) is given it until `jbench farm unquarantine`.
"""

from __future__ import annotations

import re
from typing import Optional

from jbench.core.schema import DeviceConfig
from jbench.farm import places as P
from jbench.farm.coordinator import Coordinator, PlaceInfo
from jbench.device.connection import DeviceError
from jbench.device.doctor import check_device
from jbench.device.jetson import jetson_fingerprint


def _words(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


def quick_check(device: DeviceConfig, place: PlaceInfo) -> Optional[str]:
    """None when the device is fit for a lease, else the reason (one line)."""
    from jbench.device.connect import connect

    try:
        with connect(device) as conn:
            failed = [c for c in check_device(conn, device) if c.status == "fail"]
            if failed:
                return "; ".join(f"{c.item}: {c.detail}" for c in failed)[:300]
            if not device.profile:
                return None
            fp = jetson_fingerprint(conn, device.paths)
    except DeviceError as exc:
        return f"unreachable: {exc}"[:300]
    want_module = place.tags.get("module")
    have_module = fp.get("jetson.module", "")
    if want_module and _words(want_module) not in _words(have_module):
        return f"module: the place says {want_module}, the device reports '{have_module or 'no model'}'"
    want_l4t = place.tags.get("l4t")
    have_l4t = fp.get("jetson.l4t", "")
    if want_l4t and not (have_l4t == want_l4t or have_l4t.startswith(want_l4t + ".")):
        return f"l4t: the place says {want_l4t}, the device runs L4T {have_l4t or 'unknown'}"
    return None


def _clean(reason: str) -> str:
    return " ".join(reason.split())[:200] or "quarantined"


def quarantine(coord: Coordinator, place: str, reason: str) -> None:
    coord.set_tags(place, {P.HEALTH: P.QUARANTINED, P.QUARANTINE: _clean(reason)})


def unquarantine(coord: Coordinator, place: str) -> None:
    coord.set_tags(place, {P.HEALTH: P.HEALTHY, P.QUARANTINE: "", P.FAILURES: ""})


def record_trial(coord: Coordinator, place: str, *, device_failure: bool, quarantine_after: int) -> bool:
    """Count consecutive device failures on the place; True when this one quarantined it."""
    if not device_failure:
        coord.set_tags(place, {P.FAILURES: ""})
        return False
    count = int(coord.place(place).tags.get(P.FAILURES) or 0) + 1
    if quarantine_after > 0 and count >= quarantine_after:
        quarantine(coord, place, f"{count} trials in a row failed for device reasons")
        coord.set_tags(place, {P.FAILURES: str(count)})
        return True
    coord.set_tags(place, {P.FAILURES: str(count)})
    return False
