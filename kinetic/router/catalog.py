"""The models a router serves: every model pulled into kinetic's cache (`kinetic list`), and
every GGUF file under --models-dir (by its file name without `.gguf`; vision projectors,
`mmproj*.gguf`, are not models of their own).

A request names a model as `kinetic list` does (`smollm2`, `hf:OWNER/REPO:QUANT`), by its
file name with or without `.gguf`, or with Ollama's `:latest` tag."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Model:
    name: str
    path: Path
    size: int
    modified: float      # the file's mtime
    pulled: bool         # in kinetic's cache (kinetic pull / rm manage it)


def models(models_dir: str | None) -> list[Model]:
    """Every model the router can serve now, pulled ones first, each name once."""
    from kinetic import store
    out: dict[str, Model] = {}
    for entry in store.entries():
        if entry.path is not None and (st := store.file_stat(entry.path)) is not None:
            out.setdefault(entry.name, Model(entry.name, entry.path, st.st_size, st.st_mtime,
                                             True))
    if models_dir:
        for path in sorted(Path(models_dir).expanduser().rglob("*.gguf")):
            if path.name.lower().startswith("mmproj") or not path.is_file():
                continue
            if (st := store.file_stat(path)) is not None:
                out.setdefault(path.stem, Model(path.stem, path, st.st_size, st.st_mtime,
                                                False))
    return list(out.values())



def find(name: str, available: list[Model]) -> Model | None:
    """The model `name` means, or None."""
    wanted = [name, name.removesuffix(":latest"), name.removesuffix(".gguf")]
    for want in wanted:
        for m in available:
            if want in (m.name, m.path.name, m.path.stem):
                return m
    return None


def models_dir_error(models_dir: str | None) -> str | None:
    """Why --models-dir cannot be used, or None."""
    if models_dir is None:
        return None
    if not os.path.isdir(os.path.expanduser(models_dir)):
        return f"--models-dir {models_dir}: no such folder"
    return None
