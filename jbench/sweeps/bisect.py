"""`jbench bisect`: the first bad llama.cpp build between a known good and a known bad one.

The search (pure): the two ends are measured first; when their difference is not significant (Welch t at
1 - alpha) nothing is bisected. Otherwise the repetitions a midpoint needs follow from the ends' difference d
and noise s: its mean must land on its own side of the halfway line, |mean - end| < d / 2, with probability
1 - alpha, so n >= (2 z s / d)^2 (z the normal quantile 1 - alpha / 2), bounded by --max-repetitions. A midpoint
is classified by which end its mean is closer to, and the verdict stands only when a Welch t-test
(1 - alpha) shows it differs from the other end and its mean is outside the middle third between the ends;
otherwise the step is "unclear", the build is measured once more, and when it is still unclear the search stops
with no verdict. Binary search then halves the range [last good, first bad] until they are neighbours.

The measuring (impure): each build runs the failing configuration's llama-bench (the same backend `jbench run`
uses) with `backend.binary_dir` pointing at it, through the device's connection; every build measured is a child
run of one "bisect" parent run (tags bisect.*), written through jbench.tracking. The device is handled by the
sweep's own code (jbench.sweeps.sweep.Sweep, jbench.device.lease, jbench.device.power): its on-device lease is held
for the whole bisection and a requested power state is applied, verified, and restored at the end (also on Ctrl-C
or an error). Builds are either a list of directories (on the device) or commits of a llama.cpp git checkout on
this machine, built with `jbench setup`'s CMake configuration and cached per commit: here for a local device, on
the device itself over SSH (git archive -> SFTP -> CMake there) for a remote one.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import platform
import shutil
import statistics
import subprocess
import tarfile
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

from jbench.core import paths
from jbench.core.schema import DeviceConfig
from jbench.device.ondevice import first_tool
from jbench.device.connection import DeviceError
from jbench.core.results import Status
from jbench.core.protocol import PROTOCOL_VERSION
from jbench.core.provenance import JBENCH_VERSION
from jbench.runner.recorder import Recorder, controller_id, wall_time

if TYPE_CHECKING:
    from jbench.device.connection import Connection

log = logging.getLogger("jbench.bisect")

GOOD, BAD, UNCLEAR = "good", "bad", "unclear"
METRICS = {"decode_tps": "decode", "prefill_tps": "prefill"}
BISECT_TARGETS = ("llama-bench",)

Say = Callable[[str], None]


class BisectError(Exception):
    """Bad input or a build that cannot be measured: one message naming the fix."""


# --------------------------------------------------------------------------------------------
# The search (pure)


def normal_quantile(q: float) -> float:
    return statistics.NormalDist().inv_cdf(q)


def ends_differ(good: Sequence[float], bad: Sequence[float], alpha: float) -> tuple[bool, Any]:
    """(significant, Welch interval of mean(bad) - mean(good) at 1 - alpha)."""
    from jbench.analysis.stats import welch_interval

    ci = welch_interval(good, bad, 1.0 - alpha)
    significant = not math.isnan(ci.low) and (ci.low > 0 or ci.high < 0)
    return significant, ci


def repetitions_needed(good: Sequence[float], bad: Sequence[float], alpha: float, *, minimum: int,
                       maximum: int) -> tuple[int, int]:
    """(repetitions per build, the unbounded figure): n >= (2 z s / d)^2 with s the larger end's std and d
    the ends' mean difference, so a midpoint's mean falls within d / 2 of its true end with 1 - alpha."""
    d = abs(statistics.fmean(bad) - statistics.fmean(good))
    s = max(statistics.stdev(good), statistics.stdev(bad))
    if d == 0:
        return maximum, math.inf  # type: ignore[return-value]
    raw = math.ceil((2.0 * normal_quantile(1.0 - alpha / 2.0) * s / d) ** 2)
    return max(minimum, min(maximum, raw)), raw


def classify(mid: Sequence[float], good: Sequence[float], bad: Sequence[float], alpha: float) -> tuple[str, str]:
    """(good | bad | unclear, why): the end the midpoint's mean is closer to, confirmed by a Welch t-test
    (1 - alpha) showing the midpoint differs from the other end. A mean in the middle third between the ends (a
    speed neither end has: load while it ran, or a second change) is unclear too. The band is an effect size, not
    a test against the closer end: on a quiet machine a build's run-to-run drift is significant yet immaterial."""
    m, g, b = statistics.fmean(mid), statistics.fmean(good), statistics.fmean(bad)
    closer, other = (GOOD, BAD) if abs(m - g) <= abs(m - b) else (BAD, GOOD)
    differs, ci = ends_differ(bad if closer == GOOD else good, mid, alpha)
    between = abs(m - (g if closer == GOOD else b)) > abs(g - b) / 3
    why = (f"mean {m:.4g} is closer to the {closer} end ({g if closer == GOOD else b:.4g}) than to the {other} "
           f"end ({b if closer == GOOD else g:.4g}); vs the {other} end: difference {ci.diff:+.4g}, "
           f"{100 * (1 - alpha):g} % Welch CI [{ci.low:.4g}, {ci.high:.4g}]")
    if between:
        why += "; but it lies in the middle third between the ends"
    return (closer if differs and not between else UNCLEAR), why


