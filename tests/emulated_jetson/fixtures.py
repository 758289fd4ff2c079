"""Pytest fixtures for emulated Jetson devices (load with `pytest_plugins = ["tests.emulated_jetson.fixtures"]`
in the root conftest, or import the fixture names into a test module).

- `emulated_jetson_factory(module="orin_nano", **options)` -> EmulatedJetson; function scope: every device it
  started is stopped at the end of the test, also when the test fails.
- `emulated_jetson_session_factory`: the same, devices live until the end of the session.
- `orin_nano` (Orin Nano 8GB, JetPack 6.0 / L4T R36.3), `orin_nano_super` (JetPack 6.2.1 / R36.4.4, Super conf),
  `orin_nano_super_r39` (Orin Nano Super, JetPack 7.2.1 / L4T R39.2.1),
  `agx_orin` (AGX Orin 64GB, JetPack 5.1.2 / R35.4.1), `thor` (AGX Thor, JetPack 7.1 / R38.4): one fresh device
  per test (function scope).
Options: reboot_delay_s (3.0), reboot_grace_s (0.5), sudo_password (None), nvpmodel_mode (module default),
clocks_locked (False: nothing locked; True: everything a plain jetson_clocks locks), login_is_root (False),
sudo_timestamp_timeout_s (900), host (next 127.0.0.N), start_timeout_s (15), serial (generated, distinct per unit).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator, List

import pytest

from . import EmulatedJetson

Factory = Callable[..., EmulatedJetson]


def _make_factory(tmp_path_factory: pytest.TempPathFactory, started: List[EmulatedJetson]) -> Factory:
    def make(module: str = "orin_nano", **options: Any) -> EmulatedJetson:
        if (options.get("real_paths") or options.get("jtop")) and os.geteuid() != 0:
            pytest.fail("real_paths/jtop emulated Jetsons need root (a mount namespace with bind mounts over /sys): "
                        "run the tests as root, as CI does (`sudo make test`, or `.ci/run` as root)", pytrace=False)
        base = tmp_path_factory.mktemp(f"emu-{module}", numbered=True)
        emu = EmulatedJetson.start(module, base_dir=base, **options)
        started.append(emu)
        return emu

    return make


def _stop_all(started: List[EmulatedJetson]) -> None:
    errors = []
    for emu in reversed(started):
        try:
            emu.stop()
        except Exception as exc:  # stop the others anyway
            errors.append(f"{emu!r}: {exc}")
    if errors:
        raise RuntimeError("stopping emulated Jetsons failed: " + "; ".join(errors))


@pytest.fixture
def emulated_jetson_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Factory]:
    started: List[EmulatedJetson] = []
    try:
        yield _make_factory(tmp_path_factory, started)
    finally:
        _stop_all(started)


@pytest.fixture(scope="session")
def emulated_jetson_session_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Factory]:
    started: List[EmulatedJetson] = []
    try:
        yield _make_factory(tmp_path_factory, started)
    finally:
        _stop_all(started)


@pytest.fixture
def orin_nano(emulated_jetson_factory: Factory) -> EmulatedJetson:
    return emulated_jetson_factory("orin_nano")


@pytest.fixture
def orin_nano_super(emulated_jetson_factory: Factory) -> EmulatedJetson:
    return emulated_jetson_factory("orin_nano_super")


@pytest.fixture
def orin_nano_super_r39(emulated_jetson_factory: Factory) -> EmulatedJetson:
    return emulated_jetson_factory("orin_nano_super_r39")


@pytest.fixture
def agx_orin(emulated_jetson_factory: Factory) -> EmulatedJetson:
    return emulated_jetson_factory("agx_orin")


@pytest.fixture
def thor(emulated_jetson_factory: Factory) -> EmulatedJetson:
    return emulated_jetson_factory("thor")
