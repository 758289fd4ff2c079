"""The measurement protocol's version (as asv's benchmark version): recorded on every run (`jbench.protocol_version`)
and in the nightly's fingerprint, so a history never silently mixes figures measured in different ways.

Bump PROTOCOL_VERSION, and say why in PROTOCOL_CHANGES, whenever what a recorded figure means changes: the
measurement (jbench/runner/measure.py: idle window, speed pass, energy passes, cooldown), a backend's timing or
command line (what llama-bench is asked to run, how a phase's window is taken), or a metric's definition
(docs/metrics.md). A refactor that measures the same thing the same way keeps it.

STORE_FORMAT is the layout of what jbench writes to a store (run kinds, identity tags, hash version): a store
written by a newer jbench is refused with a message (`check_store_format`), never reinterpreted.
"""

from __future__ import annotations

from typing import Optional

PROTOCOL_VERSION = 4
PROTOCOL_CHANGES = {
    1: "the protocol as of jbench 0.2: llama-bench speed pass (-r repetitions after its own warm-up), energy passes "
       "for phases shorter than energy.min_window_s, idle and cooldown windows, device-clock phase windows",
    2: "{phase}_tps_ci95_low/high: the interval of the rate on the log scale (always > 0), no longer mean +- t sd/sqrt(n)",
    3: "settled speed: llama-bench runs backend.settle_repetitions more timed repetitions in the same context and "
       "the leading ones whose rate had not settled are set aside ({phase}_cold_repetitions, {phase}_cold_tps); "
       "{phase}_tps and the phase's energy window cover the settled repetitions only",
    4: "lean energy: a phase's energy comes from the speed pass when its window's edge-error bound is within "
       "energy.max_edge_error, else from an energy pass sized to the window that meets it (no fixed "
       "energy.min_window_s); a window over the bound gives no energy; the idle baseline and the cooldown end when "
       "power settles (telemetry.adaptive); NVML power and its energy counter read every telemetry.hwmon_interval_ms",
}

STORE_FORMAT = 1
STORE_FORMAT_TAG = "jbench.store_format"


def newer_store_problem(found: Optional[str], where: str) -> Optional[str]:
    """The message for a store (or run) written by a newer jbench, or None when this jbench can read it."""
    if found is None:
        return None
    try:
        version = int(found)
    except ValueError:
        return f"{where} has an unreadable {STORE_FORMAT_TAG} '{found}'"
    if version > STORE_FORMAT:
        return (f"{where} was written by a newer jbench (store format {version}, this jbench reads up to "
                f"{STORE_FORMAT}): upgrade jbench (`pip install -U jbench`, or pull the checkout and run "
                f"`make install`) to read or add to it")
    return None
