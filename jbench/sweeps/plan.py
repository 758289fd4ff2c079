"""Plan a sweep: compose the config, expand the grid into trials, validate every trial.

Sweep dimensions come from the experiment's `sweep.grid` and from comma lists on the command
line (`backend.n_gen=64,128`, parsed by Hydra's own override parser); a command-line list for a
key the grid already sweeps replaces that dimension. A dimension over a config group
(`model=a,b`) composes the config once per choice; a dimension over a value is checked against
the typed schema once per distinct value and then applied to plain dicts, so planning stays fast
for large grids.

Planning runs nothing on a device and changes nothing there. What it reads: this machine's model
files (GGUF headers, through the model-facts cache) and its /proc/meminfo, for context and memory
fit; with `@device.power_modes` in the grid, the device's own nvpmodel.conf (one read-only command
over a connection to it); with `device=@CLASS` and a farm coordinator, the coordinator's list of
places (nothing is reserved).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import re
from functools import cached_property, lru_cache
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Protocol, runtime_checkable

from jbench.config import ConfigError, compose, explain_compose_error, load_profile
from jbench.core.schema import (DeviceConfig, FarmConfig, ProfileConfig, SweepConfig, TrackingConfig, bounds_problems,
                                typed)
from jbench.core.trial import ChoosesKVTypes, FixedLengths, SwitchesFlashAttention, Trial, TrialConfig, context_tokens, trial_config
from jbench.runner.session import PowerModesError, device_power_modes
from jbench.runner.units import POOL_PREFIX, Pool
from jbench.core.identity import config_hash
from jbench.models.gguf import GGUFMetaError
from jbench.models import memory_facts
from jbench.models.memory_facts import MeasuredBuffers, MemoryKey
from jbench.core import registry

GROUP_DIMS = ("device", "backend", "model", "tracking")  # tracking: one value only (one sweep, one store)


@dataclass
class Plan:
    trials: list[Trial]
    problems: list[str] = field(default_factory=list)
    dims: dict[str, Any] = field(default_factory=dict)
    experiment: str = "adhoc"
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    overrides: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # cells dropped by the experiment's declared rules
    rounds: int = 1
    sweep: SweepConfig = field(default_factory=SweepConfig)
    pool: Optional[Pool] = None  # device=@CLASS: trials are spread over the pool's units


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
        values = list(ov.sweep_string_iterator()) if key in GROUP_DIMS else [_unquoted(v) for v in ov.sweep_iterator()]
        dims[key] = values
    return plain, dims, pinned


def _unquoted(value: Any) -> Any:
    """A swept value as plain data: Hydra's parser leaves a quoted string inside a list or mapping as a QuotedString
    (`backend.env={},{A: '1'}`), which the typed schema refuses."""
    from hydra.core.override_parser.types import QuotedString

    if isinstance(value, QuotedString):
        return value.text
    if isinstance(value, dict):
        return {_unquoted(k): _unquoted(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unquoted(v) for v in value]
    return value


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
    """Set a dotted key, copying the dicts along its path first (copy on write): trials share the
    sections they do not change, which keeps planning linear with a small constant."""
    parts = key.split(".")
    for part in parts[:-1]:
        d[part] = dict(d[part])
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


def _resolve_special(values: Any, key: str, profile: Optional[ProfileConfig], device: Optional[dict] = None) -> list:
    """A grid value "@device.power_modes" takes the device's own mode names (its nvpmodel.conf); "@profile.<field>"
    takes a list from the device's module profile. device: the plain section (what device_power_modes takes)."""
    if values == "@device.power_modes":
        if not (device and typed(DeviceConfig, device, where="device").profile):
            raise ConfigError(f"sweep.grid.{key}: @device.power_modes needs a Jetson device (device=NAME with "
                              "device.profile set); this device has none")
        try:
            return device_power_modes(device)
        except PowerModesError as exc:
            raise ConfigError(str(exc)) from None
    if isinstance(values, str) and values.startswith("@profile."):
        field_name = values[len("@profile."):]
        if profile is None:
            raise ConfigError(f"sweep.grid.{key}: {values} needs a Jetson device with a profile "
                              "(device=NAME with device.profile set); this device has none")
        found = getattr(profile, field_name, None)  # the field the user named
        if not found:
            raise ConfigError(f"sweep.grid.{key}: profile '{profile.name}' has no {field_name}")
        return list(found)
    return values


