"""Config composition: typed groups, clear errors, user config dirs, and the installed wheel."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from jbench.config import ConfigError, available_choices, compose

from .conftest import REPO


def test_default_composition_and_choices():
    cfg, choices = compose([])
    assert choices == {"device": "local", "backend": "llamacpp", "model": "gemma3_270m", "tracking": "local"}
    assert cfg.model.quant == "Q4_K_M" and cfg.backend.n_gen == 64 and cfg.device.kind == "local"


def test_experiment_sets_grid_and_backend_values():
    cfg, choices = compose(["+experiment=quant_ladder"])
    assert choices["experiment"] == "quant_ladder"
    assert list(cfg.sweep.grid["model.quant"]) == ["Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "F16"]
    assert (cfg.backend.n_prompt, cfg.backend.n_gen, cfg.backend.repetitions) == (128, 64, 3)
    assert cfg.experiment.name == "quant_ladder"


@pytest.mark.parametrize(
    "override, expected",
    [
        ("model=nope", "unknown model 'nope'. Valid model names: gemma3_270m"),
        ("+experiment=nope", "unknown experiment 'nope'. Valid experiment names: backend_shootout, context_sweep, kv_precision, nightly, power_modes, quant_ladder, serving, speculative"),
        ("device=lab_orin", "unknown device 'lab_orin'. Valid device names: local"),
        ("backend=nope", "unknown backend 'nope'. Valid backend names: engine, llama_server, llamacpp, mlc_llm, ollama, openai, trtllm, vllm"),
        ("backend.n_gne=3", "unknown config key 'backend.n_gne'. Did you mean backend.n_gen?"),
        ("telemetry.intervl_ms=3", "unknown config key 'telemetry.intervl_ms'. Did you mean telemetry.interval_ms or telemetry.hwmon_interval_ms?"),
        ("backend.n_gen=many", "bad value 'many' for backend.n_gen: expected Integer"),
        ("backend.extra_args=5", "bad value for backend.extra_args: got int, expected a list"),
        ("colour=red", "unknown config key 'colour'. Valid top-level keys: device, backend, model"),
    ],
)
def test_bad_input_names_the_key_and_valid_values(override, expected):
    with pytest.raises(ConfigError) as err:
        compose([override])
    assert expected in str(err.value)
    assert "\n" not in str(err.value)  # one message, not a traceback


def _typo(name: str) -> str:
    return name[:-1] + ("x" if name[-1] != "x" else "y")


def test_every_section_of_the_schema_gets_key_hints_through_the_planner():
    """Hints come from JBenchConfig's own fields: a section added to the schema (wall_power, farm) is never
    missing from them (`wall_power.hots` once suggested `power`)."""
    import dataclasses

    from jbench.config import section_schemas
    from jbench.core.registry import backend_schemas
    from jbench.core.schema import JBenchConfig
    from jbench.sweeps.plan import plan

    sections = section_schemas()
    assert list(sections) == [f.name for f in dataclasses.fields(JBenchConfig)]
    for section, schema in sections.items():
        schema = schema or backend_schemas()["llamacpp"]  # the default backend's keys
        key = next(f.name for f in dataclasses.fields(schema) if len(f.name) >= 4)
        with pytest.raises(ConfigError) as err:
            plan([f"{section}.{_typo(key)}=1"])
        assert f"Did you mean {section}.{key}" in str(err.value), (section, str(err.value))
    # The issue's own cases, and a nested section followed to its keys.
    for override, hint in [("wall_power.hots=1", "Did you mean wall_power.host?"),
                           ("farm.coordinatr=x", "Did you mean farm.coordinator?"),
                           ("device.paths.boot_idd=x", "Did you mean device.paths.boot_id?"),
                           ("wall_pwer.host=x", "Did you mean wall_power"),
                           ("colour=red", "Valid top-level keys: device, backend, model, tracking, power, telemetry, "
                                          "energy, wall_power, thermal, experiment, sweep, farm")]:
        with pytest.raises(ConfigError) as err:
            plan([override])
        assert hint in str(err.value), (override, str(err.value))


@pytest.mark.e2e
def test_the_cli_suggests_a_wall_power_key(tmp_path):
    from .conftest import jbench_cli

    res = jbench_cli(["sweep", "wall_power.hots=1"], env_extra={"JBENCH_RESULTS_DIR": str(tmp_path)})
    assert res.returncode == 2, res.stdout + res.stderr
    assert "unknown config key 'wall_power.hots'. Did you mean wall_power.host?" in res.stderr
    assert not (tmp_path / "mlflow.db").exists()


def test_user_config_dir_adds_models_experiments_and_devices(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "my_llm.yaml").write_text(
        "defaults:\n  - model_schema\n  - _self_\nname: my_llm\nquant: Q8_0\nfiles:\n  Q8_0: /models/my-llm-q8.gguf\n"
    )
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "my_exp.yaml").write_text(
        "# @package _global_\nexperiment:\n  name: my_exp\nsweep:\n  grid:\n    backend.n_gen: [8, 16]\n"
    )
    cfg, choices = compose(["model=my_llm", "+experiment=my_exp"], [tmp_path])
    assert cfg.model.files["Q8_0"] == "/models/my-llm-q8.gguf" and choices["model"] == "my_llm"
    assert list(cfg.sweep.grid["backend.n_gen"]) == [8, 16]
    assert available_choices("model", [tmp_path]) == ["gemma3_270m", "my_llm"]
    # A user file is typed like the packaged ones.
    (tmp_path / "model" / "bad.yaml").write_text("defaults:\n  - model_schema\n  - _self_\nname: bad\nquant: Q8_0\nsize: 3\n")
    with pytest.raises(ConfigError, match="unknown config key 'model.size'"):
        compose(["model=bad"], [tmp_path])


def test_a_user_file_wins_over_the_packaged_one_of_the_same_name_and_the_first_dir_wins(tmp_path):
    """A lab's own `experiment/nightly.yaml` (or `device/local.yaml`) replaces jbench's: first match wins, as
    --info says. Hydra alone would put the packaged config first."""
    first, second = tmp_path / "a", tmp_path / "b"
    for d, n_gen in ((first, 7), (second, 9)):
        (d / "experiment").mkdir(parents=True)
        (d / "experiment" / "nightly.yaml").write_text(
            f"# @package _global_\nexperiment:\n  name: nightly\n  description: lab {d.name}\n"
            f"sweep:\n  grid:\n    backend.n_gen: [{n_gen}]\n")
    cfg, _ = compose(["+experiment=nightly"], [first, second])
    assert cfg.experiment.description == "lab a" and list(cfg.sweep.grid["backend.n_gen"]) == [7]
    assert "model.quant" not in cfg.sweep.grid  # nothing of the packaged nightly matrix
    cfg, _ = compose(["+experiment=nightly"], [second])
    assert cfg.experiment.description == "lab b"
    cfg, _ = compose(["+experiment=nightly"])  # no user dir: the packaged one
    assert cfg.experiment.description == "fixed regression matrix"


def test_config_dir_from_environment(tmp_path, monkeypatch):
    from jbench.config import user_config_dirs

    monkeypatch.setenv("JBENCH_CONFIG_PATH", str(tmp_path))
    assert user_config_dirs() == [tmp_path.resolve()]
    monkeypatch.setenv("JBENCH_CONFIG_PATH", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="does not exist"):
        user_config_dirs()


@pytest.mark.slow
def test_installed_wheel_carries_the_config_tree(tmp_path):
    """Build the wheel, install it into a fresh target dir, and compose from it (not the checkout)."""
    wheel_dir = tmp_path / "wheel"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheel_dir), str(REPO)],
        check=True, capture_output=True,
    )
    wheel = next(wheel_dir.glob("jbench-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for needed in ("jbench/conf/config.yaml", "jbench/conf/model/gemma3_270m.yaml",
                   "jbench/conf/experiment/quant_ladder.yaml", "jbench/cli/__init__.py",
                   "jbench/cli/run.py", "jbench/tracking/sync.py"):
        assert needed in names
    assert "jbench/cli.py" not in names  # the module became the cli/ package
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    code = (
        "import jbench, jbench.config as c; "
        "cfg, ch = c.compose(['+experiment=quant_ladder']); "
        "print(jbench.__file__); print(cfg.experiment.name, len(cfg.sweep.grid['model.quant']))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(target)}, check=True).stdout.splitlines()
    assert out[0].startswith(str(target))
    assert out[1] == "quant_ladder 6"


def test_pyproject_lists_every_package():
    import tomllib

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "jbench").rglob("__init__.py")}
    # Directories of data files only: conf/'s groups (shipped as jbench.conf.<group>) and the device probes' sources.
    data = {f"jbench.conf.{d.name}" for d in (REPO / "conf").iterdir() if d.is_dir() and d.name != "__pycache__"}
    data |= {"jbench.device.probes"}
    assert found | {"jbench.conf"} | data == listed
    assert data <= set(setuptools["package-data"]), "each data directory says which of its files ship"


def test_a_free_form_mapping_is_set_whole_and_swept():
    """backend.env (a Dict field: the user's keys) takes a mapping in one override, and a comma list of mappings is a
    sweep dimension: Hydra's struct mode alone refuses `backend.env={A: "1"}` as an unknown key backend.env.A."""
    from jbench.config import mapping_keys
    from jbench.sweeps.plan import plan

    assert {"backend.env", "model.files"} <= mapping_keys() and "backend.n_gen" not in mapping_keys()
    cfg, _ = compose(["backend.env={GGML_CUDA_DISABLE_GRAPHS: '1'}"])
    assert cfg.backend.env == {"GGML_CUDA_DISABLE_GRAPHS": "1"}
    p = plan(["backend.env={},{GGML_CUDA_DISABLE_GRAPHS: '1'}"])
    assert [t.cfg.backend.env for t in p.trials] == [{}, {"GGML_CUDA_DISABLE_GRAPHS": "1"}]
    with pytest.raises(ConfigError, match="backend.n_gne"):  # a struct section still refuses an unknown key
        compose(["backend={n_gne: 3}"])
