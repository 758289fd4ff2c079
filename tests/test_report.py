"""Reports from real MLflow stores: a real small sweep through the `jbench` CLI, and a store written with
Tracker the way the runner writes it (every plot's data present). PNGs must be valid images, the HTML
must carry them inline with no external resource, and headless Chromium must render it without a
console message. Screenshots are saved in the test's tmp dir and copied to $JBENCH_TEST_ARTIFACTS when set."""

from __future__ import annotations

import base64
import html
import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from jbench.analysis.roofline import bytes_per_weight, dominant_ggml_type
from jbench.reporting.report import bits_per_weight, build_report, export_frame, pareto_frontier
from jbench.tracking.writer import Tracker
from jbench.tracking.reader import repetition_samples, runs_frame, telemetry_frame

from .conftest import jbench_cli

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------------------------
# helpers


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        exe = shutil.which(name)
        if exe:
            return exe
    pytest.fail("headless Chromium is needed for the report test: apt-get install chromium")


def render_in_chromium(html: Path, tmp: Path, name: str) -> tuple[Path, list[str]]:
    """Screenshot of the page and every console line Chromium logged while loading it."""
    shot = tmp / f"{name}.png"
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--no-first-run", "--disable-sync", f"--user-data-dir={tmp / f'profile-{name}'}",
           f"--screenshot={shot}", "--window-size=1280,2000", "--enable-logging=stderr", "--v=0", html.as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    console = [line for line in proc.stderr.splitlines()
               if ":CONSOLE" in line or "Uncaught" in line or "ERROR:CONSOLE" in line]
    assert shot.exists(), f"Chromium wrote no screenshot (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    artifacts = os.environ.get("JBENCH_TEST_ARTIFACTS")
    if artifacts:
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(artifacts) / shot.name)
    return shot, console


def assert_valid_png(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE), path
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        im.load()
        assert im.width > 100 and im.height > 100
        extrema = im.convert("L").getextrema()
        assert extrema[0] < extrema[1], f"{path} is a blank image"
        return im.size


def assert_self_contained(html_text: str, pngs: dict[str, Path]) -> None:
    """Every PNG inline as a data URI, nothing fetched from anywhere, no script."""
    assert "<script" not in html_text.lower()
    for attr, value in re.findall(r'\b(src|href)="([^"]*)"', html_text):
        assert value.startswith("data:image/png;base64,") or value.startswith("#"), (attr, value[:80])
    assert "url(" not in html_text and "@import" not in html_text
    inline = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html_text)
    assert sorted(base64.b64decode(b) for b in inline) == sorted(p.read_bytes() for p in pngs.values())


# --------------------------------------------------------------------------------------------
# pure helpers


def test_bits_per_weight_and_pareto():
    assert bits_per_weight("Q4_K_M") == pytest.approx(bytes_per_weight(dominant_ggml_type("Q4_K_M")) * 8) == 4.5
    assert bits_per_weight("Q8_0") == 8.5 and bits_per_weight("F16") == 16
    # (power, speed): (10, 5) is dominated by (9, 6); (12, 6) is dominated by (9, 6).
    assert pareto_frontier([5, 9, 10, 12, 20], [3, 6, 5, 6, 9]) == [0, 1, 4]


@pytest.mark.e2e
def test_chromium_console_capture_is_not_vacuous(tmp_path):
    page = tmp_path / "bad.html"
    page.write_text('<!DOCTYPE html><html><body><p>x</p><script>console.error("boom"); null.f();</script></body></html>')
    _, console = render_in_chromium(page, tmp_path, "control")
    assert any("boom" in line for line in console) and any("Uncaught" in line for line in console)


# --------------------------------------------------------------------------------------------
# a real sweep through the CLI


def _file_bpw(path: str) -> float:
    """The file's real bits per weight, read with gguf's own reader (not jbench's)."""
    from gguf import GGUFReader

    tensors = GGUFReader(path).tensors
    return 8 * sum(int(t.n_bytes) for t in tensors) / sum(int(t.n_elements) for t in tensors)


def _alt(html_text: str, stem: str) -> str:
    return html.unescape(re.search(rf'<img alt="({stem}: [^"]*)"', html_text).group(1))


