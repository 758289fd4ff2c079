"""What `jbench` prints, read the way users read it: in a terminal 80 or 140 columns wide, piped into a file (stdout
a file, as cron and CI run it), and as md/csv/json/jsonl for tools. Real sweeps with the bundled model, through
the real CLI."""

from __future__ import annotations

import csv
import io
import json
import re
import subprocess
from pathlib import Path

import pytest

from .conftest import jbench_cli

pytestmark = pytest.mark.e2e

# Small and quick, yet two repetitions (so a standard deviation exists); wait for the device lease of a
# concurrent sweep instead of refusing.
TINY = ["backend.n_prompt=16", "backend.n_gen=4", "backend.repetitions=2", "device.lease_wait_s=600"]
LADDER = ["sweep", "+experiment=quant_ladder", "model.quant=Q4_0,Q8_0", *TINY]


def _piped(args: list[str], tmp_path: Path, columns: str | None = None, env: dict | None = None):
    """Run the CLI with stdout and stderr redirected to files (not a terminal), like `jbench ... > log`."""
    import os
    import sys

    e = dict(os.environ)
    e.pop("COLUMNS", None)  # rich decides the width itself: 80 for a pipe
    e["JBENCH_RESULTS_DIR"] = str(tmp_path / "results")
    if columns:
        e["COLUMNS"] = columns
    e.update(env or {})
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with open(out, "w") as fo, open(err, "w") as fe:
        rc = subprocess.run([str(Path(sys.executable).with_name("jbench")), *args], stdout=fo, stderr=fe, env=e,
                            cwd=tmp_path, timeout=600).returncode
    return rc, out.read_text(), err.read_text()


def _table_rows(stdout: str) -> dict[str, str]:
    """Summary rows by trial number (a row starts with the number)."""
    return {m.group(1): line for line in stdout.splitlines() if (m := re.match(r"^\s*(\d+)\s{2,}", line))}


@pytest.mark.slow
@pytest.mark.parametrize("columns", [None, "80", "140"], ids=["pipe", "80-columns", "140-columns"])
def test_summary_table_says_which_row_is_which(tmp_path, llama_build, bundled_model, columns):
    rc, stdout, stderr = _piped(LADDER, tmp_path, columns)
    assert rc == 0, stdout + stderr
    width = int(columns or 80)
    rows = _table_rows(stdout)
    assert set(rows) == {"1", "2"}, stdout
    # The table fits the width (messages may be longer: they are never hard-wrapped, so they stay greppable).
    # The header lines name the rates; the choice line under the table ("decode 57.5 tok/s ...") is a message.
    header = [line for line in stdout.splitlines()
              if ("prefill tok/s" in line or "mean ± sd" in line) and not line.lstrip().startswith(("quality:", "mean ± sd:"))]
    assert header, stdout
    table = header + list(rows.values())
    assert max(len(line.rstrip()) for line in table) <= width, stdout
    # Each row names its quant, the only dimension that varies, and keeps its numbers whole: mean ± sd.
    for n, quant in (("1", "Q4_0"), ("2", "Q8_0")):
        assert re.search(rf"\b{quant}\b", rows[n]) and "FINISHED" in rows[n], stdout
        assert len(re.findall(r"\d+\.\d+ ± \d+\.\d+", rows[n])) == 2, stdout
        assert re.search(r"\b[0-9a-f]{8}\b", rows[n]), stdout  # the run-id prefix compare accepts
    assert "model.quant=" not in "".join(rows.values())
    # ± is labelled, and the pp/tg sizes are shown.
    assert "pp16" in stdout and "tg4" in stdout and "standard deviation" in stdout
    assert "over 2 repetitions" in stdout
    # In a pipe the progress is plain lines, no bar left half drawn; MLflow's own log lines stay out.
    assert "━" not in stdout + stderr and "\r" not in stdout + stderr
    assert "trial 2/2 Q8_0: FINISHED" in stdout
    assert "INFO mlflow" not in stdout + stderr


@pytest.mark.slow
def test_noisy_marker_is_printed_not_swallowed_as_markup(tmp_path, llama_build, bundled_model):
    # max_cv=0 tags every trial with a non-zero spread noisy.
    rc, stdout, stderr = _piped(["run", *TINY, "sweep.max_cv=0"], tmp_path)
    assert rc == 0, stdout + stderr
    # The mark is a `*` after the status (one line per trial at 80 columns), explained under the table.
    (row,) = _table_rows(stdout).values()
    assert "FINISHED*" in row and "*: noisy" in stdout, stdout


@pytest.mark.slow
def test_json_output_is_the_whole_stdout(tmp_path, llama_build, bundled_model):
    rc, stdout, stderr = _piped([*LADDER, "-o", "json"], tmp_path)
    assert rc == 0, stdout + stderr
    rows = json.loads(stdout)  # nothing else on stdout: messages and progress went to stderr
    assert [r["model.quant"] for r in rows] == ["Q4_0", "Q8_0"]
    for r in rows:
        assert r["status"] == "FINISHED" and len(r["run_id"]) == 32
        assert r["decode_tps"] > 0 and r["prefill_tps"] > 0 and r["decode_tps_std"] is not None
        assert r["n_prompt"] == 16 and r["n_gen"] == 4
    assert "tracking to" in stderr and "trial 2/2" in stderr

    # `compare` takes the 8-character prefixes the summary prints; its markdown is never hard-wrapped.
    a, b = rows[0]["run_id"][:8], rows[1]["run_id"][:8]
    res = jbench_cli(["compare", a, b], env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "results"),
                                                   "COLUMNS": "80"}, cwd=tmp_path)
    # Q4_0 and Q8_0 are different configurations: the prefixes resolved, and the error names the fix.
    assert res.returncode == 2 and "no configuration in common" in res.stderr, res.stdout + res.stderr
    assert "compare along it with --along model.quant" in res.stderr, res.stderr
    res = jbench_cli(["compare", a, b, "--along", "model.quant"],
                     env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "results")}, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    table = [line for line in res.stdout.splitlines() if line.startswith("|")]
    assert len(table) >= 3 and all(line.endswith("|") for line in table), res.stdout
    assert len({line.count("|") for line in table}) == 1, res.stdout  # no row split across lines
    assert max(len(line) for line in table) > 80  # as long as it needs to be, in a pipe too


