"""Wall power: the meters' protocols against protocol-faithful servers on loopback (tests/wall_meters.py),
the controller-device clock offset through real processes, wall energy per window, and a local
`jbench run` with a Shelly at the wall."""

from __future__ import annotations

import json
import os
import re
import socket
import time
from pathlib import Path

import pytest

from jbench.analysis.telemetry import EnergySettings, PhaseWindow
from jbench.analysis.wall import board_coverage_metrics, wall_energy_metrics
from jbench.device.connection import DeviceError
from jbench.device.local import LocalConnection
from jbench.device.telemetry.wall import (
    ClockOffset,
    PtdSampler,
    ShellySampler,
    TasmotaSampler,
    WallMeterError,
    make_wall_sampler,
    measure_clock_offset,
    parse_ptd_fields,
)

from .wall_meters import VOLTS, PtdServer, ShellyServer, TasmotaServer


def _sample_for(sampler, n: int) -> list[dict]:
    sampler.start()
    assert sampler.wait_for_samples(n, timeout_s=10), sampler.problem
    return sampler.stop()


# ---------------------------------------------------------------------------------------------
# Clock offset


def test_offset_of_the_local_device_is_zero_within_its_uncertainty():
    off = measure_clock_offset(LocalConnection(), rounds=5)
    assert off.rounds == 5 and off.rtt_s > 0 and off.uncertainty_s == pytest.approx(off.rtt_s / 2)
    assert abs(off.offset_s) <= off.uncertainty_s + 1e-6


def test_offset_of_a_shifted_device_clock_is_found():
    # A real process prints its clock 123.5 s ahead: the estimate must bracket it within RTT/2.
    shifted = ["python3", "-c", "import time; print(repr(time.time() + 123.5))"]
    off = measure_clock_offset(LocalConnection(), rounds=3, argv=shifted)
    assert abs(off.offset_s - 123.5) <= off.uncertainty_s + 1e-6


def test_unreadable_device_clock_is_a_clear_error():
    with pytest.raises(DeviceError, match="could not read the device's clock"):
        measure_clock_offset(LocalConnection(), rounds=2, argv=["echo", "not a time"])


def test_offsets_before_and_after_combine_with_the_drift_in_the_uncertainty():
    both = ClockOffset.combine(ClockOffset(1.0, 0.001, 0.002, 4), ClockOffset(1.004, 0.002, 0.004, 4))
    assert both.offset_s == pytest.approx(1.002) and both.uncertainty_s == pytest.approx(0.002 + 0.002)


# ---------------------------------------------------------------------------------------------
# Shelly Gen2


def test_shelly_reads_power_and_its_energy_counter():
    with ShellyServer(watts=15.0) as meter:
        s = ShellySampler("127.0.0.1", meter.port, interval_ms=50)
        s.probe()
        assert "SNPL-00112EU" in s.meter and meter.device_id in s.meter
        samples = _sample_for(s, 4)
    assert all(x["power_w"] == 15.0 and x["voltage_v"] == VOLTS for x in samples)
    assert s.counter_resolution_j == pytest.approx(3.6)  # aenergy.total has 3 decimals of Wh
    assert all(b["t"] >= a["t"] and b["energy_j"] >= a["energy_j"] for a, b in zip(samples, samples[1:]))


def test_shelly_digest_authentication(monkeypatch):
    with ShellyServer(watts=15.0, password="s3cret") as meter:
        monkeypatch.setenv("JB_TEST_SHELLY_PW", "s3cret")
        ok = make_wall_sampler({"source": "shelly", "host": "127.0.0.1", "port": meter.port,
                                "password_env": "JB_TEST_SHELLY_PW"})
        ok.probe()
        assert ok._read()["power_w"] == 15.0
        with pytest.raises(WallMeterError, match="refused the password"):
            ShellySampler("127.0.0.1", meter.port, password="wrong").probe()
        with pytest.raises(WallMeterError, match="wall_power.password_env"):
            ShellySampler("127.0.0.1", meter.port).probe()


def test_password_env_must_be_set():
    with pytest.raises(WallMeterError, match="JB_TEST_UNSET_PW.*not set"):
        make_wall_sampler({"source": "shelly", "host": "h", "password_env": "JB_TEST_UNSET_PW"})


# ---------------------------------------------------------------------------------------------
# Tasmota


