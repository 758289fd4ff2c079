"""The in-house engine backend (`backend=engine`): end to end through the real `jbench` CLI into MLflow with
the stand-in engine (tests/fixtures/engine/stand_in_engine.py, real work over a weight file), plus the
command template, output parsing, energy-pass and `jbench trace analyze` functions directly."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from jbench.backends.engine.trace import TraceError
from jbench.backends.base import BackendError
from jbench.config import load_profile
from jbench.backends.engine.backend import (
    EngineBackend,
    check_template,
    parse_engine_output,
    render_command,
    template_fields,
    trace_analyze_command,
)
from jbench.device.local import LocalConnection
from jbench.sweeps.plan import plan

from .conftest import jbench_cli

HERE = Path(__file__).resolve().parent
ENGINE = HERE / "fixtures" / "engine" / "stand_in_engine.py"
WEIGHTS_BYTES = 3 * (1 << 20) + 12345  # a size no default could produce by accident
PHASE_RE = re.compile(r"\[engine\] (Prefill|Decode): (\d+) tokens in ([\d.]+) ms")
log = logging.getLogger("jbench.test.engine")


def _conf(tmp: Path, weights: Path, extra_files: dict[str, str] | None = None) -> Path:
    conf = tmp / "conf"
    (conf / "model").mkdir(parents=True, exist_ok=True)
    (conf / "model" / "standin.yaml").write_text(json.dumps(
        {"defaults": ["model_schema", "_self_"], "name": "standin", "quant": "Q4_0", "files": {"Q4_0": str(weights)}}))
    for rel, text in (extra_files or {}).items():
        (conf / rel).parent.mkdir(parents=True, exist_ok=True)
        (conf / rel).write_text(text)
    return conf


def _weights(tmp: Path, name: str = "weights.bin") -> Path:
    w = tmp / name
    w.write_bytes(os.urandom(WEIGHTS_BYTES))
    return w


def _runs(uri: str, experiment: str = "adhoc"):
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None
    runs = client.search_runs([exp.experiment_id], max_results=100)
    return client, [r for r in runs if r.data.tags.get("jbench.kind") == "trial"]


def _timed_sections(raw: str) -> list[str]:
    """The timed runs' output in a raw/stdout.txt artifact (the warmup section is left out)."""
    parts = re.split(r"^# jbench: engine (warmup run|run \d+/\d+).*$", raw, flags=re.M)
    return [parts[i + 1] for i in range(1, len(parts) - 1, 2) if parts[i] != "warmup run"]


BASE = ["run", "backend=engine", "model=standin", f"backend.binary={ENGINE}", "telemetry.source=none"]


# --------------------------------------------------------------------------------------------
# Through the CLI


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine_e2e")
    conf = _conf(tmp, _weights(tmp))
    res = jbench_cli([*BASE, "--config-dir", str(conf), "backend.n_prompt=16", "backend.n_gen=8",
                      "backend.repetitions=3", "backend.trace=true", "backend.extra_args=[--ms-decimals,3]"],
                     env_extra={"JBENCH_RESULTS_DIR": str(tmp / "results")})
    assert res.returncode == 0, res.stdout + res.stderr
    client, runs = _runs(f"sqlite:///{tmp}/results/mlflow.db")
    assert len(runs) == 1
    return client, runs[0], tmp


