"""Fast read of a GGUF file's scalar metadata (architecture, context length, layer and head counts).

gguf.GGUFReader builds objects for every field, including vocabularies of 100k+ strings, which
takes many seconds; the sweep planner only needs a dozen scalars, so this walks the key/value
section once, skipping arrays without decoding them. Value types follow the GGUF spec (the same
numbering as gguf.GGUFValueType, which the tests check).
"""

from __future__ import annotations

import struct
from functools import lru_cache
from pathlib import Path
from typing import Any

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFMetaError(ValueError):
    pass


def _read(f, n: int) -> bytes:
    if n < 0 or n > _remaining(f):
        raise GGUFMetaError("corrupt GGUF header (a length runs past the end of the file)")
    data = f.read(n)
    if len(data) != n:
        raise GGUFMetaError("truncated GGUF header")
    return data


def _remaining(f) -> int:
    here = f.tell()
    end = f.seek(0, 2)
    f.seek(here)
    return end - here


def _string(f) -> str:
    (n,) = struct.unpack("<Q", _read(f, 8))
    return _read(f, n).decode("utf-8", errors="replace")


def _skip_value(f, vtype: int) -> None:
    if vtype in _SCALARS:
        f.seek(struct.calcsize(_SCALARS[vtype]), 1)
    elif vtype == _STRING:
        (n,) = struct.unpack("<Q", _read(f, 8))
        if n > _remaining(f):
            raise GGUFMetaError("corrupt GGUF header (a string runs past the end of the file)")
        f.seek(n, 1)
    elif vtype == _ARRAY:
        etype, count = struct.unpack("<IQ", _read(f, 12))
        if etype in _SCALARS:
            f.seek(struct.calcsize(_SCALARS[etype]) * count, 1)
        else:
            for _ in range(count):
                _skip_value(f, etype)
    else:
        raise GGUFMetaError(f"unknown GGUF value type {vtype}")


# Arrays up to this length are read (sliding-window patterns, per-layer values); longer ones
# (vocabularies) are skipped and only their length is kept.
_SMALL_ARRAY = 4096


@lru_cache(maxsize=64)
def _header_cached(path: str, mtime: float, size: int) -> tuple[dict[str, Any], tuple]:
    out: dict[str, Any] = {}
    tensors = []
    with open(path, "rb") as f:
        if _read(f, 4) != b"GGUF":
            raise GGUFMetaError(f"{path} is not a GGUF file")
        (version,) = struct.unpack("<I", _read(f, 4))
        if version < 2:
            raise GGUFMetaError(f"{path}: GGUF version {version} is not supported")
        _n_tensors, n_kv = struct.unpack("<QQ", _read(f, 16))
        for _ in range(n_kv):
            key = _string(f)
            (vtype,) = struct.unpack("<I", _read(f, 4))
            if vtype in _SCALARS:
                out[key] = struct.unpack(_SCALARS[vtype], _read(f, struct.calcsize(_SCALARS[vtype])))[0]
            elif vtype == _STRING:
                out[key] = _string(f)
            elif vtype == _ARRAY:
                etype, count = struct.unpack("<IQ", _read(f, 12))
                out[f"{key}.__len__"] = count
                if etype in _SCALARS and count <= _SMALL_ARRAY:
                    fmt = _SCALARS[etype]
                    out[key] = list(struct.unpack("<" + fmt[1] * count, _read(f, struct.calcsize(fmt) * count)))
                elif etype in _SCALARS:
                    f.seek(struct.calcsize(_SCALARS[etype]) * count, 1)
                else:
                    for _ in range(count):
                        _skip_value(f, etype)
            else:
                raise GGUFMetaError(f"{path}: unknown GGUF value type {vtype} for {key}")
        for _ in range(_n_tensors):
            name = _string(f)
            (n_dims,) = struct.unpack("<I", _read(f, 4))
            dims = struct.unpack("<" + "Q" * n_dims, _read(f, 8 * n_dims))
            ttype, _offset = struct.unpack("<IQ", _read(f, 12))
            tensors.append((name, tuple(int(d) for d in dims), int(ttype)))
    return out, tuple(tensors)


def header(path: str | Path) -> tuple[dict[str, Any], tuple]:
    """(metadata, tensor table) without reading tensor data or decoding long arrays.
    Metadata arrays longer than 4096 items appear only as `<key>.__len__`; the tensor table is
    (name, dims in ggml order, ggml type id) per tensor."""
    p = Path(path)
    st = p.stat()
    meta, tensors = _header_cached(str(p), st.st_mtime, st.st_size)
    return dict(meta), tensors


def scalars(path: str | Path) -> dict[str, Any]:
    """Every scalar/string metadata value (and short arrays); long arrays only as `<key>.__len__`."""
    return header(path)[0]


def kv_arch(path: str | Path) -> dict[str, Any]:
    """The fields the planner needs: architecture, context length, layers, heads, head dims."""
    meta = scalars(path)
    arch = meta.get("general.architecture")
    if not arch:
        raise GGUFMetaError(f"{path}: missing metadata key 'general.architecture'")

    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in meta:
            raise GGUFMetaError(f"{path}: missing metadata key '{full}'")
        return meta[full]

    n_embd, n_head = need("embedding_length"), need("attention.head_count")
    head_dim = meta.get(f"{arch}.attention.key_length", n_embd // n_head if n_head else None)
    return {
        "architecture": arch,
        "context_length": need("context_length"),
        "n_layer": need("block_count"),
        "n_embd": n_embd,
        "n_head": n_head,
        "n_head_kv": meta.get(f"{arch}.attention.head_count_kv", n_head),
        "head_dim": head_dim,
        "head_dim_v": meta.get(f"{arch}.attention.value_length", head_dim),
        "file_type": meta.get("general.file_type"),
    }