def test_tasmota_reads_status_8_with_its_web_password():
    with TasmotaServer(watts=40.0, password="pw") as meter:
        s = TasmotaSampler("127.0.0.1", meter.port, password="pw", interval_ms=50)
        s.probe()
        assert s.meter == "tasmota bench-plug fw 13.2.0(tasmota)"
        samples = _sample_for(s, 3)
        assert all(x["power_w"] == 40.0 for x in samples)
        assert s.counter_resolution_j == pytest.approx(3600.0)  # Total: 3 decimals of kWh
        with pytest.raises(WallMeterError, match="user and password"):
            TasmotaSampler("127.0.0.1", meter.port, password="bad").probe()


# ---------------------------------------------------------------------------------------------
# PTDaemon


def test_ptd_reply_fields():
    assert parse_ptd_fields("Watts,22.95,Volts,228.57,Amps,0.20643,PF,0.4864") == {
        "Watts": 22.95, "Volts": 228.57, "Amps": 0.20643, "PF": 0.4864}
    # -1 is PTDaemon's "unknown" (a multichannel sum has no volts): left out, never a value.
    assert parse_ptd_fields("Time,11-13-2020 22:38:59.240,Watts,272.93,Volts,-1.000000,Amps,-1,PF,-1,Mark,x") == {
        "Watts": 272.93}


def test_ptd_ranging_run_then_testing_run_as_mlperf_does():
    with PtdServer(watts=46.0) as meter:
        s = PtdSampler("127.0.0.1", meter.port, interval_ms=50, mark="trial1")
        s.probe()
        assert s.meter.startswith("ptdaemon YokogawaWT310") and s.initial_ranges == ("Auto", "Auto")
        volts, amps = s.ranging_run(lambda: time.sleep(0.4))
        assert float(volts) == pytest.approx(VOLTS) and float(amps) == pytest.approx(1.1 * 46.0 / VOLTS, rel=1e-4)
        samples = _sample_for(s, 4)
        s.finish()
    cmds = meter.commands
    assert cmds[:6] == ["Hello", "Identify", "RR", "SR,V,Auto", "SR,A,Auto", "Go,50,0,trial1_ranging"]
    i = cmds.index("RL")
    assert cmds[i + 1:i + 5] == ["Stop", f"SR,V,{volts}", f"SR,A,{amps}", "Go,50,0,trial1_testing"]
    assert cmds[-4:] == ["Uncertainty", "Stop", "SR,V,Auto", "SR,A,Auto"]  # restored as Ptd.terminate does
    assert all(x["power_w"] == 46.0 and x["current_a"] == pytest.approx(46.0 / VOLTS) for x in samples)
    assert "ranging run: max 230 V" in s.ranging and "testing run at" in s.ranging
    assert s.uncertainty == "Uncertainty,0.012%"


def test_ptd_over_range_readings_are_gaps_not_zeros():
    with PtdServer(watts=46.0) as meter:
        s = PtdSampler("127.0.0.1", meter.port, interval_ms=50)
        s.probe()
        s.ranging_run(lambda: time.sleep(0.3))
        s.start()
        assert s.wait_for_samples(2, timeout_s=10)
        meter.set_watts(460.0)  # ten times the ranging run's current: over the fixed range
        time.sleep(0.4)
        samples = s.stop()
        s.finish()
    assert s.failed_polls >= 2 and "over range" in s.last_error
    assert all(x["power_w"] == 46.0 for x in samples)


def test_something_else_than_ptdaemon_is_refused():
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port = srv.getsockname()[1]
        import threading

        def answer():
            conn, _ = srv.accept()
            with conn:
                conn.recv(100)
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")

        threading.Thread(target=answer, daemon=True).start()
        with pytest.raises(WallMeterError, match="is not PTDaemon"):
            PtdSampler("127.0.0.1", port).probe()


def test_unreachable_meter_is_one_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        with pytest.raises(WallMeterError, match=f"cannot reach PTDaemon at 127.0.0.1:{port}"):
            PtdSampler("127.0.0.1", port).probe()
        with pytest.raises(WallMeterError, match=f"cannot reach 127.0.0.1:{port}"):
            ShellySampler("127.0.0.1", port, timeout_s=1).probe()


@pytest.mark.parametrize("section, message", [
    ({"source": "kasa", "host": "h"}, "unknown wall_power.source 'kasa'"),
    ({"source": "shelly"}, "needs wall_power.host"),
    ({"source": "ptdaemon", "host": "h"}, "needs wall_power.port"),
])
def test_bad_sections_name_the_fix(section, message):
    with pytest.raises(WallMeterError, match=message):
        make_wall_sampler(section)


