"""Open the connection a device config asks for (the one place that knows every transport)."""

from __future__ import annotations

from jbench.core.schema import DeviceConfig, DeviceSection, typed
from jbench.device.connection import Connection, DeviceError
from jbench.device.local import LocalConnection

# jbench.device.ssh (paramiko, cryptography: ~0.2 s of imports) is imported only for SSH devices,
# so a sweep on this machine does not pay for it.


def _jump_connection(spec: str, device: DeviceConfig) -> Connection:
    """device.jump 'user@host:port' -> an SSH connection to the jump host (same host-key rules)."""
    from jbench.device.ssh import SSHConnection

    user, _, hostport = spec.rpartition("@")
    host, _, port = hostport.partition(":")
    return SSHConnection(f"{device.name}-jump", host, port=int(port or 22), user=user or None,
                         key=device.key, known_hosts=device.known_hosts,
                         accept_new_host_key=device.accept_new_host_key,
                         connect_timeout=float(device.connect_timeout_s))


def connect(section: DeviceSection) -> Connection:
    """Open the connection a device config asks for (SSH connects here: errors come early)."""
    device = typed(DeviceConfig, section, where="device")
    if device.kind == "local":
        return LocalConnection(device.name)
    if device.kind == "ssh":
        if not device.host:
            raise DeviceError(f"device '{device.name}': kind ssh needs device.host")
        from jbench.device.ssh import SSHConnection

        conn = SSHConnection(
            device.name, device.host, port=int(device.port), user=device.user, key=device.key,
            known_hosts=device.known_hosts, accept_new_host_key=device.accept_new_host_key,
            connect_timeout=float(device.connect_timeout_s), keepalive_s=float(device.keepalive_s),
            jump=_jump_connection(device.jump, device) if device.jump else None,
            sudo_password_env=device.sudo_password_env,
        )
        return conn.open()
    raise DeviceError(f"device '{device.name}': kind '{device.kind}' is not supported. Valid kinds: local, ssh")
