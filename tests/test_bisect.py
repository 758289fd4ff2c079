"""`jbench bisect`: the search logic (pure), git commit listing on a real repository, and the bisection itself on
real llama.cpp builds that really differ in speed: the cached build and one compiled with SIMD disabled
(`nosimd_build`, built once into the cache; that takes minutes on a small machine)."""

from __future__ import annotations

import statistics
import subprocess
from pathlib import Path

import pytest

from jbench.sweeps.bisect import (BAD, GOOD, UNCLEAR, BisectError, builds_from_dirs, classify, commits_between, ends_differ,
                           repetitions_needed, search)
from tests.conftest import jbench_cli

# --- the search (pure) -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,first_bad", [(2, 1), (3, 1), (3, 2), (4, 2), (9, 1), (9, 5), (9, 8), (16, 11)])
def test_search_finds_the_first_bad_index_with_log2_steps(n, first_bad):
    asked = []

    def verdict(i):
        asked.append(i)
        return BAD if i >= first_bad else GOOD

    found, steps = search(n, verdict)
    assert found == first_bad
    assert [i for i, _ in steps] == asked
    assert 0 not in asked and n - 1 not in asked  # the ends are known, never asked
    assert len(asked) <= (n - 2).bit_length()


def test_search_stops_without_verdict_on_an_unclear_step():
    found, steps = search(8, lambda i: UNCLEAR)
    assert found is None and steps == [(3, UNCLEAR)]


def test_search_needs_two_builds():
    with pytest.raises(BisectError, match="at least two builds"):
        search(1, lambda i: GOOD)


def test_classification_picks_the_closer_end_only_when_the_other_end_is_clearly_different():
    good, bad = [100.0, 101, 99, 100.5, 99.5], [80.0, 81, 79, 80.5, 79.5]
    assert classify([99.0, 100, 101, 100.2, 99.8], good, bad, 0.01)[0] == GOOD
    assert classify([80.0, 79, 81, 80.2, 79.8], good, bad, 0.01)[0] == BAD
    verdict, why = classify([60.0, 140, 90, 110, 100], good, bad, 0.01)  # too noisy to tell
    assert verdict == UNCLEAR and "Welch" in why
    # Closer to the bad end, but clearly faster than it too: a speed in between is no verdict.
    verdict, why = classify([88.0, 89, 87, 88.5, 87.5], good, bad, 0.01)
    assert verdict == UNCLEAR and "middle third" in why
    # A quiet machine: 1 % of drift from the good end is significant, but immaterial next to a 20 % step.
    tight_good, tight_bad = [100.0, 100.1, 99.9, 100.05, 99.95], [80.0, 80.1, 79.9, 80.05, 79.95]
    assert classify([99.0, 99.1, 98.9, 99.05, 98.95], tight_good, tight_bad, 0.01)[0] == GOOD


def test_repetitions_follow_the_ends_difference_and_noise_within_bounds():
    good = [100.0, 102, 98, 101, 99]
    far = [50.0, 52, 48, 51, 49]
    near = [99.0, 101, 97, 100, 98]  # 1 apart, std ~1.6: (2 * 2.576 * 1.58 / 1)^2 ~ 66
    assert repetitions_needed(good, far, 0.01, minimum=3, maximum=30) == (3, 1)
    reps, raw = repetitions_needed(good, near, 0.01, minimum=3, maximum=30)
    assert reps == 30 and raw > 30
    assert repetitions_needed(good, near, 0.01, minimum=3, maximum=100)[0] == raw
    assert ends_differ(good, far, 0.01)[0] and not ends_differ(good, near, 0.01)[0]


def _ends_only(trials: dict[str, list[list[float]]], alpha: float = 0.001):
    """Bisector._bisect over two builds with canned measurements: each measure() call of an end returns that end's
    next trial."""
    from jbench.sweeps.bisect import BisectResult, Bisector, Build

    good_b, bad_b = Build("good", "/g"), Build("bad", "/b")
    job = Bisector.__new__(Bisector)
    job.builds, job.metric, job.alpha, job.say = [good_b, bad_b], "decode_tps", alpha, lambda m: None
    job.repetitions, job.max_repetitions, job.end_trials = 3, 6, len(trials["good"])
    order, queue = [], {b.label: list(trials[b.label]) for b in (good_b, bad_b)}

    def measure(build, repetitions, name):
        order.append(build.label)
        return queue[build.label].pop(0) if queue[build.label] else [statistics.fmean(trials[build.label][0])] * 3, None

    job.measure, job._record = measure, lambda step, handle: None
    res = BisectResult(job.builds)
    job._bisect(res)
    return res, order


