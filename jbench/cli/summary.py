"""The sweep's summary on the terminal, and the time a sweep has left.

One line per run at any width from 80 columns (also a pipe's 80): the number columns never wrap, a label or note
too long for its column is cut with `…` and its full text printed below the table. Each scenario gets its own
table with its own figures: tok/s (mean ± sd over the repetitions) for llama-bench-like trials, TTFT, ITL and
end-to-end latency percentiles over the requests for llama.cpp's latency scenario. A trial resumed from an earlier
sweep shows that run's figures, status `EARLIER` (`FINISHED (earlier)` in -o rows and MLflow's summary.json).
Output quality (mean KLD, same-top %) and the backend's peak memory get a column each only when a trial of the table
has them; at a width too narrow for them all, same-top % goes first, then the memory (both stay in -o rows).

Below the tables, `choice_lines`: the choice within the sweep's quality bar (`quality.max_kld`,
`quality.min_same_top_pct`; `jbench.analysis.choice`) with its speed, tokens per joule and memory, or that none
meets it, or, without a bar, the speed/quality Pareto front; nothing when no trial measured quality and
`quality.enabled` is off.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from rich import box
from rich.cells import cell_len
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from jbench.analysis.choice import Choice, QualityBar, choose
from jbench.core.results import Category, Status
from jbench.core.trial import ChoosesKVTypes, HasScenario

RUN_ID_CHARS = 8  # the run-id prefix the summary prints; `jbench compare` accepts it
EARLIER = "FINISHED (earlier)"  # a resumed trial's status in rows, as in the sweep's summary.json
LATENCY = "latency"
SERVING = "serving"
SERVER_SCENARIOS = (LATENCY, SERVING)


def is_earlier(outcome: Any) -> bool:
    """Skipped because a FINISHED run of the same trial exists: its figures are that run's."""
    return outcome.status == Status.SKIPPED and outcome.category == Category.RESUMED


def scenario(trial: Any) -> str:
    """What a trial measures: "latency" (llama.cpp's llama-server scenario: TTFT, ITL, e2e), "serving" (load levels:
    capacity, knee, tokens/J) or "bench" (tok/s)."""
    b = trial.cfg.backend
    return b.scenario if isinstance(b, HasScenario) and b.scenario in SERVER_SCENARIOS else "bench"


def number(value: Any) -> Optional[float]:
    """A finite float, else None (a figure the run does not have)."""
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def fmt(value: Any, std: Any = None) -> str:
    """A figure as the table shows it: `-` when missing, `mean ± sd` when a spread is given."""
    v, s = number(value), number(std)
    if v is None:
        return "-"
    digits = 1 if abs(v) >= 10 else 2
    return f"{v:.{digits}f}" if s is None else f"{v:.{digits}f} ± {s:.{digits}f}"


def status_text(outcome: Any) -> str:
    """The status column: FINISHED, FAILED, KILLED, SKIPPED, EARLIER (resumed); `*` marks a noisy trial."""
    text = "EARLIER" if is_earlier(outcome) else str(outcome.status)
    return text + ("*" if outcome.noisy else "")


def note_text(outcome: Any) -> str:
    """The note column in full: the run-id prefix, and why a trial did not finish (its category and error)."""
    note = (outcome.run_id or "")[:RUN_ID_CHARS]
    if str(outcome.status) != "FINISHED" and not is_earlier(outcome):
        note += f" {outcome.category}: {outcome.error}"
    return note.strip()


@dataclass
class _Figure:
    header: str
    cell: Callable[[dict], str]
    metric: str = ""  # an optional column's metric: shown only when a row has it


def _cell(value: Any, spec: str) -> str:
    """A figure by a format spec (`.3g`, `.0f`), `-` when missing."""
    v = number(value)
    return "-" if v is None else format(v, spec)


