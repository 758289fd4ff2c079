"""A trial's identity: what its result depends on, declared field by field, and hashed (versioned).

Every field of every config schema (jbench.config and each backend's CONFIG dataclass) declares in
its dataclass metadata whether it is part of a trial's identity:

    n_gen: int = ident(64)                                  # identity in every scenario
    latency_requests: int = ident(8, scenario="latency")    # identity only when backend.scenario=latency
    timeout_s: float = nonident(1800.0)                     # not identity

The rule: what a result depends on is identity (every knob that changes what runs: quant, token counts,
depth, KV types, flash attention, threads, batch sizes, GPU layers, power mode, jetson_clocks, the device's
name, the model's identity, the backend build). Where files live, time-outs, credentials, host/port,
tracking and telemetry sampling settings are not.

The hash is computed by inclusion: only identity fields count, recursively through nested dataclasses (a
nested dataclass field declared `nonident` drops its whole subtree). Config keys that are no schema field
(the planner's `profile`, `quality`, `round`) are never identity. A field without a declaration counts as
identity (the safe direction: a needless re-run, never a wrongly skipped trial) and is reported once; a
test walks every schema and fails on such a field, so each new key is a decision.

Two values come from the build and model resolution, not from the config: the backend build (for
llama.cpp the commit `llama-bench --version` prints, the `backend.build_commit` tag of a run) and the
SHA-256 of the model file. `config_hash` is the configuration alone (what `compare` and `regress` match
runs of different builds on); `trial_identity` adds the build and the model digest (what resume matches
on: a different build or another file is not "already FINISHED").

Canonical form (HASH_VERSION 2): the config is flattened to dotted keys the way the runner logs MLflow
params (jbench.trial.flatten), each value written as its param string (None -> "null", lists and dicts as
sorted JSON, else str()). So the identity of a recorded run can be computed again from its params and tags
(`run_hashes`): version-1 runs (no `jbench.hash_version` tag) are migrated on read, and a run that lacks
an identity key the schema gained later gets the field's default (a new field's default keeps the old
behaviour). Version 1 excluded known non-semantic keys instead and hashed the nested config.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from dataclasses import MISSING
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Optional, Union

HASH_VERSION = 2

# Dataclass metadata key: True (identity), False (not), or a scenario name / tuple of scenario names
# (identity only when the trial's backend.scenario is one of them).
IDENTITY = "identity"

# Tags a run records (see docs in trial_identity's docstring).
TAG_VERSION = "jbench.hash_version"
TAG_CONFIG_HASH = "jbench.config_hash"
TAG_IDENTITY = "jbench.identity"
TAG_BUILD = "jbench.build"
TAG_MODEL_DIGEST = "jbench.model_digest"

# Tags run_hashes reads (besides the params).
RUN_TAGS = (TAG_VERSION, TAG_CONFIG_HASH, TAG_IDENTITY, TAG_BUILD, TAG_MODEL_DIGEST, "backend.build_commit",
            "model.sha256", "model.file")

Declaration = Union[bool, str, tuple]

# Config keys renamed since their runs were recorded, hashed under the old name so that every existing
# run keeps its identity (resume and compare still match it) without a new HASH_VERSION: the model
# package's published hash was `model.sha256`, a name now kept for the hash of the file benchmarked.
HASHED_AS = {"model.source_sha256": "model.sha256"}

log = logging.getLogger("jbench")


# --------------------------------------------------------------------------------------------
# Declaring fields


def _field(default: Any, default_factory: Any, identity: Declaration, metadata: Optional[dict]):
    md = dict(metadata or {})
    md[IDENTITY] = identity
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=md)
    return dataclasses.field(default=default, metadata=md)


def ident(default: Any = MISSING, *, default_factory: Any = MISSING, scenario: Union[str, tuple, None] = None,
          metadata: Optional[dict] = None):
    """A schema field that is part of a trial's identity (in every scenario, or only in `scenario`)."""
    if scenario is None:
        declared: Declaration = True
    else:
        declared = (scenario,) if isinstance(scenario, str) else tuple(scenario)
    return _field(default, default_factory, declared, metadata)


