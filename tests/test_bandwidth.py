"""The roofline ceiling is a ceiling: read probes built on the device, calibrations per probe and power state,
the bandwidth a trial uses (and where it comes from), and the finding when decode beats its ceiling."""

from __future__ import annotations

import json
import math
from typing import Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from jbench.backends.engine.backend import EngineConfig  # noqa: E402
from jbench.backends.llamacpp.backend import LlamaCppConfig  # noqa: E402
from jbench.backends.trtllm.backend import TrtllmConfig  # noqa: E402
from jbench.core.schema import DeviceConfig  # noqa: E402
from jbench.device import bandwidth as bwm  # noqa: E402
from jbench.device.connection import CommandResult  # noqa: E402
from jbench.device.local import LocalConnection  # noqa: E402
from jbench.reporting import report  # noqa: E402
from jbench.runner.analyses import CEILING_BELOW_MEASURED, trial_roofline  # noqa: E402

from tests.test_roofline import _write_gguf  # noqa: E402


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JBENCH_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


LOCAL = DeviceConfig(name="local", kind="local")


def _cal(runs, probe="cpu", state="governor=performance", device="dev") -> bwm.Calibration:
    return bwm.Calibration(device=device, probe=probe, power_state=state, method="test", runs=runs, size_mb=64,
                           measured_at="2026-01-01T00:00:00")


class NoCompiler(LocalConnection):
    """This machine with no C compiler and no nvcc on the PATH (the tool lookup fails)."""

    def run(self, argv, **kw) -> CommandResult:
        if list(argv[:2]) == ["sh", "-c"] and "command -v" in argv[2]:
            return CommandResult(list(argv), 1, "", "", 0.0)
        return super().run(argv, **kw)

    def exists(self, path: str) -> bool:
        return False if path.endswith("nvcc") else super().exists(path)


def test_calibration_statistics_and_round_trip():
    cal = _cal([10.0, 12.0, 11.0, 9.0])
    assert cal.median == 10.5 and cal.min == 9.0 and cal.max == 12.0
    assert cal.ceiling_gbs == 12.0  # interference only lowers a read rate: the best run is the ceiling
    assert cal.spread == pytest.approx(3.0 / 10.5)
    d = cal.as_dict()
    assert d["bandwidth_gbs"] == 12.0 and d["median_gbs"] == 10.5 and d["spread"] == pytest.approx(3 / 10.5)
    assert bwm.Calibration.from_dict(json.loads(json.dumps(d))) == cal
    assert "best of 4 runs" in cal.summary() and "spread 28.6%" in cal.summary()


@pytest.mark.parametrize("backend, reported, path", [
    (LlamaCppConfig(n_gpu_layers=99), "CUDA", "gpu"),
    (LlamaCppConfig(n_gpu_layers=0), "CUDA", "cpu"),  # a CUDA build that offloads nothing decodes on CPU
    (LlamaCppConfig(n_gpu_layers=99), "CPU", "cpu"),  # a CPU build ignores -ngl
    (LlamaCppConfig(), None, "cpu"),
    (TrtllmConfig(), None, "gpu"),
    (EngineConfig(), "CUDA", "gpu"),  # no layer count: the engine's own report decides
    (EngineConfig(), None, "cpu"),
])
def test_compute_path_picks_the_probe(backend, reported, path):
    assert bwm.compute_path(backend, reported) == path


def test_calibrations_are_kept_per_probe_state_and_threads(cache):
    cal = _cal([20.0, 21.0, 22.0])
    path = bwm.save_calibration(cal)
    assert path.parent == cache / "calibration" / "dev" and "=" not in path.name
    assert bwm.load_calibration("dev", "cpu", "governor=performance") == cal
    assert bwm.load_calibration("dev", "cpu", "governor=powersave") is None
    assert bwm.load_calibration("dev", "gpu", "governor=performance") is None
    assert bwm.load_calibration("dev", "cpu", "governor=performance", threads=2) is None
    bwm.save_calibration(_cal([5.0, 5.0, 5.0]), threads_key=2)
    assert bwm.load_calibration("dev", "cpu", "governor=performance", threads=2).ceiling_gbs == 5.0
    path.write_text("{not json")
    assert bwm.load_calibration("dev", "cpu", "governor=performance") is None


def test_the_c_probe_measures_this_machine(cache):
    """The shipped C probe, compiled with this machine's cc and run on all its cores, reads at a positive rate;
    its binary is reused by source and compiler version."""
    conn = LocalConnection("local")
    cal = bwm.calibrate(conn, LOCAL, None, probe="cpu", runs=3)  # sized by the LLC
    assert cal.method.startswith("C read probe") and "16-byte vector loads" in cal.method
    assert len(cal.runs) == 3 and min(cal.runs) > 0 and cal.threads >= 1
    assert cal.power_state.startswith("governor=")
    binaries = sorted(p.name for p in (cache / "probes").glob("cpu_read-*") if not p.suffix)
    assert len(binaries) == 1
    assert cal.size_mb >= 512 and cal.details["buffer_bytes"] == cal.size_mb << 20
    bwm.calibrate(conn, LOCAL, None, probe="cpu", threads=1, runs=3)
    assert sorted(p.name for p in (cache / "probes").glob("cpu_read-*") if not p.suffix) == binaries


