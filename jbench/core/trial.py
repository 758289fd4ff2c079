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

    @property
    def short_label(self) -> str:
        """What the run is, in a few words: the varying dimensions' values (`MAXN_SUPER clocks=on Q4_K_M d4096`),
        or the model and quant of a trial with none. The MLflow run name; the terminal may show it too."""
        text = short_label(self.point) or f"{self.config['model']['name']} {self.config['model']['quant']}"
        return f"{text} r{self.round}/{self.rounds}" if self.rounds > 1 else text

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


# Sweep keys shown by value alone (their values say what they are) or under a short name.
_BARE = {"model.quant", "power.mode", "model", "device", "backend", "model.name", "device.name", "backend.name"}
_SHORT = {"power.jetson_clocks": "clocks", "power.fan": "fan", "backend.flash_attn": "fa",
          "backend.n_gpu_layers": "ngl", "backend.threads": "t", "backend.scenario": "", "profile": ""}
# Where a key's part goes in the name: power state first, then the model, then what the backend runs.
_RANK = {"device": 0, "power": 1, "profile": 1, "model": 2, "backend": 3}
_FIRST = ("power.mode", "power.jetson_clocks", "power.fan", "model", "model.name", "model.quant")  # within a rank


def _short_value(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def short_label(point: dict) -> str:
    """A sweep point as a short name: `{"power.mode": "MAXN_SUPER", "model.quant": "Q4_K_M", "backend.depth": 4096}`
    -> `MAXN_SUPER Q4_K_M d4096`; K and V cache types that are equal read `kv=q8_0`."""
    point = dict(point)
    k, v = point.get("backend.cache_type_k"), point.get("backend.cache_type_v")
    kv_same = "backend.cache_type_k" in point and "backend.cache_type_v" in point and k == v
    parts: list[tuple[int, int, str]] = []
    for i, (key, value) in enumerate(point.items()):
        rank = _RANK.get(key.split(".")[0], 4)
        if kv_same and key == "backend.cache_type_v":
            continue
        if kv_same and key == "backend.cache_type_k":
            text = f"kv={_short_value(value)}"
        elif key == "backend.cache_type_k" or key == "backend.cache_type_v":
            text = f"{key[-1]}={_short_value(value)}"
        elif key == "backend.depth":
            text = f"d{_short_value(value)}"
        elif key in _BARE or _SHORT.get(key) == "":
            text = _short_value(value)
        else:
            text = f"{_SHORT.get(key, key.rsplit('.', 1)[-1])}={_short_value(value)}"
        parts.append((rank, _FIRST.index(key) if key in _FIRST else len(_FIRST) + i, text))
    return " ".join(text for _, _, text in sorted(parts))


def wants_power_control(mode: Any, jetson_clocks: Any, fan: Any) -> bool:
    """A trial controls the device's power state when it sets any of power.mode/jetson_clocks/fan."""
    return mode is not None or jetson_clocks is not None or fan is not None


def context_tokens(backend: dict) -> int:
    """Tokens a trial holds in its context at the end: depth before the test + prompt + generated."""
    return int(backend.get("depth", 0)) + int(backend.get("n_prompt", 0)) + int(backend.get("n_gen", 0))


def resume_key(config_hash: str, round_no: int | str = 1) -> str:
    """What makes a FINISHED run count as this trial done: its identity and its round."""
    return f"{config_hash}:{round_no}"
