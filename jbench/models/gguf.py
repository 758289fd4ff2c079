"""Fast read of a GGUF file's header: scalar metadata (architecture, context length, layer and head
counts) and the tensor table, without tensor data.

gguf.GGUFReader builds objects for every field, including vocabularies of 100k+ strings, which
takes many seconds; the sweep planner only needs a dozen scalars, so this walks the key/value
section once, skipping arrays without decoding them. The header is read front to back in large
buffered chunks (4 MiB, then doubling) and walked in memory with struct.unpack_from: a 262k-token
vocabulary is skipped in tens of milliseconds instead of one seek per string. Value types follow
the GGUF spec (the same numbering as gguf.GGUFValueType, which the tests check).

Most callers want jbench.models.facts.model_facts(path): the facts derived from this header,
cached on disk across processes (jbench.models.facts: `model_facts(path).kv_arch()`).
"""

from __future__ import annotations

import math
import os
import struct
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_SIZES = {k: struct.calcsize(v) for k, v in _SCALARS.items()}
_STRING, _ARRAY = 8, 9

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_ARRAY_HEAD = struct.Struct("<IQ")  # element type, count
_TENSOR_TAIL = struct.Struct("<IQ")  # ggml type, data offset
_COUNTS = struct.Struct("<QQ")  # tensors, key/value pairs

_FIRST_CHUNK = 4 << 20

_CORRUPT_LENGTH = "corrupt GGUF header (a length runs past the end of the file)"
_CORRUPT_STRING = "corrupt GGUF header (a string runs past the end of the file)"


class GGUFMetaError(ValueError):
    pass


class _Buffer:
    """The file's first bytes, read in growing chunks; `data` is always a prefix of the file."""

    __slots__ = ("f", "size", "data")

    def __init__(self, f, size: int) -> None:
        self.f = f
        self.size = size
        self.data = bytearray()

    def ensure(self, end: int) -> bytearray:
        """Make data cover [0, end); a length that runs past the end of the file is corrupt."""
        if end > self.size:
            raise GGUFMetaError(_CORRUPT_LENGTH)
        have = len(self.data)
        if end > have:
            want = min(self.size, max(end, 2 * have, _FIRST_CHUNK))
            more = self.f.read(want - have)
            self.data += more
            if len(self.data) < end:
                raise GGUFMetaError("truncated GGUF header")
        return self.data


def _unpack(buf: _Buffer, st: struct.Struct, off: int) -> tuple[tuple, int]:
    end = off + st.size
    data = buf.data if end <= len(buf.data) else buf.ensure(end)
    return st.unpack_from(data, off), end


def _string(buf: _Buffer, off: int) -> tuple[str, int]:
    (n,), off = _unpack(buf, _U64, off)
    if n > buf.size - off:
        raise GGUFMetaError(_CORRUPT_LENGTH)
    end = off + n
    data = buf.data if end <= len(buf.data) else buf.ensure(end)
    return bytes(data[off:end]).decode("utf-8", errors="replace"), end


def _skip_strings(buf: _Buffer, off: int, count: int) -> int:
    """Skip `count` length-prefixed strings: the hot loop of a vocabulary."""
    size = buf.size
    data = buf.data
    have = len(data)
    u64 = _U64.unpack_from
    for _ in range(count):
        if off + 8 > have:
            data = buf.ensure(off + 8)
            have = len(data)
        n = u64(data, off)[0]
        off += 8 + n
        if off > size:
            raise GGUFMetaError(_CORRUPT_STRING)
    return off


def _skip_value(buf: _Buffer, off: int, vtype: int) -> int:
    if vtype in _SIZES:
        return off + _SIZES[vtype]
    if vtype == _STRING:
        return _skip_strings(buf, off, 1)
    if vtype == _ARRAY:
        (etype, count), off = _unpack(buf, _ARRAY_HEAD, off)
        return _skip_array(buf, off, etype, count)
    raise GGUFMetaError(f"unknown GGUF value type {vtype}")


def _skip_array(buf: _Buffer, off: int, etype: int, count: int) -> int:
    if etype in _SIZES:
        return off + _SIZES[etype] * count
    if etype == _STRING:
        return _skip_strings(buf, off, count)
    for _ in range(count):
        off = _skip_value(buf, off, etype)
    return off


# Arrays up to this length are read (sliding-window patterns, per-layer values); longer ones
# (vocabularies) are skipped and only their length is kept.
_SMALL_ARRAY = 4096


