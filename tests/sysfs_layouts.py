"""Sysfs trees per Jetson module family for the sysfs/hwmon reader's tests: tests/data/sysfs/layouts.yaml
(file names and labels from the sources it cites; values made up) written into a directory."""

from __future__ import annotations

from pathlib import Path

import yaml

LAYOUTS_FILE = Path(__file__).resolve().parent / "data" / "sysfs" / "layouts.yaml"


def layouts() -> dict[str, dict]:
    return yaml.safe_load(LAYOUTS_FILE.read_text())


def build(root: Path, name: str) -> dict:
    """Write layout `name` under root (the device's sysfs_root); returns the layout (provenance, expect, files)."""
    layout = layouts()[name]
    for rel, text in layout["files"].items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{text}\n")
    return layout
