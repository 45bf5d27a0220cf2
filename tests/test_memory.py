"""kinetic/memory.py: importing kinetic holds glibc's mmap threshold, so that big blocks a
program frees go back to the system instead of staying in the heap."""

import os
import platform
import subprocess
import sys

import pytest

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc",
                           reason="mallopt's threshold is glibc's (elsewhere hold_mmap_threshold does nothing)")

# Frees one 16 MB block (glibc, left alone, then raises its threshold to 16 MB), then holds 64
# blocks of 1 MB and frees all but the last: prints how much anonymous memory grew, in MB.
_PROGRAM = """
import sys
if sys.argv[1] == "kinetic":
    import kinetic
import numpy as np

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) // 1024

before = anon()
big = np.ones(16 << 18, np.float32)
del big
blocks = [np.ones(1 << 18, np.float32) for _ in range(64)]
del blocks[:-1]
print(anon() - before)
"""


def _growth(mode: str, env: dict[str, str]) -> int:
    out = subprocess.run([sys.executable, "-c", _PROGRAM, mode], env=env, check=True,
                         capture_output=True, text=True).stdout
    return int(out.split()[-1])


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    return {**env, **extra}


@glibc
def test_importing_kinetic_returns_freed_big_blocks_to_the_system():
    # without kinetic the 63 freed 1 MB blocks stay resident in the heap, with it they are gone
    assert _growth("plain", _env()) >= 48
    assert _growth("kinetic", _env()) <= 8


@glibc
def test_a_threshold_set_in_the_environment_is_left_as_set(monkeypatch):
    from kinetic import memory
    env = _env(MALLOC_MMAP_THRESHOLD_="33554432")
    # the user's 32 MB threshold keeps the 1 MB blocks in the heap, kinetic imported or not
    assert _growth("kinetic", env) >= 48
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "33554432")
    assert memory.hold_mmap_threshold() is False
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    assert memory.hold_mmap_threshold() is True