@pytest.mark.e2e
def test_report_from_a_real_sweep(tmp_path, llama_build, bundled_model):
    results = tmp_path / "results"
    quants = ["Q4_0", "Q4_K_M", "Q8_0"]  # Q4_0 and Q4_K_M share their main type's 4.5 bits
    # One llama.cpp thread (spinning threads stall each other on shared cores); the smallest quality context that
    # scores llama-perplexity's 100 tokens: the report draws the quality figures, their precision is not tested here.
    res = jbench_cli(["sweep", "+experiment=quant_ladder", f"model.quant={','.join(quants)}", "backend.n_prompt=16",
                      "backend.n_gen=4", "backend.repetitions=2", "backend.threads=1", "quality.context=256",
                      "device.lease_wait_s=600"],
                     env_extra={"JBENCH_RESULTS_DIR": str(results), "MLFLOW_TRACKING_URI": ""})
    assert res.returncode == 0, res.stdout + res.stderr
    sweep_id = re.search(r"sweep (\d{8}-\d{6}-[0-9a-f]{6})", res.stdout).group(1)
    uri = f"sqlite:///{results}/mlflow.db"

    df = runs_frame(uri, ["quant_ladder"], kinds=("trial", "sweep"))
    assert list(df.columns[:5]) == ["run_id", "experiment", "status", "start_time", "end_time"]
    trials = df[df["tags.jbench.kind"] == "trial"]
    assert len(df) == 4 and len(trials) == 3
    assert set(trials["params.model.quant"]) == set(quants)
    assert str(df["start_time"].dtype).startswith("datetime64") and (df["end_time"] >= df["start_time"]).all()
    assert (trials["metrics.decode_tps"] > 0).all() and trials["tags.jbench.config_hash"].str.len().eq(16).all()
    bpw = {q: _file_bpw(bundled_model[q]["path"]) for q in quants}
    for q, recorded in zip(trials["params.model.quant"], trials["metrics.roofline_bits_per_weight"]):
        assert recorded == pytest.approx(bpw[q], rel=1e-9)
    samples = {m: repetition_samples(uri, trials["run_id"], m) for m in ("decode_tps_rep", "prefill_tps_rep")}
    for run_id, row in trials.set_index("run_id").iterrows():
        reps = samples["decode_tps_rep"][run_id]
        # Two repetitions, plus the settle repetition where it was not set aside as cold.
        assert len(reps) == row["metrics.decode_repetitions"] in (2, 3)
        assert np.mean(reps) == pytest.approx(row["metrics.decode_tps"])

    # The sweep's summary table in MLflow: no dotted column name (the UI's table would read it as a path).
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    parent = df.loc[df["tags.jbench.kind"] == "sweep", "run_id"].item()
    table = json.loads(Path(client.download_artifacts(parent, "summary.json", str(tmp_path / "dl"))).read_text())
    assert not [c for c in table["columns"] if "." in c], table["columns"]
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]
    assert sorted(r["model_quant"] for r in rows) == sorted(quants)

    # The report through the CLI, as a user makes it.
    rep = jbench_cli(["report", "--sweep", sweep_id, "--out", str(tmp_path / "cli-report"), "--no-log"],
                     env_extra={"JBENCH_RESULTS_DIR": str(results), "MLFLOW_TRACKING_URI": ""})
    assert rep.returncode == 0, rep.stdout + rep.stderr
    page = (tmp_path / "cli-report" / "report.html").read_text()
    # The quants on an ordered categorical axis, each at its own position, by the files' real bits per weight;
    # the rate axis from zero.
    alt = _alt(page, "quant_ladder")
    ordered = sorted(quants, key=bpw.get)
    ticks = ", ".join(f"{q} {bpw[q]:.2f} bpw" for q in ordered)
    assert f"x quant, by the file's bits per weight: {ticks};" in alt, alt
    top = float(re.search(r"y decode tok/s: 0 to ([\d.]+)", alt).group(1))
    assert top >= trials["metrics.roofline_decode_tps"].max(), alt  # the ceilings are drawn too
    # The runs table: what every run shares is said once, not a column of identical values.
    runs_text = re.search(r'<h2 id="runs">Runs</h2>\s*<p>(.*?)</p>', page, re.S).group(1)
    assert f"Same for every run: jbench.sweep_id {sweep_id}, device.name local, backend.depth 0" in runs_text
    header = re.search(r'<h2 id="runs">.*?<thead>(.*?)</thead>', page, re.S).group(1)
    assert "sweep_id" not in header and "device.name" not in header and "model.quant" in header

    files = build_report(df, samples, out_dir=tmp_path / "report", title="quant ladder (real sweep)")
    # The ladder's speed plot, and the quality plots (quality_1, ...) the quality stage's figures make.
    assert "quant_ladder" in files.pngs and all(k == "quant_ladder" or k.startswith("quality_") for k in files.pngs)
    assert any(k.startswith("quality_") for k in files.pngs), sorted(files.pngs)
    for png in files.pngs.values():
        assert_valid_png(png)
    html_text = files.html_path.read_text()
    assert_self_contained(html_text, files.pngs)
    assert "not enough data for context scaling" in html_text and "not enough data for power modes" in html_text
    md = files.markdown_path.read_text()
    assert "![quant_ladder](quant_ladder.png)" in md and all(f"| {q} |" in md for q in quants)

    shot, console = render_in_chromium(tmp_path / "cli-report" / "report.html", tmp_path, "report_real_sweep")
    assert console == [], "\n".join(console)
    width, height = assert_valid_png(shot)
    assert (width, height) == (1280, 2000)

    # export: the same frame as Parquet and CSV.
    pq = export_frame(df, tmp_path / "runs.parquet")
    back = pd.read_parquet(pq)
    assert back.shape == df.shape and list(back.columns) == list(df.columns)
    assert back["metrics.decode_tps"].tolist() == pytest.approx(df["metrics.decode_tps"].tolist(), nan_ok=True)
    csv = export_frame(df, tmp_path / "runs.csv")
    assert pd.read_csv(csv).shape == df.shape
    with pytest.raises(ValueError, match="parquet, .pq or .csv"):
        export_frame(df, tmp_path / "runs.xlsx")


