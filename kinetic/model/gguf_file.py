"""Reading GGUF files: metadata as plain Python values, tensors as memory-mapped raw bytes.

The header is parsed here directly with `struct` over an `mmap` of the file (gguf-py's
reader builds numpy objects for every vocabulary string and takes seconds on a 262K-token
vocabulary; this takes a fraction of a second). Layout, all little-endian (GGUF v2 and v3):

    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x   (key: string, value_type u32, value)
    tensor_count x (name: string, n_dims u32, dims u64[n_dims] innermost first,
                    ggml_type u32, offset u64 relative to the data section)
    padding to general.alignment (default 32) | data section

    string = length u64 + UTF-8 bytes; array = item_type u32 + count u64 + items (arrays
    of arrays nest: each item is again item_type + count + items).

Everything that can be wrong with a file (missing, not GGUF, another version, truncated, a
tensor past the end, an unknown type, duplicates) is a `GGUFError` naming the file and the
problem, so that no caller ever sees a traceback from struct, numpy or mmap.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType


class GGUFError(ValueError):
    """A GGUF file that cannot be used; the message names the file and the reason."""


@dataclass(frozen=True)
class RawTensor:
    """One tensor as stored: its GGML type, its logical shape (outermost first, as numpy
    would index it) and its bytes (`data`: a read-only 1-D uint8 view into the memory map,
    exactly the tensor's bytes, whatever its type)."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray

    def file_offset(self, whole: np.ndarray) -> int:
        """Where the tensor's bytes start in `whole`, the file array they view."""
        return int(self.data.__array_interface__["data"][0] - whole.__array_interface__["data"][0])


_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4  # GGML_MAX_DIMS: ggml has no tensors of more dimensions

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_BOOL, _STRING, _ARRAY = 7, 8, 9
# Fixed-size value types: id -> (struct, numpy dtype of an array of them). Bools are read
# as bytes and compared with 0, so that a byte other than 0 or 1 still reads as True.
_SCALARS: dict[int, tuple[struct.Struct, np.dtype]] = {
    i: (struct.Struct("<" + fmt), np.dtype(dt)) for i, fmt, dt in (
        (0, "B", "u1"), (1, "b", "i1"), (2, "H", "<u2"), (3, "h", "<i2"), (4, "I", "<u4"),
        (5, "i", "<i4"), (6, "f", "<f4"), (_BOOL, "B", "u1"), (10, "Q", "<u8"),
        (11, "q", "<i8"), (12, "d", "<f8"))
}
# The fewest bytes an item of each kind can take: bounds a claimed count before a loop.
_MIN_ITEM_BYTES = {_STRING: 8, _ARRAY: 12, **{i: s.size for i, (s, _) in _SCALARS.items()}}
# Arrays of arrays deeper than this are damage, not data (and would exhaust the stack).
_MAX_NESTING = 32


class _Header:
    """A cursor over the file's bytes that turns every overrun into a GGUFError.
    `where` names what is being read, for the messages."""

    def __init__(self, buf: mmap.mmap, path: str):
        self.buf, self.path, self.size = buf, path, len(buf)
        self.pos = 0
        self.where = "the header"

    def error(self, reason: str) -> GGUFError:
        return GGUFError(f"{self.path}: {reason}")

    def truncated(self, need: int) -> GGUFError:
        return self.error(f"truncated: the file ends inside {self.where} (reading {need} "
                          f"bytes at offset {self.pos}, the file has {self.size} bytes)")

    def unpack(self, s: struct.Struct) -> Any:
        if self.pos + s.size > self.size:
            raise self.truncated(s.size)
        (value,) = s.unpack_from(self.buf, self.pos)
        self.pos += s.size
        return value

    def u32(self) -> int:
        return self.unpack(_U32)

    def u64(self) -> int:
        return self.unpack(_U64)

    def string(self) -> str:
        n = self.u64()
        if self.pos + n > self.size:
            raise self.truncated(n)
        s = self.buf[self.pos:self.pos + n].decode("utf-8", errors="surrogateescape")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        """One value of type `vtype`: str, int, float, bool, numpy array or list."""
        if vtype in _SCALARS:
            v = self.unpack(_SCALARS[vtype][0])
            return bool(v) if vtype == _BOOL else v
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array()
        raise self.error(f"{self.where} has unknown value type id {vtype}")

    def array(self, depth: int = 1) -> Any:
        if depth > _MAX_NESTING:
            raise self.error(f"{self.where} has arrays nested more than {_MAX_NESTING} deep")
        item_type, n = self.u32(), self.u64()
        if item_type not in _MIN_ITEM_BYTES:
            raise self.error(f"{self.where} is an array of unknown value type id {item_type}")
        if n * _MIN_ITEM_BYTES[item_type] > self.size - self.pos:
            raise self.error(f"truncated: {self.where} is an array of {n} items, more than "
                             f"the {self.size - self.pos} bytes left in the file can hold")
        if item_type == _STRING:
            return self.strings(n)
        if item_type == _ARRAY:
            return [self.array(depth + 1) for _ in range(n)]
        dtype = _SCALARS[item_type][1]
        # A copy: metadata must not pin the map, and callers may keep or modify it.
        out = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos).copy()
        self.pos += n * dtype.itemsize
        return out != 0 if item_type == _BOOL else out

    def strings(self, n: int) -> list[str]:
        """n strings; the hot loop of a large vocabulary, so kept to a few local operations."""
        buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        out: list[str] = [""] * n
        for i in range(n):
            end = pos + 8 + unpack(buf, pos)[0] if pos + 8 <= size else size + 1
            if end > size:
                self.where += f", string #{i} of {n}"
                self.pos = pos
                self.string()  # raises the truncation error, for the length or the bytes
            out[i] = buf[pos + 8:end].decode("utf-8", errors="surrogateescape")
            pos = end
        self.pos = pos
        return out


