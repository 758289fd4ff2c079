"""The table exporters (jbench/reporting/exporters.py): every format over rows with mixed columns, missing keys,
None, NaN, infinities, floats and characters that need escaping; csv, json and jsonl read back through pandas."""

from __future__ import annotations

import csv
import io
import json
import math
from html.parser import HTMLParser

import numpy as np
import pandas as pd
import pytest

from jbench.reporting.exporters import FORMATS, SUMMARY_COLUMNS, Exporter, export, exporter, format_cell, register

NAN = float("nan")

# Two sweep-summary rows as the CLI builds them (a finished trial, a failed one with fewer keys), out of the
# main columns' order, with a dimension column, a `|` in a label, a line break and a comma in an error.
ROWS = [
    {"index": 1, "model.quant": "Q4_0", "label": "Q4_0 a|b", "status": "FINISHED", "run_id": "16070adc" * 4,
     "config_hash": "8b538c", "n_prompt": 16, "n_gen": 4, "repetitions": 2, "category": None, "error": None,
     "noisy": True, "wall_s": 4.25, "prefill_tps": 567.8123456, "prefill_tps_std": 0.9, "decode_tps": 69.5,
     "decode_tps_std": 5.9, "decode_energy_j": 0.1 + 0.2, "decode_tps_cv": NAN, "model.path": "/models/a b.gguf"},
    {"index": 2, "model.quant": "Q8_0", "label": "Q8_0", "status": "FAILED", "run_id": None, "config_hash": "4656f4",
     "n_prompt": 16, "n_gen": 4, "repetitions": 2, "category": "backend_crash", "error": 'exit 1, "oops"\nsegfault',
     "noisy": False, "wall_s": 1.0, "decode_energy_j": math.inf},
]


def test_formats_are_registered_and_an_unknown_one_is_named():
    assert FORMATS == ("md", "csv", "json", "jsonl", "html")
    assert all(exporter(f).name == f for f in FORMATS)
    with pytest.raises(ValueError, match="unknown output format 'xlsx'. Valid: md, csv, json, jsonl, html"):
        export(ROWS, "xlsx")


def test_format_cell():
    assert format_cell(None) == format_cell(NAN) == format_cell(np.float32("nan")) == format_cell(pd.NA) == ""
    assert format_cell(pd.NaT) == format_cell(np.datetime64("NaT")) == ""
    assert format_cell(567.8123456) == "567.812" and format_cell(1234567.0) == "1.23457e+06"
    assert format_cell(np.float64(0.5)) == "0.5" and format_cell(2.0) == "2" and format_cell(1 / 3, "%.4g") == "0.3333"
    assert format_cell(0.1 + 0.2, None) == "0.30000000000000004"
    assert format_cell(math.inf) == "inf" and format_cell(-math.inf) == "-inf"
    assert format_cell(7) == "7" and format_cell(np.int64(1234567)) == "1234567"  # integers are never %g-rounded
    assert format_cell(True) == "True" and format_cell(np.bool_(False)) == "False" and format_cell("x|y") == "x|y"


# --------------------------------------------------------------------------------------------
# md


def _md_cells(line: str) -> list[str]:
    """A markdown row's cells, `\\|` kept inside its cell."""
    inner = line.strip()[1:-1].replace("\\|", "\0")
    return [c.strip().replace("\0", "|") for c in inner.split("|")]


def test_md_is_the_main_columns_right_aligned_and_escaped():
    out = export(ROWS, "md")
    assert out == (
        "| index | label | status | run_id | n_prompt | n_gen | prefill_tps | prefill_tps_std | decode_tps "
        "| decode_tps_std |\n"
        "|---:|---|---|---|---:|---:|---:|---:|---:|---:|\n"
        "| 1 | Q4_0 a\\|b | FINISHED | 16070adc16070adc16070adc16070adc | 16 | 4 | 567.812 | 0.9 | 69.5 | 5.9 |\n"
        "| 2 | Q8_0 | FAILED |  | 16 | 4 |  |  |  |  |\n")
    lines = out.splitlines()
    # The summary's main columns that the rows have (a latency trial's TTFT, ITL and e2e columns: none here).
    assert all(len(_md_cells(line)) == len([c for c in SUMMARY_COLUMNS if c in ROWS[0]]) for line in lines)
    assert _md_cells(lines[2])[1] == "Q4_0 a|b"
    assert "nan" not in out.lower()


