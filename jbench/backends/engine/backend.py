"""The in-house kernel engine (`backend=engine`): a command template, plain-log or JSON-lines output.

The engine is whatever executable a team built; jbench knows it only through `backend.command`, a LIST
of argument templates. Each item becomes exactly one argv item after its `{placeholder}`s are replaced
(never a shell string: a model path with spaces or `;` stays inside its one argument). Two placeholders
are lists and must stand alone as a whole item: `{extra}` (backend.extra_args) and `{trace}`
(backend.trace_args when backend.trace is true); they expand to zero or more items. `{{` and `}}` are
literal braces. A placeholder that does not exist, or one whose value the config does not provide, is a
validate() problem (so the sweep stops before anything runs) naming the placeholder and the ones that exist.

Results are read with jbench.analysis.gemv_trace (plain log lines through configurable regexes, or the
JSON-lines protocol; see docs/backends.md). One run of the engine reports one prefill and one decode
measurement (its own ms), so repetitions are separate runs of the engine, unless the template passes
`{repetitions}`: then the engine repeats itself and must print one line per repetition and phase.
Rates are tokens / ms from the log, never the rounded tok/s the engine prints.
"""

from __future__ import annotations

import logging
import shlex
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from jbench.backends.engine.trace import (LogPatterns, ParsedTrace, PhaseLine, TraceError, analyze_trace_text, json_event,
                                         parse_trace)
from jbench.device.connection import CommandResult, CommandTimeout, Connection
from jbench.device.telemetry.samplers import split_stamp, stamped
from jbench.models.store import ModelError, resolve_model_file
from jbench.core.results import BackendResult, PhaseResult
from jbench.core.schema import SchemaError, typed
from jbench.core.trial import Trial
from jbench.backends.base import (Backend, BackendError, Capabilities, command_failure, device_model_path, size_problems,
                                  timeout_failure)

# --------------------------------------------------------------------------------------------
# Config

_DEFAULT_PATTERNS = LogPatterns()

# Placeholders with a single value, and the list placeholders (whole items, zero or more argv items).
SCALAR_PLACEHOLDERS = ("binary", "model", "quant", "prompt_tokens", "gen_tokens", "depth", "context", "kv_type",
                       "repetitions")
LIST_PLACEHOLDERS = ("extra", "trace")
OUTPUT_FORMATS = ("auto", "log", "jsonl")


@dataclass
class EngineLogPatterns:
    """Regexes (re.search) for the engine's plain log; the defaults are gemv_trace.LogPatterns'.

    prefill/decode need named groups `tokens` and `ms`; power needs `mode` and/or `mhz`; gemv needs
    `fields` (the key=value text) and may have `index`."""

    prefill: str = field(default=_DEFAULT_PATTERNS.prefill, metadata={"identity": False})
    decode: str = field(default=_DEFAULT_PATTERNS.decode, metadata={"identity": False})
    power: str = field(default=_DEFAULT_PATTERNS.power, metadata={"identity": False})
    gemv: str = field(default=_DEFAULT_PATTERNS.gemv, metadata={"identity": False})


def _default_command() -> List[str]:
    return ["{binary}", "--model", "{model}", "--prompt-tokens", "{prompt_tokens}", "--gen-tokens", "{gen_tokens}",
            "--ctx", "{context}", "--kv", "{kv_type}", "{trace}", "{extra}"]


