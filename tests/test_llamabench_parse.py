"""llama-bench -o jsonl parsing on real records: llama.cpp's README sample and our own build's."""

from __future__ import annotations

import json

import pytest

from jbench.backends.llamacpp.bench import (
    ParseError,
    normalize_flash_attn,
    parse_output,
    parse_records,
    record_phase,
)

from .conftest import DATA


def _lines(path):
    return [l for l in path.read_text().splitlines() if l.strip() and not l.startswith("#")]


def test_readme_record_5a32f10_decode_phase():
    records = parse_records((DATA / "llama-bench" / "llama-bench-readme-5a32f10.jsonl").read_text())
    assert len(records) == 1
    phase = record_phase(records[0])
    assert phase.phase == "decode" and phase.n_tokens == 128
    assert phase.samples_ns == [1066331700, 1064864900, 1079042600, 1063328400, 1066824400]
    # Our tok/s (tokens / repetition time, averaged) reproduces llama-bench's own avg_ts and samples_ts.
    mean = sum(phase.samples_tps) / len(phase.samples_tps)
    assert mean == pytest.approx(records[0]["avg_ts"], rel=1e-5)
    assert phase.samples_tps == pytest.approx(records[0]["samples_ts"], rel=1e-5)
    phases, build, info = parse_output((DATA / "llama-bench" / "llama-bench-readme-5a32f10.jsonl").read_text())
    assert set(phases) == {"decode"}
    assert build == {"build_commit": "8cf427ff", "build_number": "5163"}
    assert info["gpu_info"] == "NVIDIA GeForce RTX 4080" and info["backends"] == "CUDA"
    assert info["flash_attn"] == "off"  # printed as a bool by that build


def test_own_build_records_prefill_and_decode_at_each_depth():
    lines = _lines(DATA / "llama-bench-0c1e57098.jsonl")
    records = [json.loads(l) for l in lines]
    assert len(records) == 4
    by_depth: dict[int, list[str]] = {}
    for line, rec in zip(lines, records):
        by_depth.setdefault(rec["n_depth"], []).append(line)
    for depth, depth_lines in by_depth.items():
        phases, build, info = parse_output("\n".join(depth_lines))
        assert set(phases) == {"prefill", "decode"}
        assert phases["prefill"].n_tokens == 32 and phases["decode"].n_tokens == 8
        assert phases["prefill"].depth == depth
        assert build["build_commit"] == "0c1e57098"
        assert info["flash_attn"] == "auto"  # newer builds print -1
        for phase, rec in ((phases["prefill"], json.loads(depth_lines[0])), (phases["decode"], json.loads(depth_lines[1]))):
            assert len(phase.samples_ns) == 3
            assert sum(phase.samples_tps) / 3 == pytest.approx(rec["avg_ts"], rel=1e-5)


def test_two_records_of_one_phase_are_refused():
    with pytest.raises(ParseError, match="more than one prefill"):
        parse_output((DATA / "llama-bench-0c1e57098.jsonl").read_text())


def test_schema_drift_missing_and_extra_fields():
    rec = json.loads(_lines(DATA / "llama-bench-0c1e57098.jsonl")[1])
    # Older builds: no n_depth, use_mmap instead of load_mode, flash_attn bool; future fields unknown.
    for key in ("n_depth", "load_mode", "devices", "n_cpu_moe", "tensor_buft_overrides"):
        rec.pop(key, None)
    rec.update({"use_mmap": True, "flash_attn": True, "some_future_field": [1, 2]})
    phases, build, info = parse_output("log line before\n" + json.dumps(rec) + "\nmain: done\n")
    assert phases["decode"].depth == 0 and phases["decode"].n_tokens == 8
    assert info["flash_attn"] == "on"
    # No samples_ns: avg_ns is the single sample; neither: a clear error, never a zero rate.
    rec.pop("samples_ns")
    assert parse_output(json.dumps(rec))[0]["decode"].samples_ns == [rec["avg_ns"]]
    rec.pop("avg_ns")
    with pytest.raises(ParseError, match="neither samples_ns nor avg_ns"):
        parse_output(json.dumps(rec))


@pytest.mark.parametrize("text", ["", "garbage\nmore garbage", '{"n_prompt": 0, "n_gen": 0}', "[1,2,3]"])
def test_unparseable_outputs(text):
    with pytest.raises(ParseError):
        parse_output(text)


def test_nonpositive_sample_is_an_error():
    rec = json.loads(_lines(DATA / "llama-bench-0c1e57098.jsonl")[1])
    rec["samples_ns"] = [0, 5]
    with pytest.raises(ParseError, match="non-positive"):
        parse_output(json.dumps(rec))


def test_flash_attn_normalization():
    assert [normalize_flash_attn(v) for v in (True, False, -1, 0, 1, "auto")] == ["on", "off", "auto", "off", "on", "auto"]
