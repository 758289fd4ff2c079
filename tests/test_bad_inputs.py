"""The bad-input table: every bad input a user can type, through the real `jbench` CLI, ends in one clear message
(a single `error:` line naming the problem, at most a short list), exit 2, no traceback, no store created where
none was, and a store that exists left byte for byte as it was. No case runs llama.cpp: bad input is caught first.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import socket
from pathlib import Path

import pytest

from .conftest import jbench_cli
from .gguf_files import broken_model_files

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TINY = ["backend.n_prompt=8", "backend.n_gen=2", "backend.repetitions=2", "device.lease_wait_s=600"]


def _closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _user_conf(root: Path) -> Path:
    """A user's config directory with the mistakes users make in their own YAML."""
    conf = root / "conf"
    (conf / "device").mkdir(parents=True)
    (conf / "model").mkdir()
    (conf / "device" / "typo.yaml").write_text("defaults:\n  - device_schema\n  - _self_\nname: typo\nkind: ssh\n"
                                               "hots: jetson.local\n")
    (conf / "device" / "broken.yaml").write_text("defaults:\n  - device_schema\n  - _self_\nname: broken\n"
                                                 "  kind: [ssh\n")
    (conf / "model" / "missing.yaml").write_text("defaults:\n  - model_schema\n  - _self_\nname: missing\n"
                                                 "quant: Q4_0\nsource: files\nfiles:\n  Q4_0: /nonexistent/m.gguf\n")
    # A device this machine reaches over SSH (planning never connects): model files there are not read here.
    (conf / "device" / "remote.yaml").write_text("defaults:\n  - device_schema\n  - _self_\nname: remote\n"
                                                 "kind: ssh\nhost: 127.0.0.1\n")
    (conf / "experiment").mkdir()
    (conf / "experiment" / "nopkg.yaml").write_text("experiment:\n  name: nopkg\nsweep:\n  grid:\n"
                                                    "    backend.n_gen: [2, 4]\n")  # no `# @package _global_`
    return conf


@pytest.fixture(scope="module")
def broken_models(tmp_path_factory, bundled_model) -> Path:
    """A directory, an empty file, a text file, and the bundled model's file cut in its header and in its data."""
    root = tmp_path_factory.mktemp("models")
    broken_model_files(root, Path(bundled_model["Q4_0"]["path"]))
    return root


@pytest.fixture(scope="module")
def store(tmp_path_factory, llama_build, bundled_model) -> Path:
    """A results directory holding one real finished run (the `nothing lost` cases get a copy of it)."""
    root = tmp_path_factory.mktemp("store")
    res = jbench_cli(["run", *TINY], env_extra={"JBENCH_RESULTS_DIR": str(root / "results")}, cwd=root)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (root / "results" / "mlflow.db").is_file()
    return root / "results"


def _snapshot(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}



def _own_file(name: str) -> list[str]:
    """A user's own model file instead of the bundled one's."""
    return ["model.source=files", "model.name=mine", "model.path_template={models}/" + name]


