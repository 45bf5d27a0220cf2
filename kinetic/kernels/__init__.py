"""kinetic's native kernels: the quantized weight matmul (and the embedding row gather) in
C++, called from jitted JAX through the XLA FFI on CPU.

The library (`_kinetic_kernels*.so`, built by `pip install` from csrc/) is a plain shared
library loaded with ctypes. Its C ABI (`kn_*`) is what tests and bench/kernel.py call
directly; its FFI handlers are registered with XLA once, at import.

    available()          whether the library is built and loaded here
    isa()                the instruction-set path in use: "scalar", "avx2" or "avx512"
    supported_isas()     every path this CPU can run (tests sweep them)
    qmatmul_host(...)    y = x . W^T on numpy arrays, on a chosen path and thread count
    qmatmul_id_host(...) a mixture of experts' projection over (row, expert) pairs
    delta_rule_host(...) Qwen3.5's gated delta rule over a step's rows
    dequant_rows_host()  rows of W as float32
    repack16_host(...)   a weight rearranged in place into the 16-column layout (REPACK16)
    release_pages(...)   memory pages handed back to the system (a cache's passed rows)

KINETIC_KERNEL_ISA=scalar|avx2|avx512 forces a path (every path gives the same bits); a name
this CPU cannot run is an error at import, naming the paths it can.
"""

from __future__ import annotations

import ctypes
import glob
import os

import numpy as np

ISAS = ("scalar", "avx2", "avx512")
_DIR = os.path.dirname(os.path.abspath(__file__))


class KernelError(RuntimeError):
    """The native library is missing, or it refused a call (the message says why)."""


def _load() -> ctypes.CDLL | None:
    found = sorted(glob.glob(os.path.join(_DIR, "_kinetic_kernels*.so")))
    if not found:
        return None
    lib = ctypes.CDLL(found[0])
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.kn_qmatmul.argtypes = [i32, ptr, i64, i64, ptr, i64, ptr, i32, i32, ctypes.c_char_p, i32]
    lib.kn_qmatmul_rows.argtypes = [i32, ptr, i64, i64, ptr, i64, ptr, ptr, i32, i32,
                                    ctypes.c_char_p, i32]
    lib.kn_dequant_rows.argtypes = [i32, ptr, i64, i64, ptr, i64, ptr, ctypes.c_char_p, i32]
    lib.kn_qmatmul_id.argtypes = [i32, ptr, i64, i64, i64, i64, ptr, i64, ptr, i64, ptr, i32,
                                  i32, ctypes.c_char_p, i32]
    lib.kn_delta_rule.argtypes = [ptr, ctypes.c_float, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64,
                                  ptr, i32, i32, ctypes.c_char_p, i32]
    lib.kn_isa_supported.argtypes = [i32]
    lib.kn_swiglu.argtypes = [ptr, ptr, i64, ptr, i32, ctypes.c_char_p, i32]
    lib.kn_hadamard.argtypes = [ptr, ptr, i64, i64, i64, ctypes.c_char_p, i32]
    lib.kn_row_bytes.argtypes = [i32, i64]
    lib.kn_row_bytes.restype = i64
    lib.kn_repack16.argtypes = [i32, ptr, i64, i64, ctypes.c_char_p, i32]
    lib.kn_lazy_zero.argtypes = [ptr, i64]
    lib.kn_lazy_zero.restype = i64
    lib.kn_release_pages.argtypes = [ctypes.c_size_t, i64]
    lib.kn_release_pages.restype = i64
    lib.kn_json_floats.argtypes = [ptr, i64, ptr, i64]
    lib.kn_json_floats.restype = i64
    return lib


_lib = _load()


def available() -> bool:
    return _lib is not None


def _need() -> ctypes.CDLL:
    if _lib is None:
        raise KernelError("kinetic's C++ kernel is not built here: run `pip install -e .` in "
                          "the repository (it needs a C++ compiler)")
    return _lib


def supported_isas() -> list[str]:
    lib = _need()
    return [name for i, name in enumerate(ISAS) if lib.kn_isa_supported(i)]


