"""tegrastats parsing on the real, sourced corpus in tests/data/jetson-formats (every module and release)."""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from jbench.device.telemetry import parse_line, parse_stream, sample_to_dict, total_input_power_mw
from jbench.device.telemetry.tegrastats import CpuCore, Iram, Rail, TegrastatsSample

from .conftest import DATA

CORPUS = DATA / "jetson-formats"
CORPUS_FILES = {
    "tegrastats-agx-orin.txt",
    "tegrastats-agx-xavier.txt",
    "tegrastats-nano.txt",
    "tegrastats-orin-nano.txt",
    "tegrastats-orin-nx.txt",
    "tegrastats-thor.txt",
    "tegrastats-tx1.txt",
    "tegrastats-tx2.txt",
    "tegrastats-xavier-nx.txt",
}
# The only corpus lines that are not tegrastats output (file, exact line): the `date` header of a log.
NON_TEGRASTATS = {("tegrastats-tx2.txt", "Tue Jan 26 18:22:31 UTC 2021")}


def _corpus_lines() -> list[tuple[str, str]]:
    """(file name, line) for every non-comment, non-blank corpus line; fails (never skips) without the corpus."""
    if not CORPUS.is_dir():
        pytest.fail(f"tegrastats corpus missing: {CORPUS}")
    found = {p.name for p in CORPUS.glob("tegrastats-*.txt")}
    missing = CORPUS_FILES - found
    if missing:
        pytest.fail(f"tegrastats corpus incomplete, missing {sorted(missing)} in {CORPUS}")
    out = []
    for name in sorted(found):
        for line in (CORPUS / name).read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                out.append((name, line))
    return out


def _line(name: str, prefix: str) -> str:
    """The one corpus line of `name` that starts with `prefix`."""
    hits = [line for file, line in _corpus_lines() if file == name and line.startswith(prefix)]
    assert len(hits) == 1, f"{name}: {len(hits)} lines start with {prefix!r}"
    return hits[0]


def _sample(name: str, prefix: str) -> TegrastatsSample:
    sample = parse_line(_line(name, prefix))
    assert sample is not None
    return sample


# --- the whole corpus -------------------------------------------------------------------------

def test_every_corpus_line_parses_and_only_the_date_header_is_rejected():
    lines = _corpus_lines()
    assert len(lines) >= 60
    rejected = set()
    for name, line in lines:
        sample = parse_line(line)
        if sample is None:
            rejected.add((name, line))
            continue
        # Every token of every real line is understood; the CPU list and RAM are always there.
        assert sample.unknown == [], (name, sample.unknown)
        assert sample.cpus and sample.ram_total_mb > 0, (name, line)
    assert rejected == NON_TEGRASTATS


def test_parse_stream_counts_the_date_header_as_skipped():
    _corpus_lines()  # fails loudly when the corpus is missing
    text = (CORPUS / "tegrastats-tx2.txt").read_text()
    lines = [l for l in text.splitlines() if not l.startswith("#")]
    samples, skipped = parse_stream(lines + ["", "   "])
    assert skipped == 1
    assert len(samples) == len([l for l in lines if l.strip()]) - 1


def test_never_raises_on_truncated_respaced_or_commented_corpus_text():
    payloads = [line for _, line in _corpus_lines()]
    for name in CORPUS_FILES:
        for line in (CORPUS / name).read_text().splitlines():
            for tag in ("# TEMPLATE: ", "# PARTIAL: ", "# WRAPPED: "):
                if line.startswith(tag):
                    payloads.append(line[len(tag):])
    for line in payloads:
        tokens = line.split()
        for k in range(len(tokens) + 1):
            parse_line(" ".join(tokens[:k]))
            parse_line("   ".join(tokens[k:]))
        parse_line("\t".join(tokens) + "\r\n")


def test_wrapped_readme_line_first_piece_parses_continuations_do_not():
    text = (CORPUS / "tegrastats-orin-nano.txt").read_text()
    pieces = [l[len("# WRAPPED: "):] for l in text.splitlines() if l.startswith("# WRAPPED: ")]
    assert len(pieces) == 3
    first = parse_line(pieces[0])
    assert first is not None and first.ram_used_mb == 3162 and first.swap_total_mb == 3810
    assert parse_line(pieces[1]) is None and parse_line(pieces[2]) is None
    # Joined back, the README's odd `598mW/598` still reads as mW.
    joined = parse_line(" ".join(pieces))
    assert joined is not None and joined.rails["VDD_CPU_GPU_CV"] == Rail(598, 598)
    assert [c.online for c in joined.cpus] == [True, True, True, True, False, False]


