"""Speculative decoding on llama-server (backend.draft, draft_max/min, spec_type) and the backend's environment knobs
(backend.env): plan-time checks (the draft's vocabulary against the target's, read from both GGUF headers), the
argument lists, the acceptance arithmetic from the server's own counters, and against the real llama-server of
`jbench setup`: an F16 target with its Q4_0 copy as the draft."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from jbench.backends.llamacpp import server, serving
from jbench.backends.llamacpp.backend import (LlamaCppBackend, LlamaCppConfig, env_items, env_problems,
                                              speculative_problems, speculative_type, vocabulary)
from jbench.backends.llamacpp.client import RequestRecord
from jbench.device.local import LocalConnection
from jbench.runner.serving import serving_result


def tiny_gguf(path: Path, tokens: list[str], tokenizer: str = "llama") -> str:
    """A header-only GGUF with a vocabulary (no tensors): enough for the plan-time vocabulary check."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(tokenizer)
    w.add_token_list(tokens)
    w.add_uint32("llama.context_length", 128)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def model_section(**files: str) -> dict:
    return {"name": "tiny", "quant": "F16", "source": "files", "files": files}


def cfg(**kw) -> LlamaCppConfig:
    return LlamaCppConfig(**{"scenario": "serving", **kw})


# -- plan-time checks ----------------------------------------------------------------------------------------------

def test_a_draft_of_the_same_vocabulary_passes_and_another_is_refused_naming_both_sizes(tmp_path):
    words = [f"tok{i}" for i in range(40)]
    target = tiny_gguf(tmp_path / "t.gguf", words)
    same = tiny_gguf(tmp_path / "same.gguf", list(words))
    smaller = tiny_gguf(tmp_path / "small.gguf", words[:32])
    shuffled = tiny_gguf(tmp_path / "other.gguf", words[1:] + words[:1])
    model = model_section(F16=target, Q4_0=same, Q8_0=smaller, Q6_K=shuffled)

    assert speculative_problems(cfg(draft="Q4_0"), model) == []
    assert speculative_problems(cfg(draft=same, scenario="latency"), model) == []  # a path works too
    [msg] = speculative_problems(cfg(draft="Q8_0"), model)
    assert "another vocabulary" in msg and "32 tokens vs the model's 40" in msg
    [msg] = speculative_problems(cfg(draft="Q6_K"), model)
    assert "same size (40 tokens) but other tokens" in msg
    assert vocabulary(target) == vocabulary(same) != vocabulary(shuffled)


def test_each_bad_speculative_setting_gets_its_own_message(tmp_path):
    target = tiny_gguf(tmp_path / "t.gguf", ["a", "b"])
    model = model_section(F16=target)
    [msg] = speculative_problems(cfg(draft="Q4_0", scenario="bench"), model)
    assert "llama-bench (scenario bench) has no draft model" in msg
    [msg] = speculative_problems(cfg(draft=str(tmp_path / "missing.gguf")), model)
    assert "missing.gguf does not exist" in msg
    [msg] = speculative_problems(cfg(draft="Q4_0"), model)
    assert "no file for quant Q4_0" in msg
    [msg] = speculative_problems(cfg(draft="q4_0"), model)
    assert "unknown quant 'q4_0'" in msg
    [msg] = speculative_problems(cfg(spec_type="medusa"), model)
    assert "not a --spec-type of this llama.cpp build" in msg and "ngram-mod" in msg
    [msg] = speculative_problems(cfg(spec_type="draft-simple"), model)
    assert "needs a draft model" in msg
    problems = speculative_problems(cfg(draft=target, draft_max=2, draft_min=3), model)
    assert problems == ["backend.draft_min=3 is above backend.draft_max=2"]
    assert speculative_problems(cfg(draft=target, draft_max=-1), model) == ["backend.draft_max must be >= 0 (got -1)"]
    [msg] = speculative_problems(cfg(draft_max=4), model)
    assert "bound a draft" in msg
    [msg] = speculative_problems(cfg(draft=target, spec_type="ngram-mod"), model)
    assert "does not use a draft model" in msg
    # Draft-free n-gram lookup needs no draft model.
    assert speculative_problems(cfg(spec_type="ngram-simple"), model) == []
    assert speculative_problems(cfg(), model) == []


def test_env_names_and_values_are_checked():
    assert env_problems({"GGML_CUDA_DISABLE_GRAPHS": "1"}) == []
    assert "not an environment variable name" in env_problems({"BAD-NAME": "1"})[0]
    assert "not a string value" in env_problems({"X": None})[0]
    assert env_items({"A": 1, "B": True}) == {"A": "1", "B": "true"}


# -- argument lists ------------------------------------------------------------------------------------------------

def test_server_argv_carries_the_draft_its_bounds_and_the_type():
    argv = server.server_argv("/b/llama-server", "/m/F16.gguf", port=9, context=256, parallel=1, n_gpu_layers=99,
                              cache_type_k="f16", cache_type_v="f16", flash_attn=None, draft_path="/m/Q4_0.gguf",
                              spec_type="draft-simple", draft_max=8, draft_min=2, extra_args=["--foo"])
    assert argv[argv.index("-md") + 1] == "/m/Q4_0.gguf"
    assert argv[argv.index("--spec-type") + 1] == "draft-simple"
    assert argv[argv.index("--spec-draft-n-max") + 1] == "8"
    assert argv[argv.index("--spec-draft-n-min") + 1] == "2"
    assert argv[-1] == "--foo"
    plain = server.server_argv("/b/llama-server", "/m/F16.gguf", port=9, context=256, parallel=1, n_gpu_layers=99,
                               cache_type_k="f16", cache_type_v="f16", flash_attn=None)
    assert not {"-md", "--spec-type", "--spec-draft-n-max", "--spec-draft-n-min"} & set(plain)