def _check_env() -> None:
    want = os.environ.get("KINETIC_KERNEL_ISA", "")
    if not want or _lib is None:
        return
    if want not in ISAS:
        raise KernelError(f"KINETIC_KERNEL_ISA={want!r} is not a kernel path "
                          f"(choose one of {', '.join(ISAS)})")
    if want not in supported_isas():
        raise KernelError(f"KINETIC_KERNEL_ISA={want!r}: this CPU cannot run it "
                          f"(it can run {', '.join(supported_isas())})")


_check_env()


def isa() -> str:
    """The path the FFI kernels take in this process."""
    return ISAS[_need().kn_active_isa()]


def describe(kernel: str) -> dict:
    """What multiplies the weights, for /props and the start-up line: {"name": "ffi", "xla"
    or "pallas", "backend": JAX's ("cpu", "gpu"), "isa": the path (ffi only)}."""
    import jax
    out = {"name": kernel, "backend": jax.default_backend()}
    return {**out, "isa": isa()} if kernel == "ffi" else out


def row_bytes(fmt: int, k: int) -> int:
    return int(_need().kn_row_bytes(int(fmt), int(k)))


def _call(fn, *args) -> None:
    err = ctypes.create_string_buffer(256)
    if fn(*args, err, len(err)):
        raise KernelError(err.value.decode())


def _weight_bytes(w: np.ndarray, fmt: int, n: int, k: int) -> np.ndarray:
    """w as contiguous uint8 bytes, checked to hold n rows of k values of `fmt` (the C side
    takes no length: a short buffer must not reach it)."""
    w = np.ascontiguousarray(w).view(np.uint8).reshape(-1)
    if w.size < n * row_bytes(fmt, k):
        raise ValueError(f"{w.size} bytes cannot hold {n} rows of {row_bytes(fmt, k)} bytes")
    return w


def qmatmul_host(fmt: int, w: np.ndarray, n: int, k: int, x: np.ndarray,
                 isa: str | None = None, threads: int = 1) -> np.ndarray:
    """x [M, K] float32 . W^T, W being n rows of k values in GGML type `fmt` (raw bytes w).
    Returns float32 [M, n]. isa: a path from supported_isas() (default: the active one)."""
    lib = _need()
    w = _weight_bytes(w, fmt, n, k)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {x.shape}")
    y = np.empty((x.shape[0], n), np.float32)
    code = ISAS.index(isa) if isa is not None else lib.kn_active_isa()
    _call(lib.kn_qmatmul, int(fmt), w.ctypes.data, n, k, x.ctypes.data, x.shape[0],
          y.ctypes.data, code, int(threads))
    return y


def swiglu_host(g: np.ndarray, u: np.ndarray, isa: str | None = None) -> np.ndarray:
    """silu(g) * u elementwise (csrc/glu.h; reference.swiglu is the same arithmetic), float32,
    on a path from supported_isas() (default: the active one)."""
    lib = _need()
    g = np.ascontiguousarray(g, dtype=np.float32)
    u = np.ascontiguousarray(u, dtype=np.float32)
    if g.shape != u.shape:
        raise ValueError(f"g {g.shape} and u {u.shape} must have one shape")
    y = np.empty_like(g)
    code = ISAS.index(isa) if isa is not None else lib.kn_active_isa()
    _call(lib.kn_swiglu, g.ctypes.data, u.ctypes.data, g.size, y.ctypes.data, code)
    return y


