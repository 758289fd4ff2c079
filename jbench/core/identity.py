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
params (jbench.core.trial.flatten), each value written as its param string (None -> "null", lists and dicts as
sorted JSON, else str()). So the identity of a recorded run can be computed again from its params and tags
(`run_hashes`): version-1 runs (no `jbench.hash_version` tag) are migrated on read. Version 1 excluded known
non-semantic keys instead and hashed the nested config.

Keys added later: the identity keys of version 2 are frozen in jbench.core.identity_keys; a key added since is
registered there with its default, and at that default it is left out of the hash. So adding a field changes no
recorded trial's identity (a trial at the new field's default is the trial it was before), while a trial that sets
it to anything else is a new trial. A test fails on an identity key that is neither frozen nor registered.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import MISSING
from functools import lru_cache
from typing import Any, Callable, Mapping, NamedTuple, Optional

from jbench.core import registry
from jbench.core.identity_keys import ADDED_DEFAULTS
from jbench.core.registry import backend_schemas
from jbench.core.schema import (DeviceConfig, JBenchConfig, ModelConfig, ProfileConfig, TrackingConfig, _nested_schema,
                                declaration)
from jbench.core.trial import flatten

HASH_VERSION = 2

_UNSET = object()

# Tags a run records (see docs in trial_identity's docstring).
TAG_VERSION = "jbench.hash_version"
TAG_CONFIG_HASH = "jbench.config_hash"
TAG_IDENTITY = "jbench.identity"
TAG_BUILD = "jbench.build"
TAG_MODEL_DIGEST = "jbench.model_digest"

# Tags run_hashes reads (besides the params).
RUN_TAGS = (TAG_VERSION, TAG_CONFIG_HASH, TAG_IDENTITY, TAG_BUILD, TAG_MODEL_DIGEST, "backend.build_commit",
            "model.sha256", "model.file")

# Config keys renamed since their runs were recorded, hashed under the old name so that every existing
# run keeps its identity (resume and compare still match it) without a new HASH_VERSION: the model
# package's published hash was `model.sha256`, a name now kept for the hash of the file benchmarked.
HASHED_AS = {"model.source_sha256": "model.sha256"}

log = logging.getLogger("jbench")


# --------------------------------------------------------------------------------------------
# Schemas: the root config and what each section holds


def section_schemas() -> dict[str, type]:
    """Schemas of the root config's sections whose JBenchConfig field is typed Any (config groups)."""
    return {"device": DeviceConfig, "model": ModelConfig, "tracking": TrackingConfig}


def all_schemas() -> dict[str, type]:
    """Every schema a trial config is made of: the root, each group's schema and every registered
    backend's CONFIG (what the declaration test walks)."""
    out = {"root": JBenchConfig, "profile": ProfileConfig, **section_schemas()}
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
    schemas: dict[str, Optional[type]] = dict(section_schemas())
    schemas["backend"] = _backend_schema(backend) if backend is not None else None
    out: list[Leaf] = []
    for f in dataclasses.fields(JBenchConfig):
        declared = declaration(f)
        if declared is None:
            declared = True
        if declared is False or (isinstance(declared, tuple) and scenario not in declared):
            continue
        if f.name == "backend" and schemas["backend"] is None:
            continue
        schema = schemas.get(f.name) or _nested_schema(f)
        if schema is None:
            out.append(Leaf(f.name, _default(f)))
        else:
            out += _leaves(schema, f"{f.name}.", scenario)
    return tuple(out)


@lru_cache(maxsize=1)
def identity_sections() -> tuple[str, ...]:
    """Top-level config sections that hold identity fields (params outside them never count)."""
    return tuple(f.name for f in dataclasses.fields(JBenchConfig) if declaration(f) is not False)


@lru_cache(maxsize=64)
def _backend_schema(name: str) -> Optional[type]:
    """A backend's CONFIG, or None when it cannot be loaded (cached: the registry reads entry points)."""
    try:
        return registry.load(registry.BACKENDS, name).CONFIG
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

    sections = {k: config[k] for k in identity_sections() if k in config}  # only these can hold identity
    return identity_items_from_flat(flatten(sections), strict=False, convert=canonical)


def identity_params(config: Mapping) -> dict[str, str]:
    """The inputs that define a trial, as MLflow params: its identity keys (config names) with a value.
    Keys that do not apply (another scenario's, a local device's connection) are no identity keys."""
    return {k: v for k, v in identity_items(config).items() if v != "null"}


def frozen_name(key: str, backend: Optional[str]) -> str:
    """A key as jbench.core.identity_keys names it: a backend's keys with the backend's name in front."""
    return f"{backend}:{key}" if key.startswith("backend.") else key


def _hashed(items: Mapping[str, str]) -> dict[str, str]:
    """The items a hash is made of (identity items: dotted key -> canonical value): a key added after HASH_VERSION 2
    began counts only away from the default it had when it was added (jbench.core.identity_keys), so adding it
    changed no recorded trial's identity."""
    backend = items.get("backend.name")
    return {HASHED_AS.get(k, k): v for k, v in items.items()
            if ADDED_DEFAULTS.get(frozen_name(k, backend), _UNSET) != v}


def _digest(payload: dict) -> str:
    payload = {**payload, "config": _hashed(payload["config"])}
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


def run_hashes(params: Mapping[str, Any], tags: Mapping[str, Any], *, start_time_ms: Optional[float] = None,
               local_digest: Optional[Callable[[str, Optional[float]], Optional[str]]] = None
               ) -> tuple[Optional[str], Optional[str]]:
    """(config_hash, trial_identity) of a recorded run under the current scheme; None where unknown.

    Runs of the current HASH_VERSION carry both as tags. Others (version 1: no jbench.hash_version tag)
    are recomputed from their params (the flattened resolved config) and tags: the build is
    `backend.build_commit` (version 1) or `jbench.build`, the model digest `model.sha256` (bundled models,
    version 1) or `jbench.model_digest`; a version-1 run of a user's model file on the local machine gets
    that file's digest (local_digest(path, start_time_ms): jbench.models.digest.unchanged_local_digest) when the file has not changed since the run started, else its identity is unknown
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
            digest = local_digest(tags["model.file"], start_time_ms) if local_digest else None
        if not digest:
            return chash, None
    else:
        build, digest = tags.get(TAG_BUILD), tags.get(TAG_MODEL_DIGEST)
    return chash, _trial_digest(items, build, digest)
