"""A run the user interrupts is never left broken: an SSH session to the controller that drops (SIGHUP, a hung-up
terminal) ends like Ctrl-C, the interrupted trial keeps its config, log and output so far, and the next run resumes
the same sweep under its parent. Through the real `jbench` CLI on the real bundled model, read back with MlflowClient.
"""

from __future__ import annotations

import fcntl
import os
import pty
import signal
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from .conftest import finished_trial_runs, jbench_cli, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# One llama.cpp thread: llama-bench's spinning threads stall each other on cores that other tests share.
SWEEP = ["sweep", "+experiment=quant_ladder", "model.quant=Q4_0,Q4_K_M,Q8_0", "backend.n_prompt=16",
         "backend.n_gen=32", "backend.repetitions=3", "backend.threads=1", "device.lease_wait_s=600",
         "quality.enabled=false"]


def _descendant_named(pid: int, name: str) -> bool:
    """A process under `pid` whose command is `name` runs now (the benchmark jbench started, not another test's)."""
    todo, seen = [str(pid)], set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        try:
            if current != str(pid) and Path(f"/proc/{current}/comm").read_text().strip() == name:
                return True
        except OSError:
            continue
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                todo += (task / "children").read_text().split()
            except OSError:
                continue
    return False


def _runs(results: Path):
    client = MlflowClient(f"sqlite:///{results}/mlflow.db")
    exp = client.get_experiment_by_name("quant_ladder")
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    parents = [r for r in runs if r.data.tags.get("jbench.kind") == "sweep"]
    children = [r for r in runs if r.data.tags.get("jbench.kind") == "trial"]
    return client, parents, children


def test_a_dropped_ssh_session_ends_the_sweep_killed_and_the_rerun_resumes_it(tmp_path, llama_build, bundled_model):
    """jbench runs on a terminal it controls (as in an SSH session without tmux); the session drops: the terminal
    hangs up (SIGHUP, every later write to it fails) and the login shell passes on a second SIGHUP."""
    env = dict(os.environ, JBENCH_RESULTS_DIR=str(tmp_path), COLUMNS="80", TERM="xterm")
    exe = str(Path(sys.executable).with_name("jbench"))
    master, slave = pty.openpty()
    proc = subprocess.Popen([exe, *SWEEP], env=env, stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
                            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))  # its controlling terminal
    os.close(slave)
    seen = bytearray()

    def read() -> None:  # the terminal's other end, as sshd reads it
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                return
            if not chunk:
                return
            seen.extend(chunk)

    threading.Thread(target=read, daemon=True).start()
    try:
        assert wait_until(lambda: finished_trial_runs(tmp_path / "mlflow.db") >= 1 or proc.poll() is not None, 300), \
            "no trial finished"
        assert proc.poll() is None, seen.decode(errors="replace")[-3000:]
        assert wait_until(lambda: _descendant_named(proc.pid, "llama-bench"), 120), "the next trial never measured"
        time.sleep(0.5)  # into its measurement
        os.close(master)  # the session drops: the kernel hangs the terminal up and sends SIGHUP
        time.sleep(0.3)
        proc.send_signal(signal.SIGHUP)  # the login shell's own SIGHUP to its job, while jbench unwinds
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 130, seen.decode(errors="replace")[-3000:]  # as after Ctrl-C: no EIO traceback on the dead terminal

    client, parents, first = _runs(tmp_path)
    assert len(parents) == 1 and parents[0].info.status == "KILLED", [p.info.status for p in parents]
    assert not [c for c in first if c.info.status == "RUNNING"]
    killed = [c for c in first if c.info.status == "KILLED"]
    assert len(killed) == 1 and killed[0].data.tags["jbench.failure_reason"] == "interrupted (SIGHUP)"
    # The interrupted trial keeps what a FAILED one keeps: its resolved config, its log, the output so far.
    kept = {a.path for a in client.list_artifacts(killed[0].info.run_id)}
    assert {"config.yaml", "trial.log", "raw"} <= kept, kept
    raw = {a.path for a in client.list_artifacts(killed[0].info.run_id, "raw")}
    assert raw & {"raw/stdout.txt", "raw/stderr.txt"}, raw
    log = Path(client.download_artifacts(killed[0].info.run_id, "trial.log", str(tmp_path / "dl"))).read_text()
    assert "interrupted (SIGHUP)" in log, log
    sweep_id = parents[0].data.tags["jbench.sweep_id"]

    res = jbench_cli(SWEEP, env_extra={"JBENCH_RESULTS_DIR": str(tmp_path)})
    assert res.returncode == 0, res.stdout + res.stderr
    _, parents, children = _runs(tmp_path)
    # One sweep: the KILLED parent goes on under its sweep id and finishes with every trial.
    assert len(parents) == 1 and parents[0].info.status == "FINISHED", [p.info.run_name for p in parents]
    assert parents[0].data.tags["jbench.resumed_after"] == "interrupted (SIGHUP)"
    assert {c.data.tags["jbench.sweep_id"] for c in children} == {sweep_id}
    assert sorted(c.info.run_name for c in children if c.info.status == "FINISHED") == ["Q4_0", "Q4_K_M", "Q8_0"]


