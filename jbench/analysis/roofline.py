"""Decode roofline: bytes and FLOPs per decoded token, and the tok/s ceiling they imply.

Batch-1 decode is a chain of GEMVs: every weight byte is read from DRAM once per token for about
2 FLOPs, far below any GPU's ridge point, so

    decode ceiling (tok/s) = achievable bandwidth (B/s) / bytes read per token
    bytes read per token   = weight bytes touched per token + KV-cache bytes read at depth D

Pure functions only: no device, no MLflow, no file reading: a model file's facts (architecture,
tensor table) come from jbench.models.facts (`read_gguf_header(path)` gives the GGUFModel used here,
cached across processes). Every block size and type size comes from the `gguf`
package (`GGMLQuantizationType`, `GGML_QUANT_SIZES`), never from a hand-made table, and weight bytes
of a real model come from its tensor table, never from per-layer rules of thumb.

Weight rules (`weight_bytes_per_token`):
  * every tensor except the token-embedding table is read once per token: the per-layer matrices,
    the LM head (`output.weight`), and the small 1-D tensors (norms, biases), which are counted too;
  * `token_embd.weight` is only gathered: one row (n_embd elements at its type) per token;
  * unless there is no separate `output.weight` (LM head tied to the embedding table): then the whole
    table is read for the LM head, plus the gathered row.

Sliding-window attention (Gemma 2/3, Cohere 2): interleaved layers attend to the last `window` tokens
only. `kv_bytes_per_token` is the full-attention figure (every layer, every token of context), which
is what the domain formula states and an upper bound for such models. `kv_bytes_at_depth` reports
both that figure and a sliding-window-aware one, in which a sliding layer reads
min(depth, window + swa_slack) tokens of cache. llama.cpp's default (iSWA) cache keeps window + n_ubatch
cells for those layers (padded to 256), and its attention may read all the cells it keeps, so the
true figure lies between swa_slack=0 (lower bound) and swa_slack=n_ubatch; with `--swa-full` the
sliding layers keep the whole context and the full-attention figure is the safer one. Which layers
slide: `<arch>.attention.sliding_window_pattern` when the file has it, else llama.cpp's hard-coded
pattern for the architecture (`SWA_PATTERNS`); an unknown pattern counts every layer as full
attention (an upper bound) and says so in the model's notes.

Not modelled: mixture-of-experts routing (expert tensors are counted in full, an upper bound; noted),
per-layer head counts (rejected with a RooflineError rather than guessed), activations and logits
traffic (small next to weights at batch 1), caches (a model far larger than L2 gets no help from it).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterable, Optional

from gguf import GGMLQuantizationType, LlamaFileType

# The model's types (architecture, tensor table, ggml sizes) live in the leaf module jbench.models.types, which
# both this module and the file readers (jbench.models.facts) import.
from jbench.models.types import (OUTPUT_TENSOR, SWA_DEFAULT_WINDOW, SWA_PATTERNS, TOKEN_EMBD_TENSOR, GGMLType,
                                 GGUFModel, ModelArch, RooflineError, TensorInfo, bytes_per_weight, ggml_type,
                                 swa_layers_from_pattern, tensor_bytes)

# Regime thresholds on measured / ceiling. At >= 70% of the bandwidth ceiling a runtime is about as
# fast as the memory allows (effective bandwidth is itself ~70-80% of the datasheet figure).
NEAR_ROOFLINE_FRACTION = 0.7
# 30-70%: still bandwidth-limited in shape, but bytes are being wasted (unfused kernels, stalls).
MEMORY_BOUND_FRACTION = 0.3
# Below 30%: something other than DRAM sets the pace (launch overhead, CPU fallback, parked clocks).
# Above 100% the bytes model or the bandwidth figure is wrong (or the model sits in a cache): a ceiling
# measured as the read rate of the compute path cannot be beaten.
ABOVE_CEILING_FRACTION = 1.0

LABEL_ABOVE_CEILING = "above ceiling (check bandwidth and bytes model)"
LABEL_NEAR_ROOFLINE = "near-roofline"
LABEL_MEMORY_BOUND = "memory-bound, below roofline"
LABEL_FAR_BELOW = "far below roofline (overheads)"


# llama.cpp file types whose dominant ggml type is not their own name with the _S/_M/_L size suffix
# dropped (the default_type switch in llama.cpp's llama-quant.cpp). Names only: sizes still come from
# GGML_QUANT_SIZES.
_FTYPE_DOMINANT_EXCEPTIONS: dict[str, str] = {
    "IQ2_S": "IQ2_XS",
    "IQ2_M": "IQ2_S",
    "IQ3_XS": "IQ3_S",
    "IQ3_M": "IQ3_S",
    "MXFP4_MOE": "MXFP4",
}

# --------------------------------------------------------------------------------------------
# Weight bytes per decoded token


@dataclass(frozen=True)
class WeightBytes:
    """Weight bytes read per decoded token, and where they come from.

    total = layer_matrices + layer_vectors + lm_head + token_embd_row + other.
    lm_head is output.weight, or the whole token-embedding table when the head is tied to it.
    other holds top-level tensors besides the two tables (output_norm, rope_freqs, ...).
    """

    total: int
    layer_matrices: int
    layer_vectors: int
    lm_head: int
    token_embd_row: int
    other: int
    per_layer: tuple[int, ...]
    tied_embeddings: bool
    lm_head_tensor: Optional[str]
    estimated: bool = False
    notes: tuple[str, ...] = ()


def _row_bytes(t: TensorInfo) -> int:
    """Bytes of one row (ne0 elements) of a table at its own type."""
    return tensor_bytes(t.ggml_type, t.shape[0])


def weight_bytes_per_token(model: GGUFModel) -> WeightBytes:
    """Sum the real tensor sizes under the decode rules (module docstring)."""
    layer_matrices = layer_vectors = other = 0
    per_layer = [0] * model.arch.n_layer
    embd = output = None
    for t in model.tensors:
        if t.name == TOKEN_EMBD_TENSOR:
            embd = t
            continue
        if t.name == OUTPUT_TENSOR:
            output = t
            continue
        block = t.block
        if block is None:
            other += t.n_bytes
            continue
        if t.is_matrix:
            layer_matrices += t.n_bytes
        else:
            layer_vectors += t.n_bytes
        if 0 <= block < len(per_layer):
            per_layer[block] += t.n_bytes
        else:  # a block index past block_count (e.g. a next-token-prediction layer): still read
            per_layer.extend([0] * (block + 1 - len(per_layer)))
            per_layer[block] += t.n_bytes

    notes = list(model.notes)
    token_row = _row_bytes(embd) if embd is not None else 0
    if output is not None:
        lm_head, lm_name = output.n_bytes, OUTPUT_TENSOR
    elif embd is not None:
        lm_head, lm_name = embd.n_bytes, TOKEN_EMBD_TENSOR  # tied: the whole table is the LM head
    else:
        lm_head, lm_name = 0, None
        notes.append(f"neither {OUTPUT_TENSOR} nor {TOKEN_EMBD_TENSOR} found: no LM head counted")

    total = layer_matrices + layer_vectors + lm_head + token_row + other
    return WeightBytes(
        total=total,
        layer_matrices=layer_matrices,
        layer_vectors=layer_vectors,
        lm_head=lm_head,
        token_embd_row=token_row,
        other=other,
        per_layer=tuple(per_layer),
        tied_embeddings=output is None,
        lm_head_tensor=lm_name,
        notes=tuple(notes),
    )


def file_bits_per_weight(model: GGUFModel) -> float:
    """8 x bytes / elements over every tensor of the file: its real bits per weight. A llama.cpp file type names
    only its dominant ggml type (Q4_0 and Q4_K_M both 4.5); the other tensors (embeddings, output, norms) keep their
    own types, so two files of one model differ here where their names' figure does not."""
    n_elements = sum(t.n_elements for t in model.tensors)
    if n_elements <= 0:
        raise RooflineError(f"{model.path}: no tensors, no bits per weight")
    return 8.0 * sum(t.n_bytes for t in model.tensors) / n_elements


