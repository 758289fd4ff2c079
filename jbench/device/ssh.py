"""Devices over SSH (paramiko).

- Host keys are verified against known_hosts (the user's, or the device entry's own file). An
  unknown key is refused with its fingerprint; `device.accept_new_host_key=true` is the explicit
  opt-in that records it.
- Every command is an argument list quoted with shlex.join. A command with a timeout runs under
  `timeout --kill-after` on the device, so the remote process ends too, not only our wait.
  `timeout` exits 124, or 137 when the command needed the KILL after the grace; but a command the
  kernel killed (the OOM killer's SIGKILL) also exits 137, seconds into a long limit. The time the
  command took tells them apart: the device's `timeout` cannot fire before the limit, and the
  controller's clock, started before the command and read after its exit, runs at least as long.
  124/137 at or past the limit is a CommandTimeout; 137 before it is a command killed by SIGKILL
  and returned as a CommandResult whose stderr ends with the notice a shell prints for such a job
  (`Killed ...`), so the backends' shared out-of-memory rule (backends/base.py `looks_oom`) sees the
  kernel's kill over SSH as it does in a local shell.
- Nothing it starts outlives the controller. Every command with a timeout and every stream runs
  under a small POSIX-sh guard on the device (GUARD below): it starts the command in a session and
  process group of its own and, once a second while the command runs, checks that the SSH session
  that started it is still there. When the controller is interrupted (Ctrl-C, SIGTERM), killed
  (SIGKILL), or the connection drops, the guard ends the command's process group (TERM, KILL after
  a short grace) within a few seconds -- a non-pty exec channel gets no SIGHUP, and llama-bench
  writes nothing for minutes, so without it the command would run on to its timeout. A local
  Ctrl-C inside run() also sends the session a TERM and closes the connection at once.
- sudo: `sudo -n` (passwordless sudoers entries, the documented way), or, with
  `device.sudo_password_env`, the password from that environment variable is given ONCE per
  connection to `sudo -S -v` on an exec channel without a pty (no echo), on stdin only; every sudo
  command is then `sudo -n` on the credentials sudo caches for the connection's sshd process. It is
  validated again after a reconnect, when the last validation is older than ~4 minutes, and when
  `sudo -n` reports the cache expired. A device whose sudo does not keep credentials across
  commands (`timestamp_timeout=0`) gets `sudo -k -S` per command: -k makes sudo always read the
  password line, so it never reaches the command. The password never appears in a command line,
  a pty, a log, an exception, a param or an artifact. A wrong password is one DeviceError naming
  the environment variable.
"""

from __future__ import annotations

import base64
import logging
import select
import hashlib
import os
import shlex
import socket
import threading
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

import paramiko
from paramiko.common import cMSG_CHANNEL_REQUEST
from paramiko.message import Message

from jbench.device.connection import CommandResult, CommandTimeout, Connection, ConnectionLost, DeviceError
from jbench.device.tunnel import TunnelForwarder

# Grace the device's `timeout` gives a command after TERM before KILL, and our own extra wait.
_KILL_AFTER_S = 5
_LOCAL_GRACE_S = 15
# Exit codes of the device's `timeout` when it ended the command: 124 (TERM), 137 (the KILL after the grace).
_TIMEOUT_CODES = (124, 137)
_SIGKILL_CODE = 137  # 128 + SIGKILL: also what a command killed by the kernel (OOM killer) exits with

log = logging.getLogger("jbench.device.ssh")

# Validate the sudo credentials again when the last validation is older than this (sudo's default
# timestamp_timeout is 5 minutes), so a long sweep does not meet an expired cache.
SUDO_REFRESH_S = 240.0

