"""The one module that talks to a labgrid coordinator (and the only one importing labgrid).

labgrid's coordinator (`labgrid-coordinator`, 24.0 and later) is a gRPC service. Read-only calls (places,
reservations) and tag changes need no session; acquiring a place and creating a reservation do: the
coordinator names the caller by the `ClientStream` session opened on the same channel (its peer), with the
name `host/user` that `labgrid-client` also uses (`LG_HOSTNAME`, `LG_USERNAME` override it). This adapter
keeps that session open on a thread and hands the rest of jbench plain dataclasses, never labgrid types.
"""

from __future__ import annotations

import getpass
import itertools
import os
import queue
import socket
import threading
from dataclasses import dataclass, field
from typing import Iterator, Optional

DEFAULT_PORT = 20408  # labgrid-coordinator's default listening port
# labgrid (and its gRPC) come with the `farm` extra only: every other command works without them.
LABGRID_MISSING = "the device farm needs labgrid, which is not installed: pip install 'jbench[farm]'"


class CoordinatorError(Exception):
    """The coordinator refused a request or cannot be reached (the message names the fix)."""


@dataclass(frozen=True)
class PlaceInfo:
    name: str
    tags: dict = field(default_factory=dict)
    acquired: Optional[str] = None  # "host/user" of the labgrid session that holds it
    reservation: Optional[str] = None  # token of the reservation it is allocated to
    comment: str = ""


@dataclass(frozen=True)
class ReservationInfo:
    token: str
    owner: str
    state: str  # waiting | allocated | acquired | expired | invalid
    prio: float
    filters: dict
    places: list
    created: float


_STATES = {0: "waiting", 1: "allocated", 2: "acquired", 3: "expired", 4: "invalid"}


def normalize_address(address: str) -> str:
    """`host` -> `host:20408`, as labgrid-client reads LG_COORDINATOR."""
    address = address.strip()
    if not address:
        raise CoordinatorError("empty coordinator address: give HOST:PORT (labgrid-coordinator listens on port 20408)")
    if address.startswith("[") and "]:" in address or address.count(":") == 1:
        return address
    return f"{address}:{DEFAULT_PORT}"


def session_name() -> str:
    return f"{os.environ.get('LG_HOSTNAME', socket.gethostname())}/{os.environ.get('LG_USERNAME', getpass.getuser())}"


