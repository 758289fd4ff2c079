"""`jbench roofline` for a module the user does not own (issue 24, item 5): `--profile` with each Jetson profile that
ships with jbench (its datasheet bandwidth and RAM), a profile of the user's own, a module name given as `--device`,
and the README's roofline example run exactly as written, on the real bundled model."""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

import pytest
import yaml

from jbench.core.schema import SweepConfig

from .conftest import REPO, jbench_cli

pytestmark = pytest.mark.e2e

SHIPPED = sorted(p.stem for p in (REPO / "conf" / "profile").glob("*.yaml"))


def _profile(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _roofline(args: list[str], **kw) -> dict:
    res = jbench_cli(["roofline", *args, "--json"], **kw)
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout)


def _check_fit(fig: dict, profile: dict, model_file: str, ctx: int) -> None:
    """The fit the command reports is the file's size plus a KV cache of `ctx` tokens against the profile's RAM
    less the sweep's default reserve: what planning a sweep on that module checks."""
    needed = Path(model_file).stat().st_size + math.ceil(fig["kv_bytes_per_token_of_context"] * ctx)
    assert fig["memory_needed_bytes"] == needed
    available = profile["ram_gb"] * 1e9 - SweepConfig().memory_reserve_gb * 1e9
    assert fig["fits_in_ram"] is (needed <= available)
    assert fig["memory_fit"].startswith("fits:" if needed <= available else "does not fit:")


def test_shipped_profiles_are_the_ten_jetson_modules():
    assert len(SHIPPED) == 10 and "orin_nano_8gb" in SHIPPED


@pytest.mark.parametrize("profile", SHIPPED)
def test_every_shipped_profile_gives_a_ceiling_and_a_fit(profile, bundled_model):
    data = _profile(REPO / "conf" / "profile" / f"{profile}.yaml")
    fig = _roofline(["--model", "gemma3_270m", "--profile", profile, "--ctx", "4096", "--kv", "q8_0"])
    assert fig["profile"] == profile and fig["module"] == data["module"] and fig["ram_gb"] == data["ram_gb"]
    assert fig["bandwidth_gbs"] == data["memory_bandwidth_gbs"]
    assert fig["bandwidth_source"].startswith(f"datasheet ({profile})")
    assert fig["decode_ceiling_tok_s"] == pytest.approx(data["memory_bandwidth_gbs"] * 1e9
                                                        / fig["bytes_per_decoded_token"])
    assert fig["context_depth"] == 4096 and fig["kv_type"] == "q8_0"
    _check_fit(fig, data, bundled_model["Q4_K_M"]["path"], 4096)


def test_a_gguf_path_on_a_users_own_profile_that_it_does_not_fit(tmp_path, bundled_model):
    """A GGUF file given by path (a model with no config entry yet) on a module profile in the user's config dir,
    small enough that the model does not fit: the table says so in a sentence below it."""
    conf = tmp_path / "conf"
    (conf / "profile").mkdir(parents=True)
    shipped = (REPO / "conf" / "profile" / "orin_nano_8gb.yaml").read_text()
    small = shipped.replace("name: orin_nano_8gb", "name: tiny_module").replace("ram_gb: 8", "ram_gb: 1.2")
    assert small != shipped
    (conf / "profile" / "tiny_module.yaml").write_text(small)
    path = bundled_model["Q8_0"]["path"]
    fig = _roofline(["--model", path, "--profile", "tiny_module", "--ctx", "2048", "--config-dir", str(conf)])
    assert fig["model"] == Path(path).name and fig["quant"] == "Q8_0"
    assert fig["fits_in_ram"] is False and "short by" in fig["memory_fit"]
    _check_fit(fig, _profile(conf / "profile" / "tiny_module.yaml"), path, 2048)
    table = jbench_cli(["roofline", "--model", path, "--profile", "tiny_module", "--ctx", "2048",
                        "--config-dir", str(conf)], env_extra={"COLUMNS": "80"})
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0] == "roofline: Q8_0.gguf Q8_0 on Jetson Orin Nano 8GB"
    assert all(len(line) <= 80 for line in lines[:-1]), table.stdout
    assert lines[-1] == f"memory: {fig['memory_fit']}"  # the sentence whole, below the table


def test_a_module_name_given_as_device_names_the_fix(bundled_model):
    res = jbench_cli(["roofline", "--model", "gemma3_270m", "--device", "orin_nano_8gb"])
    assert res.returncode == 2
    assert res.stderr.strip() == ("error: 'orin_nano_8gb' is a module profile, not a device entry: "
                                  "use --profile orin_nano_8gb")


def test_without_a_bandwidth_it_says_how_to_get_a_ceiling(bundled_model):
    res = jbench_cli(["roofline", "--model", "gemma3_270m"], env_extra={"COLUMNS": "80"})
    assert res.returncode == 0, res.stderr
    assert "decode_ceiling_tok_s" not in res.stdout
    assert res.stdout.splitlines()[-1] == ("no ceiling: give --profile MODULE (e.g. orin_nano_8gb), --device NAME "
                                           "or --bandwidth-gbs")


def test_the_readme_roofline_example_runs_as_written(bundled_model):
    commands = [line.split("  #")[0] for line in (REPO / "README.md").read_text().splitlines()
                if line.startswith("jbench roofline ")]
    assert commands, "README.md has no `jbench roofline` example"
    for command in commands:
        argv = shlex.split(command)[1:]
        res = jbench_cli(argv)
        assert res.returncode == 0, f"{command}\n{res.stdout}{res.stderr}"
        assert "decode_ceiling_tok_s" in res.stdout, command


def in_tmux(args: list[str], *, width: int = 80, timeout: float = 120) -> list[str]:
    """The screen lines `jbench ARGS` leaves in a real tmux pane `width` columns wide (a private tmux server, so the
    pane gets this process's environment)."""
    import os
    import subprocess
    import sys
    import time

    exe = str(Path(sys.executable).with_name("jbench"))
    sock, marker = f"jbench-test-{os.getpid()}", "__jbench_done__"
    command = shlex.join([exe, *args]) + f"; echo {marker}; sleep 600"
    tmux = ["tmux", "-L", sock, "-f", "/dev/null"]
    subprocess.run([*tmux, "new-session", "-d", "-x", str(width), "-y", "200", "-s", "t", command], check=True,
                   env={k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "TMUX")})
    try:
        deadline = time.monotonic() + timeout
        while True:
            screen = subprocess.run([*tmux, "capture-pane", "-p", "-t", "t", "-S", "-"], capture_output=True,
                                    text=True, check=True).stdout.splitlines()
            if marker in screen:
                return [line.rstrip() for line in screen[:screen.index(marker)]]
            assert time.monotonic() < deadline, "\n".join(screen)
            time.sleep(0.5)
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)


def test_roofline_in_an_80_column_terminal(bundled_model):
    """In tmux at 80 columns: the table fits (every row ends on its border), and the sentence below it breaks only
    between words."""
    args = ["roofline", "--model", "gemma3_270m", "--profile", "orin_nano_8gb", "--ctx", "4096", "--kv", "q8_0"]
    fit = _roofline(args[1:])["memory_fit"]
    screen = in_tmux(args)
    table = [line for line in screen if line[:1] in "┏┃┡│└"]
    assert len(table) > 10 and all(len(line) <= 80 and line[-1] in "┓┃┩│┘" for line in table), "\n".join(screen)
    below = screen[screen.index(table[-1]) + 1:]
    assert below[0].startswith("memory: ") and all(len(line) <= 80 for line in below)
    assert " ".join(below).split() == f"memory: {fit}".split(), "\n".join(below)  # no word cut in two
