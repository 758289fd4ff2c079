"""The device farm measured at scale (issue 14): real `jbench sweep` processes against emulated Jetsons (a real
sshd each on loopback, tests/emulated_jetson) and, for the shared and SIGKILL scenarios, a real labgrid-coordinator.
Every trial's device-side work is a fixed sleep (bench/farm_engine.sh), stamped on the device, so the figures are
about the controller, not this machine's CPU.

    .venv/bin/python bench/farm_scale.py --scenario all                  # the full sizes (64 / 16 / 4 devices)
    .venv/bin/python bench/farm_scale.py --scenario utilisation --devices 8 --trial-s 5   # a quick small run

Scenarios (JSON results in bench/results/farm-scale/<scenario>.json; the definitions are in docs/PERFORMANCE.md,
"The device farm at scale"):
- utilisation: one controller, `device=@orin_nano_super` over N devices, T trials per device of S seconds.
  Per device: busy = sum of the engine's own sleep intervals (device clock); wall = from the unit's on-device
  lease (the lease file appearing on the device) to the end of the sweep's last trial on any unit; plus the
  steady-state share from the unit's first trial start. Controller CPU and peak RSS from wait4() of the process.
- shared: three `jbench sweep` processes (each its own experiment and store, LG_USERNAME ctl-A/B/C so the
  coordinator tells them apart) sharing 16 places, several sweeps each: no device held twice at once (coordinator
  polled every 0.2 s and the devices' own stamps with the on-device lease's owner), every trial exactly once
  (MLflow), wait for a lease per place reservation and per sweep (p50/p95).
- sigkill: a controller SIGKILLed mid-sweep, the same sweep started again at once: time from the kill until its
  places are free (bound: farm.stale_after_s + the reaper's period farm.heartbeat_s + 1 s of tag resolution),
  power state restored by the next holder, its runs KILLED with a reason, unfinished trials run once.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Optional

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _procstat import load_average, machine  # noqa: E402

from tests.emulated_jetson import EmulatedJetson  # noqa: E402
from tests.labgrid_fixture import start_coordinator, stop_process  # noqa: E402

ENGINE = Path(__file__).resolve().parent / "farm_engine.sh"
CLASS = "orin_nano_super"
BUSY_LOG = "farm-bench-busy.log"
OUT_DIR = ROOT / "bench" / "results" / "farm-scale"
NO_TELEMETRY = ["telemetry.source=none", "thermal.start_below_c=null", "device.lease_wait_s=600"]
POWER = ["power.mode=15W", "power.jetson_clocks=true"]


# -- devices, config, processes ---------------------------------------------------------------------------------

def start_devices(n: int, base: Path) -> list[EmulatedJetson]:
    """n emulated Orin Nano Supers (each a supervisor + sshd), started from the main thread: a supervisor ends
    with the thread that started it (PR_SET_PDEATHSIG)."""
    emus: list[EmulatedJetson] = []
    try:
        for i in range(n):
            d = base / f"emu-{i:02d}"
            d.mkdir(parents=True)
            emus.append(EmulatedJetson.start(CLASS, base_dir=d, start_timeout_s=60))
    except BaseException:
        stop_devices(emus)
        raise
    return emus


def stop_devices(emus: list[EmulatedJetson]) -> None:
    for emu in emus:
        try:
            emu.stop()
        except Exception as exc:  # stop the others anyway
            print(f"stopping {emu!r}: {exc}", file=sys.stderr)


def unit_name(i: int) -> str:
    return f"u{i:02d}"


def write_conf(conf: Path, emus: list[EmulatedJetson], trial_s: float, controller: str,
               device_class: Optional[str] = CLASS) -> Path:
    (conf / "device").mkdir(parents=True, exist_ok=True)
    (conf / "backend").mkdir(exist_ok=True)
    for i, emu in enumerate(emus):
        cfg = emu.device_config(name=unit_name(i))
        cfg["paths"]["boot_id"] = str(emu.boot_id_path)
        # No bandwidth probe on the "device" (this host): the roofline of a sleep means nothing.
        cfg.update(connect_timeout_s=30.0, device_class=device_class, auto_calibrate=False)
        (conf / "device" / f"{unit_name(i)}.yaml").write_text(
            yaml.safe_dump({"defaults": ["device_schema", "_self_"], **cfg}))
    (conf / "backend" / "sleepy.yaml").write_text(yaml.safe_dump({
        "defaults": ["engine_schema", "_self_"], "name": "engine", "output": "log", "n_prompt": 16, "n_gen": 8,
        "repetitions": 1, "warmup": False, "command": [str(ENGINE), str(trial_s), "{prompt_tokens}", "{gen_tokens}", controller]}))
    return conf


def jbench_argv(conf: Path, overrides: list[str]) -> list[str]:
    exe = Path(sys.executable).with_name("jbench")
    return [str(exe), "sweep", "--config-dir", str(conf), f"device=@{CLASS}", "backend=sleepy", *NO_TELEMETRY,
            *overrides]


def n_gen_values(first: int, count: int) -> str:
    return "backend.n_gen=" + ",".join(str(v) for v in range(first, first + count))


class Controller:
    """One `jbench sweep` process; its CPU and peak RSS come from wait4() when it ends."""

    def __init__(self, argv: list[str], env: dict, log_path: Path):
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.started = time.time()
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        self.rc: Optional[int] = None
        self.ended: Optional[float] = None
        self.cpu_s = self.maxrss_mib = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait(self) -> int:
        _, status, ru = os.wait4(self.proc.pid, 0)
        self.ended = time.time()
        self.proc.returncode = self.rc = os.waitstatus_to_exitcode(status)
        self.cpu_s = ru.ru_utime + ru.ru_stime
        self.maxrss_mib = ru.ru_maxrss / 1024
        self.log.close()
        return self.rc

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


def env_for(results: Path, **extra: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(JBENCH_RESULTS_DIR=str(results), COLUMNS="200", **extra)
    return env


def busy_stamps(emu: EmulatedJetson) -> list[dict]:
    try:
        lines = (emu.home / BUSY_LOG).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        t0, t1, ctl, pid, sweep = line.split()
        out.append({"start": float(t0), "end": float(t1), "controller": ctl,
                    "lease_pid": int(pid) if pid.isdigit() else None, "lease_sweep": sweep})
    return out


class LeaseWatcher(threading.Thread):
    """When each device's on-device lease file first appears (polled every 20 ms on the device's own files)."""

    def __init__(self, emus: list[EmulatedJetson]):
        super().__init__(daemon=True)
        self.emus = emus
        self.first: dict[int, float] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        dirs = [emu.home / ".cache" / "jbench" for emu in self.emus]
        while not self.stop.is_set() and len(self.first) < len(dirs):
            for i, d in enumerate(dirs):
                if i not in self.first and any(d.glob("lease-*.json")):
                    self.first[i] = time.time()
            self.stop.wait(0.02)


def trial_runs(results: Path, experiment: str) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{results}/mlflow.db")
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    return [r for r in client.search_runs([exp.experiment_id], max_results=50000)
            if r.data.tags.get("jbench.kind") == "trial"]


def pct(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    vals = sorted(values)
    k = (len(vals) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(vals) - 1)
    return round(vals[lo] + (vals[hi] - vals[lo]) * (k - lo), 3)


def summary(values: list[float]) -> dict:
    if not values:
        return {}
    return {"n": len(values), "min": round(min(values), 4), "median": round(statistics.median(values), 4),
            "p95": pct(values, 0.95), "max": round(max(values), 4)}


class LoadSampler(threading.Thread):
    """The 1-minute load average and the whole machine's CPU use during a scenario (for reading the figures)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.samples: list[float] = []
        self.stop = threading.Event()
        self.cpu0 = self._cpu()

    @staticmethod
    def _cpu() -> tuple[float, float]:
        f = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(f), f[3] + f[4]

    def run(self) -> None:
        while not self.stop.wait(5):
            self.samples.append(os.getloadavg()[0])

    def result(self) -> dict:
        total, idle = self._cpu()
        busy = 1 - (idle - self.cpu0[1]) / max(1e-9, total - self.cpu0[0])
        return {"loadavg_1m": summary(self.samples), "machine_cpu_busy_pct": round(100 * busy, 1)}