def _units(value_dims: dict[str, list], links: list[list[str]]) -> list[list[str]]:
    """Dimensions grouped into units that vary together (linked) or alone."""
    units: list[list[str]] = []
    linked: set[str] = set()
    for group in links:
        group = [k for k in group if k in value_dims]
        if len(group) < 2:
            continue
        lengths = {len(value_dims[k]) for k in group}
        if len(lengths) != 1:
            raise ConfigError(f"sweep.link {group}: linked dimensions need the same number of values "
                              f"({', '.join(f'{k}: {len(value_dims[k])}' for k in group)})")
        units.append(group)
        linked.update(group)
    units += [[key] for key in value_dims if key not in linked]
    # Keep the dimensions' own order: a unit's position is that of its first key.
    order = {k: i for i, k in enumerate(value_dims)}
    return sorted(units, key=lambda u: min(order[k] for k in u))


def _points(converted: dict[str, list], units: list[list[str]]):
    for combo in itertools.product(*[range(len(converted[u[0]])) for u in units]):
        point = {}
        for unit, i in zip(units, combo):
            for key in unit:
                point[key] = converted[key][i]
        yield point


def _excluded(config: dict, rules: list[dict]) -> Optional[str]:
    for rule in rules:
        hit = True
        for key, want in rule.items():
            node: Any = config
            for part in key.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            if not (node in want if isinstance(want, list) else node == want):
                hit = False
                break
        if hit:
            return "sweep.exclude " + ", ".join(f"{k}={v}" for k, v in rule.items())
    return None


def _model_facts(path: str):
    """The model file's facts (jbench.models.facts, cached across processes), or None when the file is
    not on this machine or not a readable GGUF file."""
    from jbench.models.facts import model_facts

    try:
        return model_facts(path)
    except (GGUFMetaError, OSError):
        return None


def _kv_bytes_per_token(facts, type_k: str, type_v: str) -> Optional[float]:
    """KV-cache bytes per token of context, by the roofline's one formula; None when it cannot tell."""
    from jbench.analysis.roofline import RooflineError, kv_bytes_per_token

    try:
        arch, _ = facts.model_arch()
        return kv_bytes_per_token(arch, type_k.upper(), type_v.upper())
    except (RooflineError, GGUFMetaError, KeyError, ValueError):  # an unknown KV type: the backend says so
        return None


@lru_cache(maxsize=1)
def _local_ram_bytes() -> Optional[int]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _measured_buffers(cfg: TrialConfig) -> tuple[Optional[MeasuredBuffers], str]:
    """The compute and output buffers measured before for this trial's configuration (same backend, build, device,
    buffer settings and model file: jbench.models.memory_facts), and what the check then says about them."""
    from jbench.backends.base import backend_class
    from jbench.models.digest import model_digest

    not_counted = "compute and output buffers not counted (never measured for this configuration: the reserve stands for them)"
    try:
        cls = backend_class(cfg.backend.name)
    except KeyError:
        return None, not_counted
    settings, build = cls.buffer_settings(cfg.backend), cls.planned_build(cfg.backend)
    if settings is None:
        return None, f"compute and output buffers not counted (backend {cfg.backend.name} keeps no buffer account)"
    if not build:
        return None, "compute and output buffers not counted (the build is only known on the device)"
    key = MemoryKey.of(cfg.backend.name, build, cfg.device.name, settings)
    if not memory_facts.known(key):  # before the digest: a user's file is read whole once for it
        return None, not_counted
    model = model_digest(cfg.model)
    measured = memory_facts.lookup(key, model) if model else None
    if measured is None:
        return None, not_counted
    return measured, (f"compute {measured.compute_mib:.2f} MiB and output {measured.output_mib:.2f} MiB measured "
                      f"{measured.describe()}")


