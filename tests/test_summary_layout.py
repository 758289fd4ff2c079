"""The summary table's layout and the progress bar's time left, as pure functions (the real CLI's output is checked
in tests/test_sweep_summary.py): one line per trial at any width from 80 columns, cut text listed in full, and an
ETA that is the earlier runs' durations, unknown rather than guessed."""

from __future__ import annotations

import re
from types import SimpleNamespace as NS

import pytest
from rich.console import Console

from jbench.cli.summary import Eta, summary_tables
from jbench.core.results import Category, Status


def _trial(index: int, label: str):
    backend = NS(n_prompt=16, n_gen=4, repetitions=2)
    return NS(index=index, label=label, short_label=label, point={"x": label}, cfg=NS(backend=backend))


def _outcome(index: int, label: str, status=Status.FINISHED, category=None, error=None, noisy=False):
    metrics = {"prefill_tps": 1234.56, "prefill_tps_std": 123.4, "decode_tps": 56.78, "decode_tps_std": 1.23}
    return NS(trial=_trial(index, label), status=status, category=category, error=error, noisy=noisy,
              run_id=f"{index:08x}" + "0" * 24, metrics=metrics if status == Status.FINISHED else {})


@pytest.mark.parametrize("width", [80, 100, 140])
def test_every_trial_is_one_line_and_what_is_cut_is_listed_in_full(width):
    error = "llama-bench exited with code 1:\n" + "error: unknown argument --bogus\n" * 12
    outcomes = [_outcome(1, "gemma3_270m Q4_K_M n_gen=128 depth=4096 /models/very/long/path/to/a.gguf", noisy=True),
                _outcome(2, "gemma3_270m Q8_0", Status.FAILED, Category.BACKEND_CRASH, error),
                _outcome(3, "Q4_0", Status.SKIPPED, Category.RESUMED, "already FINISHED", noisy=True)]
    outcomes[2].metrics = dict(outcomes[0].metrics)
    console = Console(width=width, record=True)
    (part,) = summary_tables(NS(experiment="e", sweep_id="s", parent_run_id="p", outcomes=outcomes), ["x"],
                             lambda t, keys: t.label, console)
    console.print(part.table)
    lines = console.export_text().splitlines()
    assert max(len(line.rstrip()) for line in lines) <= width
    rows = [line for line in lines if re.match(r"^\s*\d+\s{2,}", line)]
    assert len(rows) == 3, "\n".join(lines)  # one line each: nothing wrapped
    assert "1234.6 ± 123.4" in rows[0] and "FINISHED*" in rows[0]
    assert "EARLIER*" in rows[2] and "1234.6 ± 123.4" in rows[2] and "already" not in rows[2]
    assert rows[1].split()[1] == "gemma3_270m" and "FAILED" in rows[1]
    # The failure's note and the long label are cut in the table and given in full below it.
    cut = "\n".join(part.cut)
    assert error.strip() in cut and "…" in rows[1]
    assert ("…" in rows[0]) == (outcomes[0].trial.label in cut) and ("…" in rows[0]) == (width < 140)


def test_eta_is_the_earlier_durations_left_and_unknown_until_it_can_be_known():
    now = [0.0]
    eta = Eta({1: 10.0, 2: 20.0, 3: 30.0}, clock=lambda: now[0])
    assert eta.seconds() == 60.0 and eta.text() == "0:01:00"
    eta.skip([3])  # resume skips it: no time
    assert eta.seconds() == 30.0
    eta.start(1)
    now[0] = 4.0
    assert eta.seconds() == 26.0  # the running trial counts what it has left
    now[0] = 15.0
    assert eta.seconds() == 20.0  # ... never less than nothing
    eta.end(1, 15.0, ran=True)
    eta.end(3, 0.0, ran=False)
    assert eta.seconds() == 20.0

    blind = Eta({1: None, 2: 10.0}, clock=lambda: now[0])
    assert blind.seconds() is None and blind.text() == "-:--:--"  # no history, nothing measured: unknown
    blind.start(2)
    blind.end(2, 8.0, ran=True)
    assert blind.seconds() == 8.0  # a trial without history counts as long as this sweep's measured ones


def test_eta_over_units_spreads_the_work():
    eta = Eta({1: 10.0, 2: 10.0, 3: 10.0, 4: 10.0}, clock=lambda: 0.0)
    eta.start(1, "u1")
    eta.start(2, "u2")
    assert eta.seconds() == 20.0
