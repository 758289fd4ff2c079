"""A config directory that makes this machine a one-unit device class with one small experiment: what the nightly
tests and bench/nightly_control_emulated.py run `jbench nightly CLASS` against (real llama.cpp, no SSH)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import yaml


def local_class_conf(conf: Path, device_class: str, experiment: str, description: str, *,
                     rounds: Optional[int] = None, backend: dict[str, Any]) -> Path:
    """conf/device/host1.yaml (kind local, of `device_class`; its lease in the process's JBENCH_STATE_DIR, as
    conf/device/local.yaml does) and conf/experiment/<experiment>.yaml (Q4_0, `rounds` rounds where given, the
    llama.cpp `backend` settings); returns `conf`."""
    (conf / "device").mkdir(parents=True)
    (conf / "experiment").mkdir()
    (conf / "device" / "host1.yaml").write_text(yaml.safe_dump({
        "defaults": ["device_schema", "_self_"], "name": "host1", "kind": "local", "device_class": device_class,
        "paths": {"state_dir": "${oc.env:JBENCH_STATE_DIR,'~/.cache/jbench'}"}}))
    (conf / "experiment" / f"{experiment}.yaml").write_text("# @package _global_\n" + yaml.safe_dump({
        "experiment": {"name": experiment, "description": description},
        "model": {"quant": "Q4_0"}, **({"sweep": {"rounds": rounds}} if rounds is not None else {}),
        "backend": {"name": "llamacpp", **backend}}))
    return conf
