"""`jbench sweep`, `run` and `setup`: plan, execute, progress and the summary table.

The summary is a rich table on the terminal (readable at 80 columns, which is also what rich assumes
in a pipe), or, with `-o md|csv|json|jsonl`, the same rows in that format on stdout while everything
else goes to stderr (docs/cli.md). Under it, the choice within the sweep's quality bar when trials measured
output quality (`cli/summary.py` `choice_lines`; docs/choosing.md).
"""

from __future__ import annotations

import difflib
import time
from typing import Any, Callable, Optional

import click
from rich.console import Console
from rich.markup import escape
from rich.text import Text

from jbench.cli.app import (_OVERRIDES, _config_dir_option, _fail, _signals_as_interrupt, common_options,
                        console, err_console, main)
from jbench.cli.summary import (EARLIER, RUN_ID_CHARS, Eta, is_earlier, number, print_choice, print_summary,
                                scenario)
from jbench.core import metrics as M
from jbench.core.exitcodes import ExitCode
from jbench.core.schema import ModelConfig, typed
from jbench.runner.recorder import preload

OUTPUT_FORMATS = ("table", "md", "csv", "json", "jsonl")


def _hydra_quoted(value: str) -> str:
    """A value as a quoted Hydra override value (a path may hold spaces, ':' or '=')."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _with_results_dir(overrides, results_dir: Optional[str]) -> list[str]:
    # --results-dir is tracking.results_dir; given last, it wins over the same key on the command line.
    return list(overrides) + ([f"tracking.results_dir={_hydra_quoted(results_dir)}"] if results_dir else [])


def _plan(overrides, config_dirs, use_grid: bool):
    from jbench.sweeps.sweep import SweepInputError, plan_sweep

    try:
        return plan_sweep(list(overrides), list(config_dirs), use_grid=use_grid)
    except SweepInputError as exc:
        raise _fail(str(exc)) from None


# --- Rows of the summary --------------------------------------------------------------------------------------


def varying_keys(trials) -> list[str]:
    """The sweep dimensions whose value differs between the given trials (in the order of the grid)."""
    keys: list[str] = []
    for t in trials:
        keys += [k for k in t.point if k not in keys]
    return [k for k in keys if len({repr(t.point.get(k)) for t in trials}) > 1]


def trial_label(trial, keys: list[str]) -> str:
    """What a row is, compactly: the varying dimensions' values (`Q4_0`, `Q8_0 n_gen=128`)."""
    short = getattr(trial, "short_label", None)  # the trial's own short run name, where it has one
    if isinstance(short, str) and short:
        return short
    parts = []
    for k in keys:
        v = trial.point.get(k)
        # A name (Q4_0, MAXN_SUPER, a device) says what it is; a number or flag needs its key.
        if isinstance(v, str) and not v.replace(".", "").isdigit():
            parts.append(v)
        else:
            parts.append(f"{k.rsplit('.', 1)[-1]}={v}")
    return " ".join(parts) or trial.label


def _backend_size(trial, key: str) -> Optional[Any]:
    """A size (n_prompt, n_gen, repetitions) of the trial's backend config; None for a backend without it, and
    repetitions of a latency trial (its requests are `latency_requests`)."""
    if key == "repetitions" and scenario(trial) == "latency":
        return None
    return getattr(trial.cfg.backend, key) if hasattr(trial.cfg.backend, key) else None


