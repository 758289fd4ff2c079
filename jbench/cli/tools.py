"""`jbench roofline`, `telemetry parse`, `trace analyze`: tools that need no device or store."""

from __future__ import annotations

import sys
from typing import Optional

import click
from rich.table import Table

from jbench.cli.app import common_options, _config_dir_option, _fail, console, err_console, main
from jbench.core.schema import DeviceConfig, ProfileConfig, typed
from jbench.device.bandwidth import device_bandwidth
from jbench.device.telemetry.tegrastats import read_log, sample_to_dict


@main.command()
@common_options(results_dir=False)
@click.option("--model", "model_name", required=True, help="Model config name (e.g. gemma3_270m) or a GGUF path.")
@click.option("--profile", "profile_name", default=None,
              help="Jetson module profile (e.g. orin_nano_8gb; `conf/profile/`): its datasheet bandwidth and RAM, "
                   "for a module you do not have.")
@click.option("--device", "device_name", default=None,
              help="Device entry: its calibration (`jbench calibrate`), else its profile's datasheet figure.")
@click.option("--bandwidth-gbs", type=float, default=None, help="Memory bandwidth in GB/s (instead of a device).")
@click.option("--quant", default=None)
@click.option("--ctx", "depth", type=click.IntRange(min=0), default=0, show_default=True,
              help="Context depth (tokens in the KV cache).")
@click.option("--kv", "kv_type", default="f16", show_default=True, help="KV cache type for K and V.")
@click.option("--json", "as_json", is_flag=True)
@_config_dir_option
def roofline(model_name, profile_name, device_name, bandwidth_gbs, quant, depth, kv_type, as_json, config_dirs) -> None:
    """Bytes per decoded token and the bandwidth ceiling on tok/s for a model on a module or device, and whether
    the model and its KV cache fit the module's RAM."""
    import json

    from jbench.analysis.roofline import RooflineError
    from jbench.config import ConfigError, user_config_dirs
    from jbench.reporting.roofline import roofline_figures

    if profile_name and device_name:
        raise _fail(f"give --profile or --device, not both: device '{device_name}' takes its bandwidth from its "
                    "calibration or its own profile")
    try:
        dirs = user_config_dirs(list(config_dirs))
        path, label = _model_path(model_name, quant, dirs)
        source, profile = "--bandwidth-gbs", None
        if profile_name:
            profile = _profile(profile_name, dirs)
        elif device_name:
            device_bw, device_source, profile = _device_bandwidth(device_name, dirs)
            if bandwidth_gbs is None:
                if device_bw is None:  # no calibration and no profile: the source says how to get one
                    raise ValueError(device_source)
                bandwidth_gbs, source = device_bw, device_source
        if bandwidth_gbs is None and profile is not None:
            bandwidth_gbs, source = profile.memory_bandwidth_gbs, f"datasheet ({profile.name}): an upper bound"
        fig = roofline_figures(path, quant=quant, depth=depth, kv_type=kv_type, bandwidth_gbs=bandwidth_gbs,
                               bandwidth_source=source, model_label=label, profile=profile)
    except (RooflineError, ConfigError, ValueError) as exc:
        raise _fail(str(exc)) from None
    if as_json:
        click.echo(json.dumps(fig, indent=2))
        return
    where = f" on {fig['module']}" if "module" in fig else ""
    table = Table(title=f"roofline: {fig['model']} {fig.get('quant') or ''}{where}", title_justify="left")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    # Sentences go below the table: a table cell would cut them into a narrow column.
    sentences = {"memory_fit"}
    for key, value in fig.items():
        if key in sentences:
            continue
        if isinstance(value, bool):
            value = "yes" if value else "no"
        elif isinstance(value, float):
            value = f"{value:,.4g}" if abs(value) < 1e6 else f"{value:,.0f}"
        elif isinstance(value, int):
            value = f"{value:,}"
        table.add_row(key, str(value))
    console.print(table)
    # In a terminal, wrapped at word boundaries (the terminal would cut words); in a pipe, each sentence whole.
    wrap = {"markup": False, "highlight": False, "soft_wrap": not console.is_terminal}
    if "memory_fit" in fig:
        console.print(f"memory: {fig['memory_fit']}", **wrap)
    if "decode_ceiling_tok_s" not in fig:
        console.print("no ceiling: give --profile MODULE (e.g. orin_nano_8gb), --device NAME or --bandwidth-gbs", **wrap)


def _model_path(model: str, quant, dirs) -> tuple[str, str]:
    """A GGUF path as given, or the file of a model config entry (and quant); and the name to show for it."""
    from pathlib import Path

    from omegaconf import OmegaConf

    from jbench.config import compose
    from jbench.models.store import ModelError, resolve_model_file

    if model.endswith(".gguf") or Path(model).is_file():
        return model, Path(model).name
    cfg, _ = compose([f"model={model}"] + ([f"model.quant={quant}"] if quant else []), dirs)
    try:
        path, _ = resolve_model_file(OmegaConf.to_container(cfg.model, resolve=True))
    except ModelError as exc:
        raise ValueError(str(exc)) from None
    if not Path(path).expanduser().is_file():  # e.g. a path on the Jetson the entry is for
        raise ValueError(f"model '{model}' {cfg.model.quant}: {path} is not on this machine; `jbench roofline` reads "
                         "the file's tensor table here: copy the GGUF file here and give its path with --model")
    return path, model


