"""Trial identity by declaration (jbench/identity.py, HASH_VERSION 2)."""

from __future__ import annotations

import copy
import dataclasses
import os
import time
from dataclasses import dataclass, field
from functools import lru_cache

import pytest

from jbench.core import identity, schema
from jbench.core.registry import backend_schemas
from jbench.core.identity import HASH_VERSION, config_hash, flat_params, identity_items, run_hashes, trial_identity
from jbench.core.schema import declaration as schema_declaration
from jbench.core.schema import ident, nonident, undeclared_fields
from jbench.models.digest import file_digest, model_digest, unchanged_local_digest
from jbench.sweeps.plan import plan

BUILD = "0c1e57098"
DIGEST = "8b90dc09855b7fc6fe7d3bec8afbe0e27541fa3ed72eb0b3b2ea0e56f3b47d88"


@lru_cache(maxsize=None)
def _planned(*overrides: str) -> dict:
    return plan(["model.quant=Q4_0", *overrides]).trials[0].config


def _config(*overrides: str) -> dict:
    return copy.deepcopy(_planned(*overrides))


def _set(config: dict, dotted: str, value) -> dict:
    out = copy.deepcopy(config)
    node = out
    *parents, last = dotted.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    return out


def _both(config: dict, build: str = BUILD, digest: str = DIGEST) -> tuple[str, str]:
    return config_hash(config), trial_identity(config, build=build, model_digest=digest)


# --------------------------------------------------------------------------------------------
# Declarations


def test_every_schema_field_declares_identity():
    """Each field of every schema (root, groups, nested dataclasses, every registered backend's CONFIG)
    says ident/nonident: a new key cannot silently become identity or not."""
    from importlib.metadata import entry_points

    registered = {ep.name for ep in entry_points(group="jbench.backends")} | {"llamacpp", "engine", "trtllm"}
    schemas = identity.all_schemas()
    assert {f"backend:{name}" for name in registered} <= set(schemas)  # every registered backend loads
    assert set(backend_schemas()) == registered
    problems = [p for schema in schemas.values() for p in undeclared_fields(schema)]
    assert problems == [], "fields without an identity declaration (use ident()/nonident() or " \
                           "metadata={'identity': ...}):\n" + "\n".join(problems)


def test_a_field_without_declaration_is_flagged_and_counts_as_identity(caplog):
    @dataclass
    class Inner:
        a: int = ident(1)
        b: int = 2  # undeclared

    @dataclass
    class Outer:
        x: int = nonident(0)
        inner: Inner = ident(default_factory=Inner)
        bad: int = field(default=0, metadata={"identity": 3})

    assert undeclared_fields(Outer) == ["Outer.inner:Inner.b", "Outer.bad (field bad: metadata identity=3 must be "
                                        "True, False or scenario name(s))"]
    # At run time an undeclared field counts as identity (a needless re-run, never a wrong skip), warned once.
    leaves = [leaf.path for leaf in identity._leaves(Inner, "inner.", None)]
    assert leaves == ["inner.a", "inner.b"] and "declares no identity" in caplog.text


def test_declaration_forms():
    @dataclass
    class S:
        a: int = ident(1)
        b: int = ident(1, scenario="latency")
        c: int = ident(1, scenario=("bench", "latency"))
        d: int = nonident(1)
        e: int = field(default=1, metadata={"identity": "bench"})

    decl = {f.name: schema.declaration(f) for f in dataclasses.fields(S)}
    assert decl == {"a": True, "b": ("latency",), "c": ("bench", "latency"), "d": False, "e": ("bench",)}
    assert [leaf.path for leaf in identity._leaves(S, "", "bench")] == ["a", "c", "e"]
    assert [leaf.path for leaf in identity._leaves(S, "", "latency")] == ["a", "b", "c"]