# The guard every command with a timeout and every stream runs under on the device (POSIX sh; the
# command comes in as "$@", never pasted into the script, so no config value can inject shell).
# - `setsid` starts the command in a session and process group of its own ($c), so the guard can end
#   the whole tree (a wrapper, sudo, the tool's workers) with one kill of the group.
# - While the command runs, a watcher subshell checks once a second that the guard's parent and that
#   parent's parent are unchanged (/proc/PID/stat field 4): the sshd session process of this
#   connection, or sudo and the sshd session above it. A dropped connection or a killed controller
#   ends the sshd session process and the guard (or sudo) is re-parented to init or a subreaper:
#   the watcher then ends the group: TERM, KILL after 3 s. Without a pty nothing else would: no
#   SIGHUP, and a quiet command (llama-bench) gets no SIGPIPE until it writes.
# - HUP/INT/TERM to the guard (pty hang-up, an SSH "signal" request, sudo relaying one) end the group too.
# - A short command costs two forks: the guard `wait`s for the command and kills the watcher; there
#   is no sleep on that path. The watcher's fds are /dev/null, so it never holds the channel open.
# - A background job of a non-interactive sh gets /dev/null as stdin: stdin is passed through fd 3.
GUARD = r"""pp() { { read -r s < "/proc/$1/stat"; } 2>/dev/null || return 1; s=${s##*) }; set -- $s; echo "$2"; }
stop() {
  kill -TERM -- "-$c" 2>/dev/null || kill -TERM "$c" 2>/dev/null || return 0
  n=0; while [ $n -lt 30 ] && kill -0 -- "-$c" 2>/dev/null; do sleep 0.1; n=$((n+1)); done
  kill -KILL -- "-$c" 2>/dev/null; return 0
}
p=$PPID; g=$(pp "$p")
exec 3<&0
setsid "$@" <&3 3<&- &
c=$!
exec 3<&-
trap 'stop; exit 129' HUP; trap 'stop; exit 130' INT; trap 'stop; exit 143' TERM
( while kill -0 "$c" 2>/dev/null; do
    if [ "$(pp $$)" != "$p" ] || [ "$(pp "$p")" != "$g" ]; then stop; exit 0; fi
    sleep 1
  done ) </dev/null >/dev/null 2>&1 &
w=$!
wait "$c"; r=$?
kill "$w" 2>/dev/null
exit "$r"
"""
GUARD_NAME = "jbench-guard"  # the guard's $0 (what `ps` shows)

# sudo inside a pipeline (sudo_argv) in password mode: sudo's parent there is a shell of the pipeline,
# not the sshd session process, so the connection's cached credentials do not apply (sudo keys them by
# the parent process when there is no tty). -k makes sudo read the password line from stdin always
# (never handing it to the command); stream_lines sends it on stdin of a channel without a pty.
_PIPE_SUDO = ["sudo", "-k", "-S", "-p", "", "--"]


def _guarded(argv: list[str]) -> list[str]:
    return ["sh", "-c", GUARD, GUARD_NAME, *argv]


def _has_seq(argv: Sequence[str], seq: list[str]) -> bool:
    n = len(seq)
    return any(list(argv[i:i + n]) == seq for i in range(len(argv) - n + 1))


def _sudo_wants_password(res_code: int, out: str, err: str) -> bool:
    """`sudo -n` refused for lack of cached credentials (nothing ran: no stdout)."""
    return res_code == 1 and not out and "sudo: a password is required" in err


class HostKeyError(DeviceError):
    pass


