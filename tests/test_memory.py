"""kinetic/memory.py: while Engine.compile runs, glibc's mmap threshold is held low, so that the
big blocks freed then go back to the system; after, the heap serves blocks up to 32 MB, so
that a step's buffers are reused warm instead of mapped anew on every call."""

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc",
    reason="mallopt's threshold is glibc's (elsewhere kinetic.memory does nothing)")

# Frees one 16 MB block (glibc, left alone, then raises its threshold to 16 MB), then holds 64
# blocks of 1 MB and frees all but the last: prints how much anonymous memory grew, in MB,
# inside memory.compiling() and after it (argv[1] "compiling" / "after"), or with kinetic
# untouched ("plain").
_PROGRAM = """
import sys
import numpy as np
from kinetic import memory

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) // 1024

def growth():
    before = anon()
    big = np.ones(16 << 18, np.float32)
    del big
    blocks = [np.ones(1 << 18, np.float32) for _ in range(64)]
    del blocks[:-1]
    out = anon() - before
    del blocks
    memory.release_memory()
    return out

if sys.argv[1] == "plain":
    print(growth())
elif sys.argv[1] == "compiling":
    with memory.compiling():
        print(growth())
else:
    with memory.compiling():
        pass
    print(growth())
"""


def _growth(mode: str, **env: str) -> int:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", _PROGRAM, mode], env={**base, **env},
                         check=True, capture_output=True, text=True).stdout
    return int(out.split()[-1])


def test_blocks_freed_while_compiling_go_back_to_the_system():
    # left alone, glibc keeps the 63 freed 1 MB blocks in the heap
    assert _growth("plain") >= 48
    assert _growth("compiling") <= 8


def test_after_compiling_the_heap_serves_blocks_up_to_32_mb():
    # a decode step's freed buffers stay for the next step, as glibc's raised threshold has it
    assert _growth("after") >= 48


def test_a_threshold_set_in_the_environment_is_left_as_set(monkeypatch):
    from kinetic import memory
    # the user's 32 MB threshold keeps the 1 MB blocks in the heap, even while compiling
    assert _growth("compiling", MALLOC_MMAP_THRESHOLD_="33554432") >= 48
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "33554432")
    assert memory.set_mmap_threshold(memory.COMPILE_THRESHOLD) is False
