"""Quality per trial: the reference the planner picks, the plan-time checks, and real sweeps on the bundled model
with the real llama-perplexity (the reference logits computed once and reused, quality reused across speed knobs,
a changed corpus measured again)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from jbench.core.quality import meaning, quality_identity, reference_key
from jbench.sweeps.quality import highest_precision, precision_rank

from .conftest import jbench_cli

SMALL = ["backend.n_prompt=16", "backend.n_gen=4", "backend.repetitions=1", "telemetry.source=none",
         "thermal.start_below_c=null", "quality.context=256"]


def test_the_reference_is_the_highest_precision_quant():
    assert highest_precision(["Q4_0", "Q8_0", "F16", "Q6_K"]) == "F16"
    assert highest_precision(["Q4_0", "Q4_K_M", "Q4_K_S"]) == "Q4_K_M"
    assert highest_precision(["Q5_K_M", "Q8_0"]) == "Q8_0"
    assert highest_precision(["BF16", "F16"]) == "BF16"  # a tie keeps the first given
    assert highest_precision(["nonsense"]) is None
    assert precision_rank("F32") > precision_rank("F16") > precision_rank("Q8_0") > precision_rank("Q2_K")


def test_quality_identity_leaves_out_speed_knobs_and_keeps_what_changes_the_numbers():
    base = dict(backend="llamacpp", build="abc", device="local", reference_digest="r" * 64, corpus_sha256="c" * 64,
                context=512, chunks=1, numerics={"n_gpu_layers": 99, "n_batch": None, "n_ubatch": None})
    key = reference_key(**base)
    assert key == reference_key(**dict(base))
    for change in ({"corpus_sha256": "d" * 64}, {"context": 1024}, {"chunks": 2}, {"build": "def"},
                   {"reference_digest": "s" * 64}, {"numerics": {**base["numerics"], "n_gpu_layers": 0}}):
        assert reference_key(**{**base, **change}) != key, change
    ident = quality_identity(reference=key, model_digest="m", kv=("f16", "f16"), flash_attn="auto")
    assert ident != quality_identity(reference=key, model_digest="m", kv=("q8_0", "q8_0"), flash_attn="auto")
    assert ident != quality_identity(reference=key, model_digest="n", kv=("f16", "f16"), flash_attn="auto")


def test_meaning_says_what_the_figures_measure():
    assert "KV-cache precision" in meaning(same_weights=True, requantized_from="Q4_K_M", reference_quant="Q4_K_M",
                                           reference_requantized_from=None, kv=("q8_0", "q8_0"))
    assert "the reference itself" in meaning(same_weights=True, requantized_from=None, reference_quant="F16",
                                             reference_requantized_from=None)
    text = meaning(same_weights=False, requantized_from="Q4_K_M", reference_quant="F16",
                   reference_requantized_from="Q4_K_M")
    assert "requantization loss" in text and "not its quality against the original weights" in text
    assert meaning(same_weights=False, requantized_from=None, reference_quant="F16",
                   reference_requantized_from=None) == "loss against F16 of the same model"


def _text(seed: int) -> str:
    """Plain English of a few thousand tokens, different for each seed."""
    import pydoc_data.topics as topics

    keys = sorted(topics.topics)
    return "\n\n".join(topics.topics[k] for k in keys[seed::3])


def _children(uri: str, experiment: str):
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], max_results=1000, order_by=["attributes.start_time ASC"])
    return [r for r in runs if r.data.tags.get("jbench.kind") == "trial"]


@pytest.mark.e2e
def test_a_quant_ladder_records_quality_reuses_it_and_measures_a_new_corpus_again(tmp_path, llama_build,
                                                                                    bundled_model):
    env = {"JBENCH_RESULTS_DIR": str(tmp_path)}
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    # A corpus of this test's own (the device's cache may hold the default corpus's reference from other runs).
    corpus = tmp_path / "corpus-a.txt"
    corpus.write_text(f"{tmp_path}\n" + _text(1))
    own = [*SMALL, f"quality.corpus={corpus}"]
    res = jbench_cli(["sweep", "+experiment=quant_ladder", "model.quant=Q4_0,Q8_0", *own], env_extra=env)
    assert res.returncode == 0, res.stdout + res.stderr
    first = _children(uri, "quant_ladder")
    assert [r.data.params["model.quant"] for r in first] == ["Q4_0", "Q8_0"]
    for run in first:
        tags, m = run.data.tags, run.data.metrics
        assert tags["quality.status"] == "ok" and tags["quality.reference_quant"] == "Q8_0"
        assert "requantization loss" in tags["quality.meaning"] or run.data.params["model.quant"] == "Q8_0"
        assert tags["quality.context"] == "256" and len(tags["quality.corpus_sha256"]) == 64
        assert str(corpus) in tags["quality.corpus"]
        assert m["quality_scored_tokens"] >= 100
        assert "quality.reused_from" not in tags
    q4, q8 = (r.data.metrics for r in first)
    # The reference against itself: the same file, the same numerics.
    assert q8["quality_kld_mean"] < 1e-3 and q8["quality_same_top_pct"] > 99
    assert q4["quality_kld_mean"] > q8["quality_kld_mean"] + 3 * q4["quality_kld_mean_err"]
    assert 0 < q4["quality_same_top_pct"] < 100 and q4["quality_ppl_ratio"] > 1
    # Computed by the first trial (the reference pass ran), read from the device's cache by the second.
    assert first[0].data.tags["quality.reference_cache"].startswith("computed")
    assert first[1].data.tags["quality.reference_cache"].startswith("hit")
    assert first[0].data.metrics["quality_reference_logits_mib"] > 10

    # A speed knob changed: the trials run again, their quality is the one measured above.
    res = jbench_cli(["sweep", "+experiment=quant_ladder", "model.quant=Q4_0,Q8_0", *own, "backend.n_gen=8"],
                     env_extra=env)
    assert res.returncode == 0, res.stdout + res.stderr
    second = _children(uri, "quant_ladder")[2:]
    assert len(second) == 2
    for before, after in zip(first, second):
        assert after.data.tags["quality.reused_from"] == f"run {before.info.run_id}"
        assert after.data.metrics["quality_kld_mean"] == before.data.metrics["quality_kld_mean"]
        assert "quality_wall_s" not in after.data.metrics

    # Another corpus: nothing FINISHED has that quality, so the trials run and the reference is computed again.
    text = Path(tmp_path / "corpus-b.txt")
    text.write_text(f"{tmp_path}\n" + _text(2))
    res = jbench_cli(["sweep", "+experiment=quant_ladder", "model.quant=Q4_0,Q8_0", *SMALL,
                      f"quality.corpus={text}"], env_extra=env)
    assert res.returncode == 0, res.stdout + res.stderr
    third = _children(uri, "quant_ladder")[4:]
    assert len(third) == 2
    assert third[0].data.tags["quality.reference_cache"].startswith("computed")
    assert third[0].data.tags["quality.corpus_sha256"] != first[0].data.tags["quality.corpus_sha256"]
    assert "quality.reused_from" not in third[0].data.tags


@pytest.mark.e2e
def test_a_corpus_too_short_stops_the_sweep_in_one_message(tmp_path, llama_build, bundled_model):
    short = tmp_path / "short.txt"
    short.write_text("Too short to score anything.\n")
    res = jbench_cli(["sweep", "+experiment=quant_ladder", "model.quant=Q4_0", *SMALL, f"quality.corpus={short}"],
                     env_extra={"JBENCH_RESULTS_DIR": str(tmp_path)})
    assert res.returncode == 2, res.stdout + res.stderr
    assert "quality.context" in res.stderr and "quality.corpus" in res.stderr
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.e2e
def test_a_reference_of_another_model_is_refused_before_anything_runs(tmp_path, llama_build, bundled_model):
    from .gguf_files import unloadable_gguf

    other = unloadable_gguf(tmp_path / "other.gguf")
    res = jbench_cli(["sweep", "+experiment=quant_ladder", "model.quant=Q4_0", *SMALL, "quality.reference=F16",
                      "model.source=files", "model.name=mine", f"+model.files.Q4_0={bundled_model['Q4_0']['path']}",
                      f"+model.files.F16={other}"], env_extra={"JBENCH_RESULTS_DIR": str(tmp_path)})
    assert res.returncode == 2, res.stdout + res.stderr
    assert "vocabulary" in res.stderr and "quality.reference" in res.stderr


@pytest.mark.e2e
def test_a_missing_llama_perplexity_is_one_clear_failure(tmp_path, llama_build, bundled_model):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "llama-bench").symlink_to(Path(llama_build["bin_dir"]) / "llama-bench")
    res = jbench_cli(["sweep", "+experiment=quant_ladder", "model.quant=Q4_0", *SMALL, f"backend.binary_dir={bin_dir}"],
                     env_extra={"JBENCH_RESULTS_DIR": str(tmp_path)})
    assert res.returncode != 0
    assert "llama-perplexity" in res.stdout + res.stderr and "jbench setup" in res.stdout + res.stderr


@pytest.mark.ssh
@pytest.mark.e2e
def test_over_ssh_the_reference_logits_are_cached_on_the_device_and_a_new_corpus_is_measured_again(
        orin_nano_super, tmp_path, llama_build, bundled_model):
    from .test_ssh_devices import write_conf

    emu = orin_nano_super
    conf = write_conf(tmp_path, emu)
    env = {"JBENCH_RESULTS_DIR": str(tmp_path / "r")}
    uri = f"sqlite:///{tmp_path}/r/mlflow.db"
    cache = Path(emu.home) / ".cache" / "jbench" / "quality"
    corpus = tmp_path / "corpus-a.txt"  # on the controller: jbench copies it to the device's cache
    corpus.write_text(_text(0))
    argv = ["sweep", "--config-dir", str(conf), "+experiment=quant_ladder", "device=emu",
            f"backend.binary_dir={llama_build['bin_dir']}", "model.quant=Q4_0,Q8_0", *SMALL]
    res = jbench_cli([*argv, "power.mode=MAXN_SUPER,25W", f"quality.corpus={corpus}"], env_extra=env)
    assert res.returncode == 0, res.stdout + res.stderr
    first = _children(uri, "quant_ladder")
    assert [(r.data.params["power.mode"], r.data.params["model.quant"]) for r in first] == [
        ("MAXN_SUPER", "Q4_0"), ("MAXN_SUPER", "Q8_0"), ("25W", "Q4_0"), ("25W", "Q8_0")]
    # On the device: one reference logits file, the corpus jbench sent, nothing half-written.
    refs, corpora = sorted(cache.glob("ref-*.kld")), sorted(cache.glob("corpus-*.txt"))
    assert len(refs) == 1 and len(corpora) == 1, sorted(cache.iterdir())
    assert corpora[0].read_text() == corpus.read_text()
    assert not list(cache.glob("*.partial"))
    size_mib = refs[0].stat().st_size / (1 << 20)
    assert first[0].data.tags["quality.reference_cache"].startswith("computed")
    assert first[1].data.tags["quality.reference_cache"].startswith("hit")
    assert first[0].data.metrics["quality_reference_logits_mib"] == pytest.approx(size_mib)
    # The power mode is a speed knob: the 25W trials reuse the quality measured in MAXN_SUPER, no second pass.
    for before, after in zip(first[:2], first[2:]):
        quant = before.data.params["model.quant"]
        assert after.data.tags["quality.reused_from"] == f"trial model.quant={quant} power.mode=MAXN_SUPER of this sweep"
        assert after.data.metrics["quality_kld_mean"] == before.data.metrics["quality_kld_mean"]
        assert "quality_wall_s" not in after.data.metrics
    assert first[0].data.metrics["quality_kld_mean"] > first[1].data.metrics["quality_kld_mean"]
    mtime = refs[0].stat().st_mtime_ns

    # Another corpus: the FINISHED trials lack that quality, so they run again and the reference is computed anew;
    # the first reference stays cached (within quality.cache_max_gb) beside the new one.
    other = tmp_path / "corpus-b.txt"
    other.write_text(_text(1))
    res = jbench_cli([*argv, "power.mode=MAXN_SUPER", f"quality.corpus={other}"], env_extra=env)
    assert res.returncode == 0, res.stdout + res.stderr
    second = _children(uri, "quant_ladder")[4:]
    assert [r.data.params["model.quant"] for r in second] == ["Q4_0", "Q8_0"]
    assert second[0].data.tags["quality.reference_cache"].startswith("computed")
    assert second[0].data.tags["quality.corpus_sha256"] != first[0].data.tags["quality.corpus_sha256"]
    assert "quality.reused_from" not in second[0].data.tags
    assert len(list(cache.glob("ref-*.kld"))) == 2 and len(list(cache.glob("corpus-*.txt"))) == 2
    assert refs[0].stat().st_mtime_ns == mtime  # the first reference was not rewritten
