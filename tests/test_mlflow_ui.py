"""The MLflow UI in a real browser, as a jbench user reads a sweep: Playwright drives the system Chromium
(no browser download) against a real `mlflow server` on the store of a real short quant-ladder sweep.

Screenshots land in the test's tmp_path and are copied to test-artifacts/mlflow_ui/ (git-ignored)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from jbench.tracking.common import runs_view_url

from .conftest import REPO, jbench_cli

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CHROMIUM = "/usr/bin/chromium"
QUANTS = ["Q4_0", "Q8_0"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def sweep_store(tmp_path, llama_build, bundled_model) -> Path:
    res = jbench_cli(["sweep", "+experiment=quant_ladder", f"model.quant={','.join(QUANTS)}", "backend.n_prompt=16",
                      "backend.n_gen=4", "backend.repetitions=2", "device.lease_wait_s=600"],
                     env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "results")})
    assert res.returncode == 0, res.stdout + res.stderr
    return tmp_path / "results"


@pytest.fixture
def mlflow_server(sweep_store):
    port = _free_port()
    mlflow = Path(sys.executable).with_name("mlflow")
    log = open(sweep_store / "server.log", "w")
    proc = subprocess.Popen([str(mlflow), "server", "--backend-store-uri", f"sqlite:///{sweep_store}/mlflow.db",
                             "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                             "--artifacts-destination", str(sweep_store / "artifacts")],  # as `jbench ui` serves them
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, (sweep_store / "server.log").read_text()
            assert time.monotonic() < deadline, "mlflow server did not answer /health"
            time.sleep(0.5)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the server and its workers: the group it leads
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def _shots(tmp_path: Path) -> Path:
    out = tmp_path / "screenshots"
    out.mkdir(exist_ok=True)
    return out


def test_a_sweep_reads_in_the_mlflow_ui(sweep_store, mlflow_server, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    client = MlflowClient(f"sqlite:///{sweep_store}/mlflow.db")
    exp = client.get_experiment_by_name("quant_ladder")
    runs = client.search_runs([exp.experiment_id], "tags.`jbench.kind` = 'trial'")
    decode = {r.info.run_name: r.data.metrics["decode_tps"] for r in runs}
    decode_run_ids = {r.info.run_name: r.info.run_id[:8] for r in runs}  # the table shows run ids cut short
    assert sorted(decode) == QUANTS
    shots = _shots(tmp_path)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(60_000)

            # The link jbench gives opens the experiment on its runs, with the experiment's description.
            page.goto(runs_view_url(mlflow_server, exp.experiment_id))
            parent = page.get_by_role("link", name="quant_ladder 20")
            parent.wait_for()
            assert "/runs" in page.url
            expect(page.get_by_text("prefill and decode tok/s, memory and output quality across quantization levels").first).to_be_visible()
            expect(page.get_by_text("Traces 0")).to_have_count(0)
            page.screenshot(path=str(shots / "1-runs.png"))

            # The sweep's children are named by their quant.
            page.locator('.ag-row [col-id="attributes.`Run Name`"] button').first.click()
            for quant in QUANTS:
                expect(page.get_by_role("link", name=quant, exact=True)).to_be_visible()
            page.screenshot(path=str(shots / "2-children.png"))

            # Select the children and open Compare.
            for quant in QUANTS:
                row = page.locator(".ag-row", has=page.get_by_role("link", name=quant, exact=True))
                row.locator("input.ag-checkbox-input").check()
            page.get_by_role("button", name="Compare").click()
            expect(page.get_by_text(f"Comparing {len(QUANTS)} Runs from 1 Experiment")).to_be_visible()
            assert "compare-runs" in page.url
            # The parallel-coordinates plot starts on the parameter that differs: the quant.
            plot = page.locator(".js-plotly-plot").first
            plot.wait_for()
            assert "model.quant" in plot.text_content()
            page.screenshot(path=str(shots / "3-compare-parallel.png"), full_page=True)

            # Scatter: decode_tps against model.quant.
            page.get_by_text("Scatter Plot", exact=True).click()
            combos = page.get_by_role("tabpanel").get_by_role("combobox")
            for i, value in ((0, "model.quant"), (1, "decode_tps")):
                combos.nth(i).click()
                page.keyboard.type(value)
                page.get_by_role("option", name=value, exact=True).click()
            scatter = page.get_by_role("tabpanel").locator(".js-plotly-plot")
            expect(scatter.locator(".g-xtitle")).to_have_text("model.quant")
            expect(scatter.locator(".g-ytitle")).to_have_text("decode_tps")
            expect(scatter.locator(".xtick")).to_have_text(QUANTS)
            # The y axis spans the measured decode rates (its ticks bracket both points).
            ticks = [float(t.replace("\u2212", "-")) for t in scatter.locator(".ytick").all_text_contents()]
            step = ticks[1] - ticks[0]
            assert min(ticks) - step <= min(decode.values()) and max(decode.values()) <= max(ticks) + step, (ticks, decode)
            # The points (drawn with WebGL, so read from the plot's data): each quant at its decode rate.
            traces = scatter.evaluate("e => e.data.map(t => ({x: Array.from(t.x), y: Array.from(t.y)}))")
            points = {x: y for t in traces for x, y in zip(t["x"], t["y"])}
            assert sorted(points) == QUANTS
            for quant in QUANTS:
                assert points[quant] == pytest.approx(decode[quant], rel=1e-6)
            page.screenshot(path=str(shots / "4-compare-scatter.png"), full_page=True)

            # The sweep's summary table, viewed as a table: every column shows its values (a dotted column name,
            # read by the UI as a path into the row, showed empty).
            sweep = client.search_runs([exp.experiment_id], "tags.`jbench.kind` = 'sweep'")[0]
            page.goto(f"{mlflow_server}/#/experiments/{exp.experiment_id}/runs/{sweep.info.run_id}"
                      "/artifacts/summary.json")
            expect(page.get_by_role("columnheader", name="model_quant")).to_be_visible()
            for quant in QUANTS:
                cells = page.get_by_role("row").filter(has_text=decode_run_ids[quant]).get_by_role("cell")
                assert cells.all_text_contents().count(quant) == 2  # the run's name and its model_quant
            page.screenshot(path=str(shots / "5-summary-table.png"), full_page=True)
            browser.close()
    finally:
        keep = REPO / "test-artifacts" / "mlflow_ui"
        shutil.rmtree(keep, ignore_errors=True)
        shutil.copytree(shots, keep)
    assert {p.name for p in shots.iterdir()} == {"1-runs.png", "2-children.png", "3-compare-parallel.png",
                                                "4-compare-scatter.png", "5-summary-table.png"}
