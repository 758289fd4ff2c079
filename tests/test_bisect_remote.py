"""`jbench bisect` on a remote device: an emulated Jetson (a real OpenSSH sshd on loopback, fake L4T tools) that runs
this machine's real llama-bench builds (the cached build and the SIMD-less `nosimd_build`) over SSH, under a power
state the bisection applies and restores; a --builds directory without llama-bench on the device refused; and a
commit built ON the device (git archive -> SFTP -> CMake there) on a tiny real CMake project, reused next time."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from jbench.core.schema import DeviceConfig, typed
from jbench.sweeps.bisect import BisectError, build_commit_on_device
from jbench.device.connect import connect
from tests.conftest import jbench_cli
from tests.test_bisect import CONFIG, _git, _ladder, _runs, assert_fast_fast_slow_slow_steps, tiny_cmake_project
from tests.test_bisect import commit_all as _commit
from tests.test_device_sweeps import JBENCH, _nothing_left, _popen, _stop
from tests.test_ssh_devices import _wait_for, device_cfg, write_conf




@pytest.mark.ssh
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.alone  # the speed difference of two real builds
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
                       "--repetitions", "3", "--max-repetitions", "4", "--end-trials", "2"])
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
    assert_fast_fast_slow_slow_steps(runs, parent[0], llama_build["build_commit"])
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
    # the model file must be on the device (the sweep's remote model check)
    proc = jbench_cli(["bisect", "--config-dir", str(conf), "--results-dir", str(tmp_path / "results"),
                       "--builds", llama_build["bin_dir"], llama_build["bin_dir"], "device=emu", *CONFIG,
                       "model.source=files", "model.name=mine", f"model.path_template='{tmp_path}/nope/{{quant}}.gguf'"])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"model file {tmp_path}/nope/Q4_0.gguf not found on device 'emu'" in proc.stderr
    assert not list(Path(emu.home).glob(".cache/jbench/lease-*.json"))


@pytest.mark.ssh
@pytest.mark.e2e
def test_a_remote_bisect_holds_the_device_and_ctrl_c_restores_its_power_state(orin_nano_super_r39, tmp_path,
                                                                            llama_build, bundled_model):
    emu = orin_nano_super_r39
    conf = write_conf(tmp_path, emu)
    dirs = _ladder(tmp_path, llama_build["bin_dir"], llama_build["bin_dir"], ["fast", "fast", "fast"])
    results = tmp_path / "results"
    # Many long repetitions: the good end is still being measured when Ctrl-C comes.
    proc = _popen([JBENCH, "bisect", "--config-dir", str(conf), "--builds", *dirs, "device=emu", "model.quant=Q4_0",
                   "backend.n_prompt=0", "backend.n_gen=256", "--repetitions", "50", "--max-repetitions", "50",
                   "power.mode=MAXN_SUPER", "power.jetson_clocks=true"], results)
    try:
        # measuring on the device now, in the requested state
        assert _wait_for(lambda: proc.poll() is not None or bool(emu.device_processes(["llama-bench"])))
        assert proc.poll() is None, _stop(proc)
        st = emu.clock_state()
        assert st["mode_name"] == "MAXN_SUPER" and st["all_locked"], st
        # the bisection holds the device's lease: a sweep of another controller is refused meanwhile
        other = jbench_cli(["run", "--config-dir", str(conf), "device=emu", f"backend.binary_dir={dirs[0]}",
                            "model.quant=Q4_0", "backend.n_gen=4", "telemetry.source=none"],
                           env_extra={"JBENCH_RESULTS_DIR": str(tmp_path / "r2")})
        assert other.returncode == 2 and "in use by another jbench controller" in other.stderr, other.stderr
        assert f"pid {proc.pid}" in other.stderr
        proc.send_signal(signal.SIGINT)
        out, err = _stop(proc, grace_s=120)
    finally:
        _stop(proc)
    assert proc.returncode == 130, out + err
    assert "interrupted: the bisect run is recorded as KILLED" in err
    st = emu.clock_state()
    assert st["mode_name"] == "25W" and st["none_locked"], st
    assert not list(Path(emu.home).glob(".cache/jbench/lease-*.json"))
    assert _wait_for(lambda: _nothing_left(emu), timeout=30)
    parent = [r for r in _runs(results) if r.data.tags.get("jbench.kind") == "bisect"]
    assert len(parent) == 1 and parent[0].info.status == "KILLED"


@pytest.mark.ssh
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.alone  # the speed difference of two real builds
@pytest.mark.timeout(2400)  # the SIMD-less build, when this test is the first to need it
def test_remote_bisect_over_git_commits_uses_the_device_build_cache(orin_nano_super_r39, tmp_path, llama_build,
                                                                     nosimd_build, bundled_model):
    """--repo with a remote device: each commit's llama-bench is looked up in the DEVICE's per-commit cache
    (<state_dir>/llama.cpp/bisect-<commit>-cpu-<device machine>), seeded here with the two real builds: the commit
    walk, the device cache and the record (the on-device compile itself: the test below)."""
    emu = orin_nano_super_r39
    conf = write_conf(tmp_path, emu)
    repo = tmp_path / "llama.cpp"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "master")
    shas = []
    for name in ("good", "regressed", "later"):
        (repo / name).write_text(name)
        shas.append(_commit(repo, name))
    with connect(device_cfg(emu)) as conn:
        machine = conn.run(["uname", "-m"], timeout=30).stdout.strip()
    cache = Path(emu.home) / ".cache" / "jbench" / "llama.cpp"
    for sha, build in zip(shas, (llama_build["bin_dir"], nosimd_build, nosimd_build)):
        bin_dir = cache / f"bisect-{sha[:9]}-cpu-{machine}" / "bin"
        bin_dir.mkdir(parents=True)
        (bin_dir / "llama-bench").symlink_to(Path(build) / "llama-bench")
    results = tmp_path / "results"
    proc = jbench_cli(["bisect", "--config-dir", str(conf), "--results-dir", str(results), "--repo", str(repo),
                       "--good", "HEAD~2", "--bad", "master", "device=emu", *CONFIG,
                       "--repetitions", "3", "--max-repetitions", "4", "--end-trials", "2"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"FIRST BAD: build 1: {shas[1][:9]}" in proc.stdout
    assert "building llama-bench" not in proc.stderr  # every commit came from the device's cache
    steps = sorted({r.data.tags["bisect.step"]: r for r in _runs(results)
                    if r.data.tags.get("jbench.kind") == "bisect_step"}.values(),
                   key=lambda r: int(r.data.tags["bisect.step"]))  # one run per step (an end has several)
    assert [(r.data.tags["bisect.build"], r.data.tags["bisect.verdict"]) for r in steps] == \
        [(shas[0][:9], "good"), (shas[2][:9], "bad"), (shas[1][:9], "bad")]
    assert all(r.data.tags["backend.binary_dir"].startswith(str(cache)) for r in steps)


@pytest.mark.ssh
def test_a_commit_is_built_on_the_device_once_and_cached_there(orin_nano_super_r39, tmp_path):
    """build_commit_on_device on a real (tiny) CMake project committed to git: `git archive` here, SFTP to the
    device, `jbench setup`'s CMake arguments, only the llama-bench target, into the device's per-commit cache; the
    second call reuses it; a commit that does not build names its log on the device and shows its tail."""
    emu = orin_nano_super_r39
    repo, sha = tiny_cmake_project(tmp_path)
    (repo / "main.c").write_text("int main(void) { return undeclared_in_commit_two; }\n")
    broken = _commit(repo, "two")
    device = typed(DeviceConfig, device_cfg(emu))
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
