"""Where trials run at the same time: the only module of the run layer and the workflows that starts threads.

Three ways to spread trials over held devices:
- serial: one device, the trials in plan order, in the caller's thread;
- shared queue: a pool of units (device=@CLASS) takes groups of trials (same power state and model: one switch,
  one load) from one queue, a worker thread per unit; a unit that becomes unfit is dropped and the rest of its
  group goes back to the queue, so every trial taken is run once or given back, never run twice;
- every unit: each unit runs every trial from a queue of its own (a nightly compares each unit with its history).
Besides: `each` runs a short function on every device side by side (taking leases, saving power states), and
`background` starts the recorder's writer.
"""

from __future__ import annotations

import collections
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Generic, Hashable, Optional, Sequence, TypeVar

log = logging.getLogger("jbench")

T = TypeVar("T")
U = TypeVar("U")


def background(target: Callable[[], None], name: str) -> threading.Thread:
    """A daemon thread running `target` (the recorder's writer)."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


def each(fn: Callable[[T], None], items: Sequence[T], max_threads: int = 16) -> None:
    """fn(item) for every item, side by side when there are several (taking 64 leases one after the other kept the
    first unit idle for ~10 s); every call ends before the first error is raised, in item order."""
    if len(items) <= 1:
        for item in items:
            fn(item)
        return
    with ThreadPoolExecutor(max_workers=min(max_threads, len(items)), thread_name_prefix="jbench-units") as pool:
        futures = [pool.submit(fn, item) for item in items]
    for future in futures:
        future.result()


class Stopped(Exception):
    """The run was interrupted: a worker starts no further trial."""


@dataclass
class Unit(Generic[U]):
    """A unit of a pool as the scheduler sees it: its name and whatever the caller runs trials on."""

    name: str
    value: U
    failures: int = 0  # the unit's run of device failures, carried across its groups


@dataclass
class Left:
    """Trials no unit ran: their queue's unit (every-unit) or None (the shared queue), and why."""

    unit: Optional[str]
    items: list = field(default_factory=list)


def group_runs(items: Sequence[T], key: Callable[[T], Hashable], units: int) -> list[list[T]]:
    """Consecutive items with the same key as groups, each at most an even share of the work (so a sweep of one
    model and power state still spreads over the units)."""
    groups: list[list[T]] = []
    for item in items:
        if groups and key(groups[-1][-1]) == key(item):
            groups[-1].append(item)
        else:
            groups.append([item])
    share = max(1, -(-len(items) // max(1, units)))
    return [g[i:i + share] for g in groups for i in range(0, len(g), share)]


class Scheduler(Generic[T, U]):
    """Runs work items on units; `stop` (Ctrl-C) ends every worker after its current item."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.lock = threading.RLock()  # what the workers share: progress callbacks, outcome lists
        self._idle = threading.Condition(self.lock)  # a queue changed (a group taken or given back)
        self._busy = 0  # workers holding a group: until none does, an empty queue may still get items back
        self._workers: list[threading.Thread] = []

    def serial(self, items: Sequence[T], run: Callable[[T], None]) -> None:
        for item in items:
            if self.stop.is_set():
                raise Stopped()
            run(item)

    def pool(self, units: list[Unit[U]], groups: list[list[T]], run: Callable[[Unit[U], T], Optional[str]], *,
             every_unit: bool = False) -> list[Left]:
        """Run the groups over the units (module doc). run(unit, item) runs one item on the unit and returns why the
        unit must stop (the rest of its group goes back), or None. Returns what was left unrun."""
        shared: collections.deque = collections.deque(groups)
        queues = {u.name: collections.deque(groups) if every_unit else shared for u in units}
        workers = [threading.Thread(target=self._worker, args=(u, queues[u.name], run), name=f"jbench-{u.name}",
                                    daemon=True) for u in units]
        self._workers = workers
        for w in workers:
            w.start()
        while any(w.is_alive() for w in workers):
            for w in workers:
                w.join(0.2)  # short joins: Ctrl-C reaches the main thread
        if every_unit:
            return [Left(name, [t for g in q for t in g]) for name, q in queues.items() if q]
        return [Left(None, [t for g in shared for t in g])] if shared else []

    def _worker(self, unit: Unit[U], groups: collections.deque, run: Callable[[Unit[U], T], Optional[str]]) -> None:
        while not self.stop.is_set():
            with self._idle:
                # An empty queue ends this worker only when no other holds a group it may give back.
                while not groups and self._busy and not self.stop.is_set():
                    self._idle.wait(0.5)
                if not groups or self.stop.is_set():
                    return
                group = groups.popleft()
                self._busy += 1
            try:
                for i, item in enumerate(group):
                    if self.stop.is_set():
                        return
                    try:
                        reason = run(unit, item)
                    except Stopped:
                        return
                    if reason:
                        with self._idle:
                            if group[i + 1:]:
                                groups.appendleft(group[i + 1:])
                        return
            finally:
                with self._idle:
                    self._busy -= 1
                    self._idle.notify_all()

    def wait_for_workers(self, interrupt: Callable[[], None], timeout_s: float = 60.0) -> None:
        """Ctrl-C of a pool: end the units' running commands (`interrupt`) and wait for the workers, so that none is
        still applying a power state while the power states are restored. A second Ctrl-C stops the wait."""
        import time

        alive = [w for w in self._workers if w.is_alive()]
        if not alive:
            return
        interrupt()
        deadline = time.monotonic() + timeout_s
        while alive and time.monotonic() < deadline:
            alive[0].join(0.2)
            alive = [w for w in alive if w.is_alive()]
        if alive:
            log.warning("%d unit worker(s) still busy after %.0f s: restoring the power states anyway",
                        len(alive), timeout_s)
