"""The one input-power rule (jbench/device/telemetry/rails.py) per module family: every tegrastats line of
the corpus (tests/data/jetson-formats/tegrastats-*.txt) and a sysfs layout per family
(tests/data/sysfs/layouts.yaml) through the hwmon reader give the documented total, labelled by what it is."""

from __future__ import annotations

from pathlib import Path

import pytest

from jbench.core.schema import ProfileConfig
from jbench.device.local import LocalConnection
from jbench.device.telemetry import parse_line
from jbench.device.telemetry.hwmon import SysfsSampler
from jbench.device.telemetry.rails import COMBINED, component_rails, input_power
from jbench.device.telemetry.samplers import tegrastats_sample
from tests.sysfs_layouts import build, layouts

CORPUS = Path(__file__).resolve().parent / "data" / "jetson-formats"

# Per corpus file: the labels its rail-printing lines may get. TX1/TX2 lines without rails give "none".
FAMILY_RULES = {
    "tegrastats-nano.txt": {"board input POM_5V_IN"},
    "tegrastats-orin-nano.txt": {"board input VDD_IN"},
    "tegrastats-orin-nx.txt": {"board input VDD_IN"},
    "tegrastats-xavier-nx.txt": {"board input VDD_IN"},
    "tegrastats-tx1.txt": {"board input VDD_IN", "none"},
    "tegrastats-tx2.txt": {"board input VDD_IN", "none"},
    "tegrastats-agx-xavier.txt": {"module rails sum (AGX Xavier): GPU+CPU+SOC+CV+VDDRQ+SYS5V"},
    "tegrastats-agx-orin.txt": {"module rails sum (AGX Orin): VDD_GPU_SOC+VDD_CPU_CV+VIN_SYS_5V0",
                                "module rails sum (AGX Orin): VDD_GPU_SOC+VDD_CPU_CV+VIN_SYS_5V0+VDDQ_VDD2_1V8AO"},
    "tegrastats-thor.txt": {"board input VIN (INA238)",
                            "module rails sum (Thor, no VIN): VDD_GPU+VDD_CPU_SOC_MSS+VIN_SYS_5V0"},
}


def _corpus_lines(name: str) -> list[str]:
    lines = [ln.rstrip("\n") for ln in (CORPUS / name).read_text().splitlines()]
    return [ln for ln in lines if ln.strip() and not ln.startswith("#")]


@pytest.mark.parametrize("name", sorted(FAMILY_RULES))
def test_every_corpus_line_gets_its_familys_rule(name):
    seen = set()
    for line in _corpus_lines(name):
        sample = parse_line(line)
        if sample is None:
            continue
        rails = {n: r.current_mw for n, r in sample.rails.items()}
        total = input_power(rails)
        assert total.label in FAMILY_RULES[name], line
        seen.add(total.label)
        if total.value is not None:
            assert total.value == pytest.approx(sum(rails[r] for r in total.rails))
            # AGX Orin's VIN_SYS_5V0 is one of the module's rails: never called an input.
            assert not (total.rule == "input" and total.rails == ["VIN_SYS_5V0"])
        roles = component_rails(rails)
        # A combined rail is reported once, as cpu_gpu_cv, never as GPU and CPU energy at the same time.
        assert roles.get("gpu") is None or roles.get("gpu") != roles.get("cpu")
        if "VDD_CPU_GPU_CV" in rails:
            assert roles == {COMBINED: "VDD_CPU_GPU_CV"}
    assert seen - {"none"}, f"{name}: no line with rails"


@pytest.mark.parametrize("profile", [ProfileConfig(gpu_rail="VDD_CPU_GPU_CV", cpu_rail="VDD_CPU_GPU_CV"),
                                     ProfileConfig(gpu_rail="VDD_SOC", cpu_rail="VDD_SOC"), None])
def test_a_rail_named_for_both_roles_is_counted_once(profile):
    line = _corpus_lines("tegrastats-orin-nano.txt")[0]
    s = tegrastats_sample(1.0, line, profile)
    assert "gpu_power_w" not in s and "cpu_power_w" not in s and s["cpu_gpu_cv_power_w"] > 0


def test_tegrastats_power_is_the_current_reading_never_the_average():
    # Xavier NX JetPack 5.1.2 (tegrastats-xavier-nx.txt): VDD_IN 2763mW/2846mW = current/average.
    line = next(ln for ln in _corpus_lines("tegrastats-xavier-nx.txt") if "VDD_IN 2763mW/2846mW" in ln)
    s = tegrastats_sample(1.0, line)
    assert s["power_w"] == pytest.approx(2.763) and s["rail_VDD_IN_w"] == pytest.approx(2.763)


@pytest.mark.parametrize("name", sorted(layouts()))
def test_sysfs_layout_per_family(tmp_path, name):
    expect = build(tmp_path, name)["expect"]
    sampler = SysfsSampler(LocalConnection(), 10, sysfs_root=str(tmp_path)).start()
    try:
        assert sampler.wait_for_samples(3, timeout_s=30), sampler.problem
    finally:
        samples = sampler.stop()
    s = samples[-1]
    power = {k: v for k, v in s.items() if k.endswith("power_w")}
    assert power == {k: pytest.approx(v) for k, v in expect.items() if k.endswith("power_w")}
    assert not any("NC" in k or "sum of" in k for k in s)  # placeholders and the sum channel are never rails
    tags = sampler.telemetry_tags()
    assert tags["telemetry.power_rule"] == expect["rule"] and tags["telemetry.power_rails"] == expect["rails"]
    assert sampler.power_field == expect["rule"]