@dataclass
class EngineConfig:
    """An in-house kernel engine run as a command template (see docs/backends.md)."""

    name: str = field(default="engine", metadata={"identity": True})
    # The engine executable on the device (an absolute path, or a name on the device's PATH).
    binary: Optional[str] = field(default=None, metadata={"identity": False})
    # Argument templates, one argv item each; placeholders: {binary} {model} {quant} {prompt_tokens}
    # {gen_tokens} {depth} {context} {kv_type} {repetitions}, whole-item lists {extra} {trace}, and backend.vars.
    command: List[str] = field(default_factory=_default_command, metadata={"identity": True})
    # More placeholders of your own: name -> value (e.g. {batch: "512"} for a "--batch={batch}" item).
    vars: Dict[str, str] = field(default_factory=dict, metadata={"identity": True})
    n_prompt: int = field(default=128, metadata={"identity": True})
    n_gen: int = field(default=64, metadata={"identity": True})
    # Tokens already in the KV cache; only meaningful when the command passes {depth}.
    depth: int = field(default=0, metadata={"identity": True})
    # Context (KV cache) size the engine is started with; must hold depth + n_prompt + n_gen.
    context: int = field(default=4096, metadata={"identity": True})
    kv_type: str = field(default="f16", metadata={"identity": True})
    # KV types this engine accepts; [] accepts any value of kv_type.
    kv_types: List[str] = field(default_factory=lambda: ["f16", "q8_0", "q4_0"], metadata={"identity": False})
    # Timed runs of the engine (or, with {repetitions} in the command, the engine's own repetitions).
    repetitions: int = field(default=3, metadata={"identity": True})
    # One untimed run first (page cache, GPU clocks, JIT); its output is kept in the raw output, not measured.
    warmup: bool = field(default=True, metadata={"identity": True})
    extra_args: List[str] = field(default_factory=list, metadata={"identity": True})
    # How results are printed: log (regex lines), jsonl (JSON events), auto (both, per line).
    output: str = field(default="auto", metadata={"identity": False})
    patterns: EngineLogPatterns = field(default_factory=EngineLogPatterns, metadata={"identity": False})
    # The engine prints one GEMV line per launch: analyse them (weight bytes per token, fusion findings).
    trace: bool = field(default=False, metadata={"identity": True})
    # Arguments that ask the engine for GEMV lines; they replace the {trace} item when trace is true.
    trace_args: List[str] = field(default_factory=lambda: ["--trace"], metadata={"identity": True})
    # Model dimensions that make the fusion checks exact: d_model, q_dim, kv_dim, n_ff (any subset).
    trace_hints: Dict[str, int] = field(default_factory=dict, metadata={"identity": False})
    # Memory bandwidth for the GEMV ceiling (GB/s); None: the device profile's memory_bandwidth_gbs.
    bandwidth_gbs: Optional[float] = field(default=None, metadata={"identity": False})
    # Environment variables for the engine process (plain values, no placeholders).
    env: Dict[str, str] = field(default_factory=dict, metadata={"identity": True})
    timeout_s: float = field(default=1800.0, metadata={"identity": False})


# --------------------------------------------------------------------------------------------
# Command templates (pure functions)


class TemplateError(ValueError):
    pass


def template_fields(item: str) -> list[str]:
    """Placeholder names in one argument template, in order. Raises TemplateError for malformed braces,
    positional/empty/dotted fields and format specs or conversions (only plain `{name}` is supported)."""
    names = []
    try:
        parsed = list(string.Formatter().parse(item))
    except ValueError as exc:
        raise TemplateError(f"malformed braces ({exc}); write {{{{ and }}}} for literal braces") from None
    for _literal, name, spec, conversion in parsed:
        if name is None:
            continue
        if not name.isidentifier():
            raise TemplateError(f"'{{{name}}}' is not a placeholder name (use {{name}}; literal braces are {{{{ }}}})")
        if spec or conversion:
            raise TemplateError(f"placeholder {{{name}}} has a format spec or conversion; only {{{name}}} is supported")
        names.append(name)
    return names


def used_placeholders(template: List[str]) -> set[str]:
    out: set[str] = set()
    for item in template:
        try:
            out.update(template_fields(str(item)))
        except TemplateError:
            continue
    return out


