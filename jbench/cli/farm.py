"""`jbench farm`: the device farm's places and leases on a labgrid coordinator (docs/farm.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Optional

import click
from rich.table import Table

from jbench.core.exitcodes import ExitCode
from jbench.core.schema import DeviceConfig, FarmConfig, typed
from jbench.cli.app import _config_dir_option, _fail, common_options, console, main

_coordinator_option = click.option(
    "--coordinator", envvar="LG_COORDINATOR", default=None, metavar="HOST:PORT",
    help="The labgrid coordinator (also $LG_COORDINATOR, as labgrid-client reads it; else farm.coordinator).")
_tag_option = click.option("-t", "--tag", "tags", multiple=True, metavar="KEY=VALUE",
                           help="Select places with this tag (repeatable): module, sku, l4t, carrier, class, ...")


def _farm_config(config_dirs) -> FarmConfig:
    from omegaconf import OmegaConf

    from jbench.config import ConfigError, compose, user_config_dirs

    try:
        cfg, _ = compose([], user_config_dirs(list(config_dirs)))
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    return typed(FarmConfig, OmegaConf.to_container(cfg.farm, resolve=True), where="farm")


def _address(coordinator: Optional[str], farm: Optional[FarmConfig]) -> str:
    """--coordinator ($LG_COORDINATOR), else farm.coordinator (farm None: the option was given)."""
    address = coordinator or (farm.coordinator if farm else None)
    if not address:
        raise _fail("no labgrid coordinator given: pass --coordinator HOST:PORT, set $LG_COORDINATOR, or set "
                    "farm.coordinator in your config (docs/farm.md: start one with `labgrid-coordinator`)")
    return address


class _Session:
    """Opens the coordinator and turns farm errors into one message (exit 2)."""

    def __init__(self, address: str):
        self.address = address

    def __enter__(self):
        from jbench.farm.coordinator import Coordinator, CoordinatorError

        try:
            self.coord = Coordinator(self.address).open()
        except CoordinatorError as exc:
            raise _fail(str(exc)) from None
        return self.coord

    def __exit__(self, exc_type, exc, tb):
        from jbench.farm import CoordinatorError, FarmError

        self.coord.close()
        if isinstance(exc, (CoordinatorError, FarmError)):
            raise _fail(str(exc)) from None
        return False


def _selector(tags) -> dict:
    from jbench.farm.places import FarmError, parse_selector

    try:
        return parse_selector(tags)
    except FarmError as exc:
        raise _fail(str(exc)) from None


@main.group()
@common_options(results_dir=False)
def farm() -> None:
    """The device farm: Jetsons as labgrid places, leased through a labgrid coordinator."""


@farm.command("list")
@common_options(results_dir=False)
@_coordinator_option
@_tag_option
@_config_dir_option
def farm_list(coordinator, tags, config_dirs) -> None:
    """List the places (optionally those matching --tag) with their tags, holder and health."""
    from jbench.farm import places as P
    from jbench.farm.coordinator import iter_places
    from jbench.farm.reservation import heartbeat_age

    selector = _selector(tags)
    with _Session(_address(coordinator, None if coordinator else _farm_config(config_dirs))) as coord:
        rows = list(iter_places(coord, selector))
    table = Table(title="farm places", title_justify="left")
    for col in ("place", "state", "device", *P.SELECT_TAGS, "holder", "heartbeat", "note"):
        table.add_column(col, overflow="fold")
    for p in rows:
        age = heartbeat_age(p)
        table.add_row(p.name, P.state(p), P.device_entry(p), *(p.tags.get(t, "-") for t in P.SELECT_TAGS),
                      (p.tags.get(P.OWNER) or p.acquired or "-") if p.acquired else "-",
                      f"{age:.0f} s ago" if age is not None and p.acquired else "-",
                      p.tags.get(P.QUARANTINE, ""))
    console.print(table)


@farm.command("status")
@common_options(results_dir=False)
@_coordinator_option
@_config_dir_option
def farm_status(coordinator, config_dirs) -> None:
    """The places and the reservation queue (who waits, in which order, for what)."""
    from jbench.farm import places as P

    with _Session(_address(coordinator, None if coordinator else _farm_config(config_dirs))) as coord:
        places = coord.places()
        reservations = coord.reservations()
    counts: dict[str, int] = {}
    for p in places:
        counts[P.state(p)] = counts.get(P.state(p), 0) + 1
    console.print(f"coordinator {coord.address}: {len(places)} place(s): "
                  + (", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "none"), highlight=False)
    for p in places:
        if P.is_quarantined(p):
            console.print(f"  {p.name}: quarantined: {p.tags.get(P.QUARANTINE, '')}", highlight=False)
    waiting = sorted((r for r in reservations if r.state == "waiting"), key=lambda r: (-r.prio, r.created))
    table = Table(title="reservations", title_justify="left")
    for col in ("position", "owner", "state", "priority", "filter", "place"):
        table.add_column(col, overflow="fold")
    ordered = waiting + [r for r in reservations if r.state != "waiting"]
    for r in ordered:
        pos = str(waiting.index(r) + 1) if r in waiting else "-"
        flt = ",".join(f"{k}={v}" for k, v in r.filters.get("main", {}).items() if k != P.HEALTH)
        table.add_row(pos, r.owner, r.state, f"{r.prio:g}", flt or "(any)", ",".join(r.places) or "-")
    console.print(table)


@farm.command("add")
@common_options(results_dir=False)
@click.argument("place")
@click.option("--device", "device_entry", default=None, help="The jbench device entry (default: the place's name).")
@_tag_option
@_coordinator_option
@_config_dir_option
def farm_add(place, device_entry, tags, coordinator, config_dirs) -> None:
    """Create PLACE (if missing), tag it and enrol it as healthy."""
    from jbench.farm import places as P

    selector = _selector(tags)
    with _Session(_address(coordinator, None if coordinator else _farm_config(config_dirs))) as coord:
        if place not in {p.name for p in coord.places()}:
            coord.add_place(place)
        coord.set_tags(place, {**selector, P.DEVICE: device_entry or place, P.HEALTH: P.HEALTHY})
    console.print(f"place {place}: device {device_entry or place}, tags {','.join(tags) or '-'}", highlight=False)


@farm.command("reserve", context_settings={"ignore_unknown_options": True})
@common_options(results_dir=False)
@_tag_option
@click.option("--count", type=click.IntRange(min=1), default=1, show_default=True, help="How many places.")
@click.option("--priority", type=float, default=None, help="Queue priority (higher first; default farm.priority).")
@click.option("--timeout", "timeout_s", type=float, default=None, help="Seconds to wait (default farm.reserve_timeout_s).")
@click.option("--sweep-id", default="manual", show_default=True, help="Named in the place's jbench_owner tag.")
@click.option("--no-health-check", is_flag=True, help="Skip the quick health check of the leased devices.")
@click.option("--heartbeat-s", type=float, default=None, help="Heartbeat period (default farm.heartbeat_s).")
@click.option("--stale-after", "stale_after_s", type=float, default=None,
              help="Free matching places whose jbench holder is silent this long (default farm.stale_after_s).")
@_coordinator_option
@_config_dir_option
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def farm_reserve(tags, count, priority, timeout_s, sweep_id, no_health_check, heartbeat_s, stale_after_s, coordinator,
                 config_dirs, command) -> None:
    """Reserve and hold places matching --tag until Ctrl-C (or SIGTERM), or run `-- COMMAND ...` while holding
    them (it gets $JBENCH_FARM_DEVICES, $JBENCH_FARM_PLACES and $LG_PLACE)."""
    from jbench.farm import CoordinatorError, FarmError, lease

    if not tags:
        raise _fail("say which places: --tag KEY=VALUE (e.g. --tag class=orin-nano-8gb); `jbench farm list` shows the tags")
    selector = _selector(tags)
    cfg = _farm_config(config_dirs)
    address = _address(coordinator, cfg)
    held = lease(address, selector, count=count, priority=cfg.priority if priority is None else priority,
                 sweep_id=sweep_id, config_dirs=config_dirs,
                 heartbeat_s=cfg.heartbeat_s if heartbeat_s is None else heartbeat_s,
                 stale_after_s=cfg.stale_after_s if stale_after_s is None else stale_after_s,
                 reserve_timeout_s=cfg.reserve_timeout_s if timeout_s is None else timeout_s,
                 health_check=not no_health_check, on_wait=lambda msg: click.echo(msg, err=True))
    try:
        with held:
            devices = [typed(DeviceConfig, d, where="device") for d in held.devices]
            for place, device in zip(held.places, devices):
                click.echo(f"reserved {place}: device {device.name} ({device.host or 'this machine'})")
            sys.stdout.flush()
            if command:
                env = {**os.environ, "JBENCH_FARM_PLACES": ",".join(held.places), "LG_PLACE": held.places[0],
                       "JBENCH_FARM_DEVICES": ",".join(d.name for d in devices)}
                rc = subprocess.call(list(command), env=env)
                raise click.exceptions.Exit(rc)
            click.echo("holding; Ctrl-C releases", err=True)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        click.echo("released", err=True)
        raise click.exceptions.Exit(ExitCode.INTERRUPTED) from None
    except (CoordinatorError, FarmError) as exc:
        raise _fail(str(exc)) from None


@farm.command("release")
@common_options(results_dir=False)
@click.argument("place")
@click.option("--kick", is_flag=True, help="Release it even though another controller or person holds it.")
@_coordinator_option
@_config_dir_option
def farm_release(place, kick, coordinator, config_dirs) -> None:
    """Release PLACE (yours; another holder's only with --kick)."""
    from jbench.farm import places as P

    with _Session(_address(coordinator, None if coordinator else _farm_config(config_dirs))) as coord:
        p = coord.place(place)
        if not p.acquired:
            console.print(f"place {place} is not held", highlight=False)
            return
        if p.acquired != coord.name and not kick:
            raise _fail(f"place {place} is held by {p.tags.get(P.OWNER) or p.acquired}: release it there, or "
                        f"pass --kick if you are sure it is abandoned")
        coord.set_tags(place, {P.OWNER: "", P.HEARTBEAT: ""})
        coord.release(place, from_user=p.acquired)
        if p.reservation:
            try:
                coord.cancel(p.reservation)
            except Exception:
                pass
    console.print(f"released place {place}", highlight=False)


@farm.command("quarantine")
@common_options(results_dir=False)
@click.argument("place")
@click.option("--reason", required=True, help="Why (shown in `jbench farm list`).")
@_coordinator_option
@_config_dir_option
def farm_quarantine(place, reason, coordinator, config_dirs) -> None:
    """Take PLACE out of selection (tagged with the reason) until `jbench farm unquarantine`."""
    from jbench.farm.health import quarantine

    with _Session(_address(coordinator, None if coordinator else _farm_config(config_dirs))) as coord:
        coord.place(place)
        quarantine(coord, place, reason)
    console.print(f"place {place} quarantined: {reason}", highlight=False)


@farm.command("unquarantine")
@common_options(results_dir=False)
@click.argument("place")
@_coordinator_option
@_config_dir_option
def farm_unquarantine(place, coordinator, config_dirs) -> None:
    """Return PLACE to selection."""
    from jbench.farm.health import unquarantine

    with _Session(_address(coordinator, None if coordinator else _farm_config(config_dirs))) as coord:
        coord.place(place)
        unquarantine(coord, place)
    console.print(f"place {place} is back in selection", highlight=False)


@farm.command("reap")
@common_options(results_dir=False)
@click.option("--stale-after", "stale_after_s", type=float, default=None,
              help="Seconds without a jbench heartbeat (default farm.stale_after_s).")
@_coordinator_option
@_config_dir_option
def farm_reap(stale_after_s, coordinator, config_dirs) -> None:
    """Release places whose jbench holder stopped heart-beating (run it from cron)."""
    from jbench.farm.reservation import reap

    cfg = _farm_config(config_dirs)
    with _Session(_address(coordinator, cfg)) as coord:
        freed = reap(coord, cfg.stale_after_s if stale_after_s is None else stale_after_s)
    for place, owner in freed:
        console.print(f"freed {place} (held by {owner})", highlight=False)
    if not freed:
        console.print("no stale places", highlight=False)
