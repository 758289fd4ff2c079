"""Shared fixtures. End-to-end tests use the real llama.cpp build and model from `jbench setup`
(`make setup` runs it); when they are missing the tests fail and say so, they never skip.

Test tiers (markers in pyproject.toml): `e2e` (real llama.cpp binaries or what `jbench setup` made, a real MLflow
server, Chromium, or a `jbench` CLI subprocess), `ssh` (a real sshd: the emulated Jetsons), `coordinator` (a real
`labgrid-coordinator`), `slow` (pure Python, over ~3 s). `make test-fast` sets JBENCH_TEST_TIER=fast and deselects
all four; in that tier the guard below makes
a test that starts one of those processes (or uses `llama_build` / `bundled_model`) without its marker fail, so the
marks cannot drift.

`alone` (a speed difference between real builds, or a load the test makes) is not a tier but where a test runs:
`make test` runs the others on pytest-xdist workers, then the `alone` ones serially; an `alone` test fails in an
xdist worker (pytest_runtest_setup below)."""

from __future__ import annotations

import functools
import inspect
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

# A suite started in the background from a non-interactive shell (`cmd &`, nohup) inherits SIGINT ignored, and
# every process it starts would ignore the Ctrl-C the tests send. Give the children Ctrl-C back.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
DATA = TESTS / "data"  # test data copied into the repository, with provenance (data/README.md)
TIER = os.environ.get("JBENCH_TEST_TIER", "")  # "fast": `make test-fast`


@pytest.fixture(scope="session")
def llama_build() -> dict:
    _needs_e2e("the llama.cpp build")
    from jbench.models.provision import active_build

    build = active_build()
    if build is None:
        pytest.fail("no llama.cpp build: run `make setup` (or `jbench setup`) before the tests")
    return build


@pytest.fixture(scope="session")
def bundled_model() -> dict:
    _needs_e2e("the bundled model")
    from jbench.models.store import load_manifest

    files = load_manifest("gemma3_270m").get("files", {})
    for quant in ("Q4_K_M", "Q4_0", "Q8_0"):
        if quant not in files or not Path(files[quant]["path"]).exists():
            pytest.fail(f"bundled model {quant} missing: run `make setup` (or `jbench setup`) before the tests")
    return files


@pytest.fixture(scope="session")
def nosimd_build(llama_build) -> str:
    """llama-bench from the cached build's sources with SIMD disabled (x86-64's baseline SSE2 remains): a build that
    really is slower (bisect, confirmation). Built once per cache, with -j2 under nice (tests/nosimd_build.py);
    another process building it (a pytest-xdist worker, `make test`'s head start) is waited for. Returns its bin
    directory."""
    from .nosimd_build import ensure_nosimd_build

    return str(ensure_nosimd_build(llama_build["build_commit"]))