@pytest.mark.e2e
def test_cli_rates_match_the_engines_printed_ms(traced_run):
    client, run, tmp = traced_run
    assert run.info.status == "FINISHED"
    m = run.data.metrics
    raw = Path(client.download_artifacts(run.info.run_id, "raw/stdout.txt", str(tmp / "dl"))).read_text()
    sections = _timed_sections(raw)
    assert len(sections) == 3
    rates: dict[str, list[float]] = {"Prefill": [], "Decode": []}
    for text in sections:
        found = PHASE_RE.findall(text)
        assert sorted(p for p, _, _ in found) == ["Decode", "Prefill"]
        for phase, tokens, ms in found:
            rates[phase].append(int(tokens) * 1000.0 / float(ms))
        # The engine read the configured file: its own line names the known size.
        assert f": {WEIGHTS_BYTES} bytes" in text
    for phase, key in (("Prefill", "prefill"), ("Decode", "decode")):
        assert m[f"{key}_tps"] == pytest.approx(sum(rates[phase]) / 3, rel=1e-9)
        history = client.get_metric_history(run.info.run_id, f"{key}_tps_rep")
        assert sorted(h.value for h in history) == pytest.approx(sorted(rates[phase]), rel=1e-9)
        assert m[f"{key}_repetitions"] == 3
    assert m["prefill_tokens"] == 16 and m["decode_tokens"] == 8
    # Real work: batched prefill (one pass over the weights for 16 tokens) beats decode (one pass per token).
    assert m["prefill_tps"] > m["decode_tps"] > 0
    tags = run.data.tags
    assert run.data.params["backend.name"] == "engine" and "backend.name" not in tags
    assert tags["backend.engine_sha256"] == hashlib.sha256(ENGINE.read_bytes()).hexdigest()
    assert json.loads(run.data.params["backend.command"])[0] == "{binary}"


@pytest.mark.e2e
def test_cli_trace_findings_reach_the_trial_log(traced_run):
    client, run, tmp = traced_run
    text = Path(client.download_artifacts(run.info.run_id, "trial.log", str(tmp / "dl2"))).read_text()
    assert "--trace" in text
    assert "finding qkv_not_fused" in text and "finding gate_up_not_fused" in text
    assert "GEMV trace: 8 token(s) (index-reset), 14 GEMVs/token, 2 layers x 7 GEMVs" in text


@pytest.mark.e2e
def test_cli_trace_findings_are_tags(traced_run):
    _client, run, _tmp = traced_run
    assert "finding.qkv_not_fused" in run.data.tags and "finding.gate_up_not_fused" in run.data.tags


@pytest.mark.e2e
def test_cli_missing_placeholder_stops_before_anything_runs(tmp_path):
    own = ('defaults: [engine_schema, _self_]\nname: engine\n'
           'command: ["{binary}", "--model", "{model}", "--prompt-tokens", "{prompt_tokens}", '
           '"--gen-tokens", "{gen_tokens}", "--batch={batch}"]\n')
    conf = _conf(tmp_path, _weights(tmp_path), {"backend/my_engine.yaml": own})
    res = jbench_cli(["run", "--config-dir", str(conf), "backend=my_engine", "model=standin",
                      f"backend.binary={ENGINE}"], env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "results")})
    assert res.returncode == 2, res.stdout + res.stderr
    assert "unknown placeholder {batch}" in res.stderr and "Placeholders that exist:" in res.stderr
    assert "prompt_tokens" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "results" / "mlflow.db").exists()
    # The same command with the value provided under backend.vars runs.
    (conf / "backend" / "my_engine.yaml").write_text(own + 'vars: {batch: "512"}\n')
    res = jbench_cli(["run", "--config-dir", str(conf), "backend=my_engine", "model=standin",
                      f"backend.binary={ENGINE}", "backend.repetitions=1", "telemetry.source=none"],
                     env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "results")})
    assert res.returncode == 0, res.stdout + res.stderr
    client, runs = _runs(f"sqlite:///{tmp_path}/results/mlflow.db")
    log_text = Path(client.download_artifacts(runs[0].info.run_id, "trial.log", str(tmp_path / "dl"))).read_text()
    assert "--batch=512" in log_text


@pytest.mark.e2e
def test_cli_unset_binary_is_a_user_error(tmp_path):
    conf = _conf(tmp_path, _weights(tmp_path))
    res = jbench_cli(["run", "--config-dir", str(conf), "backend=engine", "model=standin"],
                     env_extra={"JBENCH_RESULTS_DIR": str(tmp_path)})
    assert res.returncode == 2 and "placeholder {binary} has no value: backend.binary is not set" in res.stderr