def _records(trials, outcomes=None, *, status: str = "PLANNED") -> list[dict]:
    """One flat row per trial (a plan) or per run (`outcomes`: a trial measured twice under sweep.rerun_noisy has a
    row per attempt): index, the varying dimensions, status, run id, sizes, then the metrics."""
    keys = varying_keys(trials)
    rows = []
    for t, o in (zip([o.trial for o in outcomes], outcomes) if outcomes is not None else ((t, None) for t in trials)):
        row: dict[str, Any] = {"index": t.index, **{k: t.point.get(k) for k in keys}, "label": trial_label(t, keys),
                               "status": str(o.status) if o else status, "run_id": (o.run_id if o else None),
                               "config_hash": t.config_hash,
                               **{k: _backend_size(t, k) for k in ("n_prompt", "n_gen", "repetitions")}}
        if o is not None:
            metrics = {k: number(v) for k, v in o.metrics.items()}
            if is_earlier(o):  # the earlier run's figures, marked as such; it neither failed nor took time now
                wall = metrics.get("trial_wall_s")
                row.update({"status": EARLIER, "attempt": o.attempt, "device": o.device, "category": None,
                            "error": None, "noisy": bool(o.noisy), "wall_s": round(wall, 3) if wall else None})
            else:
                row.update({"attempt": o.attempt, "device": o.device,
                            "category": str(o.category) if o.category else None, "error": o.error,
                            "noisy": bool(o.noisy), "wall_s": round(o.wall_s, 3)})
            main_keys = ("prefill_tps", "prefill_tps_std", "decode_tps", "decode_tps_std")
            row.update({k: metrics.get(k) for k in main_keys})
            row.update({k: v for k, v in sorted(metrics.items()) if k not in main_keys})
        rows.append(row)
    return rows


def format_records(rows: list[dict], fmt: str) -> str:
    """The rows in an output format (jbench.reporting.exporters: md shows the main columns, csv/json/jsonl all)."""
    from jbench.reporting.exporters import export

    return export(rows, fmt)


# --- Progress ------------------------------------------------------------------------------------------------


class _TrialProgress:
    """A rich progress bar on a terminal (removed when the sweep ends, so no half-drawn bar stays), plain
    lines anywhere else (a pipe, a file, a CI log)."""

    def __init__(self, out: Console, total: int, keys: list[str], pool: bool = False, eta: Optional[Eta] = None):
        self.out, self.total, self.keys = out, total, keys
        self.pool = pool
        self.running: dict[str, str] = {}  # unit -> the trial it runs (a pool's bar shows every unit)
        # The time left from the planner's per-trial estimates (rich's own ETA needs several trials within 30 s).
        self.eta = eta or Eta({})
        self.skipped: set[int] = set()  # trial indices resume skips
        self.bar = None
        if out.is_terminal:
            from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn

            eta_ = self.eta

            class EtaColumn(ProgressColumn):
                def render(self, task) -> Text:
                    return Text(eta_.text(), style="progress.remaining")

            self.bar = Progress(TextColumn("[bold]trial {task.completed}/{task.total}[/]"), BarColumn(),
                                TimeElapsedColumn(), TextColumn("ETA"), EtaColumn(),
                                TextColumn("{task.description}"), console=out, transient=True)
            self.task = self.bar.add_task("", total=total)
        self.done = 0

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc):
        self.stop()
        return False

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()

    def print(self, text: str) -> None:
        (self.bar.console if self.bar is not None else self.out).print(text, highlight=False)

    def resumed(self, trials) -> None:
        """The trials resume skips: they take no time, and do not 'run'."""
        self.skipped = {t.index for t in trials}
        self.eta.skip(list(self.skipped))

    def start(self, trial) -> None:
        if trial.index in self.skipped:
            return  # its one line comes when it ends: FINISHED earlier
        label = escape(trial_label(trial, self.keys))
        device = trial.cfg.device.name
        self.eta.start(trial.index, device)
        if self.pool:  # a sweep over a device class: what each unit runs now
            self.running[device] = label
        if self.bar is not None:
            text = "; ".join(f"{escape(d)}: {lb}" for d, lb in self.running.items()) if self.pool else f"running {label}"
            self.bar.update(self.task, description=text)
        else:
            self.print(f"{self._on(device)}trial {self.done + 1}/{self.total} {label}: running")

    def _on(self, device) -> str:
        """The prefix naming the unit of a pool's line (plain lines in a pipe stay one per line)."""
        return f"{escape(device)}: " if self.pool and device else ""

    def end(self, outcome) -> None:
        self.done += 1
        label = escape(trial_label(outcome.trial, self.keys))
        on = self._on(getattr(outcome, "device", None))
        self.eta.end(outcome.trial.index, outcome.wall_s, ran=outcome.status in ("FINISHED", "FAILED"))
        if self.bar is not None:
            self.bar.advance(self.task)
        elif is_earlier(outcome):
            self.print(f"{on}trial {self.done}/{self.total} {label}: FINISHED earlier "
                       f"(run {(outcome.run_id or '')[:RUN_ID_CHARS]}, resumed)")
        elif outcome.status not in ("FAILED", "SKIPPED"):  # those get their own line below, with the reason
            self.print(f"{on}trial {self.done}/{self.total} {label}: {outcome.status} ({outcome.wall_s:.0f} s)")
        for finding in outcome.findings:
            self.print(f"{on}[yellow]trial {outcome.trial.index} finding:[/] {escape(finding.message)}")
        if outcome.status == "FAILED":
            self.print(f"{on}[red]trial {self.done}/{self.total} {label} FAILED[/] ({outcome.category}): "
                       f"{escape(str(outcome.error))}")
        elif outcome.status == "SKIPPED" and not is_earlier(outcome):
            self.print(f"{on}[cyan]trial {self.done}/{self.total} {label} skipped[/] ({outcome.category}): "
                       f"{escape(str(outcome.error))}")


