"""Plan a sweep: compose the config, expand the grid into trials, validate every trial.

Sweep dimensions come from the experiment's `sweep.grid` and from comma lists on the command
line (`backend.n_gen=64,128`, parsed by Hydra's own override parser); a command-line list for a
key the grid already sweeps replaces that dimension. A dimension over a config group
(`model=a,b`) composes the config once per choice; a dimension over a value is checked against
the typed schema once per distinct value and then applied to plain dicts, so planning stays fast
for large grids. Nothing here touches a device.
"""

from __future__ import annotations

import copy
import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..config import ConfigError, compose, explain_compose_error, load_profile
from ..trial import Trial, config_hash

GROUP_DIMS = ("device", "backend", "model", "tracking")


@dataclass
class Plan:
    trials: list[Trial]
    problems: list[str] = field(default_factory=list)
    dims: dict[str, list] = field(default_factory=dict)
    experiment: str = "adhoc"
    tracking: dict = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)


def split_overrides(args: list[str]) -> tuple[list[str], dict[str, list]]:
    """(plain overrides for composition, sweep dimensions {key: [values]}) from CLI overrides."""
    plain, dims, _ = _parse_overrides(args)
    return plain, dims


def _parse_overrides(args: list[str]) -> tuple[list[str], dict[str, list], set[str]]:
    """Also returns the keys given a single value, which pin a grid dimension to that value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    try:
        parsed = OverridesParser.create().parse_overrides(list(args))
    except OverrideParseException as exc:
        raise ConfigError(
            f"malformed override: {str(exc).splitlines()[0]}. Overrides look like key=value, group=name or key=a,b,c"
        ) from None
    plain, dims, pinned = [], {}, set()
    for ov in parsed:
        if not ov.is_sweep_override():
            plain.append(ov.input_line)
            pinned.add(ov.key_or_group)
            continue
        key = ov.key_or_group
        if key == "experiment":
            raise ConfigError("one experiment per sweep: run `jbench sweep +experiment=NAME` once per experiment")
        if ov.is_add() or ov.is_force_add():
            raise ConfigError(f"cannot sweep over a key that is being added ({ov.input_line}); sweep existing keys")
        values = list(ov.sweep_string_iterator()) if key in GROUP_DIMS else list(ov.sweep_iterator())
        dims[key] = values
    return plain, dims, pinned


def _references(value: Any, out: set[str]) -> None:
    """Config paths that ${...} interpolations in value refer to (resolvers like oc.env excluded)."""
    if isinstance(value, dict):
        for v in value.values():
            _references(v, out)
    elif isinstance(value, list):
        for v in value:
            _references(v, out)
    elif isinstance(value, str) and "${" in value:
        out.update(m for m in re.findall(r"\$\{([\w.]+)\}", value))


def _overlaps(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def _set_dotted(d: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    for part in parts[:-1]:
        d = d[part]
    d[parts[-1]] = value


def _check_value(cfg, key: str, value: Any) -> tuple[Any, Optional[str]]:
    """Value as the schema converts it, or an error naming the key and what is expected."""
    from omegaconf import OmegaConf

    try:
        OmegaConf.update(cfg, key, value, merge=False)
        node = OmegaConf.select(cfg, key)
        converted = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
        return converted, None
    except Exception as exc:  # OmegaConf raises several types for unknown keys and bad values
        return None, explain_compose_error(exc, [])


def plan(overrides: list[str], config_dirs: Optional[list[Path]] = None, *, use_grid: bool = True) -> Plan:
    """Expand and validate. Raises ConfigError for problems of the config as a whole."""
    from omegaconf import OmegaConf

    from ..backends.base import backend_class

    plain, cli_dims, pinned = _parse_overrides(overrides)
    first_cfg, first_choices = compose(plain, config_dirs)
    grid = OmegaConf.to_container(first_cfg.sweep.grid, resolve=True) if use_grid else {}
    if not use_grid and cli_dims:
        raise ConfigError(
            f"`jbench run` runs one trial; comma lists ({', '.join(cli_dims)}) belong to `jbench sweep`"
        )
    dims: dict[str, list] = {}
    for key, values in grid.items():
        if key in pinned:
            continue  # `model.quant=Q8_0` on the command line pins the grid's model.quant dimension
        if not isinstance(values, list) or not values:
            raise ConfigError(f"sweep.grid.{key} must be a non-empty list of values")
        dims[key] = values
    dims.update(cli_dims)
    group_dims = {k: [str(v) for v in vs] for k, vs in dims.items() if k in GROUP_DIMS}
    value_dims = {k: vs for k, vs in dims.items() if k not in GROUP_DIMS}

    trials: list[Trial] = []
    problems: dict[str, list[str]] = {}
    tracking: dict = {}
    experiment = "adhoc"
    group_keys = list(group_dims)
    for group_values in itertools.product(*group_dims.values()):
        group_point = dict(zip(group_keys, group_values))
        if group_point:
            cfg, choices = compose(plain + [f"{k}={v}" for k, v in group_point.items()], config_dirs)
        else:
            cfg, choices = first_cfg, first_choices
        # Validate each distinct swept value once against the typed schema.
        scratch = copy.deepcopy(cfg)
        converted: dict[str, list] = {}
        for key, values in value_dims.items():
            converted[key] = []
            for value in values:
                conv, err = _check_value(scratch, key, value)
                if err:
                    raise ConfigError(f"sweep value {key}={value!r}: {err}")
                converted[key].append(conv)
        unresolved = OmegaConf.to_container(cfg, resolve=False)
        refs: set[str] = set()
        _references(unresolved, refs)
        slow = any(_overlaps(r, k) for r in refs for k in value_dims)
        base = OmegaConf.to_container(cfg, resolve=True)
        base.pop("sweep", None)
        if base["device"].get("profile"):
            # The module profile travels with the trial (roofline, telemetry rails, findings).
            base["profile"] = load_profile(base["device"]["profile"], config_dirs)
        tracking = tracking or base["tracking"]
        experiment = base["experiment"]["name"]
        value_keys = list(converted)
        for values in itertools.product(*converted.values()):
            point = dict(zip(value_keys, values))
            if slow:
                trial_cfg = copy.deepcopy(cfg)
                for k, v in point.items():
                    OmegaConf.update(trial_cfg, k, v, merge=False)
                config = OmegaConf.to_container(trial_cfg, resolve=True)
                config.pop("sweep", None)
                if "profile" in base:
                    config["profile"] = copy.deepcopy(base["profile"])
            else:
                config = copy.deepcopy(base)
                for k, v in point.items():
                    _set_dotted(config, k, v)
            full_point = {**group_point, **point}
            trials.append(
                Trial(index=len(trials) + 1, config=config, choices=dict(choices), point=full_point,
                      config_hash=config_hash(config))
            )

    # Validation: every trial, all problems reported together.
    backends: dict[str, Any] = {}
    for trial in trials:
        name = trial.config["backend"]["name"]
        if name not in backends:
            try:
                backends[name] = backend_class(name)
            except KeyError as exc:
                backends[name] = str(exc.args[0])
        cls = backends[name]
        msgs = [cls] if isinstance(cls, str) else cls(trial.config["backend"]).validate(trial)
        for msg in msgs:
            problems.setdefault(msg, []).append(trial.label)
    formatted = []
    for msg, labels in problems.items():
        where = labels[0] if len(labels) == 1 else f"{len(labels)} trials, e.g. {labels[0]}"
        formatted.append(f"{msg}  [{where}]")
    return Plan(trials=trials, problems=formatted, dims=dims, experiment=experiment, tracking=tracking,
                overrides=list(overrides))