@pytest.mark.e2e
def test_cli_exit_0_without_decode_is_unparseable_output(tmp_path):
    conf = _conf(tmp_path, _weights(tmp_path))
    res = jbench_cli([*BASE, "--config-dir", str(conf), "backend.repetitions=1", "backend.extra_args=[--no-decode]"],
                     env_extra={"JBENCH_RESULTS_DIR": str(tmp_path)})
    assert res.returncode == 4, res.stdout + res.stderr
    client, runs = _runs(f"sqlite:///{tmp_path}/mlflow.db")
    run = runs[0]
    assert run.info.status == "FAILED"
    assert run.data.tags["jbench.failure_category"] == "unparseable_output"
    assert "no Decode result" in run.data.tags["jbench.failure_reason"]
    assert not any(k.startswith(("decode_", "prefill_")) for k in run.data.metrics)  # never a zero rate
    raw = Path(client.download_artifacts(run.info.run_id, "raw/stdout.txt", str(tmp_path / "dl"))).read_text()
    assert "[engine] Prefill:" in raw and "Decode:" not in raw


@pytest.mark.e2e
def test_cli_engine_failure_is_backend_crash_with_stderr(tmp_path):
    conf = _conf(tmp_path, _weights(tmp_path))
    res = jbench_cli([*BASE, "--config-dir", str(conf), "backend.extra_args=[--fail]"],
                     env_extra={"JBENCH_RESULTS_DIR": str(tmp_path)})
    assert res.returncode == 4
    client, runs = _runs(f"sqlite:///{tmp_path}/mlflow.db")
    run = runs[0]
    assert run.info.status == "FAILED" and run.data.tags["jbench.failure_category"] == "backend_crash"
    assert "exited with code 3" in run.data.tags["jbench.failure_reason"]
    err = Path(client.download_artifacts(run.info.run_id, "raw/stderr.txt", str(tmp_path / "dl"))).read_text()
    assert "CUDA kernel launch failed" in err


# --------------------------------------------------------------------------------------------
# Templates


def test_placeholder_values_stay_one_argument():
    values = {"binary": "/opt/e", "model": "/m/a b; rm -rf ~ $(x).gguf", "prompt_tokens": 4}
    argv = render_command(["{binary}", "--model", "{model}", "--p={prompt_tokens}", "{{literal}}", "{extra}"],
                          values, {"extra": ["--x", "a b"]})
    assert argv == ["/opt/e", "--model", "/m/a b; rm -rf ~ $(x).gguf", "--p=4", "{literal}", "--x", "a b"]
    assert render_command(["{binary}", "{extra}"], values, {"extra": []}) == ["/opt/e"]


@pytest.mark.parametrize("item, problem", [
    ("--b={batch}", "unknown placeholder {batch}. Placeholders that exist: binary, context, depth, extra"),
    ("--m={model.name}", "is not a placeholder name"),
    ("--x={0}", "is not a placeholder name"),
    ("--x={}", "is not a placeholder name"),
    ("--open={binary", "malformed braces"),
    ("--n={gen_tokens:04d}", "format spec or conversion"),
    ("--extra={extra}", "must be a whole item of its own"),
    ("{kv_type}", "has no value: backend.kv_type is null"),
])
def test_template_problems_are_named(item, problem):
    available = {n: None for n in ("binary", "model", "quant", "prompt_tokens", "gen_tokens", "depth", "context",
                                   "repetitions", "extra", "trace")}
    available["kv_type"] = "backend.kv_type is null"
    problems = check_template(["{binary}", item], available)
    assert len(problems) == 1 and problem in problems[0], problems
    assert problems[0].startswith("backend.command[1]")
    assert check_template([], available)[0].startswith("backend.command is empty")
    assert template_fields("a{{b}}c{binary}") == ["binary"]


