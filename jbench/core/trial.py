"""A Trial: one planned cell of a sweep (its config, where it came from, its identity hash and round), and
its config as schema objects (TrialConfig).

The identity itself (which config fields count) is declared on the schemas and computed in jbench.identity."""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Mapping, Optional, Protocol, runtime_checkable

from jbench.core import registry
from jbench.core.schema import (DeviceConfig, EnergyConfig, ExperimentConfig, FarmConfig, ModelConfig, PowerConfig,
                                ProfileConfig, QualityConfig, ServingConfig, SweepConfig, TelemetryConfig, ThermalConfig, TrackingConfig,
                                WallPowerConfig, typed)


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


@dataclass
class TrialConfig:
    """A trial's resolved config as schema objects: attribute access, so a renamed key fails where it is read.

    `backend` is the backend's own CONFIG dataclass (LlamaCppConfig, ...), found by backend.name in the
    registry. A section the plain config lacks holds its schema's defaults (the planner keeps `sweep` in the
    Plan); `profile` is None for a device without a module profile."""

    device: DeviceConfig
    backend: Any
    model: ModelConfig
    power: PowerConfig = field(default_factory=PowerConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    energy: EnergyConfig = field(default_factory=EnergyConfig)
    wall_power: WallPowerConfig = field(default_factory=WallPowerConfig)
    thermal: ThermalConfig = field(default_factory=ThermalConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    farm: FarmConfig = field(default_factory=FarmConfig)
    quality: QualityConfig = field(default_factory=QualityConfig)
    serving: ServingConfig = field(default_factory=ServingConfig)
    profile: Optional[ProfileConfig] = None

    @property
    def wants_power_control(self) -> bool:
        return wants_power_control(self.power.mode, self.power.jetson_clocks, self.power.fan)


def backend_schema(name: str) -> type:
    """The CONFIG dataclass of the backend registered under name (KeyError names the valid ones)."""
    return registry.load(registry.BACKENDS, name).CONFIG


@dataclass(frozen=True)
class BackendKeys:
    """The keys every backend's CONFIG has (docs/backends.md): the planner's typed view of a backend section whose
    backend is not registered, so its checks and its order still read the trial typed (it reports the name)."""

    name: Optional[str] = None
    n_prompt: int = 0
    n_gen: int = 0
    depth: int = 0
    repetitions: int = 1


_BACKEND_KEYS = frozenset(f.name for f in dataclasses.fields(BackendKeys))


def backend_config(section: Any, *, unknown_ok: bool = False) -> Any:
    """A backend section as its backend's CONFIG: a plain section is built by the schema its `name` picks; a
    schema object is returned as it is. An unregistered name is a KeyError naming the valid ones, or with
    unknown_ok the section's BackendKeys."""
    if section is not None and not isinstance(section, Mapping):
        return section
    section = section or {}
    try:
        schema = backend_schema(section.get("name"))
    except KeyError:
        if not unknown_ok:
            raise
        return BackendKeys(**{key: value for key, value in section.items() if key in _BACKEND_KEYS})
    return typed(schema, section, where="backend")


def _section_builder(schema: type, name: str) -> Callable[[Any], Any]:
    return lambda section: typed(schema, section, where=name)


# How each field of TrialConfig is built from the plain section of the same name (None where the config lacks
# it); keys that are no field (the planner's `quality`, ...) are not part of the typed view.
_BUILDERS: dict[str, Callable[[Any], Any]] = {
    name: _section_builder(schema, name) for name, schema in typing.get_type_hints(TrialConfig).items()
    if name not in ("backend", "profile")}
_BUILDERS["profile"] = lambda section: typed(ProfileConfig, section, where="profile") if section else None


def trial_config(config: Mapping[str, Any], *, unknown_backend_ok: bool = False) -> TrialConfig:
    """The schema objects of a trial's plain, resolved config (typed() per section; no OmegaConf). A backend that
    is not registered is a KeyError, or with unknown_backend_ok (the planner, which reports it) its BackendKeys."""
    builders = {**_BUILDERS, "backend": functools.partial(backend_config, unknown_ok=unknown_backend_ok)}
    return TrialConfig(**{name: build(config.get(name)) for name, build in builders.items()})


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
        text = short_label(self.point) or f"{self.cfg.model.name} {self.cfg.model.quant}"
        return f"{text} r{self.round}/{self.rounds}" if self.rounds > 1 else text

    @cached_property
    def cfg(self) -> TrialConfig:
        """The config as schema objects, built once per trial (the frozen dataclass keeps its config as it is),
        or given by the planner (with_cfg). Never mutated: trials of one plan may share it and its sections."""
        return trial_config(self.config)

    def with_cfg(self, cfg: TrialConfig) -> Trial:
        """This trial with `cfg`, built from this very config, as its typed view: the planner builds one per cell
        for its own checks, and a planned trial of an unregistered backend keeps its BackendKeys (such a plan
        has a problem and never runs)."""
        self.__dict__["cfg"] = cfg  # the cache of the cached_property, set before anything reads it
        return self

    @property
    def wants_power_control(self) -> bool:
        return self.cfg.wants_power_control

    @property
    def context_tokens(self) -> int:
        return context_tokens(self.cfg.backend)

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


def context_tokens(backend: Any) -> int:
    """Tokens a trial holds in its context at the end: depth before the test + prompt + generated. backend: a
    backend's CONFIG or BackendKeys. A serving backend (load levels, no fixed lengths) has none of these keys: 0."""
    if not isinstance(backend, FixedLengths):
        return 0
    return backend.depth + backend.n_prompt + backend.n_gen


def resume_key(config_hash: str, round_no: int | str = 1) -> str:
    """What makes a FINISHED run count as this trial done: its identity and its round."""
    return f"{config_hash}:{round_no}"


@runtime_checkable
class ChoosesKVTypes(Protocol):
    """A backend config that chooses the KV cache's types (llama.cpp's keys); the memory check counts f16 for others."""

    cache_type_k: str
    cache_type_v: str


@runtime_checkable
class FixedLengths(Protocol):
    """A backend config that runs fixed token counts (llama-bench-like); a serving backend's load levels have none."""

    depth: int
    n_prompt: int
    n_gen: int


@runtime_checkable
class HasScenario(Protocol):
    """A backend config with scenarios (llama.cpp: bench, latency, serving; openai: serving)."""

    scenario: str


@runtime_checkable
class SwitchesFlashAttention(Protocol):
    """A backend config with a flash-attention switch (llama.cpp's key)."""

    flash_attn: str