# -- A: one controller, many devices ----------------------------------------------------------------------------

def scenario_utilisation(args, work: Path) -> dict:
    n, per, trial_s = args.devices, args.trials_per_device, args.trial_s
    t0 = time.time()
    emus = start_devices(n, work / "devices")
    started_s = time.time() - t0
    try:
        conf = write_conf(work / "conf", emus, trial_s, "A")
        power = POWER if args.power else []
        argv = jbench_argv(conf, [n_gen_values(1, n * per), *power, *args.extra])
        watcher = LeaseWatcher(emus)
        watcher.start()
        load = LoadSampler()
        load.start()
        ctl = Controller(argv, env_for(work / "results"), work / "controller.log")
        rc = ctl.wait()
        load.stop.set()
        watcher.stop.set()
        if rc != 0:
            raise SystemExit(f"the sweep exited {rc}:\n{ctl.tail()}")
        stamps = {i: busy_stamps(emu) for i, emu in enumerate(emus)}
        runs = trial_runs(work / "results", "adhoc")
    finally:
        stop_devices(emus)
    end = max(s["end"] for ss in stamps.values() for s in ss)
    per_unit, gaps = [], []
    for i in range(n):
        ss = sorted(stamps[i], key=lambda s: s["start"])
        busy = sum(s["end"] - s["start"] for s in ss)
        lease = watcher.first.get(i)
        first = ss[0]["start"] if ss else None
        gaps += [b["start"] - a["end"] for a, b in zip(ss, ss[1:])]
        per_unit.append({
            "unit": unit_name(i), "trials": len(ss), "busy_s": round(busy, 3),
            "lease_at_s": round(lease - ctl.started, 3) if lease else None,
            "first_trial_at_s": round(first - ctl.started, 3) if first else None,
            "lease_to_first_trial_s": round(first - lease, 3) if lease and first else None,
            "utilisation_from_lease": round(busy / (end - lease), 4) if lease else None,
            "utilisation_from_first_trial": round(busy / (end - first), 4) if first else None})
    statuses = Counter(r.info.status for r in runs)
    indexes = Counter(int(r.data.tags["jbench.trial_index"]) for r in runs)
    return {
        "scenario": "utilisation", "devices": n, "trials_per_device": per, "trial_s": trial_s,
        "power_control": bool(args.power), "extra_overrides": args.extra, "command": argv_for_report(argv),
        "devices_started_in_s": round(started_s, 1),
        "controller": {"rc": rc, "wall_s": round(ctl.ended - ctl.started, 2), "cpu_s": round(ctl.cpu_s, 2),
                       "cpu_s_per_device": round(ctl.cpu_s / n, 3),
                       "cpu_s_per_trial": round(ctl.cpu_s / (n * per), 3),
                       "peak_rss_mib": round(ctl.maxrss_mib, 1),
                       "peak_rss_mib_per_device": round(ctl.maxrss_mib / n, 2),
                       "sweep_end_at_s": round(end - ctl.started, 3)},
        "utilisation_from_lease": summary([u["utilisation_from_lease"] for u in per_unit
                                           if u["utilisation_from_lease"] is not None]),
        "utilisation_from_first_trial": summary([u["utilisation_from_first_trial"] for u in per_unit
                                                 if u["utilisation_from_first_trial"] is not None]),
        "lease_to_first_trial_s": summary([u["lease_to_first_trial_s"] for u in per_unit
                                           if u["lease_to_first_trial_s"] is not None]),
        "gap_between_trials_s": summary(gaps),
        "mlflow": {"trial_runs": len(runs), "statuses": dict(statuses),
                   "every_trial_once": sorted(indexes) == list(range(1, n * per + 1)) and set(indexes.values()) == {1}},
        "load": load.result(), "per_unit": per_unit,
    }