def test_nested_dataclasses_are_walked_by_their_own_declarations():
    @dataclass
    class Leaf2:
        keep: str = ident("k")
        drop: str = nonident("d")

    @dataclass
    class Mid:
        leaf: Leaf2 = ident(default_factory=Leaf2)
        hidden: Leaf2 = nonident(default_factory=Leaf2)  # a nonident subtree drops out whole
        n: int = ident(3)

    leaves = identity._leaves(Mid, "s.", None)
    assert [(leaf.path, leaf.default) for leaf in leaves] == [("s.leaf.keep", "k"), ("s.n", "3")]
    # Real schemas: device.paths (nonident subtree) and power (ident section of nested fields).
    base = _config()
    items = identity_items(base)
    assert not any(k.startswith("device.paths") for k in items)
    assert {"power.mode", "power.jetson_clocks", "power.fan"} <= set(items)
    assert "power.allow_reboot" not in items and "power.reboot_timeout_s" not in items
    assert config_hash(_set(base, "device.paths.sysfs_root", "/elsewhere")) == config_hash(base)
    assert config_hash(_set(base, "power.mode", "MAXN")) != config_hash(base)


# --------------------------------------------------------------------------------------------
# What changes the hash


@pytest.mark.parametrize("key,value", [
    ("backend.binary_dir", "/opt/llama.cpp/other/bin"),
    ("backend.timeout_s", 5.0),
    ("backend.server_ready_timeout_s", 1.0),
    ("device.host", "10.0.0.7"),
    ("device.port", 2222),
    ("device.user", "nvidia"),
    ("device.key", "~/.ssh/id_other"),
    ("device.sudo_password_env", "SUDO_PW"),
    ("device.connect_timeout_s", 1.0),
    ("device.tags", {"desk": "lab-3"}),
    ("tracking", {"uri": "http://mlflow:5000", "results_dir": "/x", "experiment_name": "other"}),
    ("telemetry.interval_ms", 10),
    ("telemetry.source", "nvml"),
    ("energy.min_window_s", 1.0),
    ("thermal.timeout_s", 1.0),
    ("experiment", {"name": "elsewhere", "description": "x"}),
    ("model.files", {"Q4_0": "/models/a.gguf"}),
    ("model.path_template", "/models/m-{quant}.gguf"),
    ("model.display_name", "Another name"),
    ("quality", {"max_cv": 0.5}),
    ("round", {"index": 1, "of": 1}),
    ("profile", {"name": "orin_nano_8gb", "memory_bandwidth_gbs": 68.0}),
])
def test_context_fields_keep_the_hash(key, value):
    base = _config()
    assert _both(_set(base, key, value)) == _both(base)


@pytest.mark.parametrize("key,value", [
    ("backend.n_gen", 65),
    ("backend.n_prompt", 129),
    ("backend.depth", 512),
    ("backend.repetitions", 5),
    ("backend.cache_type_k", "q8_0"),
    ("backend.flash_attn", "on"),
    ("backend.threads", 4),
    ("backend.n_batch", 256),
    ("backend.n_ubatch", 64),
    ("backend.n_gpu_layers", 0),
    ("backend.extra_args", ["--mmap", "0"]),
    ("model.quant", "Q8_0"),
    ("model.name", "other"),
    ("device.name", "orin-2"),
    ("power.mode", "15W"),
    ("power.jetson_clocks", True),
])
def test_identity_fields_change_the_hash(key, value):
    base = _config()
    changed = _set(base, key, value)
    assert config_hash(changed) != config_hash(base)
    assert trial_identity(changed, build=BUILD, model_digest=DIGEST) != trial_identity(base, build=BUILD, model_digest=DIGEST)


def test_build_and_model_digest_are_identity_but_not_config():
    base = _config()
    ident_ = trial_identity(base, build=BUILD, model_digest=DIGEST)
    assert trial_identity(base, build="b1234ff", model_digest=DIGEST) != ident_
    assert trial_identity(base, build=BUILD, model_digest="0" * 64) != ident_
    assert trial_identity(base, build=None, model_digest=DIGEST) != ident_
    assert trial_identity(base, build=BUILD, model_digest=DIGEST.upper()) == ident_  # hex case is free
    # compare/regress match configurations across builds: the config hash has neither.
    assert config_hash(base) not in (ident_,) and len(config_hash(base)) == len(ident_) == 16


