"""`jbench doctor local` checks what the embedded default needs (issue 24, item 22): the llama.cpp build, the bundled
model's whole quant ladder and the CPU governor, through the real CLI on the real cache, on an empty one and on one
with a ladder file gone. And the package builds without a setuptools warning about its metadata (the license
fields), checked by a real build whose capture is shown to catch such a warning."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from jbench.device.doctor import governor_check

from .conftest import REPO, jbench_cli

GOVERNORS = sorted(Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cpufreq/scaling_governor"))


def _doctor(env: dict) -> tuple[int, dict[str, tuple[str, str, str]]]:
    """Exit code and {item: (status, detail, fix)} of `jbench doctor local`, at a width where no cell wraps."""
    res = jbench_cli(["doctor", "local"], env_extra={"COLUMNS": "400", **env})
    assert "Traceback" not in res.stdout + res.stderr, res.stdout + res.stderr
    rows = {}
    for line in res.stdout.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) == 4 and cells[0] != "item":
            rows[cells[0]] = tuple(cells[1:])
    return res.returncode, rows


def _ladder() -> list[str]:
    model = yaml.safe_load((REPO / "conf" / "model" / "gemma3_270m.yaml").read_text())
    return list(dict.fromkeys([model["quant"], model["source_quant"], *model["ladder"]]))


def _expected_governor() -> str:
    """What this machine's sysfs says: the status the doctor must give."""
    found = {p.read_text().strip() for p in GOVERNORS}
    return "info" if not found else ("pass" if found == {"performance"} else "warn")


@pytest.mark.e2e
def test_doctor_local_on_a_machine_that_ran_setup(llama_build, bundled_model):
    code, rows = _doctor({})
    status, detail, _ = rows["llama.cpp build"]
    assert status == "pass" and llama_build["bin_dir"] in detail and llama_build["build_commit"] in detail
    status, detail, _ = rows["model quant ladder"]
    assert status == "pass" and detail == f"gemma3_270m: {', '.join(_ladder())}"
    assert rows["CPU governor"][0] == _expected_governor()
    assert code == (1 if any(s == "fail" for s, _, _ in rows.values()) else 0)


@pytest.mark.e2e
def test_doctor_local_before_setup_names_it(tmp_path):
    code, rows = _doctor({"JBENCH_CACHE_DIR": str(tmp_path / "cache")})
    assert code == 1
    assert rows["llama.cpp build"][0] == "fail" and "run `jbench setup`" in rows["llama.cpp build"][2]
    status, detail, fix = rows["model quant ladder"]
    assert (status, fix) == ("fail", "run `jbench setup`")
    assert detail == f"gemma3_270m: {', '.join(_ladder())} missing"
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.json")), "doctor wrote a cache"


@pytest.mark.e2e
def test_doctor_local_names_a_ladder_file_that_is_gone(tmp_path, llama_build, bundled_model):
    """The real build and model files, with a manifest whose F16 entry points at a file that is not there."""
    from jbench.models.store import manifest_path

    cache = tmp_path / "cache"
    (cache / "llama.cpp").mkdir(parents=True)
    shutil.copy(Path(llama_build["bin_dir"]).parents[1] / "active.json", cache / "llama.cpp" / "active.json")
    manifest = json.loads(manifest_path("gemma3_270m").read_text())
    manifest["files"]["F16"]["path"] = str(tmp_path / "gone" / "F16.gguf")
    (cache / "models" / "gemma3_270m").mkdir(parents=True)
    (cache / "models" / "gemma3_270m" / "manifest.json").write_text(json.dumps(manifest))
    code, rows = _doctor({"JBENCH_CACHE_DIR": str(cache)})
    assert code == 1
    assert rows["llama.cpp build"][0] == "pass"
    installed = [q for q in _ladder() if q != "F16"]
    assert rows["model quant ladder"] == ("fail", f"gemma3_270m: F16 missing ({', '.join(installed)} installed)",
                                          "run `jbench setup`")


def test_governor_check_reads_sysfs_lines():
    # One line per CPU, as `cat /sys/devices/system/cpu/cpu*/cpufreq/scaling_governor` prints them.
    assert governor_check("performance\nperformance\n").status == "pass"
    ramping = governor_check("schedutil\nschedutil\nperformance\n")
    assert ramping.status == "warn" and ramping.detail.startswith("schedutil on 2 CPU(s), performance on 1 CPU(s)")
    assert "cpupower frequency-set -g performance" in ramping.fix
    assert governor_check("").status == "info"


def _build_wheel(project: Path, out: Path) -> str:
    """A real `pip wheel` of `project` with this environment's setuptools (the version constraints.txt pins, which
    `make install`'s isolated build also gets), verbose: every warning the build backend prints."""
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v",
                          "--disable-pip-version-check", "-w", str(out), str(project)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout + res.stderr


def _python_warnings(output: str) -> list[str]:
    return [line for line in output.splitlines() if re.search(r"\w+Warning\b", line)]


@pytest.mark.slow
def test_the_package_builds_without_a_metadata_warning(tmp_path):
    # The capture catches a deprecated license field: the table form with a License classifier warns.
    old = tmp_path / "old"
    (old / "oldpkg").mkdir(parents=True)
    (old / "oldpkg" / "__init__.py").write_text("")
    (old / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "oldpkg"\nversion = "0"\nlicense = {text = "Apache-2.0"}\n'
        'classifiers = ["License :: OSI Approved :: Apache Software License"]\n')
    caught = _python_warnings(_build_wheel(old, tmp_path / "old-wheel"))
    assert any("License classifiers are deprecated" in line for line in caught), caught
    assert any("project.license` as a TOML table is deprecated" in line for line in caught), caught

    output = _build_wheel(REPO, tmp_path / "wheel")
    assert _python_warnings(output) == [], "\n".join(_python_warnings(output))
    wheel = next((tmp_path / "wheel").glob("jbench-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        meta = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in zf.namelist())
    assert "License-Expression: Apache-2.0" in meta.splitlines() and "License-File: LICENSE" in meta.splitlines()


@pytest.mark.e2e
def test_doctor_local_in_an_80_column_terminal(tmp_path):
    """In tmux at 80 columns the audit's table fits: every line ends on its border, none wraps."""
    from .test_roofline_cli import in_tmux

    screen = in_tmux(["doctor", "local"])
    table = [line for line in screen if line[:1] in "┏┃┡│└"]
    assert any("llama.cpp build" in line for line in table) and any("CPU governor" in line for line in table)
    assert all(len(line) <= 80 and line[-1] in "┓┃┩│┘" for line in table), "\n".join(screen)
    assert [line for line in screen if line.strip() and line not in table] == ["doctor: local"], "\n".join(screen)