def matmul_params(model: GGUFModel) -> int:
    """Weights multiplied per decoded token: every matrix but the embedding table, which joins in
    only as a tied LM head (a gathered row costs no FLOPs)."""
    tied = model.tensor(OUTPUT_TENSOR) is None
    total = 0
    for t in model.tensors:
        if not t.is_matrix:
            continue
        if t.name == TOKEN_EMBD_TENSOR and not tied:
            continue
        total += t.n_elements
    return total


def arch_matmul_params(arch: ModelArch) -> int:
    """Weights multiplied per token for a dense decoder: q, k, v, o, gate, up, down per layer plus
    the LM head (vocab x n_embd, whether or not it is tied)."""
    q = arch.n_embd * arch.n_head * arch.head_dim
    k = arch.n_embd * arch.n_head_kv * arch.head_dim
    v = arch.n_embd * arch.n_head_kv * arch.head_dim_v
    o = arch.n_head * arch.head_dim_v * arch.n_embd
    ffn = 3 * arch.n_embd * arch.n_ff
    return arch.n_layer * (q + k + v + o + ffn) + arch.vocab_size * arch.n_embd


# --------------------------------------------------------------------------------------------
# KV cache


def kv_bytes_per_token_per_layer(arch: ModelArch, kv_type_k: GGMLType = "f16", kv_type_v: GGMLType = "f16") -> float:
    """K and V bytes one layer stores per token of context."""
    return arch.n_head_kv * (arch.head_dim * bytes_per_weight(kv_type_k) + arch.head_dim_v * bytes_per_weight(kv_type_v))


