"""`jbench advise` on real runs: two sweeps of the embedded default (the bundled model at two quants, each run twice, so
each configuration has a spread between its runs), then the advisor's answer, its exit codes, JSON and plot."""

from __future__ import annotations

import json

import pytest

from .conftest import jbench_cli

SWEEP = ["sweep", "model.quant=Q4_0,Q8_0", "backend.n_prompt=16", "backend.n_gen=16", "backend.repetitions=3",
         "backend.threads=1", "quality.enabled=false", "telemetry.idle_s=0.5", "telemetry.cooldown_s=0"]


@pytest.fixture(scope="module")
def store(tmp_path_factory, llama_build, bundled_model):
    results = tmp_path_factory.mktemp("advise")
    env = {"JBENCH_RESULTS_DIR": str(results)}
    for extra in ([], ["sweep.rerun=true"]):  # a second run of each configuration
        res = jbench_cli([*SWEEP, *extra], env_extra=env)
        assert res.returncode == 0, res.stdout + res.stderr
    return env


@pytest.mark.e2e
def test_the_answer_from_two_runs_per_configuration(store, tmp_path):
    plot = tmp_path / "front.png"
    res = jbench_cli(["advise", "--maximize", "decode_tps", "--require", "memory_peak_rss_mib<=4000",
                      "--pareto", "decode_tps,memory_peak_rss_mib", "--plot", str(plot)], env_extra=store)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "BEST: model.quant=" in res.stdout and plot.stat().st_size > 10_000
    res = jbench_cli(["advise", "--maximize", "decode_tps", "--require", "memory_peak_rss_mib<=4000", "-o", "json"],
                     env_extra=store)
    out = json.loads(res.stdout)
    assert out["outcome"] == "found" and len(out["candidates"]) == 2
    best = out["best"]
    assert best["runs"] == 2 and best["objective"]["basis"] == "runs" and best["objective"]["se"] > 0
    assert best["probabilities"]["memory_peak_rss_mib <= 4000"] > 0.9
    others = [c for c in out["candidates"] if c is not best and c["config_hash"] != best["config_hash"]]
    assert all(c["objective"]["mean"] <= best["objective"]["mean"] for c in others)
    # The same answer in the report, with its plot.
    goal = tmp_path / "goal.yaml"
    goal.write_text("maximize: decode_tps\nconstraints: ['memory_peak_rss_mib <= 4000']\n"
                    "pareto: [decode_tps, memory_peak_rss_mib]\n")
    res = jbench_cli(["report", "--goal", str(goal), "--out", str(tmp_path / "rep")], env_extra=store)
    assert res.returncode == 0, res.stdout + res.stderr
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "## Advice: the best configuration under constraints" in md and "BEST: model.quant=" in md
    assert (tmp_path / "rep" / "advice_pareto.png").stat().st_size > 10_000


@pytest.mark.e2e
def test_no_answer_and_bad_input_have_their_exit_codes(store):
    res = jbench_cli(["advise", "--maximize", "decode_tps", "--require", "decode_tps>=100000"], env_extra=store)
    assert res.returncode == 3 and "met by nothing" in res.stderr and "closest" in res.stderr
    res = jbench_cli(["advise", "--maximize", "decode_tp"], env_extra=store)
    assert res.returncode == 2 and "did you mean decode_tps" in res.stderr
    res = jbench_cli(["advise", "--goal", "fast_within_quality"], env_extra=store)  # no quality measured here
    assert res.returncode == 2 and "quality_kld_mean' is not recorded" in res.stderr
    res = jbench_cli(["advise", "--goal", "nope"], env_extra=store)
    assert res.returncode == 2 and "Shipped: edge_efficiency, fast_within_quality" in res.stderr
    res = jbench_cli(["advise", "--maximize", "decode_tps", "--require", "decode_tps=5"], env_extra=store)
    assert res.returncode == 2 and "write METRIC>=VALUE" in res.stderr
    res = jbench_cli(["advise", "nope_experiment", "--maximize", "decode_tps"], env_extra=store)
    assert res.returncode == 2


