"""The types every part of jbench shares: a Trial (what to run) and its results."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional

# Keys that do not change what a trial measures; they stay out of its identity hash.
_NON_SEMANTIC = {
    "tracking": None,
    "sweep": None,
    "profile": None,
    "telemetry": None,
    "energy": None,
    "thermal": None,
    "quality": None,
    "round": None,
    "experiment": None,
    "backend": {"timeout_s", "binary_dir", "server_ready_timeout_s"},
    "model": {"display_name", "files", "path_template", "package", "package_version", "ladder"},
    "device": {"host", "user", "port", "key", "tags", "known_hosts", "accept_new_host_key", "connect_timeout_s",
               "keepalive_s", "jump", "sudo_password_env", "paths", "bandwidth_gbs"},
}


# Backend keys that only matter in one scenario (backend.scenario, llama.cpp's "bench" or "latency"). A bench
# trial drops the latency keys and `scenario` itself, so its hash is the one it had before scenarios existed.
_SCENARIO_ONLY = {
    "bench": {"scenario", "latency_requests", "latency_concurrency", "latency_warmup_requests", "context",
              "server_extra_args"},
    "latency": {"repetitions", "warmup", "extra_args"},
}


def semantic_config(config: dict) -> dict:
    """The part of a resolved trial config that determines what is measured."""
    out = {}
    for section, value in config.items():
        if section in _NON_SEMANTIC and _NON_SEMANTIC[section] is None:
            continue
        drop = _NON_SEMANTIC.get(section) or set()
        if section == "backend" and isinstance(value, dict) and value.get("scenario") in _SCENARIO_ONLY:
            drop = drop | _SCENARIO_ONLY[value["scenario"]]
        if isinstance(value, dict):
            out[section] = {k: v for k, v in value.items() if k not in drop}
        else:
            out[section] = value
    return out


def config_hash(config: dict) -> str:
    """Stable identity of a trial: SHA-256 of its semantic config as canonical JSON (key order free)."""
    canonical = json.dumps(semantic_config(config), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists and empty dicts stay values."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


@dataclass(frozen=True)
class Trial:
    """One cell of a sweep: a fully resolved config and where it came from."""

    index: int  # 1-based position in the sweep's run order
    config: dict  # resolved, plain containers
    choices: dict  # Hydra group choices (device=local, model=gemma3_270m, ...)
    point: dict  # the sweep values that define this cell, e.g. {"model.quant": "Q4_0"}
    config_hash: str
    # sweep.rounds splits a trial's repetitions over interleaved passes of the whole sweep: this is pass
    # `round` of `rounds` (each pass is its own run; together they are the trial's measurement).
    round: int = 1
    rounds: int = 1

    @property
    def label(self) -> str:
        if not self.point:
            return "(single trial)"
        return " ".join(f"{k}={v}" for k, v in self.point.items())

    def section(self, name: str) -> dict:
        return self.config[name]

    @property
    def wants_power_control(self) -> bool:
        p = self.config.get("power") or {}
        return wants_power_control(p.get("mode"), p.get("jetson_clocks"), p.get("fan"))

    @property
    def context_tokens(self) -> int:
        return context_tokens(self.config["backend"])

    @property
    def resume_key(self) -> str:
        return resume_key(self.config_hash, self.round)


def wants_power_control(mode: Any, jetson_clocks: Any, fan: Any) -> bool:
    """A trial controls the device's power state when it sets any of power.mode/jetson_clocks/fan."""
    return mode is not None or jetson_clocks is not None or fan is not None


def context_tokens(backend: dict) -> int:
    """Tokens a trial holds in its context at the end: depth before the test + prompt + generated."""
    return int(backend.get("depth", 0)) + int(backend.get("n_prompt", 0)) + int(backend.get("n_gen", 0))


def resume_key(config_hash: str, round_no: int | str = 1) -> str:
    """What makes a FINISHED run count as this trial done: its identity and its round."""
    return f"{config_hash}:{round_no}"
