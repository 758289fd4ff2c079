"""Small programs jbench ships as sources (`jbench/device/probes/`) and compiles on the device itself, with the
device's own compiler, once per (source, compiler version): the bandwidth probes and the hwmon sampling loop."""

from __future__ import annotations

import hashlib
from importlib import resources
from typing import Optional

from jbench.core import paths
from jbench.device.connection import Connection

__all__ = ["BuildError", "build", "c_compiler", "first_tool", "probe_dir", "probe_source"]


class BuildError(Exception):
    """A program could not be compiled on the device (the message has the compiler's errors)."""


def probe_source(name: str) -> str:
    return resources.files("jbench.device").joinpath("probes", name).read_text()


def probe_dir(conn: Connection) -> str:
    if conn.is_local:
        return str(paths.cache_dir() / "probes")
    return conn.expand_path("~/.cache/jbench/probes")


def first_tool(conn: Connection, names: list[str], extra_paths: tuple[str, ...] = ()) -> Optional[str]:
    """The first of `names` on the device's PATH, else the first of `extra_paths` that exists."""
    # A constant shell program; the tool names are its arguments.
    res = conn.run(["sh", "-c", 'for t in "$@"; do command -v "$t" && exit 0; done; exit 1', "sh", *names],
                   timeout=30)
    if res.returncode == 0 and res.stdout.strip():
        return res.stdout.strip().splitlines()[0]
    return next((p for p in extra_paths if conn.exists(p)), None)


def c_compiler(conn: Connection) -> Optional[str]:
    return first_tool(conn, ["cc", "gcc", "clang"])


def build(conn: Connection, compiler: str, version_argv: list[str], source_name: str, flag_sets: list[list[str]],
          stem: str) -> tuple[str, list[str]]:
    """Compile a shipped source on the device once per (source, compiler version); (binary path, flags used).
    The first flag set that compiles wins; BuildError when none does."""
    source = probe_source(source_name)
    ver = conn.run([compiler, *version_argv], timeout=60)
    key = hashlib.sha256((source + "\0" + ver.stdout + ver.stderr).encode()).hexdigest()[:16]
    pdir = probe_dir(conn)
    binary = f"{pdir}/{stem}-{key}"
    meta = binary + ".flags"
    if conn.exists(binary) and conn.exists(meta):
        flags = conn.run(["cat", meta], timeout=30).stdout.split()
        return binary, flags
    conn.run(["mkdir", "-p", pdir], timeout=30)
    src = f"{pdir}/{source_name}"
    conn.run(["sh", "-c", 'cat > "$1"', "sh", src], stdin=source, timeout=60)
    errors = []
    for flags in flag_sets:
        tmp = f"{binary}.tmp"
        res = conn.run([compiler, *flags, "-o", tmp, src], timeout=600)
        if res.returncode == 0:
            conn.run(["mv", tmp, binary], timeout=30)
            conn.run(["sh", "-c", 'printf "%s\\n" "$2" > "$1"', "sh", meta, " ".join(flags)], timeout=30)
            return binary, flags
        errors.append(f"{' '.join([compiler, *flags])}: {res.stderr.strip()[-400:]}")
    raise BuildError(f"could not compile the {stem} program on '{conn.name}':\n" + "\n".join(errors))
