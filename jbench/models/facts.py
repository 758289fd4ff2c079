"""Facts about a model file, read from its GGUF header once and cached across processes.

Every jbench process that plans or analyses a sweep needs the same few facts about each model
file: architecture, layer and head counts, head dimensions, context length, sliding-window layout,
tied embeddings, file type, and the tensor table the roofline sums. Reading them means walking a
header that holds the whole vocabulary (262k strings for Gemma 3), so they are kept on disk and a
later process reads a small JSON file instead.

Public API
    model_facts(path) -> ModelFacts
        The facts of a local GGUF file. Served from memory, else from the on-disk cache, else
        from the header (jbench.models.gguf.read_header), which is then cached. Raises OSError
        when the file cannot be opened and GGUFMetaError when it is not a readable GGUF file.
    ModelFacts.kv_arch() -> dict
        What the sweep planner needs (jbench.models.gguf.kv_arch returns this): architecture,
        context_length, n_layer, n_embd, n_head, n_head_kv, head_dim, head_dim_v, file_type.
    ModelFacts.gguf_model() -> jbench.models.types.GGUFModel
        What the roofline needs: ModelArch (with sliding-window layers), tensor table, file type.
    read_gguf_header(path) -> GGUFModel
        model_facts(path).gguf_model(), with every failure raised as RooflineError naming the file.
    read_gguf(path | gguf.GGUFReader) -> GGUFModel
        The same model through the gguf package's own (slow) reader; the tests compare the two.
    clear_memory_cache()
        Forget what this process memoized (the on-disk cache is kept).

This module is the one place where GGUF metadata keys (`<arch>.block_count`,
`<arch>.attention.head_count_kv`, ...) are turned into model facts; jbench.analysis.roofline works
on the facts only.

The cache: one JSON file per model path under jbench.paths.cache_dir()/model-facts/, named by a
hash of the absolute path and holding {"version", "path", "size", "mtime_ns", "metadata",
"tensors"}. An entry is used only when version, path, size and mtime_ns all match the file as it
is now; anything else (a changed or replaced file, an older jbench, a corrupt or truncated cache
file) is a miss: the header is read again and the entry rewritten (atomically, by rename). The
cache keeps the raw metadata values the facts come from (general.architecture, general.name,
general.file_type, every `<arch>.*` key, the vocabulary length) rather than the derived numbers, so
a cached read validates and fails exactly like a fresh one. A cache directory that cannot be
written only costs speed. Set JBENCH_FACTS_CACHE=0 to bypass the on-disk cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import numbers
import os
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

from jbench.core import paths
from jbench.models import gguf as _gguf
from jbench.models.gguf import GGUFMetaError

from jbench.models.types import (OUTPUT_TENSOR, SWA_DEFAULT_WINDOW, SWA_PATTERNS, TOKEN_EMBD_TENSOR, GGUFModel, ModelArch, RooflineError, TensorInfo,
                                 ggml_type, swa_layers_from_pattern, tensor_bytes)

if TYPE_CHECKING:
    from gguf import GGUFReader


log = logging.getLogger("jbench")

# Bump when the cached layout or the set of cached keys changes: older entries are then rewritten.
FACTS_VERSION = 1

_VOCAB_KEY = "tokenizer.ggml.tokens"
_GENERAL_KEYS = ("general.architecture", "general.name", "general.file_type")
# Arrays up to this length keep their values (as jbench.models.gguf does); longer ones their length.
_SMALL_ARRAY = 4096

Tensor = tuple[str, tuple[int, ...], int]  # name, dims in ggml order (ne0 first), ggml type id


def _wanted(key: str, arch: Optional[str]) -> bool:
    """The metadata keys the facts are derived from (and the cache keeps)."""
    if key in _GENERAL_KEYS or key == f"{_VOCAB_KEY}.__len__":
        return True
    return bool(arch) and key.startswith(f"{arch}.")


def select_metadata(values: dict[str, Any]) -> dict[str, Any]:
    """The subset of a header's metadata (jbench.models.gguf.header's form) that facts use."""
    arch = values.get("general.architecture")
    arch = arch if isinstance(arch, str) else None
    return {k: v for k, v in values.items() if _wanted(k, arch)}


@dataclass(frozen=True)
class ModelFacts:
    """A model file's identity, the metadata its facts come from, and its tensor table.

    metadata uses jbench.models.gguf.header's form: scalars and strings as values, arrays of up
    to 4096 scalars as lists, every array's length as `<key>.__len__`.
    """

    path: str
    size: int
    mtime_ns: int
    metadata: dict[str, Any]
    tensors: tuple[Tensor, ...]

    # ---- raw access -----------------------------------------------------------------------

    @property
    def architecture(self) -> Optional[str]:
        value = self.metadata.get("general.architecture")
        return value if isinstance(value, str) and value else None

    @property
    def name(self) -> Optional[str]:
        value = self.metadata.get("general.name")
        return value if isinstance(value, str) else None

    @property
    def file_type(self) -> Optional[int]:
        """general.file_type: a llama.cpp LlamaFileType id (15 = Q4_K_M)."""
        value = self.metadata.get("general.file_type")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def file_type_name(self) -> Optional[str]:
        return file_type_name(self.file_type)

    @property
    def tensor_names(self) -> frozenset[str]:
        return frozenset(t[0] for t in self.tensors)

    @property
    def tied_embeddings(self) -> bool:
        """No separate LM head: output.weight absent, the embedding table serves as the head."""
        return OUTPUT_TENSOR not in self.tensor_names

    def _arch_or_raise(self) -> str:
        arch = self.architecture
        if not arch:
            raise GGUFMetaError(f"{self.path}: missing metadata key 'general.architecture'")
        return arch

    def _key(self, suffix: str) -> str:
        return f"{self._arch_or_raise()}.{suffix}"

    def _require(self, suffix: str) -> Any:
        key = self._key(suffix)
        if key not in self.metadata:
            raise GGUFMetaError(f"{self.path}: missing metadata key '{key}'")
        return self.metadata[key]

    def _as_int(self, key: str, value: object) -> int:
        if isinstance(value, list):
            # Per-layer values (hybrid models, OpenELM): the flat formulas do not apply.
            raise GGUFMetaError(f"{self.path}: metadata key '{key}' holds per-layer values; not supported")
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise GGUFMetaError(f"{self.path}: metadata key '{key}' is not an integer: {value!r}")
        return int(value)

    def _require_int(self, suffix: str) -> int:
        return self._as_int(self._key(suffix), self._require(suffix))

    def _optional_int(self, key: str) -> Optional[int]:
        return self._as_int(key, self.metadata[key]) if key in self.metadata else None

    # ---- what the planner needs ------------------------------------------------------------

    def kv_arch(self) -> dict[str, Any]:
        """architecture, context_length, n_layer, n_embd, n_head, n_head_kv (default n_head),
        head_dim (key_length, default n_embd / n_head), head_dim_v (value_length, default
        head_dim), file_type. Raises GGUFMetaError naming a missing key."""
        arch = self._arch_or_raise()
        meta = self.metadata
        n_embd, n_head = self._require("embedding_length"), self._require("attention.head_count")
        head_dim = meta.get(f"{arch}.attention.key_length", n_embd // n_head if n_head else None)
        return {
            "architecture": arch,
            "context_length": self._require("context_length"),
            "n_layer": self._require("block_count"),
            "n_embd": n_embd,
            "n_head": n_head,
            "n_head_kv": meta.get(f"{arch}.attention.head_count_kv", n_head),
            "head_dim": head_dim,
            "head_dim_v": meta.get(f"{arch}.attention.value_length", head_dim),
            "file_type": meta.get("general.file_type"),
        }

    # ---- what the roofline needs -----------------------------------------------------------

    def vocab_size(self) -> Optional[int]:
        """<arch>.vocab_size, else the token list's length, else the embedding table's rows."""
        vocab = self._optional_int(self._key("vocab_size"))
        if vocab is None:
            vocab = self.metadata.get(f"{_VOCAB_KEY}.__len__")
        if vocab is None:
            for name, dims, _ in self.tensors:
                if name == TOKEN_EMBD_TENSOR and len(dims) >= 2:
                    vocab = dims[1]
                    break
        return vocab

    def model_arch(self) -> tuple["ModelArch", tuple[str, ...]]:
        """The roofline's ModelArch, and notes on what it could not model. Stricter than kv_arch:
        every count must be a single integer and head_count_kv and feed_forward_length present."""

        arch_name = self._arch_or_raise()
        n_layer = self._require_int("block_count")
        n_embd = self._require_int("embedding_length")
        n_head = self._require_int("attention.head_count")
        n_head_kv = self._require_int("attention.head_count_kv")
        head_dim = self._optional_int(self._key("attention.key_length"))
        if head_dim is None:
            head_dim = n_embd // n_head  # llama.cpp's default when key_length is absent
        head_dim_v = self._optional_int(self._key("attention.value_length"))
        n_ff = self._require_int("feed_forward_length")
        vocab = self.vocab_size()
        if not vocab:
            raise GGUFMetaError(
                f"{self.path}: missing metadata key '{_VOCAB_KEY}' (and no '{self._key('vocab_size')}' "
                f"or {TOKEN_EMBD_TENSOR} to take the vocabulary size from)"
            )

        notes: list[str] = []
        window = self._optional_int(self._key("attention.sliding_window"))
        if window is None:
            window = SWA_DEFAULT_WINDOW.get(arch_name)
        swa_layers: tuple[int, ...] = ()
        if window:
            pattern = self.metadata.get(self._key("attention.sliding_window_pattern"))
            if isinstance(pattern, list):
                swa_layers = tuple(i for i, sliding in enumerate(pattern[:n_layer]) if sliding)
            elif isinstance(pattern, numbers.Integral) and not isinstance(pattern, bool):
                swa_layers = swa_layers_from_pattern(n_layer, int(pattern))
            elif arch_name in SWA_PATTERNS:
                swa_layers = swa_layers_from_pattern(n_layer, SWA_PATTERNS[arch_name])
            else:
                notes.append(
                    f"sliding window {window} present but the layer pattern of '{arch_name}' is unknown: "
                    "every layer counted as full attention (upper bound)"
                )
        if any("_exps" in name for name, _, _ in self.tensors):
            notes.append("mixture-of-experts tensors counted in full (upper bound: only routed experts are read)")
        arch = ModelArch(
            n_layer=n_layer,
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            head_dim_v=head_dim_v,
            n_ff=n_ff,
            vocab_size=int(vocab),
            tied_embeddings=self.tied_embeddings,
            sliding_window=window if swa_layers else None,
            swa_layers=swa_layers,
        )
        return arch, tuple(notes)

    def tensor_infos(self) -> tuple["TensorInfo", ...]:
        """The tensor table with exact byte sizes (from the gguf package's block sizes)."""

        out = []
        for name, dims, type_id in self.tensors:
            n = math.prod(dims)
            out.append(TensorInfo(name=name, ggml_type=ggml_type(type_id), shape=tuple(dims), n_elements=n,
                                  n_bytes=tensor_bytes(type_id, n)))
        return tuple(out)

    def gguf_model(self, tensors: Optional[tuple["TensorInfo", ...]] = None) -> "GGUFModel":
        """The roofline's view of the file (tensors: a table read elsewhere, else this one's).
        Raises GGUFMetaError naming a missing or malformed key."""

        arch, notes = self.model_arch()
        file_type = self._optional_int("general.file_type")
        return GGUFModel(
            path=self.path,
            architecture=self._arch_or_raise(),
            arch=arch,
            tensors=self.tensor_infos() if tensors is None else tensors,
            file_type=file_type,
            file_type_name=file_type_name(file_type),
            name=self.name,
            notes=notes,
        )

    # ---- cache form ------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {"version": FACTS_VERSION, "path": self.path, "size": self.size, "mtime_ns": self.mtime_ns,
                "metadata": self.metadata, "tensors": [[n, list(d), t] for n, d, t in self.tensors]}

    @classmethod
    def from_json(cls, data: Any) -> "ModelFacts":
        """Raises ValueError (or TypeError, KeyError) for anything but a current-version entry."""
        if not isinstance(data, dict) or data.get("version") != FACTS_VERSION:
            raise ValueError("not a current model-facts entry")
        metadata = data["metadata"]
        if not isinstance(metadata, dict):
            raise ValueError("metadata is not a mapping")
        tensors = []
        for name, dims, type_id in data["tensors"]:
            if not isinstance(name, str) or not isinstance(type_id, int) or not all(isinstance(d, int) for d in dims):
                raise ValueError("malformed tensor entry")
            tensors.append((name, tuple(dims), type_id))
        size, mtime_ns, path = data["size"], data["mtime_ns"], data["path"]
        if not isinstance(size, int) or not isinstance(mtime_ns, int) or not isinstance(path, str):
            raise ValueError("malformed file identity")
        return cls(path=path, size=size, mtime_ns=mtime_ns, metadata=metadata, tensors=tuple(tensors))