def nonident(default: Any = MISSING, *, default_factory: Any = MISSING, metadata: Optional[dict] = None):
    """A schema field that is not part of a trial's identity (paths, time-outs, credentials, tracking...)."""
    return _field(default, default_factory, False, metadata)


def declaration(f: dataclasses.Field) -> Optional[Declaration]:
    """A field's identity declaration, or None when it has none."""
    value = f.metadata.get(IDENTITY) if f.metadata else None
    if value is None:
        return None
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (tuple, list, frozenset, set)) and value and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise TypeError(f"field {f.name}: metadata {IDENTITY}={value!r} must be True, False or scenario name(s)")


def undeclared_fields(schema: type, prefix: str = "") -> list[str]:
    """Fields of a schema (and of its nested dataclasses) that declare nothing or something invalid."""
    out = []
    for f in dataclasses.fields(schema):
        name = f"{prefix}{schema.__name__}.{f.name}"
        try:
            if declaration(f) is None:
                out.append(name)
        except TypeError as exc:
            out.append(f"{name} ({exc})")
        nested = _nested_schema(f)
        if nested is not None:
            out += undeclared_fields(nested, prefix=f"{prefix}{schema.__name__}.{f.name}:")
    return out


def _nested_schema(f: dataclasses.Field) -> Optional[type]:
    """The dataclass a field holds (through its default factory or default), else None."""
    if f.default_factory is not MISSING:  # type: ignore[misc]
        try:
            value = f.default_factory()  # type: ignore[misc]
        except Exception:
            return None
    else:
        value = f.default
    if dataclasses.is_dataclass(value):
        return value if isinstance(value, type) else type(value)
    return None


# --------------------------------------------------------------------------------------------
# Schemas: the root config and what each section holds


def section_schemas() -> dict[str, type]:
    """Schemas of the root config's sections whose JBenchConfig field is typed Any (config groups)."""
    from jbench.config import DeviceConfig, ModelConfig, TrackingConfig

    return {"device": DeviceConfig, "model": ModelConfig, "tracking": TrackingConfig}


def all_schemas() -> dict[str, type]:
    """Every schema a trial config is made of: the root, each group's schema and every registered
    backend's CONFIG (what the declaration test walks)."""
    from jbench import config as c
    from jbench.backends.base import backend_schemas

    out = {"root": c.JBenchConfig, "profile": c.ProfileConfig, **section_schemas()}
    out.update({f"backend:{name}": schema for name, schema in backend_schemas().items()})
    return out


class Leaf(NamedTuple):
    path: str  # dotted key, e.g. "backend.n_gen"
    default: Optional[str]  # canonical default; None: mandatory (no default)


_warned: set[str] = set()


def _default(f: dataclasses.Field) -> Optional[str]:
    if f.default_factory is not MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
        if dataclasses.is_dataclass(value):
            value = dataclasses.asdict(value)
    elif f.default is MISSING or f.default == "???":
        return None
    else:
        value = f.default
    return canonical(value)


def _leaves(schema: type, prefix: str, scenario: Optional[str]) -> list[Leaf]:
    out: list[Leaf] = []
    for f in dataclasses.fields(schema):
        declared = declaration(f)
        if declared is None:
            key = f"{schema.__module__}.{schema.__name__}.{f.name}"
            if key not in _warned:
                _warned.add(key)
                log.warning("config field %s declares no identity (ident/nonident): counted as identity", key)
            declared = True
        if declared is False or (isinstance(declared, tuple) and scenario not in declared):
            continue
        nested = _nested_schema(f)
        if nested is not None:
            out += _leaves(nested, f"{prefix}{f.name}.", scenario)
        else:
            out.append(Leaf(f"{prefix}{f.name}", _default(f)))
    return out


