"""The device farm (issue 14): Jetsons as labgrid places, leased through a labgrid coordinator.

`coordinator.py` is the only module importing labgrid; the rest of jbench sees device config dicts:

    from jbench import farm
    with farm.lease("lab:20408", {"class": "orin-nano-8gb"}, count=2, sweep_id=sid) as leased:
        leased.devices
"""

from jbench.farm.coordinator import CoordinatorError
from jbench.farm.reservation import FarmBusy, FarmLease, lease, reap
from jbench.farm.places import FarmError

__all__ = ["CoordinatorError", "FarmBusy", "FarmError", "FarmLease", "lease", "reap"]