def midpoint(lo: int, hi: int) -> int:
    return (lo + hi) // 2


def search(n: int, verdict: Callable[[int], str]) -> tuple[Optional[int], list[tuple[int, str]]]:
    """Binary search over builds 0..n-1 (0 good, n-1 bad) for the first bad one; verdict(i) classifies a
    midpoint. Returns (first bad index or None when a step was unclear, [(index, verdict)] in order)."""
    if n < 2:
        raise BisectError("bisect needs at least two builds: the known good one first, the known bad one last")
    lo, hi, steps = 0, n - 1, []
    while hi - lo > 1:
        mid = midpoint(lo, hi)
        v = verdict(mid)
        steps.append((mid, v))
        if v == GOOD:
            lo = mid
        elif v == BAD:
            hi = mid
        else:
            return None, steps
    return hi, steps


# --------------------------------------------------------------------------------------------
# The builds


@dataclass
class Build:
    """One candidate: a directory holding llama-bench, or a commit built on first use."""

    label: str
    bin_dir: Optional[str] = None
    commit: Optional[str] = None
    # builds it for the device (its connection and config) and returns its bin dir there
    make: Optional[Callable[["Connection", "DeviceConfig"], str]] = None
    # a --builds directory not looked into yet: on a remote device it is found once the device is connected
    directory: Optional[str] = None
    commit_seen: Optional[str] = None  # the commit its llama-bench reported when measured

    def resolve(self, conn: Optional["Connection"] = None, device: Optional["DeviceConfig"] = None) -> str:
        if self.bin_dir is None and self.make is not None:
            if conn is None:
                raise BisectError(f"build {self.label} is built for a device: no device connection given")
            self.bin_dir = self.make(conn, device if device is not None else DeviceConfig())
        if self.bin_dir is None:
            raise BisectError(f"build {self.label} has no directory")
        return self.bin_dir


def _llama_bench_dir(directory: str, conn: Optional["Connection"]) -> Optional[str]:
    """The directory holding an executable llama-bench: `directory` itself, or its bin/ (a build's root); on the
    device when conn is a remote connection. None when neither holds one."""
    if conn is None or conn.is_local:
        p = Path(directory).expanduser()
        for candidate in (p, p / "bin"):
            if (candidate / "llama-bench").is_file() and os.access(candidate / "llama-bench", os.X_OK):
                return str(candidate.resolve())
        return None
    p = conn.expand_path(directory).rstrip("/") or "/"
    for candidate in (p, f"{p}/bin"):
        if conn.run(["test", "-f", f"{candidate}/llama-bench", "-a", "-x", f"{candidate}/llama-bench"],
                    timeout=30).returncode == 0:
            return candidate
    return None


def dir_builds(dirs: Sequence[str]) -> list[Build]:
    """--builds as given, looked into later (on the device the bisection measures on: see locate_dirs)."""
    if len(dirs) < 2:
        raise BisectError("--builds needs at least two directories: the known good build first, the bad one last")
    return [Build(label=str(d), directory=str(d)) for d in dirs]


def builds_from_dirs(dirs: Sequence[str], conn: Optional["Connection"] = None) -> list[Build]:
    """Each directory must hold an executable llama-bench (a build's bin directory, or its root with bin/ inside),
    on this machine, or on the device of a remote connection `conn`."""
    builds = dir_builds(dirs)
    locate_dirs(builds, conn)
    return builds