def argv_for_report(argv: list[str]) -> str:
    return " ".join(["jbench", *argv[1:]]).replace(str(ROOT) + "/", "")


# -- the coordinator and its observer ---------------------------------------------------------------------------

def add_places(address: str, n: int) -> list[str]:
    from jbench.farm import places as P
    from jbench.farm.coordinator import Coordinator

    names = []
    with Coordinator(address) as c:
        for i in range(n):
            name = f"jetson-{unit_name(i)}"
            c.add_place(name)
            c.set_tags(name, {"class": CLASS, P.DEVICE: unit_name(i), P.HEALTH: P.HEALTHY})
            names.append(name)
    return names


class CoordinatorObserver(threading.Thread):
    """Polls the coordinator (places and reservations) every `period` s: hold intervals per place (who held it,
    labgrid's acquired name, jbench's owner tag) and, per reservation, when it was created and when its place
    was first seen acquired under it."""

    def __init__(self, address: str, period: float = 0.2):
        super().__init__(daemon=True)
        self.address, self.period = address, period
        self.stop = threading.Event()
        self.holds: dict[str, list[dict]] = defaultdict(list)  # place -> [{holder, owner, from, to}]
        self.reservations: dict[str, dict] = {}  # token -> {owner, created, acquired_at, place}
        self.max_holders_seen = 0
        self.polls = 0

    def run(self) -> None:
        from jbench.farm import places as P
        from jbench.farm.coordinator import Coordinator, CoordinatorError

        c = Coordinator(self.address)
        c.open()
        try:
            while not self.stop.is_set():
                try:
                    places, reservations = c.places(), c.reservations()
                except CoordinatorError:
                    self.stop.wait(self.period)
                    continue
                now = time.time()
                self.polls += 1
                for r in reservations:
                    self.reservations.setdefault(r.token, {"owner": r.owner, "created": r.created,
                                                           "acquired_at": None, "place": None})
                for p in places:
                    hs = self.holds[p.name]
                    cur = hs[-1] if hs and hs[-1]["to"] is None else None
                    if p.acquired and (cur is None or cur["holder"] != p.acquired):
                        if cur is not None:
                            cur["to"] = now
                        hs.append({"holder": p.acquired, "owner": p.tags.get(P.OWNER, ""), "from": now, "to": None,
                                   "reservation": p.reservation})
                    elif not p.acquired and cur is not None:
                        cur["to"] = now
                    if p.acquired and p.reservation in self.reservations:
                        r = self.reservations[p.reservation]
                        if r["acquired_at"] is None:
                            r["acquired_at"], r["place"] = now, p.name
                    if cur is not None and cur["holder"] == p.acquired and not cur["owner"]:
                        cur["owner"] = p.tags.get(P.OWNER, "")
                self.stop.wait(self.period)
        finally:
            c.close()

    def finish(self) -> None:
        self.stop.set()
        self.join(10)
        now = time.time()
        for hs in self.holds.values():
            for h in hs:
                if h["to"] is None:
                    h["to"] = now


