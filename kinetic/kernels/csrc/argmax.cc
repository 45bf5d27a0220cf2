#include "argmax.h"

#include <cmath>
#include <limits>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace kn {
namespace {

// The largest non-NaN value of x[0..v) (-inf if none). A maximum does not depend on the
// order it is taken in (+0 and -0 aside, which compare equal, and equality is all the
// caller asks of it), so 16 lanes over the row then met give the scalar loop's value. On
// x86-64, four SSE2 registers (baseline: no run-time choice): maxps(x, m) is x > m ? x : m,
// m for a NaN x, as the scalar loop's comparison.
float row_max(const float* x, int64_t v) {
  const float neg = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  float top = neg;
#if defined(__SSE2__)
  __m128 m0 = _mm_set1_ps(neg), m1 = m0, m2 = m0, m3 = m0;
  for (; i + 16 <= v; i += 16) {
    m0 = _mm_max_ps(_mm_loadu_ps(x + i), m0);
    m1 = _mm_max_ps(_mm_loadu_ps(x + i + 4), m1);
    m2 = _mm_max_ps(_mm_loadu_ps(x + i + 8), m2);
    m3 = _mm_max_ps(_mm_loadu_ps(x + i + 12), m3);
  }
  alignas(16) float lanes[16];
  _mm_store_ps(lanes, m0);
  _mm_store_ps(lanes + 4, m1);
  _mm_store_ps(lanes + 8, m2);
  _mm_store_ps(lanes + 12, m3);
  for (float l : lanes) top = l > top ? l : top;
#endif
  for (; i < v; ++i) top = x[i] > top ? x[i] : top;
  return top;
}

// The first i < v with x[i] == top (top is finite and in x, so there is one; v if not).
int64_t first_equal(const float* x, int64_t v, float top) {
  int64_t i = 0;
#if defined(__SSE2__)
  const __m128 t = _mm_set1_ps(top);
  for (; i + 4 <= v; i += 4) {
    const int hit = _mm_movemask_ps(_mm_cmpeq_ps(_mm_loadu_ps(x + i), t));
    if (hit) return i + __builtin_ctz(unsigned(hit));
  }
#endif
  for (; i < v; ++i)
    if (x[i] == top) return i;
  return v;
}

}  // namespace

void row_argmax(const float* x, int64_t rows, int64_t v, int32_t* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * v;
    const float top = row_max(row, v);
    out[r] = std::isfinite(top) ? int32_t(first_equal(row, v, top)) : -1;
  }
}

}  // namespace kn