def key_fingerprint(key: paramiko.PKey) -> str:
    """SHA256:... as `ssh-keygen -lf` prints it."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


# Where OpenSSH keeps the user's host keys; an accepted new key is recorded there unless the device entry
# names its own file (so a later changed key is refused, as `ssh` would).
DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"


class _VerifyPolicy(paramiko.MissingHostKeyPolicy):
    """Unknown host key: refuse (default) or record it when the user opted in."""

    def __init__(self, accept_new: bool, known_hosts: Path):
        self.accept_new = accept_new
        self.known_hosts = known_hosts

    def missing_host_key(self, client, hostname, key):
        fp = key_fingerprint(key)
        if not self.accept_new:
            raise HostKeyError(
                f"unknown host key for {hostname}: {key.get_name()} {fp}. Verify it on the device "
                f"(ssh-keygen -lf /etc/ssh/ssh_host_{key.get_name().replace('ssh-', '')}_key.pub), then add it to "
                f"known_hosts (ssh-keyscan / ssh once) or opt in with device.accept_new_host_key=true"
            )
        client.get_host_keys().add(hostname, key.get_name(), key)
        self.known_hosts.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(self.known_hosts, "a") as f:
            f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")


def _known_host_name(host: str, port: int) -> str:
    return host if port == 22 else f"[{host}]:{port}"


class SSHConnection(Connection):
    def __init__(
        self,
        name: str,
        host: str,
        *,
        port: int = 22,
        user: Optional[str] = None,
        key: Optional[str] = None,
        known_hosts: Optional[str] = None,
        accept_new_host_key: bool = False,
        connect_timeout: float = 10.0,
        keepalive_s: float = 15.0,
        jump: Optional["SSHConnection"] = None,
        sudo_password_env: Optional[str] = None,
    ):
        self.name = name
        self.host, self.port, self.user = host, port, user
        self.key = os.path.expanduser(key) if key else None
        self.known_hosts = Path(os.path.expanduser(known_hosts)) if known_hosts else None
        self.accept_new_host_key = accept_new_host_key
        self.connect_timeout = connect_timeout
        self.keepalive_s = keepalive_s
        self.jump = jump
        self.sudo_password_env = sudo_password_env
        self._client: Optional[paramiko.SSHClient] = None
        self._home: Optional[str] = None
        self._lock = threading.Lock()
        # sudo with a password: when this connection last validated sudo's credentials (monotonic), and
        # whether the device's sudo keeps them across commands at all (False: `sudo -k -S` per command).
        self._sudo_lock = threading.Lock()
        self._sudo_validated_at: Optional[float] = None
        self._sudo_caches = True

    # -- connection ------------------------------------------------------------------------------

    def _connect(self) -> paramiko.SSHClient:
        client = paramiko.SSHClient()
        if self.known_hosts is not None:
            if self.known_hosts.exists():
                client.load_host_keys(str(self.known_hosts))
        else:
            client.load_system_host_keys()
        record_in = self.known_hosts or Path(os.path.expanduser(DEFAULT_KNOWN_HOSTS))
        client.set_missing_host_key_policy(_VerifyPolicy(self.accept_new_host_key, record_in))
        sock = None
        if self.jump is not None:
            transport = self.jump.transport()
            try:
                sock = transport.open_channel("direct-tcpip", (self.host, self.port), ("127.0.0.1", 0),
                                              timeout=self.connect_timeout)
            except (paramiko.SSHException, OSError) as exc:
                raise DeviceError(f"device '{self.name}': jump host {self.jump.host} cannot reach {self.host}:{self.port}: {exc}") from None
        where = f"{self.user + '@' if self.user else ''}{self.host}:{self.port}"
        try:
            if sock is None:
                # Our own socket so TCP_NODELAY can be set: without it every channel open waits out
                # the peer's delayed ACK (~40 ms a command).
                sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client.connect(
                self.host, port=self.port, username=self.user, key_filename=self.key,
                allow_agent=True, look_for_keys=self.key is None, timeout=self.connect_timeout,
                banner_timeout=self.connect_timeout, auth_timeout=self.connect_timeout, sock=sock,
            )
        except HostKeyError:
            client.close()
            raise
        except paramiko.BadHostKeyException as exc:
            client.close()
            name = _known_host_name(self.host, self.port)
            where = self.known_hosts or Path(os.path.expanduser(DEFAULT_KNOWN_HOSTS))
            raise HostKeyError(
                f"device '{self.name}': the host key of {name} CHANGED: known_hosts has {exc.expected_key.get_name()} "
                f"{key_fingerprint(exc.expected_key)}, the server offers {exc.key.get_name()} {key_fingerprint(exc.key)}. "
                f"If the device was reinstalled, verify the new key on it, then remove the old entry with "
                f"`ssh-keygen -R '{name}' -f {where}` and connect again; otherwise someone may be intercepting the "
                f"connection") from None
        except paramiko.AuthenticationException as exc:
            client.close()
            raise DeviceError(f"device '{self.name}': SSH authentication to {where} failed ({exc}); check device.user and device.key or your ssh-agent") from None
        except (socket.timeout, TimeoutError):
            client.close()
            raise DeviceError(f"device '{self.name}': {where} did not answer within {self.connect_timeout:g} s (connect timeout); is it on and reachable?") from None
        except (OSError, paramiko.SSHException) as exc:
            client.close()
            raise DeviceError(f"device '{self.name}': cannot connect to {where}: {exc}") from None
        transport = client.get_transport()
        assert transport is not None
        transport.set_keepalive(int(self.keepalive_s))
        return client

    def transport(self) -> paramiko.Transport:
        with self._lock:
            if self._client is None or not self._client.get_transport() or not self._client.get_transport().is_active():
                if self._client is not None:
                    self._client.close()
                self._client = self._connect()
                self._sudo_validated_at = None  # a new connection: sudo's credential cache is not ours yet
            return self._client.get_transport()

    def put_file(self, local: str, remote: str) -> None:
        """SFTP over this connection's own transport (host key already verified)."""
        try:
            sftp = paramiko.SFTPClient.from_transport(self.transport())
            try:
                sftp.put(local, self.expand_path(remote))
            finally:
                sftp.close()
        except (OSError, paramiko.SSHException) as exc:
            raise DeviceError(f"copying {local} to {self.name}:{remote} failed: {exc}") from None

    def forward_port(self, remote_port: int, remote_host: str = "127.0.0.1") -> TunnelForwarder:
        return TunnelForwarder(self.transport(), remote_port, remote_host)

    def open(self) -> "SSHConnection":
        self.transport()
        return self

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
            self._sudo_validated_at = None

    def reconnect(self, deadline_s: float, interval_s: float = 2.0) -> None:
        """Wait (bounded) for the device to accept SSH again, e.g. after a reboot."""
        self.close()
        end = time.monotonic() + deadline_s
        last: Optional[Exception] = None
        while time.monotonic() < end:
            try:
                self.transport()
                self._home = None
                return
            except HostKeyError:
                raise
            except DeviceError as exc:
                last = exc
                time.sleep(interval_s)
        raise DeviceError(f"device '{self.name}' did not come back within {deadline_s:g} s: {last}")

    # -- commands -------------------------------------------------------------------------------

    def command_line(self, argv: Sequence[str], *, timeout: Optional[float] = None, sudo: bool = False,
                     env: Optional[dict[str, str]] = None, cwd: Optional[str] = None, stream: bool = False) -> str:
        """The exact remote command line for argv (quoted; no config value can break out).

        A command with a timeout, and a stream, runs under the guard (GUARD): `sh -c GUARD jbench-guard
        timeout --kill-after=5 T ARGV`. sudo without a password: `timeout ... sudo -n -- ARGV` inside the
        guard (the sudoers entry then needs only the tools themselves, not `timeout`). sudo with a password: `sudo -n -- sh -c GUARD ...`, sudo outermost and exec'd by the login
        shell, so its parent is this connection's sshd process, which sudo's credential cache is keyed
        by (`sudo -k -S -p ''` instead when the device's sudo does not cache). Never contains the password."""
        argv = [str(a) for a in argv]
        if env:
            argv = ["env", *[f"{k}={v}" for k, v in env.items()], *argv]
        limit: list[str] = []
        if timeout is not None:
            limit = ["timeout", f"--kill-after={_KILL_AFTER_S}", f"{timeout:g}"]
        elif stream:
            limit = ["timeout", f"--kill-after={_KILL_AFTER_S}", "0"]  # 0: no time limit
        password = sudo and self._password_mode()
        if sudo and not password:
            argv = [*limit, "sudo", "-n", "--", *argv]
            if limit:
                argv = _guarded(argv)
        else:
            if limit:
                argv = _guarded([*limit, *argv])
            if password:
                argv = [*self._sudo_prefix(), *argv]
        line = shlex.join(argv)
        if cwd:
            line = f"cd {shlex.quote(cwd)} && exec {line}"
        elif limit or sudo:
            line = "exec " + line  # the guard / sudo is the session's process itself
        return line

    # -- sudo ------------------------------------------------------------------------------------

    def _password_mode(self) -> bool:
        return self._sudo_password() is not None

    def _sudo_password(self) -> Optional[str]:
        if not self.sudo_password_env:
            return None
        return os.environ.get(self.sudo_password_env) or None

    def _sudo_prefix(self) -> list[str]:
        return ["sudo", "-n", "--"] if self._sudo_caches else list(_PIPE_SUDO)

    def _scrub(self, text: str) -> str:
        pw = self._sudo_password()
        return text.replace(pw, "***") if pw else text

    def _exec(self, line: str, feed: str, deadline_s: Optional[float]) -> tuple[int, str, str]:
        """Run one line on an exec channel without a pty, feed stdin, collect (code, out, err).
        A local interrupt (Ctrl-C) ends the remote command before it propagates."""
        chan = self.transport().open_session()
        try:
            chan.exec_command(line)
            if feed:
                chan.sendall(feed.encode())
            chan.shutdown_write()
            out, err = _drain(chan, deadline_s)
            code = chan.recv_exit_status() if chan.exit_status_ready() else -1
        except BaseException as exc:
            if not isinstance(exc, (Exception,)):  # KeyboardInterrupt, SystemExit
                self._abort(chan)
            else:
                chan.close()
            raise
        return code, out, err

    def _abort(self, chan: paramiko.Channel) -> None:
        """End a running remote command now: TERM to its session (an SSH "signal" request, which the
        guard or sudo relays to the command's group), close the channel, and close the connection, so the
        guard also sees its sshd session end on servers without "signal" support (OpenSSH < 7.9). The
        next command reconnects."""
        _send_signal(chan, "TERM")
        try:
            chan.close()
        except Exception:
            pass
        try:
            self.close()
        except Exception:
            pass

    def validate_sudo(self, *, force: bool = False) -> None:
        """Give sudo the password once for this connection (`sudo -S -v -p ''`, stdin only, no pty).

        No-op without device.sudo_password_env, or when this connection validated less than
        SUDO_REFRESH_S ago (unless force). Raises DeviceError naming the variable when sudo refuses it."""
        password = self._sudo_password()
        if password is None:
            return
        with self._sudo_lock:
            self.transport()  # a reconnect resets _sudo_validated_at
            at = self._sudo_validated_at
            if not force and at is not None and time.monotonic() - at < SUDO_REFRESH_S:
                return
            try:
                code, out, err = self._exec("sudo -S -v -p ''", password + "\n", 60)
            except _LocalDeadline:
                raise DeviceError(f"device '{self.name}': `sudo -v` did not answer within 60 s") from None
            except (paramiko.SSHException, EOFError, OSError) as exc:
                raise ConnectionLost(f"lost the SSH connection to '{self.name}' while validating sudo: "
                                     f"{self._scrub(str(exc)) or type(exc).__name__}") from None
            if code != 0:
                detail = self._scrub((err or out).strip().splitlines()[-1] if (err or out).strip() else f"exit {code}")
                raise DeviceError(
                    f"device '{self.name}': sudo refused the password from the environment variable "
                    f"{self.sudo_password_env} (device.sudo_password_env): {detail}. Check the password, or use a "
                    f"passwordless sudoers entry instead")
            self._sudo_validated_at = time.monotonic()

    # -- commands -------------------------------------------------------------------------------

    def run(self, argv, *, timeout=None, env=None, cwd=None, sudo: bool = False, stdin: Optional[str] = None) -> CommandResult:
        argv = [str(a) for a in argv]
        password = sudo and self._password_mode()
        started = time.monotonic()
        attempts = 2 if password else 1
        for attempt in range(attempts):
            if password:
                self.validate_sudo(force=attempt > 0)
            line = self.command_line(argv, timeout=timeout, sudo=sudo, env=env, cwd=cwd)
            feed = stdin or ""
            if password and not self._sudo_caches:
                feed = self._sudo_password() + "\n" + feed  # read by `sudo -k -S` itself, never by the command
            began = time.monotonic()
            try:
                code, out, err = self._exec(line, feed, None if timeout is None else timeout + _KILL_AFTER_S + _LOCAL_GRACE_S)
                took = time.monotonic() - began
            except _LocalDeadline:
                raise CommandTimeout(f"{shlex.join(argv)} on '{self.name}' did not finish within {timeout:g} s") from None
            except (paramiko.SSHException, EOFError, OSError) as exc:
                raise ConnectionLost(f"lost the SSH connection to '{self.name}' while running {argv[0]}: "
                                     f"{self._scrub(str(exc)) or type(exc).__name__}") from None
            if password and self._sudo_caches and _sudo_wants_password(code, out, err):
                if attempt == 0:
                    continue  # the cache expired (or another connection's): validate again, once
                # A fresh validation did not help: this sudo keeps no credentials between commands.
                log.info("device '%s': sudo keeps no credentials between commands; the password goes to "
                         "`sudo -k -S` on each command's stdin from now on", self.name)
                self._sudo_caches = False
                return self.run(argv, timeout=timeout, env=env, cwd=cwd, sudo=sudo, stdin=stdin)
            break
        if code == -1:
            raise ConnectionLost(f"lost the SSH connection to '{self.name}' while running {argv[0]} (no exit status)")
        if timeout is not None and code in _TIMEOUT_CODES:
            if took >= timeout:
                raise CommandTimeout(f"{shlex.join(argv)} on '{self.name}' did not finish within {timeout:g} s (ended on the device)")
            if code == _SIGKILL_CODE:
                err = killed_notice(err, took, timeout)
        return CommandResult(argv, code, out, err, time.monotonic() - started)

    def sudo_argv(self, argv: Sequence[str]) -> list[str]:
        """argv through sudo for use inside a pipeline. With a password: `sudo -k -S -p ''`, whose password
        stream_lines sends on stdin (sudo's parent there is a pipeline shell, so the connection's cached
        credentials do not apply; -k: sudo always reads the password itself)."""
        argv = [str(a) for a in argv]
        if self._password_mode():
            self.validate_sudo()  # a wrong password fails here, with the clear message
            return [*_PIPE_SUDO, *argv]
        return ["sudo", "-n", "--", *argv]

    def stream_lines(self, argv: Sequence[str], *, sudo: bool = False) -> "RemoteStream":
        """Start a long-running command (under the guard) and iterate its output lines (tegrastats).

        Without sudo the channel has a pty (its hang-up also ends the command when the channel closes).
        With sudo (sudo=True, or sudo_argv inside argv) it has none: real sudo keys cached credentials by
        tty, so a pty would not see this connection's; and nothing is ever written into a pty. stderr is
        merged into the lines either way."""
        argv = [str(a) for a in argv]
        password = self._sudo_password()
        if sudo and password is not None:
            self.validate_sudo()
        feed = ""
        if password is not None and ((sudo and not self._sudo_caches) or _has_seq(argv, _PIPE_SUDO)):
            feed = password + "\n"
        uses_sudo = sudo or _has_seq(argv, ["sudo", "-n", "--"]) or _has_seq(argv, _PIPE_SUDO)
        chan = self.transport().open_session()
        try:
            if uses_sudo:
                chan.set_combine_stderr(True)
            else:
                chan.get_pty(width=1000)
            chan.exec_command(self.command_line(argv, sudo=sudo, stream=True))
            if feed:
                chan.sendall(feed.encode())
            if uses_sudo:
                chan.shutdown_write()
        except BaseException:
            chan.close()
            raise
        return RemoteStream(chan)

    def exists(self, path: str) -> bool:
        return self.run(["test", "-e", self.expand_path(path)], timeout=30).returncode == 0

    def expand_path(self, path: str) -> str:
        if path == "~" or path.startswith("~/"):
            if self._home is None:
                res = self.run(["sh", "-c", 'printf %s "$HOME"'], timeout=30)
                self._home = res.stdout.strip() or "/"
            return self._home + path[1:]
        return path