def test_the_ends_are_judged_by_trial_not_by_repetition():
    """Two trials of one build differ by more than their repetitions' spread (CI: 72.6 +- 0.6 vs 75.3 +- 0.4 tok/s
    of the same build); a per-repetition test calls that a difference, the trial as the unit does not."""
    same = {"good": [[72.0, 72.6, 73.2, 72.8], [75.0, 75.3, 74.9, 75.6]],
            "bad": [[75.2, 75.6, 74.9, 75.3], [72.3, 72.9, 72.5, 73.0]]}
    assert ends_differ([v for t in same["good"][:1] for v in t], same["bad"][0], 0.001)[0]  # what the old test said
    res, order = _ends_only(same)
    assert order == ["good", "bad", "bad", "good"]  # counterbalanced
    assert res.outcome == "no_difference" and "--end-trials" in res.message
    assert res.ends.k_test == 2 and res.ends.dof == 2 and "trial-to-trial spread" in res.message
    slow = {"good": same["good"], "bad": [[12.1, 12.3, 12.2], [12.6, 12.4, 12.5]]}
    res, _ = _ends_only(slow)
    assert res.outcome != "no_difference" and res.ends.ratio < 0.2 and res.ends.p_value < 0.001
    assert [s.verdict for s in res.steps[:2]] == [GOOD, BAD] and len(res.steps[0].samples) == 8


def test_build_dirs_must_hold_llama_bench(tmp_path):
    (tmp_path / "a" / "bin").mkdir(parents=True)
    (tmp_path / "a" / "bin" / "llama-bench").write_text("")
    (tmp_path / "a" / "bin" / "llama-bench").chmod(0o755)
    (tmp_path / "b").mkdir()
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "llama-bench").write_text("")  # not executable
    with pytest.raises(BisectError, match=f"--builds {tmp_path / 'b'}, {tmp_path / 'c'}: no executable llama-bench"):
        builds_from_dirs([str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "c")])
    with pytest.raises(BisectError, match="at least two"):
        builds_from_dirs([str(tmp_path / "a")])
    assert builds_from_dirs([str(tmp_path / "a"), str(tmp_path / "a" / "bin")])[0].bin_dir == \
        str((tmp_path / "a" / "bin").resolve())


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def test_commits_between_lists_first_parent_commits_oldest_first(tmp_path):
    repo = tmp_path / "llama.cpp"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "master")
    for name in ("one", "two", "three", "four"):
        (repo / name).write_text(name)
        _git(repo, "add", name)
        _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", name)
    shas = _git(repo, "rev-list", "--reverse", "HEAD").split()
    assert commits_between(str(repo), "HEAD~3", "HEAD") == shas
    assert commits_between(str(repo), shas[1], "master") == shas[1:]
    with pytest.raises(BisectError, match="not an ancestor"):
        commits_between(str(repo), "HEAD", "HEAD~2")
    with pytest.raises(BisectError, match="same commit"):
        commits_between(str(repo), "HEAD", "master")
    with pytest.raises(BisectError, match="failed"):
        commits_between(str(repo), "nope", "HEAD")


# --- real builds that differ in speed --------------------------------------------------------------------------

def _ladder(tmp_path: Path, fast: str, slow: str, kinds: list[str]) -> list[str]:
    """Directories of symlinks to the real builds, in the given order (fast/slow)."""
    dirs = []
    for i, kind in enumerate(kinds):
        d = tmp_path / f"build{i}-{kind}"
        d.mkdir()
        (d / "llama-bench").symlink_to(Path(fast if kind == "fast" else slow) / "llama-bench")
        dirs.append(str(d))
    return dirs


CONFIG = ["model.quant=Q4_0", "backend.n_prompt=0", "backend.n_gen=16", "backend.threads=1"]


