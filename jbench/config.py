"""Typed configuration: the schemas behind conf/, and composing them with Hydra.

Every config group has a dataclass schema registered in Hydra's ConfigStore; the YAML files in
conf/ extend those schemas, so composition rejects unknown keys and wrong types. Composition
errors are turned into one message that names the key and the valid choices (ConfigError).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Dict, List, Optional

from hydra.core.config_store import ConfigStore

from jbench.core.identity import section_schemas as group_schemas
from jbench.core.schema import DeviceConfig, JBenchConfig, ModelConfig, ProfileConfig, TrackingConfig
from jbench.core.registry import backend_schemas

# The schema of each config group whose files extend it (`defaults: [<group>_schema, _self_]`); JBenchConfig types
# these sections `Any`, as each option is a file. `backend` has one schema per backend (registry.backend_schemas).
GROUP_SCHEMAS: Dict[str, type] = {
    "device": DeviceConfig,
    "model": ModelConfig,
    "tracking": TrackingConfig,
    "profile": ProfileConfig,
}


def register_schemas() -> None:
    """Register every schema in Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="jbench_schema", node=JBenchConfig)
    for group, schema in GROUP_SCHEMAS.items():
        cs.store(group=group, name=f"{group}_schema", node=schema)

    for name, schema in backend_schemas().items():
        cs.store(group="backend", name=f"{name}_schema", node=schema)


# ---------------------------------------------------------------------------------------------
# Composition


class ConfigError(Exception):
    """A user-caused configuration problem; the message names the fix."""


CONFIG_MODULE = "jbench.conf"
USER_CONFIG_ENV = "JBENCH_CONFIG_PATH"


def user_config_dirs(extra: Optional[List[str]] = None) -> list[Path]:
    """User config directories: --config-dir options, then $JBENCH_CONFIG_PATH (os.pathsep list).

    They are searched before the packaged conf/, so a user's device, model or experiment file
    with a new name adds a choice, and one with a packaged name replaces it.
    """
    dirs = [Path(d) for d in (extra or [])]
    env = os.environ.get(USER_CONFIG_ENV, "")
    dirs += [Path(d) for d in env.split(os.pathsep) if d]
    out = []
    for d in dirs:
        d = d.expanduser().resolve()
        if not d.is_dir():
            raise ConfigError(f"config directory {d} does not exist (from --config-dir or ${USER_CONFIG_ENV})")
        out.append(d)
    return out


def searchpath_override(dirs: list[Path]) -> list[str]:
    """The hydra.searchpath override for dirs. Each path is a quoted string: unquoted, Hydra's override grammar
    refuses a non-ASCII character (a home like /home/jürgen) and reads ',' or ']' as syntax."""
    if not dirs:
        return []
    return ["hydra.searchpath=[" + ",".join(_quoted(f"file://{d}") for d in dirs) + "]"]


def _quoted(text: str) -> str:
    """text as a single-quoted Hydra override string. Backslashes are escapes only before a quote (Hydra's rule):
    those before an inner quote or the closing one are doubled, the quote itself escaped."""
    inner = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", text)
    trailing = len(inner) - len(inner.rstrip("\\"))
    return "'" + inner + "\\" * trailing + "'"


def available_choices(group: str, config_dirs: Optional[List[Path]] = None) -> list[str]:
    """Names a user may pick for a config group: packaged files plus the user's config dirs."""
    from importlib.resources import files

    names = set()
    packaged = files(CONFIG_MODULE).joinpath(group)
    if packaged.is_dir():
        names |= {p.name[:-5] for p in packaged.iterdir() if p.name.endswith(".yaml")}
    for d in config_dirs or []:
        names |= {p.stem for p in (d / group).glob("*.yaml")}
    return sorted(names)


class _initialized:
    """Context manager: Hydra initialized on the packaged config module, the user's config dirs in front of it.

    Hydra puts `hydra.searchpath` entries *after* the primary config, so a user's `experiment/nightly.yaml` would
    lose to the packaged one of the same name. The dirs are therefore also prepended to the loader's search path
    (ConfigLoader.get_search_path(), public API); the hydra.searchpath override is still needed: it is what makes
    Hydra rebuild its config sources from that search path at compose time. First match wins."""

    def __init__(self, dirs: Optional[List[Path]] = None):
        self.dirs = list(dirs or [])

    def __enter__(self):
        from hydra import initialize_config_module
        from hydra.core.global_hydra import GlobalHydra

        register_schemas()
        GlobalHydra.instance().clear()
        self._ctx = initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3")
        self._ctx.__enter__()
        search_path = GlobalHydra.instance().config_loader().get_search_path()
        for d in reversed(self.dirs):
            search_path.prepend(provider="jbench --config-dir", path=f"file://{d}")
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        return False