@pytest.mark.e2e
def test_a_search_sweep_measures_part_of_the_grid_and_ends_with_the_answer(tmp_path, llama_build, bundled_model):
    from mlflow.tracking import MlflowClient

    env = {"JBENCH_RESULTS_DIR": str(tmp_path / "r")}
    res = jbench_cli(["sweep", "model.quant=Q4_0,Q8_0,F16", "backend.threads=1,2", "backend.n_prompt=16",
                      "backend.n_gen=16", "backend.repetitions=3", "quality.enabled=false", "telemetry.idle_s=0.5",
                      "telemetry.cooldown_s=0", "--maximize", "decode_tps", "--require", "memory_peak_rss_mib<=450",
                      "--budget-trials", "3", "--seed", "1"], env_extra=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "search: " in res.stdout and "of 6 configuration(s) measured in 3 run(s); stopped: the trial budget" \
        in res.stdout
    assert "BEST: " in res.stdout or "NO VERDICT" in res.stderr
    c = MlflowClient(f"sqlite:///{tmp_path}/r/mlflow.db")
    exp = c.get_experiment_by_name("adhoc")
    trials = [r for r in c.search_runs([exp.experiment_id]) if r.data.tags.get("jbench.kind") == "trial"]
    assert len(trials) == 3 and {r.info.status for r in trials} == {"FINISHED"}
    parents = {r.data.tags["mlflow.parentRunId"] for r in trials}
    assert len(parents) == 1  # one sweep run, as for a full grid
    res = jbench_cli(["sweep", "model.quant=Q4_0,Q8_0", "--budget-trials", "3"], env_extra=env)
    assert res.returncode == 2 and "bound a search" in res.stderr
    # A metric the trials cannot record is refused before any device: it would leave every configuration undecided.
    res = jbench_cli(["sweep", "model.quant=Q4_0,Q8_0", "quality.enabled=false", "--maximize", "decode_tps",
                      "--require", "quality_kld_mean<=0.05"], env_extra=env)
    assert res.returncode == 2 and "add quality.enabled=true" in res.stderr
    res = jbench_cli(["sweep", "model.quant=Q4_0,Q8_0", "--maximize", "decode_tsp"], env_extra=env)
    assert res.returncode == 2 and "did you mean decode_tps" in res.stderr


@pytest.mark.ssh
@pytest.mark.e2e
def test_a_search_over_the_emulated_jetsons_power_modes(orin_nano_super_r39, tmp_path, llama_build, bundled_model):
    """`+experiment=power_modes --search` on the emulated Orin Nano Super (real sshd, nvpmodel, jetson_clocks and
    tegrastats as the device has them): the most decode tokens per joule among its power modes with a decode floor,
    two runs of the six cells, the device's power state restored; a floor above the profile's decode ceiling rules
    every cell out before anything runs."""
    from .test_ssh_devices import write_conf

    emu = orin_nano_super_r39
    before = emu.clock_state()
    conf = write_conf(tmp_path, emu)
    common = ["sweep", "--config-dir", str(conf), "+experiment=power_modes", "device=emu", "model.quant=Q4_0",
              f"backend.binary_dir={llama_build['bin_dir']}", "backend.n_prompt=16", "backend.n_gen=8",
              "backend.repetitions=2", "telemetry.source=tegrastats", "telemetry.interval_ms=50",
              "telemetry.idle_s=1", "telemetry.cooldown_s=0", "energy.min_window_s=1", "energy.speed_tolerance=10",
              "quality.enabled=false", "--maximize", "decode_tokens_per_joule", "--seed", "2"]
    env = {"JBENCH_RESULTS_DIR": str(tmp_path / "r")}
    res = jbench_cli([*common, "--require", "decode_tps>=1", "--budget-trials", "2"], env_extra=env)
    assert res.returncode in (0, 3), res.stdout + res.stderr
    assert "of 6 configuration(s) measured in 2 run(s)" in res.stdout
    assert ("BEST: " in res.stdout) == (res.returncode == 0)
    after = emu.clock_state()
    assert after["mode_name"] == before["mode_name"] and after["none_locked"], after
    res = jbench_cli([*common, "--require", "decode_tps>=5000"], env_extra=env)
    assert "ruled out before running" in res.stdout and "cannot reach 5000" in res.stdout, res.stdout + res.stderr
    assert "nothing to search: every cell was ruled out" in res.stdout and res.returncode == 3