def _estimate_line(ests) -> str:
    """The dry run's total: the trials that will run and how long those with history take; never a total that
    counts a trial without history as 0 s, nor a trial resume skips."""
    run = [e for e in ests if not e.finished or e.unsure]
    known = [e.seconds for e in run if e.seconds]
    unknown = len(run) - len(known)
    done = sum(1 for e in ests if e.finished and not e.unsure)
    unsure = sum(1 for e in ests if e.unsure)
    minutes = f"{sum(known) / 60:.1f} min" if known else ""
    if not run:
        line = "estimated duration: nothing to run"
    elif not unknown:
        line = (f"estimated duration: {minutes} for the {len(run)} trial(s) to run (from earlier runs of the same "
                "configuration)")
    elif not known:
        line = (f"estimated duration: unknown: none of the {len(run)} trial(s) to run has an earlier run of the "
                "same configuration to time it by")
    else:
        line = (f"estimated duration: more than {minutes} for the {len(run)} trial(s) to run: {len(known)} take "
                f"{minutes} by earlier runs of the same configuration, {unknown} have no earlier run (not counted)")
    if done:
        line += (f"; {done} already FINISHED with the same build and model file (resume skips them unless "
                 "sweep.rerun=true)")
    if unsure:
        line += (f"; {unsure} FINISHED earlier with the same configuration on a remote device (counted: skipped only "
                 "if its backend build and model file are unchanged)")
    return line