def locate_dirs(builds: Sequence[Build], conn: Optional["Connection"] = None) -> None:
    """Find llama-bench in every --builds directory (on the device when conn is remote): one message naming every
    directory that has none, before anything is measured."""
    missing = []
    for b in builds:
        if b.directory is None or b.bin_dir is not None:
            continue
        found = _llama_bench_dir(b.directory, conn)
        if found is None:
            missing.append(b.directory)
        b.bin_dir = found
    if missing:
        where = "" if conn is None or conn.is_local else f" on device '{conn.name}'"
        raise BisectError(f"--builds {', '.join(missing)}: no executable llama-bench in it{where} (give the build's "
                          "bin directory" + (", a path on the device" if where else "") + ")")


def _git(repo: str, *args: str) -> str:
    proc = subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise BisectError(f"git {' '.join(args)} in {repo} failed: {proc.stderr.strip()}")
    return proc.stdout.strip()


def commits_between(repo: str, good: str, bad: str) -> list[str]:
    """good, then every first-parent commit after it up to bad, oldest first (full hashes)."""
    if not Path(repo, ".git").exists() and _git_dir(repo) is None:
        raise BisectError(f"--repo {repo} is not a git checkout (clone llama.cpp there)")
    g = _git(repo, "rev-parse", "--verify", f"{good}^{{commit}}")
    b = _git(repo, "rev-parse", "--verify", f"{bad}^{{commit}}")
    if subprocess.run(["git", "-C", repo, "merge-base", "--is-ancestor", g, b]).returncode != 0:
        raise BisectError(f"--good {good} is not an ancestor of --bad {bad}: swap them or pick other refs")
    later = _git(repo, "rev-list", "--first-parent", "--reverse", f"{g}..{b}").split()
    if not later:
        raise BisectError(f"--good {good} and --bad {bad} are the same commit: nothing to bisect")
    return [g, *later]


