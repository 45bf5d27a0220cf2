"""The C++ kernel is built by `pip install` and chosen where it can run; the environment
variables that pick a kernel or an instruction-set path say clearly what is wrong."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kinetic import kernels
from kinetic.model.config import ModelConfigError
from kinetic.model.weights import kernel_choice


def test_the_library_is_built_and_loaded():
    assert kernels.available(), "pip install -e . should have built kinetic/kernels/_kinetic_kernels*.so"
    assert kernels.isa() in kernels.supported_isas()
    assert kernels.supported_isas()[0] == "scalar"  # the reference path runs anywhere


def test_kernel_choice():
    assert kernel_choice("xla") == "xla"
    assert kernel_choice("ffi") == "ffi"
    with pytest.raises(ModelConfigError, match="unknown kernel 'gpu'"):
        kernel_choice("gpu")


def _import_with(env: dict) -> subprocess.CompletedProcess:
    code = "from kinetic import kernels; print(kernels.isa())"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)


def test_isa_variable_forces_a_path():
    done = _import_with({"KINETIC_KERNEL_ISA": "scalar"})
    assert done.returncode == 0 and done.stdout.strip() == "scalar"


def test_isa_variable_with_an_unknown_name_is_one_clear_error():
    done = _import_with({"KINETIC_KERNEL_ISA": "neon"})
    assert done.returncode != 0
    assert "KINETIC_KERNEL_ISA='neon' is not a kernel path (choose one of scalar, avx2, avx512)" \
        in done.stderr


def test_kernel_variable_picks_the_xla_path(tmp_path):
    code = ("from kinetic.model.weights import kernel_choice; print(kernel_choice())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "KINETIC_KERNEL": "xla"}, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "xla"


_PREFETCH_PRODUCT = """
import hashlib, numpy as np
from kinetic import kernels
from tests.test_kernel_ffi import Q4_K, Q5_0, Q8_0, random_blocks
rng = np.random.default_rng(0)
n, k = 48, 512
x = rng.standard_normal((5, k)).astype(np.float32)
out = hashlib.sha256()
for fmt in (Q8_0, Q4_K, Q5_0):
    w = random_blocks(fmt, n, k, rng)
    for isa in kernels.supported_isas():
        for threads in (1, 2):
            out.update(kernels.qmatmul_host(fmt, w, n, k, x, isa, threads).tobytes())
    if "avx512" in kernels.supported_isas():
        r = w.copy()
        rfmt = kernels.repack16_host(fmt, r, n, k)
        out.update(kernels.qmatmul_host(rfmt, r, n, k, x, "avx512", 2).tobytes())
print(out.hexdigest())
"""


def test_software_prefetch_on_or_off_gives_the_same_bits():
    """KINETIC_PREFETCH=0|1 (csrc/cpu.h, software_prefetch: off by default on AMD CPUs before Zen 5)
    moves only where the time goes: every path, plain and repacked, gives the same bits."""
    digests = set()
    for value in ("0", "1"):
        done = subprocess.run([sys.executable, "-c", _PREFETCH_PRODUCT], capture_output=True,
                              text=True, env={**os.environ, "KINETIC_PREFETCH": value},
                              cwd=Path(__file__).resolve().parent.parent, timeout=300)
        assert done.returncode == 0, done.stderr
        digests.add(done.stdout.strip())
    assert len(digests) == 1 and len(digests.pop()) == 64