def memory_check(cfg: TrialConfig, reserve_bytes: float) -> Optional[str]:
    """Model file + KV cache at the trial's context + the compute and output buffers measured for this configuration
    before (when they were) + reserve vs the device's RAM (None: fits or unknown). The message says which parts are
    measured and which estimated."""
    from jbench.models.store import ModelError, resolve_model_file

    try:
        path, _ = resolve_model_file(cfg.model)
    except ModelError:
        return None
    facts = _model_facts(path)
    if facts is None:
        return None
    backend = cfg.backend
    context = context_tokens(backend)
    types = (backend.cache_type_k, backend.cache_type_v) if isinstance(backend, ChoosesKVTypes) else ("f16", "f16")
    kv = _kv_bytes_per_token(facts, *types)
    if kv is None:
        return None
    profile = cfg.profile
    if profile is not None:
        ram, where = profile.ram_gb * 1e9, f"{profile.module} ({profile.ram_gb:g} GB)"
    elif cfg.device.kind == "local":
        ram, where = _local_ram_bytes(), "this machine"
    else:
        return None
    if not ram:
        return None
    from jbench.analysis.roofline import memory_fit

    measured, buffers = _measured_buffers(cfg)
    extra = (measured.compute_mib + measured.output_mib) * 2**20 if measured else 0.0
    fit = memory_fit(facts.size + extra, kv, context, ram, reserve_bytes)
    if fit.fits:
        return None
    what = " + measured compute and output buffers" if measured else ""
    counted = ", counted with the model below" if measured else ""
    return (f"model + KV cache at context {context}{what} need {fit.needed_bytes / 1e9:.2f} GB, more than {where} "
            f"allows with a {reserve_bytes / 1e9:g} GB reserve (model: the file's size; KV: estimated from the GGUF "
            f"header; {buffers}{counted}): {fit.message}")


def order(trials: list[Trial]) -> list[Trial]:
    """Fewest power-state switches, then fewest model loads: group by device and power state
    (in order of first appearance), then by model file; grid order inside a group."""
    first_seen: dict[tuple, int] = {}

    def power_key(t: Trial) -> tuple:
        return (t.cfg.device.name, t.cfg.power.mode, t.cfg.power.jetson_clocks)

    def model_key(t: Trial) -> tuple:
        return (t.cfg.model.name, t.cfg.model.quant)

    for t in trials:
        first_seen.setdefault(power_key(t), len(first_seen))
        first_seen.setdefault(power_key(t) + model_key(t), len(first_seen))
    return sorted(trials, key=lambda t: (first_seen[power_key(t)], first_seen[power_key(t) + model_key(t)]))


@dataclass
class Cell:
    """One point of the grid before validation: its resolved config, group choices and swept values."""

    config: dict
    choices: dict
    point: dict

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.point.items()) or "(single trial)"

    @cached_property
    def cfg(self) -> TrialConfig:
        """The typed view the planner decides on, built once, when first read (after plan() set a pool's device),
        and handed to the cell's Trial. A backend that is not registered gives its BackendKeys: validate reports it."""
        return trial_config(self.config, unknown_backend_ok=True)


@dataclass
class Expansion:
    cells: list[Cell]
    dims: dict[str, Any]
    sweep: SweepConfig
    experiment: str
    tracking: TrackingConfig


