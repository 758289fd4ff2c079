"""One rule for board input power and the GPU/CPU share (jbench/device/telemetry/rails.py), the same
through tegrastats, the sysfs INA3221 reader and jtop, per module family.

Tegrastats lines below are pasted verbatim from the corpus (tests/data/jetson-formats/tegrastats-*.txt);
each comment names the corpus file and the public source the line was copied from there. Sysfs trees are
built in tmp_path with the kernel's INA3221 file names (Linux Documentation/hwmon/ina3221.rst for hwmon,
jetson-stats' jtop/core/power.py for the JetPack <= 4 iio names) and the rail labels those modules print;
their voltages and currents are made up.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import yaml

from jbench.analysis.telemetry import EnergySettings, PhaseWindow, energy_metrics
from jbench.core.schema import ProfileConfig, typed
from jbench.device.local import LocalConnection
from jbench.device.telemetry import parse_line, total_input_power_mw
from jbench.device.telemetry.rails import (
    InputPower,
    component_power,
    component_rails,
    input_power,
    power_fields,
)
from jbench.device.telemetry.samplers import JtopSampler, SysfsSampler, split_stamp, tegrastats_sample

PROFILES = Path(__file__).resolve().parents[1] / "conf" / "profile"

# tegrastats-nano.txt; github.com/waggle-sensor/jetson-exporter @ f42578a7482ea2242eaa06e331f71692d8add1c8
# tegrastats_test.go (TestParseTegraStatsXavierNanoJetPack461); Jetson Nano 4GB, JetPack 4.6.1, root
NANO = ("RAM 1923/3964MB (lfb 2x2MB) SWAP 191/1982MB (cached 6MB) IRAM 0/252kB(lfb 252kB) CPU [5%@1224,4%@1224,"
        "3%@1224,6%@1224] EMC_FREQ 0%@1600 GR3D_FREQ 0%@76 APE 25 PLL@37C CPU@40C PMIC@50C GPU@40C AO@45C "
        "thermal@40C POM_5V_IN 1750/1628 POM_5V_GPU 0/0 POM_5V_CPU 366/406")
# tegrastats-orin-nano.txt; github.com/henrygd/beszel @ f1e5797c76a234b1c59a31c815f07edfbee0b0e9 agent/gpu_test.go
# (test 'more valid data'); Orin Nano 8GB, JetPack 6.x, root
ORIN_NANO = ("11-15-2024 08:38:09 RAM 6185/7620MB (lfb 8x2MB) SWAP 851/3810MB (cached 1MB) CPU [15%@729,11%@729,"
             "14%@729,13%@729,11%@729,8%@729] EMC_FREQ 43%@2133 GR3D_FREQ 63%@[621] NVDEC off NVJPG off NVJPG1 off "
             "VIC off OFA off APE 200 cpu@53.968C soc2@52.437C soc0@50.75C gpu@53.343C tj@53.968C soc1@51.656C "
             "VDD_IN 12479mW/12479mW VDD_CPU_GPU_CV 4667mW/4667mW VDD_SOC 2817mW/2817mW")
# tegrastats-xavier-nx.txt; github.com/waggle-sensor/jetson-exporter @ f42578a7482ea2242eaa06e331f71692d8add1c8
# tegrastats_test.go (TestParseTegraStatsXavierNXJetPack512); Xavier NX, JetPack 5.1.2
XAVIER_NX = ("07-09-2024 13:31:31 RAM 3168/6851MB (lfb 2x4MB) SWAP 161/3426MB (cached 0MB) CPU [23%@1397,17%@1192,"
             "16%@1190,13%@1190,23%@1190,10%@1190] EMC_FREQ 2%@204 GR3D_FREQ 0%@[114] VIC_FREQ 115 APE 150 AUX@45C "
             "CPU@46.5C thermal@45.6C AO@45C GPU@45.5C PMIC@50C VDD_IN 2763mW/2846mW VDD_CPU_GPU_CV 650mW/670mW "
             "VDD_SOC 650mW/711mW")
# tegrastats-orin-nx.txt; github.com/DataDog/datadog-agent @ a50b634caee0389882c39a7f2e8bc52991bebcbe
# pkg/collector/corechecks/nvidia/jetson/jetson_test.go (const voltageUnitSample); Orin NX 16GB, JetPack 5.x
ORIN_NX = ("RAM 6334/15388MB (lfb 1770x4MB) SWAP 491/7694MB (cached 0MB) CPU [6%@729,9%@729,5%@729,16%@729,off,off,"
           "off,off] EMC_FREQ 0%@2133 GR3D_FREQ 0%@611 VIC_FREQ 729 APE 174 CV0@45.812C CPU@47.937C SOC2@46.093C "
           "SOC0@46.968C CV1@46.406C GPU@45.875C tj@48.875C SOC1@48.875C CV2@45.75C VDD_IN 5299mW/5299mW "
           "VDD_CPU_GPU_CV 773mW/773mW VDD_SOC 1424mW/1424mW")
# tegrastats-agx-orin.txt; github.com/catid/blog2022 @ 17a40e62302b34ce1fe2019a8b1fdcc0a1aef48c
# content/posts/orin_opt.md; AGX Orin 64GB, early JetPack 5 (NC placeholder rails, VDDQ_VDD2_1V8AO printed)
AGX_ORIN_JP5 = ("04-24-2023 00:01:24 RAM 1282/62795MB (lfb 15152x4MB) SWAP 0/31398MB (cached 0MB) CPU [0%@729,0%@729,"
                "0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729] EMC_FREQ 0%@2133 "
                "GR3D_FREQ 0%@0 GR3D2_FREQ 0%@0 VIC_FREQ 729 APE 174 CV0@-256C CPU@42.593C Tboard@32C SOC2@39.343C "
                "Tdiode@33.25C SOC0@39.375C CV1@-256C GPU@-256C tj@42.593C SOC1@40.468C CV2@-256C "
                "VDD_GPU_SOC 2399mW/2399mW VDD_CPU_CV 400mW/400mW VIN_SYS_5V0 4032mW/4032mW NC 0mW/0mW "
                "VDDQ_VDD2_1V8AO 301mW/301mW NC 0mW/0mW")
# tegrastats-agx-orin.txt; github.com/lesomnus/tegra-exporter @ a1384f4af528592cbde218dc1f39dff13c154a45
# stats/parse_test.go (t.Run("6.8.12-1021-tegra")); AGX Orin 64GB, JetPack 7.2 (R39.2): no VDDQ_VDD2_1V8AO
AGX_ORIN_R39 = ("07-31-2026 14:58:05 RAM 4714/62878MB (lfb 7x4MB) SWAP 0/2048MB (cached 0MB) CPU [78%@1728,33%@1728,"
                "46%@1728,55%@1728,49%@729,48%@729,37%@729,57%@729,off,off,off,off] EMC_FREQ 2%@2133 "
                "GR3D_FREQ 0%@[0,0] NVENC0 off NVDEC0 off NVJPG0 off NVJPG1 off VIC off OFA off NVDLA0 off NVDLA1 off "
                "PVA0_FREQ off APE 174 cpu@50.718C/50.718C soc2@47.656C/47.656C soc0@47.156C/47.156C "
                "tj@50.718C/50.718C soc1@49C/49C VDD_GPU_SOC 2265mW/2265mW/2265mW VDD_CPU_CV 2643mW/2643mW/2643mW "
                "VIN_SYS_5V0 4722mW/4722mW/4722mW")
# tegrastats-agx-xavier.txt; https://github.com/martinkersner/gtop/pull/7 (comment, 2019-06-17); AGX Xavier 16GB,
# JetPack 4.2, without sudo
AGX_XAVIER = ("RAM 14700/15692MB (lfb 3x2MB) SWAP 898/8192MB (cached 23MB) CPU [0%@1190,0%@1190,0%@1190,0%@1190,"
              "0%@1190,0%@1190,0%@1190,0%@1190] EMC_FREQ 0% GR3D_FREQ 0% AO@30C GPU@30.5C Tboard@31C Tdiode@32C "
              "AUX@30.5C CPU@31.5C thermal@30.8C PMIC@100C GPU 463/463 CPU 618/618 SOC 2936/2936 CV 0/0 "
              "VDDRQ 309/309 SYS5V 3306/3306")
# tegrastats-thor.txt; github.com/lesomnus/tegra-exporter @ a1384f4af528592cbde218dc1f39dff13c154a45
# stats/parse_test.go (t.Run("6.8.12-1021-tegra")); AGX Thor, JetPack 7.2, root: no VIN printed
THOR_ROOT = ("07-23-2026 15:29:26 RAM 9101/125811MB (lfb 19x4MB) SWAP 0/2048MB (cached 0MB) CPU [39%@2160,20%@2160,"
             "16%@1944,15%@1944,17%@972,15%@972,19%@2214,22%@2214,13%@2430,20%@2430,26%@972,19%@972,15%@1836,"
             "22%@1836] EMC_FREQ 7%@3200 GR3D_FREQ @[314,314,314] NVENC0_FREQ @1556 NVENC1_FREQ @1556 "
             "NVDEC0_FREQ @1556 NVDEC1_FREQ @1556 NVJPG0_FREQ @1556 VIC 59%@423 OFA_FREQ @1556 PVA0_FREQ off APE 300 "
             "cpu@34.843C/34.843C tj@35.906C/35.906C soc012@34.437C/34.437C gpu@35.906C/35.906C "
             "soc345@34.406C/34.406C VDD_GPU 4925mW/4925mW/4925mW VDD_CPU_SOC_MSS 8710mW/8710mW/8710mW "
             "VIN_SYS_5V0 6767mW/6767mW/6767mW")
# tegrastats-thor.txt; github.com/wendylabsinc/wendy-agent @ d4beff84c1a311299057beb7efc204bdad82d3be
# go/internal/agent/hoststats/gpu_test.go (TestParseTegrastatsJetPack7Thor); AGX Thor, JetPack 7.2, with VIN
THOR_VIN = ("07-02-2026 13:45:44 RAM 36529/125749MB (lfb 12x4MB) SWAP 11/4096MB (cached 9MB) CPU [2%@972,1%@972,"
            "0%@972,0%@972,0%@972,0%@972,0%@972,0%@972,0%@972,0%@972,0%@972,0%@972,0%@972,2%@972] cpu@60.406C "
            "tj@63.281C soc012@58.468C gpu@62.906C soc345@63.281C VDD_GPU 37528mW/37528mW/37528mW "
            "VDD_CPU_SOC_MSS 18961mW/18961mW/18961mW VIN_SYS_5V0 18331mW/18331mW/18331mW VIN 87426mW/43713mW/87426mW")
# tegrastats-tx2.txt; github.com/DataDog/datadog-agent @ a50b634caee0389882c39a7f2e8bc52991bebcbe
# pkg/collector/corechecks/nvidia/jetson/jetson_test.go (const tx2Sample); TX2 8GB, root
TX2 = ("RAM 2344/7852MB (lfb 1154x4MB) SWAP 0/3926MB (cached 0MB) CPU [1%@345,off,off,1%@345,0%@345,2%@345] "
       "EMC_FREQ 4%@1600 GR3D_FREQ 0%@624 APE 150 PLL@37.5C MCPU@37.5C PMIC@100C Tboard@32C GPU@35C BCPU@37.5C "
       "thermal@36.5C Tdiode@34.25C VDD_SYS_GPU 152/152 VDD_SYS_SOC 687/687 VDD_4V0_WIFI 0/0 VDD_IN 3056/3056 "
       "VDD_SYS_CPU 152/152 VDD_SYS_DDR 883/883")
# tegrastats-tx1.txt; github.com/DataDog/datadog-agent @ a50b634caee0389882c39a7f2e8bc52991bebcbe
# pkg/collector/corechecks/nvidia/jetson/jetson_test.go (const tx1Sample); TX1, L4T 28/32
TX1 = ("RAM 1179/3983MB (lfb 120x4MB) IRAM 0/252kB(lfb 252kB) CPU [1%@102,4%@102,0%@102,0%@102] EMC_FREQ 7%@408 "
       "GR3D_FREQ 0%@76 APE 25 AO@42.5C CPU@37.5C GPU@39C PLL@37C Tdiode@42.75C PMIC@100C Tboard@42C thermal@38.5C "
       "VDD_IN 2532/2698 VDD_CPU 76/178 VDD_GPU 19/19")

# (line, input power mW, rule label, GPU/CPU share in mW) by the documented rule, no profile.
FAMILIES = {
    "nano": (NANO, 1750, "board input POM_5V_IN", {"gpu": 0, "cpu": 366}),
    "orin_nano": (ORIN_NANO, 12479, "board input VDD_IN", {"cpu_gpu_cv": 4667}),
    "xavier_nx": (XAVIER_NX, 2763, "board input VDD_IN", {"cpu_gpu_cv": 650}),
    "orin_nx": (ORIN_NX, 5299, "board input VDD_IN", {"cpu_gpu_cv": 773}),
    "agx_orin_jp5": (AGX_ORIN_JP5, 2399 + 400 + 4032 + 301,
                     "module rails sum (AGX Orin): VDD_GPU_SOC+VDD_CPU_CV+VIN_SYS_5V0+VDDQ_VDD2_1V8AO", {"gpu": 2399, "cpu": 400}),
    "agx_orin_r39": (AGX_ORIN_R39, 2265 + 2643 + 4722, "module rails sum (AGX Orin): VDD_GPU_SOC+VDD_CPU_CV+VIN_SYS_5V0",
                     {"gpu": 2265, "cpu": 2643}),
    "agx_xavier": (AGX_XAVIER, 463 + 618 + 2936 + 0 + 309 + 3306, "module rails sum (AGX Xavier): GPU+CPU+SOC+CV+VDDRQ+SYS5V",
                   {"gpu": 463, "cpu": 618}),
    "thor_root": (THOR_ROOT, 4925 + 8710 + 6767, "module rails sum (Thor, no VIN): VDD_GPU+VDD_CPU_SOC_MSS+VIN_SYS_5V0",
                  {"gpu": 4925, "cpu": 8710}),
    "thor_vin": (THOR_VIN, 87426, "board input VIN (INA238)", {"gpu": 37528, "cpu": 18961}),
    "tx2": (TX2, 3056, "board input VDD_IN", {"gpu": 152, "cpu": 152}),
    "tx1": (TX1, 2532, "board input VDD_IN", {"gpu": 19, "cpu": 76}),
}


def _rails_mw(line: str) -> dict[str, float]:
    sample = parse_line(line)
    assert sample is not None
    return {name: rail.current_mw for name, rail in sample.rails.items()}


def _profile(name: str) -> ProfileConfig:
    data = yaml.safe_load((PROFILES / f"{name}.yaml").read_text())
    data.pop("defaults", None)
    return typed(ProfileConfig, data)


# --- the rule, per module family ----------------------------------------------------------------

@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_input_power_and_share_per_module_family(family):
    line, total_mw, label, share = FAMILIES[family]
    rails = _rails_mw(line)
    got = input_power(rails)
    assert got.value == total_mw and got.label == label
    assert component_power(rails) == share
    # The parser's total is the same rule.
    assert total_input_power_mw(parse_line(line)) == total_mw


def test_the_combined_rail_is_never_both_gpu_and_cpu():
    rails = _rails_mw(ORIN_NANO)
    # The shipped Orin Nano profile names VDD_CPU_GPU_CV as its GPU rail and as its CPU rail.
    prof = _profile("orin_nano_super")
    assert prof.gpu_rail == prof.cpu_rail == "VDD_CPU_GPU_CV"
    assert component_rails(rails, prof) == {"cpu_gpu_cv": "VDD_CPU_GPU_CV"}
    # Named for one role only, it still is the combined rail, not GPU energy.
    assert component_rails(rails, ProfileConfig(gpu_rail="VDD_CPU_GPU_CV")) == {"cpu_gpu_cv": "VDD_CPU_GPU_CV"}
    # Any rail a profile names for both roles is reported once.
    assert component_rails(_rails_mw(TX2), ProfileConfig(gpu_rail="VDD_IN", cpu_rail="VDD_IN")) == {"cpu_gpu_cv": "VDD_IN"}
    # A profile's rail that is absent gives nothing (no fallback to another rail).
    assert component_rails(_rails_mw(NANO), ProfileConfig(gpu_rail="VDD_GPU", cpu_rail="POM_5V_CPU")) == {"cpu": "POM_5V_CPU"}
    fields, _ = power_fields({k: v / 1000 for k, v in rails.items()}, prof)
    assert fields == {"power_w": pytest.approx(12.479), "cpu_gpu_cv_power_w": pytest.approx(4.667)}


@pytest.mark.parametrize("profile, line, expected_mw, rule", [
    ("nano", NANO, 1750, "board input POM_5V_IN"),
    ("orin_nano_8gb", ORIN_NANO, 12479, "board input VDD_IN"),
    ("orin_nx_16gb", ORIN_NX, 5299, "board input VDD_IN"),
    ("xavier_nx", XAVIER_NX, 2763, "board input VDD_IN"),
    ("agx_orin_64gb", AGX_ORIN_JP5, 2399 + 400 + 4032 + 301, "module rails sum (AGX Orin): VDD_GPU_SOC+VDD_CPU_CV+VIN_SYS_5V0+VDDQ_VDD2_1V8AO"),
    ("agx_orin_32gb", AGX_ORIN_R39, 2265 + 2643 + 4722, "module rails sum (AGX Orin): VDD_GPU_SOC+VDD_CPU_CV+VIN_SYS_5V0"),
    ("agx_xavier", AGX_XAVIER, 463 + 618 + 2936 + 0 + 309 + 3306, "module rails sum (AGX Xavier): GPU+CPU+SOC+CV+VDDRQ+SYS5V"),
    ("thor", THOR_VIN, 87426, "board input VIN (INA238)"),
    # The Thor profile asks for VIN; a root R39.2 line does not print it: unknown, not the low rail sum.
    ("thor", THOR_ROOT, None, "profile power_rails: VIN"),
])
def test_shipped_profiles(profile, line, expected_mw, rule):
    got = input_power(_rails_mw(line), _profile(profile))
    assert got.value == expected_mw and got.label == rule


def test_profile_rail_lists_and_what_never_counts():
    rails = _rails_mw(ORIN_NANO)
    assert input_power(rails, ProfileConfig(power_rails=["VDD_CPU_GPU_CV", "VDD_SOC"])) == InputPower(
        4667 + 2817, ["VDD_CPU_GPU_CV", "VDD_SOC"], "profile")
    assert input_power(rails, ProfileConfig(power_rails=["VDD_IN", "NOT_A_RAIL"])).value is None  # a partial sum would be low
    assert input_power(rails, ProfileConfig(power_rails=[])).label == "board input VDD_IN"  # [] = the documented rule
    assert input_power(_rails_mw(AGX_ORIN_JP5), ProfileConfig(power_rails=["NC"])).value is None  # placeholders are never rails
    assert input_power({"NC": 0.0, "VDD_GPU_SOC": 1.0}) == InputPower(None, [], "none")
    assert input_power({}) == InputPower(None, [], "none")
    # An AGX Orin reading that lost one of its required rails is unknown, never a partial sum.
    partial = {k: v for k, v in _rails_mw(AGX_ORIN_R39).items() if k != "VIN_SYS_5V0"}
    assert input_power(partial).value is None
    # jtop can report a rail without a value: it counts as absent.
    assert input_power({"VDD_IN": None, "POM_5V_IN": 3.0}).label == "board input POM_5V_IN"


def test_tegrastats_sample_fields():
    s = tegrastats_sample(1.0, ORIN_NANO, ProfileConfig(power_rails=["VDD_IN"], gpu_rail="VDD_CPU_GPU_CV",
                                                        cpu_rail="VDD_CPU_GPU_CV"))
    assert s["power_w"] == pytest.approx(12.479) and s["cpu_gpu_cv_power_w"] == pytest.approx(4.667)
    assert "gpu_power_w" not in s and "cpu_power_w" not in s
    n = tegrastats_sample(1.0, NANO)
    assert n["power_w"] == pytest.approx(1.75) and n["gpu_power_w"] == 0 and n["cpu_power_w"] == pytest.approx(0.366)
    t = tegrastats_sample(1.0, AGX_ORIN_R39)
    assert t["power_w"] == pytest.approx(9.63) and t["gpu_power_w"] == pytest.approx(2.265)


def test_combined_rail_energy_is_its_own_metric():
    samples = [{"t": 100.0 + 0.1 * i, "power_w": 10.0, "cpu_gpu_cv_power_w": 4.0} for i in range(60)]
    m, _ = energy_metrics(samples, [PhaseWindow("decode", 100.0, 105.0, tokens=50)], EnergySettings())
    assert m["decode_cpu_gpu_cv_energy_j"] == pytest.approx(20.0)
    assert "decode_gpu_energy_j" not in m and "decode_cpu_energy_j" not in m


# --- the sysfs INA3221 reader ------------------------------------------------------------------

def _hwmon(root: Path, chip: str, hwmon: str, channels: list[tuple[str, int, int]], *, sum_channel: bool = False):
    """JetPack >= 5: /sys/bus/i2c/drivers/ina3221/<chip>/hwmon/hwmonN/in<k>_label, in<k>_input (mV), curr<k>_input (mA)."""
    d = root / "bus/i2c/drivers/ina3221" / chip / "hwmon" / hwmon
    d.mkdir(parents=True)
    for k, (label, mv, ma) in enumerate(channels, 1):
        (d / f"in{k}_label").write_text(label + "\n")
        (d / f"in{k}_input").write_text(f"{mv}\n")
        (d / f"curr{k}_input").write_text(f"{ma}\n")
        (d / f"in{k + 3}_input").write_text("40\n")  # shunt voltage (uV): no label, never a rail
    if sum_channel:
        (d / "in7_label").write_text("sum of shunt voltages\n")
        (d / "in7_input").write_text("120\n")


def _iio(root: Path, chip: str, channels: list[tuple[str, int, int]], *, power_file: bool = True):
    """JetPack <= 4: /sys/bus/i2c/drivers/ina3221x/<chip>/iio:device0/rail_name_<k>, in_power<k>_input (mW),
    in_voltage<k>_input (mV), in_current<k>_input (mA)."""
    d = root / "bus/i2c/drivers/ina3221x" / chip / "iio:device0"
    d.mkdir(parents=True)
    for k, (name, mv, ma) in enumerate(channels):
        (d / f"rail_name_{k}").write_text(name + "\n")
        (d / f"in_voltage{k}_input").write_text(f"{mv}\n")
        (d / f"in_current{k}_input").write_text(f"{ma}\n")
        if power_file:
            (d / f"in_power{k}_input").write_text(f"{mv * ma // 1000}\n")


def _sysfs_samples(root: Path, profile: ProfileConfig | None = None) -> tuple[dict, SysfsSampler]:
    sampler = SysfsSampler(LocalConnection(), 20, profile=profile, sysfs_root=str(root)).start()
    assert sampler.wait_for_samples(2, timeout_s=20), sampler.problem
    samples = sampler.stop()
    return samples[0], sampler


def _power_keys(sample: dict) -> dict:
    return {k: v for k, v in sample.items() if k.endswith("_power_w") or k == "power_w"}


def test_sysfs_nano_iio(tmp_path):
    _iio(tmp_path, "6-0040", [("POM_5V_IN", 5000, 700), ("POM_5V_GPU", 5000, 100), ("POM_5V_CPU", 5000, 200)])
    s, sampler = _sysfs_samples(tmp_path, _profile("nano"))
    assert _power_keys(s) == {"power_w": pytest.approx(3.5), "gpu_power_w": pytest.approx(0.5),
                              "cpu_power_w": pytest.approx(1.0)}
    assert sampler.power_field == "board input POM_5V_IN"


def test_sysfs_iio_without_power_files_multiplies_volts_and_amps(tmp_path):
    _iio(tmp_path, "6-0040", [("POM_5V_IN", 5080, 345), ("POM_5V_GPU", 5080, 0), ("POM_5V_CPU", 5080, 72)],
         power_file=False)
    s, sampler = _sysfs_samples(tmp_path)
    assert s["power_w"] == pytest.approx(5080 * 345 / 1e6) and sampler.power_field == "board input POM_5V_IN"


@pytest.mark.parametrize("profile", ["xavier_nx", "orin_nano_super", "orin_nx_16gb", None])
def test_sysfs_vdd_in_modules_hwmon(tmp_path, profile):
    _hwmon(tmp_path, "1-0040", "hwmon3", [("VDD_IN", 5000, 2400), ("VDD_CPU_GPU_CV", 5000, 600),
                                          ("VDD_SOC", 5000, 300)], sum_channel=True)
    s, sampler = _sysfs_samples(tmp_path, _profile(profile) if profile else None)
    assert _power_keys(s) == {"power_w": pytest.approx(12.0), "cpu_gpu_cv_power_w": pytest.approx(3.0)}
    assert "rail_sum of shunt voltages_w" not in s and set(k for k in s if k.startswith("rail_")) == {
        "rail_VDD_IN_w", "rail_VDD_CPU_GPU_CV_w", "rail_VDD_SOC_w"}
    assert sampler.power_field == ("board input VDD_IN" if profile else "board input VDD_IN")


@pytest.mark.parametrize("profile", ["agx_orin_64gb", None])
def test_sysfs_agx_orin_sums_its_rails(tmp_path, profile):
    # Two INA3221 chips; the second has NC (unconnected) channels around VDDQ_VDD2_1V8AO.
    _hwmon(tmp_path, "1-0040", "hwmon1", [("VDD_GPU_SOC", 19000, 200), ("VDD_CPU_CV", 19000, 100),
                                          ("VIN_SYS_5V0", 5000, 800)])
    _hwmon(tmp_path, "1-0041", "hwmon2", [("NC", 0, 0), ("VDDQ_VDD2_1V8AO", 5000, 60), ("NC", 0, 0)])
    s, sampler = _sysfs_samples(tmp_path, _profile(profile) if profile else None)
    assert _power_keys(s) == {"power_w": pytest.approx(3.8 + 1.9 + 4.0 + 0.3), "gpu_power_w": pytest.approx(3.8),
                              "cpu_power_w": pytest.approx(1.9)}
    assert sampler.power_field == "module rails sum (AGX Orin): VDD_GPU_SOC+VDD_CPU_CV+VIN_SYS_5V0+VDDQ_VDD2_1V8AO"
    assert "rail_NC_w" not in s


@pytest.mark.parametrize("profile", ["agx_xavier", None])
def test_sysfs_agx_xavier_iio_sums_its_rails(tmp_path, profile):
    _iio(tmp_path, "1-0040", [("GPU", 19000, 100), ("CPU", 19000, 50), ("SOC", 19000, 150)])
    _iio(tmp_path, "1-0041", [("CV", 19000, 0), ("VDDRQ", 19000, 20), ("SYS5V", 5000, 600)])
    s, sampler = _sysfs_samples(tmp_path, _profile(profile) if profile else None)
    assert s["power_w"] == pytest.approx(1.9 + 0.95 + 2.85 + 0 + 0.38 + 3.0)
    assert s["gpu_power_w"] == pytest.approx(1.9) and s["cpu_power_w"] == pytest.approx(0.95)
    assert sampler.power_field == "module rails sum (AGX Xavier): GPU+CPU+SOC+CV+VDDRQ+SYS5V"


def test_sysfs_thor_vin_or_the_rail_sum(tmp_path):
    # Thor: the module rails on an INA3221, VIN on the carrier's INA238 (power1_input in uW, no label).
    rails = [("VDD_GPU", 19000, 500), ("VDD_CPU_SOC_MSS", 19000, 400), ("VIN_SYS_5V0", 5000, 1000)]
    _hwmon(tmp_path / "vin", "2-0040", "hwmon1", rails)
    ina238 = tmp_path / "vin/bus/i2c/drivers/ina238/2-0044/hwmon/hwmon5"
    ina238.mkdir(parents=True)
    (ina238 / "power1_input").write_text("24000000\n")
    s, sampler = _sysfs_samples(tmp_path / "vin", _profile("thor"))
    assert _power_keys(s) == {"power_w": pytest.approx(24.0), "gpu_power_w": pytest.approx(9.5),
                              "cpu_power_w": pytest.approx(7.6)}
    assert sampler.power_field == "board input VIN (INA238)"
    _hwmon(tmp_path / "novin", "2-0040", "hwmon1", rails)
    s, sampler = _sysfs_samples(tmp_path / "novin")
    assert s["power_w"] == pytest.approx(9.5 + 7.6 + 5.0) and sampler.power_field == "module rails sum (Thor, no VIN): VDD_GPU+VDD_CPU_SOC_MSS+VIN_SYS_5V0"


# --- jtop ----------------------------------------------------------------------------------------

FAKE_JTOP = textwrap.dedent('''
    import json, os, time
    class jtop:
        def __init__(self, interval=0.5):
            self.n = 0
            self.power = json.loads(os.environ["FAKE_JTOP_POWER"])
            self.stats = {"GPU": 12.0, "Temp cpu": 50.5}
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            return False
        def ok(self):
            self.n += 1
            time.sleep(0.01)
            return self.n <= 3
''')


def _jtop_samples(tmp_path, monkeypatch, power: dict, profile: ProfileConfig | None = None) -> tuple[list[dict], JtopSampler]:
    (tmp_path / "jtop").mkdir(exist_ok=True)
    (tmp_path / "jtop" / "__init__.py").write_text(FAKE_JTOP)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("FAKE_JTOP_POWER", json.dumps(power))
    sampler = JtopSampler(LocalConnection(), 10)
    sampler.rail_profile = profile
    sampler.start()
    sampler._thread.join(timeout=30)
    assert sampler.problem is None, sampler.problem
    return sampler.stop(), sampler


def _jtop_rail(mw: float) -> dict:
    return {"online": True, "type": "INA3221", "volt": 5000, "curr": mw / 5, "power": mw, "avg": mw}


def test_jtop_input_rail_moved_to_tot_still_counts(tmp_path, monkeypatch):
    # jtop removes VDD_IN from 'rail' and reports it as 'tot' with its name (jetson-stats 7.2 power.py).
    power = {"rail": {"VDD_CPU_GPU_CV": _jtop_rail(4667), "VDD_SOC": _jtop_rail(2817)},
             "tot": {**_jtop_rail(12479), "name": "VDD_IN"}}
    samples, sampler = _jtop_samples(tmp_path, monkeypatch, power)
    assert len(samples) == 3
    assert _power_keys(samples[0]) == {"power_w": pytest.approx(12.479), "cpu_gpu_cv_power_w": pytest.approx(4.667)}
    assert samples[0]["gpu_load_pct"] == 12.0 and samples[0]["temp_max_c"] == 50.5
    assert sampler.power_field == "board input VDD_IN"


def test_jtop_thor_uses_vin_not_jtops_sum_of_everything(tmp_path, monkeypatch):
    rails = {"VDD_GPU": _jtop_rail(37528), "VDD_CPU_SOC_MSS": _jtop_rail(18961), "VIN_SYS_5V0": _jtop_rail(18331),
             "VIN": _jtop_rail(87426)}
    power = {"rail": rails, "tot": {"power": 37528 + 18961 + 18331 + 87426}}  # jtop's own total: everything added
    samples, sampler = _jtop_samples(tmp_path, monkeypatch, power)
    assert samples[0]["power_w"] == pytest.approx(87.426) and sampler.power_field == "board input VIN (INA238)"


def test_jtop_agx_orin_sum_and_profile(tmp_path, monkeypatch):
    power = {"rail": {"VDD_GPU_SOC": _jtop_rail(2399), "VDD_CPU_CV": _jtop_rail(400), "VIN_SYS_5V0": _jtop_rail(4032),
                      "VDDQ_VDD2_1V8AO": _jtop_rail(301)}, "tot": {"power": 7132, "avg": 7132}}
    samples, sampler = _jtop_samples(tmp_path, monkeypatch, power, _profile("agx_orin_64gb"))
    assert _power_keys(samples[0]) == {"power_w": pytest.approx(7.132), "gpu_power_w": pytest.approx(2.399),
                                       "cpu_power_w": pytest.approx(0.4)}
    assert split_stamp("1.5 {}") == (1.5, "{}")


def test_jtop_missing_is_a_reason_not_zeros(tmp_path, monkeypatch):
    (tmp_path / "jtop").mkdir()
    (tmp_path / "jtop" / "__init__.py").write_text("raise ImportError('no jetson-stats here')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    sampler = JtopSampler(LocalConnection(), 10).start()
    sampler._thread.join(timeout=30)
    assert sampler.stop() == [] and "jetson-stats is not installed" in sampler.problem