# --- specific real values, per module and release ----------------------------------------------

def test_orin_nano_jp6_root():
    s = _sample("tegrastats-orin-nano.txt", "11-15-2024 08:38:09")
    assert s.timestamp == datetime(2024, 11, 15, 8, 38, 9)
    assert (s.ram_used_mb, s.ram_total_mb, s.lfb) == (6185, 7620, "8x2MB")
    assert (s.swap_used_mb, s.swap_total_mb, s.swap_cached_mb) == (851, 3810, 1)
    assert len(s.cpus) == 6 and s.cpus[0] == CpuCore(0, 15.0, 729.0, True)
    assert (s.emc_load_pct, s.emc_freq_mhz) == (43, 2133)
    assert s.gpu_load_pct == 63 and s.gpu_freqs_mhz == [621]
    assert s.engines["NVDEC"].online is False and "NVENC" not in s.engines
    assert s.engines["APE"].freq_mhz == 200
    assert s.temps_c["cpu"] == 53.968 and s.temps_max_c == {}
    assert s.rails["VDD_IN"] == Rail(12479, 12479, None)
    assert s.rails["VDD_SOC"].current_mw == 2817
    assert total_input_power_mw(s) == 12479  # VDD_IN alone, the other rails are inside it


def test_orin_nano_non_root_has_no_emc_and_no_gpu_clock():
    s = _sample("tegrastats-orin-nano.txt", "06-18-2025 11:25:24")
    assert s.emc_load_pct is None and s.emc_freq_mhz is None
    assert s.gpu_load_pct == 0 and s.gpu_freqs_mhz == []
    assert s.engines == {}
    assert total_input_power_mw(s) == 4824


def test_orin_nano_jp72_three_value_rails_and_cur_max_temps():
    s = _sample("tegrastats-orin-nano.txt", "09-04-2026 19:40:47")
    assert s.rails["VDD_IN"] == Rail(4093, 4463, 4832)
    assert s.rails["VDD_CPU_GPU_CV"].max_mw == 1236
    assert s.temps_c["cpu"] == 47.562 and s.temps_max_c["cpu"] == 48
    assert s.temps_max_c["soc1"] == 46.937
    assert s.swap_total_mb is None  # R39 Orin Nano prints no SWAP
    assert s.gpu_load_pct == 12 and s.gpu_freqs_mhz == [306]
    assert s.engines["NVDEC0"].online is False


def test_thor_jp72_gr3d_without_load_and_engines_at_freq():
    s = _sample("tegrastats-thor.txt", "07-23-2026 15:29:26")
    assert s.gpu_load_pct is None and s.gpu_freqs_mhz == [314, 314, 314]
    assert len(s.cpus) == 14 and s.cpus[0] == CpuCore(0, 39.0, 2160.0, True)
    assert (s.emc_load_pct, s.emc_freq_mhz) == (7, 3200)
    nvenc = s.engines["NVENC0_FREQ"]
    assert (nvenc.load_pct, nvenc.freq_mhz, nvenc.online) == (None, 1556, True)
    assert (s.engines["VIC"].load_pct, s.engines["VIC"].freq_mhz) == (59, 423)
    assert s.engines["PVA0_FREQ"].online is False
    assert s.rails["VDD_CPU_SOC_MSS"] == Rail(8710, 8710, 8710)
    # No VIN on this line: VDD_GPU + VDD_CPU_SOC_MSS + VIN_SYS_5V0
    assert total_input_power_mw(s) == 4925 + 8710 + 6767


def test_thor_r384_idle_gpcs_at_zero_and_two_value_rails():
    s = _sample("tegrastats-thor.txt", "05-17-2026 10:00:32")
    assert s.gpu_load_pct is None and s.gpu_freqs_mhz == [0, 0, 0]
    assert s.engines["NVENC0_FREQ"].freq_mhz == 0
    assert s.rails["VDD_GPU"] == Rail(0, 0, None)  # a real 0 mW reading, unlike an NC channel
    assert "gpu" not in s.temps_c
    assert total_input_power_mw(s) == 0 + 4165 + 4126


