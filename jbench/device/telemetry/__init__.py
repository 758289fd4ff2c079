"""Device telemetry: samplers' output parsers (tegrastats today)."""

from jbench.device.telemetry.tegrastats import (
    CpuCore,
    Engine,
    Iram,
    Rail,
    TegrastatsSample,
    parse_line,
    parse_stream,
    sample_to_dict,
    total_input_power_mw,
)

__all__ = [
    "CpuCore",
    "Engine",
    "Iram",
    "Rail",
    "TegrastatsSample",
    "parse_line",
    "parse_stream",
    "sample_to_dict",
    "total_input_power_mw",
]
