"""A Trial: one planned cell of a sweep (its config, where it came from, its identity hash and round).

The identity itself (which config fields count) is declared on the schemas and computed in jbench.identity."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
