"""A device held by a workflow, through explicit lifecycle states (as labgrid's BindingState and strategies).

    NEW --connect--> CONNECTED --lease--> LEASED --save--> SAVED --apply--> APPLIED --restore--> RESTORED
                                                                   (apply again: APPLIED)
    close(): from any state -> CLOSED (restores a saved power state first, releases the lease, closes the link)

Each transition is a step: it is logged with its arguments and duration, reported to the session's listeners
(`on_step`), does nothing and says so when the device is already in the state asked for (apply), and is refused
with SessionStateError when called in the wrong state (a bug in the caller, never a user error). Every workflow
(sweep, nightly, confirm, bisect) holds devices only through a DeviceSession: connecting, the fingerprint and the
profile check, the on-device lease (one controller per device), and saving, applying, verifying and restoring the
power state live here and nowhere else.

A session also keeps what is true of its device for as long as it is held: one backend instance per backend
config, each backend's build id, each model file's digest and whether it is on the device.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from jbench.backends.base import Backend, backend_class
from jbench.core.schema import DeviceConfig, ModelConfig, PowerConfig, ProfileConfig, typed
from jbench.device.connect import connect
from jbench.device.connection import Connection, DeviceError
from jbench.device.fingerprint import host_fingerprint
from jbench.device.jetson import jetson_fingerprint
from jbench.device.lease import DeviceLease
from jbench.device.power import PowerStrategy, read_power_modes
from jbench.models.digest import model_digest
from jbench.models.store import ModelError, resolve_model_file

log = logging.getLogger("jbench")


class State(str, enum.Enum):
    NEW = "new"
    CONNECTED = "connected"
    LEASED = "leased"
    SAVED = "saved"  # the original power state is saved on the device (and in its state file)
    APPLIED = "applied"  # a trial's power state is applied and verified
    RESTORED = "restored"
    CLOSED = "closed"


class SessionStateError(RuntimeError):
    """A session step called in a state it cannot start from: a bug in the workflow, not a user error."""


@dataclass(frozen=True)
class StepEvent:
    """One step of a session, as its listeners see it (after the step, or when it failed)."""

    device: str
    step: str
    detail: str
    state: State
    duration_s: float
    error: Optional[str] = None


def profile_mismatch(profile: Optional[ProfileConfig], module: Optional[str]) -> Optional[str]:
    """Why the device's device-tree model does not fit its profile, or None (no model or no rule: no verdict)."""
    if profile is None or not module or not profile.model_match:
        return None
    if any(m.lower() in module.lower() for m in profile.model_match):
        return None
    return (f"its device-tree model is '{module}', but its profile '{profile.name}' is for "
            f"{profile.module} (model_match {list(profile.model_match)})")


def power_state_tags(snap: Any, changes: list[str]) -> dict[str, str]:
    """The power state as read back after applying it (a PowerStrategy's `last` snapshot) and what changed."""
    tags = {"power.mode_actual": str(snap.mode), "power.mode_id": str(snap.mode_id),
            "power.jetson_clocks_actual": str(snap.clocks_locked), "power.changes": "; ".join(changes) or "none"}
    # Every part of the lock as verified on the device (a half-locked device is visible, not hidden).
    tags.update({f"power.lock.{k}": str(v) for k, v in snap.locks.parts().items() if v is not None})
    if snap.fan_pwm is not None:
        tags["power.fan_pwm"] = str(snap.fan_pwm)
    return tags


def _step(allowed: tuple[State, ...], after: Optional[State] = None) -> Callable:
    """A lifecycle step: refused outside `allowed`, logged, reported to the listeners; the state becomes `after`
    when the step returns."""

    def wrap(fn: Callable) -> Callable:
        def step(self: "DeviceSession", *args: Any, **kwargs: Any) -> Any:
            if self.state not in allowed:
                raise SessionStateError(f"device '{self.name}': {fn.__name__} in state {self.state.value} "
                                        f"(allowed from {', '.join(s.value for s in allowed)})")
            shown = ", ".join([repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()])
            started = time.monotonic()
            try:
                out = fn(self, *args, **kwargs)
            except BaseException as exc:
                self._event(fn.__name__, shown, time.monotonic() - started, error=str(exc) or type(exc).__name__)
                raise
            if after is not None:
                self.state = after
            self._event(fn.__name__, shown, time.monotonic() - started)
            return out

        step.__name__ = fn.__name__
        step.__doc__ = fn.__doc__
        return step

    return wrap


