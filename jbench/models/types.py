"""The types a model is described by: its architecture (ModelArch), its GGUF tensor table (TensorInfo, GGUFModel),
ggml type sizes, and the GGUF names and llama.cpp facts the weight rules need. A leaf: the file readers
(jbench.models.facts) build these, the roofline (jbench.analysis.roofline) computes over them.

Block sizes and type ids come from the `gguf` package (GGML_QUANT_SIZES, GGMLQuantizationType), never from a
hand-made table.
"""

from __future__ import annotations

import numbers
import re
from dataclasses import dataclass
from typing import Optional, Union

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

GGMLType = Union[int, str, GGMLQuantizationType]

TOKEN_EMBD_TENSOR = "token_embd.weight"
OUTPUT_TENSOR = "output.weight"

# Which layers slide, for architectures whose GGUF does not say (llama.cpp hard-codes these in
# llama-model.cpp via hparams.set_swa_pattern(n): layer il slides iff il % n < n - 1, i.e. every
# n-th layer is full attention).
SWA_PATTERNS: dict[str, int] = {"gemma2": 2, "gemma3": 6, "cohere2": 4}
# Gemma 2 GGUFs may omit the window; llama.cpp then uses 4096.
SWA_DEFAULT_WINDOW: dict[str, int] = {"gemma2": 4096}

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")


class RooflineError(ValueError):
    """Inputs the roofline cannot be computed from; the message names the file, key or value."""


def ggml_type(t: GGMLType) -> GGMLQuantizationType:
    """The ggml type for an id (12), a name ("Q4_K", "q8_0") or the enum member itself."""
    if isinstance(t, GGMLQuantizationType):
        return t
    if isinstance(t, numbers.Integral) and not isinstance(t, bool):
        try:
            return GGMLQuantizationType(int(t))
        except ValueError:
            raise RooflineError(f"unknown ggml type id {int(t)}") from None
    if isinstance(t, str):
        name = t.strip().upper()
        if name.isdigit():
            return ggml_type(int(name))
        try:
            return GGMLQuantizationType[name]
        except KeyError:
            known = ", ".join(m.name for m in GGMLQuantizationType)
            raise RooflineError(f"unknown ggml type '{t}'. Known: {known}") from None
    raise RooflineError(f"not a ggml type: {t!r}")


def _quant_size(t: GGMLType) -> tuple[int, int]:
    qt = ggml_type(t)
    if qt not in GGML_QUANT_SIZES:
        raise RooflineError(f"gguf has no block size for ggml type {qt.name}")
    block_size, type_size = GGML_QUANT_SIZES[qt]
    return int(block_size), int(type_size)


def bytes_per_weight(t: GGMLType) -> float:
    """Bytes per element including block scales: type_size / block_size (Q4_K: 144/256 = 0.5625)."""
    block_size, type_size = _quant_size(t)
    return type_size / block_size


def tensor_bytes(t: GGMLType, n_elements: int) -> int:
    """Exact bytes of n_elements stored as type t; ggml stores whole blocks only."""
    block_size, type_size = _quant_size(t)
    n = int(n_elements)
    if n < 0:
        raise RooflineError(f"negative element count {n}")
    if n % block_size:
        raise RooflineError(
            f"{n} elements is not a whole number of {ggml_type(t).name} blocks ({block_size} per block)"
        )
    return n // block_size * type_size


@dataclass(frozen=True, kw_only=True)
class ModelArch:
    """What the roofline needs to know about a decoder-only transformer.

    head_dim is the key length per head; head_dim_v the value length (defaults to head_dim).
    sliding_window / swa_layers describe interleaved sliding-window attention: the indices of the
    layers that attend only to the last `sliding_window` tokens (empty: every layer is full attention).
    """

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    head_dim_v: Optional[int] = None
    n_ff: int
    vocab_size: int
    tied_embeddings: bool = False
    sliding_window: Optional[int] = None
    swa_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        for name in ("n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "head_dim_v", "n_ff", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
                raise RooflineError(f"ModelArch.{name} must be a positive integer, got {value!r}")
        layers = tuple(sorted(set(int(i) for i in self.swa_layers)))
        object.__setattr__(self, "swa_layers", layers)
        if layers:
            if not self.sliding_window or self.sliding_window <= 0:
                raise RooflineError("ModelArch.swa_layers given without a positive sliding_window")
            if layers[0] < 0 or layers[-1] >= self.n_layer:
                raise RooflineError(f"ModelArch.swa_layers out of range 0..{self.n_layer - 1}: {layers}")

    @property
    def n_swa_layers(self) -> int:
        return len(self.swa_layers)

    @property
    def n_full_layers(self) -> int:
        return self.n_layer - len(self.swa_layers)

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        sliding = set(self.swa_layers)
        return tuple(i for i in range(self.n_layer) if i not in sliding)


def swa_layers_from_pattern(n_layer: int, pattern: int) -> tuple[int, ...]:
    """llama.cpp's set_swa_pattern(n): layer il slides iff il % n < n - 1 (every n-th is full)."""
    if pattern <= 0:
        return tuple(range(n_layer))
    return tuple(il for il in range(n_layer) if il % pattern < pattern - 1)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the table. shape is in ggml order (ne0 first: ne0 is the row length)."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int

    @property
    def type_name(self) -> str:
        return self.ggml_type.name

    @property
    def is_matrix(self) -> bool:
        # Norms and biases are 1-D; a weight matrix has at least two dimensions larger than one.
        return sum(1 for d in self.shape if d > 1) >= 2

    @property
    def block(self) -> Optional[int]:
        m = _BLOCK_RE.match(self.name)
        return int(m.group(1)) if m else None


@dataclass(frozen=True)
class GGUFModel:
    """A GGUF file's architecture and tensor table (no tensor data)."""

    path: str
    architecture: str  # general.architecture, e.g. "gemma3"
    arch: ModelArch
    tensors: tuple[TensorInfo, ...]
    file_type: Optional[int]  # general.file_type (a llama.cpp LlamaFileType id)
    file_type_name: Optional[str]  # "Q4_K_M", "F16", ...; None when absent or unknown
    name: Optional[str] = None  # general.name
    notes: tuple[str, ...] = ()

    def tensor(self, name: str) -> Optional[TensorInfo]:
        for t in self.tensors:
            if t.name == name:
                return t
        return None

    @property
    def tensor_bytes(self) -> int:
        """Bytes of all tensors: the model's resident size (what must fit in RAM)."""
        return sum(t.n_bytes for t in self.tensors)

    @property
    def type_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t in self.tensors:
            counts[t.type_name] = counts.get(t.type_name, 0) + 1
        return counts
