// The gated feed-forward's elementwise product, silu(gate) * up, in one fixed sequence of
// float32 operations per element (no libm, no fused multiply-add), the same bits on every
// instruction-set path and in the numpy reference (kernels/reference.py swiglu):
//
//   e = exp_any(-g)                 (exp_f32.h: the attention's exp, +inf past 88)
//   y = (g * (1 / (1 + e))) * u     (XLA's own silu, operation for operation, but its exp)
//
// XLA's silu runs as an elementwise fusion that its CPU runtime splits across its thread
// pool at a decode step's sizes; each split waited tens of microseconds for a sleeping
// thread (Qwen2.5-Coder-0.5B at 16 rows: 40-52 us a layer for 78k elements). Written as
// (1 if g >= 0 else e^g) / (1 + e^-|g|) instead, the product was as accurate (2.9 ulp at
// most against 2.1 for XLA's) but moved parity with llama.cpp's answers (SmolLM2 top-1
// 98.65% -> 98.21%, greedy-16 9 -> 8 of 10; docs/parity.md); XLA's order keeps them.
#pragma once

#include <cstdint>

namespace kn {

// y[i] = silu(g[i]) * u[i] for i < n, as above (on the active ISA path, split over the
// kernel's threads in fixed chunks: no element's bits depend on either).
void swiglu(const float* g, const float* u, int64_t n, float* y);

// The same on a chosen path (cpu.h Isa), one thread: the tests' entry.
void swiglu_isa(const float* g, const float* u, int64_t n, float* y, int isa);

}  // namespace kn