def _git_dir(repo: str) -> Optional[str]:
    proc = subprocess.run(["git", "-C", repo, "rev-parse", "--git-dir"], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


def build_commit(repo: str, commit: str, say: Say, jobs: Optional[int] = None) -> str:
    """llama-bench of `commit`, built with `jbench setup`'s CMake configuration (CPU) into the cache
    (llama.cpp/bisect-<commit>-cpu-<machine>), reused when already there. Returns its bin directory."""
    from jbench.models.provision import SetupError, cmake_args, compile_llamacpp

    short = commit[:9]
    root = paths.llamacpp_builds_dir() / f"bisect-{short}-cpu-{platform.machine()}"
    bin_dir = root / "bin"
    if (bin_dir / "llama-bench").exists():
        return str(bin_dir)
    for tool in ("cmake", "c++"):
        if not shutil.which(tool):
            raise BisectError(f"{tool} not found: install a C++ compiler and CMake to build commits")
    if root.exists():
        shutil.rmtree(root)
    src = root / "src"
    src.mkdir(parents=True)
    archive = root / "src.tar"
    _git(repo, "archive", "--format=tar", "-o", str(archive), commit)
    with tarfile.open(archive) as tar:
        tar.extractall(src, filter="data")
    archive.unlink()
    jobs = jobs or os.cpu_count() or 2
    say(f"building llama-bench of {short} with {jobs} jobs (log: {root / 'build.log'}); this takes minutes")
    try:
        compile_llamacpp(src, root, cmake_args(short, False), BISECT_TARGETS, jobs, root / "build.log")
    except SetupError as exc:
        raise BisectError(f"commit {short} does not build: {exc}") from None
    shutil.rmtree(src, ignore_errors=True)
    return str(bin_dir)


# The device nodes of an NVIDIA GPU on a Jetson (the same ones `jbench setup`'s gpu_visible looks for here).
_JETSON_GPU_NODES = ("/dev/nvhost-gpu", "/dev/nvgpu/igpu0/ctrl", "/dev/nvhost-ctrl-gpu")
# A build step on the device, its output appended to the log ($1); the command is the remaining arguments.
_LOGGED = 'log=$1; shift; printf "\\n$ %s\\n" "$*" >>"$log"; "$@" >>"$log" 2>&1'
BUILD_TIMEOUT_S = 4 * 3600.0  # a CUDA build of llama-bench on a small Jetson takes most of an hour


def device_cuda(conn: "Connection") -> tuple[Optional[str], str]:
    """(nvcc's path or None for a CPU build, why), decided as `jbench setup` decides here: CUDA when the device
    has nvcc (on PATH or in /usr/local/cuda/bin, where JetPack puts it) and an NVIDIA GPU."""

    nvcc = first_tool(conn, ["nvcc"], ("/usr/local/cuda/bin/nvcc",))
    if nvcc is None:
        return None, "CPU build (no nvcc on the device)"
    if any(conn.exists(p) for p in _JETSON_GPU_NODES) or "GPU" in conn.run(["nvidia-smi", "-L"], timeout=30).stdout:
        return nvcc, f"CUDA build ({nvcc} and an NVIDIA GPU on the device)"
    return None, "CPU build (nvcc on the device but no NVIDIA GPU visible)"


def _device_step(conn: "Connection", log_path: str, argv: list[str], short: str,
                 timeout: float = BUILD_TIMEOUT_S) -> None:
    """One build step on the device, logged there; BisectError with the log's tail when it fails."""
    res = conn.run(["sh", "-c", _LOGGED, "sh", log_path, *argv], timeout=timeout)
    if res.returncode != 0:
        tail = conn.run(["tail", "-n", "25", log_path], timeout=30).stdout.rstrip()
        raise BisectError(f"commit {short} does not build on device '{conn.name}': `{' '.join(argv[:3])} ...` "
                          f"failed (exit {res.returncode}); full log on the device: {log_path}\n{tail}")


def build_commit_on_device(conn: "Connection", device: "DeviceConfig", repo: str, commit: str, say: Say,
                           jobs: Optional[int] = None) -> str:
    """llama-bench of `commit` built ON the device: `git archive` here, sent over SFTP, configured with `jbench
    setup`'s CMake arguments (CUDA when the device has nvcc and a GPU, else CPU) into the device's per-commit cache
    <state_dir>/llama.cpp/bisect-<commit>-<cpu|cuda>-<machine>, reused when already there. The build log stays
    there (build.log). Returns the bin directory on the device."""
    from jbench.models.provision import cmake_args

    short = commit[:9]
    cmake = first_tool(conn, ["cmake"])
    for tool, found in (("cmake", cmake), ("c++", first_tool(conn, ["c++", "g++", "clang++"]))):
        if found is None:
            raise BisectError(f"{tool} not found on device '{conn.name}': install a C++ compiler and CMake there "
                              "(Debian/Ubuntu: apt-get install build-essential cmake) to build commits on it")
    nvcc, why = device_cuda(conn)
    machine = conn.run(["uname", "-m"], timeout=30).stdout.strip() or "unknown"
    state_dir = device.paths.state_dir.rstrip("/")
    root = conn.expand_path(f"{state_dir}/llama.cpp/bisect-{short}-{'cuda' if nvcc else 'cpu'}-{machine}")
    bin_dir, src, build, log_path = f"{root}/bin", f"{root}/src", f"{root}/build", f"{root}/build.log"
    if conn.run(["test", "-x", f"{bin_dir}/llama-bench"], timeout=30).returncode == 0:
        return bin_dir
    conn.run(["rm", "-rf", root], timeout=600)
    if not conn.run(["mkdir", "-p", src], timeout=30).ok:
        raise BisectError(f"cannot create {src} on device '{conn.name}': check device.paths.state_dir")
    with tempfile.TemporaryDirectory(prefix="jbench-bisect-") as tmp:
        archive = Path(tmp) / "src.tar"
        _git(repo, "archive", "--format=tar", "-o", str(archive), commit)
        try:
            conn.put_file(str(archive), f"{root}/src.tar")
        except DeviceError as exc:
            raise BisectError(str(exc)) from None
    _device_step(conn, log_path, ["tar", "-xf", f"{root}/src.tar", "-C", src], short, timeout=600)
    conn.run(["rm", "-f", f"{root}/src.tar"], timeout=60)
    if not jobs:
        nproc = conn.run(["nproc"], timeout=30).stdout.strip()
        jobs = int(nproc) if nproc.isdigit() else 2
    args = cmake_args(short, nvcc is not None) + ([f"-DCMAKE_CUDA_COMPILER={nvcc}"] if nvcc else [])
    generator = ["-G", "Ninja"] if first_tool(conn, ["ninja"]) else []
    say(f"building llama-bench of {short} on device '{conn.name}' with {jobs} jobs, {why} (log there: {log_path}); "
        "this takes minutes")
    _device_step(conn, log_path, [cmake, "-S", src, "-B", build, *generator, *args], short)
    _device_step(conn, log_path, [cmake, "--build", build, "--config", "Release", "-j", str(jobs),
                                  "--target", *BISECT_TARGETS], short)
    _device_step(conn, log_path, ["mkdir", "-p", bin_dir], short, timeout=30)
    for target in BISECT_TARGETS:
        _device_step(conn, log_path, ["cp", f"{build}/bin/{target}", f"{bin_dir}/{target}"], short, timeout=60)
    # The sources and objects go (a Jetson's disk is small); bin/ and build.log stay.
    conn.run(["rm", "-rf", src, build], timeout=600)
    return bin_dir


def build_for_device(conn: "Connection", device: "DeviceConfig", repo: str, commit: str, say: Say,
                     jobs: Optional[int] = None) -> str:
    """A commit's llama-bench where the bisection measures: built here for a local device, on the device for a
    remote one."""
    if conn.is_local:
        return build_commit(repo, commit, say, jobs)
    return build_commit_on_device(conn, device, repo, commit, say, jobs)


def builds_from_repo(repo: str, good: str, bad: str, say: Say, jobs: Optional[int] = None) -> list[Build]:
    commits = commits_between(repo, good, bad)
    return [Build(label=c[:9], commit=c[:9],
                  make=lambda conn, device, c=c: build_for_device(conn, device, repo, c, say, jobs))
            for c in commits]


# --------------------------------------------------------------------------------------------
# Measuring and recording


@dataclass
class Step:
    step: int  # 0: the good end, 1: the bad end, 2...: midpoints in the order measured
    index: int
    build: Build
    samples: list[float]
    verdict: str
    why: str = ""
    run_id: Optional[str] = None
    build_commit: Optional[str] = None
    runs: list = field(default_factory=list)  # the run handles of its measurements

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples)

    @property
    def std(self) -> float:
        return statistics.stdev(self.samples) if len(self.samples) > 1 else math.nan