def check_template(template: List[str], available: Dict[str, Optional[str]], list_names=LIST_PLACEHOLDERS,
                   where: str = "backend.command") -> list[str]:
    """Problems with a command template. available: every placeholder that exists -> None when it has a
    value, else the reason it has none (what to set)."""
    problems = []
    if not template:
        return [f"{where} is empty: it needs at least the engine executable, e.g. [\"{{binary}}\", ...]"]
    exist = ", ".join(sorted(available))
    for i, raw in enumerate(template):
        item = str(raw)
        try:
            names = template_fields(item)
        except TemplateError as exc:
            problems.append(f"{where}[{i}] {item!r}: {exc}")
            continue
        for name in names:
            if name not in available:
                problems.append(f"{where}[{i}] {item!r}: unknown placeholder {{{name}}}. Placeholders that exist: "
                                f"{exist} (add your own under backend.vars)")
            elif available[name] is not None:
                problems.append(f"{where}[{i}] {item!r}: placeholder {{{name}}} has no value: {available[name]}")
            elif name in list_names and item != "{" + name + "}":
                problems.append(f"{where}[{i}] {item!r}: {{{name}}} is a list (zero or more arguments) and must be "
                                f"a whole item of its own, e.g. \"{{{name}}}\"")
    if not problems and str(template[0]) in tuple("{" + n + "}" for n in list_names):
        problems.append(f"{where}[0] must be the executable, not the list placeholder {template[0]}")
    return problems


def render_command(template: List[str], values: Dict[str, Any], lists: Dict[str, List[str]]) -> list[str]:
    """The argv: each item substituted into exactly one argument; a whole-item list placeholder expands to
    its items. Assumes check_template found no problem (KeyError otherwise)."""
    argv: list[str] = []
    for raw in template:
        item = str(raw)
        names = template_fields(item)
        if len(names) == 1 and names[0] in lists and item == "{" + names[0] + "}":
            argv.extend(str(x) for x in lists[names[0]])
            continue
        parts = []
        for literal, name, _spec, _conv in string.Formatter().parse(item):
            parts.append(literal)
            if name is not None:
                parts.append(str(values[name]))
        argv.append("".join(parts))
    return argv


# --------------------------------------------------------------------------------------------
# Output parsing (pure functions)


@dataclass
class EngineRun:
    """One engine process's output, stamps removed (line numbers of `text` match `stamps`)."""

    text: str
    stamps: list[Optional[float]]
    start: Optional[float]
    parsed: ParsedTrace
    formats: set[str]

    def stamp(self, line: PhaseLine) -> Optional[float]:
        i = line.lineno - 1
        return self.stamps[i] if 0 <= i < len(self.stamps) else None


def parse_engine_output(stdout: str, patterns: Optional[LogPatterns] = None, output: str = "auto") -> EngineRun:
    """Parse one run's stdout (optionally device-stamped, with an `@@start` line).

    output=log ignores JSON event lines, jsonl ignores everything else, auto reads both."""
    texts: list[str] = []
    stamps: list[Optional[float]] = []
    start = None
    formats: set[str] = set()
    for raw in stdout.splitlines():
        t, rest = split_stamp(raw)
        if t is None:
            rest = raw
        if t is not None and rest.strip() == "@@start" and start is None:
            start = t
            rest = ""
        is_json = json_event(rest) is not None
        if (output == "log" and is_json) or (output == "jsonl" and not is_json):
            rest = ""
        texts.append(rest)
        stamps.append(t)
    text = "\n".join(texts)
    parsed = parse_trace(text, patterns)
    for lines in (parsed.prefill, parsed.decode):
        for pl in lines:
            formats.add("jsonl" if json_event(texts[pl.lineno - 1]) is not None else "log")
    return EngineRun(text=text, stamps=stamps, start=start, parsed=parsed, formats=formats)


def phase_end_times(run: EngineRun) -> dict[str, Optional[float]]:
    """Device-clock end of each phase of a run that printed one prefill and one decode line.

    decode: the stamp of its Decode line. prefill: the stamp of its Prefill line when that line came out
    before decode started (decode stamp - decode ms); an engine that prints both lines at the end (a
    summary, or buffered stdout) gets decode start instead (prefill assumed to end where decode begins)."""
    out: dict[str, Optional[float]] = {"prefill": None, "decode": None}
    dec = run.parsed.decode[0] if len(run.parsed.decode) == 1 else None
    pre = run.parsed.prefill[0] if len(run.parsed.prefill) == 1 else None
    dec_end = run.stamp(dec) if dec is not None else None
    out["decode"] = dec_end
    if pre is not None:
        pre_end = run.stamp(pre)
        if dec_end is not None:
            dec_start = dec_end - dec.ms / 1000.0
            out["prefill"] = pre_end if pre_end is not None and pre_end <= dec_start else dec_start
        else:
            out["prefill"] = pre_end
    return out


