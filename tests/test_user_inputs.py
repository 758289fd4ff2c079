"""Inputs a user gives, through the real `jbench` CLI: a config directory whose path holds any character, a model
file of another model under the bundled model's entry (recorded under the file's own name), tegrastats logs as
logrotate leaves them (gzip) or with bytes that are not UTF-8, a backend command that runs past its time limit
(named as the user knows it), and the edge values that do mean something. The bad inputs themselves (one message,
exit 2, nothing run) are in the bad-input table, tests/test_bad_inputs.py."""

from __future__ import annotations

import gzip
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from .conftest import DATA, jbench_cli

pytestmark = pytest.mark.e2e

TINY = ["backend.n_prompt=8", "backend.n_gen=2", "backend.repetitions=2", "telemetry.source=none",
        "thermal.start_below_c=null", "device.lease_wait_s=600"]
TEGRASTATS = DATA / "jetson-formats" / "tegrastats-orin-nano.txt"


def _trial_runs(results: Path) -> list:
    client = MlflowClient(f"sqlite:///{results}/mlflow.db")
    exp = client.get_experiment_by_name("adhoc")
    return [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("jbench.kind") == "trial"]


# -- a config directory anywhere (issue 24, item 13) ----------------------------------------------------------------

@pytest.mark.parametrize("dirname", ["jürgen", "o'brien & co", "naïve,dir[1]"])
def test_a_config_dir_whose_path_holds_any_character_is_used(dirname, tmp_path, bundled_model):
    conf = tmp_path / dirname / "conf"
    (conf / "model").mkdir(parents=True)
    (conf / "model" / "mine.yaml").write_text("defaults: [model_schema, _self_]\nname: mine\nquant: Q4_0\n"
                                              f"source: files\nfiles:\n  Q4_0: {bundled_model['Q4_0']['path']}\n")
    env = {"JBENCH_RESULTS_DIR": str(tmp_path / "results")}
    for args, extra in ((["--config-dir", str(conf)], {}), ([], {"JBENCH_CONFIG_PATH": str(conf)})):
        res = jbench_cli(["run", *args, "model=mine", "--dry-run"], env_extra={**env, **extra}, cwd=tmp_path)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "mine Q4_0" in res.stdout, res.stdout
        info = jbench_cli(["run", *args, "--info"], env_extra={**env, **extra}, cwd=tmp_path)
        assert info.returncode == 0 and f"file://{conf}" in info.stdout, info.stdout + info.stderr


# -- the model is named from what was measured (item 12) ------------------------------------------------------------

def _renamed_copy(src: str, dst: Path, name: bytes) -> Path:
    """A copy of a GGUF file whose general.name is `name` (as long as the old one: the header keeps its layout)."""
    import shutil
    import struct

    shutil.copyfile(src, dst)
    with open(dst, "r+b") as f:
        head = f.read(1 << 16)
        key = head.index(b"general.name") + len(b"general.name")
        vtype, length = struct.unpack_from("<IQ", head, key)
        assert vtype == 8 and length == len(name), (vtype, length)  # a string of the same length
        f.seek(key + 12)
        f.write(name)
    return dst


def test_another_models_file_is_recorded_under_its_own_name(tmp_path, llama_build, bundled_model):
    # "Another model": the bundled weights under another general.name ("Gemma 3 270m" has 12 characters too).
    other = _renamed_copy(bundled_model["Q4_0"]["path"], tmp_path / "llama-3.2-1b-Q4_0.gguf", b"Llama 3.2 1B")
    from jbench.models.gguf import scalars

    assert scalars(other)["general.name"] == "Llama 3.2 1B"
    results = tmp_path / "results"
    res = jbench_cli(["run", "model.source=files", f"model.path_template={other}", "model.quant=Q4_0", *TINY,
                      "device.bandwidth_gbs=30"],
                     env_extra={"JBENCH_RESULTS_DIR": str(results)}, cwd=tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "model.name=llama_3_2_1b (was gemma3_270m)" in out
    (run,) = _trial_runs(results)
    assert run.data.params["model.name"] == "llama_3_2_1b", run.data.params
    assert "gemma3_270m" not in run.info.run_name and "gemma3_270m" not in run.data.params.values()
    assert run.data.metrics["decode_tps"] > 0


def test_the_bundled_models_own_file_keeps_its_name(tmp_path, bundled_model):
    res = jbench_cli(["run", "model.source=files", f"model.path_template={bundled_model['Q8_0']['path']}",
                      "model.quant=Q8_0", "--dry-run"], env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "r")},
                     cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "gemma3_270m Q8_0" in res.stdout and "model.name=" not in res.stdout + res.stderr


