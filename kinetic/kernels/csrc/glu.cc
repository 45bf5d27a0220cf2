// glu.h: the per-element sequence written once over a lane count (GCC vector extensions),
// compiled three times: 1 lane (baseline), 8 (AVX2) and 16 (AVX-512F), the last two under
// target pragmas, each in its own namespace with its own copy of exp_f32.h. The lanes hold
// independent elements, each fed glu.h's operations in order (-ffp-contract=off keeps the
// multiplies and adds apart), and the last n % W elements take the 1-lane sequence: every
// path gives the same bits.
#include "glu.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"
#include "cpu.h"
#include "pool.h"

#define KN_GLU_BODY                                                                        \
  template <class T, class TU>                                                             \
  inline T silu_times(T g, T u) {                                                          \
    const T e = exp_any<T, TU>(-g);                                                        \
    const T one = T{} + 1.0f;                                                              \
    return (g * (one / (one + e))) * u;                                                    \
  }

namespace kn {

namespace w1 {
namespace {
#include "exp_f32.h"
KN_GLU_BODY
}  // namespace
void rows(const float* g, const float* u, int64_t n, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = silu_times<float, uint32_t>(g[i], u[i]);
}
}  // namespace w1

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2")
namespace w8 {
namespace {
typedef float V __attribute__((vector_size(32)));
typedef uint32_t VU __attribute__((vector_size(32)));
#define KN_EXP_V V
#define KN_EXP_VU VU
#include "exp_f32.h"
#undef KN_EXP_V
#undef KN_EXP_VU
KN_GLU_BODY
}  // namespace
void rows(const float* g, const float* u, int64_t n, float* y) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    V a, b;
    std::memcpy(&a, g + i, sizeof(V));
    std::memcpy(&b, u + i, sizeof(V));
    const V r = silu_times<V, VU>(a, b);
    std::memcpy(y + i, &r, sizeof(V));
  }
  w1::rows(g + i, u + i, n - i, y + i);
}
}  // namespace w8
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f")
namespace w16 {
namespace {
typedef float V __attribute__((vector_size(64)));
typedef uint32_t VU __attribute__((vector_size(64)));
#define KN_EXP_V V
#define KN_EXP_VU VU
#include "exp_f32.h"
#undef KN_EXP_V
#undef KN_EXP_VU
KN_GLU_BODY
}  // namespace
void rows(const float* g, const float* u, int64_t n, float* y) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    V a, b;
    std::memcpy(&a, g + i, sizeof(V));
    std::memcpy(&b, u + i, sizeof(V));
    const V r = silu_times<V, VU>(a, b);
    std::memcpy(y + i, &r, sizeof(V));
  }
  w1::rows(g + i, u + i, n - i, y + i);
}
}  // namespace w16
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