class IdentityError(ValueError):
    """The identity of a config (or recorded run) cannot be computed."""


@lru_cache(maxsize=64)
def identity_leaves(backend: Optional[str], scenario: Optional[str]) -> tuple[Leaf, ...]:
    """The identity keys of a trial of this backend in this scenario, with their canonical defaults.

    backend None: a backend that cannot be loaded (unknown name, broken plugin); its section is then left
    out here and identity_items_from_flat counts every backend key it has (nothing declares otherwise)."""
    from jbench.config import JBenchConfig

    sections: dict[str, Optional[type]] = dict(section_schemas())
    sections["backend"] = _backend_schema(backend) if backend is not None else None
    out: list[Leaf] = []
    for f in dataclasses.fields(JBenchConfig):
        declared = declaration(f)
        if declared is None:
            declared = True
        if declared is False or (isinstance(declared, tuple) and scenario not in declared):
            continue
        if f.name == "backend" and sections["backend"] is None:
            continue
        schema = sections.get(f.name) or _nested_schema(f)
        if schema is None:
            out.append(Leaf(f.name, _default(f)))
        else:
            out += _leaves(schema, f"{f.name}.", scenario)
    return tuple(out)


@lru_cache(maxsize=1)
def identity_sections() -> tuple[str, ...]:
    """Top-level config sections that hold identity fields (params outside them never count)."""
    from jbench.config import JBenchConfig

    return tuple(f.name for f in dataclasses.fields(JBenchConfig) if declaration(f) is not False)


@lru_cache(maxsize=64)
def _backend_schema(name: str) -> Optional[type]:
    """A backend's CONFIG, or None when it cannot be loaded (cached: the registry reads entry points)."""
    from jbench.backends.base import backend_class

    try:
        return backend_class(name).CONFIG
    except Exception:  # unknown name or broken plugin: the planner reports it; identity stays computable
        return None


def _backend_scenario(flat: Mapping[str, str]) -> tuple[Optional[str], Optional[str]]:
    """(backend name, scenario) of a flat config; the name is None when that backend cannot be loaded."""
    backend = flat.get("backend.name")
    if not backend or backend == "???":
        raise IdentityError("the config names no backend (backend.name)")
    schema = _backend_schema(backend)
    if schema is None:
        return None, flat.get("backend.scenario")
    scenario = flat.get("backend.scenario")
    if scenario is None:
        default = {f.name: f.default for f in dataclasses.fields(schema)}.get("scenario", MISSING)
        scenario = None if default is MISSING else default
    return backend, scenario


# --------------------------------------------------------------------------------------------
# Canonical form and hashes


def canonical(value: Any) -> str:
    """A value as its MLflow param string (jbench.tracking.common.param_value, without truncation)."""
    if value is None:
        return "null"
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, sort_keys=True, default=str)
    return str(value)


def flat_params(config: Mapping) -> dict[str, str]:
    """A resolved config as the canonical flat strings the runner records as params."""
    from jbench.trial import flatten

    return {k: canonical(v) for k, v in flatten(dict(config)).items()}