# ---------------------------------------------------------------------------------------------
# Wall energy per window (pure)


def _constant(watts: float, t0: float, t1: float, dt: float, counter_start_j: float, resolution_j: float):
    out, t = [], t0
    while t <= t1 + 1e-9:
        energy = counter_start_j + watts * (t - t0)
        out.append({"t": t, "power_w": watts, "energy_j": round(energy / resolution_j) * resolution_j})
        t += dt
    return out


def test_integrated_power_when_the_counter_is_too_coarse():
    samples = _constant(15.0, 100.0, 110.0, 0.1, 5000.0, 3600.0)  # Tasmota: 1 Wh steps
    w = [PhaseWindow("decode", 101.0, 107.0, tokens=600)]
    m, tags = wall_energy_metrics(samples, w, EnergySettings(), counter_resolution_j=3600.0)
    assert m["decode_wall_energy_j"] == pytest.approx(90.0) and m["decode_wall_avg_power_w"] == pytest.approx(15.0)
    assert m["decode_wall_tokens_per_joule"] == pytest.approx(600 / 90.0)
    assert m["decode_wall_energy_coverage"] == pytest.approx(1.0)
    assert tags["wall.decode.energy_method"].startswith("integrated power")
    assert tags["wall.energy.status"] == "ok"


def test_counter_energy_when_its_resolution_suits_the_window():
    samples = _constant(2000.0, 100.0, 110.0, 0.1, 1e6, 3.6)  # Shelly: 1 mWh steps, 12 kJ window
    m, tags = wall_energy_metrics(samples, [PhaseWindow("decode", 101.0, 107.0, tokens=60)], EnergySettings(), 3.6)
    assert tags["wall.decode.energy_method"].startswith("counter")
    assert m["decode_wall_energy_j"] == m["decode_wall_energy_counter_j"]
    assert m["decode_wall_energy_j"] == pytest.approx(12000.0, abs=2 * 3.6)


def test_a_window_the_meter_does_not_cover_has_no_wall_energy():
    samples = _constant(15.0, 100.0, 104.0, 0.1, 0.0, 3.6)
    m, tags = wall_energy_metrics(samples, [PhaseWindow("decode", 101.0, 107.0, tokens=60)], EnergySettings(), 3.6)
    assert "decode_wall_energy_j" not in m and "not fully inside" in tags["wall.decode.status"]
    assert tags["wall.energy.status"].startswith("decode:")
    assert wall_energy_metrics([], [], EnergySettings())[1] == {
        "wall.energy.status": "not measured: the wall meter gave no power samples"}


def test_board_coverage_is_reported_next_to_the_wall_coverage():
    samples = [{"t": 100 + 0.1 * i, "power_w": 5.0} for i in range(40)] + \
              [{"t": 106 + 0.1 * i, "power_w": 5.0} for i in range(40)]  # a 2 s gap inside the window
    cov = board_coverage_metrics(samples, [PhaseWindow("decode", 101.0, 109.0)], EnergySettings())
    assert cov["decode_energy_coverage"] == pytest.approx(6.0 / 8.0, abs=0.02)


# ---------------------------------------------------------------------------------------------
# End to end: a local run with a Shelly at the wall


FAKE = Path(__file__).parent / "fixtures" / "fake_tegrastats"
BOARD_W = 12.479  # the fake tegrastats' input power (tests/test_e2e_telemetry.py)