def kv_bytes_per_token(arch: ModelArch, kv_type_k: GGMLType = "f16", kv_type_v: GGMLType = "f16") -> float:
    """Full-attention KV bytes per token of context: 2 (K, V) x n_layer x n_head_kv x head_dim x bytes/elt.

    Every layer counted, sliding or not (see kv_bytes_at_depth for the sliding-window-aware figure).
    """
    return arch.n_layer * kv_bytes_per_token_per_layer(arch, kv_type_k, kv_type_v)


def _layer_token_reads(arch: ModelArch, depth: int, swa_aware: bool, swa_slack: int) -> int:
    """Sum over layers of the context tokens each layer reads at this depth."""
    if depth < 0:
        raise RooflineError(f"depth must be >= 0, got {depth}")
    if not swa_aware or not arch.swa_layers:
        return arch.n_layer * depth
    window = int(arch.sliding_window or 0) + max(0, int(swa_slack))
    return arch.n_full_layers * depth + arch.n_swa_layers * min(depth, window)


@dataclass(frozen=True)
class KVBytes:
    """KV-cache bytes read per decoded token at a context depth.

    full_attention: every layer reads `depth` tokens (kv_bytes_per_token x depth; upper bound).
    swa_aware: sliding layers read min(depth, sliding_window + swa_slack) tokens; equal to
    full_attention for a model without sliding-window layers.
    """

    depth: int
    per_token_full: float
    full_attention: float
    swa_aware: float
    n_swa_layers: int
    sliding_window: Optional[int]
    swa_slack: int


def kv_bytes_at_depth(
    arch: ModelArch,
    depth: int,
    kv_type_k: GGMLType = "f16",
    kv_type_v: GGMLType = "f16",
    *,
    swa_slack: int = 0,
) -> KVBytes:
    per_layer = kv_bytes_per_token_per_layer(arch, kv_type_k, kv_type_v)
    return KVBytes(
        depth=depth,
        per_token_full=arch.n_layer * per_layer,
        full_attention=per_layer * _layer_token_reads(arch, depth, False, swa_slack),
        swa_aware=per_layer * _layer_token_reads(arch, depth, True, swa_slack),
        n_swa_layers=arch.n_swa_layers,
        sliding_window=arch.sliding_window,
        swa_slack=swa_slack,
    )


# --------------------------------------------------------------------------------------------
# FLOPs


def flops_per_token(
    arch: ModelArch,
    depth: int = 0,
    *,
    matmul_params: Optional[int] = None,
    swa_aware: bool = True,
    swa_slack: int = 0,
) -> float:
    """FLOPs per decoded token:

        2 x P  +  2 x n_head x (head_dim + head_dim_v) x sum over layers of tokens read

    P is the number of weights multiplied (matmul_params(model) for a GGUF, else arch_matmul_params):
    one multiply-add per weight. Attention at depth D: per layer and query head, q.k over D keys
    (2 x head_dim x D) and the weighted sum of D values (2 x head_dim_v x D); a sliding layer reads
    min(D, window + swa_slack) tokens when swa_aware. Softmax, norms and activations are ignored.
    """
    params = arch_matmul_params(arch) if matmul_params is None else int(matmul_params)
    reads = _layer_token_reads(arch, depth, swa_aware, swa_slack)
    return 2.0 * params + 2.0 * arch.n_head * (arch.head_dim + arch.head_dim_v) * reads


