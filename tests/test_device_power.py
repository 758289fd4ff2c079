"""Power state you can trust, against the faithful emulated Jetson over real sshd, on an Orin Nano Super (L4T R39)
and an AGX Orin (JetPack 5): every lock part verified, unlock across modes, reboot consent, declined reboots leave
nothing pending, a recorded original is never replaced, power_modes from the device's own conf."""

from __future__ import annotations

import logging

import pytest

from jbench.device.connect import connect
from jbench.device.power import PowerStateError, PowerStrategy

from .test_ssh_devices import device_cfg

# module -> (default mode, a mode reachable from it, a second mode, a mode that needs a reboot from the default)
MODULES = {
    # R39 Orin Nano Super: 15W / 25W / MAXN_SUPER switch live (its conf has no 7W mode).
    "orin_nano_super_r39": ("25W", "MAXN_SUPER", "15W", None),
    # JetPack 5 AGX Orin: from MODE_30W every switch reboots; MAXN <-> MODE_50W is live.
    "agx_orin": ("MODE_30W", "MAXN", "MODE_50W", "MODE_15W"),
    # R36 Orin Nano Super: 7W changes the online cores (reboot).
    "orin_nano_super": ("25W", "MAXN_SUPER", "15W", "7W"),
}
REBOOTING = ["agx_orin", "orin_nano_super"]


def _emu(factory, module):
    return factory(module, reboot_delay_s=0.5, reboot_grace_s=0.2)


@pytest.mark.ssh
@pytest.mark.parametrize("module", ["orin_nano_super_r39", "agx_orin"])
def test_clocks_on_then_off_across_modes_leaves_nothing_locked(emulated_jetson_factory, module):
    default, first, second, _ = MODULES[module]
    emu = _emu(emulated_jetson_factory, module)
    cfg = device_cfg(emu)
    with connect(cfg) as conn:
        power = PowerStrategy(conn, cfg)
        original = power.save_original()
        assert original.mode == default and original.locks.none
        power.apply(first, True, allow_reboot=True, reboot_timeout_s=60)
        st = emu.clock_state()
        assert st["mode_name"] == first and st["all_locked"], st
        assert power.last.clocks_locked and power.last.locks.railgate_disabled is True
        # A mode change alone keeps EMC pinned, cpuidle off and railgating off on a real Jetson ...
        changes = power.apply(second, False, allow_reboot=True, reboot_timeout_s=60)
        # ... so the trial asking for clocks off must find every part released, read on the device itself.
        st = emu.clock_state()
        assert st["mode_name"] == second, st
        assert not st["emc_locked"] and not st["cpuidle_disabled"] and st["railgate_enabled"], st
        assert st["none_locked"], st
        assert power.last.locks.none and changes[-1].endswith("-> off"), changes
        assert power.restore(allow_reboot=True, reboot_timeout_s=60) is True
        st = emu.clock_state()
        assert st["mode_name"] == default and st["none_locked"], st


@pytest.mark.ssh
@pytest.mark.parametrize("stop", [KeyboardInterrupt, PowerStateError])
def test_a_save_stopped_before_its_state_file_is_written_leaves_no_clocks_store(orin_nano_super_r39, stop):
    """Ctrl-C (or a failed write) between `jetson_clocks --store` and the state file that names the store: nothing
    would restore from that store or remove it (a CI run found one left), so the save removes it itself."""
    from pathlib import Path

    emu = orin_nano_super_r39
    cfg = device_cfg(emu)
    cache = Path(emu.home) / ".cache" / "jbench"
    with connect(cfg) as conn:
        power = PowerStrategy(conn, cfg)

        def stopped(state):
            assert Path(conn.expand_path(state["clocks_store"])).exists()  # stored, not yet recorded
            raise stop("stopped here")

        power._write_state_file = stopped
        with pytest.raises(stop):
            power.save_original()
        assert not list(cache.glob("jetson_clocks-*")) and not list(cache.glob("power-state-*.json"))
        # The next save stores and records afresh.
        PowerStrategy(conn, cfg).save_original()
        assert len(list(cache.glob("jetson_clocks-*.store"))) == 1 and len(list(cache.glob("power-state-*.json"))) == 1


@pytest.mark.ssh
def test_verify_fails_naming_the_part_that_is_still_locked(orin_nano_super_r39):
    emu = orin_nano_super_r39
    cfg = device_cfg(emu)
    with connect(cfg) as conn:
        power = PowerStrategy(conn, cfg)
        power.save_original()
        power.apply("MAXN_SUPER", True)
        # Someone re-applies the mode by hand: CPU/GPU caps rewritten, EMC/cpuidle/railgating still locked.
        assert conn.run(["nvpmodel", "-m", "1"], sudo=True, stdin="NO\n").ok
        with pytest.raises(PowerStateError, match=r"jetson_clocks requested off but .*emc is locked"):
            power.verify("25W", False)
        with pytest.raises(PowerStateError, match=r"jetson_clocks requested on but .*cpu is not locked.*gpu is not locked"):
            power.verify("25W", True)
        assert power.restore() is True
        assert emu.clock_state()["none_locked"]


