"""Port forwarding over an SSH transport (what `ssh -L` does), for servers on the device."""

from __future__ import annotations

import select
import socket
import threading


class TunnelForwarder:
    # PortForward: `address` is where the controller connects.
    """A loopback listening socket on the controller; each connection is forwarded over a `direct-tcpip`
    channel of the SSH transport to remote_host:remote_port as the device sees it."""

    def __init__(self, transport, remote_port: int, remote_host: str = "127.0.0.1", open_timeout: float = 10.0):
        self.transport = transport
        self.remote = (remote_host, remote_port)
        self.open_timeout = open_timeout
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self.address = ("127.0.0.1", self.port)
        self._closed = threading.Event()
        self._pairs: set = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name="jbench-tunnel", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), name="jbench-tunnel-conn", daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        client.settimeout(None)
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            chan = self.transport.open_channel("direct-tcpip", self.remote, client.getpeername(),
                                               timeout=self.open_timeout)
        except Exception:  # server not listening yet, transport gone: the client sees a closed connection
            client.close()
            return
        pair = (client, chan)
        with self._lock:
            if self._closed.is_set():
                client.close()
                chan.close()
                return
            self._pairs.add(pair)
        try:
            while not self._closed.is_set():
                r, _, _ = select.select([client, chan], [], [], 0.5)
                if client in r:
                    data = client.recv(65536)
                    if not data:
                        break
                    chan.sendall(data)
                if chan in r:
                    data = chan.recv(65536)
                    if not data:
                        break
                    client.sendall(data)
        except (OSError, EOFError):
            pass
        finally:
            with self._lock:
                self._pairs.discard(pair)
            _quiet_close(chan)
            _quiet_close(client)

    def close(self) -> None:
        self._closed.set()
        _quiet_close(self._sock)
        with self._lock:
            pairs = list(self._pairs)
        for client, chan in pairs:
            _quiet_close(chan)
            try:
                client.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            _quiet_close(client)
        self._thread.join(timeout=2)


def _quiet_close(obj) -> None:
    try:
        obj.close()
    except Exception:  # closing something already dead is not an error worth reporting
        pass
