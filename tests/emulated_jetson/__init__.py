"""Emulated Jetson devices for tests: a real OpenSSH sshd per device plus fake Jetson tools.

Test-only; product code never imports this. Pytest fixtures are in `tests.emulated_jetson.fixtures`
(`pytest_plugins = ["tests.emulated_jetson.fixtures"]`). Plain use:

    from tests.emulated_jetson import EmulatedJetson
    with EmulatedJetson.start("orin_nano") as emu:
        print(emu.run("nvpmodel -q").stdout)

Each device gets its own loopback address (127.0.0.2, 127.0.0.3, ... -- Linux routes all of 127/8 to lo), a
free port, its own host key, client key pair, known_hosts file and state directory. Its sshd runs the login
user's shell with PATH=<fake tools>:... and JETSON_EMU_STATE/HOME set through `environment=` options of the
authorized_keys line (sshd: PermitUserEnvironment). A supervisor process (supervisor.py) owns the sshd and
emulates reboots, connection refusal and dropped connections.

Needs: /usr/sbin/sshd, ssh-keygen and (for the tests) the ssh client -- Debian/Ubuntu packages
`openssh-server` and `openssh-client`; python3 on the machine (the fake tools use only the standard library).
"""

from __future__ import annotations

import atexit
import fcntl
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence

from . import emu_profiles, emu_state

sys.path.insert(0, str(Path(__file__).resolve().parent))  # emu_sysfs imports its siblings as top-level modules
import emu_sysfs  # noqa: E402

__all__ = ["EmulatedJetson", "EmulatorError", "MODULES", "PRODUCT_PROFILES", "jtop_venv", "next_loopback_address"]

PACKAGE_DIR = Path(__file__).resolve().parent
BIN_DIR = PACKAGE_DIR / "bin"
SUPERVISOR = PACKAGE_DIR / "supervisor.py"
SSHD = "/usr/sbin/sshd"

MODULES = tuple(sorted(emu_profiles.PROFILES))
# jbench profile names (conf/profile/*.yaml) of the emulated modules
PRODUCT_PROFILES = {"orin_nano": "orin_nano_8gb", "orin_nano_super": "orin_nano_super",
                    "orin_nano_super_r39": "orin_nano_super", "agx_orin": "agx_orin_64gb", "thor": "thor"}

_address_lock = threading.Lock()
_address_counter = 0
_running: "List[EmulatedJetson]" = []


class EmulatorError(RuntimeError):
    pass


_serials = itertools.count(1)


def _next_serial() -> str:
    """A serial number of its own for each emulated unit: 13 digits like a Jetson devkit's label (emulator
    assumption on the format); the pid keeps units of concurrent test processes apart."""
    return f"14{os.getpid() % 1000000:06d}{next(_serials):05d}"


def _worker_slot() -> tuple[int, int]:
    """(this process's slot, the number of slots): (n, N) in pytest-xdist worker gw<n> of N, else (0, 1)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker[:2] == "gw" and worker[2:].isdigit() and count.isdigit() and int(worker[2:]) < int(count):
        return int(worker[2:]), int(count)
    return 0, 1


def next_loopback_address() -> str:
    """127.0.0.2, 127.0.0.3, ... 127.0.0.254, 127.0.1.2, ... (one per emulated device in this process). The N
    workers of a pytest-xdist run take every Nth of them (gw0 127.0.0.2, gw1 127.0.0.3, ...), so parallel workers
    never share an address (a rebooting device's port stays its own)."""
    global _address_counter
    with _address_lock:
        n = _address_counter
        _address_counter += 1
    slot, slots = _worker_slot()
    third, fourth = divmod(n * slots + slot, 253)
    return f"127.0.{third % 250}.{fourth + 2}" if third else f"127.0.0.{fourth + 2}"


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _run(argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, check=True, **kw)


def _keygen(path: Path, comment: str) -> None:
    _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)])


def _python3_for_tools() -> str:
    """A real python3 interpreter for the fake tools' `#!/usr/bin/env python3` (stdlib only)."""
    real = os.path.realpath(sys.executable)
    if os.path.basename(real).startswith("python3") and os.access(real, os.X_OK):
        return real
    found = shutil.which("python3")
    if not found:
        raise EmulatorError("no python3 interpreter for the fake Jetson tools")
    return os.path.realpath(found)


