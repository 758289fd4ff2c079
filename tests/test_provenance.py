"""Which jbench made a record (jbench/core/provenance.py): git_sha never raises, whatever git does. It runs after
the devices are leased, where an exception would cost the sweep."""

from __future__ import annotations

import subprocess

import pytest

from jbench.core import provenance

SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def git(monkeypatch):
    """Plays git: `script` holds what each call does in turn (a CompletedProcess to return, an exception to raise)."""
    calls: list[list[str]] = []
    script: list = []

    def run(argv, **kwargs):
        calls.append(list(argv))
        assert argv[0] == "git" and kwargs.get("timeout"), "git runs with a time limit"
        step = script.pop(0)
        if isinstance(step, BaseException):
            raise step
        return subprocess.CompletedProcess(argv, step[0], step[1], "")

    monkeypatch.setattr(provenance.subprocess, "run", run)
    provenance.git_sha.cache_clear()
    yield script, calls
    provenance.git_sha.cache_clear()


@pytest.mark.parametrize("second, expected", [
    ((0, ""), SHA),
    ((0, " M jbench/x.py\n"), SHA + "-dirty"),
    (subprocess.TimeoutExpired(["git", "status"], 5), SHA + "-unknown-state"),  # hangs
    ((128, ""), SHA + "-unknown-state"),  # fails
    (FileNotFoundError(2, "No such file or directory: 'git'"), SHA + "-unknown-state"),  # gone meanwhile
    (PermissionError(13, "Permission denied"), SHA + "-unknown-state"),
    (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), SHA + "-unknown-state"),
    (subprocess.SubprocessError("broken"), SHA + "-unknown-state"),
])
def test_a_git_that_hangs_or_fails_on_the_second_call_never_raises(git, second, expected):
    script, calls = git
    script.extend([(0, SHA + "\n"), second])
    assert provenance.git_sha() == expected
    assert [c[3:5] for c in calls] == [["rev-parse", "HEAD"], ["status", "--porcelain"]]


@pytest.mark.parametrize("first", [subprocess.TimeoutExpired(["git"], 5), (128, ""), FileNotFoundError(2, "git"),
                                   OSError(8, "Exec format error")])
def test_a_git_that_hangs_or_fails_on_the_first_call_gives_unknown(git, first):
    script, calls = git
    script.append(first)
    assert provenance.git_sha() == "unknown" and len(calls) == 1


def test_the_answer_is_computed_once(git):
    script, calls = git
    script.extend([(0, SHA + "\n"), (0, "")])
    assert provenance.git_sha() == provenance.git_sha() == SHA and len(calls) == 2