def _execute(plan_, dry_run: bool, fmt: str = "table", search: Optional[dict] = None) -> None:
    from jbench.sweeps.sweep import (PreflightError, SweepInputError, check_store, durations, estimates, run_sweep,
                                     tracker_factory)

    # With -o FORMAT stdout carries only the summary; every message and the progress go to stderr.
    console = globals()["console"] if fmt == "table" else err_console
    if plan_.problems:
        click.echo(click.style("error:", fg="red", bold=True)
                   + f" {len(plan_.problems)} problem(s) in the sweep; nothing was run:", err=True)
        for p in plan_.problems:
            click.echo(f"  - {p}", err=True)
        raise click.exceptions.Exit(ExitCode.BAD_INPUT)
    if not plan_.trials:
        raise _fail("the sweep has no trials")
    console.print(f"[bold]{escape(plan_.experiment)}[/]: {len(plan_.trials)} trial(s)"
                  + (f" over {', '.join(plan_.dims)}" if plan_.dims else ""), highlight=False)
    for note in plan_.notes:
        console.print(f"[cyan]note:[/] {escape(note)}", highlight=False)
    notes_shown = len(plan_.notes)
    keys = varying_keys(plan_.trials)
    if dry_run:
        try:
            ests = estimates(plan_)
        except SweepInputError as exc:
            raise _fail(str(exc)) from None
        rows = _records(plan_.trials)
        for e, row in zip(ests, rows):
            # A trial resume skips takes no time: its earlier duration is no estimate of this sweep's.
            row["estimate_s"] = round(e.seconds, 1) if e.seconds and (e.unsure or not e.finished) else None
            row["already_finished"] = e.finished
            row["finished_unsure"] = e.unsure
            est = ("FINISHED earlier: resume skips it" if e.finished and not e.unsure
                   else f"FINISHED earlier on the device, ~{e.seconds:.0f} s if run" if e.unsure and e.seconds
                   else f"~{e.seconds:.0f} s" if e.seconds else "no estimate (no earlier run)")
            t = e.trial
            full = f"{escape(t.label)}  " if t.label != trial_label(t, keys) else ""
            console.print(f"  {t.index:>4}  {escape(trial_label(t, keys))}  [dim]{full}{t.config_hash}  {est}[/]",
                          highlight=False)
        console.print(_estimate_line(ests), highlight=False, soft_wrap=True)
        if fmt != "table":
            click.echo(format_records(rows, fmt), nl=False)
        return

    searcher, goal, pareto = _searcher(plan_, search, lambda: factory()) if search else (None, None, None)
    try:
        store = check_store(plan_.tracking, plan_.experiment, len(plan_.trials))
    except SweepInputError as exc:
        raise _fail(str(exc)) from None
    if store.spool:
        console.print(f"[yellow]{escape(store.notice)}[/]", highlight=False)
    else:
        console.print(f"tracking to {store.shown}", highlight=False)

    def say(message: str) -> None:
        progress.print(f"[yellow]{escape(message)}[/]")

    _signals_as_interrupt()
    eta = Eta(durations(plan_)) if console.is_terminal else None  # only the bar shows it
    factory = tracker_factory(plan_.tracking, store, say)
    with _TrialProgress(console, len(plan_.trials), keys, pool=plan_.pool is not None, eta=eta) as progress:
        order = searcher.order if searcher is not None else None

        def end(outcome) -> None:
            if searcher is not None:  # the search looks at each outcome before it chooses the next trial
                searcher.observe(outcome)
            progress.end(outcome)
        try:
            result = run_sweep(plan_, factory, on_trial_start=progress.start, on_trial_end=end,
                               on_resume=progress.resumed, order=order)
        except PreflightError as exc:
            progress.stop()
            raise _fail(f"the device is not ready; nothing was run:\n{exc}") from None
        except KeyboardInterrupt:
            progress.stop()
            err_console.print("[yellow]interrupted: the current trial and the sweep are recorded as KILLED[/]")
            raise click.exceptions.Exit(ExitCode.INTERRUPTED) from None
    done_keys = varying_keys([o.trial for o in result.outcomes])
    if fmt == "table":
        print_summary(result, done_keys, trial_label, console)
    else:
        click.echo(format_records(_records([o.trial for o in result.outcomes], result.outcomes), fmt), nl=False)
    # The choice within the quality bar: under the table, or on stderr beside -o's rows (stdout stays the rows).
    print_choice(result, done_keys, trial_label, console)
    for note in result.notes[notes_shown:]:  # drops decided at preflight (backends not available)
        console.print(f"[cyan]note:[/] {escape(note)}", highlight=False)
    for note in sorted({n for o in result.outcomes for n in o.notes}):  # said once per sweep, not once per trial
        err_console.print(f"[yellow]energy not measured:[/] {escape(note)}", highlight=False, soft_wrap=True)
    t = result.tracker
    if t is not None and getattr(t, "disk_full", False):  # the last trial filled the disk: its record is spooled
        raise _fail(f"disk full: {t.shown_uri} has no space left; what was measured is kept in the spool "
                    f"{t.spool_uri}: free some space and run the same command again (it uploads the spool)")
    if t is not None and getattr(t, "spooling", None) is not None:
        console.print(f"results: spooled in {t.spool_uri} (experiment '{escape(result.experiment)}') because "
                      f"{t.shown_uri} did not answer; `jbench sync` uploads them once it is back",
                      highlight=False, soft_wrap=True)
    else:
        console.print(f"results: {store.shown} (experiment '{escape(result.experiment)}'); "
                      f"browse them with `jbench ui`", highlight=False, soft_wrap=True)
    if result.failed:
        err_console.print(f"[bold red]{len(result.failed)} of {len(result.outcomes)} trial(s) failed[/]")
    code = result.exit_code
    if searcher is not None and not _search_answer(plan_, searcher, goal, pareto, result, console) \
            and code == ExitCode.OK:
        code = ExitCode.NO_VERDICT  # the search ran, and there is no answer
    raise click.exceptions.Exit(code)