@pytest.mark.ssh
def test_a_device_locked_before_jbench_came_cannot_be_half_unlocked(emulated_jetson_factory):
    emu = emulated_jetson_factory("orin_nano_super_r39", clocks_locked=True, reboot_delay_s=0.5, reboot_grace_s=0.2)
    cfg = device_cfg(emu)
    with connect(cfg) as conn:
        power = PowerStrategy(conn, cfg)
        assert power.save_original().clocks_locked
        with pytest.raises(PowerStateError, match="locked by jetson_clocks before jbench started.*power.allow_reboot=true"):
            power.apply(None, False)
        # With consent a reboot releases every part; the mode is the one the device ran in.
        power.apply(None, False, allow_reboot=True, reboot_timeout_s=60)
        assert emu.clock_state()["none_locked"] and power.rebooted
        # Restored to what it was: locked.
        assert power.restore(allow_reboot=True, reboot_timeout_s=60) is True
        st = emu.clock_state()
        assert st["all_locked"] and st["mode_name"] == "25W", st


@pytest.mark.ssh
@pytest.mark.parametrize("module", REBOOTING)
def test_declined_reboot_leaves_no_pending_mode(emulated_jetson_factory, module):
    default, _, _, reboot_mode = MODULES[module]
    emu = _emu(emulated_jetson_factory, module)
    cfg = device_cfg(emu)
    with connect(cfg) as conn:
        power = PowerStrategy(conn, cfg)
        with pytest.raises(PowerStateError, match="needs a reboot .* power.allow_reboot=true") as err:
            power.apply(reboot_mode, None)
        assert "WARNING" not in str(err.value)
        st = emu.clock_state()
        assert st["mode_name"] == default and st["pending_mode"] is None, st
        # The next reboot, by anyone, brings the device up in the mode it ran in.
        boots = emu.boot_count
        emu.reboot(wait=True, timeout=30)
        assert emu.boot_count == boots + 1 and emu.clock_state()["mode_name"] == default


@pytest.mark.ssh
@pytest.mark.parametrize("module", REBOOTING)
def test_restore_never_reboots_without_consent_and_says_how_to_finish(emulated_jetson_factory, module, caplog):
    default, _, _, reboot_mode = MODULES[module]
    emu = _emu(emulated_jetson_factory, module)
    cfg = device_cfg(emu)
    with connect(cfg) as conn:
        power = PowerStrategy(conn, cfg)
        power.save_original()
        power.apply(reboot_mode, None, allow_reboot=True, reboot_timeout_s=60)
        boots = emu.boot_count
        with caplog.at_level(logging.ERROR, logger="jbench.power"):
            assert power.restore(allow_reboot=False) is False
        assert emu.boot_count == boots and emu.clock_state()["mode_name"] == reboot_mode
        assert emu.clock_state()["pending_mode"] is None  # the declined question left nothing pending
        assert "jbench devices restore emu --allow-reboot" in caplog.text
        assert f"sudo nvpmodel -m {emu.mode_id(default)}" in caplog.text
        assert power._read_state_file() is not None  # kept for later
        assert power.restore(allow_reboot=True, reboot_timeout_s=60) is True
        assert emu.clock_state()["mode_name"] == default and power._read_state_file() is None


@pytest.mark.ssh
@pytest.mark.parametrize("module", REBOOTING)
def test_a_recorded_original_is_never_replaced_by_the_modified_state(emulated_jetson_factory, module):
    # A controller saved the default mode, rebooted into another and died (SIGKILL): the next one must not save
    # the modified mode as "original".
    default, _, _, reboot_mode = MODULES[module]
    emu = _emu(emulated_jetson_factory, module)
    cfg = device_cfg(emu)
    with connect(cfg) as conn:
        dead = PowerStrategy(conn, cfg, sweep_id="dead")
        dead.save_original()
        dead.apply(reboot_mode, True, allow_reboot=True, reboot_timeout_s=60)
    with connect(cfg) as conn:
        nxt = PowerStrategy(conn, cfg, sweep_id="next")
        assert nxt.recover_leftover(allow_reboot=False) is False  # needs a reboot: no consent in this sweep
        original = nxt.save_original()
        assert original.mode == default and original.locks.none
        state = nxt._read_state_file()
        assert state["original"]["mode"] == default and state["owner"]["sweep_id"] == "next"
        assert nxt.restore(allow_reboot=True, reboot_timeout_s=60) is True
        st = emu.clock_state()
        assert st["mode_name"] == default and st["none_locked"], st


@pytest.mark.ssh
def test_fan_is_restored(orin_nano_super_r39):
    emu = orin_nano_super_r39
    cfg = device_cfg(emu)
    with connect(cfg) as conn:
        power = PowerStrategy(conn, cfg)
        before = power.save_original()
        assert power.apply(None, True, fan="max")[-1] == "fan -> max"
        assert power.last.fan_pwm == 255
        assert power.restore() is True
        assert power.current().fan_pwm != 255 and emu.clock_state()["nvfancontrol_active"]
        assert before.fan_pwm != 255