# (id, argv, text the message must contain, uses the store). "{conf}" is a user config dir with broken files,
# "{closed}" a port nothing listens on, "{out}" a scratch directory, "{models}" the broken model files.
CASES = [
    # keys
    ("backend-key-typo", ["run", "backend.n_gn=3"], "Did you mean backend.n_gen?", False),
    ("backend-key-typo-other-backend", ["run", "backend=engine", "backend.repetitons=2"],
     "Did you mean backend.repetitions?", False),
    ("backend-key-far", ["run", "backend.zzzzzz=1"], "keys of backend 'llamacpp'", False),
    ("section-key-typo", ["run", "telemetry.intervl_ms=50"], "Did you mean telemetry.interval_ms or telemetry.hwmon_interval_ms?", False),
    ("top-level-typo", ["run", "devise.name=x"], "Did you mean device?", False),
    ("wall-meter-without-host", ["run", "wall_power.source=shelly"], "wall_power.source=shelly needs wall_power.host",
     False),
    ("wall-meter-unknown", ["run", "wall_power.source=plug", "wall_power.host=127.0.0.1"],
     "unknown wall_power.source 'plug'", False),
    ("wall-meter-password-unset", ["run", "wall_power.source=tasmota", "wall_power.host=127.0.0.1",
                                   "wall_power.password_env=JB_SURELY_UNSET_PW"], "JB_SURELY_UNSET_PW, which is not set",
     False),
    ("unknown-top-level", ["run", "nonsense=1"], "unknown config key 'nonsense'", False),
    ("experiment-without-plus", ["sweep", "experiment=quant_ladder"], "+experiment=quant_ladder", False),
    ("experiment-unknown", ["sweep", "+experiment=quant_ladr"], "Valid experiment names", False),
    ("experiment-without-package", ["sweep", "--config-dir", "{conf}", "+experiment=nopkg"],
     "must start with the line `# @package _global_`", False),
    ("experiment-twice", ["sweep", "+experiment=quant_ladder", "+experiment=context_sweep"],
     "+experiment is given more than once (quant_ladder, context_sweep)", False),
    ("experiment-twice-same", ["sweep", "+experiment=nightly", "+experiment=nightly"],
     "+experiment is given more than once", False),
    ("delete-key", ["run", "~backend.n_gen"], "set the value you want instead (backend.n_gen=VALUE", False),
    ("delete-group", ["run", "~model"], "pick another with model=NAME", False),
    ("backend-unknown", ["run", "backend=nope"], "Valid backend names", False),
    ("model-unknown", ["run", "model=nope"], "Valid model names", False),
    ("device-unknown", ["run", "device=nope"], "Valid device names", False),
    ("user-yaml-unknown-key", ["run", "--config-dir", "{conf}", "device=typo"], "device/typo.yaml", False),
    ("user-yaml-syntax", ["run", "--config-dir", "{conf}", "device=broken"], "device/broken.yaml:5", False),
    # values
    ("value-type", ["run", "backend.n_gen=abc"], "bad value 'abc' for backend.n_gen", False),
    ("value-type-swept", ["sweep", "backend.n_gen=8,abc"], "backend.n_gen", False),
    ("value-needs-quotes-equals", ["run", "device.name=a=b"], "needs quotes", False),
    ("value-split-by-shell", ["run", "experiment.description=hello", "world"], "quote the whole value", False),
    ("value-unclosed-list", ["run", "backend.n_gen=[1,2"], "is not closed", False),
    ("value-interpolation", ["run", "device.host=${oops}"], "cannot resolve", False),
    ("value-env-interpolation", ["run", "device.host=${oc.env:JBENCH_NO_SUCH_VARIABLE}"], "cannot resolve", False),
    ("quant-unknown", ["run", "model.quant=Q3_Z"], "unknown quant 'Q3_Z'", False),
    ("quant-unknown-in-sweep", ["sweep", "model.quant=Q4_0,Q3_Z"], "unknown quant 'Q3_Z'", False),
    ("comma-list-in-run", ["run", "model.quant=Q4_0,Q8_0"], "belong to `jbench sweep`", False),
    ("not-an-override", ["run", "world"], "is not an override", False),
    ("model-file-missing", ["run", "--config-dir", "{conf}", "model=missing"], "/nonexistent/m.gguf", False),
    ("value-rounds-zero", ["sweep", "sweep.rounds=0"], "sweep.rounds must be >= 1 (got 0)", False),
    ("value-max-cv-negative", ["sweep", "sweep.max_cv=-1"], "sweep.max_cv must be >= 0 (got -1)", False),
    ("value-interval-zero", ["run", "telemetry.interval_ms=0"], "telemetry.interval_ms must be >= 1 (got 0)", False),
    ("value-start-below-c", ["run", "thermal.start_below_c=-100"], "thermal.start_below_c must be > 0", False),
    ("value-n-gpu-layers", ["run", "backend.n_gpu_layers=-5"], "-1 offloads all layers", False),
    ("value-swept-out-of-bounds", ["sweep", "telemetry.interval_ms=100,0"], "telemetry.interval_ms must be >= 1",
     False),
    # model files: checked at planning, so nothing runs and no FAILED run blames the backend
    ("model-file-directory", ["run", *_own_file("a-directory.gguf")], "is a directory, not a GGUF file", False),
    ("model-file-empty", ["run", *_own_file("empty.gguf")], "is empty (0 bytes)", False),
    ("model-file-not-gguf", ["run", *_own_file("text.gguf")], "is not a GGUF file", False),
    ("model-file-cut-in-header", ["run", *_own_file("cut-header.gguf")], "is truncated or corrupt", False),
    ("model-file-cut-in-data", ["run", *_own_file("cut-data.gguf")], "is truncated: its header describes", False),
    ("model-name-borrowed", ["run", "--config-dir", "{conf}", "device=remote", "model.source=files",
                             "model.path_template=/models/llama-1b.gguf"], "set model.name=NAME", False),
    # options and paths
    ("output-format", ["sweep", "-o", "xml"], "Invalid value for '-o'", False),
    ("cfg-kind", ["run", "--cfg", "everything"], "Invalid value for '--cfg'", False),
    ("package-without-cfg", ["run", "-p", "backend"], "add --cfg job", False),
    ("package-unknown", ["run", "--cfg", "job", "-p", "nosuchsection"], "no such key", False),
    ("config-dir-missing", ["run", "--config-dir", "/nonexistent/conf"], "does not exist", False),
    ("config-path-env-missing", ["run", "JBENCH_CONFIG_PATH=/nonexistent/conf"], "does not exist", False),
    ("binary-dir-missing", ["run", "backend.binary_dir=/nonexistent/bin"], "backend.binary_dir", False),
    ("results-dir-unwritable", ["run", "--results-dir", "/proc/jbench-results", *TINY], "/proc/jbench-results", False),
    ("results-dir-unwritable-key", ["sweep", "tracking.results_dir=/proc/jbench-results", *TINY],
     "/proc/jbench-results", False),
    ("report-out-unwritable", ["report", "--out", "/proc/jbench-report"], "/proc/jbench-report", True),
    ("export-out-unwritable", ["export", "--out", "/proc/jbench/x.csv"], "/proc/jbench/x.csv", True),
    ("export-out-format", ["export", "--out", "{out}/x.txt"], "x.txt", True),
    ("regress-junit-unwritable", ["regress", "--experiment", "adhoc", "--junit", "/proc/jbench.xml"],
     "/proc/jbench.xml", True),
    # URIs and servers
    ("uri-scheme", ["run", "tracking.uri=bogus://somewhere"], "not a tracking store", False),
    ("server-unreachable-run", ["run", "MLFLOW_TRACKING_URI=http://127.0.0.1:{closed}", *TINY],
     "127.0.0.1:{closed}", False),
    ("server-unreachable-compare", ["compare", "a", "b", "MLFLOW_TRACKING_URI=http://127.0.0.1:{closed}"],
     "127.0.0.1:{closed}", False),
    # devices
    ("devices-check-unknown", ["devices", "check", "nosuch"], "Valid device names", False),
    ("doctor-unknown", ["doctor", "nosuch"], "Valid device names", False),
    ("calibrate-unknown", ["calibrate", "nosuch"], "Valid device names", False),
    ("restore-not-a-jetson", ["devices", "restore", "local"], "no Jetson profile", False),
    ("roofline-unknown-model", ["roofline", "--model", "nosuch"], "Valid model names", False),
    ("roofline-profile-as-device", ["roofline", "--model", "gemma3_270m", "--device", "orin_nano_8gb"],
     "use --profile orin_nano_8gb", False),
    ("roofline-unknown-profile", ["roofline", "--model", "gemma3_270m", "--profile", "orin_nano"],
     "Valid profiles: agx_orin_32gb", False),
    ("roofline-profile-and-device", ["roofline", "--model", "gemma3_270m", "--profile", "orin_nano_8gb",
                                     "--device", "local"], "not both", False),
    ("roofline-negative-ctx", ["roofline", "--model", "gemma3_270m", "--ctx", "-1"], "--ctx", False),
    ("roofline-file-elsewhere", ["roofline", "--model", "missing", "--profile", "orin_nano_8gb", "--config-dir",
                                 "{conf}"], "/nonexistent/m.gguf is not on this machine", False),
    ("roofline-not-a-gguf", ["roofline", "--model", "{out}/../conf/model/missing.yaml", "--profile", "nano"],
     "is not a GGUF file", False),
    ("trace-missing-file", ["trace", "analyze", "/nonexistent/trace.log"], "/nonexistent/trace.log", False),
    ("telemetry-missing-file", ["telemetry", "parse", "/nonexistent/tegrastats.log"], "No such file", False),
    # run ids, sweeps and experiments over stored results
    ("compare-no-store", ["compare", "abc", "def"], "", False),
    ("compare-unknown-run", ["compare", "0123456789abcdef", "fedcba9876543210"], "selects no trial runs", True),
    ("compare-bad-prefix", ["compare", "zz", "zz"], "selects no trial runs", True),
    ("compare-short-prefix", ["compare", "1", "2"], "'1' is too short for a run id prefix", True),
    ("compare-itself", ["compare", "jbench.kind=trial", "jbench.kind=trial"], "A and B select the same 1 run(s)", True),
    ("compare-unknown-sweep", ["compare", "jbench.kind=trial", "jbench.kind=trial", "--sweep", "nosuch"],
     "selects no trial runs in sweep nosuch", True),
    ("regress-unknown-experiment", ["regress", "--experiment", "nosuch"], "Existing experiments: adhoc", True),
    ("regress-no-store", ["regress", "--experiment", "nightly"], "", False),
    ("regress-bad-baseline", ["regress", "--experiment", "adhoc", "--baseline", "bogus"], "baseline 'bogus'", True),
    ("report-unknown-experiment", ["report", "--experiment", "nosuch"], "nosuch", True),
    ("report-no-store", ["report"], "", False),
    ("export-unknown-experiment", ["export", "--experiment", "nosuch", "--out", "{out}/x.csv"],
     "Existing experiments: adhoc", True),
    ("export-no-store", ["export", "--out", "{out}/x.csv"], "", False),
    # the MLflow UI's address
    ("ui-port-out-of-range", ["ui", "--port", "99999"], "99999 is not in the range 1<=x<=65535", True),
    ("ui-host-invalid", ["ui", "--host", "256.1.1.1"], "--host 256.1.1.1: not an address", True),
    ("ui-host-not-here", ["ui", "--host", "192.0.2.1"], "--host 192.0.2.1: no interface of this machine", True),
]


