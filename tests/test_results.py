"""The shared result type: Result.merge, as its docstring says, lets later values win, findings included."""

from __future__ import annotations

from jbench.core.results import BackendResult, Finding, Result


def test_later_values_win_for_every_kind_of_content():
    record = Result(metrics={"decode_tps": 10.0, "prefill_tps": 100.0}, tags={"power.mode": "15W"},
                    artifacts={"raw/stdout.txt": "first"}, series={"power_w": [(0.0, 5.0)]},
                    stepped={"decode_tps": [9.0, 11.0]})
    out = record.merge(Result(metrics={"decode_tps": 12.0}, tags={"power.mode": "MAXN", "x": "y"},
                              artifacts={"raw/stdout.txt": "second"}, series={"power_w": [(1.0, 6.0)]},
                              stepped={"decode_tps": [12.0]}))
    assert out is record
    assert record.metrics == {"decode_tps": 12.0, "prefill_tps": 100.0}
    assert record.tags == {"power.mode": "MAXN", "x": "y"}
    assert record.artifacts == {"raw/stdout.txt": "second"}
    assert record.series == {"power_w": [(1.0, 6.0)]} and record.stepped == {"decode_tps": [12.0]}


def test_a_later_finding_of_the_same_code_replaces_the_earlier_one_in_its_place():
    early = Finding("cpu_fallback", "GR3D 0 % over 3 samples", {"samples": 3})
    other = Finding("throttling", "over-current", {"count": 1})
    record = Result(findings=[early, other])
    late = Finding("cpu_fallback", "GR3D 0 % over 40 samples", {"samples": 40}, "error")
    new = Finding("swap", "swapped 120 MB")
    record.merge(Result(findings=[late, new]))
    assert record.findings == [late, other, new]  # one finding per code, the newest, in first-seen order
    # Within one merged result too, the last of a code wins.
    record.merge(Result(findings=[Finding("swap", "a"), Finding("swap", "b")]))
    assert [(f.code, f.message) for f in record.findings] == [
        ("cpu_fallback", "GR3D 0 % over 40 samples"), ("throttling", "over-current"), ("swap", "b")]


def test_a_backend_result_merges_like_any_result():
    record = Result(findings=[Finding("slow", "old")])
    record.merge(BackendResult(findings=[Finding("slow", "new")], metrics={"decode_tps": 1.0}))
    assert [f.message for f in record.findings] == ["new"] and record.metrics == {"decode_tps": 1.0}
