"""A command's peak resident set, measured on the device: the command runs as the child of a small constant Python
program (`python3 -c`, as the hwmon reader and the latency scenario already need), which waits for it, prints one
marker line with getrusage(RUSAGE_CHILDREN).ru_maxrss (KiB on Linux) to stderr, and exits with the child's code
(128 + n for a child killed by signal n, as a shell reports it). The command travels as argv items after the
program, never pasted into it.

Only the waited-for child counts (RUSAGE_CHILDREN), so the wrapper's interpreter as such is not in the figure; but
Linux keeps a child's high-water mark across exec, and the child starts as a copy of the interpreter, so the figure
is never below that copy's size (about 10-15 MiB): a floor far under any model's weights.
"""

from __future__ import annotations

import re
from typing import Optional

MARKER = "jbench-peak-rss-kib"

# Python 3.6+ (JetPack 4's python3). The leading newline keeps the marker on a line of its own when the child's
# last line has none; split_peak_rss removes exactly what is written here.
_WRAPPER = r"""
import errno, resource, subprocess, sys
try:
    rc = subprocess.call(sys.argv[1:])
except OSError as exc:
    sys.stderr.write("%s: %s\n" % (sys.argv[1], exc))
    sys.exit(127 if exc.errno == errno.ENOENT else 126)
sys.stderr.write("\n%s %d\n" % (MARKER, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))
sys.stderr.flush()
sys.exit(128 - rc if rc < 0 else rc)
""".replace("MARKER", repr(MARKER))

_FOUND = re.compile(r"\n" + re.escape(MARKER) + r" (\d+)\n")


def peak_rss_argv(argv: list[str]) -> list[str]:
    """argv run under the peak-RSS wrapper (module doc); its stderr ends with the marker line."""
    if not argv:
        raise ValueError("peak_rss_argv needs a command")
    return ["python3", "-c", _WRAPPER, *map(str, argv)]


def split_peak_rss(stderr: str) -> tuple[Optional[int], str]:
    """(peak RSS in KiB, the command's own stderr) from a wrapped command's stderr; (None, stderr) without a marker
    (the wrapper did not get to print one: killed, or the command never started)."""
    found = list(_FOUND.finditer(stderr))
    if not found:
        return None, stderr
    m = found[-1]
    return int(m.group(1)), stderr[:m.start()] + stderr[m.end():]
