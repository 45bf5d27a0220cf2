"""Builds kinetic's native kernels (kinetic/kernels/csrc/*.cc) into one plain shared library,
`kinetic/kernels/_kinetic_kernels*.so`, that kinetic.kernels loads with ctypes and registers
with XLA's FFI. Everything else about the package is in pyproject.toml.

The library is compiled for baseline x86-64 (never -march=native): the AVX2 and AVX-512 paths
carry their own target attributes and are chosen at run time from CPUID. No -ffast-math, and
-ffp-contract=off so that no path fuses a multiply and an add that another path rounds twice
(DESIGN.md: the weight kernel is exact by construction).

The sources compile as many at once as the machine has cores, up to 8 (`KINETIC_BUILD_JOBS`
sets another count; setuptools compiles one extension's sources one after another).
"""

from __future__ import annotations

import glob
import importlib.util
import os
from concurrent.futures import ThreadPoolExecutor

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


def build_jobs() -> int:
    """Sources compiled at once: KINETIC_BUILD_JOBS, else the cores, at most 8 (each g++ -O2
    of a kernel source holds a few hundred MB)."""
    text = os.environ.get("KINETIC_BUILD_JOBS", "").strip()
    if not text:
        return max(1, min(8, os.cpu_count() or 1))
    if not text.isdigit() or int(text) < 1:
        raise SystemExit(f"KINETIC_BUILD_JOBS={text!r}: the sources to compile at once, 1 or more")
    return int(text)


def parallel_compile(compiler, jobs: int):
    """compiler.compile (distutils' CCompiler) with the sources that need it compiled `jobs`
    at a time, each its own compiler process; the objects in the sources' order, as
    compile returns them. Where this distutils lacks the steps it is made of, its own."""
    if jobs < 2 or not all(hasattr(compiler, name)
                           for name in ("_setup_compile", "_get_cc_args", "_compile")):
        return compiler.compile

    def compile_(sources, output_dir=None, macros=None, include_dirs=None, debug=0,
                 extra_preargs=None, extra_postargs=None, depends=None):
        macros, objects, extra, pp_opts, build = compiler._setup_compile(
            output_dir, macros, include_dirs, sources, depends, extra_postargs)
        cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)

        def one(obj):
            src, ext = build[obj]
            compiler._compile(obj, src, ext, cc_args, extra, pp_opts)

        with ThreadPoolExecutor(jobs) as pool:   # (up-to-date objects are not in build)
            list(pool.map(one, [obj for obj in objects if obj in build]))
        return objects
    return compile_


class BuildKernels(build_ext):
    """build_ext that compiles the sources in parallel (build_jobs) and fails with one clear
    line when there is no C++ compiler."""

    def build_extension(self, ext):
        self.compiler.compile = parallel_compile(self.compiler, build_jobs())
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
