"""The backend contract: tests every registered backend must pass (docs/backends.md, "The contract").

Parametrized over the backend registry (jbench.backends.base: built-ins and the `jbench.backends` entry
points). Each backend needs a stand-in entry in STANDINS below: how to make one tiny working trial, one
whose output is unparseable and one that crashes. A backend registered without one fails
test_every_backend_has_a_stand_in, so a new backend cannot skip the contract.

llamacpp runs the real build from `jbench setup` on the bundled Q4_0 model; engine runs the stand-in
engine (real work over a weight file); trtllm runs the replaying stand-ins of tests/fixtures/trtllm.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Callable

import pytest
from omegaconf import OmegaConf

from jbench.core import registry
from jbench.core.schema import SchemaError
from jbench.core.trial import Trial
from jbench.backends.base import Backend, BackendError, Capabilities, backend_class
from jbench.config import ConfigError, compose
from jbench.device.local import LocalConnection
from jbench.sweeps.plan import plan
from jbench.core.results import BackendResult, PhaseResult

from .gguf_files import unloadable_gguf

HERE = Path(__file__).resolve().parent
ENGINE = HERE / "fixtures" / "engine" / "stand_in_engine.py"
TRT = HERE / "fixtures" / "trtllm"
UNPARSEABLE_LLAMACPP = HERE / "fixtures" / "unparseable_llamacpp"

REGISTERED = sorted(registry.targets(registry.BACKENDS))
# Keys every backend's config has, so the same sweep knobs and metric definitions apply to all.
COMMON_KEYS = ("name", "n_prompt", "n_gen", "depth", "repetitions", "timeout_s")
# Backends measured with load levels (the `serving` section) against a server, not in phases of fixed lengths: their
# common keys, and the bad values their planning names.
SERVING_BACKENDS = {"openai"}
SERVING_KEYS = ("name", "scenario", "timeout_s")
STUB = HERE / "fixtures" / "stub_openai_server.py"


def common_keys(name: str) -> tuple[str, ...]:
    return SERVING_KEYS if name in SERVING_BACKENDS else COMMON_KEYS

log = logging.getLogger("jbench.test.contract")


@dataclasses.dataclass
class Case:
    overrides: list[str]
    config_dirs: list[Path] = dataclasses.field(default_factory=list)
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    repetitions: int = 1


@dataclasses.dataclass
class StandIn:
    ok: Callable[[Path], Case]
    unparseable: Callable[[Path], Case]
    crash: Callable[[Path], Case]
    # overrides that leave out a required setting, and a text the problem must contain
    missing: tuple[list[str], str]


def _model_dir(tmp: Path, name: str, quant: str, path: Path) -> Path:
    conf = tmp / "conf"
    (conf / "model").mkdir(parents=True, exist_ok=True)
    (conf / "model" / f"{name}.yaml").write_text(json.dumps(
        {"defaults": ["model_schema", "_self_"], "name": name, "quant": quant, "files": {quant: str(path)}}))
    return conf


# ---- llamacpp: the real build, the bundled Q4_0 model

LLAMA_TINY = ["backend=llamacpp", "model.quant=Q4_0", "backend.n_prompt=8", "backend.n_gen=4", "backend.repetitions=2"]


def _llama_crash(tmp: Path) -> Case:
    # A whole GGUF file (planning refuses a broken one) that llama.cpp cannot load.
    conf = _model_dir(tmp, "corrupt", "Q4_0", unloadable_gguf(tmp / "corrupt.gguf"))
    return Case(["backend=llamacpp", "model=corrupt", *LLAMA_TINY[2:]], [conf])


# ---- engine: the stand-in engine over a weight file

def _weights(tmp: Path) -> Path:
    w = tmp / "weights.bin"
    w.write_bytes(os.urandom(1 << 20))
    return w


def _engine(extra: list[str], reps: int = 2) -> Callable[[Path], Case]:
    def make(tmp: Path) -> Case:
        conf = _model_dir(tmp, "standin", "Q4_0", _weights(tmp))
        return Case(["backend=engine", "model=standin", f"backend.binary={ENGINE}", "backend.n_prompt=16",
                     "backend.n_gen=4", f"backend.repetitions={reps}", "backend.extra_args=[" + ",".join(extra) + "]"],
                    [conf], repetitions=reps)
    return make


# ---- trtllm: replaying stand-ins

def _trt(env: dict[str, str], n_prompt: int = 2048, n_gen: int = 2048, reps: int = 1) -> Callable[[Path], Case]:
    def make(tmp: Path) -> Case:
        ckpt = tmp / "ckpt"
        ckpt.mkdir(exist_ok=True)
        conf = _model_dir(tmp, "trt", "W4A16", ckpt)
        return Case(["backend=trtllm", "model=trt", f"backend.bin_dir={TRT}", f"backend.python={TRT / 'python3'}",
                     f"backend.prepare_dataset={TRT / 'prepare_dataset.py'}", "backend.hf_model=meta-llama/Llama-3.3-70B",
                     f"backend.engine_cache_dir={tmp / 'engines'}", "backend.num_requests=2",
                     f"backend.n_prompt={n_prompt}", f"backend.n_gen={n_gen}", f"backend.repetitions={reps}"],
                    [conf], {"TRTLLM_STANDIN_LOG": str(tmp / "standin.jsonl"), **env}, repetitions=reps)
    return make


# ---- openai: the stub OpenAI-compatible server (tests/fixtures/stub_openai_server.py) started as the device's server

def _openai(*args: str) -> Callable[[Path], Case]:
    def make(tmp: Path) -> Case:
        command = ",".join([sys.executable, str(STUB), "--port", "'{port}'", "--slots", "'{slots}'",
                            "--token-delay", "0.002", *args])
        return Case(["backend=openai", f"backend.command=[{command}]", "serving.levels=[1,2]",
                     "serving.requests_per_level=4", "serving.input.mean=8", "serving.output.mean=4",
                     "serving.warmup_requests=1", "backend.ready_timeout_s=30"])
    return make


STANDINS: dict[str, StandIn] = {
    "llamacpp": StandIn(
        ok=lambda tmp: Case(list(LLAMA_TINY), repetitions=2),
        unparseable=lambda tmp: Case([*LLAMA_TINY, f"backend.binary_dir={UNPARSEABLE_LLAMACPP}"]),
        crash=_llama_crash,
        missing=(["backend=llamacpp", "model.quant=Q4_K"], "unknown quant 'Q4_K'"),
    ),
    "engine": StandIn(
        ok=_engine(["--ms-decimals", "3"]),
        unparseable=_engine(["--no-decode", "--ms-decimals", "3"], reps=1),
        crash=_engine(["--fail"], reps=1),
        missing=(["backend=engine"], "backend.binary is not set"),
    ),
    "trtllm": StandIn(
        ok=_trt({}, reps=2),
        # the 0.12 throughput report has no TPOT/ITL: no decode rate
        unparseable=_trt({"TRTLLM_STANDIN_OUTPUT": "trtllm-bench_0.12.0_throughput.txt"}, 128, 128),
        crash=_trt({"TRTLLM_STANDIN_FAIL": "trtllm-bench"}),
        missing=(["backend=trtllm", "model.quant=W4A16"], "backend.hf_model is not set"),
    ),
    "openai": StandIn(
        ok=_openai(),
        unparseable=_openai("--no-usage"),  # a server that streams no token counts
        crash=_openai("--fail", "stub: cannot load the model"),
        missing=(["backend=openai"], "declare how the server runs"),
    ),
}


def _standin(name: str) -> StandIn:
    if name not in STANDINS:
        pytest.fail(f"backend '{name}' is registered but has no stand-in in tests/test_backend_contract.py STANDINS: "
                    f"add one (a tiny working trial, an unparseable and a crashing one)")
    return STANDINS[name]


def _trial_and_backend(case: Case, monkeypatch):
    for k, v in case.env.items():
        monkeypatch.setenv(k, v)
    p = plan(case.overrides, case.config_dirs, use_grid=False)
    assert p.problems == [], p.problems
    trial = p.trials[0]
    backend = backend_class(trial.config["backend"]["name"])(trial.config["backend"])
    return trial, backend


@pytest.fixture(params=REGISTERED)
def name(request) -> str:
    return request.param


@pytest.fixture
def needs_real_build(name, request):
    if name == "llamacpp":  # the contract runs llama.cpp for real: fail (never skip) without `jbench setup`
        request.getfixturevalue("llama_build")
        request.getfixturevalue("bundled_model")


# The tests that run a backend: llamacpp's case runs the real llama.cpp build, so it is marked e2e.
runs_the_backend = pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.e2e) if n == "llamacpp" else n for n in REGISTERED])


# --------------------------------------------------------------------------------------------


def test_builtin_backends_are_registered():
    assert {"llamacpp", "engine", "trtllm"} <= set(REGISTERED)


def test_every_backend_has_a_stand_in(name):
    _standin(name)


def test_class_declares_the_contract(name):
    cls = backend_class(name)
    assert issubclass(cls, Backend) and cls.NAME == name
    assert isinstance(cls.CAPABILITIES, Capabilities)
    assert dataclasses.is_dataclass(cls.CONFIG)
    defaults = {f.name: f for f in dataclasses.fields(cls.CONFIG)}
    missing = [k for k in common_keys(name) if k not in defaults]
    assert not missing, f"{name}'s config lacks the common keys {missing}"
    assert cls.CONFIG().name == name


def test_the_backend_holds_its_typed_config(name):
    """`self.config` is the backend's CONFIG dataclass whether it was given the dataclass or a plain section;
    a key the schema does not have is named, not carried along."""
    cls = backend_class(name)
    cfg, _ = compose([f"backend={name}"])
    section, obj = OmegaConf.to_container(cfg.backend, resolve=True), OmegaConf.to_object(cfg.backend)
    assert cls(obj).config is obj
    assert isinstance(cls(section).config, cls.CONFIG) and cls(section).config == obj
    with pytest.raises(SchemaError, match="backend.no_such_knob"):
        cls({**section, "no_such_knob": 1})
    # A trial's own backend section comes typed the same way; another backend's trial is refused.
    base = {"device": {"name": "d"}, "model": {"name": "m", "quant": "Q4_0"}}
    assert cls(obj).config_of(Trial(1, {**base, "backend": section}, {}, {}, "h")) == obj
    other = next(n for n in REGISTERED if n != name)
    with pytest.raises(TypeError, match=f"backend {name} got a trial"):
        cls(obj).config_of(Trial(1, {**base, "backend": {"name": other}}, {}, {}, "h"))


def test_schema_is_registered_and_composes(name):
    from hydra.core.config_store import ConfigStore

    cfg, choices = compose([f"backend={name}"])
    assert choices["backend"] == name and cfg.backend.name == name
    assert f"{name}_schema.yaml" in ConfigStore.instance().list("backend")
    for key in common_keys(name):
        assert key in cfg.backend


def test_unknown_key_is_a_config_error(name):
    with pytest.raises(ConfigError) as err:
        compose([f"backend={name}", "backend.no_such_knob=1"])
    # The hint is about the selected backend only, never every backend's keys.
    assert "unknown config key 'backend.no_such_knob'" in str(err.value) and f"backend '{name}'" in str(err.value)


@runs_the_backend
def test_validate_returns_a_list_of_strings(name, tmp_path, monkeypatch, needs_real_build):
    trial, backend = _trial_and_backend(_standin(name).ok(tmp_path), monkeypatch)
    problems = backend.validate(trial)
    assert isinstance(problems, list) and problems == []


@pytest.mark.parametrize("bad", [0, 1])
def test_bad_values_name_the_key(name, bad, tmp_path, monkeypatch):
    override, key = ([("serving.levels=[0]", "serving.levels"), ("serving.output.mean=1", "serving.output.mean")]
                     if name in SERVING_BACKENDS else
                     [("backend.n_gen=-1", "backend.n_gen"), ("backend.repetitions=0", "backend.repetitions")])[bad]
    case = _standin(name).ok(tmp_path)
    for k, v in case.env.items():
        monkeypatch.setenv(k, v)
    p = plan([*case.overrides, override], case.config_dirs, use_grid=False)
    assert p.problems and all(isinstance(x, str) for x in p.problems)
    assert any(key in x for x in p.problems), p.problems


def test_missing_required_setting_is_named(name, tmp_path):
    overrides, expected = _standin(name).missing
    p = plan(overrides, use_grid=False)
    assert any(expected in x for x in p.problems), p.problems


@runs_the_backend
def test_preflight_returns_a_list(name, tmp_path, monkeypatch, needs_real_build):
    _trial, backend = _trial_and_backend(_standin(name).ok(tmp_path), monkeypatch)
    with LocalConnection() as conn:
        assert backend.preflight(conn) == []


@runs_the_backend
def test_run_returns_phases_with_positive_samples(name, tmp_path, monkeypatch, needs_real_build):
    case = _standin(name).ok(tmp_path)
    trial, backend = _trial_and_backend(case, monkeypatch)
    result = backend.run(trial, LocalConnection(), log)
    assert isinstance(result, BackendResult)
    if name in SERVING_BACKENDS:  # load levels: every request of each level completed, counted by the server
        assert [lv.load for lv in result.serving_levels] == [1.0, 2.0] and not result.phases
        for lv, window in zip(result.serving_levels, result.load_windows):
            assert len(lv.outcomes) == 4 and all(o.error is None and o.output_tokens == 4 for o in lv.outcomes)
            assert window.output_tokens == 16 and window.end > window.start
        assert result.raw_output.strip() and result.command and all(isinstance(a, str) for a in result.command)
        return
    assert set(result.phases) == {"prefill", "decode"}
    cfg = trial.cfg.backend
    for phase, pr in result.phases.items():
        assert isinstance(pr, PhaseResult) and pr.phase == phase
        # Repetitions set aside as cold (a backend that settles its rates, jbench.analysis.settle) are said apart.
        settle = getattr(cfg, "settle_repetitions", 0)
        assert pr.n_tokens > 0 and len(pr.samples_ns) + len(pr.cold_samples_ns) == case.repetitions + settle
        assert len(pr.samples_ns) >= case.repetitions
        assert all(isinstance(s, int) and s > 0 for s in pr.samples_ns)
        assert all(math.isfinite(r) and r > 0 for r in pr.samples_tps)
    assert result.phases["decode"].n_tokens == cfg.n_gen
    assert result.raw_output.strip()
    assert result.command and all(isinstance(a, str) for a in result.command)
    assert isinstance(result.findings, list) and isinstance(result.metrics, dict)


@runs_the_backend
def test_unparseable_output_is_an_error_never_a_zero_rate(name, tmp_path, monkeypatch, needs_real_build):
    trial, backend = _trial_and_backend(_standin(name).unparseable(tmp_path), monkeypatch)
    with pytest.raises(BackendError) as err:
        backend.run(trial, LocalConnection(), log)
    assert err.value.category == "unparseable_output", err.value
    assert err.value.raw_output.strip()  # the output behind the failure is kept for the run's artifacts


@runs_the_backend
def test_a_crash_is_backend_crash_with_stderr(name, tmp_path, monkeypatch, needs_real_build):
    trial, backend = _trial_and_backend(_standin(name).crash(tmp_path), monkeypatch)
    with pytest.raises(BackendError) as err:
        backend.run(trial, LocalConnection(), log)
    assert err.value.category == "backend_crash", err.value
    if name in SERVING_BACKENDS:  # the server exited before it was ready: its own words, and its whole log kept
        assert "exited before it was ready" in str(err.value) and "cannot load the model" in str(err.value)
        assert "cannot load the model" in err.value.raw_output
        return
    assert err.value.raw_stderr.strip()
    assert "exited with code" in str(err.value)