# --------------------------------------------------------------------------------------------
# a store written with Tracker, as the runner writes it: every plot has its data


QUANTS = ["Q4_0", "Q4_K_M", "Q8_0"]
DEPTHS = [0, 4096]
KV = ["f16", "q8_0"]
MODES = ["MAXN", "15W"]


def _write_store(root: Path) -> tuple[str, dict[str, list[float]]]:
    tracker = Tracker(f"sqlite:///{root}/mlflow.db", root)
    exp = tracker.experiment_id("orin_study")
    sweep_id = "20250301-020000-abc123"
    parent = tracker.start_run(exp, f"sweep {sweep_id}", params={"sweep.overrides": "+experiment=orin_study"},
                               tags={"jbench.kind": "sweep", "jbench.sweep_id": sweep_id,
                                     "finding.kv_q8": "q8_0 KV keeps 97 % of decode speed at depth 4096",
                                     "finding.power": "15W gives the most tokens per joule"})
    rng = np.random.default_rng(0)
    decode_reps: dict[str, list[float]] = {}
    index = 0
    for q in QUANTS:
        for d in DEPTHS:
            for kv in KV:
                for mode in MODES:
                    index += 1
                    label = f"model.quant={q} backend.depth={d} backend.cache_type_k={kv} power.mode={mode}"
                    params = {"model.name": "qwen3_4b", "model.quant": q, "backend.name": "llamacpp",
                              "backend.depth": d, "backend.cache_type_k": kv, "backend.cache_type_v": kv,
                              "backend.n_prompt": 512, "backend.n_gen": 128, "backend.repetitions": 5,
                              "power.mode": mode, "device.name": "orin-nx"}
                    ceiling = 102e9 / (4e9 * bits_per_weight(q) / 8 + d * 147456 * (1.0 if kv == "f16" else 0.53))
                    rate = ceiling * (0.6 if mode == "MAXN" else 0.45)
                    decode = list(rate * (1 + rng.normal(0, 0.01, 5)))
                    prefill = list(rate * 15 * (1 + rng.normal(0, 0.02, 5)))
                    power = (15.0 if mode == "MAXN" else 9.5) * (1 + rng.normal(0, 0.01))
                    run = tracker.start_run(exp, f"{index:03d} {label}", parent_run_id=parent, params=params, tags={
                        "jbench.kind": "trial", "jbench.sweep_id": sweep_id, "jbench.config_hash": f"{index:016x}",
                        "jbench.trial_label": label, "jbench.trial_index": index, "device.name": "orin-nx",
                        "model.quant": q, "backend.build_commit": "b4500a1", "jetson.jetpack": "6.2"})
                    tracker.log(run, metrics={
                        "decode_tps": float(np.mean(decode)), "decode_tps_std": float(np.std(decode, ddof=1)),
                        "prefill_tps": float(np.mean(prefill)), "prefill_tps_std": float(np.std(prefill, ddof=1)),
                        "decode_avg_power_w": power, "decode_tokens_per_joule": float(np.mean(decode)) / power,
                        "roofline_decode_tps": ceiling, "roofline_fraction": float(np.mean(decode)) / ceiling,
                    }, stepped={"decode_tps_rep": decode, "prefill_tps_rep": prefill}, tags={"jbench.status": "FINISHED"})
                    if index <= 2:  # telemetry artifacts as the runner writes them
                        tracker.log_texts(run, _telemetry_artifacts(index))
                    tracker.end_run(run, "FINISHED")
                    decode_reps[run] = decode
    # One failed trial: listed in the runs table, in no plot.
    failed = tracker.start_run(exp, "025 model.quant=F16", parent_run_id=parent, params={"model.quant": "F16"},
                               tags={"jbench.kind": "trial", "jbench.sweep_id": sweep_id, "jbench.config_hash": "f" * 16,
                                     "jbench.failure_reason": "out of memory"})
    tracker.end_run(failed, "FAILED")
    tracker.end_run(parent, "FAILED")
    return tracker.uri, decode_reps


