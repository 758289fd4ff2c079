"""The history report: each unit x configuration's nightly series plotted, change points marked, noise band shown.

`build_history_report(report, out_dir=...)` writes history.html (self-contained, PNGs as data URIs), history.md
and one PNG per unit x configuration (one panel per metric): the nightly points, each segment between standing
changes as its mean with a band of +-2 noise sigmas (the robust sigma the detector scales by), and a vertical line
at each change (red: regression, green: improvement, orange: changed environment). Figures are drawn for the
series with a verdict to look at first (regression, changed environment, improvement, no verdict, no change), at
most `max_figures`; the markdown table of every series follows.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path
import numpy as np

from jbench.analysis.history import (CHANGED_ENV, IMPROVEMENT, NO_CHANGE, NO_VERDICT, REGRESSION, UNITS,
                                     HistoryReport, SeriesResult, noise_sigma)
from jbench.reporting.report import _CSS, ReportFiles, _figure, _png

__all__ = ["build_history_report"]

COLOURS = {REGRESSION: "tab:red", IMPROVEMENT: "tab:green", CHANGED_ENV: "tab:orange"}
RANK = {REGRESSION: 0, CHANGED_ENV: 1, IMPROVEMENT: 2, NO_VERDICT: 3, NO_CHANGE: 4}


def _panel(ax, r: SeriesResult) -> None:
    y = r.series.values
    x = np.arange(1, y.size + 1)
    ax.plot(x, y, "o-", color="tab:blue", markersize=3, linewidth=0.8)
    bounds = [0, *(c.index for c in r.changes), y.size]
    for a, b in zip(bounds, bounds[1:]):
        seg = y[a:b]
        if not seg.size:
            continue
        sigma = noise_sigma(y)
        mean = float(seg.mean())
        ax.hlines(mean, a + 0.6, b + 0.4, color="black", linewidth=1)
        if np.isfinite(sigma):
            ax.fill_between([a + 0.6, b + 0.4], mean - 2 * sigma, mean + 2 * sigma, color="grey", alpha=0.2,
                            linewidth=0)
    for c in r.changes:
        ax.axvline(c.index + 0.5, color=COLOURS.get(c.kind, "black"), linestyle="--", linewidth=1.2)
        ax.annotate(f"{c.effect * 100:+.1f} %", (c.index + 0.6, float(np.max(y))), fontsize=7,
                    color=COLOURS.get(c.kind, "black"), va="top")
    ax.set_title(f"{r.series.metric}: {r.verdict}", fontsize=9, color=COLOURS.get(r.verdict, "black"))
    ax.set_xlabel("night", fontsize=8)
    ax.set_ylabel(UNITS.get(r.series.metric, ""), fontsize=8)
    ax.tick_params(labelsize=7)


def build_history_report(report: HistoryReport, *, out_dir: str | Path, title: str = "jbench regress: history",
                         max_figures: int = 24) -> ReportFiles:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups: dict[tuple[str, str], list[SeriesResult]] = {}
    for r in report.results:
        groups.setdefault((r.series.unit, r.series.config_hash), []).append(r)
    ordered = sorted(groups.items(), key=lambda kv: (min(RANK.get(r.verdict, 9) for r in kv[1]), kv[0]))
    pngs: dict[str, Path] = {}
    blocks = []
    for i, ((unit, h), rs) in enumerate(ordered[:max_figures]):
        fig, axes = _figure(1, len(rs), size=(3.6 * len(rs) + 0.5, 3.2))
        for ax, r in zip(axes, rs):
            _panel(ax, r)
        fig.suptitle(f"{unit}: {rs[0].series.label} [{h}]", fontsize=10)
        stem = f"history_{i:02d}"
        path = out / f"{stem}.png"
        path.write_bytes(_png(fig))
        pngs[stem] = path
        blocks.append((stem, f"{unit}: {rs[0].series.label} [{h}]", rs))
    md = report.to_markdown()
    skipped = len(ordered) - len(blocks)
    note = (f"{skipped} more unit x configuration group(s) not drawn (see the table)." if skipped > 0 else "")
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
             f"<h1>{html.escape(title)}</h1>",
             "<p>Points: one per night. Black lines: the mean of each segment between standing changes; grey band: "
             "+-2 noise sigmas; dashed lines: changes (red regression, green improvement, orange changed "
             "environment).</p>"]
    for stem, caption, rs in blocks:
        data = base64.b64encode(pngs[stem].read_bytes()).decode("ascii")
        parts.append(f"<h2>{html.escape(caption)}</h2>")
        parts.append(f'<p><img alt="{html.escape(stem)}" src="data:image/png;base64,{data}"></p>')
        parts.append("<ul>" + "".join(f"<li>{html.escape(r.series.metric)}: {html.escape(r.message)}</li>"
                                      for r in rs) + "</ul>")
    if note:
        parts.append(f'<p class="missing">{html.escape(note)}</p>')
    parts.append(f"<h2>All series</h2><pre>{html.escape(md)}</pre></body></html>")
    html_path, md_path = out / "history.html", out / "history.md"
    html_path.write_text("\n".join(parts) + "\n", encoding="utf-8")
    md_path.write_text(md + "".join(f"\n![{stem}]({pngs[stem].name})\n" for stem, _, _ in blocks)
                       + (f"\n_{note}_\n" if note else ""), encoding="utf-8")
    return ReportFiles(html_path, md_path, pngs)