def _run_local(tmp_path: Path, extra: list[str]):
    from mlflow.tracking import MlflowClient

    from .conftest import jbench_cli

    conf = tmp_path / "conf"
    (conf / "device").mkdir(parents=True)
    (conf / "device" / "bench_orin.yaml").write_text(
        "defaults:\n  - device_schema\n  - _self_\nname: bench_orin\nkind: local\nprofile: orin_nano_8gb\n"
        # its lease in this test process's state directory (tests/conftest.py), as conf/device/local.yaml does
        "paths:\n  state_dir: ${oc.env:JBENCH_STATE_DIR,'~/.cache/jbench'}\n")
    env = {"PATH": f"{FAKE}:{os.environ['PATH']}", "JBENCH_RESULTS_DIR": str(tmp_path / "r")}
    res = jbench_cli(["run", "--config-dir", str(conf), "device=bench_orin", "telemetry.source=tegrastats",
                      "telemetry.interval_ms=50", "telemetry.idle_s=1", "telemetry.cooldown_s=0.5",
                      "energy.min_window_s=2.0", "backend.n_prompt=16", "backend.n_gen=4", "backend.repetitions=1",
                      # A cold one-repetition speed pass against a warm energy pass differ by far more than the
                      # speed-match tolerance; these tests are about wall energy, so the tolerance is opened.
                      "energy.speed_tolerance=10", "model.quant=Q4_0", "device.lease_wait_s=600", *extra],
                     env_extra=env)
    assert res.returncode == 0, res.stdout + res.stderr
    client = MlflowClient(f"sqlite:///{tmp_path}/r/mlflow.db")
    exp = client.get_experiment_by_name("adhoc")
    runs = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("jbench.kind") == "trial"]
    assert len(runs) == 1
    return res, client, runs[0]


@pytest.mark.e2e
def test_local_run_reports_wall_energy_next_to_the_board(tmp_path, bundled_model):
    with ShellyServer(watts=17.5) as meter:
        res, client, run = _run_local(tmp_path, ["wall_power.source=shelly", "wall_power.host=127.0.0.1",
                                                  f"wall_power.port={meter.port}", "wall_power.interval_ms=50"])
    m, tags = run.data.metrics, run.data.tags
    assert tags["wall.source"] == "shelly" and tags["wall.status"] == "ok", tags.get("wall.status")
    assert tags["wall.meter"].startswith("shelly SNPL-00112EU")
    # The local device is the controller: the measured offset is zero within its uncertainty.
    assert abs(float(tags["wall.clock_offset_s"])) <= float(tags["wall.clock_offset_uncertainty_s"]) + 1e-6
    assert "wall.clock_offset_after_s" in tags
    for phase in ("prefill", "decode"):
        assert m[f"{phase}_energy_j"] == pytest.approx(BOARD_W * m[f"{phase}_window_s"], rel=1e-9)
        assert m[f"{phase}_wall_energy_j"] == pytest.approx(17.5 * m[f"{phase}_window_s"], rel=1e-9)
        assert m[f"{phase}_wall_energy_coverage"] >= 0.9 and m[f"{phase}_energy_coverage"] >= 0.9
        assert tags[f"wall.{phase}.energy_method"].startswith("integrated power")  # 3.6 J steps: too coarse
    assert m["decode_wall_tokens_per_joule"] == pytest.approx(
        m["decode_tokens_per_joule"] * BOARD_W / 17.5, rel=1e-9)
    assert m.get("idle_wall_power_w") == pytest.approx(17.5), tags.get("wall.idle.status")
    assert {a.path for a in client.list_artifacts(run.info.run_id, "telemetry")} >= {"telemetry/wall_samples.csv"}
    # The sweep's summary table shows the wall figure beside the board's.
    parent = client.get_run(run.data.tags["mlflow.parentRunId"])
    table = json.loads(Path(client.download_artifacts(parent.info.run_id, "summary.json", str(tmp_path / "dl"))).read_text())
    row = dict(zip(table["columns"], table["data"][0]))
    assert row["decode_wall_tokens_per_joule"] == pytest.approx(m["decode_wall_tokens_per_joule"], abs=1e-3)
    assert row["decode_tokens_per_joule"] == pytest.approx(m["decode_tokens_per_joule"], abs=1e-3)


@pytest.mark.e2e
def test_unreachable_meter_leaves_the_trial_running_without_wall_metrics(tmp_path, bundled_model):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        res, _, run = _run_local(tmp_path, ["wall_power.source=tasmota", "wall_power.host=127.0.0.1",
                                            f"wall_power.port={port}", "wall_power.timeout_s=1"])
    m, tags = run.data.metrics, run.data.tags
    assert tags["wall.status"].startswith("not measured: cannot reach 127.0.0.1:")
    # No wall figure at all (trial_wall_s is the trial's duration, not the meter's).
    assert not [k for k in m if re.search(r"_wall_(energy|avg_power|power|window|tokens|joules)", k)]
    assert m["decode_energy_j"] > 0  # the board's energy is unaffected
    out = res.stdout + res.stderr
    assert out.count("wall power (tasmota): cannot reach 127.0.0.1") == 1 and "Traceback" not in out