def compose(overrides: List[str], config_dirs: Optional[List[Path]] = None):
    """Compose the config for plain (non-sweep) overrides. Returns (DictConfig, group choices)."""
    from hydra import compose as hydra_compose
    from omegaconf import OmegaConf, open_dict

    dirs = config_dirs or []
    _check_deletions(overrides, dirs)
    overrides = [_as_mapping_assignment(o) for o in overrides]
    with _initialized(dirs):
        try:
            cfg = hydra_compose(
                config_name="config",
                overrides=list(overrides) + searchpath_override(dirs),
                return_hydra_config=True,
            )
        except Exception as exc:  # Hydra raises several types; all are user input problems here
            raise ConfigError(explain_compose_error(exc, dirs, overrides)) from None
    choices = {k: v for k, v in OmegaConf.to_container(cfg.hydra.runtime.choices).items()
               if not k.startswith("hydra/") and v is not None}
    with open_dict(cfg):
        del cfg["hydra"]
    _check_interpolations(cfg)
    return cfg, choices


def mapping_keys() -> frozenset[str]:
    """Dotted keys of the free-form mappings of every schema (a Dict field: backend.env, backend.vars, model.files,
    ...), whose keys are the user's. Hydra composes in struct mode, where `backend.env={A: "1"}` is refused as an
    unknown key backend.env.A; such an assignment is composed as `++backend.env={...}` (set, whatever its keys)."""
    global _MAPPING_KEYS
    if _MAPPING_KEYS is None:
        import dataclasses
        import typing

        found: set[str] = set()

        def walk(schema: type, prefix: str) -> None:
            hints = typing.get_type_hints(schema)
            for f in dataclasses.fields(schema):
                hint = hints.get(f.name)
                if typing.get_origin(hint) in (dict, Dict):
                    found.add(prefix + f.name)
                elif isinstance(hint, type) and dataclasses.is_dataclass(hint):
                    walk(hint, f"{prefix}{f.name}.")

        walk(JBenchConfig, "")
        for section, schema in group_schemas().items():
            walk(schema, f"{section}.")
        for schema in backend_schemas().values():
            walk(schema, "backend.")
        _MAPPING_KEYS = frozenset(found)
    return _MAPPING_KEYS


_MAPPING_KEYS: Optional[frozenset[str]] = None


def _as_mapping_assignment(override: str) -> str:
    key, eq, value = override.partition("=")
    if eq and not key.startswith(("+", "~")) and value.lstrip().startswith("{") and key in mapping_keys():
        return "++" + override
    return override


def _check_deletions(overrides: List[str], config_dirs: list[Path]) -> None:
    """Hydra's `~key` deletes a key; jbench's keys are typed with defaults and every trial needs its groups, so a
    deletion is refused here with what to write instead (Hydra's own errors do not say, and a deleted group ends
    in a traceback while planning)."""
    for o in overrides:
        if not o.startswith("~"):
            continue
        key = o[1:].partition("=")[0]
        if key == "experiment":
            fix = "leave out +experiment to run without one"
        elif key in _GROUPS:
            fix = f"every trial needs one: pick another with {key}=NAME (one of: {', '.join(available_choices(key, config_dirs))})"
        else:
            fix = f"set the value you want instead ({key}=VALUE; null where the key allows none)"
        raise ConfigError(f"'{o}': jbench's config keys are typed and cannot be deleted; {fix}")


