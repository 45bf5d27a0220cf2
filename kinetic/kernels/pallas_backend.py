"""How the pallas kernels run: interpreted on a CPU, lowered through Triton for a GPU.

JAX 0.10 lowers a `pl.pallas_call` on a GPU through Mosaic GPU unless the call names Triton
(its `jax_pallas_use_mosaic_gpu` default). kinetic's kernels are written for Triton's model
(one program per output tile, blocks loaded from refs, every array's sizes powers of 2), so
every call names it: `options` gives the keyword arguments of a pallas_call for both cases.
"""

from __future__ import annotations

from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kinetic.kernels import target


def interpreted(interpret: bool | None) -> bool:
    """interpret=None: interpreted unless the step is traced for a GPU (kernels/target.py)."""
    return target.backend() != "gpu" if interpret is None else bool(interpret)


def load_sum(ref, at: tuple, mask=None):
    """Inside a kernel: the sum of ref's blocks at `at` over its first axis (a matmul's
    partial sums over the chunks of its K: pallas_matmul's partials), added in order, as
    pallas_matmul.summed adds them, the positions off `mask` zeros (not read; None: all
    read)."""
    total = None
    for c in range(ref.shape[0]):
        at_c = ref.at[(pl.ds(c, 1), *at)]
        part = (at_c[...] if mask is None
                else pltriton.load(at_c, mask=mask[None], other=0.0))[0]
        total = part if total is None else total + part
    return total


def barrier(interpret: bool) -> None:
    """Inside a kernel: a barrier between the program's threads (Triton's debug_barrier: the
    stores before it seen by the loads after it). Interpreted, a program is one sequence of
    array operations, already in order: nothing to emit."""
    if not interpret:
        pltriton.debug_barrier()


def options(interpret: bool, num_warps: int = 4, num_stages: int = 2) -> dict:
    """pallas_call keyword arguments: interpret mode, or Triton's lowering with these
    launch parameters (they change speed, never a row's arithmetic)."""
    if interpret:
        return {"interpret": True}
    return {"compiler_params": pltriton.CompilerParams(num_warps=num_warps,
                                                       num_stages=num_stages)}
