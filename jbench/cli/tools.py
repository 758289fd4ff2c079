"""`jbench roofline`, `telemetry parse`, `trace analyze`: tools that need no device or store."""

from __future__ import annotations

import sys

import click
from rich.table import Table

from jbench.cli import common_options, _config_dir_option, _fail, console, err_console, main


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
    from jbench.config import ConfigError
    from jbench.reporting.roofline import roofline_figures

    try:
        fig = roofline_figures(model_name, quant=quant, depth=depth, kv_type=kv_type, device_name=device_name,
                               bandwidth_gbs=bandwidth_gbs, config_dirs=list(config_dirs))
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


@main.group()
@common_options(results_dir=False)
def telemetry() -> None:
    """Telemetry tools."""


@telemetry.command("parse")
@common_options(results_dir=False)
@click.argument("source", type=click.File("r"))
@click.option("--format", "fmt", type=click.Choice(["jsonl", "csv"]), default="jsonl", show_default=True)
@click.option("--rails", default=None, help="Comma list of rails whose sum is the total power (default: the documented rule).")
def telemetry_parse(source, fmt, rails) -> None:
    """Turn a tegrastats log (FILE or -) into JSON lines or CSV; unparseable lines are counted and skipped."""
    import csv
    import json

    from jbench.device.telemetry.tegrastats import parse_stream, sample_to_dict

    spec = rails.split(",") if rails else None
    samples, skipped = parse_stream(source)
    rows = [sample_to_dict(sample, spec) for sample in samples]
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
    from jbench.config import user_config_dirs

    try:
        text, data = trace_analyze_command(path, bandwidth_gbs, decode_tps, prefill_tps=prefill_tps,
                                           n_decode_tokens=n_decode_tokens, profile=profile,
                                           config_dirs=user_config_dirs(list(config_dirs)))
    except TraceError as exc:
        raise _fail(str(exc)) from None
    click.echo(json.dumps(data, indent=2, default=str) if as_json else text)
