"""The C library's heap: what kinetic asks of glibc's malloc so that a serving process holds
the memory it uses, not the most it ever used (docs/architecture.md, "Memory").

XLA's CPU runtime allocates every executable's buffers with malloc: a decode step's temporary
block and its logits (16 MB a step at 16 rows of a 262,144-token vocabulary) are allocated and
freed on every call. glibc serves blocks above its mmap threshold (128 KB at start) with mmap
and hands them back on free, but after the first such free it raises the threshold to that
block's size (up to 32 MB), and from then on blocks of that size come from the heap, where
freed ones stay resident between the blocks still in use. Gemma 3 270M serving 16 streams grew
by 80 MB more that way than with the threshold held (`kinetic serve` at `-np 16`, rounds of
1 to 16 concurrent requests, docs/performance.md). Setting the threshold explicitly holds it.

Elsewhere than glibc (musl, macOS) both calls do nothing.
"""

from __future__ import annotations

import ctypes
import os

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD = 128 * 1024  # glibc's own starting value, kept instead of raised


def _libc():
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def hold_mmap_threshold() -> bool:
    """Keep blocks of MMAP_THRESHOLD bytes and more out of the heap for the whole process
    (each is mapped on malloc and unmapped on free). A threshold the user set in the
    environment (MALLOC_MMAP_THRESHOLD_) is left as set. True where it was applied."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def release_memory() -> None:
    """Hand the memory the C library keeps after frees back to the system (glibc's
    malloc_trim; nothing elsewhere)."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)
