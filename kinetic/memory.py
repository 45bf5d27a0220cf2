"""The C library's heap: what kinetic asks of glibc's malloc so that a serving process holds
the memory it uses, not the most it ever used (docs/architecture.md, "Memory").

XLA compiles with many large temporary blocks. glibc serves blocks above its mmap threshold
(128 KB at start) with mmap and hands them back on free, but after the first such free it raises
the threshold to that block's size (up to 32 MB): from then on blocks of that size come from the
heap, where freed ones stay resident between the blocks still in use. `compiling()` holds the
threshold at 128 KB while Engine.compile runs (Gemma 3 270M at `-np 16`: 62 MB less anonymous
memory once compiled), then sets it to 32 MB, the most glibc would raise it to: a decode step's
buffers then come from the heap, warm, every step. Held at 128 KB while serving too, they
would be mapped and unmapped on every call, and a step took 10-20% longer (docs/performance.md).
The trim threshold goes with it, as glibc pairs them when it raises the mmap threshold itself:
128 KB while compiling, then twice 32 MB. Left at 128 KB, every free that left more than that
at the top of a heap handed it back, and the next step faulted it in again page by page
(Qwen2.5-Coder-0.5B at 16 streams: 72,000 page faults a run instead of 17,000, 6% slower).

Elsewhere than glibc (musl, macOS) these do nothing. `drop_staging_caches` drops what JAX
keeps to trace a function again, once every shape has compiled.

`drop_code_pages` unmaps jaxlib's code and read-only data that the process holds only as clean
copies of the file, before, between and after Engine.compile's compiles: whatever runs again
faults back in.

`huge_pages` moves the weights a step streams through (the rearranged projections, written
once at load) to memory the kernel may back with 2 MB pages (Linux's transparent huge pages):
a step that reads every weight once then walks 512 times fewer page-table entries.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from contextlib import contextmanager
from typing import Iterator

import numpy as np

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers
COMPILE_THRESHOLD = 128 * 1024  # glibc's own starting value (of both thresholds)
SERVE_THRESHOLD = 32 * 1024 * 1024  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit systems
SERVE_TRIM = 2 * SERVE_THRESHOLD  # what glibc sets beside a threshold it raised to 32 MB


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def _mallopt(param: int, env: str, size: int) -> bool:
    """glibc's mallopt(param, size), unless the user set that parameter in the environment
    (`env`, which then stays as set). True where it was applied."""
    if env in os.environ:
        return False
    mallopt = getattr(_libc(), "mallopt", None)
    return mallopt is not None and bool(mallopt(param, size))


def set_mmap_threshold(size: int) -> bool:
    """Blocks of `size` bytes and more mapped on malloc and unmapped on free, smaller ones from
    the heap, for the whole process. A threshold the user set in the environment
    (MALLOC_MMAP_THRESHOLD_) is left as set. True where it was applied."""
    return _mallopt(M_MMAP_THRESHOLD, "MALLOC_MMAP_THRESHOLD_", size)


def set_trim_threshold(size: int) -> bool:
    """Free memory at the top of a heap kept up to `size` bytes, the rest handed back on free
    (MALLOC_TRIM_THRESHOLD_ in the environment is left as set). True where it was applied."""
    return _mallopt(M_TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_", size)


@contextmanager
def compiling() -> Iterator[None]:
    """Compiles inside keep their big temporary blocks out of the heap and hand back what they
    free; after, the heap serves everything under SERVE_THRESHOLD and keeps up to SERVE_TRIM
    free at its top for the next step. Handing back what the heap holds free is the caller's
    (release_memory: Engine.compile does it after each compile)."""
    set_mmap_threshold(COMPILE_THRESHOLD)
    set_trim_threshold(COMPILE_THRESHOLD)
    try:
        yield
    finally:
        set_mmap_threshold(SERVE_THRESHOLD)
        set_trim_threshold(SERVE_TRIM)


def release_memory() -> None:
    """Hand the memory the C library keeps after frees back to the system (glibc's
    malloc_trim; nothing elsewhere)."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


def drop_staging_caches() -> None:
    """Drop what JAX keeps to trace and lower a function again (its jaxprs and lowered
    modules: about 10 MB per compiled shape, 80 MB of Qwen2.5-Coder-0.5B's serving process).
    The executables stay in each jitted function's own cache, where every call of a compiled
    shape finds them: after Engine.compile no request compiles (tests/test_engine.py counts
    XLA's compiles); Engine.compile drops them after each of its compiles, so that the next
    one's peak does not sit on them. A JAX without this private function keeps them."""
    try:
        from jax._src import util
        util.clear_all_caches()
    except (ImportError, AttributeError):
        pass


