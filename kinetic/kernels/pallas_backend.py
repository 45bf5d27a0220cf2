"""How the pallas kernels run: interpreted on a CPU, lowered through Triton for a GPU.

JAX 0.10 lowers a `pl.pallas_call` on a GPU through Mosaic GPU unless the call names Triton
(its `jax_pallas_use_mosaic_gpu` default). kinetic's kernels are written for Triton's model
(one program per output tile, blocks loaded from refs, every array's sizes powers of 2), so
every call names it: `options` gives the keyword arguments of a pallas_call for both cases.
"""

from __future__ import annotations

from jax.experimental.pallas import triton as pltriton

from kinetic.kernels import target


def interpreted(interpret: bool | None) -> bool:
    """interpret=None: interpreted unless the step is traced for a GPU (kernels/target.py)."""
    return target.backend() != "gpu" if interpret is None else bool(interpret)


def options(interpret: bool, num_warps: int = 4, num_stages: int = 2) -> dict:
    """pallas_call keyword arguments: interpret mode, or Triton's lowering with these
    launch parameters (they change speed, never a row's arithmetic)."""
    if interpret:
        return {"interpret": True}
    return {"compiler_params": pltriton.CompilerParams(num_warps=num_warps,
                                                       num_stages=num_stages)}