def test_a_draft_without_a_type_drafts_with_draft_simple():
    # This build loads a -md model but drafts nothing while --spec-type stays at its default (none).
    assert speculative_type(cfg(draft="Q4_0")) == "draft-simple"
    assert speculative_type(cfg(spec_type="ngram-mod")) == "ngram-mod"
    assert speculative_type(cfg()) is None


def test_env_prefix_is_separate_argv_items():
    argv = ["/b/llama-server", "-m", "/m/x.gguf"]
    assert server.with_env(argv, {}) == argv
    assert server.with_env(argv, {"GGML_CUDA_DISABLE_GRAPHS": "1", "A": "b c"}) == [
        "env", "GGML_CUDA_DISABLE_GRAPHS=1", "A=b c", *argv]


# -- acceptance arithmetic -----------------------------------------------------------------------------------------

def record(i: int, out: int, **timings) -> RequestRecord:
    return RequestRecord(index=i, worker=0, sent_at=float(i), ttft_s=0.1, e2e_s=1.0, token_times_s=[],
                         output_tokens=out, tokens_source="usage", streamed_token_chunks=out,
                         server_timings={"predicted_per_second": 20.0, **timings})


def test_acceptance_is_pooled_over_requests_and_absent_without_counters():
    recs = [record(0, 16, draft_n=10, draft_n_accepted=9), record(1, 16, draft_n=30, draft_n_accepted=11)]
    m = serving.draft_metrics(recs)
    assert m["draft_acceptance"] == pytest.approx(20 / 40)  # pooled, not the mean of 0.9 and 0.37
    assert m["draft_tokens_per_output_token"] == pytest.approx(40 / 32)
    assert serving.draft_metrics([record(0, 16)]) == {}  # no draft: absent, never 0
    only = serving.draft_metrics([record(0, 16, draft_n=0, draft_n_accepted=0)])
    assert "draft_acceptance" not in only and only["draft_tokens_per_output_token"] == 0.0  # 0 / 0 is no rate


def test_serving_levels_record_acceptance_only_where_a_level_had_counters():
    from jbench.analysis.serving import Level, RequestOutcome
    from jbench.core.results import LoadWindow
    from jbench.core.schema import ServingConfig

    oc = tuple(RequestOutcome(index=i, sent_s=float(i), ttft_s=0.1, e2e_s=1.0, output_tokens=8, prompt_tokens=16,
                              token_gaps_s=(0.1,) * 7) for i in range(3))
    levels = [Level(load=1.0, outcomes=oc, wall_s=3.0), Level(load=2.0, outcomes=oc, wall_s=2.0)]
    windows = [LoadWindow(f"level{i}", 0.0, 1.0, output_tokens=24, total_tokens=72) for i in (1, 2)]
    draft = [{"draft_acceptance": 0.5, "draft_tokens_per_output_token": 1.25}, {}]
    out = serving_result(ServingConfig(), levels, windows, {}, draft=draft)
    assert out.stepped["serving_draft_acceptance"][0] == 0.5
    assert math.isnan(out.stepped["serving_draft_acceptance"][1])
    assert "draft_acceptance" in out.artifacts["serving/levels.csv"].splitlines()[0]
    plain = serving_result(ServingConfig(), levels, windows, {})
    assert not any(k.startswith("serving_draft") for k in plain.stepped)


# -- the real llama-server -----------------------------------------------------------------------------------------

@pytest.mark.e2e
def test_an_f16_target_with_its_q4_0_draft_reports_acceptance_from_the_server(llama_build, bundled_model, monkeypatch):
    from jbench.sweeps.plan import plan

    from .test_latency import assert_server_gone, trial_logger

    p = plan(["+experiment=serving", "model.quant=F16", "backend.draft=Q4_0", "backend.draft_max=4",
              "backend.threads=1", "serving.slots=1", "serving.levels=[1]", "serving.requests_per_level=3",
              "serving.warmup_requests=0", "serving.input.kind=fixed", "serving.input.mean=16",
              "serving.output.mean=16", "+backend.env.JBENCH_SPEC_PROBE=seen", "backend.timeout_s=300"])
    assert not p.problems, p.problems
    trial = p.trials[0]
    log, lines = trial_logger("speculative")
    environ: dict[str, str] = {}
    ready = server.LlamaServer._wait_ready

    def ready_then_read_environ(self):  # the server's own environment, read while it runs
        ready(self)
        raw = Path(f"/proc/{self.pid}/environ").read_bytes().decode(errors="replace")
        environ.update(item.split("=", 1) for item in raw.split("\0") if "=" in item)

    monkeypatch.setattr(server.LlamaServer, "_wait_ready", ready_then_read_environ)
    result = LlamaCppBackend(trial.config["backend"]).run(trial, LocalConnection(), log)
    assert_server_gone(lines.lines, result.command)
    argv = result.command
    assert argv[:2] == ["env", "JBENCH_SPEC_PROBE=seen"]
    assert os.path.basename(argv[argv.index("-md") + 1]) == "Q4_0.gguf"
    assert argv[argv.index("--spec-type") + 1] == "draft-simple"
    assert environ.get("JBENCH_SPEC_PROBE") == "seen"  # the knob reached the server process itself
    [level] = result.info["serving_draft"]
    assert 0.0 <= level["draft_acceptance"] <= 1.0
    assert level["draft_tokens_per_output_token"] > 0
    assert all(o.ok and o.output_tokens == 16 for o in result.serving_levels[0].outcomes)