# Optional columns, dropped from the last when the width is short: same top first, then the memory, then KLD.
_OPTIONAL = (
    _Figure("KLD\nmean", lambda m: _cell(m.get("quality_kld_mean"), ".3g"), "quality_kld_mean"),
    _Figure("peak\nMiB", lambda m: _cell(m.get("memory_peak_rss_mib"), ".0f"), "memory_peak_rss_mib"),
    _Figure("same\ntop %", lambda m: _cell(m.get("quality_same_top_pct"), ".1f"), "quality_same_top_pct"),
)
_OPTIONAL_TEXT = {"quality_kld_mean": "KLD mean: mean KL divergence of the next-token distributions against the "
                                      "quality reference (quality_kld_mean, nat)",
                  "memory_peak_rss_mib": "peak MiB: the backend process's peak resident set (memory_peak_rss_mib)",
                  "quality_same_top_pct": "same top %: tokens whose most likely next token is the reference's "
                                          "(quality_same_top_pct)"}


def _shared(trials: list, setting: Callable[[Any], Any]) -> Optional[Any]:
    """A backend setting (`setting(backend config)`, None where that backend has none) every trial shares, else
    None."""
    values = {repr(setting(t.cfg.backend)) for t in trials}
    return setting(trials[0].cfg.backend) if len(values) == 1 else None


def _size(name: str) -> Callable[[Any], Any]:
    """A llama-bench-like size (n_prompt, n_gen, repetitions) of a backend config; None for a backend without it."""
    return lambda b: getattr(b, name) if hasattr(b, name) else None


def _figures(kind: str, trials: list) -> tuple[list[_Figure], str]:
    """The figure columns of one scenario and the caption that says what they are."""
    if kind == SERVING:
        caption = ("max out tok/s: the highest level's output tok/s; knee: load where throughput stops growing in "
                   "proportion; SLO cap: highest load meeting serving.slo (≥: not bracketed); tok/J: output tokens "
                   "per joule at it; every level in MLflow and serving/levels.csv")

        def cap(m: dict) -> str:
            v = number(m.get("serving_slo_capacity"))
            if v is None:
                return "-"
            return ("≥" if number(m.get("serving_slo_capacity_high")) is None else "") + f"{v:g}"

        return [_Figure("max out\ntok/s", lambda m: _cell(m.get("serving_max_output_tps"), ".1f")),
                _Figure("knee\nload", lambda m: _cell(m.get("serving_knee_load"), "g")),
                _Figure("SLO\ncap", cap),
                _Figure("tok/J\nat cap", lambda m: _cell(m.get("serving_capacity_output_tokens_per_joule"), ".3g"))], \
            caption
    if kind == LATENCY:
        n = _shared(trials, lambda b: b.latency_requests)
        conc = _shared(trials, lambda b: b.latency_concurrency)
        over = f"{n} requests" if n is not None else "each trial's backend.latency_requests requests"
        caption = (f"p50: median over {over}" + (f", {conc} in flight" if conc is not None else "")
                   + "; p90, p99 and means in -o csv/json and MLflow")
        return [_Figure("TTFT ms\np50", lambda m: fmt(m.get("ttft_ms_p50"))),
                _Figure("ITL ms\np50", lambda m: fmt(m.get("itl_ms_p50"))),
                _Figure("e2e ms\np50", lambda m: fmt(m.get("e2e_ms_p50")))], caption
    pp, tg = _shared(trials, _size("n_prompt")), _shared(trials, _size("n_gen"))
    reps = _shared(trials, _size("repetitions"))
    caption = "mean ± sd: mean and standard deviation over " + (f"{reps} repetitions" if reps else "the repetitions")
    if pp is None or tg is None:
        caption += "; pp/tg sizes: backend.n_prompt / backend.n_gen of each trial"
    return [_Figure(f"prefill tok/s\npp{pp if pp is not None else ''} mean ± sd",
                    lambda m: fmt(m.get("prefill_tps"), m.get("prefill_tps_std"))),
            _Figure(f"decode tok/s\ntg{tg if tg is not None else ''} mean ± sd",
                    lambda m: fmt(m.get("decode_tps"), m.get("decode_tps_std")))], caption


@dataclass
class SummaryTable:
    """One scenario's table and the full text of what its rows had to cut."""

    table: Table
    legend: list[str]  # what the columns and marks mean
    cut: list[str] = field(default_factory=list)  # "3 label: full note" for every row cut to fit