@dataclass
class _TensorInfo:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order
    offset: int             # relative to the data section
    n_bytes: int


class GGUFFile:
    """An opened GGUF file: `.metadata` (key -> value) and `.tensors` (name -> RawTensor).

    Values are str (UTF-8, undecodable bytes kept as surrogate escapes), int, float, bool,
    numpy arrays for numeric arrays, list[str] for string arrays and lists for arrays of
    arrays. Tensor data stay in the file (memory-mapped) until read. `drop` frees values a
    long-lived process has no more use for (the vocabulary's merges, once the tokenizer is
    made); `keys()` still lists them and `read` reads one again. Raises GGUFError for any
    file that is missing or malformed."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        buf = _map(self.path)
        try:
            h = _Header(buf, self.path)
            n_tensors, n_kv = _read_counts(h)
            self.metadata, self._value_at = _read_kv(h, n_kv)
            infos = _read_tensor_infos(h, n_tensors)
            alignment = _alignment(h, self.metadata)
            # The data section starts at the end of the tensor infos, rounded up.
            self._data_offset = -(-h.pos // alignment) * alignment
            _check_tensor_data(h, infos, self._data_offset, alignment)
        except BaseException:
            try:
                buf.close()  # nothing should have a view into it yet
            except BufferError:
                pass  # then the garbage collector closes it
            raise
        self._map = buf  # the tensors' views keep it alive too; this makes it explicit
        whole = np.frombuffer(buf, dtype=np.uint8) if infos else None
        if whole is not None:
            whole.flags.writeable = False
        # The whole file as one read-only uint8 array (page-aligned: XLA can use it in place)
        self.bytes: np.ndarray | None = whole
        self.tensors: dict[str, RawTensor] = {}
        for t in infos:
            start = self._data_offset + t.offset
            self.tensors[t.name] = RawTensor(t.name, t.qtype, t.shape,
                                             whole[start:start + t.n_bytes])

    def writable_bytes(self) -> np.ndarray:
        """The whole file as a writable uint8 array over the same memory as `bytes`. The map
        is private: a write changes this process's copy of a page, never the file (the
        weight loader rearranges blocks in place, kinetic.model.weights)."""
        return np.frombuffer(self._map, dtype=np.uint8)

    @property
    def architecture(self) -> str:
        """`general.architecture` ("llama", "qwen2", ...); GGUFError if absent."""
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: no general.architecture key")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        """The metadata value of `key`, or `default`."""
        return self.metadata.get(key, default)

    def drop(self, keys: Iterable[str]) -> None:
        """Frees the values of `keys` from `metadata`: a served model holds its file for its
        whole life, and a vocabulary's arrays are big as Python objects (Llama 3's 280,147
        merges take 25 MB as str) where the tokenizer keeps what it needs in its own form."""
        for key in keys:
            self.metadata.pop(key, None)

    def keys(self) -> list[str]:
        """Every metadata key in the file's order, those `drop` freed included."""
        return list(self._value_at)

    def read(self, key: str) -> Any:
        """The metadata value of `key`, parsed from the file again where `drop` freed it (the
        header is still mapped; the file is never written); KeyError if the file has none."""
        if key in self.metadata:
            return self.metadata[key]
        h = _Header(self._map, self.path)
        h.pos, h.where = self._value_at[key], f"metadata key {key!r}"
        return h.value(h.u32())


