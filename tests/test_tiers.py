"""The fast tier's guard (tests/conftest.py): under JBENCH_TEST_TIER=fast a test that starts llama.cpp, sshd,
jbench, mlflow or Chromium without its marker fails and names the marker. Runs pytest on a small test file in a
child process, with stand-in programs of those names (they only exit 0)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

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