def expand(overrides: list[str], config_dirs: Optional[list[Path]] = None, *, use_grid: bool = True) -> Expansion:
    """Compose the config and expand the grid (experiment grid + command-line comma lists) into cells."""
    from omegaconf import OmegaConf

    plain, cli_dims, pinned = _parse_overrides(overrides)
    first_cfg, first_choices = compose(plain, config_dirs)
    sweep = typed(SweepConfig, OmegaConf.to_container(first_cfg.sweep, resolve=True), where="sweep")
    grid = sweep.grid if use_grid else {}
    if not use_grid and cli_dims:
        raise ConfigError(
            f"`jbench run` runs one trial; comma lists ({', '.join(cli_dims)}) belong to `jbench sweep`"
        )
    dims: dict[str, Any] = {}
    for key, values in grid.items():
        if key in pinned:
            continue  # `model.quant=Q8_0` on the command line pins the grid's model.quant dimension
        if not (isinstance(values, list) and values) and not (isinstance(values, str) and values.startswith(("@profile.", "@device."))):
            raise ConfigError(f"sweep.grid.{key} must be a non-empty list of values")
        dims[key] = values
    dims.update(cli_dims)
    # One sweep, one store: its parent run holds every trial, and resume looks in one place.
    stores = [k for k, vs in dims.items() if (k == "tracking" or k.startswith("tracking.")) and len(vs) > 1]
    if stores:
        raise ConfigError(f"'{stores[0]}' has several values, but tracking says where a sweep's results go and is not "
                          f"a sweep dimension: run one sweep per store (e.g. `jbench sweep ... {stores[0]}=VALUE` "
                          "once for each)")
    group_dims = {k: [str(v) for v in vs] for k, vs in dims.items() if k in GROUP_DIMS}
    links = sweep.link if use_grid else []

    cells: list[Cell] = []
    tracking = None  # the first group's (one store per sweep); the loop runs at least once
    experiment = "adhoc"
    group_keys = list(group_dims)
    for group_values in itertools.product(*group_dims.values()):
        group_point = dict(zip(group_keys, group_values))
        if group_point:
            cfg, choices = compose(plain + [f"{k}={v}" for k, v in group_point.items()], config_dirs)
        else:
            cfg, choices = first_cfg, first_choices
        device_cfg = OmegaConf.to_container(cfg.device, resolve=True) if OmegaConf.select(cfg, "device") else None
        profile_name = typed(DeviceConfig, device_cfg, where="device").profile
        profile = load_profile(profile_name, config_dirs) if profile_name else None
        profile_view = typed(ProfileConfig, profile, where="profile") if profile else None
        value_dims = {k: _resolve_special(vs, k, profile_view, device_cfg) for k, vs in dims.items()
                      if k not in GROUP_DIMS}
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
        if profile:
            # The module profile travels with the trial (roofline, telemetry rails, findings).
            base["profile"] = profile
        if tracking is None:
            tracking = typed(TrackingConfig, OmegaConf.to_container(cfg.tracking, resolve=True), where="tracking")
        experiment = cfg.experiment.name
        for point in _points(converted, _units(converted, links)):
            if slow:
                trial_cfg = copy.deepcopy(cfg)
                for k, v in point.items():
                    OmegaConf.update(trial_cfg, k, v, merge=False)
                config = OmegaConf.to_container(trial_cfg, resolve=True)
                config.pop("sweep", None)
                if profile:
                    config["profile"] = copy.deepcopy(profile)
            else:
                config = dict(base)
                for k, v in point.items():
                    _set_dotted(config, k, v)
            cells.append(Cell(config, dict(choices), {**group_point, **point}))
    return Expansion(cells, dims, sweep, experiment, tracking)


def name_models(cells: list[Cell]) -> list[str]:
    """Cells that benchmark the user's own file under a bundled model's name (model.source=files on the bundled
    entry, model.name left as it was) are named from the file they measure: its GGUF general.name, else its
    architecture and size. The bundled entry's package, source hash and ladder describe another file and are
    dropped. Only a file this machine reads (a local device); validate refuses the rest, naming the fix."""
    import os

    from jbench.models.store import (ModelError, borrows_bundled_name, name_from_file, resolve_model_file,
                                     same_model_name)

    notes: dict[str, None] = {}
    for cell in cells:
        model = cell.cfg.model
        if cell.cfg.device.kind != "local" or not borrows_bundled_name(model, cell.choices.get("model")):
            continue
        try:
            path, _ = resolve_model_file(model)
        except ModelError:
            continue
        named = name_from_file(os.path.expanduser(path))
        if named is None:
            continue
        name, display = named
        if same_model_name(model.name, name):
            name, display = model.name, model.display_name or display
        else:
            notes[f"model.name={name} (was {model.name}): {path} is '{display}' by its GGUF header, not the "
                  f"bundled {model.name}; set model.name to name it yourself"] = None
        own = dataclasses.replace(model, name=name, display_name=display, package=None, package_version=None,
                                  source_sha256=None, source_quant=None, ladder=[])
        _set_dotted(cell.config, "model", dataclasses.asdict(own))
        cell.__dict__.pop("cfg", None)  # the typed view read above is of the old section
    return list(notes)