def hadamard_host(x: np.ndarray, n: int) -> np.ndarray:
    """Each block of n values of x's last axis rotated (csrc/hadamard.h; reference.hadamard
    is the same arithmetic), float32."""
    lib = _need()
    x = np.ascontiguousarray(x, dtype=np.float32)
    y = np.empty_like(x)
    width = x.shape[-1] if x.ndim else 1
    _call(lib.kn_hadamard, x.ctypes.data, y.ctypes.data, x.size // max(width, 1), width, int(n))
    return y


def qmatmul_rows_host(fmt: int, w: np.ndarray, n: int, k: int, x: np.ndarray,
                     live: np.ndarray, y: np.ndarray, isa: str | None = None,
                     threads: int = 1) -> np.ndarray:
    """qmatmul_host over the rows m of x [M, k] with live[m] != 0 (csrc/qmatmul_api.h,
    qmatmul_rows): each such row's result is written to row m of y ([M, n] float32, in
    place), and every other row of y is left as it was. Returns y."""
    lib = _need()
    w = _weight_bytes(w, fmt, n, k)
    x = np.ascontiguousarray(x, dtype=np.float32)
    live = np.ascontiguousarray(live, dtype=np.int32)
    if x.ndim != 2 or x.shape[1] != k or live.shape != (x.shape[0],):
        raise ValueError(f"x must be [M, {k}] and live [M], got {x.shape} and {live.shape}")
    if y.shape != (x.shape[0], n) or y.dtype != np.float32 or not y.flags.c_contiguous:
        raise ValueError(f"y must be a C-contiguous float32 [{x.shape[0]}, {n}]")
    code = ISAS.index(isa) if isa is not None else lib.kn_active_isa()
    _call(lib.kn_qmatmul_rows, int(fmt), w.ctypes.data, n, k, x.ctypes.data, x.shape[0],
          live.ctypes.data, y.ctypes.data, code, int(threads))
    return y


def qmatmul_id_host(fmt: int, w: np.ndarray, stride: int, n_expert: int, n: int, k: int,
                    x: np.ndarray, ids: np.ndarray, isa: str | None = None,
                    threads: int = 1) -> np.ndarray:
    """A mixture of experts' projection (csrc/qmatmul_api.h, qmatmul_id): x [R, k] float32,
    ids [R, S] int32 (the S experts each row chose; S = 1 with x a row per pair); expert e's
    weight is n rows of k values in `fmt` starting e * stride bytes into w. Returns float32
    [R, S, n]: pair (r, s) is qmatmul_host(x[r], expert ids[r, s]'s weight)."""
    lib = _need()
    w = np.ascontiguousarray(w).view(np.uint8).reshape(-1)
    if w.size < (n_expert - 1) * stride + n * lib.kn_row_bytes(int(fmt), k):
        raise ValueError("the experts' weights do not fit w")
    x = np.ascontiguousarray(x, dtype=np.float32)
    ids = np.ascontiguousarray(ids, dtype=np.int32)
    if x.ndim != 2 or x.shape[1] != k or ids.ndim != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"x must be [R, {k}] and ids [R, S], got {x.shape} and {ids.shape}")
    y = np.empty((*ids.shape, n), np.float32)
    code = ISAS.index(isa) if isa is not None else lib.kn_active_isa()
    _call(lib.kn_qmatmul_id, int(fmt), w.ctypes.data, int(stride), int(n_expert), n, k,
          x.ctypes.data, x.shape[0], ids.ctypes.data, ids.shape[1], y.ctypes.data, code,
          int(threads))
    return y


def delta_rule_host(taps, windows, matrices, pending, events, rows, replay, n_replay: int,
                    heads: int, key_heads: int, eps: float, isa: str | None = None,
                    threads: int = 1):
    """csrc/delta_rule.h on numpy arrays (ffi.delta_rule's arguments), on a chosen path:
    (out [T, H, d], windows, matrices, pending), the states as new arrays."""
    lib = _need()
    f32 = lambda a: np.array(a, np.float32, order="C")   # noqa: E731 - copies
    taps, windows, matrices, pending, events = map(f32, (taps, windows, matrices, pending,
                                                         events))
    rows = np.ascontiguousarray(rows, np.int32)
    replay = np.ascontiguousarray(replay, np.int32)
    C, n_taps = taps.shape
    S, _, d, _ = matrices.shape
    shape = np.array([C, heads, key_heads, d, n_taps, S, pending.shape[0], pending.shape[1],
                      events.shape[0], replay.shape[1]], np.int64)
    if (windows.shape != (S, n_taps - 1, C) or rows.shape != (4, events.shape[0])
            or replay.shape[0] != 2 or pending.shape[2] != events.shape[1]):
        raise ValueError("delta_rule_host: shapes that do not fit together")
    out = np.zeros((events.shape[0], heads, d), np.float32)
    code = ISAS.index(isa) if isa is not None else lib.kn_active_isa()
    _call(lib.kn_delta_rule, shape.ctypes.data, ctypes.c_float(eps), taps.ctypes.data,
          windows.ctypes.data, matrices.ctypes.data, pending.ctypes.data, events.ctypes.data,
          rows.ctypes.data, replay.ctypes.data, int(n_replay), out.ctypes.data, code,
          int(threads))
    return out, windows, matrices, pending