@dataclass
class BisectResult:
    builds: list[Build]
    steps: list[Step] = field(default_factory=list)
    first_bad: Optional[int] = None
    repetitions: int = 0
    repetitions_raw: float = 0.0
    outcome: str = ""  # found | no_difference | unclear
    message: str = ""
    parent_run_id: Optional[str] = None
    ends: Any = None  # the ends' ratio, trial as the unit (jbench.analysis.paired.NightRatio)


class Bisector:
    """Measures builds for one failing configuration and records each as a child of a "bisect" run."""

    def __init__(self, builds: list[Build], overrides: list[str], config_dirs: Optional[list[Path]] = None, *,
                 metric: str = "decode_tps", alpha: float = 0.01, repetitions: int = 5,
                 max_repetitions: int = 30, end_trials: int = 3, say: Say = lambda m: None,
                 tracker_factory: Optional[Callable] = None):
        if end_trials < 2:
            raise BisectError(f"--end-trials {end_trials}: each end needs at least 2 trials, the spread between "
                              "them is what the ends' difference is judged against")
        if metric not in METRICS:
            raise BisectError(f"--metric {metric}: choose one of {', '.join(METRICS)}")
        if not 0 < alpha < 0.5:
            raise BisectError(f"--alpha {alpha}: give a significance level between 0 and 0.5, e.g. 0.01")
        if repetitions < 2 or max_repetitions < repetitions:
            raise BisectError("--repetitions must be >= 2 and --max-repetitions >= --repetitions")
        self.builds, self.overrides, self.config_dirs = builds, list(overrides), config_dirs
        self.metric, self.alpha, self.say = metric, alpha, say
        self.repetitions, self.max_repetitions, self.end_trials = repetitions, max_repetitions, end_trials
        self.trial = self._trial(self.builds[0].bin_dir or "")
        self._tracker_factory = tracker_factory
        self.device: DeviceConfig = self.trial.cfg.device
        # Leases and the power-state file on the device name this bisection.
        self.bisect_id = time.strftime("%Y%m%d-%H%M%S-bisect-") + uuid.uuid4().hex[:6]
        self.session: Any = None  # the device's DeviceSession while run() holds it
        self.runner: Any = None  # the run layer's TrialRunner while run() holds the device
        self.recorder: Any = None
        if self.device.kind == "local":
            locate_dirs(self.builds)  # on this machine: bad --builds are found before anything else

    def _trial(self, bin_dir: str, repetitions: Optional[int] = None):
        from jbench.config import ConfigError
        from jbench.sweeps.plan import plan

        quoted = "'" + bin_dir.replace("\\", "\\\\").replace("'", "\\'") + "'"  # a path may hold ':' or '='
        extra = [f"backend.binary_dir={quoted}"] if bin_dir else []
        extra += [f"backend.repetitions={repetitions}"] if repetitions else []
        try:
            p = plan(self.overrides + extra, self.config_dirs, use_grid=True)
        except ConfigError as exc:
            raise BisectError(str(exc)) from None
        if p.problems:
            if len(p.trials) == 1 and p.trials[0].cfg.device.kind == "local":
                locate_dirs(self.builds)  # a wrong --builds directory is named first, as before the configuration
            raise BisectError("the configuration cannot run: " + "; ".join(p.problems))
        if len(p.trials) != 1:
            raise BisectError(f"the failing configuration must be one trial, the overrides give {len(p.trials)}: "
                              "drop comma lists and experiment grids")
        trial = p.trials[0]
        if trial.cfg.backend.name != "llamacpp":
            raise BisectError("bisect measures llama.cpp builds: use backend=llamacpp")
        if p.pool is not None:
            raise BisectError("bisect measures on one device: name it with device=NAME, not a device class (@CLASS)")
        phase = METRICS[self.metric]
        n = trial.cfg.backend.n_gen if phase == "decode" else trial.cfg.backend.n_prompt
        if not n:
            raise BisectError(f"--metric {self.metric} needs backend.{'n_gen' if phase == 'decode' else 'n_prompt'} > 0")
        self.plan = p
        return trial

    def measure(self, build: Build, repetitions: int, name: str) -> tuple[list[float], Any]:
        """One measurement of a build: a trial of the failing configuration with backend.binary_dir at the build,
        run through the run layer's stages (power state, thermal gate, per-trial fingerprint, telemetry) in a child
        run of the bisect run named `name`. Returns the per-repetition rates and the run's handle."""

        if self.session is None or self.runner is None:
            raise BisectError("measuring needs the device: call run()")
        trial = self._trial(build.resolve(self.session.connection, self.device), repetitions)
        outcome = self.runner.run(trial, self.session, name=name,
                                  tags={"jbench.kind": "bisect_step", "bisect.build": build.label,
                                        "bisect.metric": self.metric})[-1]
        if outcome.status != Status.FINISHED or outcome.record is None:
            raise BisectError(f"build {build.label} could not be measured: {outcome.category}: {outcome.error}")
        samples = outcome.record.stepped.get(f"{METRICS[self.metric]}_tps_rep") or []
        if not samples:
            raise BisectError(f"build {build.label} gave no {self.metric} repetitions")
        build.commit_seen = outcome.record.tags.get("backend.build_commit") or build.commit
        return list(samples), outcome.run

    # -- the device, held through the run layer's DeviceSession -------------------------------------------

    @contextlib.contextmanager
    def on_device(self) -> Iterator[Any]:
        """The device, held for the whole bisection: connected, --builds directories found there, the model file
        and power request checked there, its on-device lease taken (one controller at a time) and its power state
        saved; on the way out (also Ctrl-C, errors) the power state is restored and the lease released. The trials
        apply and verify the requested power state themselves (the PowerState stage)."""
        from jbench.runner.session import DeviceSession
        from jbench.runner.trials import preflight

        trial = self.trial
        session = DeviceSession(self.device, trial.cfg.profile, owner=self.bisect_id,
                                reboot_consent=trial.cfg.power.allow_reboot)
        try:
            problems = session.connect()
            if problems:
                raise BisectError("\n".join(problems))
            locate_dirs(self.builds, session.connection)
            found = preflight(session, [trial], check_backend=False)
            if found.problems:
                raise BisectError("\n".join(found.problems))
            session.lease(self.device.lease_wait_s)
            session.save(trial.cfg.wants_power_control)
            self.session = session
            yield session
        except DeviceError as exc:  # the lease: another controller holds the device; a link that went
            raise BisectError(str(exc)) from None
        finally:
            self.session = None
            session.close()

    # -- recording (through the run layer's Recorder) ---------------------------------------------------

    def _tracker(self) -> Any:
        if self._tracker_factory is not None:
            return self._tracker_factory()
        from jbench.tracking.writer import Tracker

        return Tracker(self.plan.tracking.uri, self.plan.tracking.results_dir)

    def _record(self, step: Step, handle: Any) -> None:
        """The step's verdict on the run its measurement made (each measurement of it, when the ends got more)."""
        step.build_commit = step.build.commit_seen or step.build.commit
        tags = {"bisect.step": step.step, "bisect.index": step.index, "bisect.verdict": step.verdict,
                "bisect.why": step.why[:5000], "backend.build_commit": step.build_commit or ""}
        for h in ([handle] if not isinstance(handle, list) else handle):
            self.recorder.tag(h, tags)
        step.runs = handle if isinstance(handle, list) else [handle]

    # -- the whole bisection ----------------------------------------------------------------------

    def run(self) -> BisectResult:
        """The whole bisection on the device, recorded (see on_device for what is held meanwhile)."""
        from jbench.runner.session import power_state_tags
        from jbench.runner.stages import default_stages
        from jbench.runner.trials import TrialRunner

        res = BisectResult(self.builds)
        n = len(self.builds)
        with self.on_device() as session:
            self.recorder = Recorder(self._tracker, experiment=self.plan.tracking.experiment_name or "bisect",
                                     sweep_id=self.bisect_id,
                                     common_tags={"jbench.version": JBENCH_VERSION, "jbench.controller": controller_id(),
                                                  "jbench.protocol_version": PROTOCOL_VERSION})
            self.runner = TrialRunner(self.recorder, default_stages(), experiment="bisect")
            self.recorder.open_sweep(
                run_name=f"bisect {wall_time()}",
                params={"bisect.overrides": " ".join(self.overrides), "bisect.n_builds": n, "bisect.alpha": self.alpha,
                        "bisect.metric": self.metric, "device.name": self.device.name,
                        "bisect.builds": " ".join(b.label for b in self.builds)[:6000]},
                tags={"jbench.kind": "bisect", "jbench.status": "RUNNING", "jbench.config_hash": self.trial.config_hash,
                      "device.kind": self.device.kind,
                      **({"device.host": f"{self.device.host}:{self.device.port}"} if self.device.host else {}),
                      **session.fingerprint},
                description="", resume=lambda t: None, leased=set())
            status = "FAILED"
            try:
                self._bisect(res)
                status = "FINISHED"
            except KeyboardInterrupt:
                status = "KILLED"
                self.recorder.kill_sweep(self.runner.open_runs(), "interrupted (Ctrl-C)")
                raise
            finally:
                tags: dict[str, Any] = {"bisect.outcome": res.outcome or "error", "bisect.repetitions": res.repetitions}
                if res.first_bad is not None:
                    fb = res.builds[res.first_bad]
                    tags.update({"bisect.first_bad_index": res.first_bad, "bisect.first_bad": fb.label,
                                 "bisect.first_bad_commit": next((s.build_commit for s in res.steps
                                                                  if s.index == res.first_bad and s.build_commit), "")
                                 or (fb.commit or "")})
                if res.message:
                    tags["bisect.message"] = res.message[:5000]
                strategy = session.strategy
                if strategy is not None and strategy.last is not None:  # the state every step was verified in
                    tags.update({k: v for k, v in power_state_tags(strategy.last, []).items() if k != "power.changes"})
                if status != "KILLED":
                    self.recorder.end_sweep(status, tags, None)
                try:
                    self.recorder.flush()
                finally:
                    self.recorder.close()
                res.parent_run_id = self.recorder.sweep.parent.run_id
                for step in res.steps:
                    step.run_id = step.runs[-1].run_id if step.runs else None
        return res

    def _bisect(self, res: BisectResult) -> None:
        from jbench.analysis.paired import trial_ratio

        n = len(self.builds)
        good_b, bad_b = self.builds[0], self.builds[-1]
        k = self.end_trials
        self.say(f"measuring the good end {good_b.label} and the bad end {bad_b.label}: {k} trials each, "
                 f"counterbalanced, {self.repetitions} repetitions per trial")
        # Repetitions of one trial share its process and its moment, so the ends are judged with the trial as the
        # unit (two trials of one build on this VM differed by 3.6 % at a repetition spread of 0.5-0.8 %). The
        # order G B B G G B ... cancels a linear drift between the ends.
        trials: dict[str, list[list[float]]] = {GOOD: [], BAD: []}
        handles: dict[str, list[Any]] = {GOOD: [], BAD: []}
        for i in range(k):
            for which in ((GOOD, BAD) if i % 2 == 0 else (BAD, GOOD)):
                b = good_b if which == GOOD else bad_b
                samples, r = self.measure(b, self.repetitions, f"bisect step {0 if which == GOOD else 1}: "
                                          f"{_short(b)} (trial {i + 1} of {k})")
                trials[which].append(samples)
                handles[which].append(r)

        def judge() -> tuple[bool, Any]:
            ratio = trial_ratio(trials[BAD], trials[GOOD], +1, metric=self.metric, alpha=self.alpha, min_effect=0.0)
            res.ends = ratio
            return math.isfinite(ratio.p_value) and ratio.p_value < self.alpha, ratio

        good = [v for t in trials[GOOD] for v in t]
        bad = [v for t in trials[BAD] for v in t]
        differ, ratio = judge()
        reps, raw = self.repetitions, 0.0
        if differ:
            reps, raw = repetitions_needed(good, bad, self.alpha, minimum=self.repetitions,
                                           maximum=self.max_repetitions)
            short = reps - min(len(good), len(bad))
            if short > 0:
                # The ends get as many repetitions as a midpoint: the classification compares with them. The order
                # continues the counterbalancing (the trials so far ended on the end the next pair starts with).
                self.say(f"the ends need {reps} repetitions each to separate a midpoint; measuring {short} more")
                order = ((GOOD, good_b), (BAD, bad_b)) if k % 2 == 0 else ((BAD, bad_b), (GOOD, good_b))
                for which, b in order:
                    samples, r = self.measure(b, short, f"bisect step {0 if which == GOOD else 1}: "
                                              f"{_short(b)} (more repetitions)")
                    trials[which].append(samples)
                    handles[which].append(r)
                good = [v for t in trials[GOOD] for v in t]
                bad = [v for t in trials[BAD] for v in t]
                differ, ratio = judge()
        res.repetitions, res.repetitions_raw = reps, raw
        ends_why = (f"ends: {self.metric} {statistics.fmean(good):.4g} -> {statistics.fmean(bad):.4g}, bad/good "
                    + (f"{(ratio.ratio - 1) * 100:+.2f} %" if math.isfinite(ratio.ratio) else "unknown")
                    + (f", {100 * (1 - self.alpha):g} % CI {(ratio.low - 1) * 100:+.2f} … {(ratio.high - 1) * 100:+.2f} %, "
                       f"p={ratio.p_value:.2g}, {ratio.k_reference}+{ratio.k_test} trials, trial-to-trial spread "
                       f"{ratio.trial_sd * 100:.2f} % ({ratio.dof} dof)" if math.isfinite(ratio.p_value)
                       else f" ({ratio.reason})"))
        for i, (b, samples, r, verdict) in enumerate(((good_b, good, handles[GOOD], GOOD),
                                                      (bad_b, bad, handles[BAD], BAD))):
            step = Step(i, 0 if verdict == GOOD else n - 1, b, samples, verdict, ends_why)
            self._record(step, r)
            res.steps.append(step)
        if not differ:
            res.outcome = "no_difference"
            res.message = (f"the good and the bad end do not differ significantly ({ends_why}): nothing to bisect; "
                           "check the failing configuration, or measure more trials of each end (--end-trials)")
            return
        if raw > self.max_repetitions:
            self.say(f"a clear separation needs {raw} repetitions per build, bounded to {reps} by --max-repetitions: "
                     "midpoints may come out unclear")

        def verdict(index: int) -> str:
            b = self.builds[index]
            for attempt in (1, 2):  # an unclear build is measured once more: a burst of load passes
                again = " again" if attempt > 1 else ""
                self.say(f"step {len(res.steps)}: measuring build {index} ({b.label}){again}, {reps} repetitions")
                samples, r = self.measure(b, reps, f"bisect step {len(res.steps)}: {_short(b)}")
                v, why = classify(samples, good, bad, self.alpha)
                step = Step(len(res.steps), index, b, samples, v, why)
                self._record(step, r)
                res.steps.append(step)
                self.say(f"  build {index}: {v}: {why}")
                if v != UNCLEAR:
                    break
            return v

        first_bad, _ = search(n, verdict)
        res.first_bad = first_bad
        if first_bad is None:
            last = res.steps[-1]
            res.outcome = "unclear"
            res.message = (f"build {last.index} ({last.build.label}) is neither clearly good nor clearly bad "
                           f"({last.why}); raise --max-repetitions or check the build")
        else:
            res.outcome = "found"
            res.message = f"first bad build: {first_bad} ({self.builds[first_bad].label})"


def _short(build: Build) -> str:
    return Path(build.label).name or build.label
