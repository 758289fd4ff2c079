"""Power rails of a Jetson: the board's input power and the GPU/CPU share, one rule for every source.

tegrastats, the sysfs INA3221 reader and jtop all end up with the same thing, a reading per rail
name (`VDD_IN`, `VDD_CPU_GPU_CV`, ...); what the rails mean is decided here and nowhere else.
The functions only pick and add values, so they work in any unit (tegrastats' mW, the samplers' W).

Input power (`input_power`), first rule that applies:
1. The profile names rails (`power_rails`, non-empty): their sum. Every named rail must be present,
   else None (a partial sum would be silently low).
2. An input rail is present: `VDD_IN` (TX1, TX2, Xavier NX, Orin NX, Orin Nano), `POM_5V_IN` (Nano)
   or `VIN` (Thor, where it is printed). It is returned alone: the other rails are downstream of it
   and must not be added (jtop `total_power()`; jetson_stats issues #51 and #344).
3. No input rail (AGX Xavier, AGX Orin, Thor without `VIN`): the sum of the module's rails, since those
   boards monitor no single input and jtop defines the total as that sum (`SUMMED_RAIL_SETS`):
     - AGX Xavier: GPU + CPU + SOC + CV + VDDRQ + SYS5V
     - AGX Orin:   VDD_GPU_SOC + VDD_CPU_CV + VIN_SYS_5V0 (+ VDDQ_VDD2_1V8AO where present: JP5 and early
                   JP6 print it, R36.4.4 and R39.2 do not, so the total differs by that rail, ~0.3-0.8 W).
                   AGX Orin has no VDD_IN; its VIN_SYS_5V0 is one of the module's rails, not an input.
     - Thor:       VDD_GPU + VDD_CPU_SOC_MSS + VIN_SYS_5V0. Caveat: well below `VIN` (a public Thor line
                   with both shows 74820 mW summed against 87426 mW VIN), so prefer a source with `VIN`.
   All required rails of a set must be present. The label says "module rails sum (<module>)", never
   "board input": it is the module's own rails, not what the carrier draws.
4. Otherwise (no rails, or an unknown rail set): None, never 0.
`NC` placeholder channels (unconnected INA3221 inputs) and the INA3221 sum channel are never rails.
A profile list that picks exactly what the documented rule picks is reported as that rule.

GPU/CPU share (`component_rails`): the profile's `gpu_rail` / `cpu_rail`, else the module's usual
rail (`GPU_RAILS`, `CPU_RAILS`). A rail that feeds both CPU and GPU (`VDD_CPU_GPU_CV` on Xavier NX,
Orin NX and Orin Nano, or one rail the profile names for both) is reported once, as `cpu_gpu_cv`,
never as both GPU and CPU energy.

Sources: the rail names per module are those of the tegrastats samples and sysfs notes in
tests/data/jetson-formats (public captures; each names its repository), the Linux hwmon ina3221
documentation, and jetson-stats' `jtop/core/power.py`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple, Optional

from jbench.core.schema import ProfileConfig

__all__ = [
    "COMBINED_RAILS",
    "CPU_RAILS",
    "GPU_RAILS",
    "INPUT_RAILS",
    "SUMMED_RAIL_SETS",
    "INPUT_WHERE",
    "MODULE_NAMES",
    "InputPower",
    "component_power",
    "component_rails",
    "input_power",
    "power_fields",
]

# Rails that already measure the whole module/board input; the other rails are part of it.
INPUT_RAILS: tuple[str, ...] = ("VDD_IN", "POM_5V_IN", "VIN")

# Modules without an input rail: (required rails, optional rails). The total is the sum of all of
# these that are present (jtop's rule: the sum of every connected rail, `NC` excluded).
SUMMED_RAIL_SETS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "agx_xavier": (("GPU", "CPU", "SOC", "CV", "VDDRQ", "SYS5V"), ()),
    "agx_orin": (("VDD_GPU_SOC", "VDD_CPU_CV", "VIN_SYS_5V0"), ("VDDQ_VDD2_1V8AO",)),
    "thor": (("VDD_GPU", "VDD_CPU_SOC_MSS", "VIN_SYS_5V0"), ()),
}

# The GPU and the CPU rail of each module, when the profile names none (first present wins):
# Thor / TX1 / TX2 (L4T 28), Nano, TX2 (L4T 32), AGX Xavier, AGX Orin (GPU+SOC, CPU+CV), Thor (CPU+SOC+MSS).
GPU_RAILS: tuple[str, ...] = ("VDD_GPU", "POM_5V_GPU", "VDD_SYS_GPU", "GPU", "VDD_GPU_SOC")
CPU_RAILS: tuple[str, ...] = ("VDD_CPU", "POM_5V_CPU", "VDD_SYS_CPU", "CPU", "VDD_CPU_CV", "VDD_CPU_SOC_MSS")
# Rails that feed CPU, GPU and CV together (Xavier NX, Orin NX, Orin Nano): reported once, as cpu_gpu_cv.
COMBINED_RAILS: tuple[str, ...] = ("VDD_CPU_GPU_CV",)
COMBINED = "cpu_gpu_cv"

_PLACEHOLDER = "NC"


# How a summed total is named: a module total, never "board input" (these modules expose no input rail).
MODULE_NAMES: dict[str, str] = {"agx_xavier": "AGX Xavier", "agx_orin": "AGX Orin", "thor": "Thor, no VIN"}
# Where an input rail sits, for the label (Thor's VIN is the carrier's INA238, the others an INA3221 channel).
INPUT_WHERE: dict[str, str] = {"VIN": " (INA238)"}


class InputPower(NamedTuple):
    """Board input power, the rails it was taken from, and the rule that chose them."""

    value: Optional[float]  # None: not known from these rails
    rails: list[str]
    rule: str  # "profile" | "input" | "sum:<module>" (a SUMMED_RAIL_SETS key) | "none"

    @property
    def label(self) -> str:
        """The rule in words with its rails: `board input VDD_IN`, `board input VIN (INA238)`,
        `module rails sum (AGX Orin): VDD_GPU_SOC+VDD_CPU_CV+VIN_SYS_5V0`, `profile power_rails: A+B`, `none`."""
        joined = "+".join(self.rails)
        if self.rule == "input":
            return f"board input {joined}{INPUT_WHERE.get(joined, '')}"
        if self.rule.startswith("sum:"):
            module = self.rule[4:]
            return f"module rails sum ({MODULE_NAMES.get(module, module)}): {joined}"
        if self.rule == "profile":
            return f"profile power_rails: {joined}"
        return self.rule


def _present(rails: Mapping[str, Optional[float]]) -> dict[str, float]:
    """The rails that have a value (a None reading counts as absent); placeholders never count."""
    return {name: float(v) for name, v in rails.items() if v is not None and name != _PLACEHOLDER}


def input_power(rails: Mapping[str, Optional[float]], profile: Optional[ProfileConfig] = None) -> InputPower:
    """The board's input power from one reading of its rails (see the module doc for the rules).

    `rails`: {rail name: value} in any unit; `profile`: a module profile whose `power_rails`, when non-empty,
    names the rails to sum instead of the documented rule.
    """
    have = _present(rails)
    spec = [str(name) for name in profile.power_rails] if profile else []
    if spec:
        if any(name not in have for name in spec):
            return InputPower(None, spec, "profile")
        documented = _documented(have)
        if documented.rails == spec:  # the profile agrees with the rule: say which rule it is
            return documented
        return InputPower(float(sum(have[name] for name in spec)), spec, "profile")
    return _documented(have)


def _documented(have: Mapping[str, float]) -> InputPower:
    for name in INPUT_RAILS:
        if name in have:
            return InputPower(have[name], [name], "input")
    for module, (required, optional) in SUMMED_RAIL_SETS.items():
        if all(name in have for name in required):
            names = list(required) + [name for name in optional if name in have]
            return InputPower(float(sum(have[name] for name in names)), names, f"sum:{module}")
    return InputPower(None, [], "none")


def component_rails(names: Iterable[str], profile: Optional[ProfileConfig] = None) -> dict[str, str]:
    """{"gpu": rail, "cpu": rail} or {"cpu_gpu_cv": rail} (or a subset) for the rails present.

    The profile's `gpu_rail` / `cpu_rail` win where set (a named rail that is absent gives nothing);
    else the module's usual rail. A combined rail, or one rail named for both, is `cpu_gpu_cv` only.
    """
    present = {n for n in names if n != _PLACEHOLDER}
    named_gpu, named_cpu = (profile.gpu_rail, profile.cpu_rail) if profile else (None, None)

    def pick(named: Optional[str], table: Sequence[str]) -> Optional[str]:
        if named:
            return named if named in present else None
        return next((r for r in table if r in present), None)

    gpu, cpu = pick(named_gpu, GPU_RAILS), pick(named_cpu, CPU_RAILS)
    out: dict[str, str] = {}
    for role, rail in (("gpu", gpu), ("cpu", cpu)):
        if rail is None:
            continue
        if rail in COMBINED_RAILS or gpu == cpu:
            out[COMBINED] = rail
        else:
            out[role] = rail
    if not named_gpu and not named_cpu and COMBINED not in out:
        combined = next((r for r in COMBINED_RAILS if r in present), None)
        if combined is not None:
            out[COMBINED] = combined
    return out


def component_power(rails: Mapping[str, Optional[float]], profile: Optional[ProfileConfig] = None) -> dict[str, float]:
    """{"gpu": value, "cpu": value} or {"cpu_gpu_cv": value} (see `component_rails`), in the rails' unit."""
    have = _present(rails)
    return {role: have[rail] for role, rail in component_rails(have, profile).items()}


def power_fields(rails_w: Mapping[str, Optional[float]],
                 profile: Optional[ProfileConfig] = None) -> tuple[dict[str, Optional[float]], InputPower]:
    """A telemetry sample's power signals from rails in watts: `power_w` (board input, None when unknown)
    and `gpu_power_w` / `cpu_power_w` or `cpu_gpu_cv_power_w`; with the input-power rule applied."""
    total = input_power(rails_w, profile)
    out: dict[str, Optional[float]] = {"power_w": total.value}
    for role, value in component_power(rails_w, profile).items():
        out[f"{role}_power_w"] = value
    return out, total