# -- tegrastats logs as they are found (item 15) --------------------------------------------------------------------

def _parse(path: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("jbench")
    return subprocess.run([str(exe), "telemetry", "parse", path, "--format", "csv"], input=stdin,
                          capture_output=True, timeout=120)


def _counts(res: subprocess.CompletedProcess) -> tuple[int, int]:
    m = re.search(r"(\d+) samples, (\d+) unparseable line\(s\) skipped", res.stderr.decode())
    assert m, res.stderr.decode()
    return int(m.group(1)), int(m.group(2))


def test_telemetry_parse_reads_gzip_and_counts_undecodable_lines(tmp_path):
    plain = _parse(str(TEGRASTATS))
    assert plain.returncode == 0, plain.stderr.decode()
    samples, skipped = _counts(plain)
    assert samples > 0
    rotated = tmp_path / "tegrastats.log.1.gz"
    rotated.write_bytes(gzip.compress(TEGRASTATS.read_bytes()))
    for res in (_parse(str(rotated)), _parse("-", stdin=rotated.read_bytes())):
        assert res.returncode == 0, res.stderr.decode()
        assert res.stdout == plain.stdout and _counts(res) == (samples, skipped)
    # One line with bytes that are not UTF-8 (a serial console's noise): counted, the rest parsed as before.
    noisy = tmp_path / "tegrastats.log"
    noisy.write_bytes(TEGRASTATS.read_bytes() + b"RAM 1234/7620MB \xff\xfe\x80 garbled\n")
    res = _parse(str(noisy))
    assert res.returncode == 0 and b"Traceback" not in res.stderr, res.stderr.decode()
    assert res.stdout == plain.stdout and _counts(res) == (samples, skipped + 1)


def test_a_gzip_log_cut_short_keeps_the_lines_before_the_cut(tmp_path):
    text = TEGRASTATS.read_bytes() * 200
    whole = gzip.compress(text)
    cut = tmp_path / "tegrastats.log.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    res = _parse(str(cut))
    err = res.stderr.decode()
    assert res.returncode == 0 and "Traceback" not in err, err
    samples, _ = _counts(res)
    full_samples, _ = _counts(_parse(str(TEGRASTATS)))
    assert 0 < samples < full_samples * 200
    assert "the gzip data ends early or is damaged" in err


# -- a timeout names the backend's command and the limit (item 17) --------------------------------------------------

def test_a_timeout_names_the_backend_command_and_the_limit(tmp_path, llama_build, bundled_model):
    results = tmp_path / "results"
    # 20 x 512 prompt tokens take far longer than a second on any machine this suite runs on.
    res = jbench_cli(["run", "model.quant=Q4_0", "backend.n_prompt=512", "backend.n_gen=16", "backend.repetitions=20",
                      "backend.timeout_s=1", "telemetry.source=none", "thermal.start_below_c=null"],
                     env_extra={"JBENCH_RESULTS_DIR": str(results), "COLUMNS": "80"}, cwd=tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 4, out
    (run,) = _trial_runs(results)
    assert run.data.tags["jbench.failure_category"] == "timeout"
    reason = run.data.tags["jbench.failure_reason"]
    assert reason.startswith("llama-bench did not finish within backend.timeout_s=1 s: llama-bench -m "), reason
    assert "\n" not in reason and "EPOCHREALTIME" not in reason and "bash" not in reason
    assert "llama-bench did not finish within backend.timeout_s=1 s" in re.sub(r"\s+", " ", out)
    assert "EPOCHREALTIME" not in out


# -- edge values that mean something stay valid (item 18) -----------------------------------------------------------

def test_edge_values_that_mean_something_are_accepted(tmp_path):
    res = jbench_cli(["run", "backend.n_gpu_layers=-1", "thermal.start_below_c=null", "sweep.max_cv=0",
                      "telemetry.idle_s=0", "--dry-run"], env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "r")},
                     cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
