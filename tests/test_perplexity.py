"""llama-perplexity for output quality (jbench.backends.llamacpp.perplexity): the argument lists, the logits file's
size, the statistics and the refusals, read from real captured outputs (tests/data/llamacpp/perplexity, each with
its .cmd) and, in the e2e test, from the real build on the real model ladder."""

from __future__ import annotations

import math
import re
import struct
import subprocess
from pathlib import Path

import pytest

from jbench.backends.llamacpp.perplexity import (PerplexityError, QualityStats, candidate_argv, logits_file_bytes,
                                                 logits_row_bytes, parse_base_output, parse_kld_output,
                                                 parse_logits_header, reference_argv, refusal, scored_tokens,
                                                 too_few_scored)
from jbench.core import metrics

from .conftest import DATA

PPL_DATA = DATA / "llamacpp" / "perplexity"
GEMMA3_VOCAB = 262144  # gemma-3-270m's n_vocab, as the captured logits files' headers say


def capture(name: str) -> str:
    return (PPL_DATA / f"{name}.txt").read_text(encoding="utf-8")


def test_every_capture_names_its_command_and_build():
    outputs = sorted(PPL_DATA.glob("*.txt"))
    assert len(outputs) >= 10
    for out in outputs:
        if out.name == "logits-sizes.txt":
            continue
        cmd = out.with_suffix(".cmd").read_text()
        assert "# build: llama.cpp 0c1e57098" in cmd, out.name
        assert "/llama-perplexity -m " in cmd, out.name


# --------------------------------------------------------------------------------------------
# statistics


def test_candidate_statistics_from_the_real_output():
    stats = parse_kld_output(capture("kld-Q4_0-c256"))
    assert stats == QualityStats(
        quality_kld_mean=0.371834, quality_kld_mean_err=0.029776, quality_kld_median=0.284980,
        quality_kld_p99=1.591030, quality_kld_max=1.871525, quality_same_top_pct=69.291,
        quality_same_top_pct_err=4.109, quality_rms_dp_pct=14.569, quality_rms_dp_pct_err=1.982,
        quality_ppl=28.647013, quality_ppl_err=7.620110, quality_ppl_base=18.013124, quality_ppl_base_err=4.337450,
        quality_ppl_ratio=1.590341, quality_ppl_ratio_err=0.144537, quality_scored_tokens=127)
    got = stats.metrics()
    assert len(got) == 16 and all(isinstance(v, float) for v in got.values())
    # every name is a declared quality metric: the record takes them as they are
    assert set(got) <= set(metrics.provided_by("quality"))


def test_scored_tokens_come_from_the_logits_file_not_from_chunks():
    # --chunks 1 against a 2-chunk reference: the KLD pass scores both chunks (it reads n_chunk from the file)
    stats = parse_kld_output(capture("kld-Q4_0-c128x2-chunks1"))
    assert stats.quality_scored_tokens == 2 * (128 - 1 - 64) == 126
    assert stats.quality_kld_mean == pytest.approx(0.421710)
    assert stats.quality_ppl_base == pytest.approx(12.581531)  # the reference pass's own final estimate ...
    assert parse_base_output(capture("reference-F16-c128x2"))["ppl"] == pytest.approx(12.5815)  # ... agrees


def test_fewer_than_100_scored_tokens_is_no_statistics_with_the_count():
    with pytest.raises(PerplexityError) as err:
        parse_kld_output(capture("kld-Q4_0-c128-few"))
    assert err.value.kind == "no_statistics"
    assert "fewer than 100 tokens scored (63 scored)" in err.value.reason
    assert "quality.context" in err.value.reason and "quality.chunks" in err.value.reason


def test_an_output_cut_after_the_table_header_is_not_called_too_few_tokens():
    """127 tokens to score, exit 0, the table's header and nothing after (seen once in CI): not "fewer than 100"."""
    with pytest.raises(PerplexityError) as err:
        parse_kld_output(capture("kld-Q4_0-c256-cut-short"))
    assert err.value.kind == "cut_short"
    assert "ends after its table header" in err.value.reason and "127 tokens" in err.value.reason


