"""What a sweep shows of its own results, through the real CLI with the bundled model (issue 24, items 1, 4, 19,
21): a resumed trial's earlier numbers, each scenario's own figures, one line per trial at 80 columns in a pipe
and in a real terminal (tmux), a progress bar whose time left comes from earlier runs, dry-run estimates that
count only what will run, and `jbench ui` printing its link once the server answers, on the experiment last run.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from .conftest import TESTS, jbench_cli

pytestmark = pytest.mark.e2e

JBENCH = str(Path(sys.executable).with_name("jbench"))
# One llama.cpp thread: llama-bench's spinning threads stall each other on cores that other tests share (these tests
# are about what a sweep prints, not its speed).
TINY = ["backend.n_prompt=16", "backend.n_gen=4", "backend.repetitions=2", "backend.threads=1",
        "device.lease_wait_s=600"]
# One quality reference for every sweep of this module: the reference is otherwise the sweep's highest-precision
# quant, so Q4_0 alone (its own reference) and Q4_0 beside Q8_0 would be two quality identities, and no resume.
# The smallest context that scores the 100 tokens llama-perplexity needs (quality.context / 2 - 1 a chunk): the
# ladder's KLD column is in the tables these tests read, its precision is not.
LADDER = ["sweep", "+experiment=quant_ladder", *TINY, "quality.reference=Q8_0", "quality.context=256"]
UNPARSEABLE = TESTS / "fixtures" / "unparseable_llamacpp"  # a llama-bench that prints no records: a FAILED trial


def _piped(args: list[str], results: Path, **env: str) -> tuple[int, str, str]:
    """The CLI with stdout and stderr in files, as cron or `> file` runs it (rich's width: 80)."""
    e = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    e.update({"JBENCH_RESULTS_DIR": str(results), **env})
    out, err = results.parent / "stdout.txt", results.parent / "stderr.txt"
    with open(out, "w") as fo, open(err, "w") as fe:
        rc = subprocess.run([JBENCH, *args], stdout=fo, stderr=fe, env=e, cwd=results.parent, timeout=600).returncode
    return rc, out.read_text(), err.read_text()


class Tmux:
    """jbench in a real terminal of 80 columns: a tmux server of its own, its screen captured while it runs."""

    def __init__(self, tmp: Path, args: list[str], results: Path):
        self.socket = f"jb-{os.getpid()}-{time.monotonic_ns()}"
        self.rc_file = tmp / "tmux-rc"
        env = f"env -u COLUMNS -u LINES JBENCH_RESULTS_DIR={shlex.quote(str(results))}"
        if os.environ.get("PYTHONPATH"):
            env += f" PYTHONPATH={shlex.quote(os.environ['PYTHONPATH'])}"
        command = (f"cd {shlex.quote(str(tmp))} && {env} {shlex.join([JBENCH, *args])}; "
                   f"echo $? > {shlex.quote(str(self.rc_file))}; sleep 600")
        subprocess.run(["tmux", "-L", self.socket, "new-session", "-d", "-x", "80", "-y", "50", "-s", "jb", command],
                       check=True)
        subprocess.run(["tmux", "-L", self.socket, "set-option", "-t", "jb", "history-limit", "5000"], check=True)

    def screen(self) -> str:
        return subprocess.run(["tmux", "-L", self.socket, "capture-pane", "-p", "-t", "jb", "-S", "-5000"],
                              capture_output=True, text=True).stdout

    def wait(self, timeout: float = 600, every: float = 0.2) -> tuple[int, list[str]]:
        """The exit code and every screen seen while it ran."""
        screens = []
        deadline = time.monotonic() + timeout
        while not self.rc_file.exists():
            assert time.monotonic() < deadline, self.screen()
            screens.append(self.screen())
            time.sleep(every)
        time.sleep(0.3)  # the last lines reach the terminal
        screens.append(self.screen())
        return int(self.rc_file.read_text()), screens

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True)


def _rows(text: str) -> dict[str, list[str]]:
    """The summary table's rows by trial number: every line from a row to the next (a wrapped row has several)."""
    rows: dict[str, list[str]] = {}
    current = None
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "─" in line)  # the rule under the header
    for line in lines[start + 1:]:
        if not line.strip():
            break
        m = re.match(r"^\s*(\d+)\s{2,}", line)
        if m:
            current = m.group(1)
            rows[current] = [line]
        elif current is not None:
            rows[current].append(line)
    return rows


def _table_lines(text: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "tok/s" in line or "TTFT" in line)
    end = next(i for i in range(start + 2, len(lines)) if not lines[i].strip())
    return lines[start:end]


