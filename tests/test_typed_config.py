"""Typed views of plain config sections (jbench.core.schema.typed) and a trial's TrialConfig (Trial.cfg).

typed() builds the schema objects without OmegaConf; the shipped config must come out exactly as
OmegaConf.to_object makes it, for every section and option, so the two cannot drift apart."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from importlib.resources import files
from typing import Any, Optional

import pytest
import yaml
from omegaconf import OmegaConf

from jbench.backends.llamacpp.backend import LlamaCppConfig
from jbench.config import available_choices, compose
from jbench.core.schema import (DeviceConfig, DevicePaths, JBenchConfig, ModelConfig, PowerConfig, ProfileConfig,
                                SchemaError, SweepConfig, TrackingConfig, nonident, typed)
from jbench.core.trial import Trial, TrialConfig, backend_schema, trial_config

GROUP_SCHEMAS = {"device": DeviceConfig, "model": ModelConfig, "tracking": TrackingConfig}
# The root sections with a schema of their own (power, telemetry, energy, wall_power, thermal, experiment, sweep, farm).
ROOT_SCHEMAS = {name: hint for name, hint in typing.get_type_hints(JBenchConfig).items() if dataclasses.is_dataclass(hint)}


def _omegaconf(schema: type, section: Any) -> Any:
    """The schema object as OmegaConf makes it (what jbench used before typed())."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), section))


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True)


# --------------------------------------------------------------------------------------------
# typed() equals the OmegaConf conversion for everything shipped


@pytest.mark.parametrize("group", ["device", "backend", "model", "tracking"])
def test_every_shipped_group_option_converts_as_omegaconf_does(group):
    for name in available_choices(group):
        cfg, _ = compose([f"{group}={name}"])
        section = _plain(cfg[group])
        schema = backend_schema(cfg.backend.name) if group == "backend" else GROUP_SCHEMAS[group]  # a declaration (llama_server) names its backend
        assert typed(schema, section) == _omegaconf(schema, section), f"{group}={name}"


@pytest.mark.parametrize("experiment", [None, *available_choices("experiment")])
def test_every_root_section_of_every_shipped_experiment_converts_as_omegaconf_does(experiment):
    cfg, _ = compose([f"+experiment={experiment}"] if experiment else [])
    assert set(ROOT_SCHEMAS) >= {"power", "telemetry", "energy", "wall_power", "thermal", "experiment", "sweep", "farm"}
    for name, schema in ROOT_SCHEMAS.items():
        section = _plain(cfg[name])
        assert typed(schema, section) == _omegaconf(schema, section), f"{experiment}: {name}"


def test_every_shipped_profile_converts_as_omegaconf_does():
    names = available_choices("profile")
    assert len(names) >= 10
    for name in names:
        data = yaml.safe_load(files("jbench.conf").joinpath("profile", f"{name}.yaml").read_text())
        data.pop("defaults", None)
        assert typed(ProfileConfig, data) == _omegaconf(ProfileConfig, data), name


def test_a_planned_trials_config_matches_the_omegaconf_conversion_section_by_section():
    from jbench.sweeps.plan import plan

    trial = plan(["model.quant=Q4_0", "backend.n_gen=16"], use_grid=False).trials[0]
    cfg = trial_config(trial.config)
    assert cfg.backend == _omegaconf(LlamaCppConfig, trial.config["backend"]) and cfg.backend.n_gen == 16
    for name in ("device", "model", "power", "telemetry", "energy", "wall_power", "thermal", "experiment",
                 "tracking", "farm"):
        schema = type(getattr(cfg, name))
        assert getattr(cfg, name) == _omegaconf(schema, trial.config[name]), name


# --------------------------------------------------------------------------------------------
# typed(): defaults, nesting, copies, errors


def test_missing_keys_take_the_schema_defaults_and_nested_sections_are_built():
    device = typed(DeviceConfig, {"name": "orin", "kind": "ssh", "paths": {"state_dir": "/var/jbench"}})
    assert device == DeviceConfig(name="orin", kind="ssh", paths=DevicePaths(state_dir="/var/jbench"))
    assert isinstance(device.paths, DevicePaths) and device.paths.boot_id == DevicePaths().boot_id
    assert typed(PowerConfig, None) == PowerConfig() and typed(PowerConfig, {}) == PowerConfig()


