"""The serving scenario's backend-independent part: what requests a load level sends and when (workload), and
running one level against any send function (loadgen). No HTTP here: each backend's client sends."""

from jbench.backends.serving.loadgen import GivenUp, LevelRun, NotSent, OVERHEAD_KEYS, Sent, run_level
from jbench.backends.serving.workload import (LengthDist, RequestSpec, arrival_offsets, load_trace,
                                              synthetic_requests, with_arrivals)

__all__ = ["GivenUp", "LevelRun", "LengthDist", "NotSent", "OVERHEAD_KEYS", "RequestSpec", "Sent", "arrival_offsets",
           "load_trace", "run_level", "synthetic_requests", "with_arrivals"]
