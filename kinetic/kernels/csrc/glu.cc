// glu.h: the per-element sequence written once over a lane count (glu_impl.h, GCC vector
// extensions), compiled three times: 1 lane (baseline), 8 (AVX2) and 16 (AVX-512F), the
// last two under target pragmas, each in its own namespace with its own copy of exp_f32.h.
// The lanes hold independent elements, each fed glu.h's operations in order
// (-ffp-contract=off keeps the multiplies and adds apart), and the last n % W elements take
// the 1-lane sequence: every path gives the same bits.
#include "glu.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"
#include "cpu.h"
#include "pool.h"

namespace kn {

#define KN_GLU_W 1
#define KN_GLU_NS w1
#include "glu_impl.h"
#undef KN_GLU_W
#undef KN_GLU_NS

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2")
#define KN_GLU_W 8
#define KN_GLU_NS w8
#include "glu_impl.h"
#undef KN_GLU_W
#undef KN_GLU_NS
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f")
#define KN_GLU_W 16
#define KN_GLU_NS w16
#include "glu_impl.h"
#undef KN_GLU_W
#undef KN_GLU_NS
#pragma GCC pop_options
#endif

namespace {

using RowsFn = void (*)(const float*, const float*, int64_t, float*);

RowsFn rows_for(int isa) {
#if defined(__x86_64__)
  if (isa >= ISA_AVX512) return w16::rows;
  if (isa >= ISA_AVX2) return w8::rows;
#endif
  (void)isa;
  return w1::rows;
}

constexpr int64_t kChunk = 16384;  // elements a thread takes at a time (a multiple of 16)

}  // namespace

void swiglu_isa(const float* g, const float* u, int64_t n, float* y, int isa) {
  rows_for(isa)(g, u, n, y);
}

void swiglu(const float* g, const float* u, int64_t n, float* y) {
  const RowsFn fn = rows_for(active_isa());
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  if (chunks <= 1) return fn(g, u, n, y);
  pool_run(chunks, [&](int64_t c) {
    const int64_t i = c * kChunk, m = n - i < kChunk ? n - i : kChunk;
    fn(g + i, u + i, m, y + i);
  });
}

}  // namespace kn