def _plan(tmp: Path, *overrides: str):
    conf = _conf(tmp, _weights(tmp))
    return plan(["backend=engine", "model=standin", f"backend.binary={ENGINE}", *overrides], [conf], use_grid=False)


@pytest.mark.parametrize("overrides, problem", [
    (["backend.depth=64"], "backend.depth=64 but backend.command has no {depth}"),
    (["backend.kv_type=q4_0", 'backend.command=["{binary}","--model","{model}"]'],
     "backend.kv_type=q4_0 but backend.command has no {kv_type}"),
    (["backend.kv_type=iq9"], "backend.kv_type 'iq9' is not a KV type this engine accepts. Valid (backend.kv_types)"),
    (["backend.trace=true", 'backend.command=["{binary}","--model","{model}"]'], 'has no "{trace}" item'),
    (["backend.context=100"], "backend.context=100 cannot hold depth + n_prompt + n_gen = 192"),
    (["backend.output=xml"], "backend.output 'xml' is not valid. Valid: auto, log, jsonl"),
    (["backend.patterns.decode='Decode (\\d+)'"], "backend.patterns: LogPatterns.decode lacks named group(s) ms, tokens"),
    (["+backend.vars.model=x"], "backend.vars.model: 'model' is a built-in placeholder"),
    (["+backend.trace_hints.layers=4"], "backend.trace_hints.layers is not a hint"),
])
def test_validate_catches_config_problems(tmp_path, overrides, problem):
    p = _plan(tmp_path, *overrides)
    assert any(problem in x for x in p.problems), p.problems


def test_default_engine_config_is_valid(tmp_path):
    assert _plan(tmp_path).problems == []


# --------------------------------------------------------------------------------------------
# Running the stand-in directly


def _trial(tmp: Path, *overrides: str, weights_name: str = "weights.bin"):
    conf = _conf(tmp, _weights(tmp, weights_name))
    p = plan(["backend=engine", "model=standin", f"backend.binary={ENGINE}", "backend.n_prompt=16", "backend.n_gen=4",
              *overrides], [conf], use_grid=False)
    assert p.problems == [], p.problems
    t = p.trials[0]
    return t, EngineBackend(t.config["backend"])


def test_model_path_with_spaces_and_semicolon_runs(tmp_path):
    trial, backend = _trial(tmp_path, "backend.repetitions=1", "backend.warmup=false",
                            "backend.extra_args=[--ms-decimals,3]", weights_name="my model; rm -rf x.bin")
    result = backend.run(trial, LocalConnection(), log)
    assert str(tmp_path / "my model; rm -rf x.bin") in result.command
    assert result.phases["decode"].n_tokens == 4
    assert (tmp_path / "my model; rm -rf x.bin").exists()


def test_single_run_has_phase_windows_in_order(tmp_path):
    trial, backend = _trial(tmp_path, "backend.repetitions=1", "backend.extra_args=[--ms-decimals,3]")
    result = backend.run(trial, LocalConnection(), log)
    pre, dec = result.phases["prefill"].window, result.phases["decode"].window
    assert pre is not None and dec is not None
    assert result.start_time is not None and result.start_time <= pre[0]
    assert pre[1] <= dec[0] + 1e-6  # prefill ends where decode starts (the engine prints both at the end)
    assert result.info["engine_runs"] == 1 and result.info["engine_output_format"] == "log"


def test_several_runs_have_no_window(tmp_path):
    trial, backend = _trial(tmp_path, "backend.repetitions=2", "backend.extra_args=[--ms-decimals,3]")
    result = backend.run(trial, LocalConnection(), log)
    assert all(pr.window is None and len(pr.samples_ns) == 2 for pr in result.phases.values())