def test_a_schema_object_is_returned_as_it_is():
    power = PowerConfig(mode="MAXN")
    assert typed(PowerConfig, power) is power


def test_lists_and_dicts_are_copied_not_shared_with_the_plain_config():
    section = {"grid": {"model.quant": ["Q4_0", "Q8_0"]}, "link": [["a", "b"]], "exclude": [{"x": [1]}]}
    sweep = typed(SweepConfig, section)
    assert sweep.grid == section["grid"] and sweep.link == [["a", "b"]] and sweep.exclude == [{"x": [1]}]
    sweep.grid["model.quant"].append("F16")
    sweep.exclude[0]["x"].append(2)
    assert section["grid"]["model.quant"] == ["Q4_0", "Q8_0"] and section["exclude"] == [{"x": [1]}]


def test_an_unknown_key_is_named_with_its_path_and_the_closest_field():
    with pytest.raises(SchemaError, match=r"unknown config key 'device\.hots'.*did you mean 'host'"):
        typed(DeviceConfig, {"hots": "orin"}, where="device")
    with pytest.raises(SchemaError, match=r"'device\.paths\.no_such_path'"):
        typed(DeviceConfig, {"paths": {"no_such_path": "/x"}}, where="device")
    with pytest.raises(TypeError, match="expected a mapping or PowerConfig"):
        typed(PowerConfig, ["MAXN"])


@dataclass
class _Inner:
    x: int = nonident(0)


@dataclass
class _Outer:
    required: str = nonident()
    one: Optional[_Inner] = nonident(None)
    many: list[_Inner] = nonident(default_factory=list)
    named: dict[str, _Inner] = nonident(default_factory=dict)


def test_dataclasses_in_optional_list_and_dict_fields_are_built_and_a_mandatory_field_is_named():
    outer = typed(_Outer, {"required": "r", "one": {"x": 1}, "many": [{"x": 2}], "named": {"a": {"x": 3}}})
    assert outer == _Outer("r", _Inner(1), [_Inner(2)], {"a": _Inner(3)})
    assert typed(_Outer, {"required": "r", "one": None}).one is None
    with pytest.raises(SchemaError, match="required: mandatory in _Outer and not set"):
        typed(_Outer, {})


def test_a_schema_whose_annotations_cannot_be_resolved_keeps_plain_values():
    @dataclass
    class Local:  # annotations name a class local to this function: get_type_hints cannot resolve them
        inner: Optional[_LocalInner] = nonident(None)  # noqa: F821

    assert typed(Local, {"inner": {"x": 1}}).inner == {"x": 1}


# --------------------------------------------------------------------------------------------
# TrialConfig and Trial.cfg


def _config(**sections: Any) -> dict:
    base = {"device": {"name": "d"}, "model": {"name": "m", "quant": "Q4_0"}, "backend": {"name": "llamacpp"}}
    return {**base, **sections}


def test_trial_cfg_types_every_section_and_is_built_once():
    trial = Trial(1, _config(power={"mode": "MAXN"}, profile={"name": "orin_nano_8gb", "ram_gb": 8.0}), {}, {}, "h")
    cfg = trial.cfg
    assert cfg is trial.cfg and isinstance(cfg, TrialConfig)
    assert isinstance(cfg.backend, LlamaCppConfig) and cfg.backend.n_gen == LlamaCppConfig().n_gen
    assert cfg.power.mode == "MAXN" and cfg.wants_power_control
    assert cfg.profile == ProfileConfig(name="orin_nano_8gb", ram_gb=8.0)
    # Sections the plain config lacks hold their defaults: every field of TrialConfig is a schema object.
    for f in dataclasses.fields(TrialConfig):
        if f.name not in ("backend", "profile"):
            assert dataclasses.is_dataclass(getattr(cfg, f.name)), f.name
    assert cfg.sweep == SweepConfig()
    assert dataclasses.replace(trial, config=_config()).cfg.profile is None  # a new trial, a new view


def test_a_trial_of_an_unknown_backend_or_with_an_unknown_key_is_refused_by_name():
    with pytest.raises(KeyError, match="unknown backend 'nope'"):
        Trial(1, _config(backend={"name": "nope"}), {}, {}, "h").cfg
    with pytest.raises(SchemaError, match=r"'backend\.n_gens'"):
        Trial(1, _config(backend={"name": "llamacpp", "n_gens": 3}), {}, {}, "h").cfg