def _cut(text: str, width: int) -> str:
    """The text's start, `…` where it is cut (a note: its run id comes first)."""
    t = Text(text)
    t.truncate(width, overflow="ellipsis")
    return t.plain


def _cut_middle(text: str, width: int) -> str:
    """Start and end with `…` between: a label's first and last values (the quant, a path's last part) tell rows
    apart."""
    if cell_len(text) <= width:
        return text
    if width < 3:
        return _cut(text, width)
    head = width // 2
    tail = width - 1 - head
    return text[:head] + "…" + (text[-tail:] if tail else "")


def summary_tables(outcome: Any, keys: list[str], label: Callable[[Any, list[str]], str],
                   console: Console) -> list[SummaryTable]:
    """The sweep's summary: a table per scenario (bench first), each fitting `console.width`."""
    kinds = sorted({scenario(o.trial) for o in outcome.outcomes}, key=lambda k: (k == LATENCY, k == SERVING))
    out = []
    for n, kind in enumerate(kinds):
        rows = [o for o in outcome.outcomes if scenario(o.trial) == kind]
        if n == 0:
            title = (f"{outcome.experiment}: sweep {outcome.sweep_id}" if outcome.parent_run_id is not None
                     else f"{outcome.experiment}: nothing run, every trial already FINISHED")
        else:
            title = {LATENCY: "latency scenario (llama-server)", SERVING: "serving scenario (load levels)"}.get(kind, kind)
        out.append(_table(title, kind, rows, keys, label, console))
    return out


def _table(title: str, kind: str, rows: list, keys: list[str], label: Callable[[Any, list[str]], str],
           console: Console) -> SummaryTable:
    figures, caption = _figures(kind, [o.trial for o in rows])
    optional = [f for f in _OPTIONAL if any(number(o.metrics.get(f.metric)) is not None for o in rows)]
    # The legend goes under the table, a line per entry, as messages are printed: never hard-wrapped (greppable).
    legend = [caption + (f"; trials vary {', '.join(keys)}" if keys else "")]
    if any(is_earlier(o) for o in rows):
        legend.append("EARLIER: FINISHED by an earlier sweep of this experiment; its run and figures are shown "
                      "(sweep.rerun=true measures it again)")
    if any(o.noisy for o in rows):
        legend.append("*: noisy, a rate's coefficient of variation is above sweep.max_cv")
    labels = [label(o.trial, keys) for o in rows]
    notes = [" ".join(note_text(o).split()) for o in rows]  # one line: a multi-line error is shown below in full

    def build(label_w: int, note_w: int, cells: bool, shown: list[_Figure], narrow: bool = False) -> Table:
        # narrow: one space less between columns (collapsed padding), tried before an optional column is dropped.
        table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=narrow)
        table.add_column("#", justify="right", no_wrap=True)
        table.add_column("trial", width=label_w, no_wrap=True, overflow="ellipsis")
        table.add_column("status", no_wrap=True)
        for f in shown:
            table.add_column(f.header, justify="right", no_wrap=True)
        table.add_column("run id\n/ note", width=note_w, no_wrap=True, overflow="ellipsis")
        for o, lb, nt in zip(rows, labels, notes):
            color = {"FINISHED": "green", "FAILED": "red", "SKIPPED": "cyan"}.get(str(o.status), "yellow")
            color = "cyan" if is_earlier(o) else color
            table.add_row(str(o.trial.index), escape(_cut_middle(lb, label_w)) if cells else "",
                          f"[{color}]{status_text(o)}[/]", *(f.cell(o.metrics) for f in shown),
                          escape(_cut(nt, note_w)) if cells else "")
        return table

    need_label = max([cell_len(lb) for lb in labels] + [len("trial")])
    need_note = max([cell_len(nt) for nt in notes] + [len("/ note")])
    # The note keeps at least the run id (and a `…` when it is cut); the label gets the rest first.
    min_note = min(need_note, RUN_ID_CHARS + 1)
    dropped: list[_Figure] = []
    # Without optional columns the layout is as it always was; with them, narrower gaps first, then fewer columns.
    tries = [False, True] if optional else [False]
    while True:
        shown = figures + optional
        for narrow in tries:
            # The width left for the label and the note once the fixed columns are laid out (measured, not assumed).
            fixed = Measurement.get(console, console.options.update_width(10 ** 6),
                                    build(1, 1, False, shown, narrow)).maximum - 2
            room = console.width - fixed
            if room >= min(need_label, 8) + min_note:
                break
        if room >= min(need_label, 8) + min_note or not optional:
            break
        dropped.insert(0, optional.pop())  # the least needed first: same top %, then the memory
    legend += [_OPTIONAL_TEXT[f.metric] for f in optional]
    if dropped:
        legend.append(f"left out at this width (in -o csv/json and MLflow): {', '.join(f.metric for f in dropped)}")
    label_w = max(min(need_label, room - min_note), min(need_label, 8))
    note_w = max(min(need_note, room - label_w), min_note)
    table = build(label_w, note_w, True, shown, narrow)
    cut = [f"{o.trial.index} {lb}: {note_text(o)}" for o, lb, nt in zip(rows, labels, notes)
           if cell_len(lb) > label_w or cell_len(nt) > note_w]
    return SummaryTable(table, legend, cut)


