"""Reading GGUF files: metadata as plain Python values, tensors as memory-mapped raw bytes.

Everything that can be wrong with a file (not GGUF, truncated, a tensor past the end) is
reported here as a `GGUFError` naming the file and the problem, so that no caller ever sees
a traceback from inside the gguf package or numpy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from gguf import GGUFReader, GGUFValueType, GGMLQuantizationType


class GGUFError(ValueError):
    """A GGUF file that cannot be used; the message names the file and the reason."""


@dataclass(frozen=True)
class RawTensor:
    """One tensor as stored: its GGML type, its logical shape (outermost first, as numpy
    would index it) and its bytes (a read-only view into the memory map)."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class GGUFFile:
    """An opened GGUF file: `.metadata` (key -> value) and `.tensors` (name -> RawTensor)."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise GGUFError(f"{self.path}: no such file")
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise GGUFError(f"{self.path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
        try:
            reader = GGUFReader(self.path, "r")
        except (ValueError, IndexError, KeyError, OSError, TypeError) as e:
            raise GGUFError(f"{self.path}: unreadable GGUF file, perhaps truncated ({e})") from None
        self.metadata: dict[str, Any] = {
            name: _field_value(field) for name, field in reader.fields.items()
            if not name.startswith("GGUF.")
        }
        size = os.path.getsize(self.path)
        self.tensors: dict[str, RawTensor] = {}
        for t in reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size or t.data.nbytes != int(t.n_bytes):
                raise GGUFError(
                    f"{self.path}: truncated: tensor {t.name!r} needs bytes up to {end}, "
                    f"the file has {size}")
            # gguf lists dims innermost first; we keep numpy order (outermost first).
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            self.tensors[t.name] = RawTensor(t.name, GGMLQuantizationType(int(t.tensor_type)),
                                             shape, t.data)
        self._reader = reader  # keeps the memory map alive

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: no general.architecture key")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


def _field_value(field: Any) -> Any:
    """A field's value as Python: str, int, float, bool, or a list (a numpy array for long
    numeric arrays such as token scores)."""
    kind = field.types[0] if field.types else None
    if kind == GGUFValueType.ARRAY:
        inner = field.types[1] if len(field.types) > 1 else None
        if inner == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="surrogateescape")
                    for i in field.data]
        if inner == GGUFValueType.ARRAY:
            return field.contents()
        if not field.data:
            return []
        return np.concatenate([np.asarray(field.parts[i]) for i in field.data]).copy()
    if kind == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="surrogateescape")
    value = field.parts[field.data[0]][0]
    if kind == GGUFValueType.BOOL:
        return bool(value)
    return value.item()
