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
from jbench.models.gguf import GGUFMetaError, data_end


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


def borrows_bundled_name(section: ModelSection, entry: Optional[str]) -> bool:
    """True when a model section benchmarks the user's own file under a bundled model's name: model.source=files on
    a bundled entry (its package still set) whose name the user did not change (`model=gemma3_270m
    model.source=files model.path_template=/models/llama-1b.gguf`). Recorded as is, another model's figures would
    be filed under the bundled model's name. entry: the model group option the config was composed from."""
    model = typed(ModelConfig, section, where="model")
    return model.source == "files" and bool(model.package) and model.name == entry


def name_from_file(path: str) -> Optional[tuple[str, str]]:
    """(model name, display name) read from a local GGUF file: its general.name ("Llama 3.2 1B" ->
    "llama_3_2_1b"), else its architecture and parameter count from the tensor table ("llama 1.24B"); None when
    the file is not a readable GGUF file here."""
    import math
    import re

    from jbench.models.facts import model_facts
    try:
        facts = model_facts(path)
    except (OSError, GGUFMetaError):
        return None
    display = (facts.name or "").strip()
    if not display:
        if not facts.architecture:
            return None
        params = sum(math.prod(dims) for _name, dims, _type in facts.tensors)
        size = f"{params / 1e9:.3g}B" if params >= 1e9 else f"{params / 1e6:.3g}M"
        display = f"{facts.architecture} {size}"
    name = re.sub(r"[^a-z0-9]+", "_", display.lower()).strip("_")
    return (name, display) if name else None


def same_model_name(a: str, b: str) -> bool:
    """Two spellings of one model name ("gemma3_270m", "Gemma 3 270m"): equal letters and digits, case aside."""
    def key(text: str) -> str:
        return "".join(ch for ch in text.lower() if ch.isalnum())

    return key(a) == key(b)


def local_file_problem(section: ModelSection, *, gguf: bool = False) -> Optional[str]:
    """Why the trial's model file is missing on this machine, or with gguf (a backend that loads GGUF files) not a
    whole GGUF file (gguf_file_problem); None when it is fine, or not resolvable: the backend's validation reports
    that."""
    model = typed(ModelConfig, section, where="model")
    try:
        path, _ = resolve_model_file(model)
    except ModelError:
        return None
    fix = "run `jbench setup`" if model.source == "bundled" else f"fix model.files.{model.quant} or model.path_template"
    local = os.path.expanduser(path)
    if os.path.exists(local):
        problem = gguf_file_problem(local) if gguf else None
        return f"model '{model.name}' {model.quant}: {path} {problem}; {fix}" if problem else None
    if model.source == "bundled":
        return f"model '{model.name}' {model.quant}: {path} is gone: run `jbench setup`"
    return f"model file {path} not found (model '{model.name}' {model.quant}): {fix}"


def gguf_file_problem(path: str) -> Optional[str]:
    """Why the local file at path cannot be the GGUF model a backend loads (a phrase: "is a directory", "is empty",
    "is not a GGUF file", "is truncated: ..."), or None. Reads the header only (cached by path, size and mtime)."""
    if os.path.isdir(path):
        return "is a directory, not a GGUF file"
    try:
        size = os.path.getsize(path)
        if size == 0:
            return "is empty (0 bytes)"
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return "is not a GGUF file (it does not start with the GGUF magic bytes)"
        end = data_end(path)
    except GGUFMetaError as exc:
        return f"is truncated or corrupt: {exc}"
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if end is not None and size < end:
        return (f"is truncated: its header describes {end} bytes, the file has {size} "
                "(an interrupted download or copy?)")
    return None


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
                f"requantized from {entry['requantized_from']}: speed and memory are real; quality figures measure "
                "requantization loss against the sweep's reference, not quality against the original weights"
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
