"""The backend a step is traced for: JAX's default one, or a GPU inside `for_gpu()`.

Which kernels a step uses is decided at trace time from it: the C++ FFI pieces only for a
CPU (kernels/ffi.py `usable`), the pallas kernels interpreted unless for a GPU
(kernels/pallas_backend.py). `for_gpu` lets a machine without a GPU trace a step as a GPU
would run it and lower it for CUDA (`lower(lowering_platforms=("cuda",))`), which
tests/test_pallas_lowering.py does to check that every kernel has a Triton lowering.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

_FOR_GPU = contextvars.ContextVar("kinetic_trace_for_gpu", default=False)


def backend() -> str:
    """"gpu" inside for_gpu(), else JAX's default backend ("cpu", "gpu", ...)."""
    return "gpu" if _FOR_GPU.get() else jax.default_backend()


@contextlib.contextmanager
def for_gpu():
    """Trace steps as for a GPU (module docstring), whatever this machine has. JAX's trace
    caches do not know of it, so they are cleared on the way in and out: no trace made for
    the CPU is reused inside, and none made inside is reused after."""
    token = _FOR_GPU.set(True)
    jax.clear_caches()
    try:
        yield
    finally:
        _FOR_GPU.reset(token)
        jax.clear_caches()