def drop(cells: list[Cell], *, exclude: list[dict], drop_beyond_context: bool) -> tuple[list[Cell], list[str]]:
    """Cells the experiment declares meaningless are dropped, each with a note naming the rule."""
    kept, notes = [], []
    for cell in cells:
        reason = _excluded(cell.config, exclude)
        if reason is None and drop_beyond_context:
            limit = cell.cfg.model.context_length
            if limit is None:
                from jbench.models.store import ModelError, resolve_model_file

                try:
                    facts = _model_facts(resolve_model_file(cell.cfg.model)[0])
                except ModelError:
                    facts = None
                limit = facts.kv_arch().get("context_length") if facts else None
            need = context_tokens(cell.cfg.backend)
            if limit is not None and need > limit:
                reason = f"drop_beyond_context: {need} tokens > the model's context length {limit}"
        if reason:
            notes.append(f"dropped {cell.label}: {reason}")
        else:
            kept.append(cell)
    return kept, notes


def validate(cells: list[Cell], *, reserve_bytes: float) -> tuple[list[Trial], list[str]]:
    """Trials for the cells, and every problem found without touching a device (names, values, backend
    capabilities, model files, memory fit), each once with the trials it concerns."""
    from jbench.backends.base import backend_class

    problems: dict[str, list[str]] = {}
    trials: list[Trial] = []
    classes: dict[str, Any] = {}
    for cell in cells:
        cfg = cell.cfg
        trial = Trial(index=0, config=cell.config, choices=cell.choices, point=cell.point,
                      config_hash=config_hash(cell.config)).with_cfg(cfg)
        name = cfg.backend.name
        if name not in classes:
            try:
                classes[name] = backend_class(name)
            except KeyError as exc:
                classes[name] = str(exc.args[0])
        cls = classes[name]
        if isinstance(cls, str):
            msgs = [cls]
        else:
            backend = cls(cfg.backend)
            msgs = backend.validate(trial) + _capability_problems(cls, cfg)
            msgs += _model_file_problems(cfg, msgs, backend.reads_model_file(trial), cell.choices.get("model"),
                                         cls.CAPABILITIES.gguf_models)
        msgs += _registered_names_problems(cfg) + _bounds_problems(cfg)
        if not msgs:
            fit = memory_check(cfg, reserve_bytes)
            if fit:
                msgs.append(fit)
        for msg in msgs:
            problems.setdefault(msg, []).append(trial.label)
        trials.append(trial)
    formatted = []
    for msg, labels in problems.items():
        where = labels[0] if len(labels) == 1 else f"{len(labels)} trials, e.g. {labels[0]}"
        formatted.append(f"{msg}  [{where}]")
    return trials, formatted


