"""The HTTP side every serving client shares: one connection per load-generator worker, aborted from another thread
when a level gives up, and the error a request raises when the server's answer cannot be counted."""

from __future__ import annotations

import http.client
import json
import socket
import threading
from typing import Any, Callable, Generic, Iterator, Optional, TypeVar


class RequestError(Exception):
    """A request the server refused, or answered with something jbench cannot count (`category`: the trial's
    failure category)."""

    def __init__(self, message: str, category: str = "unparseable_output"):
        super().__init__(message)
        self.category = category


class HTTPClient:
    """One HTTP connection to host:port (the server, or the local end of the device's tunnel), Nagle off: a
    request's bytes leave at once, so the first token's time is the server's, not the socket's."""

    def __init__(self, address: tuple[str, int], timeout: float):
        self.address, self.timeout = address, timeout
        self.conn = http.client.HTTPConnection(*address, timeout=timeout)

    def close(self) -> None:
        self.conn.close()

    def abort(self) -> None:
        """Break a blocked read from another thread."""
        sock = self.conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _connect(self) -> None:
        if self.conn.sock is None:
            self.conn.connect()
            self.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def exchange(self, method: str, path: str, body: Optional[bytes] = None,
                 headers: Optional[dict[str, str]] = None) -> tuple[int, bytes]:
        """(HTTP status, whole answer) of one request on the kept connection, closed after an error or when the
        server says it closes it."""
        try:
            self._connect()
            self.conn.request(method, path, body=body, headers=dict(headers or {}))
            resp = self.conn.getresponse()
            payload = resp.read()
        except (OSError, http.client.HTTPException):
            self.conn.close()
            raise
        if resp.will_close:
            self.conn.close()
        return resp.status, payload


C = TypeVar("C", bound=HTTPClient)


class ClientPool(Generic[C]):
    """A client per load-generator worker (made on its first request), all aborted or closed at once."""

    def __init__(self, make: Callable[[], C]):
        self._make = make
        self._lock = threading.Lock()
        self._clients: dict[int, C] = {}

    def get(self, worker: int) -> C:
        with self._lock:
            c = self._clients.get(worker)
            if c is None:
                c = self._clients[worker] = self._make()
            return c

    def abort(self) -> None:
        with self._lock:
            for c in self._clients.values():
                c.abort()

    def close(self) -> None:
        with self._lock:
            for c in self._clients.values():
                c.close()


class EventStream:
    """The JSON chunks of a streamed answer (server-sent events: `data: {...}` lines up to `data: [DONE]`), each with
    its arrival time on `clock`. An `error:` line, an error object or a chunk that is not a JSON object raises
    RequestError; `end()` is the arrival of the last line (the stream's end)."""

    def __init__(self, resp: Any, clock: Callable[[], float]):
        self.resp, self.clock = resp, clock
        self._end: Optional[float] = None

    def __iter__(self) -> Iterator[tuple[float, dict]]:
        readline = self.resp.readline
        while True:
            line = readline()
            if not line:
                return
            now = self._end = self.clock()
            line = line.strip()
            if not line.startswith(b"data:"):
                if line.startswith(b"error:"):
                    raise RequestError(f"server error in the stream: {line[:500]!r}", "backend_crash")
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return
            try:
                obj = json.loads(payload)
            except ValueError:
                raise RequestError(f"unparseable stream chunk: {payload[:300]!r}") from None
            if not isinstance(obj, dict):
                raise RequestError(f"unparseable stream chunk: {payload[:300]!r}")
            if obj.get("error"):
                raise RequestError(f"server error in the stream: {str(obj['error'])[:500]}", "backend_crash")
            yield now, obj

    def end(self) -> float:
        if self._end is None:
            raise RequestError("empty response stream", "backend_crash")
        return self._end