def jbench_cli(args: list[str], *, env_extra: dict | None = None, cwd: Path | None = None,
               timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the installed `jbench` command the way a user does."""
    env = dict(os.environ)
    env.update(env_extra or {})
    env.setdefault("COLUMNS", "200")
    exe = Path(sys.executable).with_name("jbench")
    return subprocess.run([str(exe), *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


# --- The fast tier's guard -------------------------------------------------------------------------------------
_SHELLS = {"sh", "bash", "dash", "zsh"}
_WRAPPERS = {"env", "sudo", "timeout", "nice", "nohup", "setsid", "stdbuf", "exec", "command"}
_CHROMIUM = {"chromium", "chromium-browser", "chrome", "google-chrome", "google-chrome-stable", "headless_shell",
             "chrome-headless-shell"}
_OPTION_OR_ARG = re.compile(r"^(-.*|[A-Za-z_][A-Za-z0-9_]*=.*|\d+(\.\d+)?[smhd]?)$")  # -x, VAR=value, 10, 2.5s


def wait_until(predicate, timeout: float, every: float = 0.3) -> bool:
    """Poll predicate() until it is true (True) or timeout seconds pass (False)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(every)
    return False


def finished_trial_runs(db: Path) -> int:
    """FINISHED trial runs in a local MLflow SQLite store, read-only with sqlite3 (an MlflowClient would race the
    jbench process creating the store's tables); 0 while the store or its tables do not exist yet."""
    import sqlite3

    if not db.exists():
        return 0
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            return con.execute("SELECT count(*) FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid WHERE "
                               "r.status = 'FINISHED' AND t.key = 'jbench.kind' AND t.value = 'trial'").fetchone()[0]
        finally:
            con.close()
    except sqlite3.Error:
        return 0


def _started(argv: list[str]):
    """The commands `argv` starts: argv[0], the command behind a wrapper (env, sudo, timeout, ...), every command
    of an `sh -c` string, and the script or `-m` module of a Python interpreter."""
    while argv:
        word, rest = argv[0], argv[1:]
        name = os.path.basename(word)
        yield word
        if name in _WRAPPERS:
            while rest and _OPTION_OR_ARG.match(rest[0]):
                rest = rest[1:]
            argv = rest
        elif name in _SHELLS:
            flags = [w for w in rest if w.startswith("-") and not w.startswith("--")]
            if not any("c" in f for f in flags):
                return
            script = next((w for w in rest if not w.startswith("-")), "")
            lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            try:
                words = list(lexer)
            except ValueError:  # unbalanced quotes: the shell will refuse it anyway
                words = script.split()
            command: list[str] = []
            for w in words + [";"]:
                if w and set(w) <= set(";&|()"):  # end of a simple command
                    while command and re.match(r"[A-Za-z_][A-Za-z0-9_]*=", command[0]):  # VAR=value cmd
                        command.pop(0)
                    yield from _started(command)
                    command = []
                else:
                    command.append(w)
            return
        elif re.fullmatch(r"python[0-9.]*", name):
            for i, w in enumerate(rest):
                if w == "-m" and i + 1 < len(rest) or w.startswith("-m") and len(w) > 2:
                    module = rest[i + 1] if w == "-m" else w[2:]
                    yield "python -m " + module
                    return
                if w == "-c":
                    return
                if not w.startswith("-"):
                    argv = rest[i:]
                    break
            else:
                return
        else:
            return


def _heavy(word: str, path: str | None) -> tuple[str, str] | None:
    """(what it is, the marker it needs) when `word`, a started command, is one the fast tier does not run."""
    if word.startswith("python -m "):
        module = word.split()[-1]
        if module in ("jbench", "jbench.cli"):
            return "the jbench CLI", "e2e"
        return ("mlflow", "e2e") if module.split(".")[0] == "mlflow" else None
    name = os.path.basename(word)
    found = word if "/" in word else shutil.which(word, path=path)
    if not found or not os.path.exists(found):
        return None  # nothing starts (a test of a missing program)
    if name in ("sshd", "sshd-session", "sshd-auth"):
        return "sshd", "ssh"
    if name == "supervisor.py" and "emulated_jetson" in word:
        return "an emulated Jetson (its supervisor runs sshd)", "ssh"
    if name.startswith("llama-"):
        if Path(found).resolve().is_relative_to(TESTS / "fixtures"):
            return None  # a stand-in from tests/fixtures, not llama.cpp
        return f"llama.cpp's {name}", "e2e"
    if name == "jbench":
        return "the jbench CLI", "e2e"
    if name == "mlflow":
        return "mlflow", "e2e"
    if name in ("postgres", "postmaster", "initdb", "pg_ctl", "pg_ctlcluster"):
        return f"PostgreSQL's {name}", "e2e"
    if name == "labgrid-coordinator":
        return "a labgrid coordinator", "coordinator"
    if name in _CHROMIUM:
        return "Chromium", "e2e"
    return None


_current: list = [None]  # the test item whose setup, call or teardown runs now
_violations = pytest.StashKey[list]()


def _needs_e2e(what: str) -> None:
    """What `jbench setup` makes (a fresh clone has none) is for e2e tests only: the fast tier needs no setup."""
    item = _current[0]
    if TIER == "fast" and item is not None and item.get_closest_marker("e2e") is None:
        pytest.fail(f"{item.nodeid} uses {what} from `jbench setup` but is not marked `e2e`: add @pytest.mark.e2e. "
                    "The fast tier (JBENCH_TEST_TIER=fast, `make test-fast`) runs without `jbench setup`.", pytrace=False)


def _check_spawn(argv, path: str | None) -> None:
    item = _current[0]
    if item is None:
        return
    argv = [os.fsdecode(a) if isinstance(a, (bytes, os.PathLike)) else str(a) for a in argv]
    for word in _started(argv):
        hit = _heavy(word, path)
        if hit is None or item.get_closest_marker(hit[1]) is not None:
            continue
        what, marker = hit
        msg = (f"{item.nodeid} starts {what} ({shlex.join(argv)[:300]}) but is not marked `{marker}`: "
               f"add @pytest.mark.{marker} (or `pytestmark = pytest.mark.{marker}` for the whole module). "
               f"The fast tier (JBENCH_TEST_TIER=fast, `make test-fast`) must not start it.")
        item.stash.setdefault(_violations, []).append(msg)
        pytest.fail(msg, pytrace=False)


def _install_guard() -> list:
    """Wrap subprocess.Popen and os.posix_spawn(p) for the session; returns what to restore."""
    restore = []
    popen_init = subprocess.Popen.__init__
    sig = inspect.signature(popen_init)

    @functools.wraps(popen_init)
    def guarded_init(self, *args, **kwargs):
        bound = sig.bind(self, *args, **kwargs)
        cmd = bound.arguments.get("args")
        env = bound.arguments.get("env") or os.environ
        if isinstance(cmd, (str, bytes, os.PathLike)):
            cmd = [os.fsdecode(cmd)]
        if bound.arguments.get("shell"):
            cmd = ["/bin/sh", "-c", " ".join(os.fsdecode(c) for c in cmd)]
        if bound.arguments.get("executable"):
            cmd = [bound.arguments["executable"], *list(cmd)[1:]]
        _check_spawn(list(cmd), env.get("PATH"))
        return popen_init(self, *args, **kwargs)

    subprocess.Popen.__init__ = guarded_init
    restore.append((subprocess.Popen, "__init__", popen_init))
    for fn_name in ("posix_spawn", "posix_spawnp"):
        fn = getattr(os, fn_name, None)
        if fn is None:
            continue

        def guarded_spawn(path, argv, env, *a, _fn=fn, **kw):
            _check_spawn([path, *list(argv)[1:]], (env or os.environ).get("PATH"))
            return _fn(path, argv, env, *a, **kw)

        setattr(os, fn_name, guarded_spawn)
        restore.append((os, fn_name, fn))
    return restore


_restore: list = []  # (object, attribute, original) to put back at the end of the session
_saved_env: dict = {}


# What a pytest-xdist worker's environment has that the pytest process that started it did not: COLUMNS=80 and
# LINES=24 appear in the workers, and every CLI a test starts would print 80 columns wide.
_WORKER_ENV = ("COLUMNS", "LINES")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist, in the controlling process: hand each worker the terminal variables of this process."""
    node.workerinput["jbench_env"] = {name: os.environ.get(name) for name in _WORKER_ENV}


def pytest_configure(config):
    # A pytest-xdist worker: the tests' processes see the environment of a run without xdist.
    for name, value in getattr(config, "workerinput", {}).get("jbench_env", {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    # The local device's lease and power-state files (conf/device/local.yaml) in a directory of this test process:
    # a developer's own sweep, or another test process (pytest-xdist workers), never holds the tests' device.
    if "JBENCH_STATE_DIR" not in _saved_env:
        _saved_env["JBENCH_STATE_DIR"] = os.environ.get("JBENCH_STATE_DIR")
        os.environ["JBENCH_STATE_DIR"] = tempfile.mkdtemp(prefix="jbench-test-state-")
    if TIER != "fast" or _restore:
        return
    _restore.extend(_install_guard())
    # An empty cache: the fast tier sees no llama.cpp build or model from `jbench setup`, as on a fresh clone.
    _saved_env["JBENCH_CACHE_DIR"] = os.environ.get("JBENCH_CACHE_DIR")
    os.environ["JBENCH_CACHE_DIR"] = tempfile.mkdtemp(prefix="jbench-fast-tier-cache-")


def pytest_unconfigure(config):
    if "JBENCH_STATE_DIR" in _saved_env:
        shutil.rmtree(os.environ["JBENCH_STATE_DIR"], ignore_errors=True)
        previous = _saved_env.pop("JBENCH_STATE_DIR")
        if previous is None:
            os.environ.pop("JBENCH_STATE_DIR", None)
        else:
            os.environ["JBENCH_STATE_DIR"] = previous
    while _restore:
        owner, name, original = _restore.pop()
        setattr(owner, name, original)
    if "JBENCH_CACHE_DIR" in _saved_env:
        shutil.rmtree(os.environ["JBENCH_CACHE_DIR"], ignore_errors=True)
        previous = _saved_env.pop("JBENCH_CACHE_DIR")
        if previous is None:
            os.environ.pop("JBENCH_CACHE_DIR", None)
        else:
            os.environ["JBENCH_CACHE_DIR"] = previous


def pytest_runtest_setup(item):
    """A test marked `alone` measures a speed difference or makes its own load: it never shares the cores with
    other tests, so it fails in a pytest-xdist worker (`make test` runs it in its serial pass)."""
    if item.get_closest_marker("alone") is not None and os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.fail(f"{item.nodeid} is marked `alone` (it measures speed) and must not run beside other tests: run it "
                    "without pytest-xdist's -n, as `make test`'s second pass does (-m alone)", pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current[0] = item
    try:
        yield
    finally:
        _current[0] = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A violation fails the test even where the code under test caught the failure (or it happened in a thread)."""
    outcome = yield
    report = outcome.get_result()
    msgs = item.stash.get(_violations, [])
    if msgs and not report.failed:
        report.outcome = "failed"
        report.longrepr = "\n".join(msgs)
    item.stash[_violations] = []



from .emulated_jetson.fixtures import *  # noqa: F401,F403,E402  (emulated Jetson devices over real sshd)