def test_too_few_scored_is_known_before_running():
    assert too_few_scored(256, 1) is None and too_few_scored(128, 2) is None  # 127, 126: the captures with statistics
    message = too_few_scored(128, 1)  # 63: the capture without
    assert "scores 63 tokens" in message and "quality.context" in message and "quality.chunks" in message
    assert too_few_scored(202, 1) is None and too_few_scored(200, 1) is not None  # 100 and 99


def test_an_output_without_the_table_or_statistics_is_an_older_build():
    text = capture("kld-Q4_0-c256")
    older = text[:text.index("chunk             PPL")]
    with pytest.raises(PerplexityError) as err:
        parse_kld_output(older)
    assert err.value.kind == "no_statistics"
    assert "printed no KL-divergence statistics (an older build?)" in err.value.reason


def test_nan_stays_nan_and_a_missing_line_is_absent():
    text = capture("kld-Q4_0-c256")
    text = re.sub(r"^(RMS Δp    : )\s*[\d.]+ ± [\d.]+ %", r"\1   nan ±   nan %", text, flags=re.M)
    text = re.sub(r"^(Mean PPL\(Q\)/PPL\(base\)\s*:)\s*[\d.]+ ±\s*[\d.]+", r"\1   1.590341 ±       -nan", text,
                  flags=re.M)
    text = re.sub(r"^Same top p:.*\n", "", text, flags=re.M)
    got = parse_kld_output(text).metrics()
    assert math.isnan(got["quality_rms_dp_pct"]) and math.isnan(got["quality_rms_dp_pct_err"])
    assert got["quality_ppl_ratio"] == pytest.approx(1.590341) and math.isnan(got["quality_ppl_ratio_err"])
    assert "quality_same_top_pct" not in got and "quality_same_top_pct_err" not in got
    assert got["quality_kld_mean"] == pytest.approx(0.371834)


def test_a_statistics_block_without_mean_kld_is_refused():
    text = re.sub(r"^Mean    KLD:.*\n", "", capture("kld-Q4_0-c256"), flags=re.M)
    with pytest.raises(PerplexityError) as err:
        parse_kld_output(text)
    assert err.value.kind == "no_statistics" and "Mean KLD" in err.value.reason


def test_scored_tokens_absent_when_the_pass_did_not_say_its_chunks():
    text = re.sub(r"^.*kl_divergence: computing over.*\n", "", capture("kld-Q4_0-c256"), flags=re.M)
    stats = parse_kld_output(text)
    assert stats.quality_scored_tokens is None and "quality_scored_tokens" not in stats.metrics()


def test_reference_pass_report():
    assert parse_base_output(capture("reference-F16-c256")) == {
        "chunks": 1, "context": 256, "batch_size": 256, "n_seq": 1, "scored_tokens": 127,
        "ppl": pytest.approx(18.0132), "ppl_err": pytest.approx(4.33746)}
    # the candidate pass's PPL(base) is the reference's own figure over the same tokens
    assert parse_kld_output(capture("kld-Q4_0-c256")).quality_ppl_base == pytest.approx(18.0132, abs=1e-4)


# --------------------------------------------------------------------------------------------
# refusals: the tool exits 0 after them, so the text decides


@pytest.mark.parametrize("name", ["reference-F16-c256", "kld-Q4_0-c256", "kld-Q4_0-c128-few",
                                  "kld-Q4_0-c128x2-chunks1"])
def test_no_refusal_in_a_good_pass(name):
    assert refusal(capture(name)) is None


def test_corpus_too_short_says_what_it_has_needs_and_what_to_change():
    err = refusal(capture("reference-short-corpus"))
    assert err.kind == "corpus_too_short"
    assert "only 441 tokens" in err.reason and "at least 512" in err.reason and "context 256" in err.reason
    for setting in ("quality.context", "quality.chunks", "quality.corpus"):
        assert setting in err.reason
    with pytest.raises(PerplexityError) as raised:
        parse_base_output(capture("reference-short-corpus"))
    assert raised.value.kind == "corpus_too_short"