# --- item 1: a resumed sweep shows its numbers --------------------------------------------------------------------


@pytest.fixture(scope="module")
def store(tmp_path_factory, llama_build, bundled_model) -> dict:
    """quant_ladder's Q4_0, then an `adhoc` run (the newest experiment), then the ladder again with Q8_0 added
    (Q4_0 resumed): the experiment run last is not the one created last."""
    root = tmp_path_factory.mktemp("summary")
    results = root / "results"
    rc, first, err = _piped([*LADDER, "model.quant=Q4_0", "-o", "json"], results)
    assert rc == 0, first + err
    rc, out, err = _piped(["run", *TINY], results)
    assert rc == 0, out + err
    rc, resumed, err = _piped([*LADDER, "model.quant=Q4_0,Q8_0", "-o", "csv"], results)
    assert rc == 0, resumed + err
    return {"results": results, "first": json.loads(first)[0], "resumed": list(csv.DictReader(io.StringIO(resumed))),
            "resumed_err": err}


def test_resumed_trials_show_their_earlier_numbers_marked(store):
    first, rows = store["first"], store["resumed"]
    assert [r["model.quant"] for r in rows] == ["Q4_0", "Q8_0"]
    earlier, new = rows
    # The earlier run, its numbers, marked as earlier; no failure category or error for a trial that did not fail.
    assert earlier["status"] == "FINISHED (earlier)" and earlier["run_id"] == first["run_id"]
    for key in ("prefill_tps", "prefill_tps_std", "decode_tps", "decode_tps_std"):
        assert float(earlier[key]) == pytest.approx(first[key], rel=1e-5), key
    assert earlier["category"] == "" and earlier["error"] == ""
    assert float(earlier["wall_s"]) == pytest.approx(first["wall_s"], rel=0.01)
    assert new["status"] == "FINISHED" and float(new["decode_tps"]) > 0 and new["run_id"] != first["run_id"]
    assert "trial 1/2 Q4_0: FINISHED earlier (run " + first["run_id"][:8] in store["resumed_err"]
    assert "trial 1/2 Q4_0: running" not in store["resumed_err"]  # it did not run
    assert "trial 2/2 Q8_0: running" in store["resumed_err"]

    # The parent run's summary.json in MLflow says the same.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{store['results']}/mlflow.db")
    exp = client.get_experiment_by_name("quant_ladder")
    parent = client.search_runs([exp.experiment_id], "tags.`jbench.kind` = 'sweep'",
                                order_by=["attributes.start_time DESC"], max_results=1)[0]
    path = client.download_artifacts(parent.info.run_id, "summary.json", str(store["results"].parent / "dl"))
    table = json.loads(Path(path).read_text())
    got = dict(zip(table["columns"], table["data"][0]))
    assert got["status"] == "FINISHED (earlier)" and got["decode_tps"] == pytest.approx(first["decode_tps"], rel=1e-3)


def test_a_fully_resumed_sweep_prints_every_number_one_line_a_trial(store, tmp_path):
    results = store["results"]
    rc, out, err = _piped([*LADDER, "model.quant=Q4_0,Q8_0"], results)
    assert rc == 0, out + err
    assert "nothing run, every trial already FINISHED" in out
    rows = _rows(out)
    assert set(rows) == {"1", "2"} and all(len(lines) == 1 for lines in rows.values()), out
    for line in (rows["1"][0], rows["2"][0]):
        assert re.search(r"\bEARLIER\*?\s", line) and len(re.findall(r"\d+\.\d+ ± \d+\.\d+", line)) == 2, out
    first = store["first"]
    assert f"{first['decode_tps']:.1f}" in rows["1"][0] or f"{first['decode_tps']:.2f}" in rows["1"][0], out
    assert out.count("already FINISHED") == 1 and "resumed:" not in out  # the title; no error text per row
    assert "EARLIER: FINISHED by an earlier sweep" in out
    # md, the format a README shows: status and numbers.
    rc, md, err = _piped([*LADDER, "model.quant=Q4_0,Q8_0", "-o", "md"], results)
    assert rc == 0 and md.count("FINISHED (earlier)") == 2, md + err


# --- item 21: dry-run estimates and `jbench ui` --------------------------------------------------------------------


