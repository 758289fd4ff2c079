"""Leasing farm devices through the labgrid coordinator: reserve -> wait -> acquire -> refresh -> release.

    with FarmLease(coordinator, {"class": "orin-nano-8gb"}, count=2, sweep_id=sid) as leased:
        leased.devices   # [device config dicts], one per place, health-checked

labgrid reservations give the queue (by priority, then age) and matching by tags; an acquired place never
expires in labgrid, so jbench adds its own heartbeat on the place (`jbench_owner`, `jbench_heartbeat`, written
by a thread every `heartbeat_s`) and a stale policy (`reap`): a place whose jbench heartbeat is older than
`stale_after_s` is released from its dead holder. Every reserving controller reaps the places it selects
before and while it waits; a lab also runs `jbench farm reap` from cron. Heartbeats are epoch seconds of the
controller's clock: controllers and reapers need synchronized clocks (NTP), and stale_after_s well above
any skew.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from typing import Callable, Iterable, Optional

from jbench.core.schema import DeviceConfig, typed
from jbench.farm import health as H
from jbench.farm import places as P
from jbench.farm.coordinator import Coordinator, CoordinatorError, PlaceInfo, ReservationInfo, iter_places

log = logging.getLogger("jbench.farm")


class FarmBusy(P.FarmError):
    """No matching place came free within reserve_timeout_s."""


def owner_id(sweep_id: str) -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{sweep_id or '-'}"


def heartbeat_age(place: PlaceInfo, now: Optional[float] = None) -> Optional[float]:
    try:
        return (time.time() if now is None else now) - float(place.tags[P.HEARTBEAT])
    except (KeyError, ValueError):
        return None


def reap(coord: Coordinator, stale_after_s: float, selector: Optional[dict] = None) -> list[tuple[str, str]]:
    """Free places held by a jbench controller whose heartbeat stopped more than stale_after_s ago.
    Places acquired without a jbench heartbeat (a person's `labgrid-client acquire`) are left alone.
    Returns (place, former owner) for each place freed."""
    freed = []
    for place in iter_places(coord, selector or {}):
        age = heartbeat_age(place)
        if not place.acquired or age is None or age <= stale_after_s:
            continue
        owner = place.tags.get(P.OWNER, place.acquired)
        # from_user: if the holder changed since we looked, the coordinator leaves the new one alone.
        coord.release(place.name, from_user=place.acquired)
        if place.reservation:
            try:
                coord.cancel(place.reservation)  # else the dead holder's allocation blocks the place ~60 s
            except CoordinatorError:
                pass
        coord.set_tags(place.name, {P.OWNER: "", P.HEARTBEAT: ""})
        log.warning("farm: freed place %s: its holder %s sent no heartbeat for %.0f s (stale after %g s)",
                    place.name, owner, age, stale_after_s)
        freed.append((place.name, owner))
    return freed


class FarmLease:
    """Hold `count` healthy places matching `selector` for the duration of a with-block."""

    def __init__(self, coordinator: str, selector: dict, *, count: int = 1, priority: float = 0.0,
                 sweep_id: str = "", config_dirs: Iterable[str] = (), heartbeat_s: float = 10.0,
                 stale_after_s: float = 300.0, reserve_timeout_s: Optional[float] = 3600.0,
                 health_check: bool = True, on_wait: Optional[Callable[[str], None]] = None,
                 handle_signals: bool = True):
        if count < 1:
            raise P.FarmError(f"count must be at least 1 (got {count})")
        self.coord = Coordinator(coordinator)
        self.selector = {**selector, P.HEALTH: P.HEALTHY}
        self.count = count
        self.priority = priority
        self.owner = owner_id(sweep_id)
        self.config_dirs = list(config_dirs)
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s
        self.reserve_timeout_s = reserve_timeout_s
        self.health_check = health_check
        self.on_wait = on_wait or (lambda msg: log.warning("farm: %s", msg))
        self.handle_signals = handle_signals
        self.places: list[str] = []
        self.devices: list[dict] = []
        self.quarantined: list[tuple[str, str]] = []  # (place, reason) found unhealthy while leasing
        self._tokens: list[str] = []  # every reservation of ours not yet cancelled
        self._stop = threading.Event()
        self._beat: Optional[threading.Thread] = None
        self._old_handlers: dict = {}

    # -- the with-block -----------------------------------------------------------------------------

    def __enter__(self) -> "FarmLease":
        self._install_signals()
        try:
            self.coord.open()
            self._lease()
        except BaseException:
            self._release_all()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._release_all()

    # -- acquiring ----------------------------------------------------------------------------------

    def _lease(self) -> None:
        started = time.monotonic()
        last_reap = float("-inf")
        told = None
        pending: list[str] = []
        while len(self.places) < self.count:
            if time.monotonic() - last_reap >= self.heartbeat_s:
                reap(self.coord, self.stale_after_s, self.selector)
                last_reap = time.monotonic()
            while len(pending) + len(self.places) < self.count:
                res = self.coord.reserve(self.selector, self.priority)
                self._tokens.append(res.token)
                pending.append(res.token)
            for token in list(pending):
                res = self.coord.poll(token)
                if res.state in ("expired", "invalid"):
                    pending.remove(token)
                    self._forget(token)
                elif res.state == "allocated" and res.places:
                    pending.remove(token)
                    self._take(res)
            if len(self.places) >= self.count:
                break
            waited = time.monotonic() - started
            msg = self._wait_message(pending, waited)
            if msg != told:
                self.on_wait(msg)
                told = msg
            if self.reserve_timeout_s is not None and waited > self.reserve_timeout_s:
                raise FarmBusy(f"no place matching {_fmt(self.selector)} came free in {self.reserve_timeout_s:g} s "
                               f"({msg}). Wait longer (farm.reserve_timeout_s), ask for fewer (count), or see "
                               f"`jbench farm status`")
            self._stop.wait(min(1.0, self.heartbeat_s))

    def _take(self, res: ReservationInfo) -> None:
        name = res.places[0]
        # Owner and heartbeat go on before the acquire: a reaper never sees our hold with an old heartbeat.
        self.coord.set_tags(name, {P.OWNER: self.owner, P.HEARTBEAT: str(int(time.time()))})
        self.coord.acquire(name)
        place = self.coord.place(name)
        self.places.append(name)
        self._start_heartbeat()
        try:
            device = P.resolve_device(P.device_entry(place), self.config_dirs)
        except P.FarmError as exc:
            return self._reject(name, res.token, str(exc))
        if self.health_check:
            reason = H.quick_check(typed(DeviceConfig, device, where="device"), place)
            if reason:
                return self._reject(name, res.token, f"health check: {reason}")
        self.devices.append(device)

    def _reject(self, name: str, token: str, reason: str) -> None:
        """Quarantine a place that cannot be used, give it back, and look for another one."""
        H.quarantine(self.coord, name, reason)
        self.quarantined.append((name, reason))
        self.on_wait(f"place {name} quarantined ({reason}); looking for another place")
        self._release_place(name)
        self.places.remove(name)
        self._cancel(token)

    def _wait_message(self, pending: list[str], waited: float) -> str:
        waiting = sorted((r for r in self.coord.reservations() if r.state == "waiting"),
                         key=lambda r: (-r.prio, r.created))
        tokens = [r.token for r in waiting]
        positions = [tokens.index(t) + 1 for t in pending if t in tokens]
        matching = list(iter_places(self.coord, self.selector))
        busy = [f"{p.name} held by {p.tags.get(P.OWNER) or p.acquired}" for p in matching if p.acquired]
        pos = f"position {min(positions)} of {len(tokens)} in the queue" if positions else "being allocated"
        where = f"; {', '.join(busy)}" if busy else ("" if matching else "; no healthy place matches")
        return f"waiting for {len(pending)} place(s) matching {_fmt(self.selector)}: {pos}{where}, " \
               f"{int(waited)} s so far"

    # -- keeping fresh ------------------------------------------------------------------------------

    def _start_heartbeat(self) -> None:
        if self._beat is None:
            self._beat = threading.Thread(target=self._heartbeat, name="farm-heartbeat", daemon=True)
            self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            for name in list(self.places):
                try:
                    self.coord.set_tags(name, {P.HEARTBEAT: str(int(time.time()))})
                except CoordinatorError as exc:  # a coordinator restart: the next beat tries again
                    log.warning("farm: heartbeat on %s failed: %s", name, exc)
            for token in list(self._tokens):
                try:
                    self.coord.poll(token)  # keeps an allocated (not yet acquired) reservation alive
                except CoordinatorError:
                    pass

    # -- results a sweep reports ----------------------------------------------------------------------

    def record_trial(self, device_name: str, *, device_failure: bool, quarantine_after: int = 3) -> bool:
        """A trial on a leased device ended; True when the device got quarantined (stop using it)."""
        for name, device in zip(self._healthy_places(), self.devices):
            if typed(DeviceConfig, device, where="device").name == device_name:
                return H.record_trial(self.coord, name, device_failure=device_failure,
                                      quarantine_after=quarantine_after)
        raise P.FarmError(f"device '{device_name}' is not part of this lease")

    def _healthy_places(self) -> list[str]:
        return [p for p in self.places]

    # -- releasing ----------------------------------------------------------------------------------

    def _release_place(self, name: str) -> None:
        try:
            self.coord.set_tags(name, {P.OWNER: "", P.HEARTBEAT: ""})
            self.coord.release(name, from_user=self.coord.name)
        except CoordinatorError as exc:
            log.warning("farm: could not release %s: %s (the stale policy frees it)", name, exc)

    def _cancel(self, token: str) -> None:
        try:
            self.coord.cancel(token)
        except CoordinatorError:
            pass  # expired or already gone
        self._forget(token)

    def _forget(self, token: str) -> None:
        if token in self._tokens:
            self._tokens.remove(token)

    def _release_all(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=self.heartbeat_s + 5)
            self._beat = None
        if self.coord._stub is not None:
            for name in list(self.places):
                self._release_place(name)
            for token in list(self._tokens):
                self._cancel(token)
        self.places.clear()
        self.devices.clear()
        self.coord.close()
        self._restore_signals()

    # -- signals ------------------------------------------------------------------------------------

    def _install_signals(self) -> None:
        # SIGTERM (a CI job cancelled) ends the with-block like Ctrl-C does, so the places are released.
        if not self.handle_signals or threading.current_thread() is not threading.main_thread():
            return

        def on_term(signum, frame):
            raise KeyboardInterrupt(f"signal {signum}")

        self._old_handlers[signal.SIGTERM] = signal.signal(signal.SIGTERM, on_term)

    def _restore_signals(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()


def _fmt(selector: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in selector.items() if k != P.HEALTH) or "(any)"


def lease(coordinator: str, selector: dict, **kwargs) -> FarmLease:
    """`with farm.lease(coordinator, {"class": ...}, count=2) as leased: leased.devices`."""
    return FarmLease(coordinator, selector, **kwargs)