def test_vocabulary_mismatch_wins_over_what_follows_it():
    text = capture("kld-vocab-mismatch")
    assert "failed reading log-probs for chunk 0" in text  # the tool went on after the mismatch
    err = refusal(text)
    assert err.kind == "vocabulary_mismatch"
    assert "1000" in err.reason and "262144" in err.reason and "quality.reference" in err.reason


def test_statistics_after_a_vocabulary_mismatch_are_not_returned():
    # the tool goes on after `inconsistent vocabulary` and prints numbers of no meaning
    good = capture("kld-Q4_0-c256")
    mismatch = next(line for line in capture("kld-vocab-mismatch").splitlines() if "inconsistent vocabulary" in line)
    at = good.index("\n", good.index("system_info")) + 1
    with pytest.raises(PerplexityError) as err:
        parse_kld_output(good[:at] + mismatch + "\n" + good[at:])
    assert err.value.kind == "vocabulary_mismatch"


@pytest.mark.parametrize("name, words", [
    ("kld-truncated-logits", "truncated (failed reading n_vocab, n_chunk)"),
    ("kld-not-logits", "is not a llama-perplexity logits file"),
    ("kld-missing-logits", "could not open the reference logits file /tmp/jbench-ppl-capture/missing.kld for reading"),
])
def test_bad_logits_files(name, words):
    err = refusal(capture(name))
    assert err.kind == "bad_logits_file" and words in err.reason
    assert "\n" not in err.reason


def test_an_argument_the_build_refuses_is_a_crash_naming_it():
    err = refusal(capture("kld-bad-argument"))
    assert err.kind == "crash" and 'Unsupported cache type: q3_x' in err.reason


def test_error_kinds_are_checked():
    with pytest.raises(ValueError):
        PerplexityError("oops", "x")
    assert PerplexityError("crash", "why").reason == "why" and str(PerplexityError("crash", "why")) == "why"


# --------------------------------------------------------------------------------------------
# the logits file


def test_logits_file_size_matches_the_real_files():
    sizes = {}
    for line in (PPL_DATA / "logits-sizes.txt").read_text().splitlines():
        parts = line.split()
        sizes[Path(parts[-1]).name] = int(parts[4])
    assert sizes["f16-c256.kld"] == logits_file_bytes(GEMMA3_VOCAB, 256, 1)
    assert sizes["f16-c128.kld"] == logits_file_bytes(GEMMA3_VOCAB, 128, 1)
    assert sizes["f16-c128x2.kld"] == logits_file_bytes(GEMMA3_VOCAB, 128, 2)
    # the refused reference pass leaves a 12-byte stub (magic and n_ctx): one the candidate pass refuses
    assert sizes["short.kld"] == 12


def test_logits_file_layout():
    assert scored_tokens(256, 1) == 127 and scored_tokens(128, 2) == 126 and scored_tokens(512, 3) == 3 * 255
    assert logits_row_bytes(262144) == (262144 + 4) * 2
    assert logits_row_bytes(32001) == (32002 + 4) * 2  # odd vocabularies are padded to an even count
    assert logits_file_bytes(1000, 128, 1) == 20 + 4 * 128 + 63 * 1004 * 2


def test_logits_header():
    head = b"_logits_" + struct.pack("<Iii", 256, GEMMA3_VOCAB, 3)
    assert parse_logits_header(head) == {"n_ctx": 256, "n_vocab": GEMMA3_VOCAB, "n_chunk": 3}
    for bad in (b"_logits_" + struct.pack("<I", 256), b"not logits at all, really"):
        with pytest.raises(PerplexityError) as err:
            parse_logits_header(bad)
        assert err.value.kind == "bad_logits_file"


# --------------------------------------------------------------------------------------------
# argument lists