# --------------------------------------------------------------------------------------------
# Ceiling and regime


@dataclass(frozen=True)
class RooflineResult:
    """The bandwidth ceiling of decode at one context depth.

    arithmetic_intensity is flops_per_token / bytes_per_token (FLOP/byte), None when FLOPs are unknown.
    """

    weight_bytes: float
    kv_bytes: float
    bytes_per_token: float
    depth: int
    bandwidth_bytes_per_s: float
    ceiling_tps: float
    flops_per_token: Optional[float] = None
    arithmetic_intensity: Optional[float] = None
    estimated: bool = False
    notes: tuple[str, ...] = ()

    @property
    def ms_per_token(self) -> float:
        return 1000.0 / self.ceiling_tps

    def regime(self, measured_tps: float) -> str:
        return regime_label(measured_tps, self.ceiling_tps)


def decode_ceiling(
    weight_bytes: float,
    kv_bytes_per_token: float,
    depth: int,
    bandwidth_bytes_per_s: float,
    *,
    kv_bytes_read: Optional[float] = None,
    flops_per_token: Optional[float] = None,
    estimated: bool = False,
    notes: Iterable[str] = (),
) -> RooflineResult:
    """Ceiling tok/s = bandwidth / (weight_bytes + kv_bytes_per_token x depth).

    kv_bytes_read, when given, replaces kv_bytes_per_token x depth (e.g. KVBytes.swa_aware for a
    sliding-window model, whose layers do not all read `depth` tokens).
    """
    if not bandwidth_bytes_per_s or bandwidth_bytes_per_s <= 0 or not math.isfinite(bandwidth_bytes_per_s):
        raise RooflineError(f"bandwidth must be a positive number of B/s, got {bandwidth_bytes_per_s!r}")
    if weight_bytes < 0 or kv_bytes_per_token < 0:
        raise RooflineError("weight and KV bytes must be >= 0")
    if depth < 0:
        raise RooflineError(f"depth must be >= 0, got {depth}")
    kv = float(kv_bytes_per_token) * depth if kv_bytes_read is None else float(kv_bytes_read)
    total = float(weight_bytes) + kv
    if total <= 0:
        raise RooflineError("no bytes read per token: cannot compute a ceiling")
    intensity = None if flops_per_token is None else float(flops_per_token) / total
    return RooflineResult(
        weight_bytes=float(weight_bytes),
        kv_bytes=kv,
        bytes_per_token=total,
        depth=int(depth),
        bandwidth_bytes_per_s=float(bandwidth_bytes_per_s),
        ceiling_tps=float(bandwidth_bytes_per_s) / total,
        flops_per_token=None if flops_per_token is None else float(flops_per_token),
        arithmetic_intensity=intensity,
        estimated=estimated,
        notes=tuple(notes),
    )


def regime_label(measured_tps: float, ceiling_tps: float) -> str:
    """Where a measured decode rate sits against its ceiling (thresholds: module constants)."""
    if not ceiling_tps or ceiling_tps <= 0 or not math.isfinite(ceiling_tps):
        raise RooflineError(f"ceiling must be a positive tok/s, got {ceiling_tps!r}")
    if measured_tps is None or not math.isfinite(measured_tps) or measured_tps < 0:
        raise RooflineError(f"measured tok/s must be a number >= 0, got {measured_tps!r}")
    ratio = measured_tps / ceiling_tps
    if ratio > ABOVE_CEILING_FRACTION:
        return LABEL_ABOVE_CEILING
    if ratio >= NEAR_ROOFLINE_FRACTION:
        return LABEL_NEAR_ROOFLINE
    if ratio >= MEMORY_BOUND_FRACTION:
        return LABEL_MEMORY_BOUND
    return LABEL_FAR_BELOW


