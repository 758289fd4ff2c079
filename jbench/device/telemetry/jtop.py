"""jtop source: the user's own jetson-stats install, read through its service (jbench ships none of its code).

Instantaneous values only: jetson-stats' per-rail `avg` is `(power + old_avg) // 2` at every tick, an exponential
average of weight 0.5, not a mean (jetson-stats 7.2.2 jtop/core/power.py, PowerService.get_status), so `power` is
used and `avg` never. Board input power comes from jbench's one rule (rails.input_power), not from jtop's `tot`.

Beyond tegrastats, each sample records what jtop reports from the service: the fan (`fan_speed_pct`, `fan_rpm`),
the nvpmodel mode (`jtop_nvpmodel`) and jetson_clocks status (`jtop_jetson_clocks`) as jtop sees them, the GPU's
governor and 3D scaling (`gpu_governor`, `gpu_3d_scaling`), GPU and EMC clocks (`gpu_freq_mhz`, `emc_freq_mhz`).
"""

from __future__ import annotations

from typing import Optional

from jbench.core.schema import ProfileConfig
from jbench.device.connection import Connection
from jbench.device.telemetry.rails import power_fields
from jbench.device.telemetry.samplers import StreamSampler

JTOP_READER = r"""
import json, sys, time
try:
    from jtop import jtop
except ImportError as e:
    print("NO_JTOP jetson-stats is not installed for python3 on the device (%s)" % e, flush=True); sys.exit(3)
interval = float(sys.argv[1]) / 1000.0
def num(x):
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) else None
try:
    with jtop(interval=interval) as j:
        while j.ok():
            p = j.power or {}
            rails = {k: num(v.get("power")) for k, v in (p.get("rail") or {}).items()}
            tot = p.get("tot") or {}
            if tot.get("name"):  # jtop moves the input rail (VIN, POM_5V_IN, VDD_IN) out of 'rail' into 'tot'
                rails[tot["name"]] = num(tot.get("power"))
            out = {"rails_mw": rails}
            gpus = getattr(j, "gpu", None) or {}
            if gpus:
                g = list(gpus.values())[0]
                st, fr = g.get("status") or {}, g.get("freq") or {}
                out.update(gpu_load=num(st.get("load")), gpu_cur_khz=num(fr.get("cur")), gpu_governor=fr.get("governor"),
                           gpu_3d_scaling=st.get("3d_scaling"), gpu_railgate=st.get("railgate"))
            emc = (getattr(j, "memory", None) or {}).get("EMC") or {}
            out["emc_cur_khz"] = num(emc.get("cur"))
            temps = getattr(j, "temperature", None)
            if temps is not None:
                out["temps"] = {k: num(v.get("temp")) for k, v in temps.items() if v.get("online")}
            else:  # older clients: the flat stats' 'Temp <name>' entries
                out["temps"] = {k: num(v) for k, v in (j.stats or {}).items() if k.startswith("Temp")}
            if "gpu_load" not in out:
                out["gpu_load"] = num((j.stats or {}).get("GPU"))
            fans = getattr(j, "fan", None) or {}
            for name, f in fans.items():
                speed, rpm = f.get("speed") or [], f.get("rpm") or []
                out.update(fan_speed=num(speed[0]) if speed else None, fan_rpm=num(rpm[0]) if rpm else None)
                break
            nvp = getattr(j, "nvpmodel", None)
            out["nvpmodel"] = str(nvp.name) if nvp is not None else None
            jc = getattr(j, "jetson_clocks", None)
            out["jetson_clocks"] = bool(jc) if jc is not None else None
            print("%.6f %s" % (time.time(), json.dumps(out, default=str)), flush=True)
except Exception as e:
    print("NO_JTOP jtop service not reachable: %s" % str(e).replace("\n", " "), flush=True); sys.exit(3)
"""


def _mhz(khz) -> Optional[float]:
    return khz / 1000.0 if isinstance(khz, (int, float)) else None


class JtopSampler(StreamSampler):
    """jtop's instantaneous rail readings; board and GPU/CPU power by the rules of telemetry/rails.py rather than
    jtop's own total. `rail_profile` (the module profile) may be set after construction; without it the documented
    rules apply."""

    source = "jtop"
    rail_profile: Optional[ProfileConfig] = None

    def __init__(self, conn: Connection, interval_ms: int = 100):
        super().__init__(conn, ["python3", "-c", JTOP_READER, str(int(interval_ms))])

    def _run(self) -> None:
        for t, data in self._device_json("NO_JTOP "):
            temps = [v for v in (data.get("temps") or {}).values() if isinstance(v, (int, float)) and v > -100]
            rails = {k: v / 1000.0 for k, v in (data.get("rails_mw") or {}).items() if isinstance(v, (int, float))}
            power, total = power_fields(rails, self.rail_profile)
            self._note_power(total)
            self.samples.append({
                "t": t, **power,
                "gpu_load_pct": data.get("gpu_load"), "gpu_freq_mhz": _mhz(data.get("gpu_cur_khz")),
                "emc_freq_mhz": _mhz(data.get("emc_cur_khz")), "temp_max_c": max(temps) if temps else None,
                "fan_speed_pct": data.get("fan_speed"), "fan_rpm": data.get("fan_rpm"),
                "gpu_governor": data.get("gpu_governor"), "gpu_3d_scaling": data.get("gpu_3d_scaling"),
                "jtop_nvpmodel": data.get("nvpmodel"), "jtop_jetson_clocks": data.get("jetson_clocks"),
                **{f"rail_{k}_w": v for k, v in rails.items()},
            })
        if not self.samples and not self._stop.is_set():
            self.problem = self.problem or f"jtop produced no samples (last output: {self.last_skipped!r})"