def _objects(build: Path) -> dict[str, int]:
    return {str(p.relative_to(build)): p.stat().st_mtime_ns for p in build.rglob("*.o")} if build.exists() else {}


def _ctrl_c_when(proc: subprocess.Popen, ready, timeout: float) -> tuple[int, str, str]:
    """Ctrl-C as the terminal sends it (SIGINT to jbench's process group) once `ready()`; (exit code, out, err)."""
    try:
        assert wait_until(lambda: ready() or proc.poll() is not None, timeout), "never ready"
        assert proc.poll() is None, proc.communicate()
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out, err


def test_ctrl_c_during_setup_exits_130_and_the_next_setup_resumes_the_build(tmp_path, llama_build):
    """An empty jbench cache (its sources linked from the real one, so nothing is downloaded): `jbench setup` compiles
    llama.cpp, Ctrl-C stops it (exit 130, no "failed"), and the next `jbench setup` goes on from the objects compiled
    so far instead of deleting the build directory."""
    from jbench.models import provision

    real = provision.paths.llamacpp_builds_dir()
    cache = tmp_path / "cache"
    sdist = f"llama_cpp_python-{provision.LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    (cache / "llama.cpp" / "sdist").mkdir(parents=True)
    (cache / "llama.cpp" / "sdist" / sdist).symlink_to(real / "sdist" / sdist)
    (cache / "llama.cpp" / "src").mkdir()
    source = f"llama-cpp-python-{provision.LLAMA_CPP_PYTHON_VERSION}"
    (cache / "llama.cpp" / "src" / source).symlink_to(real / "src" / source)
    # Its compiler cache in the empty jbench cache too, never a warm one of the machine's (.ci/run sets CCACHE_DIR):
    # the build must still be compiling when Ctrl-C comes.
    env = {**{k: v for k, v in os.environ.items() if k != "CCACHE_DIR"}, "JBENCH_CACHE_DIR": str(cache),
           "COLUMNS": "80"}
    exe = str(Path(sys.executable).with_name("jbench"))
    argv = [exe, "setup", "--skip-model", "--no-cuda", "-j", "2"]
    root = next(iter(Path(llama_build["bin_dir"]).parents)).name  # <version>-<commit>-cpu-<machine>, as cached
    build = cache / "llama.cpp" / root / "build"

    def start() -> subprocess.Popen:
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)  # its own process group, as a shell's foreground job

    rc, out, err = _ctrl_c_when(start(), lambda: len(_objects(build)) >= 6, 300)
    assert rc == 130, out + err
    assert "failed" not in out + err and "interrupted" in err and "Traceback" not in err, out + err
    first = _objects(build)
    assert len(first) >= 6

    again = start()
    rc, out, err = _ctrl_c_when(again, lambda: len(_objects(build)) > len(first), 300)
    assert rc == 130, out + err
    assert f"resuming the unfinished build in {build.parent}" in out, out
    after = _objects(build)
    # Every object of the first run is still there, not compiled again: the build went on from them.
    assert {k: after.get(k) for k in first} == first
    assert len(after) > len(first)