def _banner_ok(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            return sock.recv(64).startswith(b"SSH-")
    except OSError:
        return False


def _refused(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def _kill_pids(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class EmulatedJetson:
    """One emulated Jetson reachable over real SSH. Create with `EmulatedJetson.start(module)`.

    Connection attributes: host, port, user, key_path (client private key), public_key_path, known_hosts_path
    (holds `[host]:port ssh-ed25519 ...`), host_key_line, host_public_key, host_key_fingerprint ("SHA256:...").
    Device attributes: module, profile (dict from emu_profiles), title, l4t, jetpack, product_profile, modes,
    default_mode, state_dir, home, root_home, bin_dir, nvpmodel_conf_path, device_tree_model_path,
    nv_tegra_release_path, boot_id_path, nvpmodel_status_path, gpu_railgate_path, commands_log_path, sshd_log_path,
    base_dir, serial (the unit's serial number, distinct per emulated unit), serial_number_path.
    """

    def __init__(self, module: str, base_dir: Path, host: str, port: int, owns_base_dir: bool) -> None:
        self.profile = emu_profiles.profile(module)
        self.module: str = self.profile["key"]
        self.title: str = self.profile["title"]
        self.l4t: str = self.profile["l4t"]
        self.jetpack: str = self.profile["jetpack"]
        self.product_profile: str = PRODUCT_PROFILES.get(self.module, self.module)
        self.modes: List[Dict[str, Any]] = [dict(m) for m in self.profile["modes"]]
        self.default_mode: int = self.profile["default_mode"]
        self.base_dir = Path(base_dir)
        self.host = host
        self.port = port
        self.user = _current_user()
        self._owns_base_dir = owns_base_dir
        self.bin_dir = BIN_DIR
        sshd_dir, client_dir = self.base_dir / "sshd", self.base_dir / "client"
        self.ctl_dir = self.base_dir / "ctl"
        self.state_dir = self.base_dir / "state"
        self.pybin_dir = self.base_dir / "pybin"
        self.home = self.state_dir / "home"
        self.root_home = self.state_dir / "root_home"
        self.sshd_config_path = sshd_dir / "sshd_config"
        self.host_key_path = sshd_dir / "ssh_host_ed25519_key"
        self.authorized_keys_path = sshd_dir / "authorized_keys"
        self.sshd_pid_path = sshd_dir / "sshd.pid"
        self.sshd_log_path = sshd_dir / "sshd.log"
        self.key_path = client_dir / "id_ed25519"
        self.public_key_path = client_dir / "id_ed25519.pub"
        self.known_hosts_path = client_dir / "known_hosts"
        self.nvpmodel_conf_path = self.state_dir / "nvpmodel.conf"
        self.device_tree_model_path = self.state_dir / "device-tree-model"
        # /sys/firmware/devicetree/base/serial-number analogue (jetson-stats reads the serial there)
        self.serial_number_path = self.state_dir / "serial-number"
        self.serial = ""
        self.nv_tegra_release_path = self.state_dir / "nv_tegra_release"
        self.boot_id_path = self.state_dir / "boot_id"
        self.nvpmodel_status_path = self.state_dir / "nvpmodel_status"
        # /sys/devices/platform/gpu.0/railgate_enable analogue ("1\n" railgating on, "0\n" after jetson_clocks)
        self.gpu_railgate_path = self.state_dir / emu_state.RAILGATE_FILE
        self.commands_log_path = self.state_dir / "commands.log"
        self.supervisor_log_path = self.ctl_dir / "supervisor.log"
        self.path_env = f"{BIN_DIR}:{self.pybin_dir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        self.host_public_key = ""
        self.host_key_line = ""
        self.host_key_fingerprint = ""
        self._supervisor: Optional[subprocess.Popen] = None
        self._stopped = False
        self.real_paths = False
        self.jtop_venv: Optional[Path] = None
        self.tree: "Optional[emu_sysfs.Tree]" = None

    # ------------------------------------------------------------------------------------------ start
    @classmethod
    def start(cls, module: str = "orin_nano", base_dir: Optional[os.PathLike] = None, *, host: Optional[str] = None,
              reboot_delay_s: float = 3.0, reboot_grace_s: float = 0.5, sudo_password: Optional[str] = None,
              nvpmodel_mode: Optional[int] = None, clocks_locked: bool = False, login_is_root: bool = False,
              sudo_timestamp_timeout_s: float = 900.0, start_timeout_s: float = 15.0, real_paths: bool = False,
              jtop: bool = False, serial: Optional[str] = None) -> "EmulatedJetson":
        """Create the device's files, start its supervisor+sshd and wait (bounded) until sshd accepts connections.

        real_paths=True: the device's files at their real paths (/sys, /run, /etc, ...) in the mount namespace of its
        sshd (root only: EmulatorError otherwise). jtop=True (implies real_paths): the real jetson-stats service runs
        in it (`jtop_venv()`), and the login PATH's python3 is that venv's interpreter."""
        if jtop:
            real_paths = True
        if real_paths and os.geteuid() != 0:
            raise EmulatorError("real_paths needs root (mount namespaces and bind mounts)")
        owns = base_dir is None
        base = Path(tempfile.mkdtemp(prefix=f"emu-{module}-")) if owns else Path(base_dir)
        host = host or next_loopback_address()
        emu = cls(module, base, host, _free_port(host), owns)
        emu.real_paths, emu.jtop_venv = real_paths, (jtop_venv() if jtop else None)
        emu.serial = serial or _next_serial()
        try:
            emu._prepare(reboot_delay_s=reboot_delay_s, reboot_grace_s=reboot_grace_s, sudo_password=sudo_password,
                         nvpmodel_mode=nvpmodel_mode, clocks_locked=clocks_locked, login_is_root=login_is_root,
                         sudo_timestamp_timeout_s=sudo_timestamp_timeout_s)
            emu._launch(start_timeout_s)
        except BaseException:
            emu.stop()
            raise
        return emu

    def _prepare(self, **initial: Any) -> None:
        for path in (self.sshd_config_path.parent, self.key_path.parent, self.ctl_dir, self.state_dir,
                     self.pybin_dir, self.home, self.root_home):
            path.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
        if self.jtop_venv:  # the login PATH's python3 is the jtop venv's (a link would not find its pyvenv.cfg)
            wrapper = self.pybin_dir / "python3"
            wrapper.write_text(f'#!/bin/sh\nexec "{self.jtop_venv}/bin/python3" "$@"\n')
            wrapper.chmod(0o755)
        else:
            os.symlink(_python3_for_tools(), self.pybin_dir / "python3")
        _keygen(self.host_key_path, f"emulated-{self.module}-host")
        _keygen(self.key_path, f"emulated-{self.module}-client")
        self.host_public_key = " ".join(Path(f"{self.host_key_path}.pub").read_text().split()[:2])
        self.host_key_line = f"[{self.host}]:{self.port} {self.host_public_key}"
        self.known_hosts_path.write_text(self.host_key_line + "\n")
        self.host_key_fingerprint = _run(["ssh-keygen", "-lf", f"{self.host_key_path}.pub"]).stdout.split()[1]
        options = ",".join(f'environment="{name}={value}"' for name, value in (
            ("PATH", self.path_env), ("HOME", self.home), (emu_state.STATE_ENV, self.state_dir)))
        self.authorized_keys_path.write_text(f"{options} {self.public_key_path.read_text().strip()}\n")
        self.sshd_config_path.write_text("\n".join([
            "# sshd of an emulated Jetson (tests/emulated_jetson)",
            f"ListenAddress {self.host}:{self.port}",
            f"HostKey {self.host_key_path}",
            f"PidFile {self.sshd_pid_path}",
            f"AuthorizedKeysFile {self.authorized_keys_path}",
            f"AllowUsers {self.user}",
            "StrictModes no",
            "UsePAM no",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PermitUserEnvironment PATH,HOME,JETSON_EMU_*",
            "UseDNS no",
            "PrintMotd no",
            "PrintLastLog no",
            "X11Forwarding no",
            "MaxStartups 64:30:128",
            "MaxSessions 32",
            "LogLevel VERBOSE",
            f"Subsystem sftp internal-sftp -d {self.home}",  # sftp starts in the session's $HOME
            "",
        ]))
        (self.home / ".bashrc").write_text(
            "# login shell rc of an emulated Jetson (tests/emulated_jetson): start in $HOME like a real login\n"
            'cd "$HOME" 2>/dev/null || true\n')
        (self.root_home / ".bashrc").write_text("")
        prof = self.profile
        self.device_tree_model_path.write_bytes(prof["device_tree_model"].encode() + b"\0")  # real file ends in NUL
        self.serial_number_path.write_bytes(self.serial.encode() + b"\0")  # a device-tree string: NUL-terminated
        self.nv_tegra_release_path.write_text(prof["nv_tegra_release"])
        self.nvpmodel_conf_path.write_text(emu_profiles.nvpmodel_conf_text(prof))
        boot_id = str(uuid.uuid4())
        self.boot_id_path.write_text(boot_id + "\n")
        mode = initial["nvpmodel_mode"] if initial["nvpmodel_mode"] is not None else prof["default_mode"]
        emu_profiles.mode_by_id(prof, mode)
        self.nvpmodel_status_path.write_text(f"pmode:{mode:04d} fmode:fan_mode_quiet\n")
        state = dict(emu_state.DEFAULT_STATE)
        state.update({
            "module": self.module, "nvpmodel_mode": mode, "clocks_locked": initial["clocks_locked"],
            "sudo_password": initial["sudo_password"], "login_is_root": initial["login_is_root"],
            "hostname": prof["hostname"], "reboot_delay_s": initial["reboot_delay_s"],
            "reboot_grace_s": initial["reboot_grace_s"], "boot_time": time.time(), "events": [],
            "sudo_timestamp_timeout_s": float(initial["sudo_timestamp_timeout_s"]),
        })
        emu_state.normalize(state)
        emu_state.write_text_atomic(str(self.state_dir / emu_state.STATE_FILE), json.dumps(state, indent=1) + "\n")
        self.gpu_railgate_path.write_text(f"{state['gpu_railgate_enable']}\n")
        if self.real_paths:
            self.tree = emu_sysfs.Tree(str(self.base_dir), prof, serial=self.serial)
            if self.jtop_venv:
                self.tree.base_prefix = subprocess.run(
                    [str(self.jtop_venv / "bin" / "python3"), "-c", "import sys; print(sys.base_prefix)"],
                    capture_output=True, text=True, check=True).stdout.strip()
            self.tree.build()
            self.tree.link_tool("jetson_clocks", str(BIN_DIR / "jetson_clocks"))
            (self.ctl_dir / "mounts.json").write_text(json.dumps(self.tree.mounts(), indent=1) + "\n")
        check = subprocess.run([SSHD, "-t", "-f", str(self.sshd_config_path)], capture_output=True, text=True)
        if check.returncode != 0:
            raise EmulatorError(f"sshd rejected the emulated device's config: {check.stderr.strip()}")

    def _launch(self, timeout: float) -> None:
        cfg = {"state_dir": str(self.state_dir), "ctl_dir": str(self.ctl_dir), "host": self.host, "port": self.port,
               "sshd_log": str(self.sshd_log_path),
               "sshd_cmd": [SSHD, "-D", "-e", "-f", str(self.sshd_config_path)]}
        if self.real_paths:
            # sshd in its own mount namespace where emu_ns.py mounted the device's files at the real paths
            cfg["sshd_cmd"] = ["unshare", "--mount", "--propagation", "private", "--", _python3_for_tools(),
                               str(PACKAGE_DIR / "emu_ns.py"), str(self.ctl_dir / "mounts.json"), "--",
                               *cfg["sshd_cmd"]]
            services = [[str(self.jtop_venv / "bin" / "jtop"), "--force"]] if self.jtop_venv else []
            cfg["real_paths"] = {
                "base_dir": str(self.base_dir), "module": self.module, "services": services,
                # jtop.service: Environment="JTOP_SERVICE=True", as root; the fake tools need the device's state
                "service_env": {"PATH": self.path_env, "HOME": str(self.root_home), "JTOP_SERVICE": "True",
                                emu_state.STATE_ENV: str(self.state_dir), emu_state.ROOT_ENV: "1",
                                emu_state.SERVICE_ENV: "1", "LANG": "C.UTF-8"}}
        cfg_path = self.ctl_dir / "supervisor.json"
        cfg_path.write_text(json.dumps(cfg, indent=1) + "\n")
        with open(self.ctl_dir / "supervisor.out", "ab") as out:
            self._supervisor = subprocess.Popen([sys.executable, str(SUPERVISOR), str(cfg_path)],
                                                stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                                start_new_session=True)
        _running.append(self)
        try:
            self.wait_until_up(timeout)
            if self.jtop_venv:  # a real device's jtop.service is up before anyone logs in: wait for its socket
                sock = Path(self.tree.p("/run/jtop.sock"))
                deadline = time.monotonic() + max(timeout, 30.0)
                while not sock.exists():
                    if time.monotonic() > deadline:
                        raise EmulatorError(f"{self!r}: the jtop service did not open /run/jtop.sock; its log:\n"
                                            + self._tail(self.ctl_dir / "service-jtop.log"))
                    time.sleep(0.1)
        except EmulatorError as exc:
            raise EmulatorError(f"{exc}\n--- sshd log ---\n{self._tail(self.sshd_log_path)}"
                                f"\n--- supervisor log ---\n{self._tail(self.supervisor_log_path)}") from None

    @staticmethod
    def _tail(path: Path, n: int = 30) -> str:
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(none)"

    # ------------------------------------------------------------------------------------------- stop
    def stop(self) -> None:
        """Stop supervisor, sshd and every process of this device (terminate, then kill). Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        sup = self._supervisor
        if sup is not None and sup.poll() is None:
            sup.send_signal(signal.SIGTERM)
            try:
                sup.wait(timeout=5)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(sup.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                sup.kill()
                sup.wait(timeout=5)
        # safety net: anything still carrying this device's state dir or sshd config (e.g. after a supervisor crash)
        leftovers = self.processes()
        if leftovers:
            _kill_pids(leftovers, signal.SIGTERM)
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline and self.processes():
                time.sleep(0.05)
            _kill_pids(self.processes(), signal.SIGKILL)
        if self in _running:
            _running.remove(self)
        if self._owns_base_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def processes(self) -> List[int]:
        """Pids of live processes belonging to this device: its supervisor and everything below it (sshd,
        sessions, commands), plus any process carrying its JETSON_EMU_STATE or its sshd_config path."""
        state, cfg = str(self.state_dir), str(self.sshd_config_path)
        own = os.getpid()
        found = set()
        sup = self._supervisor
        if sup is not None and sup.poll() is None:
            found.add(sup.pid)
            found.update(emu_state.descendants(sup.pid))
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == own:
                continue
            pid = int(entry)
            argv = emu_state.proc_cmdline(pid)
            if not argv:
                continue
            if cfg in " ".join(argv) or emu_state.proc_env_value(pid, emu_state.STATE_ENV) == state:
                found.add(pid)
        return sorted(p for p in found if os.path.exists(f"/proc/{p}"))

    def __enter__(self) -> "EmulatedJetson":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<EmulatedJetson {self.module} {self.user}@{self.host}:{self.port}>"

    # -------------------------------------------------------------------------------------- liveness
    def status(self) -> Dict[str, Any]:
        try:
            return json.loads((self.ctl_dir / "status.json").read_text())
        except (OSError, ValueError):
            return {}

    def accepts_connections(self) -> bool:
        return _banner_ok(self.host, self.port)

    def wait_until_up(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._supervisor is not None and self._supervisor.poll() is not None:
                raise EmulatorError(f"supervisor of {self!r} exited with {self._supervisor.returncode}")
            st = self.status()
            if st.get("up") and not st.get("rebooting") and self.accepts_connections():
                return
            time.sleep(0.05)
        raise EmulatorError(f"{self!r}: sshd did not accept connections within {timeout} s")

    def wait_until_down(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if _refused(self.host, self.port):
                return
            time.sleep(0.02)
        raise EmulatorError(f"{self!r}: still accepting connections after {timeout} s")

    def wait_for_boot(self, after_boot_count: int, timeout: float = 20.0) -> None:
        """Wait until an emulated reboot that started after `after_boot_count` boots is over and sshd is up."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.boot_count > after_boot_count and not (self.state_dir / emu_state.REBOOT_REQUEST).exists():
                self.wait_until_up(max(0.1, deadline - time.monotonic()))
                return
            time.sleep(0.05)
        raise EmulatorError(f"{self!r}: no reboot completed within {timeout} s")

    # ---------------------------------------------------------------------------------------- state
    @property
    def state(self) -> Dict[str, Any]:
        return emu_state.load(str(self.state_dir))

    def set_state(self, **changes: Any) -> Dict[str, Any]:
        unknown = set(changes) - set(emu_state.DEFAULT_STATE)
        if unknown:
            raise KeyError(f"unknown emulated-Jetson state keys: {sorted(unknown)}")
        return emu_state.update(str(self.state_dir), changes)

    @property
    def nvpmodel_mode(self) -> int:
        return self.state["nvpmodel_mode"]

    @property
    def nvpmodel_mode_name(self) -> str:
        return emu_profiles.mode_by_id(self.profile, self.nvpmodel_mode)["name"]

    @property
    def nvpmodel_pending(self) -> Optional[int]:
        return self.state["nvpmodel_pending"]

    @property
    def clocks_locked(self) -> bool:
        """True when everything a plain `jetson_clocks` locks is locked (CPU, GPU, EMC, cpuidle, railgate)."""
        return emu_state.all_locked(self.state)

    @property
    def clocks_unlocked(self) -> bool:
        """True when nothing of jetson_clocks is left (no lock, cpuidle on, railgating on, fan under nvfancontrol)."""
        return emu_state.none_locked(self.state)

    def clock_state(self) -> Dict[str, Any]:
        """The device's jetson_clocks/nvpmodel state: {cpu_locked, gpu_locked, emc_locked, cpuidle_disabled,
        railgate_enabled, nvfancontrol_active, fan_pwm (None: nvfancontrol's), all_locked, none_locked, mode,
        mode_name, pending_mode, pending_mode_name}."""
        st = self.state
        out = emu_state.lock_state(st)
        out["mode_name"] = emu_profiles.mode_by_id(self.profile, st["nvpmodel_mode"])["name"]
        pending = st.get("nvpmodel_pending")
        out["pending_mode_name"] = (emu_profiles.mode_by_id(self.profile, pending)["name"]
                                    if pending is not None else None)
        return out

    def set_clocks(self, **locks: Any) -> Dict[str, Any]:
        """Set lock keys directly (cpu_locked, gpu_locked, emc_locked, cpuidle_disabled, gpu_railgate_enable,
        nvfancontrol_active, fan_pwm); all_locked=True/False sets all of them like jetson_clocks / a reboot."""
        def fn(s: Dict[str, Any]) -> None:
            if "all_locked" in locks:
                emu_state.set_all_locks(s, bool(locks.pop("all_locked")))
            s.update(locks)

        unknown = set(locks) - set(emu_state.DEFAULT_STATE) - {"all_locked"}
        if unknown:
            raise KeyError(f"unknown emulated-Jetson state keys: {sorted(unknown)}")
        return emu_state.update(str(self.state_dir), fn=fn)

    def slow_tool(self, tool: str, first_arg: str, seconds: Optional[float]) -> None:
        """Test control: `sudo TOOL FIRST_ARG ...` sleeps `seconds` before running (None: normal speed), so a test can
        stop a controller in the middle of that step. Only calls as root (under sudo) are slowed."""
        delays = dict(self.state.get("tool_delays") or {})
        key = f"{tool} {first_arg}".strip()
        if seconds is None:
            delays.pop(key, None)
        else:
            delays[key] = seconds
        self.set_state(tool_delays=delays)

    def device_processes(self, names: Optional[Sequence[str]] = None) -> List[Dict[str, Any]]:
        """Processes still running on the emulated device that its ssh sessions started (shells, fake tools,
        daemonized `tegrastats --start`, workloads...: everything carrying this device's JETSON_EMU_STATE), not the
        supervisor or sshd. names: only those whose argv[0]/argv[1] basename is in it. For "nothing left running"
        checks: `assert emu.device_processes() == []` after the product closed its sessions (sshd needs a moment to
        reap a closed session: poll). Each item: {pid, ppid, argv}."""
        ppids = emu_state.proc_ppid_map()
        out = []
        for pid in emu_state.processes_of_device(str(self.state_dir), list(names) if names is not None else None):
            argv = emu_state.proc_cmdline(pid)
            if not argv:
                continue
            out.append({"pid": pid, "ppid": ppids.get(pid), "argv": argv})
        return out

    @property
    def boot_count(self) -> int:
        return int(self.state["boot_count"])

    @property
    def boot_id(self) -> str:
        return self.boot_id_path.read_text().strip()

    @property
    def uptime_s(self) -> float:
        """Seconds since the current emulated boot ended (negative while a reboot is in progress)."""
        return time.time() - float(self.state["boot_time"])

    @property
    def events(self) -> List[Dict[str, Any]]:
        return list(self.state["events"])

    def mode_id(self, name: str) -> int:
        for mode in self.modes:
            if mode["name"] == name:
                return mode["id"]
        raise KeyError(f"{self.module} has no power mode {name!r}: {[m['name'] for m in self.modes]}")

    def needs_reboot(self, to_id: int, from_id: Optional[int] = None) -> bool:
        return emu_profiles.needs_reboot(self.profile, self.nvpmodel_mode if from_id is None else from_id, to_id)

    def command_log(self) -> List[Dict[str, Any]]:
        """The fake Jetson tools run so far: [{'tool', 'argv', 'root', 'time'}, ...]."""
        try:
            lines = self.commands_log_path.read_text().splitlines()
        except OSError:
            return []
        return [json.loads(line) for line in lines if line.strip()]

    def set_sudo_password(self, password: Optional[str]) -> None:
        """None: passwordless sudo (the default); a string: sudo needs it (`sudo -S` reads it from stdin)."""
        self.set_state(sudo_password=password)

    def set_load(self, gpu: Optional[float] = None, cpu: Optional[float] = None) -> None:
        """Force the GPU/CPU load tegrastats reports (None: idle, or busy while a workload process runs)."""
        self.set_state(gpu_load_pct=gpu, cpu_load_pct=cpu)

    def block(self, wait: bool = True, timeout: float = 10.0) -> None:
        """Stop sshd: new connections are refused (ECONNREFUSED) until unblock(); open sessions stay."""
        self.set_state(blocked=True)
        if wait:
            self.wait_until_down(timeout)

    def unblock(self, wait: bool = True, timeout: float = 15.0) -> None:
        self.set_state(blocked=False)
        if wait:
            self.wait_until_up(timeout)

    def reboot(self, wait: bool = False, timeout: float = 20.0) -> None:
        """Reboot the device from the test side (as `sudo reboot` does); wait=True waits until it is back."""
        before = self.boot_count
        emu_state.write_text_atomic(str(self.state_dir / emu_state.REBOOT_REQUEST),
                                    json.dumps({"by": "test", "time": time.time()}) + "\n")
        if wait:
            self.wait_for_boot(before, timeout)

    def die_after(self, seconds: float, match: Optional[Sequence[str]] = None) -> None:
        """One-shot: the next command started whose argv[0]/argv[1] basename is in `match` (default tegrastats,
        llama-bench, emu-hang, emu-gpu-load) loses its ssh connection `seconds` after it started."""
        self.set_state(die_after_s=float(seconds), die_match=list(match) if match else None)

    # -------------------------------------------------------------------------------- ssh helpers
    def ssh_options(self) -> List[str]:
        return ["-F", "/dev/null", "-i", str(self.key_path), "-p", str(self.port),
                "-o", f"UserKnownHostsFile={self.known_hosts_path}", "-o", "GlobalKnownHostsFile=/dev/null",
                "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes",
                "-o", "ConnectTimeout=5", "-o", "LogLevel=ERROR"]

    def ssh_argv(self, command: Optional[str] = None) -> List[str]:
        """`ssh ...` argument list for this device (real client, strict host-key checking, key only)."""
        argv = ["ssh", *self.ssh_options(), f"{self.user}@{self.host}"]
        return argv + ([command] if command is not None else [])

    def run(self, command: str, input: Optional[str] = None, timeout: float = 30.0) -> subprocess.CompletedProcess:
        """Run one remote command through the real ssh client; stdin is empty unless `input` is given."""
        return subprocess.run(self.ssh_argv(command), input=input if input is not None else "", capture_output=True,
                              text=True, timeout=timeout)

    def paramiko_client(self, timeout: float = 10.0):
        """A connected paramiko.SSHClient that verifies the host key against known_hosts_path (RejectPolicy)."""
        import paramiko

        client = paramiko.SSHClient()
        client.load_host_keys(str(self.known_hosts_path))
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
        client.connect(self.host, port=self.port, username=self.user, key_filename=str(self.key_path),
                       allow_agent=False, look_for_keys=False, timeout=timeout, banner_timeout=timeout,
                       auth_timeout=timeout)
        return client

    def ssh_config_entry(self, alias: str) -> str:
        """An OpenSSH client config `Host` block for this device."""
        return "\n".join([
            f"Host {alias}", f"  HostName {self.host}", f"  Port {self.port}", f"  User {self.user}",
            f"  IdentityFile {self.key_path}", "  IdentitiesOnly yes", f"  UserKnownHostsFile {self.known_hosts_path}",
            "  StrictHostKeyChecking yes", ""])

    def device_config(self, name: Optional[str] = None) -> Dict[str, Any]:
        """A jbench device entry (keys of jbench.config.DeviceConfig) pointing at this emulated device."""
        return {
            "name": name or f"emu-{self.module}", "kind": "ssh", "host": self.host, "user": self.user,
            "port": self.port, "key": str(self.key_path), "known_hosts": str(self.known_hosts_path),
            "profile": self.product_profile,
            "paths": {"nvpmodel_conf": str(self.nvpmodel_conf_path),
                      "device_tree_model": str(self.device_tree_model_path),
                      "serial_number": str(self.serial_number_path),
                      "tegra_release": str(self.nv_tegra_release_path),
                      "boot_id": str(self.boot_id_path),
                      "gpu_railgate": str(self.gpu_railgate_path)},
        }


JTOP_VERSION = "7.2.2"  # jetson-stats from PyPI (AGPL-3.0): a test-only install, never a jbench dependency
JTOP_VENV = Path(os.environ.get("JBENCH_TEST_CACHE", Path.home() / ".cache" / "jbench-test")) / f"jtop-{JTOP_VERSION}"


def jtop_venv() -> Path:
    """A venv with jetson-stats, made once and cached (JBENCH_TEST_CACHE, default ~/.cache/jbench-test). The wheel
    only (--only-binary): its sdist's setup.py installs a systemd unit and a group when built as root."""
    ready = JTOP_VENV / ".ready"
    if ready.exists():
        return JTOP_VENV
    JTOP_VENV.parent.mkdir(parents=True, exist_ok=True)
    # One process makes it (pytest-xdist workers, other test sessions): the others wait on the lock, then find it.
    with open(JTOP_VENV.with_name(JTOP_VENV.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if ready.exists():
            return JTOP_VENV
        try:
            _run([sys.executable, "-m", "venv", "--clear", str(JTOP_VENV)])
            _run([str(JTOP_VENV / "bin" / "pip"), "install", "-q", "--only-binary", ":all:",
                  f"jetson-stats=={JTOP_VERSION}"], timeout=600)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            out = getattr(exc, "stderr", "") or ""
            raise EmulatorError(f"cannot install jetson-stats {JTOP_VERSION} for the emulated jtop service: {out[-500:]}")
        ready.write_text(JTOP_VERSION + "\n")
    return JTOP_VENV


def _current_user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


@atexit.register
def _stop_all() -> None:
    for emu in list(_running):
        emu.stop()