KW = dict(context=256, chunks=2, n_gpu_layers=99, threads=4, n_batch=256, n_ubatch=128)


def test_reference_argv():
    argv = reference_argv("/opt/ll/bin", "/m/F16.gguf", "/c/corpus.txt", "/q/base.kld", **KW)
    assert argv == ["/opt/ll/bin/llama-perplexity", "-m", "/m/F16.gguf", "--kl-divergence-base", "/q/base.kld",
                    "-c", "256", "--chunks", "2", "-b", "256", "-ub", "128", "-ngl", "99", "-t", "4",
                    "-f", "/c/corpus.txt", "-ctk", "f16", "-ctv", "f16"]
    assert "--kl-divergence" not in argv


def test_candidate_argv():
    argv = candidate_argv("/opt/ll/bin", "/m/Q4_0.gguf", "/q/base.kld", cache_type_k="q8_0", cache_type_v="q4_0",
                          flash_attn="on", **KW)
    assert argv == ["/opt/ll/bin/llama-perplexity", "-m", "/m/Q4_0.gguf", "--kl-divergence-base", "/q/base.kld",
                    "-c", "256", "--chunks", "2", "-b", "256", "-ub", "128", "-ngl", "99", "-t", "4",
                    "--kl-divergence", "-ctk", "q8_0", "-ctv", "q4_0", "-fa", "on"]
    assert "-f" not in argv  # the tokens come from the logits file
    auto = candidate_argv("/b", "/m.gguf", "/q.kld", cache_type_k="f16", cache_type_v="f16", flash_attn=None,
                          **{**KW, "threads": None})
    assert "-fa" not in auto and "-t" not in auto
    off = candidate_argv("/b", "/m.gguf", "/q.kld", cache_type_k="f16", cache_type_v="f16", flash_attn="off", **KW)
    assert off[-2:] == ["-fa", "off"]
    with pytest.raises(ValueError):
        candidate_argv("/b", "/m.gguf", "/q.kld", cache_type_k="f16", cache_type_v="f16", flash_attn="auto", **KW)
    with pytest.raises(ValueError):
        reference_argv("/b", "/m.gguf", "/c.txt", "/q.kld", **{**KW, "context": 0})


# --------------------------------------------------------------------------------------------
# the real build


@pytest.mark.e2e
def test_real_passes_on_the_ladder(llama_build, bundled_model, tmp_path):
    """The reference pass (F16 when the ladder has it, else Q8_0) and a Q4_0 candidate at the smallest size with
    statistics (-c 256 --chunks 1: 127 tokens), on the default corpus: the file is the size computed, the statistics
    parse, and the candidate's PPL(base) is the reference pass's own estimate."""
    from jbench.models.corpus import default_corpus

    ladder = Path(bundled_model["Q4_0"]["path"]).parent
    reference = ladder / "F16.gguf" if (ladder / "F16.gguf").exists() else Path(bundled_model["Q8_0"]["path"])
    corpus = default_corpus(tmp_path / "cache")
    kld = tmp_path / "base.kld"
    kw = dict(context=256, chunks=1, n_gpu_layers=0, threads=2, n_batch=256, n_ubatch=256)

    ref = subprocess.run(reference_argv(llama_build["bin_dir"], str(reference), corpus.path, str(kld), **kw),
                         capture_output=True, text=True, timeout=120)
    assert ref.returncode == 0, ref.stderr[-2000:]
    base = parse_base_output(ref.stdout + ref.stderr)
    assert base["scored_tokens"] == 127 and base["chunks"] == 1
    head = parse_logits_header(kld.read_bytes()[:20])
    assert head == {"n_ctx": 256, "n_vocab": GEMMA3_VOCAB, "n_chunk": 1}
    assert kld.stat().st_size == logits_file_bytes(head["n_vocab"], 256, 1)

    cand = subprocess.run(candidate_argv(llama_build["bin_dir"], bundled_model["Q4_0"]["path"], str(kld),
                                         cache_type_k="f16", cache_type_v="f16", flash_attn="off", **kw),
                          capture_output=True, text=True, timeout=120)
    assert cand.returncode == 0, cand.stderr[-2000:]
    stats = parse_kld_output(cand.stdout + cand.stderr)
    assert stats.quality_scored_tokens == 127
    assert stats.quality_kld_mean > 0 and 0 < stats.quality_same_top_pct <= 100
    assert stats.quality_ppl_base == pytest.approx(base["ppl"], rel=1e-3)