class DeviceSession:
    """One device, held from connect to close. Use as a context manager, or call close() in a finally."""

    def __init__(self, device: DeviceConfig | Mapping[str, Any],
                 profile: Optional[ProfileConfig | Mapping[str, Any]] = None, *, owner: str,
                 reboot_consent: bool = False, on_step: Optional[Callable[[StepEvent], None]] = None,
                 logger: Optional[logging.Logger] = None):
        self.cfg: DeviceConfig = typed(DeviceConfig, device, where="device")
        self.name = self.cfg.name
        self.profile: Optional[ProfileConfig] = typed(ProfileConfig, profile, where="profile") if profile else None
        self.owner = owner  # the sweep id the lease and the power-state file name
        self.reboot_consent = reboot_consent  # some trial on this device set power.allow_reboot=true
        self.listeners: list[Callable[[StepEvent], None]] = [on_step] if on_step else []
        self.log = logger or log
        self.state = State.NEW
        self.conn: Optional[Connection] = None
        self.fingerprint: dict[str, str] = {}
        self.strategy: Optional[PowerStrategy] = None  # a Jetson profile's power control
        self.lease_: Optional[DeviceLease] = None
        self.saved = False  # a power state to restore was saved
        self.extra_tags: dict[str, str] = {}  # who this unit is in a pool (device.unit, farm.place, ...)
        self.boot_id: Optional[str] = None  # seen at the previous trial: a change is a reboot between trials
        self._backends: dict[str, Backend] = {}
        self._builds: dict[str, Optional[str]] = {}
        self._digests: dict[str, Optional[str]] = {}
        # Quality already measured on this device, by quality identity: (where it was measured, its figures).
        self.known_quality: dict[str, tuple[str, dict[str, float]]] = {}
        self._model_found: dict[str, bool] = {}

    def __enter__(self) -> "DeviceSession":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _event(self, step: str, detail: str, duration_s: float, error: Optional[str] = None) -> None:
        event = StepEvent(self.name, step, detail, self.state, duration_s, error)
        self.log.debug("device %s: %s(%s) -> %s in %.2f s%s", self.name, step, detail, self.state.value, duration_s,
                       f": {error}" if error else "")
        for listener in self.listeners:
            listener(event)

    @property
    def connection(self) -> Connection:
        if self.conn is None:
            raise SessionStateError(f"device '{self.name}' is not connected (state {self.state.value})")
        return self.conn

    # -- lifecycle ---------------------------------------------------------------------------------

    @_step((State.NEW,))
    def connect(self) -> list[str]:
        """Connect, read the fingerprint, make the power strategy of a Jetson profile and check the profile against
        the device tree. Returns the problems found (empty: the state is CONNECTED; else the link is closed again)."""
        problems: list[str] = []
        try:
            conn = connect(self.cfg)
        except DeviceError as exc:
            return [str(exc)]
        try:
            self.fingerprint = host_fingerprint(conn)
            if self.cfg.profile:
                self.fingerprint.update(jetson_fingerprint(conn, self.cfg.paths))
                self.strategy = PowerStrategy(conn, self.cfg, self.log, sweep_id=self.owner, profile=self.profile)
                mismatch = profile_mismatch(self.profile, self.fingerprint.get("jetson.module"))
                if mismatch and not self.cfg.allow_profile_mismatch:
                    problems.append(f"device '{self.name}': {mismatch}. Fix device.profile, or set "
                                    f"device.allow_profile_mismatch=true to run it anyway")
                elif mismatch:
                    self.fingerprint["jetson.profile_mismatch"] = mismatch
        except DeviceError as exc:
            problems.append(str(exc))
        if problems:
            conn.close()
            self.strategy = None
            return problems
        self.conn = conn
        self.state = State.CONNECTED
        return []

    @_step((State.CONNECTED,), after=State.LEASED)
    def lease(self, wait_s: float = 0.0) -> None:
        """Hold the device with an on-device lease (heartbeat) or raise LeaseBusy (a DeviceError) naming its holder."""
        lease = DeviceLease(self.connection, self.cfg, self.owner, log=self.log)
        lease.acquire(wait_s, on_wait=lambda msg: self.log.warning("%s", msg))
        self.lease_ = lease

    @_step((State.LEASED,), after=State.SAVED)
    def save(self, control_power: bool) -> None:
        """Put back what a controller that died here left changed (we hold the lease, so its owner is gone), then,
        when trials will set power.*, save the original power state to restore at the end."""
        if self.strategy is None:
            return
        self.strategy.recover_leftover(allow_reboot=self.reboot_consent)
        if control_power:
            self.strategy.save_original()
            self.saved = True

    @_step((State.SAVED, State.APPLIED), after=State.APPLIED)
    def apply(self, power: PowerConfig, logger: Optional[logging.Logger] = None) -> dict[str, str]:
        """Bring the device into `power` (nvpmodel mode, jetson_clocks, fan) and verify it; parts already true are
        left alone (the strategy says "unchanged"). Returns the power state's tags as read back."""
        if self.strategy is None or not self.saved:
            raise SessionStateError(f"device '{self.name}' has no saved power state to change (no Jetson profile, "
                                    "or save(control_power=True) was not called)")
        self.strategy.log = logger or self.log
        changes = self.strategy.apply(power.mode, power.jetson_clocks, allow_reboot=power.allow_reboot,
                                      reboot_timeout_s=power.reboot_timeout_s, fan=power.fan)
        tags = power_state_tags(self.strategy.last, changes)
        if self.strategy.rebooted:
            tags["jetson.rebooted"] = "power mode change"
        return tags

    @_step((State.SAVED, State.APPLIED, State.RESTORED), after=State.RESTORED)
    def restore(self) -> bool:
        """Put the original power state back; False when some part could not be (the state file stays on the
        device and the next start there finishes the job)."""
        if self.strategy is None or not self.saved:
            return True
        self.strategy.log = self.log
        done = self.strategy.restore(allow_reboot=self.reboot_consent)
        self.saved = not done
        if not done:
            self.log.error("the power state of %s was not fully restored (see above); the state file stays on the "
                           "device and jbench finishes the job at its next start there", self.name)
        return done

    def close(self) -> None:
        """Restore a saved power state, release the lease, close the link (every part even when one fails)."""
        if self.state is State.CLOSED:
            return
        started = time.monotonic()
        errors: list[str] = []
        if self.saved:
            try:
                self.restore()
            except Exception as exc:  # keep releasing
                errors.append(f"restore: {exc}")
                self.log.error("restoring the power state of %s failed: %s", self.name, exc)
        if self.lease_ is not None:
            try:
                self.lease_.release()
            except Exception as exc:  # a dead link: the lease goes stale and is taken over later
                errors.append(f"release: {exc}")
                self.log.warning("releasing the lease of %s failed: %s", self.name, exc)
            self.lease_ = None
        if self.conn is not None:
            self.conn.close()
        self.state = State.CLOSED
        self._event("close", "", time.monotonic() - started, "; ".join(errors) or None)

    def interrupt(self) -> None:
        """Ctrl-C from another thread: end the running command (closing the link makes the device-side guard end
        it); close() reconnects to restore."""
        if self.conn is not None:
            try:
                self.conn.close()
            except Exception as exc:
                self.log.debug("closing %s: %s", self.name, exc)

    def reconnect(self, timeout_s: float) -> None:
        self.connection.reconnect(timeout_s)

    # -- what the held device knows ----------------------------------------------------------------

    def backend(self, config: Any) -> Backend:
        """One backend instance per distinct backend config (its CONFIG object) on this device (a pool's units
        never share one)."""
        key = repr(config)
        if key not in self._backends:
            self._backends[key] = backend_class(config.name)(config)
        return self._backends[key]

    def build_id(self, config: Any) -> Optional[str]:
        """The backend build on the device (read once per backend config)."""
        key = repr(config)
        if key not in self._builds:
            self._builds[key] = self.backend(config).build_id(self.connection)
        return self._builds[key]

    def model_digest(self, model: ModelConfig) -> Optional[str]:
        """SHA-256 of the model file on the device (once per model section)."""
        key = repr(model)
        if key not in self._digests:
            self._digests[key] = model_digest(model, self.connection)
        return self._digests[key]

    def model_missing(self, model: ModelConfig) -> Optional[str]:
        """A model file missing on a remote device, found before anything runs (a local one: at planning)."""
        conn = self.connection
        if conn.is_local:
            return None
        try:
            path, _ = resolve_model_file(model)
        except ModelError:
            return None  # validation reported it
        if path not in self._model_found:
            self._model_found[path] = conn.exists(conn.expand_path(path))
        if self._model_found[path]:
            return None
        return f"model file {path} not found on device '{conn.name}': copy it there or fix model.files / model.path_template"


class PowerModesError(DeviceError):
    """A device's power modes could not be read."""


_DEVICE_MODES_CACHE: dict[str, list[str]] = {}  # per device entry, for the group loop of one plan


def device_power_modes(device: Mapping[str, Any]) -> list[str]:
    """The mode names of the device's own /etc/nvpmodel.conf, by id (one read-only command on the device, while a
    sweep is planned: `"@device.power_modes"`). PowerModesError when the device cannot be read."""
    cfg = typed(DeviceConfig, device, where="device")
    key = repr((cfg.name, cfg.kind, cfg.host, cfg.port, cfg.paths))
    if key not in _DEVICE_MODES_CACHE:
        try:
            with connect(cfg) as conn:
                modes = read_power_modes(conn, cfg.paths.nvpmodel_conf)
        except DeviceError as exc:
            raise PowerModesError(f"@device.power_modes reads the power modes from device '{cfg.name}': {exc}") from None
        _DEVICE_MODES_CACHE[key] = [n for n, _ in sorted(modes.items(), key=lambda kv: kv[1])]
    return list(_DEVICE_MODES_CACHE[key])