@pytest.mark.parametrize("case_id,argv,expect,with_store", CASES, ids=[c[0] for c in CASES])
def test_bad_input(case_id, argv, expect, with_store, tmp_path, request, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("JBENCH_CONFIG_PATH", raising=False)
    results = tmp_path / "results"
    before = None
    if with_store:
        shutil.copytree(request.getfixturevalue("store"), results)
        before = _snapshot(results)
    subs = {"{conf}": str(_user_conf(tmp_path)), "{closed}": str(_closed_port()), "{out}": str(tmp_path / "out")}
    if any("{models}" in a for a in argv):
        subs["{models}"] = str(request.getfixturevalue("broken_models"))
    (tmp_path / "out").mkdir()

    def fill(text: str) -> str:
        for k, v in subs.items():
            text = text.replace(k, v)
        return text

    env = {"JBENCH_RESULTS_DIR": str(results)}
    args = []
    for a in map(fill, argv):  # VAR=value words are the environment, as in a shell
        name, eq, value = a.partition("=")
        if eq and re.fullmatch(r"[A-Z_]+", name):
            env[name] = value
        else:
            args.append(a)
    res = jbench_cli(args, env_extra=env, cwd=tmp_path, timeout=120)
    out = res.stdout + res.stderr
    assert "Traceback" not in out, out
    assert res.returncode == 2, f"exit {res.returncode}\n{out}"
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^error:", line, re.I)]
    assert len(errors) == 1, res.stderr
    # Besides the error line: a short list ("  - ..."), click's usage lines, or a sweep's plan header.
    others = [line for line in lines if line not in errors and not line.startswith(("  ", "Usage:", "Try '"))]
    assert len(others) <= 2 and len(lines) <= 12, res.stderr
    assert fill(expect) in out, out
    if with_store:
        assert _snapshot(results) == before, "the store changed"
    else:
        assert not (results / "mlflow.db").exists(), "a store was created"
        assert not results.exists() or not any(results.iterdir()), f"created {list(results.iterdir())}"