def _searcher(plan_, search: dict, tracker: Callable[[], Any]):
    """(Search, Goal, Pareto metrics) for `sweep --search`; bad input ends in one message (exit 2)."""
    from jbench.cli.goals import goal_from
    from jbench.sweeps.search import Search, SearchSettings, decode_ceiling

    if plan_.pool is not None:
        raise _fail("--search runs on one device: name it (device=NAME), not a device class")
    if not plan_.dims:
        raise _fail("--search chooses among a grid's trials: give an experiment with a grid or comma lists "
                    "(key=a,b)")
    goal, pareto = goal_from(search["goal"], search["maximize"], search["minimize"], tuple(search["requires"]))

    # Before any device: a metric the trials cannot record would leave every configuration undecided.
    for metric in (goal.objective, *(c.metric for c in goal.constraints)):
        decl = M.find(metric)
        if decl is None:
            close = difflib.get_close_matches(metric, M.declared_names(), n=3)
            raise _fail(f"--search: '{metric}' is not a metric jbench records (docs/metrics.md)"
                        + (f"; did you mean {' or '.join(close)}?" if close else ""))
        if decl.group == "quality" and not any(t.cfg.quality.enabled for t in plan_.trials):
            raise _fail(f"--search: '{metric}' is measured by the quality pass: add quality.enabled=true (or use "
                        "+experiment=quant_ladder, which enables it)")
    settings = SearchSettings(budget_trials=search["budget_trials"], budget_s=search["budget_s"],
                              max_runs=search["max_runs"], patience=search["patience"], seed=search["seed"])
    problems = settings.problems()
    if problems:
        raise _fail("; ".join(problems))
    opened: list = []

    def earlier(run_id: str) -> dict:
        if not opened:
            opened.append(tracker())
        return dict(opened[0].run_record(run_id)["metrics"])

    return Search(goal, settings, dims=plan_.dims, upper_bound=decode_ceiling, earlier_metrics=earlier), goal, pareto


def _search_answer(plan_, searcher, goal, pareto, result, console) -> bool:
    """What the search measured, why it stopped, and the advisor's answer over this sweep's runs (True: an answer)."""
    from jbench.cli.advise import print_advice
    from jbench.cli.goals import answer
    from jbench.tracking.reader import runs_frame

    grid = len({t.config_hash for t in plan_.trials})
    measured = len(searcher.measured)
    console.print(f"search: {measured} of {grid} configuration(s) measured in {searcher.runs} run(s); stopped: "
                  f"{searcher.stop_reason}", highlight=False, soft_wrap=True)
    for trial, why in searcher.pruned:
        console.print(f"[cyan]ruled out before running:[/] {escape(trial.label)}: {escape(why)}", highlight=False)
    # Every run the search used: its own, and those FINISHED earlier that it was answered with (resume).
    run_ids = [o.run_id for o in result.outcomes if o.run_id]
    df = runs_frame(result.tracker, [result.experiment], run_ids=run_ids) \
        if result.tracker is not None and run_ids else None
    if df is None or df.empty or "status" not in df.columns or not (df["status"] == "FINISHED").any():
        console.print("NO VERDICT: the search finished no trial: no answer", highlight=False)
        return False
    advice = answer(result.tracker, df, goal, pareto)
    print_advice(advice)
    return advice.outcome == "found"