def _check_interpolations(cfg) -> None:
    """Resolve every ${...} once now, so a bad one is one message here, not a traceback while planning."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        node = OmegaConf.select(cfg, key, throw_on_resolution_failure=False) if key != "?" else None
        raw = OmegaConf.to_container(cfg, resolve=False)
        for part in key.split("."):
            raw = raw.get(part) if isinstance(raw, dict) else None
        reason = str(exc).splitlines()[0]
        raise ConfigError(
            f"{key}: cannot resolve {raw if isinstance(raw, str) else node!r} ({reason}). ${{...}} in a value is an "
            "interpolation; for a literal '$' write '\\${...}' inside quotes, e.g. 'key=\"\\${x}\"'") from None


_GROUPS = ("device", "backend", "model", "experiment", "tracking", "profile")


def explain_compose_error(exc: Exception, config_dirs: list[Path], overrides: Optional[List[str]] = None) -> str:
    """Turn a Hydra/OmegaConf/YAML error into one message that names the key (or file) and the fix."""
    import yaml

    overrides = list(overrides or [])
    if isinstance(exc, yaml.YAMLError):
        return _yaml_error(exc, config_dirs)
    msg = str(exc).strip()
    cause = exc.__cause__
    while cause is not None:  # Hydra wraps the OmegaConf error that names the key
        msg += "\n" + str(cause)
        cause = cause.__cause__
    where = _user_file(msg, config_dirs)  # "In 'device/mine': ..." of a file in the user's config dirs
    if (fix := _experiment_package_problem(msg, config_dirs)) is not None:
        return fix
    m = re.search(r"Multiple values for (\w+)|(\w+) appears more than once in the final defaults list", msg)
    if m:
        key = m.group(1) or m.group(2)
        given = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+") == key and "=" in o]
        listed = f" ({', '.join(given)})" if given else ""
        if key == "experiment":
            return (f"+experiment is given more than once{listed}: one experiment per sweep; run `jbench sweep "
                    "+experiment=NAME` once per experiment")
        return f"{key} is given more than once{listed}: give it once (a comma list, {key}=a,b, sweeps several)"
    # Unknown group option: "Could not find 'model/foo'" / "In 'config': Could not find 'experiment/x'"
    m = re.search(r"Could not (?:find|load) '([\w/]+)/([^']+)'", msg)
    if m and m.group(1) in _GROUPS:
        group, name = m.group(1), m.group(2)
        valid = available_choices(group, config_dirs)
        return f"unknown {group} '{name}'. Valid {group} names: {', '.join(valid)}"
    m = re.search(r"Key '([^']+)' not in '(\w+)'", msg) or re.search(r"Key '([^']+)' is not in struct", msg)
    if m:
        key = m.group(1)
        full = re.search(r"full_key: (\S+)", msg)
        dotted = full.group(1) if full else key
        return f"{where}unknown config key '{dotted}'. {_valid_keys_hint(dotted, _backend_choice(overrides))}"
    m = re.search(r"Could not override '([^']+)'", msg)
    if m:
        key = m.group(1)
        value = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == key), None)
        if key in _GROUPS and key not in ("device", "backend", "model", "tracking"):
            # `experiment` is not in the defaults list: it is added, with `+`.
            valid = available_choices(key, config_dirs)
            fix = f"+{key}={value}" if value in valid else f"+{key}=NAME (one of: {', '.join(valid)})"
            return f"'{key}={value}': {key} is added to the config, not overridden: write {fix}"
        return (f"unknown config key '{key}'. {_valid_keys_hint(key, _backend_choice(overrides))} "
                f"(use +{key}=... only to add new keys to free-form maps)")
    m = re.search(r"Value '([^']*)' (?:of type '\w+' )?could not be converted to (\w+)", msg)
    if m:
        full = re.search(r"full_key: (\S+)", msg)
        key = full.group(1) if full else "?"
        return f"bad value '{m.group(1)}' for {key}: expected {m.group(2)}"
    m = re.search(r"Invalid value assigned: (\w+) is not a (\w+)", msg)
    if m:
        full = re.search(r"full_key: (\S+)", msg)
        key = full.group(1) if full else "?"
        want = "a list, e.g. [a,b]" if "List" in m.group(2) else m.group(2)
        return f"bad value for {key}: got {m.group(1)}, expected {want}"
    m = re.search(r"mismatched input|no viable alternative|extraneous input|token recognition error|"
                  r"Error parsing override", msg)
    if m:
        return _malformed(msg, overrides)
    return where + (msg.splitlines()[0] if msg else type(exc).__name__)


def _experiment_package_problem(msg: str, config_dirs: list[Path]) -> Optional[str]:
    """The fix for a user's experiment file without `# @package _global_`: Hydra then nests its keys under
    `experiment.` and reports an unknown key 'experiment.experiment' (or 'experiment.sweep'), which says nothing
    about the missing first line."""
    m = re.search(r"In 'experiment/([\w.-]+)'", msg)
    if not m or not re.search(r"experiment\.\w+", msg):
        return None
    for d in config_dirs:
        path = d / "experiment" / f"{m.group(1)}.yaml"
        if path.is_file():
            try:
                text = path.read_text(errors="replace")
            except OSError:
                return None
            if "@package _global_" in text:
                return None
            return (f"{path}: an experiment file must start with the line `# @package _global_` (its keys, "
                    "experiment.name, sweep.grid, backend.* ..., are the whole config's); add it as the first line")
    return None


def check_overrides(overrides: List[str]) -> None:
    """Raise ConfigError (naming the override and the fix) when a command-line override does not parse."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    try:
        OverridesParser.create().parse_overrides(list(overrides))
    except OverrideParseException as exc:
        raise ConfigError(_malformed(str(exc), list(overrides))) from None


