"""Parser for `tegrastats` output lines, across Jetson modules and JetPack/L4T releases.

One line of tegrastats output becomes one `TegrastatsSample`. The format drifted a lot between
L4T 24 (TX1, 2016) and JetPack 7.2 (R39.2, Orin/Thor); the corpus in `tests/data/jetson-formats/`
holds real lines of every variant handled here. The parser is token driven and order agnostic
(SWAP after CPU, rails before or after temperatures), splits on any run of whitespace, and never
fails on something it does not understand: such tokens land in `TegrastatsSample.unknown`.

Conventions:
- Names (temperatures, rails, engines) are kept exactly as tegrastats prints them: `CPU` on JP5 Orin,
  `cpu` on JP6 (the case changed between releases; a caller comparing releases maps them).
- A `-256C` temperature is an offline sensor: its name is kept and its value is None.
- `NC 0mW/0mW` rails are unconnected INA3221 channels (AGX Orin JP5): they are left out of `rails` and
  only counted in `nc_rails`.
- JP4-and-older rails print bare numbers (`VDD_IN 2532/2698`): the unit is mW, the same as the
  later explicit `2532mW/2698mW`.
- Timestamps are the device's local time as printed (`MM-DD-YYYY HH:MM:SS`), returned naive.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, BinaryIO, Iterable, Iterator, Sequence

from jbench.core.schema import ProfileConfig
from jbench.device.telemetry.rails import INPUT_RAILS, SUMMED_RAIL_SETS, InputPower, input_power

__all__ = [
    "CpuCore",
    "Engine",
    "Iram",
    "Rail",
    "TegrastatsSample",
    "INPUT_RAILS",
    "SUMMED_RAIL_SETS",
    "parse_line",
    "parse_stream",
    "input_power_of",
    "total_input_power_mw",
    "sample_to_dict",
]


@dataclass(frozen=True)
class CpuCore:
    index: int
    load_pct: float | None  # None when the core is off (or the load was not printed)
    freq_mhz: float | None  # None when off or not printed
    online: bool


@dataclass(frozen=True)
class Engine:
    """A hardware engine token such as `APE 174`, `NVENC off`, `VIC 36%@115`, `NVENC0_FREQ @1556`."""

    load_pct: float | None
    freq_mhz: float | None
    online: bool
    raw: str  # the value exactly as printed (e.g. "off", "36%@115", "@1556", "fg 0% bg 1%")


@dataclass(frozen=True)
class Rail:
    current_mw: float
    average_mw: float
    max_mw: float | None = None  # JP7.2 (R39.2) prints a running max as a third value


@dataclass(frozen=True)
class Iram:
    used_kb: int
    total_kb: int
    lfb_kb: int | None


@dataclass
class TegrastatsSample:
    ram_used_mb: int
    ram_total_mb: int
    timestamp: datetime | None = None
    lfb: str | None = None  # largest free block, as printed: "3x4MB", "1x512kB"
    swap_used_mb: int | None = None
    swap_total_mb: int | None = None
    swap_cached_mb: int | None = None
    iram: Iram | None = None
    cpus: list[CpuCore] = field(default_factory=list)
    emc_load_pct: float | None = None
    emc_freq_mhz: float | None = None
    gpu_load_pct: float | None = None  # GR3D / GR3D_FREQ load; None on Thor (no %) or when absent
    gpu_freqs_mhz: list[float] = field(default_factory=list)  # one entry per GPC (GR3D2_FREQ appended)
    gpu2_load_pct: float | None = None  # JP5.0 AGX Orin's GR3D2_FREQ (second GPC) load
    engines: dict[str, Engine] = field(default_factory=dict)
    temps_c: dict[str, float | None] = field(default_factory=dict)  # None = offline sensor (-256C)
    temps_max_c: dict[str, float | None] = field(default_factory=dict)  # JP7.2 `cur/max` form only
    rails: dict[str, Rail] = field(default_factory=dict)
    nc_rails: int = 0  # count of `NC` placeholder channels skipped
    unknown: list[str] = field(default_factory=list)


# --- token patterns -------------------------------------------------------------------------

_DATE = re.compile(r"^\d{2}-\d{2}-\d{4}$")
_TIME = re.compile(r"^\d{2}:\d{2}:\d{2}$")
_USED_TOTAL_MB = re.compile(r"^(\d+)/(\d+)MB$")
_LFB_OPEN = "(lfb"
_LFB_VALUE = re.compile(r"^(\d+x\d+(?:[kKMG]B))\)$")
_CACHED_VALUE = re.compile(r"^(\d+)MB\)$")
_IRAM = re.compile(r"^(\d+)/(\d+)kB(?:\(lfb)?$")
_IRAM_LFB = re.compile(r"^(\d+)kB\)$")
_NUM = r"\d+(?:\.\d+)?"
_LOAD_FREQ = re.compile(rf"^(?:({_NUM})%)?(?:@({_NUM}|\[[\d,]*\]))?$")
_OLD_CPU = re.compile(r"^\[([^\]]*)\]@(\d+)$")  # L4T <= 28.1: cpu [a%,b%,off]@MHz
_NEW_CPU = re.compile(r"^\[([^\]]*)\]$")
_CORE = re.compile(rf"^({_NUM})%(?:@({_NUM}))?$")
_TEMP = re.compile(rf"^([A-Za-z][\w.-]*?)@(-?{_NUM})C(?:/(-?{_NUM})C)?$")
_RAIL_VALUE = re.compile(rf"^({_NUM})(?:mW)?/({_NUM})(?:mW)?(?:/({_NUM})(?:mW)?)?$")
_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")
_ENGINE_VALUE = re.compile(rf"^(?:off|{_NUM}|{_NUM}%|{_NUM}%@{_NUM}|@{_NUM})$")
_PCT = re.compile(rf"^({_NUM})%$")

_OFFLINE_TEMP = -256.0  # jtop's TEMPERATURE_OFFLINE; tegrastats prints -256C for a sensor that is off


def _f(text: str | None) -> float | None:
    return float(text) if text is not None else None


def _parse_timestamp(date: str, time: str) -> datetime | None:
    try:
        return datetime.strptime(f"{date} {time}", "%m-%d-%Y %H:%M:%S")
    except ValueError:
        return None


def _parse_cpus(value: str) -> list[CpuCore] | None:
    old = _OLD_CPU.match(value)
    shared_freq: float | None = None
    if old:
        body, shared_freq = old.group(1), float(old.group(2))
    else:
        new = _NEW_CPU.match(value)
        if not new:
            return None
        body = new.group(1)
    cores: list[CpuCore] = []
    for index, entry in enumerate(e for e in body.split(",") if e != ""):
        if entry == "off":
            cores.append(CpuCore(index, None, None, False))
            continue
        m = _CORE.match(entry)
        if not m:
            return None
        freq = _f(m.group(2)) if m.group(2) is not None else shared_freq
        cores.append(CpuCore(index, float(m.group(1)), freq, True))
    return cores


def _parse_load_freq(value: str) -> tuple[float | None, list[float]] | None:
    """`12%`, `12%@1300`, `12%@[1300,1300]`, `@[0,0,0]` -> (load, [freqs])."""
    m = _LOAD_FREQ.match(value)
    if not m or (m.group(1) is None and m.group(2) is None):
        return None
    load = _f(m.group(1))
    freq_text = m.group(2)
    if freq_text is None:
        return load, []
    if freq_text.startswith("["):
        return load, [float(x) for x in freq_text[1:-1].split(",") if x != ""]
    return load, [float(freq_text)]


def _parse_engine(value: str) -> Engine:
    if value == "off":
        return Engine(None, None, False, value)
    if _PCT.match(value):
        return Engine(float(value[:-1]), None, True, value)
    parsed = _parse_load_freq(value)
    if parsed is not None and (parsed[0] is not None or parsed[1]):
        load, freqs = parsed
        return Engine(load, freqs[0] if freqs else None, True, value)
    return Engine(None, float(value), True, value)  # bare number = clock in MHz (`APE 174`)


def parse_line(line: str) -> TegrastatsSample | None:
    """Parse one tegrastats output line; None when the line is not tegrastats output.

    A line is tegrastats output when, after the optional leading `MM-DD-YYYY HH:MM:SS`, it starts with
    `RAM used/totalMB` -- true of every release from L4T 24 to R39. Anything else (a `date` header,
    a blank line, a wrapped continuation) returns None.
    """
    tokens = line.split()
    i = 0
    timestamp = None
    if len(tokens) >= 2 and _DATE.match(tokens[0]) and _TIME.match(tokens[1]):
        timestamp = _parse_timestamp(tokens[0], tokens[1])
        i = 2
    if len(tokens) < i + 2 or tokens[i] != "RAM":
        return None
    ram = _USED_TOTAL_MB.match(tokens[i + 1])
    if not ram:
        return None
    sample = TegrastatsSample(ram_used_mb=int(ram.group(1)), ram_total_mb=int(ram.group(2)), timestamp=timestamp)
    i += 2
    n = len(tokens)

    def at(k: int) -> str:
        """Token k places after the cursor, "" past the end."""
        return tokens[i + k] if i + k < n else ""

    while i < n:
        tok = tokens[i]
        after = tokens[i + 1] if i + 1 < n else None

        if tok == _LFB_OPEN and (m := _LFB_VALUE.match(after or "")):
            sample.lfb = m.group(1)
            i += 2
            continue

        if tok == "SWAP" and (m := _USED_TOTAL_MB.match(after or "")):
            sample.swap_used_mb, sample.swap_total_mb = int(m.group(1)), int(m.group(2))
            i += 2
            if at(0) == "(cached" and (c := _CACHED_VALUE.match(at(1))):
                sample.swap_cached_mb = int(c.group(1))
                i += 2
            continue

        if tok == "IRAM" and (m := _IRAM.match(after or "")):
            i += 2
            # `0/252kB(lfb 252kB)` (the real form) or `0/252kB (lfb 252kB)`
            if not m.group(0).endswith("(lfb") and at(0) == "(lfb":
                i += 1
            lfb = _IRAM_LFB.match(at(0))
            if lfb:
                i += 1
            sample.iram = Iram(int(m.group(1)), int(m.group(2)), int(lfb.group(1)) if lfb else None)
            continue

        if tok in ("CPU", "cpu") and after is not None and after.startswith("["):
            cores = _parse_cpus(after)
            if cores is not None:
                sample.cpus = cores
                i += 2
                continue

        if tok in ("EMC", "EMC_FREQ") and after is not None:
            parsed = _parse_load_freq(after)
            if parsed is not None and len(parsed[1]) <= 1:
                sample.emc_load_pct = parsed[0]
                sample.emc_freq_mhz = parsed[1][0] if parsed[1] else None
                i += 2
                continue

        if tok in ("GR3D", "GR3D_FREQ", "GR3D2_FREQ") and after is not None:
            parsed = _parse_load_freq(after)
            if parsed is not None:
                if tok == "GR3D2_FREQ":
                    sample.gpu2_load_pct = parsed[0]
                else:
                    sample.gpu_load_pct = parsed[0]
                sample.gpu_freqs_mhz.extend(parsed[1])
                i += 2
                continue

        if tok == "MTS" and at(1) == "fg" and at(3) == "bg":
            fg, bg = _PCT.match(at(2)), _PCT.match(at(4))
            if fg and bg:
                raw = " ".join(tokens[i + 1:i + 5])
                sample.engines["MTS_FG"] = Engine(float(fg.group(1)), None, True, raw)
                sample.engines["MTS_BG"] = Engine(float(bg.group(1)), None, True, raw)
                i += 5
                continue

        if tok == "EDP" and at(1) == "limit" and re.match(rf"^{_NUM}$", at(2)):
            # L4T 24: CPU frequency cap (MHz) set by the electrical design point limiter
            sample.engines["EDP_LIMIT"] = Engine(None, float(at(2)), True, at(2))
            i += 3
            continue

        temp = _TEMP.match(tok)
        if temp:
            name, cur, mx = temp.group(1), float(temp.group(2)), _f(temp.group(3))
            sample.temps_c[name] = None if cur == _OFFLINE_TEMP else cur
            if mx is not None:
                sample.temps_max_c[name] = None if mx == _OFFLINE_TEMP else mx
            i += 1
            continue

        if _NAME.match(tok) and after is not None:
            rail = _RAIL_VALUE.match(after)
            if rail:
                if tok == "NC":
                    sample.nc_rails += 1
                else:
                    sample.rails[tok] = Rail(float(rail.group(1)), float(rail.group(2)), _f(rail.group(3)))
                i += 2
                continue
            if _ENGINE_VALUE.match(after):
                sample.engines[tok] = _parse_engine(after)
                i += 2
                continue

        sample.unknown.append(tok)
        i += 1

    return sample


def parse_stream(lines: Iterable[str]) -> tuple[list[TegrastatsSample], int]:
    """Parse many lines; returns (samples, number of non-empty lines that were not tegrastats output)."""
    samples: list[TegrastatsSample] = []
    skipped = 0
    for line in lines:
        if not line.strip():
            continue
        sample = parse_line(line)
        if sample is None:
            skipped += 1
        else:
            samples.append(sample)
    return samples, skipped


@dataclass
class LogRead:
    """A tegrastats log file read back: its samples, the lines that were not tegrastats output (undecodable bytes
    included), and why reading stopped early (a gzip file cut short), if it did."""

    samples: list[TegrastatsSample]
    skipped: int
    cut_short: str = ""


def read_log(stream: BinaryIO) -> LogRead:
    """Parse a tegrastats log given as bytes: gzip-compressed (logrotate's default, found by its magic bytes, not its
    name) or plain. A line that is not UTF-8 counts as unparseable, like any other line that is not tegrastats
    output; a compressed file that ends mid-stream keeps the lines before the cut."""
    import gzip
    import zlib

    head = stream.peek(2)[:2] if hasattr(stream, "peek") else b""
    raw: Any = gzip.GzipFile(fileobj=stream) if head == b"\x1f\x8b" else stream
    undecodable = 0
    cut_short = ""

    def lines() -> Iterator[str]:
        nonlocal undecodable, cut_short
        try:
            for data in raw:
                try:
                    yield data.decode("utf-8")
                except UnicodeDecodeError:
                    undecodable += 1
        except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
            cut_short = f"the gzip data ends early or is damaged ({exc}); the lines before it were read"

    samples, skipped = parse_stream(lines())
    return LogRead(samples, skipped + undecodable, cut_short)


# --- board power ----------------------------------------------------------------------------
# The rules live in jbench/device/telemetry/rails.py (shared with the sysfs and jtop samplers).


def total_input_power_mw(sample: TegrastatsSample, rails_spec: Sequence[str] | None = None) -> float | None:
    """Board-level input power (mW, current value) of one sample, or None when it cannot be known.

    `rails_spec` (a device profile's rail names) sums those rails, every one of which must be printed;
    an empty spec gives None. Without it, the documented rule of `rails.input_power`: the input rail
    (`VDD_IN`, `POM_5V_IN`, `VIN`) alone, else the module's summed rails (AGX Xavier, AGX Orin, Thor
    without `VIN`), else None (no rails: non-root TX2 on JP4.6, L4T 24/28 TX1; an unknown rail set).
    """
    return input_power_of(sample, rails_spec).value


def input_power_of(sample: TegrastatsSample, rails_spec: Sequence[str] | None = None) -> InputPower:
    """`rails.input_power` over one sample's current rail values (mW); see `total_input_power_mw`."""
    if rails_spec is not None and not rails_spec:
        return InputPower(None, [], "profile")
    current = {name: rail.current_mw for name, rail in sample.rails.items()}
    return input_power(current, ProfileConfig(power_rails=list(rails_spec)) if rails_spec else None)


