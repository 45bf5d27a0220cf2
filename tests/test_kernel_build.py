"""The C++ kernel is built by `pip install` and chosen where it can run; the environment
variables that pick a kernel or an instruction-set path say clearly what is wrong."""

from __future__ import annotations

import os
import subprocess
import sys

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
