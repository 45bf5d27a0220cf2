#include "quantize.h"

#include <cmath>
#include <cstring>

#ifdef __SSE2__
#include <emmintrin.h>
#endif

namespace kn {

namespace {

// nearbyint (round half to even) clamped to int8's symmetric range; NaN becomes 0 so that a
// damaged activation never reaches an undefined float-to-int conversion.
inline int8_t to_q(float v) {
  v = std::nearbyint(v);
  if (v != v) return 0;
  return int8_t(v > 127.f ? 127.f : v < -127.f ? -127.f : v);
}

#ifdef __SSE2__
// The same steps 4 values at a time with SSE2 (baseline x86-64, so every path shares it):
// cvtps2dq rounds in the current rounding mode as nearbyint does, and clamping before the
// rounding gives what clamping after it gives (the bounds are integers).

// |v| of 4 floats.
inline __m128 abs4(__m128 v) { return _mm_and_ps(v, _mm_castsi128_ps(_mm_set1_epi32(0x7FFFFFFF))); }

// The largest of 4 lanes, none of them NaN.
inline float hmax4(__m128 v) {
  v = _mm_max_ps(v, _mm_shuffle_ps(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = _mm_max_ps(v, _mm_shuffle_ps(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtss_f32(v);
}

// max(amax, |x[i]|) over n values (n % 4 == 0), NaN skipped as std::fmax skips it.
inline float amax_of(const float* x, int n) {
  __m128 m = _mm_setzero_ps();
  for (int i = 0; i < n; i += 4) m = _mm_max_ps(abs4(_mm_loadu_ps(x + i)), m);  // NaN: m
  return hmax4(m);
}

// to_q(s * x[i]) of 4 values as int32: NaN 0, the rest rounded and clamped to +-127.
inline __m128i q4(__m128 s, const float* x) {
  const __m128 v = _mm_mul_ps(s, _mm_loadu_ps(x));
  const __m128 c = _mm_min_ps(_mm_max_ps(v, _mm_set1_ps(-127.f)), _mm_set1_ps(127.f));
  return _mm_andnot_si128(_mm_castps_si128(_mm_cmpunord_ps(v, v)), _mm_cvtps_epi32(c));
}

// q[0..15] = to_q(s * x[i]); returns their sum.
inline int32_t q16(__m128 s, const float* x, int8_t* q) {
  const __m128i a = q4(s, x), b = q4(s, x + 4), c = q4(s, x + 8), d = q4(s, x + 12);
  _mm_storeu_si128((__m128i*)q, _mm_packs_epi16(_mm_packs_epi32(a, b), _mm_packs_epi32(c, d)));
  __m128i t = _mm_add_epi32(_mm_add_epi32(a, b), _mm_add_epi32(c, d));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(t);
}

// The index of the first x[i] with |x[i]| == a (one exists).
inline int first_abs(const float* x, float a) {
  const __m128 av = _mm_set1_ps(a);
  for (int i = 0;; i += 4)
    if (int hit = _mm_movemask_ps(_mm_cmpeq_ps(abs4(_mm_loadu_ps(x + i)), av))) return i + __builtin_ctz(unsigned(hit));
}
#endif

}  // namespace

void q8_0_row(const float* x, int64_t K, bool with_sum, int8_t* q, float* d, float* s, int32_t* qsum) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* xb = x + b * 32;
#ifdef __SSE2__
    const float amax = amax_of(xb, 32);
#else
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
#endif
    float db = amax / 127.f;
    float id = db > 0.f ? 1.f / db : 0.f;
#ifdef __SSE2__
    const int32_t sum = q16(_mm_set1_ps(id), xb, q + b * 32) + q16(_mm_set1_ps(id), xb + 16, q + b * 32 + 16);
#else
    int32_t sum = 0;
    for (int i = 0; i < 32; ++i) {
      q[b * 32 + i] = to_q(xb[i] * id);
      sum += q[b * 32 + i];
    }
#endif
    d[b] = round_f16(db);
    qsum[b] = sum;
    if (with_sum) s[b] = round_f16(db * float(sum));
  }
}

void q8_k_row(const float* x, int64_t K, int8_t* q, float* d, int32_t* bsum) {
  for (int64_t b = 0; b < K / 256; ++b) {
    const float* xb = x + b * 256;
    int8_t* qb = q + b * 256;
#ifdef __SSE2__
    const float amax = amax_of(xb, 256);
    if (amax == 0.f) {
      d[b] = 0.f;
      for (int i = 0; i < 256; ++i) qb[i] = 0;
      for (int g = 0; g < 16; ++g) bsum[b * 16 + g] = 0;
      continue;
    }
    const float iscale = -127.f / xb[first_abs(xb, amax)];  // the first largest, signed
    for (int g = 0; g < 16; ++g) bsum[b * 16 + g] = q16(_mm_set1_ps(iscale), xb + 16 * g, qb + 16 * g);
    d[b] = 1.f / iscale;
#else
    float amax = 0.f, max = 0.f;  // the first value of largest magnitude, with its sign
    for (int i = 0; i < 256; ++i) {
      float a = std::fabs(xb[i]);
      if (a > amax) { amax = a; max = xb[i]; }
    }
    if (amax == 0.f) {
      d[b] = 0.f;
      for (int i = 0; i < 256; ++i) qb[i] = 0;
    } else {
      float iscale = -127.f / max;
      for (int i = 0; i < 256; ++i) qb[i] = to_q(iscale * xb[i]);
      d[b] = 1.f / iscale;
    }
    for (int g = 0; g < 16; ++g) {
      int32_t sum = 0;
      for (int i = 0; i < 16; ++i) sum += qb[g * 16 + i];
      bsum[b * 16 + g] = sum;
    }
#endif
  }
}

namespace {

// The block-major copies of row m (quantize.h), from its row-major arrays.
void row_by_block(QuantActs& x, int64_t m) {
  const int64_t M = x.M, nb = x.K / 32;
  for (int64_t b = 0; b < nb; ++b) {
    const size_t i = size_t(b * M + m), src = size_t(m * nb + b);
    std::memcpy(&x.bq[8 * i], &x.q[32 * src], 32);
    x.bd[i] = x.d[src];
    x.bnsum[i] = -x.qsum[src];
    if (x.kind == ACT_Q8_1) x.bs[i] = x.s[src];
  }
}

}  // namespace

void quantize_begin(ActKind kind, int64_t M, int64_t K, bool block_major, QuantActs& out) {
  out.kind = kind;
  out.M = M;
  out.K = K;
  out.block_major = block_major && (kind == ACT_Q8_0 || kind == ACT_Q8_1);
  if (kind == ACT_F32 || kind == ACT_F16 || kind == ACT_BF16) {
    out.f.reset(new float[size_t(M * K)]);
    return;
  }
  const int64_t nb = out.blocks_per_row();
  out.q.resize(size_t(M * K));
  out.d.resize(size_t(M * nb));
  if (kind == ACT_Q8_K) {
    out.bsum.resize(size_t(M * K / 16));
    return;
  }
  if (kind == ACT_Q8_1) out.s.resize(size_t(M * nb));
  out.qsum.resize(size_t(M * nb));
  if (out.block_major) {
    out.bq.resize(size_t(M * nb * 8));
    out.bd.resize(size_t(M * nb));
    out.bnsum.resize(size_t(M * nb));
    if (kind == ACT_Q8_1) out.bs.resize(size_t(M * nb));
  }
}

void quantize_rows(const float* x, int64_t m0, int64_t m1, QuantActs& out, bool simd) {
  const ActKind kind = out.kind;
  const int64_t K = out.K, nb = out.blocks_per_row();
  if (kind == ACT_F16 && simd) {
    round_f16_avx2(x + m0 * K, out.f.get() + m0 * K, (m1 - m0) * K);
    return;
  }
  if (kind == ACT_F32 || kind == ACT_F16 || kind == ACT_BF16) {
    for (int64_t i = m0 * K; i < m1 * K; ++i)
      out.f[size_t(i)] = kind == ACT_F16 ? round_f16(x[i]) : kind == ACT_BF16 ? round_bf16(x[i]) : x[i];
    return;
  }
  for (int64_t m = m0; m < m1; ++m) {
    if (kind == ACT_Q8_K) {
      (simd ? q8_k_row_avx2 : q8_k_row)(x + m * K, K, &out.q[size_t(m * K)], &out.d[size_t(m * nb)],
                                        &out.bsum[size_t(m * K / 16)]);
      continue;
    }
    const bool with_sum = kind == ACT_Q8_1;
    (simd ? q8_0_row_avx2 : q8_0_row)(x + m * K, K, with_sum, &out.q[size_t(m * K)], &out.d[size_t(m * nb)],
                                      with_sum ? &out.s[size_t(m * nb)] : nullptr, &out.qsum[size_t(m * nb)]);
    if (out.block_major) row_by_block(out, m);
  }
}

}  // namespace kn