def test_md_of_a_planned_sweep_aligns_its_empty_rate_columns_as_numbers():
    planned = [{"index": 1, "label": "Q4_0", "status": "PLANNED", "run_id": None, "n_prompt": 16, "n_gen": 4,
                "estimate_s": 3.0}]
    out = export(planned, "md")
    assert out.splitlines()[1] == "|---:|---|---|---|---:|---:|"
    # An empty column that is a declared metric is a number column, also when it is there but empty.
    out = export([dict(planned[0], decode_tps=None)], "md")
    assert out.splitlines()[1] == "|---:|---|---|---|---:|---:|---:|"


def test_md_with_other_columns_shows_them_all_or_those_asked_for():
    rows = [{"finding": "throttling", "value": "decode: 3 OC1 | events\nmore", "runs": 2},
            {"finding": "swap_used", "value": None, "runs": NAN}]
    assert export(rows, "md") == ("| finding | value | runs |\n|---|---|---:|\n"
                                  "| throttling | decode: 3 OC1 \\| events more | 2 |\n| swap_used |  |  |\n")
    assert export(rows, "md", columns=["runs", "nope", "finding"]) == (
        "| runs | finding |\n|---:|---|\n| 2 | throttling |\n|  | swap_used |\n")
    assert export(ROWS, "md", columns=["label", "decode_energy_j"]).splitlines()[2:] == [
        "| Q4_0 a\\|b | 0.3 |", "| Q8_0 | inf |"]


# --------------------------------------------------------------------------------------------
# csv


def test_csv_has_every_column_in_first_seen_order_and_reads_back():
    rows = [{"a": 1, "b": "x"}, {"c": 2.5, "a": 3}, {"b": None, "d": NAN}]
    out = export(rows, "csv")
    assert out == "a,b,c,d\n1,x,,\n3,,2.5,\n,,,\n"
    back = pd.read_csv(io.StringIO(out))
    assert list(back.columns) == ["a", "b", "c", "d"] and back["a"].tolist()[:2] == [1, 3] and back["d"].isna().all()


def test_csv_round_trip_of_summary_rows():
    out = export(ROWS, "csv")
    assert "nan" not in out.lower()
    header = out.splitlines()[0].split(",")
    assert header == list(ROWS[0])
    back = pd.read_csv(io.StringIO(out))
    assert back.shape == (2, len(ROWS[0]))
    first, second = back.iloc[0], back.iloc[1]
    assert first["prefill_tps"] == 567.812  # %.6g
    assert first["decode_energy_j"] == pytest.approx(0.3) and math.isinf(second["decode_energy_j"])
    assert first["label"] == "Q4_0 a|b" and first["model.path"] == "/models/a b.gguf"
    assert second["error"] == 'exit 1, "oops"\nsegfault'  # quoted: comma, quotes and the line break survive
    assert pd.isna(second["run_id"]) and pd.isna(first["decode_tps_cv"]) and pd.isna(second["decode_tps"])
    assert bool(first["noisy"]) is True and bool(second["noisy"]) is False
    # The csv module reads the same cells; a missing value is an empty cell.
    cells = list(csv.DictReader(io.StringIO(out)))
    assert cells[1]["run_id"] == "" and cells[1]["prefill_tps"] == "" and cells[0]["n_prompt"] == "16"


# --------------------------------------------------------------------------------------------
# json and jsonl


def test_json_is_an_array_with_null_for_missing_values_and_every_digit():
    out = export(ROWS, "json")
    data = json.loads(out)
    assert isinstance(data, list) and len(data) == 2 and out.endswith("]\n")
    assert [list(r) for r in data] == [list(ROWS[0])] * 2  # every column, first-seen order
    first, second = data
    assert first["decode_energy_j"] == 0.1 + 0.2 and first["prefill_tps"] == 567.8123456  # exact, not %.6g
    assert first["decode_tps_cv"] is None and first["category"] is None  # NaN and None
    assert second["prefill_tps"] is None and second["decode_energy_j"] is None  # a key it lacks; infinity
    assert first["noisy"] is True and first["n_prompt"] == 16 and first["model.path"] == "/models/a b.gguf"
    assert "NaN" not in out and "Infinity" not in out and "\\/" not in out
    back = pd.read_json(io.StringIO(out), orient="records")
    assert list(back.columns) == list(ROWS[0]) and back["decode_tps"].tolist()[0] == 69.5


def test_jsonl_is_one_object_per_line_and_reads_back():
    out = export(ROWS, "jsonl")
    lines = out.splitlines()
    assert len(lines) == 2 and out.endswith("\n")
    objs = [json.loads(line) for line in lines]
    assert objs == json.loads(export(ROWS, "json"))
    back = pd.read_json(io.StringIO(out), lines=True)
    assert back.shape == (2, len(ROWS[0])) and back["status"].tolist() == ["FINISHED", "FAILED"]
    assert back["label"].tolist() == ["Q4_0 a|b", "Q8_0"] and pd.isna(back["run_id"][1])