def _show_config(what: str, package: Optional[str], overrides, config_dirs, use_grid: bool) -> None:
    """--cfg job: the composed config of the command line (a sweep's grid included); --cfg sweep: the
    resolved config of every planned trial, one YAML document each. Nothing runs, no store is touched."""
    from omegaconf import OmegaConf

    from jbench.config import ConfigError, check_overrides, compose, user_config_dirs
    from jbench.sweeps.plan import split_overrides

    def select(config: dict) -> Any:
        if not package:
            return config
        node = OmegaConf.select(OmegaConf.create(config), package, default=None)
        if node is None:
            raise _fail(f"--package {package}: no such key in the config; give a section such as backend or model")
        return OmegaConf.to_container(node) if OmegaConf.is_config(node) else node

    def dump(value: Any) -> str:
        return OmegaConf.to_yaml(OmegaConf.create(value)) if isinstance(value, (dict, list)) else f"{value}\n"

    if what == "job":
        try:
            check_overrides(list(overrides))
            dirs = user_config_dirs(list(config_dirs))
            pool, composable = _class_overrides(list(overrides), dirs)
            plain, dims = split_overrides(composable)
            cfg, _ = compose(plain, dirs)
        except ConfigError as exc:
            raise _fail(str(exc)) from None
        if pool is not None:  # as the plan has it: the trials' device is the class, a unit runs them
            cfg.device.name, cfg.device.device_class = pool.name, pool.device_class
        config = OmegaConf.to_container(cfg, resolve=True)
        if pool is not None:
            err_console.print(f"note: {_units_text(pool)}", highlight=False, soft_wrap=True)
        if dims:
            err_console.print(f"note: command-line sweep dimensions ({', '.join(dims)}) are not applied here; "
                              "--cfg sweep prints each trial's config", highlight=False, soft_wrap=True)
        click.echo(dump(select(config)), nl=False)
        return
    plan_ = _plan(overrides, config_dirs, use_grid)
    keys = varying_keys(plan_.trials)
    for n, t in enumerate(plan_.trials):
        click.echo(("---\n" if n else "") + f"# trial {t.index}: {trial_label(t, keys)} (config hash {t.config_hash})")
        click.echo(dump(select(t.config)), nl=False)
    for p in plan_.problems:  # shown, not fatal: --cfg inspects the plan, it runs nothing
        click.echo(f"problem: {p}", err=True)


def _class_overrides(overrides: list[str], dirs: list) -> tuple[Any, list[str]]:
    """(the pool of a `device=@CLASS` override or None, the overrides to compose with): the class is no device
    entry, so it is composed as the plan composes it, with its first unit's entry (ConfigError as the plan's)."""
    from jbench.sweeps.plan import class_pool  # the planner's own reading of device=@CLASS, so both agree

    return class_pool(overrides, dirs)


def _units_text(pool: Any) -> str:
    """Which units a `device=@CLASS` runs on, as --info and --cfg job say it."""
    if pool.coordinator and not pool.members:
        return f"units: the places of farm {pool.coordinator} matching {pool.selector}"
    names = [str(m.get("name")) for m in pool.members]
    where = f"; leased from farm {pool.coordinator}" if pool.coordinator else ""
    return f"units: {', '.join(names)}{where}; the trials are planned with {names[0]}'s entry"