# --- flat output ----------------------------------------------------------------------------

def sample_to_dict(sample: TegrastatsSample, rails_spec: Sequence[str] | None = None) -> dict[str, Any]:
    """One flat dict per sample, for JSON lines or CSV.

    Fixed keys are always present (None when not printed); per-core, per-GPC, per-engine,
    per-sensor and per-rail keys exist only for what the line printed. Names keep tegrastats' case.
    """
    out: dict[str, Any] = {
        "timestamp": sample.timestamp.isoformat() if sample.timestamp else None,
        "ram_used_mb": sample.ram_used_mb,
        "ram_total_mb": sample.ram_total_mb,
        "lfb": sample.lfb,
        "swap_used_mb": sample.swap_used_mb,
        "swap_total_mb": sample.swap_total_mb,
        "swap_cached_mb": sample.swap_cached_mb,
        "iram_used_kb": sample.iram.used_kb if sample.iram else None,
        "iram_total_kb": sample.iram.total_kb if sample.iram else None,
        "iram_lfb_kb": sample.iram.lfb_kb if sample.iram else None,
        "cpu_count": len(sample.cpus),
        "cpu_online_count": sum(1 for c in sample.cpus if c.online),
        "emc_load_pct": sample.emc_load_pct,
        "emc_freq_mhz": sample.emc_freq_mhz,
        "gpu_load_pct": sample.gpu_load_pct,
        "gpu_freq_mhz": sample.gpu_freqs_mhz[0] if sample.gpu_freqs_mhz else None,
        "gpu2_load_pct": sample.gpu2_load_pct,
    }
    for core in sample.cpus:
        out[f"cpu{core.index}_online"] = core.online
        out[f"cpu{core.index}_load_pct"] = core.load_pct
        out[f"cpu{core.index}_freq_mhz"] = core.freq_mhz
    for k, freq in enumerate(sample.gpu_freqs_mhz):
        out[f"gpu_gpc{k}_freq_mhz"] = freq
    for name, eng in sample.engines.items():
        out[f"engine_{name}_online"] = eng.online
        out[f"engine_{name}_load_pct"] = eng.load_pct
        out[f"engine_{name}_freq_mhz"] = eng.freq_mhz
    for name, temp in sample.temps_c.items():
        out[f"temp_{name}_c"] = temp
    for name, temp in sample.temps_max_c.items():
        out[f"temp_{name}_max_c"] = temp
    for name, rail in sample.rails.items():
        out[f"rail_{name}_mw"] = rail.current_mw
        out[f"rail_{name}_avg_mw"] = rail.average_mw
        if rail.max_mw is not None:
            out[f"rail_{name}_max_mw"] = rail.max_mw
    total = input_power_of(sample, rails_spec)
    out["total_power_mw"] = total.value
    out["total_power_rule"] = total.label
    out["unknown"] = " ".join(sample.unknown) if sample.unknown else None
    return out