def roofline_from_gguf(
    model: GGUFModel,
    depth: int,
    bandwidth_bytes_per_s: float,
    kv_type_k: GGMLType = "f16",
    kv_type_v: GGMLType = "f16",
    *,
    swa_aware: bool = True,
    swa_slack: int = 0,
) -> RooflineResult:
    """Ceiling from a real tensor table (exact weight bytes)."""
    weights = weight_bytes_per_token(model)
    kv = kv_bytes_at_depth(model.arch, depth, kv_type_k, kv_type_v, swa_slack=swa_slack)
    flops = flops_per_token(
        model.arch, depth, matmul_params=matmul_params(model), swa_aware=swa_aware, swa_slack=swa_slack
    )
    return decode_ceiling(
        weights.total,
        kv.per_token_full,
        depth,
        bandwidth_bytes_per_s,
        kv_bytes_read=kv.swa_aware if swa_aware else kv.full_attention,
        flops_per_token=flops,
        notes=weights.notes,
    )


# --------------------------------------------------------------------------------------------
# Estimates without a GGUF file


def dominant_ggml_type(quant: str) -> GGMLQuantizationType:
    """The ggml type most tensors of a llama.cpp file type get (Q4_K_M -> Q4_K, IQ3_M -> IQ3_S).

    Accepts file-type names as llama-quantize spells them (with or without MOSTLY_), and plain ggml
    type names (Q4_K, F16). Mixed files are not made of one type: see roofline_from_arch.
    """
    if isinstance(quant, LlamaFileType):
        quant = quant.name
    name = str(quant).strip().upper()
    bare = name.replace("MOSTLY_", "").replace("ALL_", "")
    ftypes = {m.name.replace("MOSTLY_", "").replace("ALL_", "") for m in LlamaFileType if m.name != "GUESSED"}
    if bare in ftypes:
        if bare in _FTYPE_DOMINANT_EXCEPTIONS:
            return ggml_type(_FTYPE_DOMINANT_EXCEPTIONS[bare])
        if bare in GGMLQuantizationType.__members__:
            return GGMLQuantizationType[bare]
        stripped = re.sub(r"_(S|M|L)$", "", bare)
        if stripped in GGMLQuantizationType.__members__:
            return GGMLQuantizationType[stripped]
        raise RooflineError(f"no dominant ggml type known for file type '{quant}': pass a ggml type name")
    if bare in GGMLQuantizationType.__members__:
        return GGMLQuantizationType[bare]
    raise RooflineError(
        f"unknown quant '{quant}'. File types: {', '.join(sorted(ftypes))}; "
        f"ggml types: {', '.join(m.name for m in GGMLQuantizationType)}"
    )


def estimate_weight_bytes(arch: ModelArch, quant: str, *, lm_head_type: Optional[GGMLType] = None) -> WeightBytes:
    """Weight bytes per token from parameter counts, every matrix at the quant's dominant type.

    An estimate: llama.cpp's mixed file types (Q4_K_M, Q5_K_M, ...) put some tensors (attn_v,
    ffn_down, the LM head) at larger types, and fall back to other types where a row length is not
    a multiple of the block size, so real files usually read somewhat more. Norm vectors: two F32
    per layer plus the output norm.
    """
    main = dominant_ggml_type(quant)
    head_type = main if lm_head_type is None else ggml_type(lm_head_type)
    bpw = bytes_per_weight(main)
    params_per_layer = (arch_matmul_params(arch) - arch.vocab_size * arch.n_embd) // arch.n_layer
    layer = round(params_per_layer * bpw)
    f32 = bytes_per_weight(GGMLQuantizationType.F32)
    norms = round(2 * arch.n_embd * f32)
    lm_head = round(arch.vocab_size * arch.n_embd * bytes_per_weight(head_type))
    token_row = round(arch.n_embd * bytes_per_weight(head_type if arch.tied_embeddings else main))
    other = round(arch.n_embd * f32)
    layer_matrices = layer * arch.n_layer
    layer_vectors = norms * arch.n_layer
    return WeightBytes(
        total=layer_matrices + layer_vectors + lm_head + token_row + other,
        layer_matrices=layer_matrices,
        layer_vectors=layer_vectors,
        lm_head=lm_head,
        token_embd_row=token_row,
        other=other,
        per_layer=tuple([layer + norms] * arch.n_layer),
        tied_embeddings=arch.tied_embeddings,
        lm_head_tensor=TOKEN_EMBD_TENSOR if arch.tied_embeddings else OUTPUT_TENSOR,
        estimated=True,
        notes=(f"estimated from parameter counts at {main.name} (dominant type of {quant}); not a tensor table",),
    )


