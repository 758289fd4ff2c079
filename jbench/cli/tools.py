"""`jbench roofline`, `telemetry parse`, `trace analyze`: tools that need no device or store."""

from __future__ import annotations

import sys

import click
from rich.table import Table

from jbench.cli.app import common_options, _config_dir_option, _fail, console, err_console, main
from jbench.core.schema import DeviceConfig, ProfileConfig, typed
from jbench.device.bandwidth import device_bandwidth
from jbench.device.telemetry.tegrastats import read_log, sample_to_dict


@main.command()
@common_options(results_dir=False)
@click.option("--model", "model_name", required=True, help="Model config name (e.g. gemma3_270m) or a GGUF path.")
@click.option("--device", "device_name", default=None, help="Device entry whose profile gives the bandwidth.")
@click.option("--bandwidth-gbs", type=float, default=None, help="Memory bandwidth in GB/s (instead of a device).")
@click.option("--quant", default=None)
@click.option("--ctx", "depth", type=int, default=0, show_default=True, help="Context depth (tokens in the KV cache).")
@click.option("--kv", "kv_type", default="f16", show_default=True, help="KV cache type for K and V.")
@click.option("--json", "as_json", is_flag=True)
@_config_dir_option
def roofline(model_name, device_name, bandwidth_gbs, quant, depth, kv_type, as_json, config_dirs) -> None:
    """Bytes per decoded token and the bandwidth ceiling on tok/s for a model on a device."""
    import json

    from jbench.analysis.roofline import RooflineError
    from jbench.config import ConfigError, user_config_dirs
    from jbench.reporting.roofline import roofline_figures

    try:
        dirs = user_config_dirs(list(config_dirs))
        path = _model_path(model_name, quant, dirs)
        source = "--bandwidth-gbs"
        if bandwidth_gbs is None and device_name:
            bandwidth_gbs, source = _device_bandwidth(device_name, dirs)
        fig = roofline_figures(path, quant=quant, depth=depth, kv_type=kv_type, bandwidth_gbs=bandwidth_gbs,
                               bandwidth_source=source)
    except (RooflineError, ConfigError, ValueError) as exc:
        raise _fail(str(exc)) from None
    if as_json:
        click.echo(json.dumps(fig, indent=2))
        return
    table = Table(title=f"roofline: {fig['model']} {fig.get('quant') or ''}", title_justify="left")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    for key, value in fig.items():
        if isinstance(value, float):
            value = f"{value:,.4g}" if abs(value) < 1e6 else f"{value:,.0f}"
        elif isinstance(value, int):
            value = f"{value:,}"
        table.add_row(key, str(value))
    console.print(table)


def _model_path(model: str, quant, dirs) -> str:
    """A GGUF path as given, or the file of a model config entry (and quant)."""
    from pathlib import Path

    from omegaconf import OmegaConf

    from jbench.config import compose
    from jbench.models.store import ModelError, resolve_model_file

    if model.endswith(".gguf") or Path(model).is_file():
        return model
    cfg, _ = compose([f"model={model}"] + ([f"model.quant={quant}"] if quant else []), dirs)
    try:
        path, _ = resolve_model_file(OmegaConf.to_container(cfg.model, resolve=True))
    except ModelError as exc:
        raise ValueError(str(exc)) from None
    return path


def _device_bandwidth(device_name: str, dirs) -> tuple[float, str]:
    """A device entry's read bandwidth (calibration, else its profile's datasheet figure) and its source."""
    from omegaconf import OmegaConf

    from jbench.config import compose, load_profile

    cfg, _ = compose([f"device={device_name}"], dirs)
    device = typed(DeviceConfig, OmegaConf.to_container(cfg.device, resolve=True), where="device")
    profile = typed(ProfileConfig, load_profile(device.profile, dirs), where="profile") if device.profile else None
    bw = device_bandwidth(device, profile)
    if bw.gbs is None:
        raise ValueError(bw.source)
    return bw.gbs, bw.source


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