def _telemetry_artifacts(k: int) -> dict[str, str]:
    """telemetry/samples.csv and telemetry/windows.json of one run, on a device clock (epoch seconds)."""
    t0 = 1_740_794_400.0 + 100 * k
    t = t0 + np.arange(0, 12, 0.1)
    rel = t - t0
    samples = pd.DataFrame({"t": t, "power_w": np.where(rel < 2, 4.0, 14.0 - k) + np.sin(rel),
                            "gpu_load_pct": np.where(rel < 2, 0.0, 99.0),
                            "gpu_freq_mhz": np.where(rel < 2, 306.0, 918.0), "temp_max_c": 45 + rel * 0.8})
    windows = [{"phase": "idle", "start": t0, "end": t0 + 2, "tokens": 0, "source": "speed"},
               {"phase": "prefill", "start": t0 + 2, "end": t0 + 5, "tokens": 512, "source": "speed"},
               {"phase": "decode", "start": t0 + 5, "end": t0 + 11, "tokens": 128, "source": "speed"}]
    return {"telemetry/samples.csv": samples.to_csv(index=False), "telemetry/windows.json": json.dumps(windows)}


@pytest.mark.e2e
def test_report_with_every_section(tmp_path):
    uri, decode_reps = _write_store(tmp_path / "results")
    df = runs_frame(uri, ["orin_study"], kinds=("trial", "sweep"))
    assert len(df) == 26 and (df["status"] == "FAILED").sum() == 2
    # params stay strings, as MLflow stores them
    assert set(df["params.backend.depth"].dropna()) == {"0", "4096"}
    assert df.loc[df["tags.jbench.kind"] == "sweep", "tags.finding.power"].notna().all()
    trials = df[(df["tags.jbench.kind"] == "trial") & (df["status"] == "FINISHED")]
    samples = repetition_samples(uri, trials["run_id"])  # decode_tps_rep by default
    assert set(samples) == set(decode_reps)
    for run_id, values in decode_reps.items():
        assert samples[run_id] == pytest.approx(values)
    # The SQL read and the search_runs read give the same frame (a NaN metric included).
    nan_run = trials["run_id"].iloc[0]
    Tracker(uri, tmp_path / "results").client.log_metric(nan_run, "nan_metric", float("nan"))
    for sel in ({"kinds": None}, {"kinds": ("trial",), "tag_filters": {"model.quant": "Q4_0"}},
                {"sweep_ids": ["20250301-020000-abc123"], "run_ids": list(df["run_id"][:5]), "kinds": None}):
        fast = runs_frame(uri, ["orin_study"], method="sql", **sel)
        pd.testing.assert_frame_equal(fast, runs_frame(uri, ["orin_study"], method="search", **sel))
    full = runs_frame(uri, ["orin_study"], kinds=None).set_index("run_id")
    assert math.isnan(full.loc[nan_run, "metrics.nan_metric"]) and full["metrics.nan_metric"].isna().all()
    # Selection by sweep, run ids and tags.
    assert len(runs_frame(uri, run_ids=list(trials["run_id"][:3]))) == 3
    assert len(runs_frame(uri, sweep_ids=["20250301-020000-abc123"], kinds=None)) == 26
    assert len(runs_frame(uri, tag_filters={"model.quant": "Q8_0"})) == 8
    assert runs_frame(uri, sweep_ids=["nope"]).empty

    telemetry = telemetry_frame(uri, trials["run_id"])  # the two runs that have telemetry artifacts
    assert telemetry["run_id"].nunique() == 2 and len(telemetry) == 240
    assert {"t", "power_w", "gpu_freq_mhz", "temp_max_c"} <= set(telemetry.columns)
    assert [w["phase"] for w in telemetry.attrs["phases"]] == ["idle", "prefill", "decode"] * 2
    files = build_report(df, samples, telemetry, out_dir=tmp_path / "report", title="Orin NX study")
    assert set(files.pngs) == {"quant_ladder", "context_scaling", "power_modes", "telemetry_1", "telemetry_2"}
    for png in files.pngs.values():
        assert_valid_png(png)
    html_text = files.html_path.read_text()
    assert_self_contained(html_text, files.pngs)
    assert "not enough data" not in html_text
    for text in ("Quant ladder", "Context scaling", "Power modes", "Telemetry timelines", "Findings",
                 "q8_0 KV keeps 97 % of decode speed at depth 4096", "15W gives the most tokens per joule",
                 "out of memory", "roofline_decode_tps", "pareto", "decode_tokens_per_joule", "bits_per_weight"):
        assert text in html_text, text
    md = files.markdown_path.read_text()
    for stem in files.pngs:
        assert f"]({stem}.png)" in md
    assert "kv_q8" in md and "| Q8_0 |" in md

    # No file bits per weight in this store: the quants by their main type's figure, Q4_0 and Q4_K_M apart.
    assert "x quant, by bits per weight of its main ggml type (~): Q4_0 ~4.5 bpw, Q4_K_M ~4.5 bpw, Q8_0 ~8.5 bpw;" \
        in _alt(html_text, "quant_ladder")
    for stem, rate in (("quant_ladder", "decode tok/s"), ("context_scaling", "decode tok/s"),
                       ("context_scaling", "prefill tok/s"), ("power_modes", "decode tok/s"),
                       ("power_modes", "decode tokens per joule")):
        assert re.search(rf"y {rate}: 0 to \d", _alt(html_text, stem)), (stem, rate, _alt(html_text, stem))

    shot, console = render_in_chromium(files.html_path, tmp_path, "report_every_section")
    assert console == [], "\n".join(console)
    assert_valid_png(shot)