def test_thor_non_root_uses_vin_as_board_input():
    s = _sample("tegrastats-thor.txt", "07-02-2026 13:45:44")
    assert s.gpu_load_pct is None and s.gpu_freqs_mhz == [] and s.emc_freq_mhz is None
    assert s.rails["VIN"] == Rail(87426, 43713, 87426)
    assert total_input_power_mw(s) == 87426
    assert s.temps_c["gpu"] == 62.906 and s.temps_max_c == {}


def test_agx_orin_jp5_gr3d2_offline_sensors_and_nc_rails():
    s = _sample("tegrastats-agx-orin.txt", "04-24-2023 00:01:24")
    assert s.gpu_load_pct == 0 and s.gpu2_load_pct == 0 and s.gpu_freqs_mhz == [0, 0]
    # -256C = offline sensor: name kept, value None
    assert s.temps_c["CV0"] is None and s.temps_c["GPU"] is None and s.temps_c["CV2"] is None
    assert s.temps_c["CPU"] == 42.593 and s.temps_c["Tboard"] == 32
    assert s.nc_rails == 2 and "NC" not in s.rails
    assert s.engines["VIC_FREQ"].freq_mhz == 729
    # No input rail on AGX Orin: the sum of its rails, NC placeholders excluded.
    assert total_input_power_mw(s) == 2399 + 400 + 4032 + 301


def test_agx_orin_jp6_per_gpc_freqs_and_rail_sum():
    s = _sample("tegrastats-agx-orin.txt", "10-26-2025 05:19:40")
    assert s.gpu_freqs_mhz == [305, 1300] and s.gpu_load_pct == 0
    assert s.cpus[11] == CpuCore(11, 100.0, 2201.0, True)
    assert s.engines["NVDLA1"].online is False
    assert s.rails["VDDQ_VDD2_1V8AO"] == Rail(705, 739)
    assert total_input_power_mw(s) == 4001 + 2800 + 4838 + 705


def test_agx_orin_jp72_off_cores_and_max_values():
    s = _sample("tegrastats-agx-orin.txt", "07-31-2026 14:58:05")
    assert [c.online for c in s.cpus] == [True] * 8 + [False] * 4
    assert s.cpus[8] == CpuCore(8, None, None, False)
    assert s.rails["VIN_SYS_5V0"] == Rail(4722, 4722, 4722)
    assert s.temps_c["soc1"] == 49 and s.temps_max_c["soc1"] == 49
    assert total_input_power_mw(s) == 2265 + 2643 + 4722  # no VDDQ_VDD2_1V8AO printed on R39.2


def test_agx_orin_jp72_gr3d_load_with_gpc_list():
    s = _sample("tegrastats-agx-orin.txt", "07-25-2026 09:08:28")
    assert s.gpu_load_pct == 12 and s.gpu_freqs_mhz == [1300, 1300]
    assert s.lfb == "1x2MB" and s.swap_used_mb is None


def test_agx_orin_r36_irregular_spacing():
    s = _sample("tegrastats-agx-orin.txt", "RAM 29114/30697MB")
    assert s.timestamp is None
    assert (s.swap_used_mb, s.swap_total_mb, s.swap_cached_mb) == (4915, 15348, 1)
    assert s.engines["NVENC"].online is False and s.engines["APE"].freq_mhz == 174
    assert s.temps_c["gpu"] == 47.812 and s.unknown == []
    assert total_input_power_mw(s) == 3205 + 4405 + 4767


def test_agx_orin_active_encoder_load_at_freq():
    s = _sample("tegrastats-agx-orin.txt", "05-09-2026 18:42:06")
    assert (s.engines["NVENC"].load_pct, s.engines["NVENC"].freq_mhz) == (79, 166)
    assert (s.engines["VIC"].load_pct, s.engines["VIC"].freq_mhz) == (36, 115)


def test_agx_orin_non_root_line():
    s = _sample("tegrastats-agx-orin.txt", "RAM 2448/62840MB")
    assert s.gpu_load_pct == 0 and s.gpu_freqs_mhz == [] and s.emc_load_pct is None
    assert total_input_power_mw(s) == 4940 + 988 + 4442