def overlaps(intervals: list[tuple[float, float, str]]) -> list[tuple]:
    """Every pair of intervals of different owners that overlap in time (all pairs: a few dozen per device)."""
    return [(a, b) for i, a in enumerate(intervals) for b in intervals[i + 1:]
            if a[2] != b[2] and a[0] < b[1] and b[0] < a[1]]


# -- B: three controllers, one coordinator ----------------------------------------------------------------------

def scenario_shared(args, work: Path) -> dict:
    n, per_ctl, rounds, trial_s = args.shared_devices, args.places_per_sweep, args.rounds, args.shared_trial_s
    trials = args.trials_per_sweep or 2 * per_ctl
    names = ["A", "B", "C"][:args.controllers]
    coord_proc, address = start_coordinator(work / "coordinator")
    emus = start_devices(n, work / "devices")
    observer = CoordinatorObserver(address)
    load = LoadSampler()
    try:
        add_places(address, n)
        observer.start()
        load.start()
        results: dict[str, list[Controller]] = {k: [] for k in names}

        def controller_loop(name: str) -> None:
            conf = write_conf(work / f"conf-{name}", emus, trial_s, name, device_class=None)
            for r in range(rounds):  # each round a new set of trials (a sweep over the same trials would resume)
                argv = jbench_argv(conf, [n_gen_values(1 + r * trials, trials), f"farm.coordinator={address}",
                                          f"farm.devices={per_ctl}", "farm.heartbeat_s=2",
                                          f"tracking.experiment_name=ctl-{name}", *args.extra])
                ctl = Controller(argv, env_for(work / f"results-{name}", LG_USERNAME=f"ctl-{name}"),
                                 work / f"controller-{name}-{r}.log")
                results[name].append(ctl)
                if ctl.wait() != 0:
                    print(f"controller {name} round {r} exited {ctl.rc}:\n{ctl.tail()}", file=sys.stderr)

        threads = [threading.Thread(target=controller_loop, args=(k,)) for k in names]
        for t in threads:
            t.start()
            time.sleep(0.3)  # distinct reservation ages; all three still compete for the places
        for t in threads:
            t.join()
        observer.finish()
        load.stop.set()
        stamps = {unit_name(i): busy_stamps(emu) for i, emu in enumerate(emus)}
        runs = {k: trial_runs(work / f"results-{k}", f"ctl-{k}") for k in names}
    finally:
        observer.stop.set()
        stop_devices(emus)
        stop_process(coord_proc)
    pid_of = {c.pid: k for k, cs in results.items() for c in cs}
    problems: list[str] = []
    # The coordinator's view: per place, holds by different sessions never overlap.
    coord_overlaps = sum(len(overlaps([(h["from"], h["to"], h["holder"]) for h in hs]))
                         for hs in observer.holds.values())
    # The devices' view: per device, busy intervals of different controllers never overlap, and each ran under
    # the on-device lease of the controller process that ran it.
    device_overlaps = sum(len(overlaps([(s["start"], s["end"], s["controller"]) for s in ss])) for ss in stamps.values())
    wrong_lease = [(u, s) for u, ss in stamps.items() for s in ss if pid_of.get(s["lease_pid"]) != s["controller"]]
    # Across the two: every device-side interval lies in a coordinator hold of its place by that controller.
    outside = 0
    slack = 2 * observer.period
    for u, ss in stamps.items():
        hs = observer.holds.get(f"jetson-{u}", [])
        for s in ss:
            if not any(h["holder"].endswith(f"/ctl-{s['controller']}") and h["from"] - slack <= s["start"]
                       and s["end"] <= h["to"] + slack for h in hs):
                outside += 1
    if coord_overlaps:
        problems.append(f"{coord_overlaps} overlapping holds in the coordinator's state")
    if device_overlaps:
        problems.append(f"{device_overlaps} overlapping busy intervals on the devices")
    if wrong_lease:
        problems.append(f"{len(wrong_lease)} trials ran under another controller's on-device lease")
    if outside:
        problems.append(f"{outside} device-side intervals outside a coordinator hold by their controller")
    # Every trial exactly once: per controller, rounds * trials runs, each identity once, all FINISHED.
    once = {}
    for k, rs in runs.items():
        idents = Counter(r.data.tags.get("jbench.identity") for r in rs)
        once[k] = {"trial_runs": len(rs), "expected": rounds * trials,
                   "statuses": dict(Counter(r.info.status for r in rs)),
                   "duplicates": sum(v - 1 for v in idents.values() if v > 1)}
        stamped = sum(1 for ss in stamps.values() for s in ss if s["controller"] == k)
        once[k]["device_side_trials"] = stamped
        if len(rs) != rounds * trials or once[k]["duplicates"] or set(once[k]["statuses"]) != {"FINISHED"} \
                or stamped != rounds * trials:
            problems.append(f"controller {k}: {once[k]}")
    for k, cs in results.items():
        for c in cs:
            if c.rc != 0:
                problems.append(f"controller {k} exited {c.rc}")
    # Waits: per place reservation (created -> its place acquired) and per sweep (its first reservation -> its
    # last place acquired: the sweep starts when it holds all farm.devices places).
    res = [r for r in observer.reservations.values() if r["acquired_at"] is not None]
    place_waits = [max(0.0, r["acquired_at"] - r["created"]) for r in res]
    by_sweep = defaultdict(list)
    for k, cs in results.items():
        for c in cs:
            mine = [r for r in res if r["owner"].endswith(f"/ctl-{k}") and c.started <= r["created"] <= (c.ended or 0)]
            if mine:
                by_sweep[k].append(max(r["acquired_at"] for r in mine) - min(r["created"] for r in mine))
    sweep_waits = [w for ws in by_sweep.values() for w in ws]
    return {
        "scenario": "shared", "devices": n, "controllers": len(names), "places_per_sweep": per_ctl,
        "sweeps_per_controller": rounds, "trials_per_sweep": trials, "trial_s": trial_s,
        "command_of_one_sweep": argv_for_report(jbench_argv(work / "conf-A", [
            n_gen_values(1, trials), f"farm.coordinator={address}", f"farm.devices={per_ctl}", "farm.heartbeat_s=2",
            "tracking.experiment_name=ctl-A", *args.extra])),
        "coordinator_polls": observer.polls, "poll_period_s": observer.period,
        "holds_seen": sum(len(hs) for hs in observer.holds.values()),
        "coordinator_overlapping_holds": coord_overlaps, "device_overlapping_busy": device_overlaps,
        "trials_under_another_controllers_lease": len(wrong_lease), "device_busy_outside_a_hold": outside,
        "exactly_once": once,
        "wait_per_place_reservation_s": summary(place_waits), "wait_per_sweep_s": summary(sweep_waits),
        "controller_wall_s": {k: [round(c.ended - c.started, 1) for c in cs] for k, cs in results.items()},
        "load": load.result(), "problems": problems, "ok": not problems,
        # The raw observations the checks above read, to check again: epoch seconds.
        "coordinator_holds": {p: [{k: h[k] for k in ("holder", "owner", "from", "to")} for h in hs]
                              for p, hs in observer.holds.items()},
        "device_busy": {u: [{k: s[k] for k in ("start", "end", "controller", "lease_pid")} for s in ss]
                        for u, ss in stamps.items()},
        "controller_pids": {str(pid): k for pid, k in pid_of.items()},
    }


