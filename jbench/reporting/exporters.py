"""Tables as text: one registered exporter per format (md, csv, json, jsonl, html) over a pandas DataFrame.

`export(rows_or_frame, fmt, columns=None)` takes a list of row dicts (mixed columns, missing keys, None, NaN)
or a DataFrame and returns the table in that format. What every format shares:

- columns: every column in first-seen order (a row's keys, then the next row's new keys, ...); `columns=`
  picks and orders them, leaving out names no row has. `md` shows the sweep summary's main columns
  (`SUMMARY_COLUMNS`, those present) unless `columns=` is given, or every column when none of them is there;
- missing values: None, NaN, NaT and pd.NA are an empty cell in md, csv and html and `null` in json/jsonl,
  never the text "nan"; infinities are `inf`/`-inf` in text cells and `null` in json (JSON has no infinity);
- floats: `float_format` (`%.6g` by default) in md, csv and html; json keeps every digit (Python's repr);
- md: a GitHub table, numeric columns right-aligned, `|` in a cell escaped as `\\|` and a line break as a space;
- html: pandas' `to_html`, cells escaped, a numeric cell wrapped in `<span class="num">` for a style sheet
  to align (`.num{display:block;text-align:right}`).

JSON is written with the standard library from the frame's records: pandas' `to_json` rounds floats to at most
15 significant digits and writes `/` as `\\/`. The markdown is built here, not with `DataFrame.to_markdown`,
which needs `tabulate`, a dependency for two dozen lines.
"""

from __future__ import annotations

import html
import json
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from datetime import date, datetime
from typing import Any, ClassVar, Optional, Union

import numpy as np
import pandas as pd

from jbench.core.metrics import is_declared

__all__ = ["FORMATS", "SUMMARY_COLUMNS", "Exporter", "export", "exporter", "register", "to_frame", "format_cell",
           "numeric_columns"]

Rows = Sequence[Mapping[str, Any]]

# The sweep summary's main columns: what `md` shows of a summary row (docs/cli.md, "The sweep summary and -o").
# A latency-scenario row's own figures follow (the bench rows of a sweep have none: their cells stay empty).
SUMMARY_COLUMNS: tuple[str, ...] = ("index", "label", "status", "run_id", "n_prompt", "n_gen", "prefill_tps",
                                    "prefill_tps_std", "decode_tps", "decode_tps_std", "ttft_ms_p50", "itl_ms_p50",
                                    "e2e_ms_p50")

DEFAULT_FLOAT_FORMAT = "%.6g"


def _missing(value: Any) -> bool:
    if value is None or value is pd.NA or value is pd.NaT:
        return True
    if isinstance(value, (float, np.floating)):
        return math.isnan(value)
    if isinstance(value, (np.datetime64, np.timedelta64)):
        return bool(np.isnat(value))
    return False


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def format_cell(value: Any, float_format: Optional[str] = DEFAULT_FLOAT_FORMAT) -> str:
    """One value as table text: '' when missing, floats by `float_format` (None: every digit), else str()."""
    if _missing(value):
        return ""
    if isinstance(value, (bool, np.bool_)):
        return str(bool(value))
    if isinstance(value, (float, np.floating)):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(float(value)) if float_format is None else float_format % value
    if isinstance(value, np.integer):
        return str(int(value))
    return str(value)


def _json_value(value: Any) -> Any:
    """A value JSON can hold: missing and non-finite -> None, numpy scalars -> Python, datetimes -> ISO 8601."""
    if _missing(value):
        return None
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, (datetime, date, pd.Timestamp)):
        return value.isoformat()
    return value


def to_frame(rows_or_frame: Union[Rows, pd.DataFrame], columns: Optional[Sequence[str]] = None) -> pd.DataFrame:
    """The rows as a DataFrame: every column in first-seen order, or `columns` (those present, in that order).

    Rows keep their Python values (object columns: an int stays an int, None stays None); a key a row lacks
    is missing (NaN) in that row."""
    if isinstance(rows_or_frame, pd.DataFrame):
        frame = rows_or_frame
    else:
        seen: dict[str, None] = {}
        for row in rows_or_frame:
            seen.update(dict.fromkeys(row))
        frame = pd.DataFrame(list(rows_or_frame), columns=list(seen), dtype=object)
    if columns is not None:
        frame = frame[[c for c in columns if c in frame.columns]]
    return frame


def numeric_columns(frame: pd.DataFrame) -> list[str]:
    """Columns of numbers: a numeric dtype, or values that are all numbers; a column without any value is
    numeric when its name is a declared metric (a planned sweep's empty `decode_tps` still aligns as a number)."""
    out = []
    for name in frame.columns:
        col = frame[name]
        if pd.api.types.is_bool_dtype(col.dtype):
            continue
        if pd.api.types.is_numeric_dtype(col.dtype):
            out.append(name)
            continue
        values = [v for v in col if not _missing(v)]
        if (values and all(_is_number(v) for v in values)) or (not values and is_declared(str(name))):
            out.append(name)
    return out