def test_without_a_compiler_numpy_reads_in_threads(cache, monkeypatch):
    monkeypatch.setattr(bwm, "last_level_cache_mb", lambda conn: 1.0)  # a small buffer is enough to test the path
    cal = bwm.calibrate(NoCompiler("local"), LOCAL, None, probe="cpu", size_mb=32, threads=2, runs=3)
    assert cal.method == "numpy sum in 2 threads (no C compiler on the device)"
    assert min(cal.runs) > 0


def test_gpu_probe_without_nvcc_names_the_fix(cache):
    with pytest.raises(bwm.CalibrationError, match="no nvcc on 'local'.*install the CUDA toolkit"):
        bwm.calibrate(NoCompiler("local"), LOCAL, None, probe="gpu")


def test_trial_bandwidth_order_and_auto_calibration(cache):
    conn = LocalConnection("local")
    device = {"name": "local", "kind": "local"}
    cpu_backend = {"name": "llamacpp", "n_gpu_layers": 99}
    # The user's figure wins and says so.
    user = bwm.trial_bandwidth(conn, {**device, "bandwidth_gbs": 61.2}, None, cpu_backend, "CPU")
    assert (user.gbs, user.source, user.calibration) == (61.2, "device.bandwidth_gbs", None)
    # No calibration, auto-calibration off, no profile: no ceiling, and why.
    off = bwm.trial_bandwidth(conn, device, None, cpu_backend, "CPU", auto_calibrate=False)
    assert off.gbs is None and "device.auto_calibrate is off" in off.source and "jbench calibrate" in off.source
    # A profile gives a datasheet figure, labelled as one.
    sheet = bwm.trial_bandwidth(conn, device, {"name": "orin_nano_8gb", "memory_bandwidth_gbs": 68.0}, cpu_backend,
                                "CPU", auto_calibrate=False)
    assert sheet.gbs == 68.0 and sheet.source.startswith("datasheet (orin_nano_8gb") and "not a measurement" in sheet.source
    # Auto-calibration measures once, then the saved calibration is used.
    first = bwm.trial_bandwidth(conn, device, None, {**cpu_backend, "threads": 1}, "CPU")
    assert first.source == "measured during the sweep (auto-calibration)" and first.calibration.threads == 1
    again = bwm.trial_bandwidth(conn, device, None, {**cpu_backend, "threads": 1}, "CPU")
    assert again.source == "jbench calibrate" and again.gbs == first.gbs
    tags = again.tags()
    assert tags["roofline.bandwidth_probe"] == "cpu" and tags["roofline.bandwidth_runs"] == "7"
    assert tags["roofline.bandwidth_method"].startswith("C read probe, 1 threads")
    assert float(tags["roofline.bandwidth_spread"]) >= 0
    # A GPU trial on a machine without nvcc: the failure is the label of the fallback, never a guess.
    gpu = bwm.trial_bandwidth(NoCompiler("local"), device, None, cpu_backend, "CUDA")
    assert gpu.gbs is None and "auto-calibration failed: no nvcc" in gpu.source


def _model_config(path):
    from jbench.core.trial import trial_config

    return trial_config({"model": {"name": "tiny", "quant": "F16", "source": "files", "files": {"F16": str(path)}},
                         "backend": {"name": "llamacpp"}, "device": {"name": "dev"}})


