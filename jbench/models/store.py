"""Model files: quantization names and where a trial's GGUF file lives.

Quant names come from the `gguf` package's LlamaFileType (the file types llama-quantize makes),
so the list follows llama.cpp instead of a hand-made table.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Optional

from jbench.core import paths
from jbench.core.schema import ModelConfig, ModelSection, typed


class ModelError(Exception):
    """A model that cannot be resolved; the message names the fix."""


@lru_cache(maxsize=1)
def quant_names() -> tuple[str, ...]:
    """Valid quant names as users and llama-quantize spell them (Q4_K_M, Q8_0, F16, ...)."""
    from gguf import LlamaFileType

    names = []
    for member in LlamaFileType:
        if member.name == "GUESSED":
            continue
        names.append(member.name.replace("MOSTLY_", "").replace("ALL_", ""))
    return tuple(names)


def check_quant(quant: str) -> Optional[str]:
    """None when valid, else the message listing the valid names."""
    if quant in quant_names():
        return None
    close = [q for q in quant_names() if q.upper() == str(quant).upper()]
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"unknown quant '{quant}'{hint}. Valid quants: {', '.join(quant_names())}"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------
# The model store: bundled models installed and quantized by `jbench setup`.


def store_dir(model_name: str) -> Path:
    return paths.models_dir() / model_name


def manifest_path(model_name: str) -> Path:
    return store_dir(model_name) / "manifest.json"


def load_manifest(model_name: str) -> dict:
    path = manifest_path(model_name)
    try:
        stat = path.stat()
    except FileNotFoundError:
        return {"files": {}}
    return _read_manifest(str(path), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=32)
def _read_manifest(path: str, mtime_ns: int, size: int) -> dict:
    # Cached by modification time: planning a large sweep resolves the same manifest per trial.
    return json.loads(Path(path).read_text())


def save_manifest(model_name: str, manifest: dict) -> None:
    path = manifest_path(model_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    tmp.replace(path)


def override_problem(section: ModelSection) -> Optional[str]:
    """Why a model section's file overrides cannot take effect, or None: a bundled model's file is the one
    `jbench setup` made and verified, so model.files / model.path_template on it would be recorded but
    not benchmarked. They are refused instead, naming how to benchmark one's own file."""
    model = typed(ModelConfig, section, where="model")
    if model.source != "bundled":
        return None
    set_keys = [key for key, value in (("files", model.files), ("path_template", model.path_template)) if value]
    if not set_keys:
        return None
    keys = " / ".join(f"model.{k}" for k in set_keys)
    return (f"{keys} does not apply to the bundled model '{model.name}' (model.source=bundled benchmarks the "
            f"file `jbench setup` made). To benchmark your own file, set model.source=files and "
            f"model.name=<your model's name> with it")


def local_file_problem(section: ModelSection) -> Optional[str]:
    """Why the trial's model file is missing on this machine, or None (found, or not resolvable: the
    backend's validation reports that)."""
    model = typed(ModelConfig, section, where="model")
    try:
        path, _ = resolve_model_file(model)
    except ModelError:
        return None
    if os.path.exists(os.path.expanduser(path)):
        return None
    if model.source == "bundled":
        return f"model '{model.name}' {model.quant}: {path} is gone: run `jbench setup`"
    return (f"model file {path} not found (model '{model.name}' {model.quant}): fix model.files.{model.quant} or "
            f"model.path_template")


def resolve_model_file(section: ModelSection) -> tuple[str, dict]:
    """Path (on the device) of the trial's model file, and facts to tag the run with.

    Raises ModelError naming the fix when the file is not known.
    """
    model = typed(ModelConfig, section, where="model")
    quant, name = model.quant, model.name
    if model.source == "bundled":
        entry = load_manifest(name).get("files", {}).get(quant)
        if not entry or not os.path.exists(entry["path"]):
            if quant not in model.ladder and quant != model.source_quant:
                raise ModelError(
                    f"model '{name}' has no {quant} file: jbench setup derives only "
                    f"{', '.join(model.ladder)}. Add {quant} to model.ladder and run `jbench setup`."
                )
            raise ModelError(f"model '{name}' {quant} is not installed: run `jbench setup`")
        # model.sha256 is always the file benchmarked (here: recorded by `jbench setup` when it made the file).
        facts = {"model.sha256": entry["sha256"], "model.file": entry["path"]}
        if entry.get("requantized_from"):
            facts["model.requantized_from"] = entry["requantized_from"]
            facts["model.quality_note"] = (
                f"requantized from {entry['requantized_from']}: speed is real, quality is not a finding"
            )
        return entry["path"], facts
    if quant in model.files:
        return model.files[quant], {"model.file": model.files[quant]}
    if model.path_template:
        path = model.path_template.replace("{quant}", quant)
        return path, {"model.file": path}
    known = ", ".join(sorted(model.files)) or "none"
    raise ModelError(
        f"model '{name}' has no file for quant {quant} (known: {known}). "
        f"Set model.files.{quant}=/path/on/device.gguf or model.path_template"
    )
