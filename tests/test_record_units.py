"""The record's pure parts, without a device or a store: run names, a trial's params, the renamed model hash
key keeping every recorded identity, and model overrides refused at planning."""

from __future__ import annotations

import pytest

from jbench.core.identity import config_hash, identity_items_from_flat, identity_params, _config_digest
from jbench.sweeps.plan import plan
from jbench.core.trial import short_label

from .gguf_files import unloadable_gguf


@pytest.mark.parametrize("point, name", [
    ({"model.quant": "Q4_0"}, "Q4_0"),
    ({"backend.depth": 4096, "model.quant": "Q4_K_M", "power.jetson_clocks": True, "power.mode": "MAXN_SUPER"},
     "MAXN_SUPER clocks=on Q4_K_M d4096"),
    ({"backend.cache_type_k": "q8_0", "backend.cache_type_v": "q8_0", "backend.depth": 0}, "kv=q8_0 d0"),
    ({"backend.cache_type_k": "q8_0", "backend.cache_type_v": "f16"}, "k=q8_0 v=f16"),
    ({"backend.n_gen": 128, "model": "gemma3_270m"}, "gemma3_270m n_gen=128"),
    ({"backend.flash_attn": "on", "backend.n_gpu_layers": 0}, "fa=on ngl=0"),
    ({}, ""),
])
def test_a_run_is_named_by_its_varying_dimensions(point, name):
    assert short_label(point) == name


def test_a_trial_without_varying_dimension_is_named_by_model_and_quant():
    (trial,) = plan(["model.quant=Q4_0"], use_grid=False).trials
    assert trial.short_label == "gemma3_270m Q4_0"
    rounds = plan(["model.quant=Q4_0,Q8_0", "sweep.rounds=2"]).trials
    assert [t.short_label for t in rounds] == ["Q4_0 r1/2", "Q8_0 r1/2", "Q4_0 r2/2", "Q8_0 r2/2"]


def test_params_are_the_inputs_that_apply_and_have_a_value():
    (bench,) = plan(["model.quant=Q4_0"], use_grid=False).trials
    params = identity_params(bench.config)
    assert params["model.quant"] == "Q4_0" and params["device.name"] == "local"
    assert "null" not in params.values()
    assert not [k for k in params if "latency" in k]
    assert not [k for k in params if k.startswith(("tracking.", "telemetry.", "sweep.", "experiment."))]
    assert "backend.binary_dir" not in params and "model.sha256" not in params
    assert params["model.source_sha256"] == bench.config["model"]["source_sha256"]
    (latency,) = plan(["backend.scenario=latency"], use_grid=False).trials
    assert {"backend.latency_requests", "backend.latency_concurrency"} <= set(identity_params(latency.config))


def test_a_remote_devices_connection_details_are_no_params():
    config = plan(["model.quant=Q4_0"], use_grid=False).trials[0].config
    config = {**config, "device": {**config["device"], "name": "orin", "kind": "ssh", "host": "10.0.0.7",
                                   "user": "nvidia", "key": "~/.ssh/id_ed25519"}}
    params = identity_params(config)
    assert params["device.name"] == "orin"
    assert not [k for k in params if k.startswith("device.") and k != "device.name"]


def test_the_renamed_source_hash_keeps_every_recorded_identity():
    # Pinned: the config hash of this trial as jbench computed it before model.sha256 was renamed
    # model.source_sha256, so runs recorded then still resume and compare.
    (trial,) = plan(["+experiment=quant_ladder", "model.quant=Q4_0"]).trials
    assert config_hash(trial.config) == trial.config_hash == "b97017ee59e0dc39"
    # A run recorded with the old key (its params) hashes the same as today's config.
    old_params = {("model.sha256" if k == "model.source_sha256" else k): v
                  for k, v in identity_params(trial.config).items()}
    assert _config_digest(identity_items_from_flat(old_params)) == trial.config_hash


@pytest.mark.parametrize("overrides, message", [
    (["+model.files.Q4_0=/tmp/elsewhere.gguf"], "model.files does not apply to the bundled model 'gemma3_270m'"),
    (["model.source=files", "model.name=mine", "+model.files.Q4_K_M=/nonexistent/mine.gguf"],
     "model file /nonexistent/mine.gguf not found (model 'mine' Q4_K_M)"),
])
def test_a_model_override_that_cannot_take_effect_is_a_plan_problem(overrides, message):
    problems = plan(overrides, use_grid=False).problems
    assert any(message in p for p in problems), problems


def test_a_users_existing_file_is_no_problem(tmp_path):
    own = unloadable_gguf(tmp_path / "mine-Q4_0.gguf")  # whole: planning reads a GGUF file's header and size
    problems = plan(["model.source=files", "model.name=mine", "model.quant=Q4_0", f"+model.files.Q4_0={own}"],
                    use_grid=False).problems
    assert not [p for p in problems if "mine" in p], problems