def roofline_from_arch(
    arch: ModelArch,
    quant: str,
    depth: int,
    bandwidth_bytes_per_s: float,
    kv_type_k: GGMLType = "f16",
    kv_type_v: GGMLType = "f16",
    *,
    lm_head_type: Optional[GGMLType] = None,
    swa_aware: bool = True,
    swa_slack: int = 0,
) -> RooflineResult:
    """Ceiling without a GGUF file: weight bytes estimated by estimate_weight_bytes (estimated=True)."""
    weights = estimate_weight_bytes(arch, quant, lm_head_type=lm_head_type)
    kv = kv_bytes_at_depth(arch, depth, kv_type_k, kv_type_v, swa_slack=swa_slack)
    flops = flops_per_token(arch, depth, swa_aware=swa_aware, swa_slack=swa_slack)
    return decode_ceiling(
        weights.total,
        kv.per_token_full,
        depth,
        bandwidth_bytes_per_s,
        kv_bytes_read=kv.swa_aware if swa_aware else kv.full_attention,
        flops_per_token=flops,
        estimated=True,
        notes=weights.notes,
    )


# --------------------------------------------------------------------------------------------
# Memory fit


@dataclass(frozen=True)
class FitResult:
    fits: bool
    needed_bytes: int
    available_bytes: int
    model_bytes: int
    kv_bytes: int
    message: str

    @property
    def headroom_bytes(self) -> int:
        return self.available_bytes - self.needed_bytes


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def memory_fit(
    model_bytes: float,
    kv_bytes_per_token: float,
    context: int,
    ram_bytes: float,
    reserve_bytes: float = 0,
) -> FitResult:
    """Whether weights + a KV cache for `context` tokens fit in RAM less a reserve.

    Jetson memory is unified: the GPU's share comes out of the same RAM as the OS and runtime, which
    the reserve stands for. llama.cpp allocates the KV cache for the whole context up front, so
    context here is the allocated n_ctx, not the depth reached.
    """
    if context < 0 or model_bytes < 0 or kv_bytes_per_token < 0:
        raise RooflineError("model bytes, KV bytes per token and context must be >= 0")
    kv = int(math.ceil(kv_bytes_per_token * context))
    needed = int(math.ceil(model_bytes)) + kv
    available = int(ram_bytes - reserve_bytes)
    fits = needed <= available
    detail = (
        f"needs {_gib(needed)} (model {_gib(model_bytes)} + KV {_gib(kv)} at {context} tokens) "
        f"of {_gib(available)} available ({_gib(ram_bytes)} RAM - {_gib(reserve_bytes)} reserve)"
    )
    if fits:
        message = f"fits: {detail}"
    else:
        message = (
            f"does not fit: {detail}, short by {_gib(needed - available)}; use a smaller quant, "
            f"a quantized KV cache (-ctk/-ctv q8_0) or a shorter context"
        )
    return FitResult(
        fits=fits, needed_bytes=needed, available_bytes=available, model_bytes=int(math.ceil(model_bytes)),
        kv_bytes=kv, message=message,
    )


__all__ = [
    "ABOVE_CEILING_FRACTION",
    "file_bits_per_weight",
    "FitResult",
    "GGUFModel",
    "KVBytes",
    "LABEL_ABOVE_CEILING",
    "LABEL_FAR_BELOW",
    "LABEL_MEMORY_BOUND",
    "LABEL_NEAR_ROOFLINE",
    "MEMORY_BOUND_FRACTION",
    "ModelArch",
    "NEAR_ROOFLINE_FRACTION",
    "RooflineError",
    "RooflineResult",
    "SWA_DEFAULT_WINDOW",
    "SWA_PATTERNS",
    "TensorInfo",
    "WeightBytes",
    "arch_matmul_params",
    "bytes_per_weight",
    "decode_ceiling",
    "dominant_ggml_type",
    "estimate_weight_bytes",
    "flops_per_token",
    "ggml_type",
    "kv_bytes_at_depth",
    "kv_bytes_per_token",
    "kv_bytes_per_token_per_layer",
    "matmul_params",
    "memory_fit",
    "regime_label",
    "roofline_from_arch",
    "roofline_from_gguf",
    "swa_layers_from_pattern",
    "tensor_bytes",
    "weight_bytes_per_token",
]
