"""The fast tier's guard (tests/conftest.py): under JBENCH_TEST_TIER=fast a test that starts llama.cpp, sshd,
jbench, mlflow or Chromium without its marker fails and names the marker. Runs pytest on a small test file in a
child process, with stand-in programs of those names (they only exit 0)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO, TESTS

INNER = '''
import subprocess, threading
import pytest

def test_unmarked_llama_bench():
    subprocess.run(["llama-bench", "-o", "jsonl"], check=True)

@pytest.mark.e2e
def test_marked_llama_bench():
    subprocess.run(["llama-bench", "-o", "jsonl"], check=True)

def test_unmarked_sshd_in_a_shell_line():
    subprocess.run("cd / && sshd -t -f /dev/null", shell=True, check=True)

@pytest.mark.ssh
def test_sshd_marked_ssh():
    subprocess.run(["sudo", "-n", "sshd", "-t"], check=True)

def test_unmarked_jbench_in_a_thread_caught():
    def run():
        try:
            subprocess.run(["jbench", "sweep"], check=True)
        except BaseException:
            pass
    t = threading.Thread(target=run)
    t.start()
    t.join()

def test_unmarked_stand_in_from_tests_fixtures():
    subprocess.run([FIXTURE], check=True)

def test_unmarked_missing_program_starts_nothing():
    with pytest.raises(FileNotFoundError):
        subprocess.run(["/nonexistent/llama-bench"])
'''


def _run_inner(tmp_path: Path, tier: str) -> tuple[dict[str, str], str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("llama-bench", "sshd", "jbench", "sudo"):
        exe = bin_dir / name
        exe.write_text("#!/bin/sh\nexit 0\n" if name != "sudo" else '#!/bin/sh\nshift; exec "$@"\n')
        exe.chmod(0o755)
    fixture = TESTS / "fixtures" / "unparseable_llamacpp" / "llama-bench"
    (tmp_path / "test_inner.py").write_text(f"FIXTURE = {str(fixture)!r}\n" + INNER)
    env = dict(os.environ, JBENCH_TEST_TIER=tier, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    res = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-rA",
                          "-W", "ignore", "test_inner.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    outcomes = dict((m.group(2), m.group(1)) for m in
                    re.finditer(r"^(PASSED|FAILED) test_inner\.py::(\w+)", res.stdout, re.M))
    assert len(outcomes) == 7, res.stdout + res.stderr
    return outcomes, res.stdout


def test_fast_tier_fails_unmarked_heavy_processes_and_names_the_marker(tmp_path):
    out, text = _run_inner(tmp_path, "fast")
    assert out["test_unmarked_llama_bench"] == "FAILED"
    assert out["test_unmarked_sshd_in_a_shell_line"] == "FAILED"
    assert out["test_unmarked_jbench_in_a_thread_caught"] == "FAILED"  # caught, and in a thread: still fails
    assert out["test_marked_llama_bench"] == "PASSED"
    assert out["test_sshd_marked_ssh"] == "PASSED"
    assert out["test_unmarked_stand_in_from_tests_fixtures"] == "PASSED"
    assert out["test_unmarked_missing_program_starts_nothing"] == "PASSED"
    assert "test_unmarked_llama_bench starts llama.cpp's llama-bench" in text
    assert "is not marked `e2e`: add @pytest.mark.e2e" in text
    assert "test_unmarked_sshd_in_a_shell_line starts sshd" in text and "is not marked `ssh`" in text
    assert "test_unmarked_jbench_in_a_thread_caught starts the jbench CLI" in text


def test_guard_is_off_outside_the_fast_tier(tmp_path):
    out, text = _run_inner(tmp_path, "")
    assert set(out.values()) == {"PASSED"}, text


# --- Where tests run: `make test`'s two passes, `make test-fast` in parallel ------------------------------------

def _recipe(target: str) -> str:
    """The recipe of `target` in the Makefile, its continuation lines joined."""
    lines = (REPO / "Makefile").read_text().split("\n")
    start = lines.index(next(x for x in lines if x.startswith(f"{target}:")))
    body = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        body.append(line.strip())
    return " ".join(body).replace("\\ ", " ")


def _pytest_runs(recipe: str) -> list[str]:
    return [m.group(1) for m in re.finditer(r"-m pytest (.*?)(?:\|\||;|$)", recipe)]


def test_make_test_runs_every_test_once_the_alone_ones_by_themselves():
    """The parallel pass takes -m "not alone", the serial pass -m "alone" and no -n: together every test, once.
    Neither deselects anything else (no -k, --deselect, --ignore), and the exit status keeps either's failure."""
    recipe = _recipe("test")
    runs = _pytest_runs(recipe)
    assert len(runs) == 2, recipe
    parallel, serial = runs
    assert re.search(r'-m "not alone"(\s|$)', parallel) and re.search(r"-n \S+", parallel), parallel
    assert re.search(r'-m "alone"(\s|$)', serial) and " -n " not in f" {serial} ", serial
    for run in runs:
        assert not re.search(r"(^|\s)(-k|--deselect|--ignore|--ignore-glob|-x|--exitfirst)(\s|=|$)", run), run
        assert len(re.findall(r"(^|\s)-m\s", run)) == 1, run
    assert "|| status=$$?" in recipe and "exit $$status" in recipe, recipe


def test_make_test_fast_runs_on_xdist_workers():
    [run] = _pytest_runs(_recipe("test-fast"))
    assert re.search(r"-n \S+", run) and '-m "not e2e and not ssh and not slow and not coordinator"' in run, run


ALONE_INNER = '''
import pytest

@pytest.mark.alone
def test_measures_alone():
    pass
'''


@pytest.mark.slow  # two pytest processes, one with an xdist worker: ~5 s
def test_an_alone_test_fails_in_an_xdist_worker_and_passes_serially(tmp_path):
    (tmp_path / "test_alone_inner.py").write_text(ALONE_INNER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    env.pop("JBENCH_TEST_TIER", None)
    env.pop("PYTEST_XDIST_WORKER", None)
    base = [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-rA", "-W", "ignore",
            "test_alone_inner.py"]
    serial = subprocess.run(base, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert serial.returncode == 0 and "PASSED test_alone_inner.py::test_measures_alone" in serial.stdout, serial.stdout
    parallel = subprocess.run([*base, "-n", "1"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert parallel.returncode == 1, parallel.stdout + parallel.stderr
    assert "test_measures_alone is marked `alone`" in parallel.stdout and "must not run beside other tests" \
        in parallel.stdout, parallel.stdout
