"""Sweep planning: grid expansion, command-line sweep dimensions, hashing, validation."""

from __future__ import annotations

import pytest

from jbench.config import ConfigError
from jbench.sweeps.plan import plan, split_overrides
from jbench.core.identity import config_hash


def _user_dir(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "other.yaml").write_text(
        "defaults:\n  - model_schema\n  - _self_\nname: other\nquant: Q8_0\n"
        "files:\n  Q8_0: /models/other-q8.gguf\n  Q4_0: /models/other-q4.gguf\n"
    )
    return tmp_path


def test_split_overrides_uses_hydra_parser():
    plain, dims = split_overrides(["+experiment=quant_ladder", "backend.n_gen=64,128", "model=a,b", "backend.depth=range(0,3)"])
    assert plain == ["+experiment=quant_ladder"]
    assert dims == {"backend.n_gen": [64, 128], "model": ["a", "b"], "backend.depth": [0, 1, 2]}


def test_quant_ladder_expands_to_six_trials_in_grid_order():
    p = plan(["+experiment=quant_ladder"])
    assert [t.config["model"]["quant"] for t in p.trials] == ["Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "F16"]
    assert [t.index for t in p.trials] == [1, 2, 3, 4, 5, 6]
    assert p.experiment == "quant_ladder"
    assert len({t.config_hash for t in p.trials}) == 6
    assert "sweep" not in p.trials[0].config


def test_command_line_lists_add_dimensions_and_replace_grid_ones():
    p = plan(["+experiment=quant_ladder", "backend.n_gen=64,128"])
    assert len(p.trials) == 12
    assert p.trials[0].point == {"model.quant": "Q4_0", "backend.n_gen": 64}
    assert p.trials[1].point == {"model.quant": "Q4_0", "backend.n_gen": 128}
    p = plan(["+experiment=quant_ladder", "model.quant=Q4_0,Q8_0"])
    assert [t.config["model"]["quant"] for t in p.trials] == ["Q4_0", "Q8_0"]


def test_values_are_typed_by_the_schema():
    p = plan(["backend.n_gen=8,16"])
    assert [t.config["backend"]["n_gen"] for t in p.trials] == [8, 16]
    with pytest.raises(ConfigError, match=r"backend.n_gen='x'.*expected Integer"):
        plan(["backend.n_gen=8,x"])
    with pytest.raises(ConfigError, match="unknown config key 'backend.bogus'"):
        plan(["backend.bogus=1,2"])


def test_group_dimension_composes_each_choice(tmp_path):
    p = plan(["model=gemma3_270m,other", "model.quant=Q8_0"], [_user_dir(tmp_path)])
    assert [t.config["model"]["name"] for t in p.trials] == ["gemma3_270m", "other"]
    assert [t.choices["model"] for t in p.trials] == ["gemma3_270m", "other"]
    assert p.trials[1].config["model"]["files"]["Q8_0"] == "/models/other-q8.gguf"


def test_hash_is_stable_and_ignores_key_order_and_non_semantic_keys():
    a = plan(["+experiment=quant_ladder"]).trials[2]
    b = plan(["+experiment=quant_ladder"]).trials[2]
    assert a.config_hash == b.config_hash
    reordered = {k: dict(reversed(list(v.items()))) if isinstance(v, dict) else v for k, v in reversed(list(a.config.items()))}
    assert config_hash(reordered) == a.config_hash
    changed = dict(a.config, tracking={"uri": "http://elsewhere"}, experiment={"name": "x", "description": ""})
    changed["backend"] = dict(a.config["backend"], timeout_s=5.0)
    assert config_hash(changed) == a.config_hash
    changed["backend"] = dict(a.config["backend"], n_gen=65)
    assert config_hash(changed) != a.config_hash


def test_all_invalid_trials_are_reported_together(tmp_path):
    p = plan(["model=other", "model.quant=Q8_0,Q4_K_M,Q9_X", "backend.repetitions=0"], [_user_dir(tmp_path)])
    text = "\n".join(p.problems)
    assert "unknown quant 'Q9_X'" in text and "Valid quants:" in text
    assert "backend.repetitions must be >= 1" in text
    assert len(p.trials) == 3


def test_missing_model_file_is_reported_before_running(tmp_path):
    p = plan(["model=other", "model.quant=Q6_K"], [_user_dir(tmp_path)])
    assert any("has no file for quant Q6_K" in m and "model.files.Q6_K" in m for m in p.problems)


def test_quantized_v_cache_needs_flash_attention():
    p = plan(["backend.cache_type_v=q8_0", "backend.flash_attn=off"])
    assert any("needs flash attention" in m for m in p.problems)


def test_capabilities_are_checked_on_the_backends_own_config():
    kv = plan(["model.quant=Q4_0", "backend.cache_type_v=iq9"]).problems
    assert any("backend llamacpp does not support KV type iq9 (cache_type_v)" in m for m in kv), kv
    depth = plan(["backend=trtllm", "model.quant=FP16", "backend.depth=16"]).problems
    assert any("backend trtllm cannot pre-fill a context depth (backend.depth=16)" in m for m in depth), depth


def test_a_plan_of_an_unregistered_backend_reports_it_and_still_drops_orders_and_splits_its_trials():
    p = plan(["backend.name=bogus", "model.quant=Q4_0,Q8_0", "backend.depth=0,8192", "backend.repetitions=3",
              "model.context_length=4096", "sweep.rounds=2", "sweep.drop_beyond_context=true"])
    assert any("unknown backend 'bogus'" in m for m in p.problems)
    assert len(p.notes) == 2 and all("drop_beyond_context" in n for n in p.notes)  # depth 8192 > 4096
    assert [t.short_label for t in p.trials] == ["Q4_0 d0 r1/2", "Q8_0 d0 r1/2", "Q4_0 d0 r2/2", "Q8_0 d0 r2/2"]
    for t in p.trials:
        assert t.config["backend"]["repetitions"] == t.cfg.backend.repetitions == 2  # ceil(3 / 2) in each round
        assert t.context_tokens == t.cfg.backend.n_prompt + t.cfg.backend.n_gen


def test_run_refuses_comma_lists():
    with pytest.raises(ConfigError, match="runs one trial"):
        plan(["backend.n_gen=1,2"], use_grid=False)
    p = plan(["+experiment=quant_ladder"], use_grid=False)
    assert len(p.trials) == 1 and p.trials[0].point == {}


def test_malformed_override_is_one_clear_message():
    with pytest.raises(ConfigError, match="malformed override"):
        plan(["backend.n_gen=[1,2"])
    with pytest.raises(ConfigError, match="one experiment per sweep"):
        plan(["+experiment=a,b"])


def test_single_value_on_the_command_line_pins_a_grid_dimension():
    p = plan(["+experiment=quant_ladder", "model.quant=Q8_0"])
    assert len(p.trials) == 1 and p.trials[0].config["model"]["quant"] == "Q8_0"
    assert "model.quant" not in p.dims


@pytest.mark.parametrize("override", ["tracking.results_dir=/tmp/a,/tmp/b", "tracking.experiment_name=x,y",
                                      "tracking=local,team"])
def test_tracking_is_not_a_sweep_dimension(tmp_path, override):
    """Sweeping where results go sent every trial to the first store; one sweep has one store (its parent run)."""
    (tmp_path / "tracking").mkdir()
    (tmp_path / "tracking" / "team.yaml").write_text("defaults: [tracking_schema, _self_]\nuri: http://127.0.0.1:5999\n")
    with pytest.raises(ConfigError, match="not a sweep dimension"):
        plan([override], [tmp_path])
    assert plan(["tracking.experiment_name=x"], [tmp_path]).tracking.experiment_name == "x"  # one value pins it