def identity_items_from_flat(flat: Mapping[str, Any], *, strict: bool = True, convert=None) -> dict[str, str]:
    """The identity keys and canonical values of a flat config (params of a run: dotted key -> string).

    A key the flat config lacks gets the field's default; a mandatory one (no default) raises IdentityError
    (strict, for recorded runs: such a run is not identifiable) or counts as "???" (a config being planned:
    composition reports it). Map-valued fields (e.g. backend.vars) count through their dotted sub-keys.
    convert: applied to each value taken (canonical() for a flattened live config; params are strings)."""
    conv = convert or (lambda v: v)
    if strict or flat.get("backend.name") not in (None, "", "???"):
        backend, scenario = _backend_scenario({k: flat[k] for k in ("backend.name", "backend.scenario") if k in flat})
    else:
        backend, scenario = None, None
    items: dict[str, str] = {}
    if backend is None:  # no declarations to go by: every backend key counts (a re-run, never a wrong skip)
        items.update({k: conv(v) for k, v in flat.items() if k.startswith("backend.")})
    for leaf in identity_leaves(backend, scenario):
        if leaf.path in flat:  # flatten() gives a key either as a value or through sub-keys, never both
            items[leaf.path] = conv(flat[leaf.path])
            continue
        if HASHED_AS.get(leaf.path) in flat:  # a run recorded before the key was renamed
            items[leaf.path] = conv(flat[HASHED_AS[leaf.path]])
            continue
        prefix = leaf.path + "."
        sub = {key: conv(value) for key, value in flat.items() if key.startswith(prefix)}
        if sub:
            items.update(sub)
        elif leaf.default is None:
            if strict:
                raise IdentityError(f"{leaf.path} is not set and has no default")
            items[leaf.path] = "???"
        else:
            items[leaf.path] = leaf.default
    return items


def identity_items(config: Mapping) -> dict[str, str]:
    """The part of a resolved trial config that is its identity, as dotted key -> canonical string."""
    from jbench.trial import flatten

    sections = {k: config[k] for k in identity_sections() if k in config}  # only these can hold identity
    return identity_items_from_flat(flatten(sections), strict=False, convert=canonical)


def identity_params(config: Mapping) -> dict[str, str]:
    """The inputs that define a trial, as MLflow params: its identity keys (config names) with a value.
    Keys that do not apply (another scenario's, a local device's connection) are no identity keys."""
    return {k: v for k, v in identity_items(config).items() if v != "null"}


def _digest(payload: dict) -> str:
    payload = {**payload, "config": {HASHED_AS.get(k, k): v for k, v in payload["config"].items()}}
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _config_digest(items: Mapping[str, str]) -> str:
    return _digest({"v": HASH_VERSION, "config": dict(items)})


def _trial_digest(items: Mapping[str, str], build: Optional[str], model_digest: Optional[str]) -> str:
    return _digest({"v": HASH_VERSION, "config": dict(items), "build": build or None,
                    "model_digest": (model_digest or "").lower() or None})


def config_hash(config: Mapping) -> str:
    """Identity of a trial's configuration alone (16 hex digits; key order free): recorded as the tag
    `jbench.config_hash`, what compare/regress match runs on across builds."""
    return _config_digest(identity_items(config))


def trial_identity(config: Mapping, *, build: Optional[str], model_digest: Optional[str]) -> str:
    """Identity of a trial (16 hex digits): its identity fields, the backend build and the model file's
    SHA-256. What resume matches FINISHED runs on (tag `jbench.identity`).

    build: the backend build as the run records it in `backend.build_commit` (llama.cpp: the commit
    `llama-bench --version` prints, e.g. "0c1e57098"); model_digest: `model_digest()` of the trial's model.
    None where a backend or model has none; the runner records what it passed as `jbench.build` and
    `jbench.model_digest`, so a later scheme can recompute the identity from the run."""
    return _trial_digest(identity_items(config), build, model_digest)


# --------------------------------------------------------------------------------------------
# Recorded runs (migration on read)