# --------------------------------------------------------------------------------------------
# The backend


def _knobs(cfg: EngineConfig) -> list[tuple[str, str, Any]]:
    """(placeholder, backend key, value) of the knobs the engine only sees through their placeholder."""
    return [("prompt_tokens", "n_prompt", cfg.n_prompt), ("gen_tokens", "n_gen", cfg.n_gen),
            ("depth", "depth", cfg.depth), ("context", "context", cfg.context), ("kv_type", "kv_type", cfg.kv_type)]


class EngineBackend(Backend[EngineConfig]):
    NAME = "engine"
    CONFIG = EngineConfig
    # KV types come from backend.kv_types (per engine); context depth only when the command passes {depth}.
    CAPABILITIES = Capabilities(
        quants=frozenset(), kv_types=frozenset(), flash_attention=False, context_depth=True, latency_scenario=False,
        extra={"kv_types": "backend.kv_types", "context_depth": "only when backend.command passes {depth}",
               "gemv_trace": True},
    )

    # ---- placeholders

    def _available(self, trial: Trial) -> tuple[dict[str, Optional[str]], dict[str, Any]]:
        """(placeholder -> None or why it has no value, placeholder -> value)."""
        cfg, model = self.config_of(trial), trial.cfg.model
        reasons: dict[str, Optional[str]] = {}
        values: dict[str, Any] = {}
        if cfg.binary:
            values["binary"], reasons["binary"] = cfg.binary, None
        else:
            reasons["binary"] = "backend.binary is not set (the engine executable on the device)"
        try:
            values["model"], _ = resolve_model_file(model)
            reasons["model"] = None
        except ModelError as exc:
            reasons["model"] = str(exc)
        values["quant"], reasons["quant"] = model.quant, None
        for name, key, value in [*_knobs(cfg), ("repetitions", "repetitions", cfg.repetitions)]:
            if value is None:
                reasons[name] = f"backend.{key} is null"
            else:
                values[name], reasons[name] = value, None
        for name in LIST_PLACEHOLDERS:
            reasons[name] = None
        for name, value in cfg.vars.items():
            if name in reasons:
                continue  # reported by validate
            if value is None:
                reasons[name] = f"backend.vars.{name} is null"
            else:
                values[name], reasons[name] = value, None
        return reasons, values

    # ---- validate / preflight

    def validate(self, trial: Trial) -> list[str]:
        cfg = self.config_of(trial)
        problems: list[str] = []
        problems += size_problems(cfg)
        if cfg.context < 1:
            problems.append(f"backend.context must be >= 1 (got {cfg.context})")
        elif min(cfg.n_prompt, cfg.n_gen, cfg.depth) >= 0:
            need = cfg.depth + cfg.n_prompt + cfg.n_gen
            if need > cfg.context:
                problems.append(f"backend.context={cfg.context} cannot hold depth + n_prompt + n_gen = {need}: "
                                f"raise backend.context")
        if cfg.timeout_s <= 0:
            problems.append(f"backend.timeout_s must be > 0 (got {cfg.timeout_s})")
        if cfg.output not in OUTPUT_FORMATS:
            problems.append(f"backend.output '{cfg.output}' is not valid. Valid: {', '.join(OUTPUT_FORMATS)}")
        if cfg.kv_types and cfg.kv_type not in cfg.kv_types:
            problems.append(f"backend.kv_type '{cfg.kv_type}' is not a KV type this engine accepts. "
                            f"Valid (backend.kv_types): {', '.join(cfg.kv_types)}")
        try:
            _patterns(cfg.patterns)
        except TraceError as exc:
            problems.append(f"backend.patterns: {exc}")
        for name in cfg.vars:
            if name in SCALAR_PLACEHOLDERS or name in LIST_PLACEHOLDERS:
                problems.append(f"backend.vars.{name}: '{name}' is a built-in placeholder; pick another name")
            elif not str(name).isidentifier():
                problems.append(f"backend.vars.{name}: a placeholder name must be an identifier (letters, digits, _)")
        for key in cfg.trace_hints:
            if key not in ("d_model", "q_dim", "kv_dim", "n_ff"):
                problems.append(f"backend.trace_hints.{key} is not a hint. Valid: d_model, q_dim, kv_dim, n_ff")
        if cfg.bandwidth_gbs is not None and cfg.bandwidth_gbs <= 0:
            problems.append(f"backend.bandwidth_gbs must be > 0 (got {cfg.bandwidth_gbs})")
        reasons, _ = self._available(trial)
        template = [str(x) for x in cfg.command]
        problems += check_template(template, reasons)
        used = used_placeholders(template)
        for (name, key, value), (_, _, default) in zip(_knobs(cfg), _knobs(EngineConfig())):
            if name not in used and value != default:
                problems.append(f"backend.{key}={value} but backend.command has no {{{name}}}: the engine would "
                                f"never see it; add {{{name}}} to the command or leave backend.{key} at {default}")
        if cfg.trace and cfg.trace_args and "trace" not in used:
            problems.append("backend.trace is true but backend.command has no \"{trace}\" item, so the engine is "
                            f"never given backend.trace_args {list(cfg.trace_args)}")
        return problems

    def preflight(self, conn: Connection) -> list[str]:
        binary = self.config.binary
        if not binary:
            return []  # validate() already names backend.binary when the command uses it
        if "/" in binary:
            path = conn.expand_path(binary)
            if not conn.exists(path):
                return [f"engine binary {path} not found on device '{conn.name}': fix backend.binary"]
            return []
        res = conn.run(["sh", "-c", 'command -v "$1"', "sh", binary], timeout=30)
        if res.returncode != 0 or not res.stdout.strip():
            return [f"engine binary '{binary}' is not on the PATH of device '{conn.name}': set backend.binary to its path"]
        return []

    def build_id(self, conn: Connection) -> Optional[str]:
        """SHA-256 of the engine binary on the device (hashed once per file version, jbench.identity)."""
        from jbench.models.digest import file_digest

        binary = self.config.binary
        if not binary:
            return None
        path = conn.expand_path(binary) if "/" in binary else conn.run(
            ["sh", "-c", 'command -v "$1"', "sh", binary], timeout=30).stdout.strip()
        digest = file_digest(path, conn) if path else None
        return f"sha256:{digest}" if digest else None

    # ---- run

    def command(self, trial: Trial, model_path: Optional[str] = None, *, n_prompt: Optional[int] = None,
                n_gen: Optional[int] = None, repetitions: Optional[int] = None) -> list[str]:
        """The engine's argv for this trial (the values may be overridden for an energy pass)."""
        cfg = self.config_of(trial)
        reasons, values = self._available(trial)
        problems = check_template([str(x) for x in cfg.command], reasons)
        if problems:
            raise BackendError("backend_crash", "; ".join(problems))
        if model_path is not None:
            values["model"] = model_path
        if n_prompt is not None:
            values["prompt_tokens"] = n_prompt
        if n_gen is not None:
            values["gen_tokens"] = n_gen
        if repetitions is not None:
            values["repetitions"] = repetitions
        lists = {"extra": [str(a) for a in cfg.extra_args],
                 "trace": [str(a) for a in cfg.trace_args] if cfg.trace else []}
        return render_command([str(x) for x in cfg.command], values, lists)

    def _execute(self, argv: list[str], conn: Connection, cfg: EngineConfig, log: logging.Logger,
                 what: str) -> CommandResult:
        log.info("running engine (%s): %s", what, shlex.join(argv))
        try:
            res = conn.run(stamped(argv, start_marker=True), timeout=cfg.timeout_s,
                           env={str(k): str(v) for k, v in cfg.env.items()} or None)
        except CommandTimeout:
            raise timeout_failure(f"engine ({what})", argv, cfg.timeout_s) from None
        log.info("engine (%s) exited %d after %.2f s", what, res.returncode, res.duration_s)
        if res.returncode != 0:
            raise command_failure(f"engine ({what})", res)
        return res

    def run(self, trial: Trial, conn: Connection, log: logging.Logger, *, only_phase: Optional[str] = None,
            repetitions: Optional[int] = None) -> BackendResult:
        cfg = self.config_of(trial)
        template = [str(x) for x in cfg.command]
        used = used_placeholders(template)
        model_path = None
        if "model" in used:
            model_path = device_model_path(trial, conn)

        n_prompt, n_gen = cfg.n_prompt, cfg.n_gen
        energy_pass = only_phase is not None and repetitions is not None
        if energy_pass:
            # One run with the phase made longer: separate processes give no contiguous window to integrate over.
            room = cfg.context - cfg.depth - n_prompt - n_gen
            if only_phase == "decode" and "gen_tokens" in used and n_gen > 0:
                k = max(1, min(repetitions, 1 + room // n_gen))
                n_gen *= k
            elif only_phase == "prefill" and "prompt_tokens" in used and n_prompt > 0:
                k = max(1, min(repetitions, 1 + room // n_prompt))
                n_prompt *= k
            else:
                k = 1
            log.info("energy pass for %s: one engine run with n_prompt=%d n_gen=%d (x%d, bounded by backend.context)",
                     only_phase, n_prompt, n_gen, k)
            reps = 1
        else:
            reps = repetitions or cfg.repetitions
        internal = "repetitions" in used  # the engine repeats itself and prints one line per repetition
        processes = 1 if internal else reps
        lines_per_run = reps if internal else 1
        argv = self.command(trial, model_path, n_prompt=n_prompt, n_gen=n_gen, repetitions=reps)
        patterns = _patterns(cfg.patterns)

        raw: list[str] = []
        stderr: list[str] = []
        if cfg.warmup and not energy_pass:
            res = self._execute(argv, conn, cfg, log, "warmup")
            raw.append(f"# jbench: engine warmup run (not measured): {shlex.join(argv)}\n{res.stdout}")
            stderr.append(res.stderr)
        runs: list[EngineRun] = []
        for i in range(processes):
            what = f"run {i + 1}/{processes}"
            try:
                res = self._execute(argv, conn, cfg, log, what)
            except BackendError as exc:
                exc.raw_output = "\n".join(raw + [exc.raw_output])
                exc.raw_stderr = "\n".join(stderr + [exc.raw_stderr])
                raise
            raw.append(f"# jbench: engine {what}: {shlex.join(argv)}\n{res.stdout}")
            stderr.append(res.stderr)
            runs.append(parse_engine_output(res.stdout, patterns, cfg.output))
        raw_output, raw_stderr = "\n".join(raw), "\n".join(stderr)

        wanted = [p for p, n in (("prefill", n_prompt), ("decode", n_gen)) if n > 0]
        if only_phase:
            wanted = [p for p in wanted if p == only_phase]
        phases: dict[str, PhaseResult] = {}
        for phase in wanted:
            phases[phase] = self._phase(phase, runs, lines_per_run, cfg, raw_output, raw_stderr, log,
                                        n_prompt if phase == "prefill" else n_gen)
        for run in runs:
            for w in run.parsed.warnings:
                log.warning("engine output: %s", w)

        info: dict[str, Any] = {"engine_runs": processes, "engine_output_format": "+".join(sorted(
            set().union(*(r.formats for r in runs)))) or "none"}
        power = [p for r in runs for p in r.parsed.power]
        modes = [p.mode for p in power if p.mode is not None]
        clocks = [p.gpu_mhz for p in power if p.gpu_mhz is not None]
        if modes:
            info["engine_power_mode"] = modes[-1]
        if clocks:
            info["engine_gpu_mhz"] = clocks[-1]
            info["engine_gpu_mhz_min"] = min(clocks)
        for phase in ("prefill", "decode"):
            watts = [pl.power_w for r in runs for pl in getattr(r.parsed, phase) if pl.power_w is not None]
            if watts:
                info[f"engine_{phase}_power_w"] = sum(watts) / len(watts)

        result = BackendResult(phases=phases, raw_output=raw_output, raw_stderr=raw_stderr, info=info, command=argv,
                               start_time=runs[0].start if runs else None, build=self._build_identity(conn, cfg))
        if not energy_pass:
            self._analyse(trial, runs, result, log)
        return result

    def _phase(self, phase: str, runs: list[EngineRun], per_run: int, cfg: EngineConfig, raw: str, raw_err: str,
               log: logging.Logger, requested: int) -> PhaseResult:
        title = phase.capitalize()
        lines: list[PhaseLine] = []
        for i, run in enumerate(runs):
            got = getattr(run.parsed, phase)
            if not got:
                fmt = {"log": f"a line matching backend.patterns.{phase}",
                       "jsonl": f'a JSON line {{"event": "{phase}", "tokens": N, "ms": X}}'}.get(
                    cfg.output, f'a line matching backend.patterns.{phase} or a JSON {{"event": "{phase}"}} line')
                raise BackendError(
                    "unparseable_output",
                    f"engine exited 0 but printed no {title} result in run {i + 1} (expected {fmt}; "
                    f"backend.output={cfg.output})", raw, raw_err)
            if len(got) != per_run:
                raise BackendError(
                    "unparseable_output",
                    f"engine printed {len(got)} {title} results in run {i + 1}; expected {per_run} "
                    + ("(one per repetition: the command passes {repetitions})" if per_run > 1 else
                       "(one per run; pass {repetitions} in backend.command if the engine repeats itself)"),
                    raw, raw_err)
            lines.extend(got)
        for pl in lines:
            if pl.tokens <= 0 or pl.ms <= 0:
                raise BackendError(
                    "unparseable_output",
                    f"engine {title} line {pl.lineno} reports {pl.tokens} tokens in {pl.ms:g} ms: no rate can be "
                    f"computed (too short for the engine's ms resolution? raise the token count)", raw, raw_err)
        tokens = {pl.tokens for pl in lines}
        if len(tokens) > 1:
            raise BackendError("unparseable_output",
                               f"engine {title} token counts differ between repetitions: {sorted(tokens)}", raw, raw_err)
        n_tokens = tokens.pop()
        if n_tokens != requested:
            log.warning("engine reports %d %s tokens, %d were requested; the engine's count is used", n_tokens,
                        phase, requested)
        end = None
        if len(lines) == 1:  # one contiguous phase: its window is [end - ms, end]
            end = phase_end_times(runs[0])[phase]
        return PhaseResult(phase=phase, n_tokens=n_tokens, samples_ns=[max(1, round(pl.ms * 1e6)) for pl in lines],
                           depth=cfg.depth, end_time=end)

    def _build_identity(self, conn: Connection, cfg: EngineConfig) -> dict[str, str]:
        binary = cfg.binary
        if not binary:
            return {}
        build = {"engine_binary": str(binary)}
        try:
            res = conn.run(["sha256sum", conn.expand_path(binary) if "/" in binary else binary], timeout=60)
            if res.returncode == 0 and res.stdout.split():
                build["engine_sha256"] = res.stdout.split()[0]
        except Exception:  # identity is best effort; the trial's numbers do not depend on it
            pass
        return build

    def _analyse(self, trial: Trial, runs: list[EngineRun], result: BackendResult, log: logging.Logger) -> None:
        """Findings from the log (power line, prefill vs decode) and, with trace, the GEMV analysis."""
        cfg, profile = self.config_of(trial), trial.cfg.profile
        if not runs:
            return
        rates = {p: pr.samples_tps for p, pr in result.phases.items()}
        mean = {p: sum(v) / len(v) for p, v in rates.items() if v}
        bw = cfg.bandwidth_gbs or (profile.memory_bandwidth_gbs if profile else None)
        text = runs[0].text
        decode_lines = runs[0].parsed.decode
        report = None
        error = None
        for n_tokens in (None, decode_lines[0].tokens if decode_lines else None):
            try:
                report = analyze_trace_text(
                    text, bandwidth_bytes_per_s=float(bw) * 1e9 if bw else None, decode_tps=mean.get("decode"),
                    prefill_tps=mean.get("prefill"), n_decode_tokens=n_tokens, hints=dict(cfg.trace_hints),
                    patterns=_patterns(cfg.patterns))
                break
            except TraceError as exc:
                error = str(exc)
                if n_tokens is None and decode_lines:
                    continue
        if report is None:
            result.info["gemv_error"] = error
            log.warning("engine output analysis failed: %s", error)
            return
        if cfg.trace:
            result.info["gemv"] = report.to_dict()
            tok = report.token
            if tok is None:
                result.info["gemv_error"] = "backend.trace is true but the engine printed no GEMV lines"
                log.warning("%s", result.info["gemv_error"])
            else:
                result.metrics["gemv_launches_per_token"] = float(tok.launches)
                result.metrics["gemv_weight_bytes_per_token"] = float(tok.weight_bytes)
                if report.implied_bandwidth_bytes_per_s is not None:
                    result.metrics["gemv_implied_bandwidth_gbs"] = report.implied_bandwidth_bytes_per_s / 1e9
                if report.ceiling_tps is not None:
                    result.metrics["gemv_ceiling_tps"] = report.ceiling_tps
                if report.fraction_of_ceiling is not None:
                    result.metrics["gemv_fraction_of_ceiling"] = report.fraction_of_ceiling
                log.info("%s", report.summary().splitlines()[0])
        for f in report.findings:
            result.findings.append(f)
            log.warning("finding %s: %s", f.code, f.message)


def _patterns(given: EngineLogPatterns) -> LogPatterns:
    """The configured log patterns; raises TraceError for an invalid one."""
    patterns = LogPatterns(prefill=given.prefill, decode=given.decode, power=given.power, gemv=given.gemv)
    patterns.compiled()
    return patterns


# --------------------------------------------------------------------------------------------
# `jbench trace analyze FILE`


def trace_analyze_command(path: str, bandwidth_gbs: Optional[float] = None, decode_tps: Optional[float] = None, *,
                          prefill_tps: Optional[float] = None, n_decode_tokens: Optional[int] = None,
                          bandwidth_source: Optional[str] = None, hints: Optional[dict] = None,
                          patterns: Optional[Mapping[str, str]] = None) -> tuple[str, dict]:
    """What `jbench trace analyze FILE` prints and its JSON form: (summary text, report dict).

    FILE is an engine's saved output (plain log, JSON lines or a raw/stdout.txt artifact; leading
    timestamps are fine). bandwidth_gbs (GB/s) gives the ceiling, bandwidth_source says where it came from
    (default "--bandwidth"; the CLI names a profile's datasheet figure). decode_tps / prefill_tps override the
    log's rates. Raises TraceError with a one-line message for any user error (unreadable file, no engine
    lines, bad bandwidth, hint or pattern): the CLI prints it and exits 2.
    """
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as exc:
        raise TraceError(f"cannot read {path}: {exc.strerror or exc}") from None
    source = (bandwidth_source or "--bandwidth") if bandwidth_gbs is not None else None
    if bandwidth_gbs is not None and (not isinstance(bandwidth_gbs, (int, float)) or bandwidth_gbs <= 0):
        raise TraceError(f"bandwidth must be a positive number of GB/s, got {bandwidth_gbs!r}")
    try:
        lp = _patterns(typed(EngineLogPatterns, patterns, where="patterns"))
    except SchemaError as exc:
        raise TraceError(str(exc)) from None
    report = analyze_trace_text(
        text, bandwidth_bytes_per_s=bandwidth_gbs * 1e9 if bandwidth_gbs else None, decode_tps=decode_tps,
        prefill_tps=prefill_tps, n_decode_tokens=n_decode_tokens, hints=hints, patterns=lp)
    out = report.to_dict()
    out["file"] = str(path)
    out["bandwidth_source"] = source
    return report.summary(), out