def test_json_of_a_frame_with_numpy_values_and_timestamps():
    df = pd.DataFrame({"run_id": ["r1", "r2"], "start_time": pd.to_datetime(["2025-01-01", None], utc=True),
                       "metrics.decode_tps": [10.5, np.nan], "runs": np.array([3, 4], dtype=np.int64),
                       "ok": [True, False]})
    data = json.loads(export(df, "json"))
    assert data[0] == {"run_id": "r1", "start_time": "2025-01-01T00:00:00+00:00", "metrics.decode_tps": 10.5,
                       "runs": 3, "ok": True}
    assert data[1]["start_time"] is None and data[1]["metrics.decode_tps"] is None and data[1]["runs"] == 4
    assert json.loads(export(df, "jsonl").splitlines()[1]) == data[1]


# --------------------------------------------------------------------------------------------
# html


class _Cells(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self.spans: list[str] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "span" and ("class", "num") in attrs and self._cell is not None:
            self.spans.append("")

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append("".join(self._cell).strip())
            self._cell = None


def test_html_is_a_table_with_escaped_cells_and_numbers_marked():
    rows = [{"name": "<b>x</b> & y", "value": 1.5, "n": 3, "note": None},
            {"name": "z", "value": NAN, "n": 4, "note": "a|b"}]
    out = export(rows, "html")
    assert out.startswith("<table") and "<script" not in out and "<b>" not in out
    assert "&lt;b&gt;x&lt;/b&gt; &amp; y" in out
    parser = _Cells()
    parser.feed(out)
    assert parser.rows == [["name", "value", "n", "note"], ["<b>x</b> & y", "1.5", "3", ""], ["z", "", "4", "a|b"]]
    assert out.count('<span class="num">') == 3  # 1.5, 3, 4: the empty number cell has no span
    assert "nan" not in out.lower()
    assert export(rows, "html", float_format="%.4g") == out
    assert '<span class="num">0.3333</span>' in export([{"v": 1 / 3}], "html", float_format="%.4g")


def test_html_escapes_column_names():
    out = export([{"a<b": 1}], "html")
    assert "<th>a&lt;b</th>" in out


# --------------------------------------------------------------------------------------------
# frames, options, empty input


def test_a_frame_keeps_its_column_order_and_float_format_applies():
    df = pd.DataFrame({"quant": ["Q4_0", "Q8_0"], "decode_tps": [69.51234, np.nan], "runs": [2, 3]})
    assert export(df, "md", columns=list(df.columns), float_format="%.4g") == (
        "| quant | decode_tps | runs |\n|---|---:|---:|\n| Q4_0 | 69.51 | 2 |\n| Q8_0 |  | 3 |\n")
    assert export(df, "csv", float_format=None) == "quant,decode_tps,runs\nQ4_0,69.51234,2\nQ8_0,,3\n"
    # md's default is the summary's main columns, those the frame has.
    assert export(df, "md").splitlines()[0] == "| decode_tps |"
    assert export(df, "csv", columns=["runs", "quant"]) == "runs,quant\n2,Q4_0\n3,Q8_0\n"


def test_pandas_string_columns_with_missing_values():
    df = pd.DataFrame({"tag": pd.array(["a", None], dtype="string"), "x": [1.0, 2.0]})
    assert export(df, "csv") == "tag,x\na,1\n,2\n"
    assert json.loads(export(df, "json"))[1] == {"tag": None, "x": 2.0}


@pytest.mark.parametrize("fmt, empty", [("md", ""), ("csv", ""), ("json", "[]\n"), ("jsonl", "")])
def test_no_rows(fmt, empty):
    assert export([], fmt) == empty


def test_no_rows_but_columns():
    df = pd.DataFrame({"a": pd.Series([], dtype=float), "b": pd.Series([], dtype=object)})
    assert export(df, "csv") == "a,b\n"
    assert export(df, "md", columns=["a", "b"]) == "| a | b |\n|---:|---|\n"
    assert export(df, "json") == "[]\n"
    parser = _Cells()
    parser.feed(export(df, "html"))
    assert parser.rows == [["a", "b"]]


def test_a_registered_exporter_is_a_format():
    from jbench.reporting import exporters

    @register
    class Tsv(Exporter):
        name = "tsv"

        def render(self, frame, float_format):
            return frame.to_csv(sep="\t", index=False, lineterminator="\n")

    try:
        assert export([{"a": 1, "b": "x"}], "tsv") == "a\tb\n1\tx\n"
    finally:
        del exporters._EXPORTERS["tsv"]
    with pytest.raises(ValueError):
        exporter("tsv")