HUGE_PAGE = 2 * 1024 * 1024   # x86-64's and arm64's (4 KB granule) transparent huge page
_PROT_RW, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS = 0x3, 0x02, 0x10, 0x20   # Linux's values
_MADV_HUGEPAGE = 14
_THP_SWITCH = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.cache
def _huge_pages_on() -> bool:
    """Linux with transparent huge pages "always" or "madvise" (not "[never]"), and not turned
    off by KINETIC_HUGE_PAGES=0."""
    if sys.platform != "linux" or os.environ.get("KINETIC_HUGE_PAGES", "1") == "0":
        return False
    try:
        with open(_THP_SWITCH) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def huge_pages(buf: np.ndarray, offset: int, size: int, done: set[int]) -> int:
    """Move bytes [offset, offset + size) of `buf` (a writable view of a whole private
    mapping, such as GGUFFile.writable_bytes) to anonymous memory that asks for transparent
    huge pages, at the same addresses and with the same contents: every 2 MB-aligned piece of
    the mapping that overlaps the range (its neighbours' bytes in it come along, unchanged).
    Pieces in `done` are skipped and those moved are added to it. Pieces that cross the
    mapping's ends, and everything where huge pages are off (_huge_pages_on), stay as they
    are. Returns the bytes moved. The mapping's owner unmaps them with the rest."""
    libc = _libc()
    if not _huge_pages_on() or libc is None or size <= 0:
        return 0
    base = buf.ctypes.data
    first = max(-(-base // HUGE_PAGE), (base + offset) // HUGE_PAGE)
    last = min((base + buf.nbytes) // HUGE_PAGE, -(-(base + offset + size) // HUGE_PAGE))
    mmap_, madvise = libc.mmap, libc.madvise
    mmap_.restype = ctypes.c_void_p
    mmap_.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    keep, moved = None, 0
    for piece in range(first, last):
        if piece in done:
            continue
        at = piece * HUGE_PAGE
        keep = keep or ctypes.create_string_buffer(HUGE_PAGE)
        ctypes.memmove(keep, at, HUGE_PAGE)
        # the old pages are replaced in one call: nothing else maps this range meanwhile
        if mmap_(at, HUGE_PAGE, _PROT_RW, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_FIXED,
                 -1, 0) != at:
            raise OSError(f"huge_pages: mapping anonymous memory at {at:#x} failed")
        madvise(at, HUGE_PAGE, _MADV_HUGEPAGE)   # advice only: 4 KB pages where none is free
        ctypes.memmove(at, keep, HUGE_PAGE)
        done.add(piece)
        moved += HUGE_PAGE
    return moved


_MADV_DONTNEED = 4
CODE_LIBRARIES = ("/jaxlib/",)   # drop_code_pages' default: the XLA runtime and compiler


def drop_code_pages(libraries: tuple[str, ...] = CODE_LIBRARIES) -> int:
    """Unmap from this process the pages of the shared libraries whose path contains one of
    `libraries` that it holds only as clean copies of the file: their code and read-only data
    (madvise MADV_DONTNEED on each read-only or executable private file mapping without a
    dirty page). Whatever runs there again faults its pages back in from the page cache, as
    after the system itself reclaimed them. Importing JAX leaves about 140 MB of jaxlib's code
    resident (its static initializers are spread over the whole library), and compiling
    touches XLA's and LLVM's passes, which serving never runs again: Engine.compile drops them
    before, between and after its compiles. Returns the bytes of the mappings advised; nothing where
    /proc/self/smaps is missing (not Linux) or KINETIC_DROP_CODE=0."""
    libc = _libc()
    if sys.platform != "linux" or libc is None or os.environ.get("KINETIC_DROP_CODE") == "0":
        return 0
    maps: list[list] = []   # [start, end, perms, path, dirty kB]
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()
                if not head:
                    continue
                if "-" in head[0] and not head[0].endswith(":"):
                    start, end = (int(x, 16) for x in head[0].split("-"))
                    maps.append([start, end, head[1], head[5] if len(head) > 5 else "", 1])
                elif head[0] == "Private_Dirty:" and maps:
                    maps[-1][4] = int(head[1])
    except (OSError, ValueError):
        return 0
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    dropped = 0
    for start, end, perms, path, dirty in maps:
        if (perms in ("r-xp", "r--p") and dirty == 0 and path.endswith(".so")
                and any(lib in path for lib in libraries)
                and madvise(start, end - start, _MADV_DONTNEED) == 0):
            dropped += end - start
    return dropped


def file_pages(path: str, address: int, size: int) -> list[tuple[int, int]]:
    """The whole memory pages of bytes [address, address + size) that this process maps from
    the file `path` (its file-backed mappings, not the anonymous pieces huge_pages put in
    their place), as (start, length) runs; [] where /proc/self/maps is missing."""
    page = os.sysconf("SC_PAGE_SIZE")
    lo, hi = -(-address // page) * page, (address + size) // page * page
    runs = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                head = line.split(maxsplit=5)
                if len(head) < 6 or head[5].strip() != path:
                    continue
                start, end = (int(x, 16) for x in head[0].split("-"))
                a, b = max(start, lo), min(end, hi)
                if a < b:
                    runs.append((a, b - a))
    except (OSError, ValueError):
        return []
    return runs


def drop_file_pages(runs: list[tuple[int, int]]) -> None:
    """Unmap `runs` (file_pages') from this process: they read the file's bytes again when
    next touched, faulted back in from the page cache. Only for bytes of a private file
    mapping that nothing has written (a write there would be lost): the token embedding that
    a step gathers rows of (Runner.drop_embedding_pages)."""
    libc = _libc()
    if libc is None or not runs:
        return
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for start, length in runs:
        madvise(start, length, _MADV_DONTNEED)


def resident_bytes() -> int | None:
    """This process's memory in use now (its resident set), or None where /proc has no statm
    (Ollama's /api/ps size, `kinetic serve`'s start line)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
