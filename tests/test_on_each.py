"""`each` (jbench.runner.scheduler): a class sweep takes its units' leases and saves their power states side by side, and a failure on
one unit neither hides nor cancels the others' calls (what they took is released by the sweep's cleanup)."""

from __future__ import annotations

import threading

import pytest

from jbench.runner.scheduler import each as _on_each


def test_every_unit_is_called_side_by_side_and_the_first_failure_in_unit_order_is_raised():
    names = [f"u{i}" for i in range(8)]
    barrier = threading.Barrier(len(names), timeout=30)  # passes only when all eight calls run at once
    done: list[str] = []

    def call(name: str) -> None:
        barrier.wait()
        done.append(name)
        if name in ("u5", "u2"):
            raise RuntimeError(f"{name} refused")

    with pytest.raises(RuntimeError, match="u2 refused"):
        _on_each(call, names, max_threads=len(names))
    assert sorted(done) == sorted(names)  # nobody was cancelled by the failures


def test_one_unit_runs_in_the_callers_thread():
    seen: list[str] = []
    _on_each(lambda name: seen.append(threading.current_thread().name), ["solo"])
    assert seen == [threading.current_thread().name]
    _on_each(lambda name: seen.append(name), [])
    assert len(seen) == 1