def run_hashes(params: Mapping[str, Any], tags: Mapping[str, Any], *, start_time_ms: Optional[float] = None
               ) -> tuple[Optional[str], Optional[str]]:
    """(config_hash, trial_identity) of a recorded run under the current scheme; None where unknown.

    Runs of the current HASH_VERSION carry both as tags. Others (version 1: no jbench.hash_version tag)
    are recomputed from their params (the flattened resolved config) and tags: the build is
    `backend.build_commit` (version 1) or `jbench.build`, the model digest `model.sha256` (bundled models,
    version 1) or `jbench.model_digest`; a version-1 run of a user's model file on the local machine gets
    that file's digest when the file has not changed since the run started, else its identity is unknown
    (it is run again rather than wrongly skipped)."""
    tags = {k: v for k, v in tags.items() if isinstance(v, str)}
    version = tags.get(TAG_VERSION)
    if version == str(HASH_VERSION):
        return tags.get(TAG_CONFIG_HASH) or None, tags.get(TAG_IDENTITY) or None
    flat = {k: v for k, v in params.items() if isinstance(v, str)}
    try:
        items = identity_items_from_flat(flat)
    except IdentityError:
        return None, None
    chash = _config_digest(items)
    if version is None:  # version 1
        build = tags.get("backend.build_commit")
        digest = tags.get("model.sha256")
        if not digest and flat.get("device.kind") == "local" and tags.get("model.file"):
            digest = _unchanged_local_digest(tags["model.file"], start_time_ms)
        if not digest:
            return chash, None
    else:
        build, digest = tags.get(TAG_BUILD), tags.get(TAG_MODEL_DIGEST)
    return chash, _trial_digest(items, build, digest)


def _unchanged_local_digest(path: str, start_time_ms: Optional[float]) -> Optional[str]:
    if start_time_ms is None or start_time_ms != start_time_ms:
        return None
    try:
        if os.stat(path).st_mtime * 1000 >= float(start_time_ms):
            return None  # changed (or written) after the run started: not the file it measured
        return file_digest(path)
    except OSError:
        return None


# --------------------------------------------------------------------------------------------
# Model digests


def _digest_cache_path() -> Path:
    from jbench import paths

    return paths.cache_dir() / "digests.json"


def _load_cache() -> dict:
    try:
        return json.loads(_digest_cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _save_cache_entry(key: str, entry: dict) -> None:
    path = _digest_cache_path()
    try:
        cache = _load_cache()
        cache[key] = entry
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as exc:  # a read-only cache only costs hashing again
        log.debug("digest cache not written (%s)", exc)


def file_digest(path: str, conn: Any = None) -> Optional[str]:
    """SHA-256 of a file, cached in <cache_dir>/digests.json by (where, path, size, mtime): a file is read
    once until it changes. conn: the device Connection the path is on (None or a local one: this machine);
    on a remote device the digest is `sha256sum` run there. None when the file cannot be read."""
    if conn is None or getattr(conn, "is_local", False):
        try:
            real = os.path.realpath(os.path.expanduser(path))
            st = os.stat(real)
        except OSError:
            return None
        key, stamp = f"local:{real}", [st.st_size, st.st_mtime_ns, st.st_ino]
    else:
        res = conn.run(["stat", "-L", "-c", "%s %Y %i", path], timeout=30)
        if not res.ok:
            return None
        key, stamp = f"{getattr(conn, 'name', 'device')}:{path}", res.stdout.split()
    cached = _load_cache().get(key)
    if cached and cached.get("stamp") == stamp:
        return cached["sha256"]
    if conn is None or getattr(conn, "is_local", False):
        from jbench.models.store import sha256_file

        try:
            digest = sha256_file(Path(real))
        except OSError:
            return None
    else:
        res = conn.run(["sha256sum", "--", path], timeout=1800)
        if not res.ok or not res.stdout.split():
            return None
        digest = res.stdout.split()[0].lower()
    _save_cache_entry(key, {"stamp": stamp, "sha256": digest})
    return digest


def model_digest(model: Mapping, conn: Any = None) -> Optional[str]:
    """SHA-256 of a trial's model file (the `model` section of its config).

    A bundled model: the store manifest's SHA-256 (recorded when `jbench setup` made the file; nothing
    is read). A user's file (model.files / model.path_template): file_digest() of the resolved path on the
    device. None when the file is not resolved or not readable (the trial then fails as missing_model)."""
    from jbench.models.store import ModelError, resolve_model_file

    try:
        path, facts = resolve_model_file(dict(model))
    except ModelError:
        return None
    if facts.get("model.sha256"):
        return facts["model.sha256"]
    return file_digest(path, conn)
