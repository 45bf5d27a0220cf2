"""The kernels built with AddressSanitizer and UndefinedBehaviorSanitizer
(scripts/sanitize_kernels.sh): every format and ISA path this CPU has, threads, attention and
the row pieces, in a standalone self-test. A bad access, undefined behaviour, a leak or a
path that disagrees with the reference fails it."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_sanitized_selftest(tmp_path):
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler here to build the sanitized self-test")
    done = subprocess.run([str(ROOT / "scripts" / "sanitize_kernels.sh")], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all paths agree" in done.stdout