class _LocalDeadline(Exception):
    pass


def killed_notice(stderr: str, took_s: float, limit_s: float) -> str:
    """stderr of a command that exited 137 (SIGKILL) after took_s, before its limit_s time limit, with the
    notice a shell prints for a job killed by SIGKILL appended as its own last line. The device's `timeout`
    did not end it (it cannot before the limit): something on the device did, the kernel's OOM killer above all."""
    sep = "" if not stderr or stderr.endswith("\n") else "\n"
    return (f"{stderr}{sep}Killed (SIGKILL on the device after {took_s:.1f} s, before the {limit_s:g} s time limit: "
            f"not a timeout)\n")


def _send_signal(chan: paramiko.Channel, name: str) -> None:
    """An SSH "signal" request (RFC 4254 6.9; OpenSSH >= 7.9 sends it to the session's process group).
    paramiko has no public call for it. Best effort: no reply is awaited."""
    try:
        if chan.closed or chan.transport is None or not chan.transport.is_active():
            return
        m = Message()
        m.add_byte(cMSG_CHANNEL_REQUEST)
        m.add_int(chan.remote_chanid)
        m.add_string("signal")
        m.add_boolean(False)
        m.add_string(name)
        chan.transport._send_user_message(m)
    except Exception:
        pass


def _drain(chan: paramiko.Channel, deadline_s: Optional[float]) -> tuple[str, str]:
    """Read stdout and stderr until the command has exited and both streams are drained.

    Waits with select() on the channel (woken by data and by close), not by polling with sleeps:
    a short command costs one network round trip, not a sleep interval."""
    out, err = bytearray(), bytearray()
    end = None if deadline_s is None else time.monotonic() + deadline_s
    while True:
        if chan.recv_ready():
            out += chan.recv(65536)
            continue
        if chan.recv_stderr_ready():
            err += chan.recv_stderr(65536)
            continue
        if chan.exit_status_ready() and (chan.eof_received or chan.closed):
            break
        if end is not None and time.monotonic() > end:
            chan.close()
            raise _LocalDeadline()
        transport = chan.get_transport()
        if transport is None or not transport.is_active():
            raise EOFError("transport closed")
        select.select([chan], [], [], 0.2)
    return out.decode(errors="replace"), err.decode(errors="replace")


class RemoteStream:
    """Lines of a long-running remote command; close() ends it on the device."""

    def __init__(self, chan: paramiko.Channel):
        self.chan = chan
        self._buf = b""

    def __iter__(self) -> Iterator[str]:
        self.chan.settimeout(None)
        while True:
            try:
                data = self.chan.recv(65536)
            except (OSError, paramiko.SSHException):
                data = b""
            if not data:
                if self._buf:
                    yield self._buf.decode(errors="replace").rstrip("\r")
                return
            self._buf += data
            *lines, self._buf = self._buf.split(b"\n")
            for line in lines:
                yield line.decode(errors="replace").rstrip("\r")

    def close(self) -> None:
        _send_signal(self.chan, "TERM")  # the guard ends the command's group (no pty: no hang-up)
        try:
            self.chan.close()
        except Exception:  # closing a dead channel is not an error worth reporting
            pass
