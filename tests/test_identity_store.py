"""Stores written under an earlier trial-identity scheme still resume (tests/data/stores/v1)."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest

from jbench.core.identity import config_hash, trial_identity
from jbench.sweeps.plan import plan
from jbench.tracking.reader import finished_trials, runs_frame, with_current_hashes

from .conftest import jbench_cli

V1 = Path(__file__).parent / "data" / "stores" / "v1"
# Version-1 runs were recorded before quality existed: a sweep that wants quality runs them again (tests/test_quality.py);
# the resume of their identity is what this module checks, so quality is off.
SWEEP = ["+experiment=quant_ladder", "model.quant=Q4_0,Q8_0", "backend.n_prompt=16", "backend.n_gen=8",
         "backend.repetitions=1", "telemetry.source=none", "quality.enabled=false"]
# What the version-1 runs recorded (README.md there).
BUILD = "0c1e57098"
SHA = {"Q4_0": "8b90dc09855b7fc6fe7d3bec8afbe0e27541fa3ed72eb0b3b2ea0e56f3b47d88",
       "Q8_0": "d3d21138dcca83884e329b4cd6939b905c15e06022a930ce13d6db4d9e67290a"}
V1_HASHES = {"Q4_0": "7d6d063dfdce418a", "Q8_0": "34dcfe7915a5b018"}


@pytest.fixture
def v1_store(tmp_path) -> str:
    shutil.copy(V1 / "mlflow.db", tmp_path / "mlflow.db")  # MLflow may write to it: never the original
    return str(tmp_path)


def _trials(*extra: str) -> dict[str, dict]:
    return {t.config["model"]["quant"]: copy.deepcopy(t.config) for t in plan([*SWEEP, *extra]).trials}


def test_v1_trials_are_finished_for_the_new_code(v1_store):
    uri = f"sqlite:///{v1_store}/mlflow.db"
    by_config = finished_trials(uri, "quant_ladder")
    by_identity = finished_trials(uri, "quant_ladder", key="identity")
    assert len(by_config) == len(by_identity) == 2
    configs = _trials()
    for quant, cfg in configs.items():
        assert f"{config_hash(cfg)}:1" in by_config, quant
        ident = trial_identity(cfg, build=BUILD, model_digest=SHA[quant])
        assert f"{ident}:1" in by_identity, quant
        assert by_config[f"{config_hash(cfg)}:1"]["run_id"] == by_identity[f"{ident}:1"]["run_id"]
    # The planner's own resume key (Trial.config_hash) is the same config hash.
    assert {f"{t.config_hash}:1" for t in plan(SWEEP).trials} == set(by_config)


def test_a_changed_identity_does_not_match_a_v1_trial(v1_store):
    uri = f"sqlite:///{v1_store}/mlflow.db"
    by_config = finished_trials(uri, "quant_ladder")
    by_identity = finished_trials(uri, "quant_ladder", key="identity")
    q4 = _trials()["Q4_0"]
    longer = _trials("backend.n_gen=9")["Q4_0"]
    assert f"{config_hash(longer)}:1" not in by_config
    assert f"{trial_identity(longer, build=BUILD, model_digest=SHA['Q4_0'])}:1" not in by_identity
    other_quant = copy.deepcopy(q4)
    other_quant["model"]["quant"] = "Q5_K_M"
    assert f"{config_hash(other_quant)}:1" not in by_config
    # The same config with another build or another model file is not "already FINISHED".
    assert f"{trial_identity(q4, build='deadbee', model_digest=SHA['Q4_0'])}:1" not in by_identity
    assert f"{trial_identity(q4, build=BUILD, model_digest=SHA['Q8_0'])}:1" not in by_identity
    # Context changes (where the build and results live, time-outs, telemetry) still match.
    moved = _trials("backend.binary_dir=/opt/llama/bin", "backend.timeout_s=10", "telemetry.source=auto",
                    "tracking.results_dir=/elsewhere")["Q4_0"]
    assert f"{trial_identity(moved, build=BUILD, model_digest=SHA['Q4_0'])}:1" in by_identity


def test_current_hashes_keep_what_v1_runs_recorded(v1_store):
    df = with_current_hashes(runs_frame(f"sqlite:///{v1_store}/mlflow.db", ["quant_ladder"]))
    recorded = dict(zip(df["tags.model.quant"], df["tags.jbench.config_hash_recorded"]))
    assert recorded == V1_HASHES
    current = dict(zip(df["tags.model.quant"], df["tags.jbench.config_hash"]))
    assert current == {q: config_hash(c) for q, c in _trials().items()}
    assert df["tags.jbench.identity"].notna().all()


@pytest.mark.e2e
def test_sweep_resumes_a_v1_store(v1_store, llama_build, bundled_model):
    """The real command over a copy of the version-1 store: both trials are already FINISHED."""
    again = jbench_cli(["sweep", *SWEEP], env_extra={"JBENCH_RESULTS_DIR": v1_store})
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("FINISHED earlier (run ") == 2, again.stdout
    dry = jbench_cli(["sweep", *SWEEP[:3], "backend.n_gen=8,9", *SWEEP[4:], "--dry-run"],
                     env_extra={"JBENCH_RESULTS_DIR": v1_store})
    assert "2 already FINISHED" in dry.stdout, dry.stdout
    assert "none of the 2 trial(s) to run has an earlier run" in dry.stdout, dry.stdout
