"""The sysfs telemetry source on an emulated Jetson whose files sit at their real paths (INA3221 hwmon,
soctherm_oc counters, thermal zones, GPU devfreq): a real sweep over SSH records which rails make the
input power, the sensor's own settings, and the over-current events of each phase."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import jbench_cli
from .test_ssh_devices import _trials, write_conf


@pytest.mark.ssh
@pytest.mark.e2e
def test_sysfs_source_records_rails_sensor_settings_and_oc_events(emulated_jetson_factory, tmp_path, llama_build,
                                                                  bundled_model):
    emu = emulated_jetson_factory("orin_nano_super", real_paths=True)
    conf = write_conf(tmp_path, emu)
    res = jbench_cli(["sweep", "--config-dir", str(conf), "device=emu", "model.quant=Q4_0",
                      f"backend.binary_dir={llama_build['bin_dir']}", "backend.n_prompt=32", "backend.n_gen=16",
                      "backend.repetitions=2", "power.mode=MAXN_SUPER,25W", "telemetry.source=sysfs",
                      "telemetry.idle_s=0.5", "telemetry.cooldown_s=0", "energy.min_window_s=1",
                      "energy.speed_tolerance=10", "thermal.start_below_c=null"],
                     env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "r")})
    assert res.returncode == 0, res.stdout + res.stderr
    client, trials = _trials(f"sqlite:///{tmp_path}/r/mlflow.db", "adhoc")
    by_mode = {t.data.params["power.mode"]: t for t in trials}
    assert set(by_mode) == {"MAXN_SUPER", "25W"}
    for mode, t in by_mode.items():
        tags, m = t.data.tags, t.data.metrics
        assert tags["telemetry.source"] == "sysfs"
        # Orin Nano: the input rail alone; VDD_CPU_GPU_CV feeds CPU, GPU and CV, so it is one figure, not two.
        assert tags["telemetry.power_rails"] == "VDD_IN" and tags["telemetry.power_rule"] == "board input VDD_IN"
        assert tags["telemetry.sensor_update_interval_ms"] and tags["telemetry.sensor_averaging"]
        assert m["decode_energy_j"] > 0 and m["decode_cpu_gpu_cv_energy_j"] > 0
        assert "decode_gpu_energy_j" not in m and "decode_cpu_energy_j" not in m
        assert "decode_oc3_events" in m and "decode_temp_max_c" in m
        codes = []
        if "findings.json" in {a.path for a in client.list_artifacts(t.info.run_id)}:  # only written when any
            path = client.download_artifacts(t.info.run_id, "findings.json", str(tmp_path / mode))
            codes = [f["code"] for f in json.loads(Path(path).read_text())]
        if mode == "MAXN_SUPER":
            # Under load in MAXN_SUPER the emulated soctherm counts over-current events, as users report.
            assert m["decode_oc3_events"] > 0 and "throttling" in codes, sorted((k, v) for k, v in m.items() if "oc" in k or "window" in k or "temp" in k)
        else:
            assert m["decode_oc3_events"] == 0 and "throttling" not in codes


@pytest.mark.ssh
@pytest.mark.parametrize("module, rails, rule", [
    ("thor", "VIN", "board input VIN (INA238)"),
    ("agx_orin", "VDD_GPU_SOC+VDD_CPU_CV+VIN_SYS_5V0+VDDQ_VDD2_1V8AO",
     "module rails sum (AGX Orin): VDD_GPU_SOC+VDD_CPU_CV+VIN_SYS_5V0+VDDQ_VDD2_1V8AO"),
])
def test_sysfs_source_picks_the_rule_of_each_module_from_its_real_files(emulated_jetson_factory, module, rails, rule):
    from jbench.device.connect import connect
    from jbench.device.telemetry.hwmon import SysfsSampler

    from .test_ssh_devices import device_cfg

    emu = emulated_jetson_factory(module, real_paths=True)
    with connect(device_cfg(emu)) as conn:
        sampler = SysfsSampler(conn, 10).start()
        try:
            assert sampler.wait_for_samples(20, timeout_s=30), sampler.problem
        finally:
            samples = sampler.stop()
        tags = sampler.telemetry_tags()
    assert tags["telemetry.power_rails"] == rails and tags["telemetry.power_rule"] == rule
    assert all(s["power_w"] > 0 for s in samples)
    # Thor's VIN is the carrier's INA238, beside the module's INA3221 rails; AGX Orin's NC channels are no rails.
    assert not any(k.startswith("rail_NC") for s in samples for k in s)
    if module == "thor":
        assert all(s["power_w"] > s["rail_VDD_GPU_w"] for s in samples)