def test_path_template_pointing_to_another_file_changes_the_identity(tmp_path, monkeypatch):
    monkeypatch.setenv("JBENCH_CACHE_DIR", str(tmp_path / "cache"))
    for name, content in (("a-Q4_0.gguf", b"GGUF model a"), ("b-Q4_0.gguf", b"GGUF model b")):
        (tmp_path / name).write_bytes(content)
    base = _set(_config(), "model", {"name": "mine", "quant": "Q4_0", "source": "files",
                                      "path_template": str(tmp_path / "a-{quant}.gguf")})
    other = _set(base, "model.path_template", str(tmp_path / "b-{quant}.gguf"))
    same_file = _set(base, "model.files", {"Q4_0": str(tmp_path / "a-Q4_0.gguf")})
    da, db, ds = model_digest(base["model"]), model_digest(other["model"]), model_digest(same_file["model"])
    assert da and db and da != db and ds == da
    assert config_hash(other) == config_hash(base)  # where the file lives is not identity ...
    assert trial_identity(other, build=BUILD, model_digest=db) != trial_identity(base, build=BUILD, model_digest=da)
    # ... what it holds is: the same file through model.files is the same trial.
    assert trial_identity(same_file, build=BUILD, model_digest=ds) == trial_identity(base, build=BUILD, model_digest=da)


def test_bundled_model_digest_is_the_manifest_sha256(tmp_path, monkeypatch):
    monkeypatch.setenv("JBENCH_CACHE_DIR", str(tmp_path / "cache"))
    from jbench.models.store import save_manifest

    f = tmp_path / "Q4_0.gguf"
    f.write_bytes(b"not what the manifest says")  # the manifest is trusted: nothing is read
    save_manifest("m", {"files": {"Q4_0": {"path": str(f), "sha256": "ab" * 32}}})
    assert model_digest({"name": "m", "quant": "Q4_0", "source": "bundled"}) == "ab" * 32
    assert model_digest({"name": "m", "quant": "Q8_0", "source": "bundled", "ladder": ["Q8_0"]}) is None
    assert model_digest({"name": "nothing", "quant": "Q4_0", "source": "files"}) is None  # unresolved