def _walk(buf: _Buffer, path: str, layout: Optional[list[int]] = None) -> tuple[dict[str, Any], tuple]:
    """layout, when given, receives each tensor's data offset and then the offset where the tensor table ends."""
    out: dict[str, Any] = {}
    tensors = []
    if buf.size < 4:
        raise GGUFMetaError(_CORRUPT_LENGTH)
    if bytes(buf.ensure(4)[:4]) != b"GGUF":
        raise GGUFMetaError(f"{path} is not a GGUF file")
    (version,), off = _unpack(buf, _U32, 4)
    if version < 2:
        raise GGUFMetaError(f"{path}: GGUF version {version} is not supported")
    (n_tensors, n_kv), off = _unpack(buf, _COUNTS, off)
    for _ in range(n_kv):
        key, off = _string(buf, off)
        (vtype,), off = _unpack(buf, _U32, off)
        if vtype in _SCALARS:
            size = _SIZES[vtype]
            data = buf.ensure(off + size)
            out[key] = struct.unpack_from(_SCALARS[vtype], data, off)[0]
            off += size
        elif vtype == _STRING:
            out[key], off = _string(buf, off)
        elif vtype == _ARRAY:
            (etype, count), off = _unpack(buf, _ARRAY_HEAD, off)
            out[f"{key}.__len__"] = count
            if etype in _SCALARS and count <= _SMALL_ARRAY:
                fmt = _SCALARS[etype]
                end = off + _SIZES[etype] * count
                data = buf.ensure(end)
                out[key] = list(struct.unpack_from("<" + fmt[1] * count, data, off))
                off = end
            else:
                off = _skip_array(buf, off, etype, count)
        else:
            raise GGUFMetaError(f"{path}: unknown GGUF value type {vtype} for {key}")
    for _ in range(n_tensors):
        name, off = _string(buf, off)
        (n_dims,), off = _unpack(buf, _U32, off)
        end = off + 8 * n_dims
        data = buf.ensure(end)
        dims = struct.unpack_from("<" + "Q" * n_dims, data, off)
        (ttype, offset), off = _unpack(buf, _TENSOR_TAIL, end)
        tensors.append((name, tuple(int(d) for d in dims), int(ttype)))
        if layout is not None:
            layout.append(int(offset))
    if layout is not None:
        layout.append(off)
    return out, tuple(tensors)


def read_header(path: str | Path) -> tuple[dict[str, Any], tuple]:
    """One uncached read of the header (see `header`)."""
    with open(path, "rb") as f:
        return _walk(_Buffer(f, os.fstat(f.fileno()).st_size), str(path))


def data_end(path: str | Path) -> Optional[int]:
    """The file size the header describes: where the last tensor's data ends (the tensor data starts at the first
    multiple of general.alignment after the tensor table). A smaller file is truncated: the header survived a cut
    download or copy, the weights did not. None when a tensor's type has no known size. Raises OSError or
    GGUFMetaError as read_header does. Memoized by (path, mtime, size)."""
    st = Path(path).stat()
    return _data_end_cached(str(path), st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=64)
def _data_end_cached(path: str, mtime_ns: int, size: int) -> Optional[int]:
    from jbench.models.types import RooflineError, tensor_bytes

    layout: list[int] = []
    with open(path, "rb") as f:
        meta, tensors = _walk(_Buffer(f, os.fstat(f.fileno()).st_size), path, layout)
    alignment = meta.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0:
        alignment = 32
    table_end = layout[-1]
    data_start = -(-table_end // alignment) * alignment
    end = data_start
    for (_name, dims, ttype), offset in zip(tensors, layout):
        try:
            n_bytes = tensor_bytes(ttype, math.prod(dims))
        except RooflineError:
            return None
        end = max(end, data_start + offset + n_bytes)
    return end


@lru_cache(maxsize=64)
def _header_cached(path: str, mtime_ns: int, size: int) -> tuple[dict[str, Any], tuple]:
    return read_header(path)


def header(path: str | Path) -> tuple[dict[str, Any], tuple]:
    """(metadata, tensor table) without reading tensor data or decoding long arrays.
    Metadata arrays longer than 4096 items appear only as `<key>.__len__` (arrays of strings or
    nested arrays only that way, whatever their length); the tensor table is (name, dims in ggml
    order, ggml type id) per tensor. Memoized in this process by (path, mtime, size)."""
    p = Path(path)
    st = p.stat()
    meta, tensors = _header_cached(str(p), st.st_mtime_ns, st.st_size)
    return dict(meta), tensors


def scalars(path: str | Path) -> dict[str, Any]:
    """Every scalar/string metadata value (and short arrays); long arrays only as `<key>.__len__`."""
    return header(path)[0]
