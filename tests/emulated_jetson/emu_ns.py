"""Enter point of a real_paths emulated Jetson's sshd: run by `unshare --mount --propagation private`, it mounts the
device's tree (emu_sysfs.Tree.mounts) at the real paths in that new mount namespace, then execs the command (sshd),
so sshd and every session it starts see the emulated files; nothing outside the namespace changes.

Usage: python3 emu_ns.py MOUNTS_JSON -- COMMAND ARGS...   (root only: mount(2) needs CAP_SYS_ADMIN)
"""

import json
import os
import subprocess
import sys


def mount(spec: dict) -> None:
    if spec["kind"] == "bind":
        argv = ["mount", "--bind", spec["src"], spec["dst"]]
    else:  # overlay: the device's files in front of the host's (read-only unless an upper dir is given)
        opts = f"lowerdir={spec['lower']}"
        if spec.get("upper"):
            opts += f",upperdir={spec['upper']},workdir={spec['work']}"
        argv = ["mount", "-t", "overlay", "overlay", "-o", opts, spec["dst"]]
    subprocess.run(argv, check=True)


def main() -> int:
    sep = sys.argv.index("--")
    with open(sys.argv[1], encoding="utf-8") as fh:
        mounts = json.load(fh)
    for spec in mounts:
        mount(spec)
    command = sys.argv[sep + 1:]
    os.execvp(command[0], command)
    return 127


if __name__ == "__main__":
    sys.exit(main())