def _malformed(msg: str, overrides: List[str]) -> str:
    """A Hydra override that does not parse: name it, and say when its value needs quotes."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    bad = None
    for i, o in enumerate(overrides):
        try:
            parser.parse_overrides([o])
        except Exception:
            bad = i
            break
    if bad is None:
        return f"malformed override: {msg.splitlines()[0]}. Overrides look like key=value, group=name or key=a,b,c"
    o = overrides[bad]
    key, eq, value = o.partition("=")
    if not eq:
        before = overrides[bad - 1] if bad else None
        if before is not None and "=" in before:
            return (f"'{o}' is not an override (key=value); if it belongs to the value before it, quote the whole "
                    f"value so the shell passes one word: '{before.split('=', 1)[0]}=\"{before.split('=', 1)[1]} {o}\"'")
        return f"'{o}' is not an override: overrides look like key=value, group=name, +experiment=NAME or key=a,b,c"
    if value.startswith("[") and not value.rstrip().endswith("]"):
        return f"the list given to {key} is not closed: write {key}=[a,b] (or key=a,b to sweep the values)"
    if re.search(r"[\s=:'\"\[\]{}(),\\]", value) or value == "":
        inner = value.replace("\\", "\\\\").replace("'", "\\'")
        return (f"the value of {key} needs quotes ({value!r} holds characters the override syntax reserves): "
                f"write {key}='{inner}' and quote that for your shell, e.g. \"{key}='{inner}'\"")
    return f"malformed override '{o}': {msg.splitlines()[0]}. Overrides look like key=value, group=name or key=a,b,c"


def _backend_choice(overrides: List[str]) -> Optional[str]:
    """The backend a command line selects (backend=NAME), else the packaged default."""
    for o in reversed(overrides):
        key, eq, value = o.partition("=")
        if eq and key.lstrip("+~") == "backend" and "," not in value:
            return value
    from importlib.resources import files

    import yaml

    defaults = yaml.safe_load(files(CONFIG_MODULE).joinpath("config.yaml").read_text()).get("defaults", [])
    return next((d["backend"] for d in defaults if isinstance(d, dict) and "backend" in d), None)


def _user_file(msg: str, config_dirs: list[Path]) -> str:
    """'<path>: ' for a config named in a Hydra message ("In 'device/mine'") that is one of the user's files."""
    m = re.search(r"In '([\w/.-]+)'", msg)
    if not m:
        return ""
    for d in config_dirs:
        path = d / f"{m.group(1)}.yaml"
        if path.is_file():
            return f"{path}: "
    return ""


def _yaml_error(exc: Exception, config_dirs: list[Path]) -> str:
    """A YAML syntax error: Hydra parses file contents without their names, so find the user's file that fails."""
    import yaml

    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    for d in config_dirs:
        for path in sorted(d.rglob("*.yaml")):
            try:
                yaml.safe_load(path.read_text())
            except yaml.YAMLError as e:
                mark = getattr(e, "problem_mark", None)
                line = f":{mark.line + 1}" if mark is not None else ""
                return f"{path}{line}: YAML syntax error: {getattr(e, 'problem', None) or e}"
            except OSError:
                continue
    mark = getattr(exc, "problem_mark", None)
    return f"YAML syntax error{f' at line {mark.line + 1}' if mark else ''}: {problem}"