def test_jsonl_output_and_power_line(tmp_path):
    trial, backend = _trial(tmp_path, "backend.repetitions=1", "backend.output=jsonl",
                            "backend.extra_args=[--format,jsonl]", "+backend.env.ENGINE_GPU_MHZ=0",
                            "+backend.env.ENGINE_POWER_MODE=7W")
    result = backend.run(trial, LocalConnection(), log)
    decode_ms = [json.loads(line.split(" ", 1)[1])["ms"] for line in result.raw_output.splitlines()
                 if '"event": "decode"' in line]
    assert result.phases["decode"].samples_ns == [round(decode_ms[-1] * 1e6)]
    assert result.info["engine_output_format"] == "jsonl"
    assert result.info["engine_gpu_mhz"] == 0 and result.info["engine_power_mode"] == "7W"
    assert "gpu_clock_zero" in [f.code for f in result.findings]


def test_output_jsonl_with_a_log_engine_is_unparseable(tmp_path):
    trial, backend = _trial(tmp_path, "backend.repetitions=1", "backend.output=jsonl")
    with pytest.raises(BackendError) as err:
        backend.run(trial, LocalConnection(), log)
    assert err.value.category == "unparseable_output" and '{"event": "prefill"' in str(err.value)
    assert "[engine] Prefill:" in err.value.raw_output


def test_energy_pass_is_one_longer_run(tmp_path):
    trial, backend = _trial(tmp_path, "backend.extra_args=[--ms-decimals,3]")
    result = backend.run(trial, LocalConnection(), log, only_phase="decode", repetitions=5)
    assert set(result.phases) == {"decode"}
    dec = result.phases["decode"]
    assert dec.n_tokens == 20 and len(dec.samples_ns) == 1 and dec.window is not None
    assert "--gen-tokens" in result.command and result.command[result.command.index("--gen-tokens") + 1] == "20"
    assert "warmup" not in result.raw_output  # no warmup run in an energy pass
    # bounded by the context: 16 prompt tokens + 4 x k generated tokens <= 40
    trial, backend = _trial(tmp_path, "backend.context=40", "backend.extra_args=[--ms-decimals,3]")
    result = backend.run(trial, LocalConnection(), log, only_phase="decode", repetitions=100)
    assert result.phases["decode"].n_tokens == 24


def _fake_engine(tmp: Path, body: str) -> Path:
    path = tmp / "fake_engine.sh"
    path.write_text("#!/bin/sh\n# test fixture: prints crafted engine lines for an edge case\n" + body)
    path.chmod(0o755)
    return path


def test_zero_ms_is_unparseable_not_infinite(tmp_path):
    fake = _fake_engine(tmp_path, 'echo "[engine] Prefill: 16 tokens in 3 ms (5.3 tok/s)"\n'
                                  'echo "[engine] Decode: 4 tokens in 0 ms (0.0 tok/s)"\n')
    trial, backend = _trial(tmp_path, f"backend.binary={fake}", "backend.repetitions=1")
    with pytest.raises(BackendError) as err:
        backend.run(trial, LocalConnection(), log)
    assert err.value.category == "unparseable_output" and "4 tokens in 0 ms" in str(err.value)


def test_engine_repeating_itself_with_repetitions_placeholder(tmp_path):
    # A wrapper that runs the real stand-in R times in one process: one line per repetition and phase.
    fake = _fake_engine(tmp_path, f'n=$1; shift\nfor i in $(seq "$n"); do "{sys.executable}" "{ENGINE}" "$@" || exit $?; '
                                  f'done\n')
    cmd = ('backend.command=["{binary}","{repetitions}","--model","{model}","--prompt-tokens","{prompt_tokens}",'
           '"--gen-tokens","{gen_tokens}","--ms-decimals","3"]')
    trial, backend = _trial(tmp_path, f"backend.binary={fake}", cmd, "backend.repetitions=3", "backend.warmup=false")
    result = backend.run(trial, LocalConnection(), log)
    assert result.info["engine_runs"] == 1
    assert all(len(pr.samples_ns) == 3 for pr in result.phases.values())
    assert result.command[1] == "3"