def test_dry_run_counts_only_what_will_run_and_never_says_zero_minutes(store, tmp_path):
    results = store["results"]
    rc, out, err = _piped([*LADDER, "model.quant=Q4_0,Q8_0,Q6_K", "--dry-run"], results)
    assert rc == 0, out + err
    lines = {m.group(1): line for line in out.splitlines() if (m := re.match(r"^\s+(\d+)\s{2}", line))}
    assert "FINISHED earlier: resume skips it" in lines["1"] and "FINISHED earlier" in lines["2"], out
    assert "no estimate (no earlier run)" in lines["3"], out
    assert "unknown: none of the 1 trial(s) to run has an earlier run" in out and "0.0 min" not in out, out
    assert "2 already FINISHED" in out
    rc, js, err = _piped([*LADDER, "model.quant=Q4_0,Q8_0,Q6_K", "--dry-run", "-o", "json"], results)
    assert rc == 0, js + err
    assert [(r["already_finished"], r["estimate_s"]) for r in json.loads(js)] == [(True, None)] * 2 + [(False, None)]

    # sweep.rerun=true: every trial runs; two have history (their earlier wall times), one has none.
    rc, js, err = _piped([*LADDER, "model.quant=Q4_0,Q8_0,Q6_K", "sweep.rerun=true", "--dry-run", "-o", "json"],
                         results)
    assert rc == 0, js + err
    planned = json.loads(js)
    walls = {r["model.quant"]: float(r["wall_s"]) for r in store["resumed"]}
    assert planned[0]["estimate_s"] == pytest.approx(walls["Q4_0"], abs=0.06)
    assert planned[1]["estimate_s"] == pytest.approx(walls["Q8_0"], abs=0.06) and planned[2]["estimate_s"] is None
    # The line sums the unrounded estimates; the JSON rounds each to 0.1 s, so near a 0.05-minute edge the two
    # can print different tenths: compare the figure, not its text.
    said = re.search(r"more than (\d+\.\d) min for the 3 trial\(s\) to run: 2 take (\d+\.\d) min", err)
    assert said and said.group(1) == said.group(2), err
    assert float(said.group(1)) == pytest.approx((planned[0]["estimate_s"] + planned[1]["estimate_s"]) / 60,
                                                 abs=0.05 + 0.1 / 60), err
    assert "1 have no earlier run (not counted)" in err

    # 900 trials, no history at all: the duration is unknown, not "0.0 min".
    rc, out, err = _piped(["sweep", "+experiment=quant_ladder", "backend.n_prompt=16,32,64,128,256",
                           "backend.n_gen=4,8,16,32,64,128", "backend.threads=1,2,3,4,5", "--dry-run"],
                          tmp_path / "empty")
    assert rc == 0, out + err
    assert "900 trial(s)" in out and "estimated duration: unknown: none of the 900 trial(s)" in out, out[-500:]
    assert "0.0 min" not in out and not (tmp_path / "empty").exists()


