// The gated feed-forward's elementwise product, silu(gate) * up, in one fixed sequence of
// float32 operations per element (no libm, no fused multiply-add), the same bits on every
// instruction-set path and in the numpy reference (kernels/reference.py swiglu):
//
//   t = exp_softmax(-|g|)                       (exp_f32.h; e^-|g| in (0, 1], 0 below -86)
//   s = (g >= 0 ? 1 : t) / (1 + t)              (the sigmoid of g, from e^-|g| only)
//   y = (g * s) * u
//
// XLA's own silu runs as an elementwise fusion that its CPU runtime splits across its thread
// pool at a decode step's sizes; each split waited tens of microseconds for a sleeping
// thread (Qwen2.5-Coder-0.5B at 16 rows: 40-52 us a layer for 78k elements).
#pragma once

#include <cstdint>

namespace kn {

// y[i] = silu(g[i]) * u[i] for i < n, as above (on the active ISA path, split over the
// kernel's threads in fixed chunks: no element's bits depend on either).
void swiglu(const float* g, const float* u, int64_t n, float* y);

// The same on a chosen path (cpu.h Isa), one thread: the tests' entry.
void swiglu_isa(const float* g, const float* u, int64_t n, float* y, int isa);

}  // namespace kn
