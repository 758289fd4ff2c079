"""`jbench sweep +experiment=quant_ladder --dry-run` (6 trials) as a user waits for it, against
`jbench --help`: each a fresh process, in alternating pairs.

Phases (each its own alternating pairs with `jbench --help`):
  warm   the model-facts cache holds the six GGUF files (any run after the first)
  cold   the model-facts cache is emptied before every dry run (a first run after `jbench setup`)
  store  (with --store DIR) a results store exists, so the dry run reads its history for estimates
The OS page cache is warm throughout (one unmeasured run of each command first), as it is on a
user's second run. The facts cache lives in a private cache directory (models and llama.cpp linked
from the real one), so emptying it touches nobody else.

Targets (issue 10): warm dry run < 1 s and <= 10x `jbench --help`.

    .venv/bin/python bench/dry_run.py [--pairs 20] [--cold-pairs 10] [--store /tmp/jb-resume]
                                      [--json bench/results-dry-run.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _procstat import (  # noqa: E402
    alternate, describe, exit_cleanly_on_sigterm, fmt, jbench_env, jbench_exe, load_average, machine, paired, raw,
    run_once,
)

from jbench.core import paths  # noqa: E402


def private_cache(tmp: Path) -> Path:
    """A cache dir whose models/ and llama.cpp/ are the real ones and whose model-facts/ is ours."""
    real = paths.cache_dir()
    cache = tmp / "cache"
    cache.mkdir()
    for name in ("models", "llama.cpp"):
        if (real / name).exists():
            (cache / name).symlink_to(real / name)
    if not (cache / "models").exists():
        raise SystemExit(f"no models under {real}: run `jbench setup` first")
    return cache


def phase(name: str, pairs: int, dry, helpc, before_dry=None) -> dict:
    def a():
        if before_dry:
            before_dry()
        return dry()

    def show(i, x, y):
        print(f"  {name} pair {i + 1}: dry run {x.wall_s:.3f} s ({x.cpu_s:.2f} CPU-s), --help {y.wall_s:.3f} s, "
              f"ratio {x.wall_s / y.wall_s:.2f}", flush=True)

    load0 = load_average()
    sa, sb = alternate(a, helpc, pairs, show)
    out = {
        "dry_run_wall_s": describe([s.wall_s for s in sa]),
        "dry_run_cpu_s": describe([s.cpu_s for s in sa]),
        "help_wall_s": describe([s.wall_s for s in sb]),
        "help_cpu_s": describe([s.cpu_s for s in sb]),
        "dry_over_help_wall": paired([s.wall_s for s in sa], [s.wall_s for s in sb])["ratio"],
        "load_average": {"start": load0, "end": load_average()},
        "pairs": raw(sa, sb, ("dry_run", "help")),
    }
    print(f"{name}: dry run {fmt(out['dry_run_wall_s'])}\n"
          f"{' ' * len(name)}  --help  {fmt(out['help_wall_s'])}\n"
          f"{' ' * len(name)}  ratio   {fmt(out['dry_over_help_wall'], unit='x', digits=2)}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=20, help="alternating pairs with a warm facts cache")
    ap.add_argument("--cold-pairs", type=int, default=10, help="pairs with the facts cache emptied each time")
    ap.add_argument("--store", type=Path, help="a results dir holding mlflow.db: also time the dry run with history")
    ap.add_argument("--json", type=Path, default=Path(__file__).resolve().parent / "results-dry-run.json")
    args = ap.parse_args()
    exit_cleanly_on_sigterm()

    jb = jbench_exe()
    with tempfile.TemporaryDirectory(prefix="jbench-dry-") as t:
        tmp = Path(t)
        cache = private_cache(tmp)
        facts_dir = cache / "model-facts"
        empty_results = tmp / "results"
        env = jbench_env(JBENCH_CACHE_DIR=str(cache), JBENCH_RESULTS_DIR=str(empty_results))
        dry_argv = jb + ["sweep", "+experiment=quant_ladder", "--dry-run"]

        def dry():
            return run_once(dry_argv, env=env, cwd=tmp)

        def helpc():
            return run_once(jb + ["--help"], env=env, cwd=tmp)

        def empty_facts():
            shutil.rmtree(facts_dir, ignore_errors=True)

        # Unmeasured: warm the OS page cache (interpreter, site-packages, GGUF headers) and the facts cache.
        helpc()
        dry()
        dry()
        figures: dict = {"command": " ".join(["jbench"] + dry_argv[1:]), "baseline": "jbench --help",
                         "machine": machine(), "trials": 6}
        figures["warm"] = phase("warm", args.pairs, dry, helpc)
        if args.cold_pairs:
            figures["cold"] = phase("cold", args.cold_pairs, dry, helpc, before_dry=empty_facts)
            dry()  # leave the facts cache warm again
        if args.store:
            if not (args.store / "mlflow.db").exists():
                raise SystemExit(f"--store {args.store}: no mlflow.db there")
            env_store = dict(env, JBENCH_RESULTS_DIR=str(args.store.resolve()))

            def dry_store():
                return run_once(dry_argv, env=env_store, cwd=tmp)

            dry_store()
            figures["store"] = phase("store", max(2, args.pairs // 2), dry_store, helpc)

    warm = figures["warm"]
    figures["targets"] = {
        "warm_dry_run_under_1s": warm["dry_run_wall_s"]["median"] < 1.0,
        "warm_dry_run_at_most_10x_help": warm["dry_over_help_wall"]["median"] <= 10.0,
    }
    print(json.dumps(figures["targets"]))
    args.json.write_text(json.dumps(figures, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