def test_file_digest_is_cached_by_size_and_mtime(tmp_path, monkeypatch):
    monkeypatch.setenv("JBENCH_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"one")
    first = file_digest(str(f))
    reads = []
    import jbench.models.digest as digest

    real = digest.sha256_file
    monkeypatch.setattr(digest, "sha256_file", lambda p: reads.append(p) or real(p))
    assert file_digest(str(f)) == first and reads == []  # from the cache
    f.write_bytes(b"two, longer")
    assert file_digest(str(f)) not in (None, first) and len(reads) == 1
    assert file_digest(str(tmp_path / "missing.gguf")) is None


def test_remote_file_digest_runs_on_the_device(tmp_path, monkeypatch):
    monkeypatch.setenv("JBENCH_CACHE_DIR", str(tmp_path / "cache"))
    from jbench.device.connection import CommandResult

    calls = []

    class Conn:
        name, is_local = "orin", False

        def run(self, argv, timeout=None):
            calls.append(argv[0])
            out = "123 1700000000 42\n" if argv[0] == "stat" else "CD" * 32 + "  /m.gguf\n"
            return CommandResult(list(argv), 0, out, "", 0.0)

    assert file_digest("/m.gguf", Conn()) == "cd" * 32
    assert file_digest("/m.gguf", Conn()) == "cd" * 32
    assert calls == ["stat", "sha256sum", "stat"]  # hashed once while size/mtime/inode stay


def test_scenario_only_fields():
    bench = _config()
    assert _both(_set(bench, "backend.latency_requests", 99)) == _both(bench)
    assert _both(_set(bench, "backend.context", 4096)) == _both(bench)
    assert _both(_set(bench, "backend.server_extra_args", ["-v"])) == _both(bench)
    assert _both(_set(bench, "backend.repetitions", 9)) != _both(bench)
    lat = _set(bench, "backend.scenario", "latency")
    assert _both(lat) != _both(bench)
    assert _both(_set(lat, "backend.latency_requests", 99)) != _both(lat)
    assert _both(_set(lat, "backend.latency_concurrency", 2)) != _both(lat)
    assert _both(_set(lat, "backend.repetitions", 9)) == _both(lat)  # llama-bench keys don't count here
    assert _both(_set(lat, "backend.extra_args", ["-v"])) == _both(lat)
    assert _both(_set(lat, "backend.server_ready_timeout_s", 5.0)) == _both(lat)


def test_key_order_is_free():
    base = _config()
    reordered = {k: dict(reversed(list(v.items()))) if isinstance(v, dict) else v for k, v in reversed(list(base.items()))}
    assert _both(reordered) == _both(base)


def test_other_backends_install_paths_are_not_identity():
    trt = _set(_config(), "backend", {"name": "trtllm", "bin_dir": "/usr/local/bin", "n_gen": 128})
    for key, value in (("backend.bin_dir", "/opt/trt/bin"), ("backend.engine_cache_dir", "/x"),
                       ("backend.benchmark_dir", "/y"), ("backend.python", "/usr/bin/python3.10"),
                       ("backend.timeout_s", 1.0), ("backend.device_name", "Orin")):
        assert _both(_set(trt, key, value)) == _both(trt), key
    for key, value in (("backend.batch_size", 4), ("backend.build_args", ["--gemm_plugin", "float16"]),
                       ("backend.trtllm_version", "0.12.0"), ("backend.bench_backend", "tensorrt")):
        assert _both(_set(trt, key, value)) != _both(trt), key
    eng = _set(_config(), "backend", {"name": "engine", "binary": "/opt/engine/run"})
    assert _both(_set(eng, "backend.binary", "/opt/engine2/run")) == _both(eng)  # its build is `build`
    assert _both(_set(eng, "backend.patterns", {"decode": "x"})) == _both(eng)
    assert _both(_set(eng, "backend.vars", {"batch": "512"})) != _both(eng)
    assert _both(_set(eng, "backend.env", {"CUDA_VISIBLE_DEVICES": "0"})) != _both(eng)


# --------------------------------------------------------------------------------------------
# Recorded runs


def test_hash_version_is_2():
    assert HASH_VERSION == 2 and identity.TAG_VERSION == "jbench.hash_version"


def test_run_hashes_recompute_a_run_from_its_params_and_tags():
    base = _config()
    params = flat_params(base)
    v1_tags = {"backend.build_commit": BUILD, "model.sha256": DIGEST}
    assert run_hashes(params, v1_tags) == _both(base)
    # A key the schema gained after the run was recorded gets its default.
    older = {k: v for k, v in params.items() if k not in ("backend.scenario", "backend.latency_requests")}
    assert run_hashes(older, v1_tags) == _both(base)
    # A run that recorded a non-default value keeps it.
    assert run_hashes({**params, "backend.n_gen": "65"}, v1_tags) == _both(_set(base, "backend.n_gen", 65))
    # Current-version runs are taken at their tags; their build/digest tags are jbench.build/jbench.model_digest.
    v2 = {"jbench.hash_version": "2", "jbench.config_hash": "c" * 16, "jbench.identity": "i" * 16}
    assert run_hashes(params, v2) == ("c" * 16, "i" * 16)
    v3 = {"jbench.hash_version": "3", "jbench.build": BUILD, "jbench.model_digest": DIGEST,
          "backend.build_commit": "ignored"}
    assert run_hashes(params, v3) == _both(base)
    # No params (or no backend): not identifiable.
    assert run_hashes({}, v1_tags) == (None, None)
    # Version 1 without a model digest: the config hash, but no identity.
    assert run_hashes(params, {"backend.build_commit": BUILD}) == (config_hash(base), None)


def test_v1_run_of_a_local_user_file_gets_its_digest_while_the_file_is_unchanged(tmp_path, monkeypatch):
    monkeypatch.setenv("JBENCH_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "m-Q4_0.gguf"
    f.write_bytes(b"GGUF user model")
    old = time.time() - 3600
    os.utime(f, (old, old))
    cfg = _set(_config(), "model", {"name": "mine", "quant": "Q4_0", "source": "files", "files": {"Q4_0": str(f)}})
    params, tags = flat_params(cfg), {"backend.build_commit": BUILD, "model.file": str(f)}
    start_ms = (old + 60) * 1000
    expected = trial_identity(cfg, build=BUILD, model_digest=model_digest(cfg["model"]))
    assert run_hashes(params, tags, start_time_ms=start_ms, local_digest=unchanged_local_digest) == (config_hash(cfg), expected)
    # Changed after the run started: not the file it measured.
    assert run_hashes(params, tags, start_time_ms=(old - 60) * 1000, local_digest=unchanged_local_digest) == (config_hash(cfg), None)
    # On a remote device the controller cannot look.
    remote = {**params, "device.kind": "ssh"}
    assert run_hashes(remote, tags, start_time_ms=start_ms, local_digest=unchanged_local_digest)[1] is None


def test_a_config_being_planned_always_has_a_hash():
    """Problems (an unknown backend, a missing key) are the planner's to report: hashing never fails."""
    bogus = _set(_config(), "backend.name", "bogus")
    assert config_hash(bogus) != config_hash(_set(bogus, "backend.n_gen", 1))  # every key of an unknown backend counts
    assert config_hash(bogus) == config_hash(_set(bogus, "tracking.uri", "x"))
    assert len(config_hash({})) == 16
    p = plan(["backend.name=bogus", "model.quant=Q4_0"])
    assert "unknown backend 'bogus'" in "\n".join(p.problems) and len(p.trials[0].config_hash) == 16
    # A recorded run without its backend or a mandatory key is not identifiable.
    assert run_hashes({"backend.name": "llamacpp"}, {}) == (None, None)


@pytest.mark.parametrize("value", [None, True, False, 0, 64, 0.9, 1e-05, "f16", "", [], ["-fa", "1"], {},
                                   {"b": 1, "a": [1, 2]}, "x" * 100])
def test_canonical_values_are_the_params_the_runner_records(value):
    from jbench.tracking.common import param_value

    assert identity.canonical(value) == param_value(value)


# --- Defect: adding an identity field with a default must not change any old trial's identity ------------------


def _current_identity_keys() -> set[str]:
    keys = set()
    for name, schema in backend_schemas().items():
        scenarios = {None}
        for f in dataclasses.fields(schema):
            declared = schema_declaration(f)
            if isinstance(declared, tuple):
                scenarios.update(declared)
        for scenario in scenarios:
            keys.update(identity.frozen_name(leaf.path, name) for leaf in identity.identity_leaves(name, scenario))
    return keys


def test_every_identity_key_is_frozen_at_v2_or_registered_with_its_default():
    from jbench.core.identity_keys import ADDED_DEFAULTS, V2_KEYS

    new = sorted(_current_identity_keys() - V2_KEYS - set(ADDED_DEFAULTS))
    assert not new, ("new identity key(s) " + ", ".join(new) + ": add each to ADDED_DEFAULTS in "
                     "jbench/core/identity_keys.py with its default as jbench.core.identity.canonical() writes it, "
                     "so trials recorded before it existed keep their identity")


def test_a_new_identity_field_at_its_default_keeps_every_recorded_hash(monkeypatch):
    from jbench.backends.llamacpp.backend import LlamaCppConfig
    from jbench.core import identity_keys

    ladder = plan(["+experiment=quant_ladder"]).trials
    before = [(t.config_hash, trial_identity(t.config, build=BUILD, model_digest=DIGEST)) for t in ladder]

    @dataclasses.dataclass
    class WithNewKnob(LlamaCppConfig):
        new_knob: int = ident(7)

    monkeypatch.setattr(identity, "_backend_schema", lambda name: WithNewKnob if name == "llamacpp" else None)
    identity.identity_leaves.cache_clear()
    try:
        def hashes(configs):
            return [(config_hash(c), trial_identity(c, build=BUILD, model_digest=DIGEST)) for c in configs]

        # Unregistered, the field at its default would change every trial's identity: the defect this guards.
        assert all(a != b for a, b in zip(hashes([t.config for t in ladder]), before))
        monkeypatch.setitem(identity_keys.ADDED_DEFAULTS, "llamacpp:backend.new_knob", "7")
        assert hashes([t.config for t in ladder]) == before  # absent: its default
        assert hashes([_set(t.config, "backend.new_knob", 7) for t in ladder]) == before  # given at its default
        changed = hashes([_set(t.config, "backend.new_knob", 8) for t in ladder])
        assert all(a[0] != b[0] and a[1] != b[1] for a, b in zip(changed, before))  # away from it: a new trial
        # A recorded run (params written before the field existed) is identified as before too.
        p0 = flat_params(ladder[0].config)
        assert run_hashes(p0, {"backend.build_commit": BUILD, "model.sha256": DIGEST})[0] == before[0][0]
    finally:
        identity.identity_leaves.cache_clear()