def test_report_without_plot_data_says_so(tmp_path):
    df = pd.DataFrame([{"run_id": "r1", "experiment": "e", "status": "FINISHED",
                        "start_time": pd.Timestamp("2025-01-01", tz="UTC"), "end_time": pd.NaT,
                        "params.model.quant": "Q4_0", "metrics.decode_tps": 10.0, "tags.jbench.kind": "trial"}])
    files = build_report(df, out_dir=tmp_path)
    assert files.pngs == {}
    text = files.html_path.read_text()
    for what in ("the quant ladder", "context scaling", "power modes"):
        assert f"not enough data for {what}" in text
    assert "no findings recorded" in text
    md = files.markdown_path.read_text()
    assert "_not enough data for the quant ladder" in md


def test_telemetry_timelines_from_a_phase_column(tmp_path):
    t = np.arange(0, 6, 0.1)
    tel = pd.DataFrame({"t": 1000 + t, "power_w": 5 + t, "temp_c": 40 + t,
                        "phase": np.where(t < 2, "idle", np.where(t < 5, "decode", None))})
    df = pd.DataFrame([{"run_id": "r1", "experiment": "e", "status": "FINISHED",
                        "start_time": pd.Timestamp("2025-01-01", tz="UTC"), "end_time": pd.NaT,
                        "tags.jbench.kind": "trial"}])
    files = build_report(df, telemetry=tel, out_dir=tmp_path)
    assert set(files.pngs) == {"telemetry_1"}
    assert_valid_png(files.pngs["telemetry_1"])
    table = files.markdown_path.read_text()
    assert "| telemetry | idle | 0 | 2 |" in table and "| telemetry | decode | 2 | 5 |" in table  # seconds since start