# -- C: a controller SIGKILLed mid-sweep ------------------------------------------------------------------------

def power_state(emu: EmulatedJetson) -> str:
    locks = "all locked" if emu.clocks_locked else "none locked" if emu.clocks_unlocked else "partly locked"
    return f"{emu.nvpmodel_mode_name}, jetson_clocks {locks}"


def scenario_sigkill(args, work: Path) -> dict:
    from jbench.farm.coordinator import Coordinator

    n, per, trial_s = args.kill_devices, args.kill_trials_per_device, args.kill_trial_s
    stale, beat = args.stale_after_s, args.heartbeat_s
    coord_proc, address = start_coordinator(work / "coordinator")
    emus = start_devices(n, work / "devices")
    observer = CoordinatorObserver(address)
    try:
        places = add_places(address, n)
        observer.start()
        conf = write_conf(work / "conf", emus, trial_s, "K", device_class=None)
        argv = jbench_argv(conf, [n_gen_values(1, n * per), *POWER, f"farm.coordinator={address}",
                                  f"farm.heartbeat_s={beat:g}", f"farm.stale_after_s={stale:g}", *args.extra])
        original = {unit_name(i): power_state(emu) for i, emu in enumerate(emus)}
        # Own labgrid session names, so the coordinator's state tells the two controllers apart.
        first = Controller(argv, env_for(work / "results", LG_USERNAME="ctl-killed"), work / "controller-killed.log")
        # Kill once every device has finished one trial and is inside its second (mid-sweep, power changed).
        deadline = time.monotonic() + 600
        while not all(len(busy_stamps(emu)) >= 1 for emu in emus):
            if first.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the first sweep ended before the kill:\n{first.tail()}")
            time.sleep(0.1)
        time.sleep(trial_s / 2)
        state_at_kill = {unit_name(i): power_state(emu) for i, emu in enumerate(emus)}
        with Coordinator(address) as c:
            held_at_kill = {p: c.place(p).acquired for p in places}
        os.kill(first.pid, signal.SIGKILL)
        killed_at = time.time()
        first.wait()
        done_before = sum(len(busy_stamps(emu)) for emu in emus)
        # The same sweep again at once: it waits for the places, reaps them once stale, resumes.
        second = Controller(argv, env_for(work / "results", LG_USERNAME="ctl-rerun"), work / "controller-rerun.log")
        second.wait()
        observer.finish()
        stamps = {unit_name(i): busy_stamps(emu) for i, emu in enumerate(emus)}
        final_state = {unit_name(i): power_state(emu) for i, emu in enumerate(emus)}
        runs = trial_runs(work / "results", "adhoc")
        rerun_log = (work / "controller-rerun.log").read_text(errors="replace")
    finally:
        observer.stop.set()
        stop_devices(emus)
        stop_process(coord_proc)
    killed_holder = {p: h for p, h in held_at_kill.items() if h}
    freed_after = {}
    for p in killed_holder:
        hold = next((h for h in observer.holds[p] if h["from"] <= killed_at <= h["to"]), None)
        freed_after[p] = round(hold["to"] - killed_at, 2) if hold else None
    bound = stale + beat + 1.0
    problems = []
    if any(v is None or v > bound for v in freed_after.values()):
        problems.append(f"a place not freed within {bound:g} s: {freed_after}")
    if second.rc != 0:
        problems.append(f"the re-run exited {second.rc}")
    recovered = rerun_log.count("found a state file left by")
    if recovered != len(killed_holder):
        problems.append(f"the next holder recovered the left power state on {recovered} of {len(killed_holder)} devices")
    if final_state != original:
        problems.append(f"power states at the end {final_state} != before {original}")
    killed = [r for r in runs if r.info.status == "KILLED"]
    reasons = sorted({r.data.tags.get("jbench.failure_reason", "") for r in killed})
    if not killed or not all(x.startswith("controller died:") for x in reasons):
        problems.append(f"KILLED runs {len(killed)} with reasons {reasons}")
    finished = Counter(int(r.data.tags["jbench.trial_index"]) for r in runs if r.info.status == "FINISHED")
    if sorted(finished) != list(range(1, n * per + 1)) or set(finished.values()) != {1}:
        problems.append(f"FINISHED trials {dict(finished)}")
    device_trials = sum(len(ss) for ss in stamps.values())
    return {
        "scenario": "sigkill", "devices": n, "trials_per_device": per, "trial_s": trial_s,
        "stale_after_s": stale, "heartbeat_s": beat, "free_bound_s": bound, "command": argv_for_report(argv),
        "power_state_before": original, "power_state_at_kill": state_at_kill, "power_state_after_rerun": final_state,
        "time_to_free_s": freed_after, "time_to_free_max_s": max((v for v in freed_after.values() if v), default=None),
        "next_holder_recovered_left_state_on": recovered,
        "killed_runs": len(killed), "killed_reasons": reasons,
        "finished_trials": sum(finished.values()), "expected_trials": n * per,
        "device_side_trials_before_kill": done_before, "device_side_trials_total": device_trials,
        "rerun_wall_s": round(second.ended - second.started, 1), "problems": problems, "ok": not problems,
    }