def _runs(results: Path) -> list:
    from jbench.tracking.common import resolve_uri
    from mlflow.tracking import MlflowClient

    client = MlflowClient(resolve_uri(None, str(results)))
    exps = client.search_experiments()
    return [r for e in exps for r in client.search_runs([e.experiment_id])]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.alone  # the speed difference of two real builds
@pytest.mark.timeout(2400)  # the first use builds the SIMD-less llama-bench: minutes on two cores
def test_bisect_finds_the_first_slow_build_and_records_every_step(tmp_path, llama_build, nosimd_build,
                                                                 bundled_model):
    dirs = _ladder(tmp_path, llama_build["bin_dir"], nosimd_build, ["fast", "fast", "slow", "slow"])
    results = tmp_path / "results"
    proc = jbench_cli(["bisect", "--results-dir", str(results), "--builds", *dirs, *CONFIG,
                       "--repetitions", "3", "--max-repetitions", "4", "--end-trials", "2"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"FIRST BAD: build 2: {dirs[2]}" in proc.stdout
    runs = _runs(results)
    parent = [r for r in runs if r.data.tags.get("jbench.kind") == "bisect"]
    assert len(parent) == 1 and parent[0].info.status == "FINISHED"
    assert parent[0].data.tags["bisect.first_bad_index"] == "2"
    assert_fast_fast_slow_slow_steps(runs, parent[0], llama_build["build_commit"])


def assert_fast_fast_slow_slow_steps(runs: list, parent, commit: str) -> list:
    """The step runs of a bisection of [fast, fast, slow, slow]: the good end, the bad end, then the midpoints of
    [0, 3]: 1 (good), 2 (bad); each the real build's commit and a measured decode, the slow end slower."""
    runs_of_steps = sorted((r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id),
                           key=lambda r: (int(r.data.tags["bisect.step"]), r.info.start_time))
    for r in runs_of_steps:  # every measurement is a trial run of its own (an end measured for more repetitions: two)
        assert r.data.tags["jbench.kind"] == "bisect_step" and r.data.tags["backend.build_commit"] == commit
        assert r.data.metrics["decode_tps"] > 0 and r.data.tags["jbench.status"] == "FINISHED"
    children = list({r.data.tags["bisect.step"]: r for r in reversed(runs_of_steps)}.values())[::-1]
    assert [(r.data.tags["bisect.index"], r.data.tags["bisect.verdict"]) for r in children] == \
        [("0", "good"), ("3", "bad"), ("1", "good"), ("2", "bad")]
    assert children[1].data.metrics["decode_tps"] < children[0].data.metrics["decode_tps"]
    return children


@pytest.mark.e2e
@pytest.mark.alone  # two builds measured as equally fast
def test_bisect_stops_when_the_ends_do_not_differ(tmp_path, llama_build, bundled_model):
    dirs = _ladder(tmp_path, llama_build["bin_dir"], llama_build["bin_dir"], ["fast", "fast"])
    results = tmp_path / "results"
    proc = jbench_cli(["bisect", "--results-dir", str(results), "--builds", *dirs, *CONFIG,
                       "--repetitions", "3", "--alpha", "0.001", "--end-trials", "2"])
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "do not differ significantly" in proc.stderr and "nothing to bisect" in proc.stderr
    runs = _runs(results)
    parent = [r for r in runs if r.data.tags.get("jbench.kind") == "bisect"]
    assert parent[0].data.tags["bisect.outcome"] == "no_difference"
    assert "bisect.first_bad_index" not in parent[0].data.tags
    steps = [r for r in runs if r.data.tags.get("jbench.kind") == "bisect_step"]
    assert sorted(r.data.tags["bisect.step"] for r in steps) == ["0", "0", "1", "1"]  # two trials of each end
    assert "trial-to-trial spread" in steps[0].data.tags["bisect.why"]


def test_bad_input_is_one_message(tmp_path):
    from click.testing import CliRunner

    from jbench.cli import main

    runner = CliRunner()
    res = runner.invoke(main, ["bisect", "--results-dir", str(tmp_path), "model.quant=Q4_0"])
    assert res.exit_code == 2 and "--builds GOOD_DIR" in res.output
    res = runner.invoke(main, ["bisect", "--repo", str(tmp_path), "--good", "a"])
    assert res.exit_code == 2 and "--good REF and --bad REF" in res.output
    res = runner.invoke(main, ["bisect", "--builds", str(tmp_path), str(tmp_path / "x"), "model.quant=Q4_0"])
    assert res.exit_code == 2 and "no executable llama-bench in it" in res.output


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.alone  # the speed difference of two real builds
@pytest.mark.timeout(2400)  # the SIMD-less build, when this test is the first to need it
def test_bisect_over_git_commits_uses_the_per_commit_build_cache(tmp_path, llama_build, nosimd_build, bundled_model):
    """--repo: the commits between --good and --bad, each commit's llama-bench found in the per-commit cache
    (llama.cpp/bisect-<commit>-cpu-<machine>). The cache is seeded with the two real builds, so this proves the
    commit walk, the cache and the record, not the compile (that is `compile_llamacpp`, which the nosimd fixture and
    `jbench setup` run)."""
    import platform

    repo = tmp_path / "llama.cpp"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "master")
    for name in ("good", "regressed", "later"):
        (repo / name).write_text(name)
        _git(repo, "add", name)
        _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", name)
    shas = _git(repo, "rev-list", "--reverse", "HEAD").split()
    cache = tmp_path / "cache"
    (cache / "llama.cpp").mkdir(parents=True)
    (cache / "models").symlink_to(Path(bundled_model["Q4_0"]["path"]).parent.parent)
    for sha, build in zip(shas, (llama_build["bin_dir"], nosimd_build, nosimd_build)):
        bin_dir = cache / "llama.cpp" / f"bisect-{sha[:9]}-cpu-{platform.machine()}" / "bin"
        bin_dir.mkdir(parents=True)
        (bin_dir / "llama-bench").symlink_to(Path(build) / "llama-bench")
    results = tmp_path / "results"
    proc = jbench_cli(["bisect", "--results-dir", str(results), "--repo", str(repo), "--good", "HEAD~2",
                       "--bad", "master", *CONFIG, "--repetitions", "3", "--max-repetitions", "4", "--end-trials", "2"],
                      env_extra={"JBENCH_CACHE_DIR": str(cache)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"FIRST BAD: build 1: {shas[1][:9]}" in proc.stdout
    runs = _runs(results)
    steps = sorted({r.data.tags["bisect.step"]: r for r in runs if r.data.tags.get("jbench.kind") == "bisect_step"}
                   .values(), key=lambda r: int(r.data.tags["bisect.step"]))  # one run per step (an end has several)
    assert [(r.data.tags["bisect.build"], r.data.tags["bisect.verdict"]) for r in steps] == \
        [(shas[0][:9], "good"), (shas[2][:9], "bad"), (shas[1][:9], "bad")]


def commit_all(repo: Path, message: str) -> str:
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", message)
    return _git(repo, "rev-parse", "HEAD")


def tiny_cmake_project(tmp_path: Path) -> tuple[Path, str]:
    """(a git repository of a tiny real CMake project, its one commit): a `llama-bench` target that prints the
    LLAMA_BUILD_COMMIT it was configured with, and another target that must not be built."""
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
    return repo, commit_all(repo, "one")


def test_a_commit_is_built_with_the_setup_cmake_configuration_once_and_cached(tmp_path, monkeypatch):
    """build_commit on a real (tiny) CMake project committed to git: `git archive` of the commit, `jbench setup`'s
    CMake arguments, only the llama-bench target, into the cache; the second call reuses it."""
    from jbench.sweeps import bisect

    repo, sha = tiny_cmake_project(tmp_path)
    monkeypatch.setenv("JBENCH_CACHE_DIR", str(tmp_path / "cache"))
    said = []
    bin_dir = bisect.build_commit(str(repo), sha, said.append, jobs=1)
    assert Path(bin_dir).parent.name.startswith(f"bisect-{sha[:9]}-cpu-")
    # -DLLAMA_BUILD_COMMIT from cmake_args reached the compiled program (read, not run: it is no llama.cpp)
    assert sha[:9].encode() in (Path(bin_dir) / "llama-bench").read_bytes()
    assert any("building llama-bench" in m for m in said)
    said.clear()
    assert bisect.build_commit(str(repo), sha, said.append, jobs=1) == bin_dir and not said