def print_summary(outcome: Any, keys: list[str], label: Callable[[Any, list[str]], str], console: Console) -> None:
    """The summary tables, each followed by the full text of the notes it cut."""
    for part in summary_tables(outcome, keys, label, console):
        console.print(part.table)
        for line in part.legend:
            console.print(escape(line), highlight=False)
        if part.cut:
            console.print("in full:", highlight=False)
            for line in part.cut:
                console.print(f"  {escape(line)}", highlight=False, soft_wrap=True)


# --- The choice within the quality bar ----------------------------------------------------------------------


def _bar(trials: list) -> tuple[Optional[QualityBar], bool, list[str]]:
    """The sweep's quality bar (its trials' `quality.max_kld` / `quality.min_same_top_pct`), whether any trial had
    `quality.enabled`, and notes. Trials that set different bars: the strictest of each (said in a note)."""
    qs = [t.cfg.quality for t in trials]
    enabled = any(q.enabled for q in qs)
    kld = {q.max_kld for q in qs if q.max_kld is not None}
    top = {q.min_same_top_pct for q in qs if q.min_same_top_pct is not None}
    notes = []
    if len(kld) > 1 or len(top) > 1:
        notes.append("the trials set different quality bars: the strictest of each is applied")
    bar = QualityBar(min(kld) if kld else None, max(top) if top else None)
    return (None if bar.empty else bar), enabled, notes


def _choice_row(o: Any, label: str) -> dict[str, Any]:
    """What the choice reads of one outcome: label, status, quant, KV types, metrics, the quality tags."""
    cfg = o.trial.cfg
    kv = (cfg.backend.cache_type_k, cfg.backend.cache_type_v) if isinstance(cfg.backend, ChoosesKVTypes) else (None,
                                                                                                              None)
    status = EARLIER if is_earlier(o) else str(o.status)
    row: dict[str, Any] = {"label": label, "status": status, "model.quant": cfg.model.quant,
                           "backend.cache_type_k": kv[0], "backend.cache_type_v": kv[1]}
    row.update(o.metrics or {})
    tags = getattr(getattr(o, "record", None), "tags", None) or {}
    for k in ("quality.meaning", "quality.reference", "quality.status"):
        if tags.get(k):
            row[k] = tags[k]
    return row


def _group(o: Any) -> tuple[str, str, int]:
    """What a choice is made within: the device, the model, and the context depth the trial decodes at (a workload,
    not a choice: "q8_0 KV at depth 4096" is no answer for a user whose prompts are 512 tokens)."""
    cfg = o.trial.cfg
    depth = int(cfg.backend.depth or 0) if hasattr(cfg.backend, "depth") else 0  # a backend without the setting: 0
    return str(o.device or cfg.device.name or ""), str(cfg.model.name or ""), depth


