"""`jbench bisect` on a remote device: an emulated Jetson (a real OpenSSH sshd on loopback, fake L4T tools) that runs
this machine's real llama-bench builds (the cached build and the SIMD-less `nosimd_build`) over SSH, under a power
state the bisection applies and restores; a --builds directory without llama-bench on the device refused; and a
commit built ON the device (git archive -> SFTP -> CMake there) on a tiny real CMake project, reused next time."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from jbench.bisect import BisectError, build_commit_on_device
from jbench.device.connect import connect
from tests.conftest import jbench_cli
from tests.test_bisect import CONFIG, _ladder, _runs
from tests.test_ssh_devices import device_cfg, write_conf


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def _commit(repo: Path, message: str) -> str:
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", message)
    return _git(repo, "rev-parse", "HEAD")


@pytest.mark.ssh
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(2400)  # the SIMD-less build, when this test is the first to need it
def test_remote_bisect_finds_the_first_slow_build_under_a_restored_power_state(
        orin_nano_super_r39, tmp_path, llama_build, nosimd_build, bundled_model):
    emu = orin_nano_super_r39
    conf = write_conf(tmp_path, emu)
    dirs = _ladder(tmp_path, llama_build["bin_dir"], nosimd_build, ["fast", "fast", "slow", "slow"])
    before = emu.clock_state()
    assert before["mode_name"] == "25W" and before["none_locked"], before
    results = tmp_path / "results"
    proc = jbench_cli(["bisect", "--config-dir", str(conf), "--results-dir", str(results), "--builds", *dirs,
                       "device=emu", *CONFIG, "power.mode=MAXN_SUPER", "power.jetson_clocks=true",
                       "--repetitions", "4", "--max-repetitions", "6"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"FIRST BAD: build 2: {dirs[2]}" in proc.stdout
    runs = _runs(results)
    parent = [r for r in runs if r.data.tags.get("jbench.kind") == "bisect"]
    assert len(parent) == 1 and parent[0].info.status == "FINISHED"
    tags = parent[0].data.tags
    assert tags["bisect.first_bad_index"] == "2" and tags["device.kind"] == "ssh"
    assert tags["device.host"] == f"{emu.host}:{emu.port}" and parent[0].data.params["device.name"] == "emu"
    # measured in the requested state, verified on the device
    assert tags["power.mode_actual"] == "MAXN_SUPER" and tags["power.jetson_clocks_actual"] == "True"
    children = sorted((r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent[0].info.run_id),
                      key=lambda r: int(r.data.tags["bisect.step"]))
    assert [(r.data.tags["bisect.index"], r.data.tags["bisect.verdict"]) for r in children] == \
        [("0", "good"), ("3", "bad"), ("1", "good"), ("2", "bad")]
    for r in children:
        assert r.data.tags["backend.build_commit"] == llama_build["build_commit"]
        assert r.data.metrics["decode_tps"] > 0
    assert children[1].data.metrics["decode_tps"] < children[0].data.metrics["decode_tps"]
    # the power state was changed on the device, and is back to the original; the lease is gone
    changed = [c["argv"] for c in emu.command_log() if c["tool"] == "nvpmodel" and "-m" in c["argv"]]
    assert changed, "the bisection never set the power mode"
    after = emu.clock_state()
    assert after["mode_name"] == "25W" and after["none_locked"], after
    assert not list(Path(emu.home).glob(".cache/jbench/lease-*.json"))
    assert not list(Path(emu.home).glob(".cache/jbench/power-state-*.json"))


@pytest.mark.ssh
@pytest.mark.e2e
def test_a_build_directory_without_llama_bench_on_the_device_is_refused(orin_nano_super_r39, tmp_path, llama_build,
                                                                        bundled_model):
    emu = orin_nano_super_r39
    conf = write_conf(tmp_path, emu)
    empty = tmp_path / "not-a-build"
    empty.mkdir()
    proc = jbench_cli(["bisect", "--config-dir", str(conf), "--results-dir", str(tmp_path / "results"),
                       "--builds", llama_build["bin_dir"], str(empty), "device=emu", *CONFIG,
                       "power.mode=MAXN_SUPER"])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"--builds {empty}: no executable llama-bench in it on device 'emu'" in proc.stderr
    # refused before anything changed: no power mode set, no lease left, nothing recorded
    assert not [c for c in emu.command_log() if c["tool"] == "nvpmodel" and "-m" in c["argv"]]
    assert emu.clock_state()["mode_name"] == "25W"
    assert not list(Path(emu.home).glob(".cache/jbench/lease-*.json"))
    assert not (tmp_path / "results").exists() or not _runs(tmp_path / "results")


@pytest.mark.ssh
def test_a_commit_is_built_on_the_device_once_and_cached_there(orin_nano_super_r39, tmp_path):
    """build_commit_on_device on a real (tiny) CMake project committed to git: `git archive` here, SFTP to the device,
    `jbench setup`'s CMake arguments, only the llama-bench target, into the device's per-commit cache; the second call
    reuses it; a commit that does not build names its log on the device and shows its tail."""
    emu = orin_nano_super_r39
    repo = tmp_path / "proj"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "master")
    (repo / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.14)\nproject(p C)\n"
        "add_executable(llama-bench main.c)\n"
        "target_compile_definitions(llama-bench PRIVATE COMMIT=\"${LLAMA_BUILD_COMMIT}\")\n"
        "set_target_properties(llama-bench PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)\n"
        "add_executable(other other.c)\n")
    (repo / "main.c").write_text('#include <stdio.h>\nint main(void) { puts(COMMIT); return 0; }\n')
    (repo / "other.c").write_text("#error a target bisect must not build\n")
    sha = _commit(repo, "one")
    (repo / "main.c").write_text("int main(void) { return undeclared_in_commit_two; }\n")
    broken = _commit(repo, "two")
    device = device_cfg(emu)
    said: list[str] = []
    with connect(device) as conn:
        bin_dir = build_commit_on_device(conn, device, str(repo), sha, said.append, jobs=1)
        root = Path(bin_dir).parent
        # in the device's own cache (its home: the emulated device's HOME is not this user's)
        assert root.parent == Path(emu.home) / ".cache" / "jbench" / "llama.cpp"
        assert root.name.startswith(f"bisect-{sha[:9]}-cpu-")
        assert any("building llama-bench" in m and "on device 'emu'" in m for m in said)
        # -DLLAMA_BUILD_COMMIT from cmake_args reached the program, which runs on the device
        res = conn.run([f"{bin_dir}/llama-bench"], timeout=30)
        assert res.ok and res.stdout.strip() == sha[:9]
        assert (root / "build.log").exists() and not (root / "src").exists() and not (root / "build").exists()
        said.clear()
        assert build_commit_on_device(conn, device, str(repo), sha, said.append, jobs=1) == bin_dir and not said
        with pytest.raises(BisectError) as err:
            build_commit_on_device(conn, device, str(repo), broken, said.append, jobs=1)
    msg = str(err.value)
    assert f"commit {broken[:9]} does not build on device 'emu'" in msg
    assert "undeclared_in_commit_two" in msg  # the compiler's error, from the log's tail
    log = msg.split("full log on the device: ", 1)[1].splitlines()[0]
    assert Path(log).exists() and "undeclared_in_commit_two" in Path(log).read_text()