# The format id flag of the 16-column layout (csrc/repack.h): fmt | REPACK16 is fmt's blocks
# rearranged so that the AVX-512 path reads 16 columns' blocks as the vectors it multiplies.
REPACK16 = 256
REPACKABLE = (2, 3, 6, 7, 8, 10, 11, 12, 13, 14)  # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K .. Q6_K


def repack16_host(fmt: int, w: np.ndarray, n: int, k: int) -> int:
    """Rearrange the n rows of k values of `fmt` (a writable contiguous uint8 array, holding
    at least their bytes) in place into the 16-column layout; returns fmt | REPACK16, the id
    to multiply them with. Every path gives the plain weight's bits for it."""
    if not (isinstance(w, np.ndarray) and w.dtype == np.uint8 and w.flags.c_contiguous
            and w.flags.writeable):
        raise ValueError("repack16_host needs a writable contiguous uint8 array")
    _weight_bytes(w, fmt, n, k)
    _call(_need().kn_repack16, int(fmt), w.ctypes.data, n, k)
    return int(fmt) | REPACK16


def lazy_zero_host(a: np.ndarray) -> int:
    """Zero the contiguous array a in place as the KV cache is zeroed (csrc/lazyzero.h):
    its whole memory pages handed back to the system, the rest memset. Returns the bytes
    handed back."""
    if not a.flags.c_contiguous:
        raise ValueError("lazy_zero_host needs a contiguous array")
    return int(_need().kn_lazy_zero(a.ctypes.data, a.nbytes))


def release_pages(address: int, nbytes: int) -> int:
    """Hand the whole memory pages inside nbytes bytes at host address `address` back to the
    system (csrc/lazyzero.h release_pages: they read as zeros after, and take no memory
    until written; the partial pages at either end are left as they are). Returns the bytes
    handed back. Only for memory whose values nobody reads again."""
    return int(_need().kn_release_pages(int(address), int(nbytes))) if nbytes > 0 else 0


def dequant_rows_host(fmt: int, w: np.ndarray, n: int, k: int, rows) -> np.ndarray:
    """The rows `rows` of W (n x k, GGML type fmt) as float32 [len(rows), k]."""
    lib = _need()
    w = _weight_bytes(w, fmt, n, k)
    rows = np.ascontiguousarray(rows, dtype=np.int32)
    out = np.empty((rows.size, k), np.float32)
    _call(lib.kn_dequant_rows, int(fmt), w.ctypes.data, n, k, rows.ctypes.data, rows.size,
          out.ctypes.data)
    return out


def json_floats(v: np.ndarray) -> str | None:
    """A float32 vector as the JSON text json.dumps(v.tolist()) writes, with no spaces, in
    C++ (Python's float repr takes tens of ms over an embeddings answer). None where the
    library is not built or a value is not finite: then json.dumps is the way."""
    if _lib is None:
        return None
    x = np.ascontiguousarray(v, dtype=np.float32).ravel()
    out = ctypes.create_string_buffer(2 + len(x) * _JSON_FLOAT_CHARS)
    n = _lib.kn_json_floats(x.ctypes.data, len(x), out, len(out))
    return out.raw[:n].decode("ascii") if n >= 0 else None


_JSON_FLOAT_CHARS = 32   # float_json.h's kJsonFloatChars