@pytest.mark.slow
def test_csv_output_parses_with_one_row_per_trial(tmp_path, llama_build, bundled_model):
    rc, stdout, stderr = _piped(["run", *TINY, "-o", "csv", "--results-dir", str(tmp_path / "elsewhere")], tmp_path)
    assert rc == 0, stdout + stderr
    rows = list(csv.DictReader(io.StringIO(stdout)))
    assert len(rows) == 1 and rows[0]["status"] == "FINISHED" and float(rows[0]["decode_tps"]) > 0
    # --results-dir after the command name set tracking.results_dir
    assert (tmp_path / "elsewhere" / "mlflow.db").is_file() and not (tmp_path / "results").exists()


@pytest.mark.parametrize("fmt", ["md", "csv", "json", "jsonl"])
def test_every_format_parses_for_a_planned_sweep(tmp_path, fmt):
    res = jbench_cli(["sweep", "+experiment=quant_ladder", "backend.n_gen=64,128", "--dry-run", "-o", fmt],
                     env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "results")}, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    if fmt == "json":
        rows = json.loads(out)
    elif fmt == "jsonl":
        rows = [json.loads(line) for line in out.splitlines()]
    elif fmt == "csv":
        rows = list(csv.DictReader(io.StringIO(out)))
    else:
        lines = out.splitlines()
        assert all(line.startswith("|") and line.endswith("|") for line in lines), out
        assert re.fullmatch(r"\|(-+:?\|)+", lines[1]), out
        header = [c.strip() for c in lines[0].strip("|").split("|")]
        rows = [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]
        assert {len(line.split("|")) for line in lines} == {len(lines[0].split("|"))}
    assert len(rows) == 12
    assert {r["status"] for r in rows} == {"PLANNED"}
    if fmt != "md":
        assert {str(r["model.quant"]) for r in rows} == {"Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "F16"}
        assert {str(r["backend.n_gen"]) for r in rows} == {"64", "128"}
    else:
        assert "Q4_0 n_gen=64" in {r["label"] for r in rows}
    assert not (tmp_path / "results").exists()


def test_cfg_prints_the_config_and_runs_nothing(tmp_path):
    env = {"JBENCH_RESULTS_DIR": str(tmp_path / "results")}
    res = jbench_cli(["sweep", "+experiment=quant_ladder", "--cfg", "job", "-p", "sweep.grid"], env_extra=env,
                     cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("model.quant:") and "- Q4_K_M" in res.stdout
    res = jbench_cli(["sweep", "+experiment=quant_ladder", "model.quant=Q4_0,Q8_0", "--cfg", "sweep", "-p",
                      "model.quant"], env_extra=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    docs = res.stdout.split("---\n")
    assert len(docs) == 2 and docs[0].rstrip().endswith("Q4_0") and docs[1].rstrip().endswith("Q8_0")
    # -v and --results-dir before or after the command name
    res = jbench_cli(["-v", "--results-dir", str(tmp_path / "a"), "run", "--cfg", "job", "-p", "tracking.results_dir"],
                     env_extra=env, cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.strip() == str(tmp_path / "a"), res.stdout + res.stderr
    assert "DEBUG" in res.stderr
    res = jbench_cli(["run", "--cfg", "job", "-p", "tracking.results_dir", "--results-dir", str(tmp_path / "b"), "-v"],
                     env_extra=env, cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.strip() == str(tmp_path / "b"), res.stdout + res.stderr
    res = jbench_cli(["sweep", "--info", "+experiment=quant_ladder", "--config-dir", str(tmp_path)], env_extra=env,
                     cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert f"file://{tmp_path}" in res.stdout and "experiment: quant_ladder" in res.stdout
    assert not (tmp_path / "results").exists() and not (tmp_path / "a").exists()


def test_shared_options_are_accepted_by_every_command(tmp_path):
    for cmd in (["sweep"], ["run"], ["setup"], ["report"], ["compare"], ["regress"], ["export"], ["ui"],
                ["devices", "list"], ["devices", "check"], ["devices", "restore"], ["doctor"], ["calibrate"],
                ["roofline"], ["telemetry", "parse"], ["trace", "analyze"], ["nightly"]):
        res = jbench_cli([*cmd, "--help"], cwd=tmp_path)
        assert res.returncode == 0 and "--results-dir" in res.stdout and "--verbose" in res.stdout, cmd


@pytest.mark.slow
def test_regress_without_enough_data_gives_no_verdict(tmp_path, llama_build, bundled_model):
    env = {"JBENCH_RESULTS_DIR": str(tmp_path / "results")}
    res = jbench_cli(["run", *TINY], env_extra=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    res = jbench_cli(["regress", "--experiment", "adhoc"], env_extra=env, cwd=tmp_path)
    assert res.returncode == 3, res.stdout + res.stderr
    assert res.stdout.startswith("# jbench regress: NO VERDICT: insufficient data for 1 of 1 configuration(s)")
    assert "NO VERDICT" in res.stderr and "OK" not in res.stdout.splitlines()[0]