def _profile(name: str, dirs) -> ProfileConfig:
    from jbench.config import load_profile

    return typed(ProfileConfig, load_profile(name, dirs), where="profile")


def _device_bandwidth(device_name: str, dirs) -> tuple[Optional[float], str, Optional[ProfileConfig]]:
    """A device entry's read bandwidth (calibration, else its profile's datasheet figure; None: neither), its
    source, and the device's profile."""
    from omegaconf import OmegaConf

    from jbench.config import ConfigError, available_choices, compose

    if device_name not in available_choices("device", dirs) and device_name in available_choices("profile", dirs):
        # A module name given where a device entry is expected: the profile answers without a device.
        raise ConfigError(f"'{device_name}' is a module profile, not a device entry: use --profile {device_name}")
    cfg, _ = compose([f"device={device_name}"], dirs)
    device = typed(DeviceConfig, OmegaConf.to_container(cfg.device, resolve=True), where="device")
    profile = _profile(device.profile, dirs) if device.profile else None
    bw = device_bandwidth(device, profile)
    return bw.gbs, bw.source, profile


@main.group()
@common_options(results_dir=False)
def telemetry() -> None:
    """Telemetry tools."""


@telemetry.command("parse")
@common_options(results_dir=False)
@click.argument("source", type=click.File("rb"))
@click.option("--format", "fmt", type=click.Choice(["jsonl", "csv"]), default="jsonl", show_default=True)
@click.option("--rails", default=None, help="Comma list of rails whose sum is the total power (default: the documented rule).")
def telemetry_parse(source, fmt, rails) -> None:
    """Turn a tegrastats log (FILE or -, plain or gzip-compressed) into JSON lines or CSV; unparseable lines
    (undecodable bytes included) are counted and skipped."""
    import csv
    import io
    import json

    spec = rails.split(",") if rails else None
    # Buffered, so the gzip magic bytes can be peeked at on a pipe too.
    read = read_log(source if isinstance(source, io.BufferedReader) else io.BufferedReader(source))
    skipped = read.skipped
    rows = [sample_to_dict(sample, spec) for sample in read.samples]
    if fmt == "jsonl":
        for row in rows:
            click.echo(json.dumps(row, default=str))
    else:
        cols: dict = {}
        for row in rows:
            cols.update(dict.fromkeys(row))
        writer = csv.DictWriter(sys.stdout, fieldnames=list(cols), restval="")
        writer.writeheader()
        writer.writerows(rows)
    err_console.print(f"{len(rows)} samples, {skipped} unparseable line(s) skipped", highlight=False)
    if read.cut_short:
        err_console.print(f"warning: {source.name}: {read.cut_short}", highlight=False)


@main.group()
@common_options(results_dir=False)
def trace() -> None:
    """In-house engine traces."""


@trace.command("analyze")
@common_options(results_dir=False)
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--bandwidth-gbs", type=float, default=None, help="Memory bandwidth for the ceiling (GB/s).")
@click.option("--profile", default=None, help="Or a module profile whose datasheet bandwidth to use.")
@click.option("--decode-tps", type=float, default=None, help="Measured decode tok/s (default: from the log).")
@click.option("--prefill-tps", type=float, default=None)
@click.option("--tokens", "n_decode_tokens", type=int, default=None, help="Decoded tokens in the trace, if it cannot tell.")
@click.option("--json", "as_json", is_flag=True)
@_config_dir_option
def trace_analyze(path, bandwidth_gbs, profile, decode_tps, prefill_tps, n_decode_tokens, as_json, config_dirs) -> None:
    """GEMV launches and weight bytes per decoded token, implied bandwidth, ceiling and findings
    (QKV or gate/up not fused, per-token prefill, parked GPU) from an engine log with GEMV lines."""
    import json

    from jbench.backends.engine.trace import TraceError
    from jbench.backends.engine.backend import trace_analyze_command
    from jbench.config import ConfigError, load_profile, user_config_dirs

    source = None
    try:
        if bandwidth_gbs is None and profile:
            bandwidth_gbs = load_profile(profile, user_config_dirs(list(config_dirs))).get("memory_bandwidth_gbs")
            source = f"profile {profile}"
        text, data = trace_analyze_command(path, bandwidth_gbs, decode_tps, prefill_tps=prefill_tps,
                                           n_decode_tokens=n_decode_tokens, bandwidth_source=source)
    except (TraceError, ConfigError) as exc:
        raise _fail(str(exc)) from None
    click.echo(json.dumps(data, indent=2, default=str) if as_json else text)