def section_schemas() -> Dict[str, Optional[type]]:
    """Every top-level section of the config (the fields of JBenchConfig, so a new section is never missed) with its
    dataclass schema: the field's own type, or the group's schema (GROUP_SCHEMAS); None for `backend`, whose keys
    depend on the backend chosen."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(JBenchConfig)
    out: Dict[str, Optional[type]] = {}
    for f in dataclasses.fields(JBenchConfig):
        kind = hints.get(f.name)
        out[f.name] = kind if dataclasses.is_dataclass(kind) else GROUP_SCHEMAS.get(f.name)
    return out


def _nested_schema(schema: type, name: str) -> Optional[type]:
    """The dataclass type of schema's field `name` (Optional[...] unwrapped), or None when it is no dataclass."""
    import dataclasses
    import typing

    kind = typing.get_type_hints(schema).get(name)
    for arg in (kind, *typing.get_args(kind)):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def _valid_keys_hint(dotted: str, backend: Optional[str] = None) -> str:
    """The closest valid keys (difflib) of the section a dotted key points into, followed through nested sections
    (`device.paths.x`); for `backend`, of the selected backend only. Without a close match, the section's keys
    (short sections) or where to look."""
    import dataclasses
    import difflib

    parts = dotted.split(".")
    section = parts[0]
    sections = section_schemas()
    if section not in sections:
        names = list(sections)
        close = difflib.get_close_matches(section, names, n=3, cutoff=0.6)
        if close:
            return "Did you mean " + " or ".join(close) + "?"
        return f"Valid top-level keys: {', '.join(names)}"
    schema = sections[section]
    if section == "backend":

        schemas = backend_schemas()
        schema = schemas.get(backend or "")
        what = f"keys of backend '{backend}'" if schema is not None else "backend keys"
        names = (sorted({f.name for s in schemas.values() for f in dataclasses.fields(s)}) if schema is None else
                 [f.name for f in dataclasses.fields(schema)])
    else:
        what = f"{section} keys"
        names = [f.name for f in dataclasses.fields(schema)]
    prefix = section
    rest = parts[1:]
    # Follow nested sections as far as the key names them (device.paths.boot_idd -> the keys of device.paths).
    while len(rest) > 1 and schema is not None and rest[0] in names:
        schema = _nested_schema(schema, rest[0])
        if schema is None:
            break
        prefix = f"{prefix}.{rest[0]}"
        rest = rest[1:]
        names = [f.name for f in dataclasses.fields(schema)]
        what = f"{prefix} keys"
    leaf = rest[0] if rest else section
    close = difflib.get_close_matches(leaf, names, n=3, cutoff=0.6)
    if close:
        return "Did you mean " + " or ".join(f"{prefix}.{c}" for c in close) + "?"
    if len(names) <= 12:
        return f"Valid {what}: {', '.join(names)}"
    return f"None of the {len(names)} {what} is close to '{leaf}'; `jbench run --cfg job -p {section}` lists them"


def load_profile(name: str, config_dirs: Optional[List[Path]] = None) -> dict:
    """A module profile by name (the user's config dirs first, then the packaged conf/profile),
    checked against ProfileConfig (unknown keys and wrong types are errors), as a plain dict."""
    from importlib.resources import files

    import yaml
    from omegaconf import OmegaConf

    valid = available_choices("profile", config_dirs)
    if name not in valid:
        raise ConfigError(f"unknown profile '{name}'. Valid profiles: {', '.join(valid)}")
    candidates = [d / "profile" / f"{name}.yaml" for d in (config_dirs or [])]
    text = next((c.read_text() for c in candidates if c.is_file()), None)
    if text is None:
        text = files(CONFIG_MODULE).joinpath("profile", f"{name}.yaml").read_text()
    data = yaml.safe_load(text) or {}
    data.pop("defaults", None)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(ProfileConfig), data)
        return OmegaConf.to_container(merged, resolve=True, throw_on_missing=True)
    except Exception as exc:  # OmegaConf validation errors
        raise ConfigError(f"profile '{name}': {explain_compose_error(exc, [])}") from None
