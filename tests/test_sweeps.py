"""Sweeps worth trusting: the experiment library plans for every profile, grid rules, ordering,
rounds, memory fit, resume, OOM skip and the thermal gate."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from jbench.config import available_choices
from jbench.core.schema import ThermalConfig
from jbench.device.thermal import thermal_gate
from jbench.sweeps.plan import plan
from jbench.sweeps.sweep import _oom_key, skipped as _skipped
from jbench.core.trial import Trial

from .conftest import jbench_cli

PROFILES = available_choices("profile")
EXPERIMENTS = available_choices("experiment")


def _devices_dir(tmp_path: Path, ram_gb: float | None = None) -> Path:
    conf = tmp_path / "conf"
    (conf / "device").mkdir(parents=True)
    for profile in PROFILES:
        (conf / "device" / f"dev_{profile}.yaml").write_text(yaml.safe_dump({
            "defaults": ["device_schema", "_self_"], "name": f"dev_{profile}", "kind": "ssh",
            "host": "127.0.0.1", "profile": profile}))
    if ram_gb is not None:
        (conf / "profile").mkdir()
        (conf / "profile" / "tiny_board.yaml").write_text(yaml.safe_dump({
            "defaults": ["profile_schema", "_self_"], "name": "tiny_board", "module": "Tiny", "soc": "t0",
            "gpu_arch": "none", "memory_bandwidth_gbs": 10, "ram_gb": ram_gb}))
        (conf / "device" / "tiny.yaml").write_text(yaml.safe_dump({
            "defaults": ["device_schema", "_self_"], "name": "tiny", "kind": "ssh", "host": "127.0.0.1",
            "profile": "tiny_board"}))
    return conf


# Experiments whose grid comes from the device itself (`@device.power_modes`: its own /etc/nvpmodel.conf, read when
# the sweep is planned): planned on emulated Jetsons (test_power_modes_grid_comes_from_the_devices_own_modes), refused
# without a Jetson (test_power_modes_needs_a_jetson); every other experiment plans for every profile below.
DEVICE_GRID_EXPERIMENTS = ["power_modes"]


def test_the_experiments_planned_on_a_device_are_exactly_those_whose_grid_reads_it():
    from importlib.resources import files

    reads_device = sorted(e for e in EXPERIMENTS
                          if "@device." in files("jbench.conf").joinpath("experiment", f"{e}.yaml").read_text())
    assert reads_device == DEVICE_GRID_EXPERIMENTS


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("experiment", [e for e in EXPERIMENTS if e not in DEVICE_GRID_EXPERIMENTS])
def test_every_experiment_plans_for_every_profile(experiment, tmp_path, bundled_model):
    conf = _devices_dir(tmp_path)
    for profile in PROFILES:
        p = plan([f"+experiment={experiment}", f"device=dev_{profile}"], [conf])
        assert p.trials, (experiment, profile)
        assert p.problems == [], (experiment, profile, p.problems)
        assert all(t.config["profile"]["name"] == profile for t in p.trials)


def test_power_modes_needs_a_jetson():
    from jbench.config import ConfigError

    with pytest.raises(ConfigError, match="@device.power_modes needs a Jetson device"):
        plan(["+experiment=power_modes"])


@pytest.mark.ssh
@pytest.mark.e2e
@pytest.mark.parametrize("module, modes", [
    ("agx_orin", ["MAXN", "MODE_15W", "MODE_30W", "MODE_50W"]),  # JetPack 5 names, from its own nvpmodel.conf
    ("orin_nano_super", ["15W", "25W", "MAXN_SUPER", "7W"]),
])
def test_power_modes_grid_comes_from_the_devices_own_modes(emulated_jetson_factory, module, modes, tmp_path,
                                                           bundled_model):
    from .test_ssh_devices import write_conf

    emu = emulated_jetson_factory(module)
    conf = write_conf(tmp_path, emu, profile="agx_orin_64gb" if module == "agx_orin" else "orin_nano_super")
    p = plan(["+experiment=power_modes", "device=emu", "model.quant=Q4_0,Q8_0"], [conf])
    assert p.problems == []
    assert list(dict.fromkeys(t.config["power"]["mode"] for t in p.trials)) == modes
    # modes x clocks off/on x 2 quants, grouped so each power state is applied once, then by model.
    assert len(p.trials) == len(modes) * 4
    states = [(t.config["power"]["mode"], t.config["power"]["jetson_clocks"]) for t in p.trials]
    switches = sum(1 for a, b in zip(states, states[1:]) if a != b)
    assert switches == 2 * len(modes) - 1
    assert [t.config["model"]["quant"] for t in p.trials[:2]] == ["Q4_0", "Q8_0"]


def test_linked_dimensions_and_exclusions(tmp_path):
    p = plan(["+experiment=kv_precision"])
    pairs = {(t.config["backend"]["cache_type_k"], t.config["backend"]["cache_type_v"]) for t in p.trials}
    assert pairs == {("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0")} and len(p.trials) == 6
    exp = tmp_path / "conf" / "experiment"
    exp.mkdir(parents=True)
    (exp / "ex.yaml").write_text("# @package _global_\nexperiment:\n  name: ex\nsweep:\n  grid:\n"
                                 "    backend.n_gen: [4, 8]\n    backend.depth: [0, 64]\n"
                                 "  exclude:\n    - {backend.n_gen: 8, backend.depth: 64}\n")
    p = plan(["+experiment=ex"], [tmp_path / "conf"])
    assert len(p.trials) == 3 and any("sweep.exclude backend.n_gen=8, backend.depth=64" in n for n in p.notes)
    (exp / "all.yaml").write_text("# @package _global_\nexperiment:\n  name: all\nsweep:\n  grid:\n"
                                  "    backend.n_gen: [4]\n  exclude:\n    - {backend.n_gen: [4]}\n")
    p = plan(["+experiment=all"], [tmp_path / "conf"])
    assert p.trials == [] and "the grid is empty after dropping" in p.problems[-1]


@pytest.mark.e2e
def test_context_sweep_drops_beyond_the_models_context(bundled_model):
    p = plan(["+experiment=context_sweep", "backend.depth=0,4096,32768"])
    assert [t.config["backend"]["depth"] for t in p.trials] == [0, 4096]
    assert any("drop_beyond_context" in n and "32768" in n for n in p.notes)


@pytest.mark.e2e
def test_memory_fit_is_checked_against_the_profile(tmp_path, bundled_model):
    conf = _devices_dir(tmp_path, ram_gb=0.5)
    p = plan(["device=tiny", "model.quant=F16", "sweep.memory_reserve_gb=0.2"], [conf])
    assert any("more than Tiny (0.5 GB) allows" in m for m in p.problems), p.problems


def test_rounds_split_repetitions_and_keep_the_hash():
    p = plan(["+experiment=nightly"])
    assert len(p.trials) == 12 and p.rounds == 2
    first, second = p.trials[:6], p.trials[6:]
    assert [t.config_hash for t in first] == [t.config_hash for t in second]
    assert all(t.config["backend"]["repetitions"] == 5 for t in p.trials)
    assert {t.round for t in second} == {2} and {t.rounds for t in p.trials} == {2}
    assert len({t.resume_key for t in p.trials}) == 12  # round 1 and round 2 of a trial are resumed apart


def test_planning_is_linear_and_hash_stable():
    p1 = plan(["backend.n_gen=range(1,41)", "backend.depth=range(0,25)"])
    p2 = plan(["backend.depth=range(0,25)", "backend.n_gen=range(1,41)"])
    assert len(p1.trials) == 1000
    assert {t.config_hash for t in p1.trials} == {t.config_hash for t in p2.trials}


def _trial(depth, quant="Q4_0"):
    cfg = {"device": {"name": "d"}, "model": {"name": "m", "quant": quant},
           "backend": {"name": "llamacpp", "depth": depth, "n_prompt": 16, "n_gen": 4, "cache_type_k": "f16",
                       "cache_type_v": "f16"}}
    return Trial(1, cfg, {}, {}, "h")


def test_oom_skips_larger_contexts_of_the_same_model_and_kv_type():
    failed = _trial(2048)
    oom = [(_oom_key(failed), failed.context_tokens, "run123")]
    skipped = _skipped(_trial(4096), "k", {}, oom)
    assert skipped.category == "oom_skip" and "ran out of memory at context 2068" in skipped.error
    assert _skipped(_trial(1024), "k", {}, oom) is None
    assert _skipped(_trial(4096, quant="Q8_0"), "k", {}, oom) is None
    resumed = _skipped(_trial(1024), "k", {"k": {"run_id": "r1"}}, oom)
    assert resumed.status == "SKIPPED" and resumed.category == "resumed" and resumed.run_id == "r1"


def test_thermal_gate_waits_bounded_and_skips_without_sensors():
    log = logging.getLogger("test")
    temps = iter([72.0, 66.0, 58.0])
    clock = iter(range(0, 1000, 5))
    tags = thermal_gate(None, ThermalConfig(start_below_c=60, timeout_s=100, poll_s=5), log,
                        read=lambda c: next(temps), sleep=lambda s: None, clock=lambda: next(clock))
    assert tags["thermal.gate"].startswith("waited") and tags["thermal.start_temp_c"] == "58.0"
    hot = thermal_gate(None, ThermalConfig(start_below_c=60, timeout_s=10, poll_s=5), log,
                       read=lambda c: 80.0, sleep=lambda s: None, clock=iter(range(0, 1000, 5)).__next__)
    assert hot["thermal.gate"] == "timeout" and hot["thermal.start_temp_c"] == "80.0"
    assert thermal_gate(None, ThermalConfig(start_below_c=60), log, read=lambda c: None) == {
        "thermal.gate": "no temperature sensors: not gated"}


def test_the_thermal_gate_reads_a_gpu_hosts_own_gpu_temperature():
    from types import SimpleNamespace

    from jbench.device.thermal import hottest_c, parse_temperatures

    # A GPU host in a container: no thermal zone, NVML's temperature through nvidia-smi (degrees C, one line a GPU).
    assert parse_temperatures("gpu 34\ngpu 41\n") == {"gpu": [34.0, 41.0]}
    # A Jetson: zones in milli-degrees, an offline zone (-256 C) ignored, a GPU without a sensor ("[N/A]") ignored.
    both = "zone 45500\nzone -256000\nzone 51000\ngpu [N/A]\n"
    assert parse_temperatures(both) == {"zone": [45.5, 51.0]}

    class Conn:
        def __init__(self, out: str):
            self.out, self.argv = out, None

        def run(self, argv, timeout):
            self.argv = argv
            return SimpleNamespace(stdout=self.out, returncode=0)

    conn = Conn("zone 38000\ngpu 63\n")
    assert hottest_c(conn) == 63.0 and conn.argv[:2] == ["sh", "-c"]  # a constant script, no user input
    assert hottest_c(Conn("")) is None
    log = logging.getLogger("test")
    tags = thermal_gate(Conn("gpu 41\n"), ThermalConfig(start_below_c=60), log)
    assert tags == {"thermal.start_temp_c": "41.0", "thermal.gate": "cool"}


@pytest.mark.e2e
def test_resume_runs_only_what_is_not_finished(tmp_path, bundled_model):
    env = {"JBENCH_RESULTS_DIR": str(tmp_path)}
    small = ["backend.n_prompt=8", "backend.repetitions=1", "telemetry.source=none"]
    first = jbench_cli(["sweep", "backend.n_gen=2,3", *small], env_extra=env)
    assert first.returncode == 0, first.stderr
    again = jbench_cli(["sweep", "backend.n_gen=2,3,4", *small], env_extra=env)
    assert again.returncode == 0, again.stderr
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("adhoc").experiment_id])
    trials = [r for r in runs if r.data.tags.get("jbench.kind") == "trial"]
    assert sorted(r.data.params["backend.n_gen"] for r in trials) == ["2", "3", "4"]  # only the new cell ran
    assert again.stdout.count("FINISHED earlier (run ") == 2
    plan_only = jbench_cli(["sweep", "backend.n_gen=2,3,4,5", "--dry-run", *small], env_extra=env)
    assert "3 already FINISHED" in plan_only.stdout, plan_only.stdout
    assert "none of the 1 trial(s) to run has an earlier run" in plan_only.stdout, plan_only.stdout
    rerun = jbench_cli(["sweep", "backend.n_gen=2", "sweep.rerun=true", *small], env_extra=env)
    assert rerun.returncode == 0, rerun.stderr
    # The trial really ran again (a skipped one's note says "already FINISHED" too): a second FINISHED run of it.
    assert "EARLIER" not in rerun.stdout and "already FINISHED" not in rerun.stdout
    runs = client.search_runs([client.get_experiment_by_name("adhoc").experiment_id])
    n_gen_2 = [r for r in runs if r.data.tags.get("jbench.kind") == "trial" and r.data.params["backend.n_gen"] == "2"]
    assert [r.info.status for r in n_gen_2] == ["FINISHED", "FINISHED"]
    assert len({r.data.tags["jbench.sweep_id"] for r in n_gen_2}) == 2  # the first sweep's and the rerun's


# How the fixture's llama-bench runs out of memory: llama.cpp's own allocation error, or the kernel's OOM killer
# (SIGKILL, exit 137 seconds into a 600 s limit: over SSH that was once reported as a timeout).
OOM_BY = {
    "allocation_error": 'echo "ggml_backend_cpu_buffer_type_alloc_buffer: failed to allocate buffer of size 4294967296" >&2; exit 1',
    "oom_killer": 'echo "llama_model_load: loading" >&2; kill -KILL $$',
}


@pytest.mark.e2e
def test_dry_run_promises_a_skip_only_for_the_same_build(tmp_path, llama_build, bundled_model):
    """Resume matches a trial's identity (configuration + backend build + model file); so does --dry-run's promise.
    After a rebuild (another commit) the same configuration is not "already FINISHED"."""
    env = {"JBENCH_RESULTS_DIR": str(tmp_path / "r")}
    small = ["backend.n_prompt=8", "backend.n_gen=2", "backend.repetitions=1", "telemetry.source=none"]
    assert jbench_cli(["run", *small], env_extra=env).returncode == 0
    same = jbench_cli(["run", *small, "--dry-run"], env_extra=env)
    assert "1 already FINISHED with the same build" in same.stdout, same.stdout
    rebuilt = tmp_path / "rebuilt"  # the same binary reporting another commit, as a rebuild would
    rebuilt.mkdir()
    (rebuilt / "llama-bench").write_text(
        "#!/bin/sh\n# Test fixture: the cached llama-bench under another build commit.\n"
        'if [ "$1" = "--version" ]; then echo "version: 9999 (deadbee)"; exit 0; fi\n'
        f'exec {llama_build["bin_dir"]}/llama-bench "$@"\n')
    (rebuilt / "llama-bench").chmod(0o755)
    other = jbench_cli(["run", *small, f"backend.binary_dir={rebuilt}", "--dry-run"], env_extra=env)
    assert other.returncode == 0 and "already FINISHED" not in other.stdout, other.stdout
    ran = jbench_cli(["run", *small, f"backend.binary_dir={rebuilt}"], env_extra=env)
    assert ran.returncode == 0 and "EARLIER" not in ran.stdout, ran.stdout  # the promise held: it ran


@pytest.mark.e2e
@pytest.mark.ssh
@pytest.mark.parametrize("oom_by", sorted(OOM_BY))
def test_oom_failure_skips_larger_contexts_on_an_emulated_device(orin_nano, tmp_path, llama_build, bundled_model, oom_by):
    fake = tmp_path / "bin"
    fake.mkdir()
    script = fake / "llama-bench"
    script.write_text(
        "#!/bin/sh\n# Test fixture: runs out of memory at depth >= 2048, else the real llama-bench.\n"
        'depth=0; prev=""; for a in "$@"; do [ "$prev" = "-d" ] && depth=$a; prev=$a; done\n'
        f'if [ "$depth" -ge 2048 ]; then {OOM_BY[oom_by]}; fi\n'
        f'exec {llama_build["bin_dir"]}/llama-bench "$@"\n')
    script.chmod(0o755)
    cfg = orin_nano.device_config(name="emu")
    conf = tmp_path / "conf" / "device"
    conf.mkdir(parents=True)
    (conf / "emu.yaml").write_text(yaml.safe_dump({"defaults": ["device_schema", "_self_"], **cfg}))
    res = jbench_cli(["sweep", "--config-dir", str(tmp_path / "conf"), "device=emu", f"backend.binary_dir={fake}",
                      "backend.depth=0,2048,4096", "backend.n_prompt=8", "backend.n_gen=2", "backend.repetitions=1",
                      "model.quant=Q4_0", "telemetry.source=none", "thermal.start_below_c=null"],
                     env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "r")})
    assert res.returncode == 4, res.stdout + res.stderr
    client = MlflowClient(f"sqlite:///{tmp_path}/r/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("adhoc").experiment_id])
    trials = {r.data.params["backend.depth"]: r for r in runs if r.data.tags.get("jbench.kind") == "trial"}
    assert trials["0"].info.status == "FINISHED"
    assert trials["2048"].data.tags["jbench.failure_category"] == "out_of_memory"
    assert "4096" not in trials  # skipped, not run
    assert "SKIPPED" in res.stdout and "ran out of memory at context" in res.stdout
