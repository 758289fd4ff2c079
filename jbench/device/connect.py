"""Open the connection a device config asks for (the one place that knows every transport)."""

from __future__ import annotations

from jbench.device.connection import Connection, DeviceError
from jbench.device.local import LocalConnection

# jbench.device.ssh (paramiko, cryptography: ~0.2 s of imports) is imported only for SSH devices,
# so a sweep on this machine does not pay for it.


def _jump_connection(spec: str, device: dict) -> Connection:
    """device.jump 'user@host:port' -> an SSH connection to the jump host (same host-key rules)."""
    from jbench.device.ssh import SSHConnection

    user, _, hostport = spec.rpartition("@")
    host, _, port = hostport.partition(":")
    return SSHConnection(f"{device['name']}-jump", host, port=int(port or 22), user=user or None,
                         key=device.get("key"), known_hosts=device.get("known_hosts"),
                         accept_new_host_key=bool(device.get("accept_new_host_key")),
                         connect_timeout=float(device.get("connect_timeout_s", 10)))


def connect(device: dict) -> Connection:
    """Open the connection a device config asks for (SSH connects here: errors come early)."""
    kind = device.get("kind", "local")
    if kind == "local":
        return LocalConnection(device.get("name", "local"))
    if kind == "ssh":
        if not device.get("host"):
            raise DeviceError(f"device '{device.get('name')}': kind ssh needs device.host")
        from jbench.device.ssh import SSHConnection

        conn = SSHConnection(
            device["name"], device["host"], port=int(device.get("port") or 22), user=device.get("user"),
            key=device.get("key"), known_hosts=device.get("known_hosts"),
            accept_new_host_key=bool(device.get("accept_new_host_key")),
            connect_timeout=float(device.get("connect_timeout_s", 10)),
            keepalive_s=float(device.get("keepalive_s", 15)),
            jump=_jump_connection(device["jump"], device) if device.get("jump") else None,
            sudo_password_env=device.get("sudo_password_env"),
        )
        return conn.open()
    raise DeviceError(f"device '{device.get('name')}': kind '{kind}' is not supported. Valid kinds: local, ssh")
