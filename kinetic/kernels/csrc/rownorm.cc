#include "rownorm.h"

#include <cmath>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu.h"
#include "qmatmul.h"

namespace kn {

namespace {

// lanes[i % 16] = lanes[i % 16] + x[i] * x[i] for i in order (lanes start at zero): on x86-64
// four SSE2 registers hold the 16 lanes (baseline, no run-time choice), each lane the
// scalar loop's sequence of rounded products and sums (the build never fuses them). Kept in
// an array, the lanes cost a store and a load per element.
void square_lanes(const float* x, int64_t d, float* lanes) {
  int64_t i = 0;
#if defined(__SSE2__)
  __m128 a[4] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
  for (; i + 16 <= d; i += 16)
    for (int j = 0; j < 4; ++j) {
      const __m128 v = _mm_loadu_ps(x + i + 4 * j);
      a[j] = _mm_add_ps(a[j], _mm_mul_ps(v, v));
    }
  for (int j = 0; j < 4; ++j) _mm_storeu_ps(lanes + 4 * j, a[j]);
#endif
  for (; i < d; ++i) lanes[i % 16] = lanes[i % 16] + x[i] * x[i];
}

// y[i] = (x[i] * inv) * w[i], four at a time where SSE2 is (the same two roundings).
void scale_rows(const float* x, float inv, const float* w, int64_t d, float* y) {
  int64_t i = 0;
#if defined(__SSE2__)
  const __m128 s = _mm_set1_ps(inv);
  for (; i + 4 <= d; i += 4)
    _mm_storeu_ps(y + i, _mm_mul_ps(_mm_mul_ps(_mm_loadu_ps(x + i), s), _mm_loadu_ps(w + i)));
#endif
  for (; i < d; ++i) y[i] = (x[i] * inv) * w[i];
}

#if defined(__x86_64__)
// The same two loops on CPUs of the AVX2 path and up (target attributes, as
// quantize_avx2.cc): lanes 0..7 and 8..15 of the 16 as two 256-bit registers, each lane the
// scalar sequence (a rounded product, then the add); the scaling 8 values at a time, the
// same two roundings. So the same bits as the SSE2 loops.
#define KN_AVX2 __attribute__((target("avx2")))
KN_AVX2 void square_lanes_avx2(const float* x, int64_t d, float* lanes) {
  int64_t i = 0;
  __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
  for (; i + 16 <= d; i += 16) {
    const __m256 u = _mm256_loadu_ps(x + i), v = _mm256_loadu_ps(x + i + 8);
    a = _mm256_add_ps(a, _mm256_mul_ps(u, u));
    b = _mm256_add_ps(b, _mm256_mul_ps(v, v));
  }
  _mm256_storeu_ps(lanes, a);
  _mm256_storeu_ps(lanes + 8, b);
  for (; i < d; ++i) lanes[i % 16] = lanes[i % 16] + x[i] * x[i];
}

KN_AVX2 void scale_rows_avx2(const float* x, float inv, const float* w, int64_t d, float* y) {
  int64_t i = 0;
  const __m256 s = _mm256_set1_ps(inv);
  for (; i + 8 <= d; i += 8)
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), s), _mm256_loadu_ps(w + i)));
  for (; i < d; ++i) y[i] = (x[i] * inv) * w[i];
}
#undef KN_AVX2
#endif

}  // namespace

void rms_norm_rows(const float* x, const float* w, int64_t rows, int64_t d, float eps, float* y) {
  auto square = square_lanes;
  auto scale = scale_rows;
#if defined(__x86_64__)
  if (active_isa() >= ISA_AVX2) {
    square = square_lanes_avx2;
    scale = scale_rows_avx2;
  }
#endif
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    float lanes[16] = {};
    square(xr, d, lanes);
    const float mean = reduce_lanes(lanes) / float(d);
    const float inv = 1.0f / std::sqrt(mean + eps);
    scale(xr, inv, w, d, y + r * d);
  }
}

void layer_norm_rows(const float* x, const float* w, const float* b, int64_t rows, int64_t d,
                     float eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    float lanes[16] = {};
    for (int64_t i = 0; i < d; ++i) lanes[i % 16] = lanes[i % 16] + xr[i];
    const float mean = reduce_lanes(lanes) / float(d);
    float sq[16] = {};
    for (int64_t i = 0; i < d; ++i) {
      const float c = xr[i] - mean;
      sq[i % 16] = sq[i % 16] + c * c;
    }
    const float inv = 1.0f / std::sqrt(reduce_lanes(sq) / float(d) + eps);
    for (int64_t i = 0; i < d; ++i) y[r * d + i] = ((xr[i] - mean) * inv) * w[i] + b[i];
  }
}

void cos_sin(const float* theta, int64_t n, float* c, float* s) {
  for (int64_t i = 0; i < n; ++i) {
    c[i] = std::cos(theta[i]);
    s[i] = std::sin(theta[i]);
  }
}

}  // namespace kn