def test_agx_xavier_jp4_off_cores_mts_and_rail_sum():
    s = _sample("tegrastats-agx-xavier.txt", "RAM 721/31927MB")
    assert [c.online for c in s.cpus] == [True] * 4 + [False] * 4
    assert s.engines["MTS_FG"].load_pct == 0 and s.engines["MTS_BG"].load_pct == 0
    assert (s.emc_load_pct, s.emc_freq_mhz, s.gpu_freqs_mhz) == (0, 665, [318])
    assert s.rails["VDDRQ"] == Rail(621, 621) and s.temps_c["PMIC"] == 100
    assert total_input_power_mw(s) == 0 + 311 + 932 + 0 + 621 + 1482
    assert total_input_power_mw(_sample("tegrastats-agx-xavier.txt", "RAM 14700/15692MB")) == (
        463 + 618 + 2936 + 0 + 309 + 3306
    )


def test_nano_jp4_unitless_pom_rails_and_iram():
    s = _sample("tegrastats-nano.txt", "RAM 1923/3964MB")
    assert s.rails["POM_5V_IN"] == Rail(1750, 1628, None)
    assert s.rails["POM_5V_GPU"] == Rail(0, 0) and s.rails["POM_5V_CPU"] == Rail(366, 406)
    assert s.iram == Iram(0, 252, 252)
    assert [c.freq_mhz for c in s.cpus] == [1224] * 4
    assert (s.gpu_load_pct, s.gpu_freqs_mhz) == (0, [76])
    assert total_input_power_mw(s) == 1750


def test_nano_active_codecs_print_bare_mhz():
    s = _sample("tegrastats-nano.txt", "RAM 1180/3965MB")
    assert s.engines["NVENC"].freq_mhz == 716 and s.engines["NVDEC"].freq_mhz == 716
    assert s.engines["NVENC"].load_pct is None and s.engines["NVENC"].online is True


def test_tx1_l4t24_shared_clock_cpu_and_old_engines():
    s = _sample("tegrastats-tx1.txt", "RAM 1104/3995MB")
    assert s.cpus == [CpuCore(i, load, 1734.0, True) for i, load in enumerate([2.0, 5.0, 8.0, 11.0])]
    assert (s.emc_load_pct, s.emc_freq_mhz) == (0, 1600)
    assert (s.gpu_load_pct, s.gpu_freqs_mhz) == (0, [998])
    assert (s.engines["AVP"].load_pct, s.engines["AVP"].freq_mhz) == (1, 115)
    assert s.engines["MSENC"].freq_mhz == 192 and s.engines["NVDEC"].freq_mhz == 192
    assert s.engines["EDP_LIMIT"].freq_mhz == 1734
    assert s.rails == {} and s.temps_c == {} and s.swap_used_mb is None
    assert total_input_power_mw(s) is None  # no sensor: not available, never 0


def test_tx1_l4t281_and_l4t28_32_forms():
    s = _sample("tegrastats-tx1.txt", "RAM 3607/3983MB")
    assert [c.load_pct for c in s.cpus] == [17, 11, 65, 0] and s.cpus[3].freq_mhz == 1734
    assert (s.gpu_load_pct, s.gpu_freqs_mhz, s.swap_cached_mb) == (39, [76], 281)
    t = _sample("tegrastats-tx1.txt", "RAM 1179/3983MB")
    assert t.iram == Iram(0, 252, 252) and t.rails["VDD_CPU"] == Rail(76, 178)
    assert total_input_power_mw(t) == 2532


def test_tx2_off_denver_cores_and_vdd_in():
    s = _sample("tegrastats-tx2.txt", "RAM 2344/7852MB")
    assert [c.online for c in s.cpus] == [True, False, False, True, True, True]
    assert s.cpus[5] == CpuCore(5, 2.0, 345.0, True)
    assert s.gpu_freqs_mhz == [624] and s.emc_load_pct == 4
    assert total_input_power_mw(s) == 3056


def test_tx2_non_root_has_no_rails():
    s = _sample("tegrastats-tx2.txt", "RAM 1689/3825MB (lfb 339x4MB) SWAP 0/1913MB (cached 0MB) CPU [3%@345")
    assert s.rails == {} and total_input_power_mw(s) is None
    assert s.temps_c["PMIC"] == 50


def test_tx2_2019_capture_small_lfb():
    s = _sample("tegrastats-tx2.txt", "RAM 4722/7844MB")
    assert s.lfb == "1x512kB" and s.swap_total_mb is None
    assert (s.gpu_load_pct, s.gpu_freqs_mhz) == (71, [1300])
    assert total_input_power_mw(s) == 14025