def sweep_choices(outcome: Any, keys: list[str],
                  label: Callable[[Any, list[str]], str]) -> list[tuple[tuple[str, str, int], Choice]]:
    """The choice within the sweep's quality bar per (device, model, depth) of the bench scenario's trials; empty
    when no trial measured quality and `quality.enabled` is off."""
    outcomes = [o for o in outcome.outcomes if scenario(o.trial) not in SERVER_SCENARIOS]
    bar, enabled, _ = _bar([o.trial for o in outcomes])
    measured = any(number((o.metrics or {}).get(m)) is not None for o in outcomes
                   for m in ("quality_kld_mean", "quality_same_top_pct"))
    if not outcomes or not (measured or enabled):
        return []
    groups: dict[tuple[str, str], list] = {}
    for o in outcomes:
        groups.setdefault(_group(o), []).append(o)
    return [(g, choose([_choice_row(o, label(o.trial, keys)) for o in os_], bar)) for g, os_ in groups.items()]


def choice_lines(outcome: Any, keys: list[str], label: Callable[[Any, list[str]], str]) -> list[str]:
    """The choice as the summary prints it: per (device, model, depth) a headline and its reasons (indented), the caveat
    of what the quality figures measure; a line per group only when the sweep has several."""
    choices = sweep_choices(outcome, keys, label)
    _, _, notes = _bar([o.trial for o in outcome.outcomes if scenario(o.trial) not in SERVER_SCENARIOS])
    lines: list[str] = []
    several = {what: len({g[i] for g, _ in choices}) > 1 for i, what in enumerate(("device", "model", "depth"))}
    for (device, model, depth), choice in choices:
        prefix = ""
        if several["device"] or several["model"]:
            prefix = f"{model} on {device}"
        if several["depth"]:
            prefix += f"{' ' if prefix else ''}at depth {depth}"
        prefix += ": " if prefix else ""
        lines.append("quality: " + prefix + choice.headline())
        lines += [f"  {r}" for r in choice.reasons]
        lines += [f"  caveat: {c}" for c in choice.caveats]
    if lines:
        lines += [f"  note: {n}" for n in notes]
    return lines


def print_choice(outcome: Any, keys: list[str], label: Callable[[Any, list[str]], str], console: Console) -> None:
    """`choice_lines` on the console, never hard-wrapped (greppable)."""
    for line in choice_lines(outcome, keys, label):
        console.print(escape(line), highlight=False, soft_wrap=True)


class Eta:
    """The time a sweep has left, from each trial's expected duration (earlier runs of the same configuration).

    A trial without history counts as long as the trials this sweep measured took on average; until one has been
    measured the time left is unknown (None), never a guess. Trials resume skips take no time. The trial running now
    counts what it has left of its estimate. Over several units (a device class) the sum is spread over the units
    that have started a trial."""

    def __init__(self, expected: dict[int, Optional[float]], clock: Callable[[], float] = time.monotonic):
        self.expected = dict(expected)
        self.left = set(expected)
        self.running: dict[int, float] = {}  # trial index -> when it started
        self.measured: list[float] = []
        self.units: set[str] = set()
        self.clock = clock

    def skip(self, indices: list[int]) -> None:
        """Trials resume will not run (already FINISHED)."""
        for i in indices:
            self.expected[i] = 0.0

    def start(self, index: int, unit: str = "") -> None:
        self.running[index] = self.clock()
        self.units.add(unit)

    def end(self, index: int, wall_s: float, ran: bool) -> None:
        """A trial ended; `ran`: it was measured (its wall time teaches the estimate of trials without history)."""
        self.left.discard(index)
        self.running.pop(index, None)
        if ran and wall_s > 0:
            self.measured.append(wall_s)

    def seconds(self) -> Optional[float]:
        """The estimated seconds left, or None when some trial has neither history nor a measured sibling."""
        now = self.clock()
        typical = sum(self.measured) / len(self.measured) if self.measured else None
        total = 0.0
        for i in self.left:
            e = self.expected.get(i)
            e = e if e is not None else typical
            if e is None:
                return None
            if i in self.running:
                e = max(0.0, e - (now - self.running[i]))
            total += e
        return total / max(1, len(self.units))

    def text(self) -> str:
        """`h:mm:ss` as rich's columns write a duration, `-:--:--` when unknown."""
        s = self.seconds()
        if s is None:
            return "-:--:--"
        s = int(round(s))
        return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
