"""Builds kinetic's native kernels (kinetic/kernels/csrc/*.cc) into one plain shared library,
`kinetic/kernels/_kinetic_kernels*.so`, that kinetic.kernels loads with ctypes and registers
with XLA's FFI. Everything else about the package is in pyproject.toml.

The library is compiled for baseline x86-64 (never -march=native): the AVX2 and AVX-512 paths
carry their own target attributes and are chosen at run time from CPUID. No -ffast-math, and
-ffp-contract=off so that no path fuses a multiply and an add that another path rounds twice
(DESIGN.md: the weight kernel is exact by construction).
"""

from __future__ import annotations

import glob
import importlib.util
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CSRC = os.path.join("kinetic", "kernels", "csrc")


def _xla_ffi_include() -> str:
    """jaxlib's XLA FFI headers (what jax.ffi.include_dir() returns), without importing jax."""
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("kinetic's build needs jaxlib for the XLA FFI headers "
                         "(pyproject.toml lists it as a build requirement)")
    return os.path.join(list(spec.submodule_search_locations)[0], "include")


class BuildKernels(build_ext):
    """build_ext that fails with one clear line when there is no C++ compiler."""

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:  # distutils' CompileError / LinkError, or a missing compiler
            raise SystemExit(
                "kinetic: could not build its C++ kernel (kinetic/kernels/csrc): "
                f"{e}\nkinetic needs a C++17 compiler: install g++ (Debian/Ubuntu: "
                "apt install g++) or clang++, then run pip install again.") from None


kernels = Extension(
    "kinetic.kernels._kinetic_kernels",
    sources=sorted(glob.glob(os.path.join(CSRC, "*.cc"))),
    depends=sorted(glob.glob(os.path.join(CSRC, "*.h"))),  # a changed header rebuilds all
    include_dirs=[CSRC, _xla_ffi_include()],
    language="c++",
    extra_compile_args=["-std=c++17", "-O2", "-ffp-contract=off", "-fno-fast-math",
                        "-fvisibility=hidden", "-Wall", "-Wextra", "-Wno-unused-parameter"],
    extra_link_args=["-pthread"],
)

setup(ext_modules=[kernels], cmdclass={"build_ext": BuildKernels})