class Coordinator:
    """A connection to one labgrid coordinator; use as a context manager."""

    def __init__(self, address: str, *, connect_timeout_s: float = 10.0, call_timeout_s: float = 30.0):
        self.address = normalize_address(address)
        self.name = session_name()
        self.connect_timeout_s = connect_timeout_s
        self.call_timeout_s = call_timeout_s
        self._channel = None
        self._stub = None
        self._pb2 = None
        self._out: "queue.Queue" = queue.Queue()
        self._stream = None
        self._reader: Optional[threading.Thread] = None
        self._syncs: dict[int, threading.Event] = {}
        self._sync_ids = itertools.count(1)
        self._lock = threading.Lock()

    # -- connection ---------------------------------------------------------------------------------

    def open(self) -> "Coordinator":
        try:
            import grpc
            from labgrid.remote.generated import labgrid_coordinator_pb2, labgrid_coordinator_pb2_grpc
        except ImportError as exc:
            raise CoordinatorError(f"{LABGRID_MISSING} ({exc})") from None

        self._pb2 = labgrid_coordinator_pb2
        # Keepalive as labgrid-client sets it: a dead coordinator is noticed, an idle link is kept.
        self._channel = grpc.insecure_channel(self.address, options=[
            ("grpc.keepalive_time_ms", 7500), ("grpc.keepalive_timeout_ms", 10000),
            ("grpc.http2.max_pings_without_data", 0),
            # Own TCP connection per Coordinator: the coordinator tells sessions apart by peer address, and
            # gRPC would otherwise share one connection between channels of a process (two leases in one).
            ("grpc.use_local_subchannel_pool", 1)])
        try:
            grpc.channel_ready_future(self._channel).result(timeout=self.connect_timeout_s)
        except grpc.FutureTimeoutError:
            self._channel.close()
            self._channel = None
            raise CoordinatorError(
                f"no labgrid coordinator answers at {self.address}: start one (`labgrid-coordinator --listen "
                f"{self.address}`) or point jbench at yours (--coordinator HOST:PORT, $LG_COORDINATOR or "
                f"farm.coordinator)") from None
        self._stub = labgrid_coordinator_pb2_grpc.CoordinatorStub(self._channel)
        return self

    def _session(self) -> None:
        """Open the client session acquire and reserve need (once per connection)."""
        with self._lock:
            if self._stream is not None:
                return
            self._stream = self._stub.ClientStream(iter(self._out.get, None))
            msg = self._pb2.ClientInMessage()
            msg.startup.version = _labgrid_version()
            msg.startup.name = self.name
            self._out.put(msg)
            self._reader = threading.Thread(target=self._read, name="labgrid-session", daemon=True)
            self._reader.start()
        self.sync()

    def _read(self) -> None:
        try:
            for out_msg in self._stream:
                if out_msg.HasField("sync"):
                    event = self._syncs.pop(out_msg.sync.id, None)
                    if event is not None:
                        event.set()
        except Exception:  # the stream ends when we close, or when the coordinator goes away
            pass
        for event in list(self._syncs.values()):
            event.set()

    def sync(self) -> None:
        """Wait until the coordinator has handled everything sent on the session so far."""
        ident = next(self._sync_ids)
        event = self._syncs[ident] = threading.Event()
        msg = self._pb2.ClientInMessage()
        msg.sync.id = ident
        self._out.put(msg)
        if not event.wait(self.call_timeout_s):
            raise CoordinatorError(f"the labgrid coordinator at {self.address} did not answer the session start")

    def close(self) -> None:
        self._out.put(None)  # ends the request iterator: the coordinator drops the session
        if self._stream is not None:
            self._stream.cancel()
        if self._reader is not None:
            self._reader.join(timeout=5)
        if self._channel is not None:
            self._channel.close()
        self._channel = self._stub = self._stream = None

    def __enter__(self) -> "Coordinator":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method: str, request, *, session: bool = False):
        import grpc

        if self._stub is None:
            raise CoordinatorError("coordinator connection is not open")
        if session:
            self._session()
        try:
            return getattr(self._stub, method)(request, timeout=self.call_timeout_s)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise CoordinatorError(f"the labgrid coordinator at {self.address} is unreachable "
                                       f"({exc.details() if hasattr(exc, 'details') else exc})") from None
            raise CoordinatorError(exc.details() if hasattr(exc, "details") else str(exc)) from None

    # -- places ---------------------------------------------------------------------------------------

    def places(self) -> list[PlaceInfo]:
        res = self._call("GetPlaces", self._pb2.GetPlacesRequest())
        return sorted((_place(p) for p in res.places), key=lambda p: p.name)

    def place(self, name: str) -> PlaceInfo:
        for p in self.places():
            if p.name == name:
                return p
        raise CoordinatorError(f"no place '{name}' on the coordinator at {self.address}: "
                               f"`jbench farm list` shows the places there")

    def add_place(self, name: str) -> None:
        self._call("AddPlace", self._pb2.AddPlaceRequest(name=name))

    def delete_place(self, name: str) -> None:
        self._call("DeletePlace", self._pb2.DeletePlaceRequest(name=name))

    def set_tags(self, name: str, tags: dict) -> None:
        """Set tags on a place; an empty value removes that tag."""
        self._call("SetPlaceTags", self._pb2.SetPlaceTagsRequest(placename=name, tags={k: str(v) for k, v in tags.items()}))

    def acquire(self, name: str) -> None:
        self._call("AcquirePlace", self._pb2.AcquirePlaceRequest(placename=name), session=True)

    def release(self, name: str, *, from_user: Optional[str] = None) -> None:
        """Release a place; with from_user, only if that session still holds it (labgrid's `release-from`:
        a release that cannot free someone else's later acquisition)."""
        req = self._pb2.ReleasePlaceRequest(placename=name)
        if from_user is not None:
            req.fromuser = from_user
        self._call("ReleasePlace", req)

    # -- reservations -------------------------------------------------------------------------------

    def reserve(self, filters: dict, prio: float = 0.0) -> ReservationInfo:
        req = self._pb2.CreateReservationRequest(prio=prio)
        req.filters["main"].filter.update({k: str(v) for k, v in filters.items()})
        return _reservation(self._call("CreateReservation", req, session=True).reservation)

    def poll(self, token: str) -> ReservationInfo:
        """The reservation's state; polling also keeps a waiting reservation from expiring (60 s)."""
        return _reservation(self._call("PollReservation", self._pb2.PollReservationRequest(token=token)).reservation)

    def cancel(self, token: str) -> None:
        self._call("CancelReservation", self._pb2.CancelReservationRequest(token=token))

    def reservations(self) -> list[ReservationInfo]:
        res = self._call("GetReservations", self._pb2.GetReservationsRequest())
        return [_reservation(r) for r in res.reservations]


def _place(pb) -> PlaceInfo:
    return PlaceInfo(name=pb.name, tags=dict(pb.tags), acquired=pb.acquired if pb.HasField("acquired") and pb.acquired else None,
                     reservation=pb.reservation if pb.HasField("reservation") and pb.reservation else None,
                     comment=pb.comment)


def _reservation(pb) -> ReservationInfo:
    return ReservationInfo(token=pb.token, owner=pb.owner, state=_STATES.get(pb.state, str(pb.state)), prio=pb.prio,
                           filters={k: dict(v.filter) for k, v in pb.filters.items()},
                           places=[n for group in pb.allocations.values() for n in group.split()]
                           if pb.allocations else [], created=pb.created)


def _labgrid_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("labgrid")
    except PackageNotFoundError:
        return "unknown"


def iter_places(coord: Coordinator, selector: dict) -> Iterator[PlaceInfo]:
    """Places whose tags include every key=value of selector (labgrid's own matching rule; `name` is the place)."""
    for p in coord.places():
        tags = {**p.tags, "name": p.name}
        if all(tags.get(k) == str(v) for k, v in selector.items()):
            yield p