def test_ui_prints_its_link_once_the_server_answers_on_the_experiment_last_run(store, tmp_path):
    import socket

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{store['results']}/mlflow.db")
    ladder, adhoc = client.get_experiment_by_name("quant_ladder"), client.get_experiment_by_name("adhoc")
    assert int(adhoc.creation_time) > int(ladder.creation_time)  # adhoc is the newest; quant_ladder ran last
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ui = subprocess.Popen([JBENCH, "ui", "--port", str(port), "--results-dir", str(store["results"])],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = ui.stdout.readline()  # the link line, printed once the server answers
        # The link works the moment it is printed.
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
            assert reply.status == 200, line
        assert line.startswith("MLflow UI: ") and f"/#/experiments/{ladder.experiment_id}/runs" in line, line
    finally:
        ui.send_signal(signal.SIGINT)
        out, err = ui.communicate(timeout=60)
    assert "starting the MLflow UI" in err and "Traceback" not in out + err


# --- items 4 and 19: each scenario's own figures; one line a trial at 80 columns ------------------------------------


def test_latency_scenario_summary_shows_ttft_itl_and_e2e(tmp_path, llama_build, bundled_model):
    args = ["run", "backend.scenario=latency", "backend.latency_requests=16", "model.quant=Q4_0", "backend.threads=1",
            "backend.n_prompt=8", "backend.n_gen=4", "backend.latency_warmup_requests=1", "device.lease_wait_s=600"]
    results = tmp_path / "results"
    rc, out, err = _piped(args, results)
    assert rc == 0, out + err
    # The same trial again, resumed: the same run's figures as JSON.
    rc, js, err2 = _piped([*args, "-o", "json"], results)
    assert rc == 0, js + err2
    row = json.loads(js)[0]
    assert row["status"] == "FINISHED (earlier)" and row["latency_requests"] == 16
    assert row["repetitions"] is None  # repetitions are llama-bench's; a latency trial has requests
    table = "\n".join(_table_lines(out))
    assert "TTFT ms" in table and "ITL ms" in table and "e2e ms" in table and "tok/s" not in table, out
    (line,) = _rows(out)["1"]
    figures = re.findall(r"\d+\.\d+", line)
    expect = [row["ttft_ms_p50"], row["itl_ms_p50"], row["e2e_ms_p50"]]
    assert [float(f) for f in figures] == [pytest.approx(v, abs=0.051 if v >= 10 else 0.0051) for v in expect], line
    assert "median over 16 requests" in out and "repetitions" not in out, out
    rc, md, _ = _piped([*args, "-o", "md"], results)
    assert "ttft_ms_p50" in md.splitlines()[0] and "e2e_ms_p50" in md.splitlines()[0], md


def test_a_sweep_of_both_scenarios_prints_a_table_for_each(tmp_path, llama_build, bundled_model):
    rc, out, err = _piped(["sweep", "backend.scenario=bench,latency", "model.quant=Q4_0",  # TINY: one thread
                           "backend.latency_requests=4", "backend.latency_warmup_requests=1", *TINY],
                          tmp_path / "results")
    assert rc == 0, out + err
    bench, latency = out.split("latency scenario (llama-server)")
    (row,) = _rows(bench).values()
    assert len(re.findall(r"\d+\.\d+ ± \d+\.\d+", row[0])) == 2 and "over 2 repetitions" in bench, out
    (row,) = _rows(latency).values()
    assert len(re.findall(r"\d+\.\d+", row[0])) == 3 and "median over 4 requests" in latency, out
    assert "TTFT ms" in latency and "TTFT" not in bench and "tok/s" not in latency


def _check_80_columns(text: str, n_rows: int) -> dict[str, list[str]]:
    """Every table line fits 80 columns and every trial is one line."""
    table = _table_lines(text)
    assert max(len(line.rstrip()) for line in table) <= 80, text
    rows = _rows(text)
    assert len(rows) == n_rows and all(len(lines) == 1 for lines in rows.values()), text
    return rows


def test_summary_is_one_line_a_trial_at_80_columns_in_a_pipe_and_in_tmux(tmp_path, llama_build, bundled_model):
    # Labels too long for 80 columns (two build directories) and a failure note: cut, with the full text below.
    dims = ["model.quant=Q4_0,Q8_0", f"backend.binary_dir={llama_build['bin_dir']},{UNPARSEABLE}"]
    results = tmp_path / "results"
    rc, out, err = _piped(["sweep", *dims, *TINY], results)
    assert rc == 4, out + err
    for text in (out,):
        rows = _check_80_columns(text, 4)
        assert "FAILED" in rows["2"][0] and "FAILED" in rows["4"][0] and "FINISHED" in rows["1"][0], text
        assert all("…" in rows[n][0] for n in rows), text  # the labels are cut ...
        full = text[text.index("in full:"):]  # ... and given in full below, with the whole failure reason
        assert f"2 Q4_0 binary_dir={UNPARSEABLE}: " in full and "no JSON records in llama-bench output" in full, text
        assert f"1 Q4_0 binary_dir={llama_build['bin_dir']}: " in full

    # The same in a real terminal 80 columns wide: the finished trials resumed, the failed ones run again.
    tmux = Tmux(tmp_path, ["sweep", *dims, *TINY], results)
    try:
        rc, screens = tmux.wait()
    finally:
        tmux.close()
    assert rc == 4, screens[-1]
    rows = _check_80_columns(screens[-1], 4)
    assert "EARLIER" in rows["1"][0] and "FAILED" in rows["2"][0], screens[-1]


def test_progress_bar_eta_comes_from_earlier_runs(tmp_path, llama_build, bundled_model):
    results = tmp_path / "results"
    sweep = [*LADDER, "model.quant=Q4_0,Q8_0"]
    rc, js, err = _piped([*sweep, "-o", "json"], results)
    assert rc == 0, js + err
    total = sum(r["wall_s"] for r in json.loads(js))
    # Measured again in a terminal: the bar's time left is the earlier runs' wall time from the start.
    tmux = Tmux(tmp_path, [*sweep, "sweep.rerun=true"], results)
    try:
        rc, screens = tmux.wait()
    finally:
        tmux.close()
    assert rc == 0, screens[-1]
    bars = [line for s in screens for line in s.splitlines() if re.match(r"^trial \d/2 ", line)]
    assert bars, screens[-1]
    assert not [b for b in bars if "-:--:--" in b], bars
    etas = [re.search(r"ETA (\d+):(\d\d):(\d\d)", b) for b in bars]
    assert all(etas), bars
    h, m, s = map(int, etas[0].groups())
    assert 0 < h * 3600 + m * 60 + s <= total + 1, (bars[0], total)
    _check_80_columns(screens[-1], 2)