def _text(frame: pd.DataFrame, float_format: Optional[str]) -> pd.DataFrame:
    """Every cell as its table text, same columns."""
    rows = frame.itertuples(index=False, name=None)
    return pd.DataFrame([[format_cell(v, float_format) for v in row] for row in rows], columns=frame.columns,
                        dtype=object)


class Exporter(ABC):
    """One output format of a table."""

    name: ClassVar[str]

    def columns(self, frame: pd.DataFrame) -> list[str]:
        """The columns shown when the caller names none: every column."""
        return list(frame.columns)

    @abstractmethod
    def render(self, frame: pd.DataFrame, float_format: Optional[str]) -> str:
        """The frame (its columns already chosen) as text."""


_EXPORTERS: dict[str, Exporter] = {}


def register(cls: type[Exporter]) -> type[Exporter]:
    """Class decorator: make `cls.name` a format of `export`."""
    _EXPORTERS[cls.name] = cls()
    return cls


def exporter(fmt: str) -> Exporter:
    """The exporter of a format; ValueError names the valid ones."""
    try:
        return _EXPORTERS[fmt]
    except KeyError:
        raise ValueError(f"unknown output format '{fmt}'. Valid: {', '.join(_EXPORTERS)}") from None


@register
class MarkdownExporter(Exporter):
    """A GitHub markdown table; the summary's main columns by default, numeric columns right-aligned."""

    name = "md"

    def columns(self, frame: pd.DataFrame) -> list[str]:
        # The dimensions live in `label`; every column is what csv and json are for.
        main = [c for c in SUMMARY_COLUMNS if c in frame.columns]
        return main or list(frame.columns)

    def render(self, frame: pd.DataFrame, float_format: Optional[str]) -> str:
        if not len(frame.columns):
            return ""

        def esc(text: Any) -> str:
            return str(text).replace("|", "\\|").replace("\r\n", " ").replace("\n", " ")

        numeric = set(numeric_columns(frame))
        lines = ["| " + " | ".join(esc(c) for c in frame.columns) + " |",
                 "|" + "|".join("---:" if c in numeric else "---" for c in frame.columns) + "|"]
        for row in _text(frame, float_format).itertuples(index=False, name=None):
            lines.append("| " + " | ".join(esc(cell) for cell in row) + " |")
        return "\n".join(lines) + "\n"


@register
class CsvExporter(Exporter):
    """CSV with a header line, every column; missing values empty."""

    name = "csv"

    def render(self, frame: pd.DataFrame, float_format: Optional[str]) -> str:
        if not len(frame.columns):
            return ""
        return _text(frame, float_format).to_csv(index=False, lineterminator="\n")


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    return [{str(k): _json_value(v) for k, v in zip(frame.columns, row)}
            for row in frame.itertuples(index=False, name=None)]


@register
class JsonExporter(Exporter):
    """A JSON array of row objects (every column, null where a row has no value)."""

    name = "json"

    def render(self, frame: pd.DataFrame, float_format: Optional[str]) -> str:
        return json.dumps(_records(frame), indent=2, default=str, allow_nan=False) + "\n"


@register
class JsonLinesExporter(Exporter):
    """One JSON object per line."""

    name = "jsonl"

    def render(self, frame: pd.DataFrame, float_format: Optional[str]) -> str:
        return "".join(json.dumps(r, default=str, allow_nan=False) + "\n"
                       for r in _records(frame))


@register
class HtmlExporter(Exporter):
    """An HTML table (pandas' to_html) with escaped cells; numeric cells as `<span class="num">`."""

    name = "html"

    def render(self, frame: pd.DataFrame, float_format: Optional[str]) -> str:
        numeric = set(numeric_columns(frame))
        cells = _text(frame, float_format)
        for name in cells.columns:
            wrap = name in numeric
            cells[name] = cells[name].map(
                lambda text, wrap=wrap: f'<span class="num">{html.escape(text)}</span>' if wrap and text
                else html.escape(text))
        # Cells are escaped above (to_html would escape the spans too), so the header is escaped here as well.
        cells.columns = [html.escape(str(c)) for c in cells.columns]
        return cells.to_html(index=False, escape=False, border=0, justify="left", na_rep="") + "\n"


FORMATS: tuple[str, ...] = tuple(_EXPORTERS)


def export(rows_or_frame: Union[Rows, pd.DataFrame], fmt: str, columns: Optional[Sequence[str]] = None, *,
           float_format: Optional[str] = DEFAULT_FLOAT_FORMAT) -> str:
    """The rows (a list of dicts or a DataFrame) as a `fmt` table (one of FORMATS); see the module doc.

    columns: the columns to show, in order (names no row has are left out); None: the format's default
    (md: the summary's main columns, else every column). float_format: %-format of floats in md, csv and
    html (None: every digit)."""
    out = exporter(fmt)
    frame = to_frame(rows_or_frame)
    frame = frame[[c for c in (columns if columns is not None else out.columns(frame)) if c in frame.columns]]
    return out.render(frame, float_format)