def test_a_rate_above_its_ceiling_is_a_finding_not_a_fraction(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write_gguf(path)
    cal = _cal([1.0, 1.0, 1.0])
    bw = bwm.Bandwidth(cal.ceiling_gbs, "jbench calibrate", cal)
    below = trial_roofline(_model_config(path), 10.0, bw)
    ceiling = below.metrics["roofline_decode_tps"]
    assert below.metrics["roofline_fraction"] == pytest.approx(10.0 / ceiling) and not below.findings
    above = trial_roofline(_model_config(path), ceiling * 1.29, lambda: bw)
    assert "roofline_fraction" not in above.metrics
    assert above.metrics["roofline_measured_over_ceiling"] == pytest.approx(1.29)
    assert above.tags["roofline.regime"].startswith("above ceiling")
    (finding,) = above.findings
    assert finding.code == CEILING_BELOW_MEASURED
    assert finding.message == "ceiling below measured: calibration wrong or cache-resident model"
    assert finding.evidence["measured_over_ceiling"] == pytest.approx(1.29)
    assert finding.evidence["bandwidth_source"] == "jbench calibrate"
    assert finding.evidence["implied_read_gbs"] == pytest.approx(1.29)  # the rate decode would have to read at
    assert above.metrics["roofline_bandwidth_spread"] == 0.0


def test_no_bandwidth_no_ceiling_and_the_reason(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write_gguf(path)
    out = trial_roofline(_model_config(path), 10.0, bwm.Bandwidth(None, "no device bandwidth: ..."))
    assert "roofline_decode_tps" not in out.metrics and "roofline_fraction" not in out.metrics
    assert out.tags["roofline.status"] == "no device bandwidth: ..." and out.metrics["roofline_bytes_per_token"] > 0


def test_bandwidth_is_not_asked_for_when_the_model_is_not_here(tmp_path):
    def must_not_measure() -> bwm.Bandwidth:
        raise AssertionError("measured without a model file")

    out = trial_roofline(_model_config(tmp_path / "missing.gguf"), 10.0, must_not_measure)
    assert "not on this machine" in out.tags["roofline.status"]


def test_report_crosses_out_points_above_their_ceiling():
    fig, ax = plt.subplots()
    x = pd.Series([4.5, 8.5, 16.0])
    n = report._mark_above_ceiling(ax, x, pd.Series([10.0, 20.0, 59.8]), pd.Series([30.0, 25.0, 46.5]))
    assert n == 1
    (line,) = ax.lines
    assert list(line.get_xdata()) == [16.0] and list(line.get_ydata()) == [59.8]
    plt.close(fig)
    assert "crossed out" in report._ceiling_note(1) and report._ceiling_note(0) == ""


def test_report_summary_counts_the_finding():
    trials = pd.DataFrame({"status": ["FINISHED", "FINISHED"], "metrics.decode_tps": [59.8, 20.0],
                           "metrics.roofline_decode_tps": [46.5, 30.0], "metrics.roofline_fraction": [math.nan, 0.66],
                           "metrics.roofline_measured_over_ceiling": [1.29, 0.66],
                           report.CEILING_FINDING: ["ceiling below measured: calibration wrong or cache-resident model",
                                                    None]})
    sec = report._overview(pd.DataFrame({"experiment": ["quant_ladder"]}), trials)
    assert "1 run(s) decoded faster than their roofline ceiling (finding ceiling_below_measured" in sec.text


def test_calibrate_command_fails_with_one_message(cache, monkeypatch):
    from jbench.cli import main

    monkeypatch.setattr(bwm, "_first_tool", lambda conn, names, extra_paths=(): None)
    res = CliRunner().invoke(main, ["calibrate", "local", "--probe", "gpu"])
    assert res.exit_code == 2 and "no nvcc on 'local'" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(main, ["calibrate", "local", "--runs", "2"])
    assert res.exit_code == 2 and "--runs" in res.output


@pytest.mark.e2e
def test_a_sweep_measures_its_ceiling_and_no_fraction_exceeds_one(tmp_path, llama_build, bundled_model):
    """A real sweep on this machine with no bandwidth figure and no calibration: the first trial measures the
    CPU read rate, the next one reuses it, and every finished run's fraction is <= 1 or carries the finding."""
    from jbench.core import paths

    from tests.conftest import jbench_cli

    real, cache = paths.cache_dir(), tmp_path / "cache"
    cache.mkdir()
    for name in ("llama.cpp", "models", "model-facts", "digests.json"):  # the build and models, no calibration
        if (real / name).exists():
            (cache / name).symlink_to(real / name)
    env = {"JBENCH_RESULTS_DIR": str(tmp_path / "results"), "JBENCH_CACHE_DIR": str(cache)}
    res = jbench_cli(["sweep", "+experiment=quant_ladder", "model.quant=Q4_0,F16", "backend.n_prompt=16",
                      "backend.n_gen=8", "backend.repetitions=2", "quality.enabled=false"], env_extra=env)
    assert res.returncode == 0, res.stdout + res.stderr
    out = tmp_path / "runs.csv"
    res = jbench_cli(["export", "--experiment", "quant_ladder", "--out", str(out)], env_extra=env)
    assert res.returncode == 0, res.stderr
    df = pd.read_csv(out).sort_values("start_time")
    assert list(df["status"]) == ["FINISHED", "FINISHED"]
    assert list(df["tags.roofline.bandwidth_source"]) == ["measured during the sweep (auto-calibration)",
                                                         "jbench calibrate"]
    assert set(df["tags.roofline.bandwidth_probe"]) == {"cpu"}
    assert df["tags.roofline.bandwidth_method"].str.startswith("C read probe").all()
    assert len(list((cache / "calibration" / "local").glob("cpu--*.json"))) == 1
    finding = df.get("tags.finding.ceiling_below_measured", pd.Series([None] * len(df), index=df.index))
    for fraction, ratio, found in zip(df["metrics.roofline_fraction"], df["metrics.roofline_measured_over_ceiling"],
                                      finding):
        if ratio <= 1.0:
            assert fraction == pytest.approx(ratio) and pd.isna(found)
        else:
            assert pd.isna(fraction) and found.startswith("ceiling below measured")


def test_cpu_buffer_must_dwarf_the_last_level_cache(cache, monkeypatch):
    monkeypatch.setattr(bwm, "last_level_cache_mb", lambda conn: 256.0)
    with pytest.raises(bwm.CalibrationError, match=r"under 8x the CPU's last-level cache \(256 MB\): pass --size-mb 2048"):
        bwm.calibrate(LocalConnection("local"), {"name": "local"}, None, probe="cpu", size_mb=512)


def test_last_level_cache_is_read_from_sysfs():
    llc = bwm.last_level_cache_mb(LocalConnection("local"))
    assert llc is None or llc > 0