def file_type_name(file_type: Optional[int]) -> Optional[str]:
    """"Q4_K_M", "F16", ... for a general.file_type id; None when absent or unknown."""
    if file_type is None:
        return None
    from gguf import LlamaFileType

    try:
        member = LlamaFileType(file_type)
    except ValueError:
        return None
    return member.name.replace("MOSTLY_", "").replace("ALL_", "")


# --------------------------------------------------------------------------------------------
# The cache


def cache_root() -> Path:
    return paths.cache_dir() / "model-facts"


def _cache_file(abspath: str) -> Path:
    return cache_root() / (hashlib.sha256(abspath.encode("utf-8", "surrogateescape")).hexdigest()[:32] + ".json")


def _disk_cache_enabled() -> bool:
    return os.environ.get("JBENCH_FACTS_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def _load_entry(abspath: str, size: int, mtime_ns: int) -> Optional[ModelFacts]:
    try:
        with open(_cache_file(abspath), "rb") as f:
            facts = ModelFacts.from_json(json.loads(f.read()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as exc:  # corrupt, truncated, older layout
        log.debug("model-facts cache entry for %s ignored: %s", abspath, exc)
        return None
    if (facts.path, facts.size, facts.mtime_ns) != (abspath, size, mtime_ns):
        return None
    return facts


def _store_entry(facts: ModelFacts) -> None:
    target = _cache_file(facts.path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(facts.to_json(), f, separators=(",", ":"))
            os.replace(tmp, target)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
    except (OSError, TypeError, ValueError) as exc:  # read-only cache dir, a value JSON cannot hold
        log.debug("model-facts cache not written for %s: %s", facts.path, exc)


@lru_cache(maxsize=256)
def _facts(abspath: str, size: int, mtime_ns: int) -> ModelFacts:
    use_disk = _disk_cache_enabled()
    if use_disk:
        cached = _load_entry(abspath, size, mtime_ns)
        if cached is not None:
            return cached
    values, tensors = _gguf.read_header(abspath)
    facts = ModelFacts(path=abspath, size=size, mtime_ns=mtime_ns, metadata=select_metadata(values),
                       tensors=tuple(tensors))
    if use_disk:
        _store_entry(facts)
    return facts


def model_facts(path: Union[str, os.PathLike]) -> ModelFacts:
    """The facts of a local GGUF file, reading its header only when no cache entry matches its
    current (absolute path, size, mtime_ns). Raises OSError (no such file, unreadable) or
    GGUFMetaError (not a GGUF file, corrupt header)."""
    abspath = os.path.abspath(os.fspath(path))
    st = os.stat(abspath)
    return _facts(abspath, st.st_size, st.st_mtime_ns)


def clear_memory_cache() -> None:
    """Forget this process's memoized facts (the on-disk cache stays)."""
    _facts.cache_clear()
    _gguf._header_cached.cache_clear()


# --------------------------------------------------------------------------------------------
# GGUFModel for the roofline


def read_gguf_header(path: Union[str, os.PathLike]) -> "GGUFModel":
    """Architecture and tensor table of a GGUF file from its (cached) header facts: the same model
    as read_gguf in milliseconds. Raises RooflineError naming the file, key or value."""

    path_str = os.fspath(path)
    try:
        facts = model_facts(path_str)
    except (GGUFMetaError, OSError) as exc:
        raise RooflineError(f"cannot read GGUF file '{path_str}': {exc}") from exc
    try:
        return facts.gguf_model()
    except GGUFMetaError as exc:
        raise RooflineError(str(exc)) from None


def _reader_metadata(reader: "GGUFReader") -> dict[str, Any]:
    """The facts' metadata keys from a gguf.GGUFReader, in jbench.models.gguf.header's form."""
    from gguf import GGUFValueType

    fields = reader.fields
    arch_field = fields.get("general.architecture")
    arch = None
    if arch_field is not None and list(arch_field.types) == [GGUFValueType.STRING]:
        arch = bytes(arch_field.parts[arch_field.data[0]]).decode("utf-8", errors="replace")
    out: dict[str, Any] = {}

    def one(vtype: GGUFValueType, part: Any) -> Any:
        if vtype == GGUFValueType.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        value = part[0]
        if vtype == GGUFValueType.BOOL:
            return bool(value)
        if vtype in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
            return float(value)
        return int(value)

    for key, field in fields.items():
        types = list(field.types)
        if not types:
            continue
        if types[0] == GGUFValueType.ARRAY:
            if not _wanted(f"{key}.__len__", arch):
                continue
            out[f"{key}.__len__"] = len(field.data)
            scalar = len(types) > 1 and types[1] not in (GGUFValueType.ARRAY, GGUFValueType.STRING)
            if scalar and len(field.data) <= _SMALL_ARRAY:
                out[key] = [one(types[1], field.parts[i]) for i in field.data]
        elif _wanted(key, arch):
            out[key] = one(types[0], field.parts[field.data[0]])
    return out


def read_gguf(path: Union[str, os.PathLike, "GGUFReader"]) -> "GGUFModel":
    """read_gguf_header through the gguf package's GGUFReader instead of jbench's header walk
    (tensor data memory-mapped, never read; byte sizes as the reader reports them). Slow on big
    vocabularies (GGUFReader takes ~15 s on 262k tokens) and uncached: for tests and
    cross-checks. Also takes an open GGUFReader, so a caller that has one does not parse twice."""
    from gguf import GGUFReader


    if isinstance(path, GGUFReader):
        reader = path
        path_str = str(getattr(getattr(reader, "data", None), "filename", None) or "<GGUFReader>")
    else:
        path_str = os.fspath(path)
        try:
            reader = GGUFReader(path_str, "r")
        except Exception as exc:  # OSError, ValueError, struct/numpy errors... depending on the damage
            raise RooflineError(f"cannot read GGUF file '{path_str}': {type(exc).__name__}: {exc}") from exc
    tensors = tuple(
        TensorInfo(name=str(t.name), ggml_type=ggml_type(int(t.tensor_type)), shape=tuple(int(d) for d in t.shape),
                   n_elements=int(t.n_elements), n_bytes=int(t.n_bytes))
        for t in reader.tensors
    )
    facts = ModelFacts(path=path_str, size=0, mtime_ns=0, metadata=_reader_metadata(reader),
                       tensors=tuple((t.name, t.shape, int(t.ggml_type)) for t in tensors))
    try:
        return facts.gguf_model(tensors)
    except GGUFMetaError as exc:
        raise RooflineError(str(exc)) from None


__all__ = [
    "FACTS_VERSION",
    "GGUFMetaError",
    "ModelFacts",
    "OUTPUT_TENSOR",
    "SWA_DEFAULT_WINDOW",
    "SWA_PATTERNS",
    "TOKEN_EMBD_TENSOR",
    "cache_root",
    "clear_memory_cache",
    "file_type_name",
    "model_facts",
    "read_gguf",
    "read_gguf_header",
    "select_metadata",
]