def replicate(trials: list[Trial], rounds: int) -> list[Trial]:
    """Number the trials in run order; with rounds > 1 the whole ordered sweep runs `rounds` times, each
    pass with its share of the repetitions (the trial's identity is unchanged)."""
    final: list[Trial] = []
    for r in range(1, rounds + 1):
        for t in trials:
            config, cfg = t.config, t.cfg
            if rounds > 1:
                share = max(1, -(-cfg.backend.repetitions // rounds))
                config = dict(config)
                _set_dotted(config, "backend.repetitions", share)
                cfg = dataclasses.replace(cfg, backend=dataclasses.replace(cfg.backend, repetitions=share))
            final.append(Trial(index=len(final) + 1, config=config, choices=t.choices, point=t.point,
                               config_hash=t.config_hash, round=r, rounds=rounds).with_cfg(cfg))
    return final


def plan(overrides: list[str], config_dirs: Optional[list[Path]] = None, *, use_grid: bool = True) -> Plan:
    """expand -> name_models -> drop -> validate -> order -> replicate. Raises ConfigError for problems of the
    config as a whole; problems of single trials are collected in Plan.problems."""
    pool, composed = class_pool(overrides, config_dirs)
    ex = expand(composed, config_dirs, use_grid=use_grid)
    if pool is not None:
        for cell in ex.cells:
            # The trial's device is the class, not a unit: its identity (resume, compare) is the same
            # whichever unit runs it; the unit is recorded in tags.
            _set_dotted(cell.config, "device.name", pool.name)
            _set_dotted(cell.config, "device.device_class", pool.device_class)
            cell.choices["device"] = pool.name
    sweep, tracking = ex.sweep, ex.tracking
    if bad := bounds_problems(sweep, "sweep"):
        raise ConfigError("; ".join(bad))
    named = name_models(ex.cells)
    kept, notes = drop(ex.cells, exclude=sweep.exclude if use_grid else [],
                       drop_beyond_context=sweep.drop_beyond_context and use_grid)
    notes = named + notes
    trials, problems = validate(kept, reserve_bytes=sweep.memory_reserve_gb * 1e9)
    if not problems:
        from jbench.sweeps.quality import plan_quality

        trials, quality_problems, quality_notes = plan_quality(trials)
        problems, notes = problems + quality_problems, notes + quality_notes
    rounds = max(1, sweep.rounds)
    final = replicate(order(trials), rounds)
    if not final and notes:
        problems.append("the grid is empty after dropping: " + "; ".join(notes))
    return Plan(trials=final, problems=problems, dims=ex.dims, experiment=ex.experiment, tracking=tracking,
                overrides=list(overrides), notes=notes, rounds=rounds, sweep=sweep, pool=pool)


def class_pool(overrides: list[str], config_dirs: Optional[list[Path]]) -> tuple[Optional[Pool], list[str]]:
    """(the pool of a `device=@CLASS` override or None, the overrides to compose with). Hydra parses `@CLASS`
    but has no such device entry: the override is replaced by the class's first unit (its profile and
    paths plan the trials) or, with a coordinator and no entry of the class here, by the default device."""
    from omegaconf import OmegaConf

    from jbench.config import available_choices

    plain, dims, _ = _parse_overrides(overrides)
    if any(str(v).startswith(POOL_PREFIX) for v in dims.get("device", [])):
        raise ConfigError("one device class per sweep: `device=@CLASS` cannot be a comma list")
    given = [o for o in plain if o.split("=", 1)[0] == "device" and o.split("=", 1)[1].strip("'\"").startswith(POOL_PREFIX)]
    if not given:
        return None, list(overrides)
    cls = given[-1].split("=", 1)[1].strip("'\"")[len(POOL_PREFIX):]
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", cls):
        raise ConfigError(f"device=@{cls}: a device class is a name of letters, digits, '_', '-' or '.' "
                          "(the device_class of device entries, or a farm place's class tag)")
    rest = [o for o in overrides if o.split("=", 1)[0] != "device"]
    rest_plain = [o for o in plain if o.split("=", 1)[0] != "device"]
    base, _ = compose(rest_plain, config_dirs)
    farm_section = OmegaConf.to_container(base.farm, resolve=True)  # plain, as Pool takes it
    farm = typed(FarmConfig, farm_section, where="farm")
    members, entries, classes = [], [], {}
    for choice in available_choices("device", config_dirs):
        try:
            cfg, _ = compose(rest_plain + [f"device={choice}"], config_dirs)
        except ConfigError:
            continue  # a broken entry of another class must not stop this sweep
        entry = OmegaConf.to_container(cfg.device, resolve=True)
        device_class = typed(DeviceConfig, entry, where="device").device_class
        if device_class:
            classes.setdefault(device_class, []).append(choice)
        if device_class == cls:
            members.append(entry)
            entries.append(choice)
    coordinator = farm.coordinator
    selector = {"class": cls, **farm.select}
    if coordinator and not members:  # the class's places name their device entries: plan with theirs
        members, entries = _farm_members(coordinator, selector, rest_plain, config_dirs)
    if not members and not coordinator:
        known = "; ".join(f"{c}: {', '.join(n)}" for c, n in sorted(classes.items())) or "none has a device_class"
        raise ConfigError(f"device=@{cls}: no device entry has device_class '{cls}' (device entries by class: {known}). "
                          f"Add `device_class: {cls}` to device/NAME.yaml in your config dir, or set farm.coordinator "
                          "to lease the class's places")
    profiles = {typed(DeviceConfig, m, where="device").profile for m in members}
    if len(profiles) > 1:
        raise ConfigError(f"device=@{cls}: its units have different profiles ({', '.join(sorted(map(str, profiles)))}); "
                          "a class is one kind of module: give each kind its own device_class")
    count_text = str(farm.devices)
    if count_text != "all" and not (count_text.isdigit() and int(count_text) > 0):
        raise ConfigError(f"farm.devices={count_text}: give a number of places (1, 2, ...) or all")
    pool = Pool(cls, members, coordinator, selector,
                None if count_text == "all" else int(count_text), farm_section, [str(d) for d in config_dirs or []])
    return pool, rest + ([f"device={entries[0]}"] if entries else [])


def _farm_members(coordinator: str, selector: dict, overrides: list[str],
                  config_dirs: Optional[list[Path]]) -> tuple[list[dict], list[str]]:
    """(device configs, entry names) of the healthy places matching selector: the trials' device template."""
    from omegaconf import OmegaConf

    from jbench.farm import places as P
    from jbench.farm.coordinator import Coordinator, CoordinatorError, iter_places

    try:
        with Coordinator(coordinator) as coord:
            names = [P.device_entry(p) for p in iter_places(coord, {**selector, P.HEALTH: P.HEALTHY})]
    except CoordinatorError as exc:
        raise ConfigError(f"farm.coordinator {coordinator}: {exc}") from None
    members, entries = [], []
    for name in dict.fromkeys(names):
        try:
            cfg, _ = compose(overrides + [f"device={name}"], config_dirs)
        except ConfigError:
            continue  # the lease reports a place whose entry is missing
        members.append(OmegaConf.to_container(cfg.device, resolve=True))
        entries.append(name)
    return members, entries


def _model_file_problems(cfg: TrialConfig, found: list[str], reads_file: bool, entry: Optional[str],
                         gguf: bool) -> list[str]:
    """A file override that would be ignored, a model file missing or broken on this machine (a local device) for
    a backend that reads it, or a file recorded under a bundled model's name that name_models could not replace:
    caught here, so nothing runs, rather than as FAILED or misnamed runs (a remote device's file: at preflight)."""
    from jbench.models.store import borrows_bundled_name, local_file_problem, override_problem

    if (msg := override_problem(cfg.model)) is not None:
        return [msg]
    if found:
        return []
    if reads_file and cfg.device.kind == "local" and (msg := local_file_problem(cfg.model, gguf=gguf)):
        return [msg]
    if borrows_bundled_name(cfg.model, entry):
        return [f"model.source=files replaces the bundled model's file but keeps its name '{cfg.model.name}', so "
                f"another model's figures would be recorded as {cfg.model.name}: set model.name=NAME (your model's "
                "name), or use a model entry of your own (model=NAME, docs: README \"Your own configs\")"]
    return []


def _bounds_problems(cfg: TrialConfig) -> list[str]:
    """Values outside their schema's declared bounds (core/schema.py `bounded`), in every section a trial runs with
    (sweep: the plan's, checked once in plan())."""
    problems = []
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if f.name != "sweep" and dataclasses.is_dataclass(section) and not isinstance(section, type):
            problems += bounds_problems(section, f.name)
    return problems


def _registered_names_problems(cfg: TrialConfig) -> list[str]:
    """Names that select a plug-in (telemetry.source) must name a registered one; a wall meter section must be usable."""

    source = cfg.telemetry.source
    sources = registry.targets(registry.SAMPLERS)
    if source not in sources:
        return [f"unknown telemetry.source '{source}'. Valid sources: {', '.join(sorted(sources))}"]
    from jbench.device.telemetry.wall import wall_power_problem

    wall = wall_power_problem(cfg.wall_power)
    return [wall] if wall else []


def _capability_problems(cls, cfg: TrialConfig) -> list[str]:
    """What the backend declares it cannot do, checked before any device is touched."""
    caps = cls.CAPABILITIES
    backend, quant = cfg.backend, cfg.model.quant
    out = []
    if caps.quants and quant not in caps.quants:
        out.append(f"backend {cls.NAME} does not support quant {quant}. Supported: {', '.join(sorted(caps.quants))}")
    if isinstance(backend, ChoosesKVTypes) and caps.kv_types:
        for key, value in (("cache_type_k", backend.cache_type_k), ("cache_type_v", backend.cache_type_v)):
            if value not in caps.kv_types:
                out.append(f"backend {cls.NAME} does not support KV type {value} ({key}). "
                           f"Supported: {', '.join(sorted(caps.kv_types))}")
    if isinstance(backend, FixedLengths) and backend.depth and not caps.context_depth:
        out.append(f"backend {cls.NAME} cannot pre-fill a context depth (backend.depth={backend.depth})")
    if isinstance(backend, SwitchesFlashAttention) and backend.flash_attn == "on" and not caps.flash_attention:
        out.append(f"backend {cls.NAME} has no flash attention switch")
    return out