def _map(path: str) -> mmap.mmap:
    """A private map of the file (copy on write: the file itself is never written), after
    checking it exists and starts with the magic."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(4)
            if head != _MAGIC:
                what = "it is empty" if not head else f"it starts with {head!r}"
                raise GGUFError(f"{path}: not a GGUF file ({what}, not {_MAGIC!r})")
            return mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    except FileNotFoundError:
        raise GGUFError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise GGUFError(f"{path}: is a directory, not a GGUF file") from None
    except OSError as e:
        raise GGUFError(f"{path}: cannot read the file ({e.strerror or e})") from None


def _read_counts(h: _Header) -> tuple[int, int]:
    """Checks the version; returns (tensor count, key-value count)."""
    h.pos = 4  # after the magic, which _map checked
    version = h.u32()
    if version not in _VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if swapped in _VERSIONS:
            raise h.error(f"a big-endian GGUF file (version {swapped}), which is not supported")
        raise h.error(f"unsupported GGUF version {version} (supported: "
                      f"{', '.join(map(str, _VERSIONS))})")
    return h.u64(), h.u64()


def _read_kv(h: _Header, n_kv: int) -> tuple[dict[str, Any], dict[str, int]]:
    """(key -> value, key -> where its value type starts in the file), in the file's order."""
    meta: dict[str, Any] = {}
    value_at: dict[str, int] = {}
    for i in range(n_kv):
        h.where = f"metadata key #{i} of {n_kv}"
        key = h.string()
        h.where = f"metadata key {key!r}"
        value_at[key] = h.pos
        value = h.value(h.u32())
        if key in meta:
            raise h.error(f"duplicate metadata key {key!r}")
        meta[key] = value
    return meta, value_at


def _read_tensor_infos(h: _Header, n: int) -> list[_TensorInfo]:
    infos: list[_TensorInfo] = []
    seen: set[str] = set()
    for i in range(n):
        h.where = f"tensor info #{i} of {n}"
        name = h.string()
        h.where = f"the tensor info of {name!r}"
        if name in seen:
            raise h.error(f"duplicate tensor {name!r}")
        seen.add(name)
        n_dims = h.u32()
        if n_dims > _MAX_DIMS:
            raise h.error(f"tensor {name!r} has {n_dims} dimensions (at most {_MAX_DIMS})")
        dims = [h.u64() for _ in range(n_dims)]  # innermost first
        type_id, offset = h.u32(), h.u64()
        infos.append(_tensor_info(h, name, dims, type_id, offset))
    return infos


def _tensor_info(h: _Header, name: str, dims: list[int], type_id: int,
                 offset: int) -> _TensorInfo:
    try:
        qtype = GGMLQuantizationType(type_id)
        block, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise h.error(f"tensor {name!r} has unknown GGML type id {type_id}") from None
    shape = tuple(reversed(dims))
    if dims and dims[0] % block:
        raise h.error(f"tensor {name!r} of type {qtype.name} has shape {shape}: its last "
                      f"dimension is not a multiple of the block size {block}")
    n_elements = 1
    for d in dims:
        n_elements *= d
    return _TensorInfo(name, qtype, shape, offset, n_elements // block * type_size)


def _alignment(h: _Header, meta: dict[str, Any]) -> int:
    """general.alignment (default 32): tensor offsets and the data section's start are
    multiples of it."""
    alignment = meta.get("general.alignment", _DEFAULT_ALIGNMENT)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 \
            or alignment & (alignment - 1):
        raise h.error(f"general.alignment is {alignment!r}, not a positive power of two")
    return alignment


def _check_tensor_data(h: _Header, infos: list[_TensorInfo], data_offset: int,
                       alignment: int) -> None:
    """Every tensor's bytes must be aligned and lie inside the file."""
    for t in infos:
        if t.offset % alignment:
            raise h.error(f"tensor {t.name!r} has data offset {t.offset}, not a multiple of "
                          f"the alignment {alignment}")
        end = data_offset + t.offset + t.n_bytes
        if end > h.size:
            raise h.error(
                f"truncated: tensor {t.name!r} ({t.qtype.name}, shape {t.shape}, "
                f"{t.n_bytes} bytes) needs the file to reach byte {end}, the file has "
                f"{h.size} bytes")