# -- main -------------------------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", choices=["all", "utilisation", "shared", "sigkill"], default="all")
    ap.add_argument("--devices", type=int, default=64, help="utilisation: emulated devices (64)")
    ap.add_argument("--trials-per-device", type=int, default=2, help="utilisation: trials per device (2)")
    ap.add_argument("--trial-s", type=float, default=60.0, help="utilisation: each trial's device-side sleep (60 s)")
    ap.add_argument("--power", action="store_true", help="utilisation: trials also set power.mode/jetson_clocks")
    ap.add_argument("--shared-devices", type=int, default=16)
    ap.add_argument("--controllers", type=int, default=3)
    ap.add_argument("--places-per-sweep", type=int, default=8, help="shared: farm.devices of each sweep (8)")
    ap.add_argument("--rounds", type=int, default=3, help="shared: sweeps per controller, one after the other (3)")
    ap.add_argument("--trials-per-sweep", type=int, default=0, help="shared: trials per sweep (2 per place)")
    ap.add_argument("--shared-trial-s", type=float, default=5.0)
    ap.add_argument("--kill-devices", type=int, default=4)
    ap.add_argument("--kill-trials-per-device", type=int, default=3)
    ap.add_argument("--kill-trial-s", type=float, default=4.0)
    ap.add_argument("--stale-after-s", type=float, default=15.0)
    ap.add_argument("--heartbeat-s", type=float, default=2.0)
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides for every sweep")
    ap.add_argument("--out", type=Path, default=OUT_DIR)
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, stores)")
    args = ap.parse_args()
    scenarios = ["utilisation", "shared", "sigkill"] if args.scenario == "all" else [args.scenario]
    fns = {"utilisation": scenario_utilisation, "shared": scenario_shared, "sigkill": scenario_sigkill}
    args.out.mkdir(parents=True, exist_ok=True)
    rc = 0
    for name in scenarios:
        work = Path(tempfile.mkdtemp(prefix=f"farm-scale-{name}-"))
        info = machine()
        t0 = time.time()
        result = fns[name](args, work)
        result.update(machine=info, load_average_at_end=load_average(), bench_wall_s=round(time.time() - t0, 1),
                      date=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
        if args.keep:
            result["work_dir"] = str(work)
        else:
            subprocess.run(["rm", "-rf", str(work)])
        path = args.out / f"{name}.json"
        path.write_text(json.dumps(result, indent=2, default=str) + "\n")
        brief = {k: v for k, v in result.items() if k not in ("per_unit", "machine")}
        print(json.dumps(brief, indent=2, default=str))
        if result.get("ok") is False:
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