def _show_info(overrides, config_dirs) -> None:
    """--info: where configs come from, what this command line picks, and the choices of every group."""
    from jbench.config import CONFIG_MODULE, ConfigError, available_choices, check_overrides, compose, user_config_dirs
    from jbench.sweeps.plan import split_overrides

    try:
        check_overrides(list(overrides))
        dirs = user_config_dirs(list(config_dirs))
        pool, composable = _class_overrides(list(overrides), dirs)
        plain, dims = split_overrides(composable)
        _, choices = compose(plain, dirs)
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    if pool is not None:
        choices["device"] = f"{pool.name} ({_units_text(pool)})"
    out = ["Config search path (first match wins):"]
    out += [f"  file://{d}" for d in dirs] + [f"  pkg://{CONFIG_MODULE}  (jbench's packaged configs)"]
    out += ["Choices of this command line:"] + [f"  {g}: {c}" for g, c in sorted(choices.items())]
    if dims:
        out += ["Sweep dimensions from the command line:"] + [f"  {k}: {', '.join(map(str, v))}" for k, v in dims.items()]
    out += ["Available (group=NAME, experiments as +experiment=NAME):"]
    for group in ("device", "backend", "model", "experiment", "tracking", "profile"):
        out.append(f"  {group}: {', '.join(available_choices(group, dirs))}")
    click.echo("\n".join(out))


def _run_options(fn):
    """Options `sweep` and `run` share (besides -v and --results-dir)."""
    fn = click.option("--info", "info", is_flag=True,
                      help="Print the config search path, this command line's choices and every group's options; "
                           "run nothing.")(fn)
    fn = click.option("-p", "--package", default=None, metavar="KEY",
                      help="With --cfg: print only this part of the config (e.g. backend).")(fn)
    fn = click.option("--cfg", "cfg", type=click.Choice(["job", "sweep"]), default=None,
                      help="Print the config and run nothing: job = the composed config (a sweep's grid "
                           "included), sweep = each planned trial's resolved config.")(fn)
    fn = click.option("-o", "--output", "fmt", type=click.Choice(OUTPUT_FORMATS), default="table", show_default=True,
                      help="Summary format on stdout (messages and progress then go to stderr).")(fn)
    fn = click.option("--dry-run", is_flag=True, help="Print the planned trials and run nothing.")(fn)
    return common_options(_config_dir_option(fn))


def _command(overrides, config_dirs, results_dir, dry_run, fmt, cfg, package, info, *, use_grid: bool,
             search: Optional[dict] = None) -> None:
    overrides = _with_results_dir(overrides, results_dir)
    if info:
        return _show_info(overrides, config_dirs)
    if cfg:
        return _show_config(cfg, package, overrides, config_dirs, use_grid)
    if package:
        raise _fail("--package selects a part of --cfg's output: add --cfg job or --cfg sweep")
    if not dry_run:

        preload()  # MLflow's import overlaps planning and the device checks
    _execute(_plan(overrides, config_dirs, use_grid=use_grid), dry_run, fmt, search)


@main.command(context_settings=_OVERRIDES)
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
@click.option("--search", "search_goal", default=None, metavar="GOAL",
              help="Measure only what can change the answer to GOAL (a shipped goal name or a YAML file, as for "
                   "`jbench advise --goal`; --maximize/--minimize/--require add to it): an adaptive search over the "
                   "grid that ends with the advisor's answer (docs/advise.md).")
@click.option("--maximize", default=None, metavar="METRIC", help="With --search: the objective.")
@click.option("--minimize", default=None, metavar="METRIC", help="With --search: the objective.")
@click.option("--require", "requires", multiple=True, metavar="'METRIC>=VALUE'", help="With --search: a constraint.")
@click.option("--budget-trials", type=int, default=None, help="With --search: runs to measure at most.")
@click.option("--budget-time", "budget_s", type=float, default=None, help="With --search: seconds at most.")
@click.option("--max-runs", type=int, default=2, show_default=True,
              help="With --search: runs of one configuration at most (repeated while its verdict is undecided).")
@click.option("--patience", type=int, default=None,
              help="With --search: stop after this many configurations without a better feasible one (default: a "
                   "third of the grid, at least 5).")