def test_xavier_nx_jp512_bracketed_single_gpc_and_mw_units():
    s = _sample("tegrastats-xavier-nx.txt", "07-09-2024 13:31:31")
    assert (s.gpu_load_pct, s.gpu_freqs_mhz) == (0, [114])
    assert s.rails["VDD_IN"] == Rail(2763, 2846)
    assert s.engines["VIC_FREQ"].freq_mhz == 115


def test_orin_nx_jp5_off_cores():
    s = _sample("tegrastats-orin-nx.txt", "RAM 6334/15388MB")
    assert sum(c.online for c in s.cpus) == 4 and len(s.cpus) == 8
    assert s.gpu_freqs_mhz == [611] and s.temps_c["CV1"] == 46.406
    assert total_input_power_mw(s) == 5299


# --- behaviour --------------------------------------------------------------------------------

def test_non_tegrastats_lines_give_none():
    for line in ("", "   ", "Tue Jan 26 18:22:31 UTC 2021", "11-15-2024 08:38:09", "RAM", "RAM lots",
                 "CPU [1%@729,0%@729] GR3D_FREQ 1%"):
        assert parse_line(line) is None, line


def test_unknown_tokens_are_kept_not_fatal():
    s = parse_line("RAM 1/2MB (lfb 1x4MB) FUTURE_THING x=1 CPU [1%@100] weird")
    assert s is not None and s.cpus == [CpuCore(0, 1.0, 100.0, True)]
    assert s.unknown == ["FUTURE_THING", "x=1", "weird"]


def test_fields_are_order_independent():
    line = _line("tegrastats-tx2.txt", "RAM 2344/7852MB")
    swap = "SWAP 0/3926MB (cached 0MB)"
    moved = line.replace(swap + " ", "").replace("EMC_FREQ", swap + " EMC_FREQ")
    assert moved != line
    a, b = parse_line(line), parse_line(moved)
    assert a == b


def test_total_power_with_explicit_rails_spec():
    s = _sample("tegrastats-orin-nano.txt", "11-15-2024 08:38:09")
    assert total_input_power_mw(s, ["VDD_CPU_GPU_CV", "VDD_SOC"]) == 4667 + 2817
    assert total_input_power_mw(s, ["VDD_IN"]) == 12479
    assert total_input_power_mw(s, ["VDD_IN", "NOT_A_RAIL"]) is None  # a partial sum would be low
    assert total_input_power_mw(s, []) is None
    orin = _sample("tegrastats-agx-orin.txt", "04-24-2023 00:01:24")
    assert total_input_power_mw(orin, ["NC"]) is None  # placeholders are never rails


def test_sample_to_dict_flat_keys_and_json():
    s = _sample("tegrastats-orin-nano.txt", "09-04-2026 19:40:47")
    d = sample_to_dict(s)
    assert d["timestamp"] == "2026-09-04T19:40:47"
    assert d["ram_used_mb"] == 1803 and d["swap_used_mb"] is None
    assert d["cpu0_load_pct"] == 64 and d["cpu0_freq_mhz"] == 729 and d["cpu5_online"] is True
    assert d["gpu_load_pct"] == 12 and d["gpu_freq_mhz"] == 306 and d["gpu_gpc0_freq_mhz"] == 306
    assert d["emc_load_pct"] == 5 and d["emc_freq_mhz"] == 665
    assert d["temp_cpu_c"] == 47.562 and d["temp_cpu_max_c"] == 48
    assert d["rail_VDD_IN_mw"] == 4093 and d["rail_VDD_IN_avg_mw"] == 4463 and d["rail_VDD_IN_max_mw"] == 4832
    assert d["engine_VIC_online"] is False
    assert d["total_power_mw"] == 4093 and d["unknown"] is None
    json.dumps(d)  # JSON-lines ready
    orin = sample_to_dict(_sample("tegrastats-agx-orin.txt", "04-24-2023 00:01:24"))
    assert orin["temp_CV0_c"] is None and orin["gpu2_load_pct"] == 0 and "rail_NC_mw" not in orin
    assert orin["total_power_mw"] == 7132
    assert orin["total_power_rule"] == "module rails sum (AGX Orin): VDD_GPU_SOC+VDD_CPU_CV+VIN_SYS_5V0+VDDQ_VDD2_1V8AO"
    assert d["total_power_rule"] == "board input VDD_IN"
    tx1 = sample_to_dict(_sample("tegrastats-tx1.txt", "RAM 1104/3995MB"))
    assert tx1["total_power_mw"] is None and tx1["iram_used_kb"] is None