REPLAY_BIN = Path(__file__).parent / "fixtures" / "replay_llama_perplexity"


def _quality_pass(tmp_path: Path, outputs: list[str]):
    """measure_quality of a planned Q4_0 trial on this machine, llama-perplexity replaying `outputs`, the reference
    logits already in the cache (so only the trial pass runs). Returns what it found and each call's arguments."""
    import logging

    import gguf

    from jbench.backends.llamacpp.backend import LlamaCppBackend
    from jbench.backends.llamacpp.quality import measure_quality
    from jbench.core.quality import QualityRequest
    from jbench.device.local import LocalConnection
    from jbench.sweeps.plan import plan

    model = tmp_path / "m.gguf"  # a header-only GGUF: the plan reads it, the stand-in never does
    writer = gguf.GGUFWriter(str(model), "gemma3")
    writer.add_context_length(32768)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    replay = tmp_path / "replay"
    replay.mkdir()
    for i, name in enumerate(outputs, start=1):
        (replay / f"out-{i}.txt").write_text(capture(name), encoding="utf-8")
    p = plan(["model.quant=Q4_0", "model.source=files", f"+model.files.Q4_0={model}", "quality.enabled=false",
              f"backend.binary_dir={REPLAY_BIN}",
              f"+backend.env.PPL_REPLAY_DIR={replay}"], use_grid=False)
    assert not p.problems, p.problems
    trial = p.trials[0]
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "ref-k.kld").write_bytes(b"logits")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("text\n")
    req = QualityRequest(corpus_path=str(corpus), corpus_sha256="0" * 64, corpus_name="corpus", context=256,
                         chunks=1, reference_quant="F16", reference_model_path=str(model), reference_key="k",
                         identity="i", cache_dir=str(cache))
    with LocalConnection() as conn:
        out = measure_quality(LlamaCppBackend(trial.cfg.backend), trial, conn, logging.getLogger("test.quality"), req)
    return out, (replay / "calls.txt").read_text().splitlines()


def test_a_trial_pass_cut_short_runs_once_more_and_keeps_the_cut_output(tmp_path):
    out, calls = _quality_pass(tmp_path, ["kld-Q4_0-c256-cut-short", "kld-Q4_0-c256"])
    assert len(calls) == 2 and calls[0] == calls[1] and "--kl-divergence" in calls[0]
    # The second pass's statistics, the first pass's cut output kept, and the rerun said on the run.
    assert out.metrics == pytest.approx({**parse_kld_output(capture("kld-Q4_0-c256")).metrics(),
                                         "quality_wall_s": out.metrics["quality_wall_s"],
                                         "quality_reference_logits_mib": 6 / (1 << 20)})
    assert "ends after its table header" in out.tags["quality.trial_pass_rerun"]
    assert out.artifacts["raw/quality-trial-cut-short.txt"].startswith(
        "\n--- stderr ---\n" + capture("kld-Q4_0-c256-cut-short")[:40])
    assert "chunk             PPL" in out.artifacts["raw/quality-trial.txt"]


def test_a_trial_pass_cut_short_twice_fails_the_trial_with_that_reason(tmp_path):
    from jbench.backends.base import BackendError

    with pytest.raises(BackendError) as err:
        _quality_pass(tmp_path, ["kld-Q4_0-c256-cut-short", "kld-Q4_0-c256-cut-short"])
    assert err.value.category == "quality" and "ends after its table header" in str(err.value)
    assert len((tmp_path / "replay" / "calls.txt").read_text().splitlines()) == 2