@click.option("--seed", type=int, default=0, show_default=True, help="With --search: the optimiser's seed.")
@_run_options
def sweep(overrides: tuple[str, ...], config_dirs: tuple[str, ...], results_dir: Optional[str], dry_run: bool,
          fmt: str, cfg: Optional[str], package: Optional[str], info: bool, search_goal: Optional[str],
          maximize: Optional[str], minimize: Optional[str], requires: tuple[str, ...], budget_trials: Optional[int],
          budget_s: Optional[float], max_runs: int, patience: Optional[int], seed: int) -> None:
    """Run an experiment's grid: jbench sweep +experiment=quant_ladder [key=value|key=a,b ...]"""
    search = None
    if search_goal or maximize or minimize or requires:
        search = {"goal": search_goal, "maximize": maximize, "minimize": minimize, "requires": requires,
                  "budget_trials": budget_trials, "budget_s": budget_s, "max_runs": max_runs, "patience": patience,
                  "seed": seed}
    elif budget_trials is not None or budget_s is not None or patience is not None:
        raise _fail("--budget-trials, --budget-time and --patience bound a search: add --search GOAL (or --maximize)")
    _command(overrides, config_dirs, results_dir, dry_run, fmt, cfg, package, info, use_grid=True, search=search)


@main.command(context_settings=_OVERRIDES)
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
@_run_options
def run(overrides: tuple[str, ...], config_dirs: tuple[str, ...], results_dir: Optional[str], dry_run: bool,
        fmt: str, cfg: Optional[str], package: Optional[str], info: bool) -> None:
    """Run one trial (the experiment's grid is not expanded): jbench run model.quant=Q8_0"""
    _command(overrides, config_dirs, results_dir, dry_run, fmt, cfg, package, info, use_grid=False)


@main.command(context_settings=_OVERRIDES)
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
@_config_dir_option
@click.option("--cuda/--no-cuda", default=None, help="Force a CUDA or CPU build (default: CUDA when nvcc and an NVIDIA GPU are found).")
@click.option("--jobs", "-j", type=int, default=None, help="Parallel build jobs (default: all cores).")
@click.option("--force", is_flag=True, help="Rebuild llama.cpp even if a build exists.")
@click.option("--skip-model", is_flag=True, help="Only build llama.cpp.")
@common_options(results_dir=False)
def setup(overrides, config_dirs, cuda: Optional[bool], jobs: Optional[int], force: bool, skip_model: bool) -> None:
    """Provision the embedded default: build llama.cpp, install and quantize the bundled model."""
    from omegaconf import OmegaConf

    from jbench.config import ConfigError, compose, user_config_dirs
    from jbench.models.provision import SetupError, build_llamacpp, install_bundled_model

    def say(msg: str) -> None:
        console.print(f"[cyan]setup[/] {msg}", highlight=False)

    _signals_as_interrupt()
    try:
        cfg, _ = compose(list(overrides), user_config_dirs(list(config_dirs)))
        model = typed(ModelConfig, OmegaConf.to_container(cfg.model, resolve=True), where="model")
        started = time.monotonic()
        build = build_llamacpp(cuda, jobs, force, say)
        if not skip_model:
            if model.source != "bundled":
                say(f"model '{model.name}' is not a bundled model: nothing to install")
            else:
                manifest = install_bundled_model(model, build, say)
                for quant in [model.source_quant, *model.ladder]:
                    entry = manifest["files"].get(quant)
                    if entry:
                        note = f"requantized from {entry['requantized_from']}" if entry.get("requantized_from") else "original"
                        say(f"  {quant:<7} {entry['path']}  ({note})")
    except (ConfigError, SetupError) as exc:
        raise _fail(str(exc)) from None
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted: what was built is kept; `jbench setup` resumes from there[/]",
                          highlight=False)
        raise click.exceptions.Exit(ExitCode.INTERRUPTED) from None
    say(f"ready in {time.monotonic() - started:.0f} s. Next: jbench sweep +experiment=quant_ladder")