def test_custom_log_patterns():
    patterns = dict(prefill=r"PP (?P<tokens>\d+)t (?P<ms>[\d.]+)ms", decode=r"TG (?P<tokens>\d+)t (?P<ms>[\d.]+)ms")
    from jbench.backends.engine.backend import EngineLogPatterns, _patterns

    run = parse_engine_output("1795000000.5 @@start\n1795000001.0 PP 16t 8.0ms\n1795000002.0 TG 4t 500ms\n",
                              _patterns(EngineLogPatterns(**patterns)))
    assert run.start == 1795000000.5
    assert (run.parsed.prefill[0].tokens, run.parsed.prefill[0].ms) == (16, 8.0)
    assert run.stamp(run.parsed.decode[0]) == 1795000002.0


# --------------------------------------------------------------------------------------------
# jbench trace analyze FILE


def _q4k(m: int, k: int) -> int:
    return m * k * 144 // 256  # Q4_K: 144 bytes per 256 weights


def test_trace_analyze_command_on_a_saved_trace(tmp_path):
    weights = _weights(tmp_path)
    out = subprocess.run([sys.executable, str(ENGINE), "--model", str(weights), "--prompt-tokens", "8",
                          "--gen-tokens", "3", "--trace", "--fused", "--ms-decimals", "3"],
                         capture_output=True, text=True, check=True).stdout
    trace = tmp_path / "engine.log"
    trace.write_text(out)
    text, report = trace_analyze_command(str(trace), bandwidth_gbs=68.0)
    # stand-in defaults: 2 layers, d=256, ff=768, kv_dim=128, q_dim=256, fused QKV and gate/up, no LM head
    layer = _q4k(256 + 2 * 128, 256) + _q4k(256, 256) + _q4k(2 * 768, 256) + _q4k(256, 768)
    assert report["token"]["launches"] == 8 and report["token"]["weight_bytes"] == 2 * layer
    assert report["token"]["n_blocks"] == 3
    assert report["ceiling_tps"] == pytest.approx(68e9 / (2 * layer))
    assert report["bandwidth_source"] == "--bandwidth" and report["file"] == str(trace)
    codes = [f["code"] for f in report["findings"]]
    assert "qkv_not_fused" not in codes and "gate_up_not_fused" not in codes
    assert text.startswith("GEMV trace: 3 token(s)") and "Findings:" in text
    _, from_profile = trace_analyze_command(str(trace), load_profile("orin_nano_8gb")["memory_bandwidth_gbs"],
                                            bandwidth_source="profile orin_nano_8gb")
    assert from_profile["bandwidth_source"] == "profile orin_nano_8gb"
    assert from_profile["bandwidth_bytes_per_s"] == pytest.approx(68e9)
    _, rated = trace_analyze_command(str(trace), bandwidth_gbs=68.0, decode_tps=10.0)
    assert rated["implied_bandwidth_bytes_per_s"] == pytest.approx(10.0 * 2 * layer)


@pytest.mark.parametrize("kwargs, message", [
    ({"path": "/nonexistent/engine.log"}, "cannot read /nonexistent/engine.log"),
    ({"bandwidth_gbs": -1.0}, "bandwidth must be a positive number"),
    ({"patterns": {"decode": "Decode"}}, "lacks named group"),
])
def test_trace_analyze_command_user_errors(tmp_path, kwargs, message):
    f = tmp_path / "x.log"
    f.write_text("[engine] Decode: 4 tokens in 100 ms (40.0 tok/s)\n")
    kwargs = {"path": str(f), **kwargs}
    with pytest.raises(TraceError) as err:
        trace_analyze_command(**kwargs)
    assert message in str(err.value)
    empty = tmp_path / "empty.log"
    empty.write_text("nothing here\n")
    with pytest.raises(TraceError):
        trace_analyze_command(str(empty))
