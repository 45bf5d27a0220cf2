// The activation rounding's rows on CPUs of the AVX2 path and up (target attributes, never
// -march=native): quantize.cc's reference row functions 8 values a step, with F16C for the
// half roundings. The same operations on the same values, so the same bits:
//  - amax: the largest |x| of a block with NaN skipped (max(|x|, m) returns m for a NaN
//    |x|, as the reference's SSE2 max does); a maximum of numbers is exact in any order;
//  - the scales: the reference's scalar divisions, operand for operand;
//  - the values: x times the scale, clamped to +-127, rounded to nearest even by cvtps2dq
//    (the reference's instruction), NaN products 0; their sums are integers;
//  - round_f16 by vcvtps2ph (nearest even; to infinity past the half range; half subnormals
//    exactly, as common.h f32_to_f16), except NaN, whose payload F16C keeps: NaN lanes
//    take round_f16's quiet NaN of the same sign.
#include <immintrin.h>

#include <cstring>

#include "common.h"
#include "quantize.h"

namespace kn {
namespace {

#define KN_SIMD __attribute__((target("avx2,fma,f16c")))  // ISA_AVX2 requires F16C (cpu.cc)
#define KN_INL KN_SIMD inline __attribute__((always_inline))

KN_INL __m256 abs8(__m256 v) { return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))); }

// max(m, |x[i]|) over n values (n % 8 == 0) with NaN skipped; m is not NaN.
KN_INL __m256 amax8(const float* x, int n, __m256 m) {
  for (int i = 0; i < n; i += 8) m = _mm256_max_ps(abs8(_mm256_loadu_ps(x + i)), m);
  return m;
}

// The largest of 8 lanes, none NaN.
KN_INL float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
  m = _mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtss_f32(m);
}

// quantize.cc to_q(s * x[i]) of 8 values, as int32: clamped to +-127 before the rounding
// (the bounds are integers, so the same), NaN 0.
KN_INL __m256i q8(__m256 s, const float* x) {
  const __m256 v = _mm256_mul_ps(s, _mm256_loadu_ps(x));
  const __m256 c = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-127.f)), _mm256_set1_ps(127.f));
  return _mm256_andnot_si256(_mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)), _mm256_cvtps_epi32(c));
}

// 16 int32 (a: values 0..7, b: 8..15), each in [-127, 127], as 16 int8 in order.
KN_INL __m128i pack16(__m256i a, __m256i b) {
  const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);  // int16, in order
  return _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
}

// Lane j = the largest lane of m[j] (none NaN): pairs, then quads, then the two halves.
KN_INL __m256 lanes_max8(const __m256* m) {
  __m256 t[4], u[2];
  for (int i = 0; i < 4; ++i)   // per 128 bits: [m2i a, m2i+1 a, m2i b, m2i+1 b]
    t[i] = _mm256_max_ps(_mm256_unpacklo_ps(m[2 * i], m[2 * i + 1]), _mm256_unpackhi_ps(m[2 * i], m[2 * i + 1]));
  for (int i = 0; i < 2; ++i)   // per 128 bits: blocks 4i .. 4i + 3
    u[i] = _mm256_max_ps(_mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
  return _mm256_max_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
}

// Lane j = the sum of v[j]'s lanes (integers: exact in any order).
KN_INL __m256i lanes_sum8(const __m256i* v) {
  const __m256i t0 = _mm256_hadd_epi32(v[0], v[1]), t1 = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i t2 = _mm256_hadd_epi32(v[4], v[5]), t3 = _mm256_hadd_epi32(v[6], v[7]);
  const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

// round_f16 of 8 floats (round_f16_avx2's lanes).
KN_INL __m256 round_half8(__m256 v) {
  const __m256 r = _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  const __m256 qnan = _mm256_or_ps(_mm256_and_ps(v, _mm256_set1_ps(-0.0f)), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)));
  return _mm256_blendv_ps(r, qnan, nan);
}

}  // namespace

// The blocks go 8 at a time, so that their scales are one vector's lanes: lane j of the
// maxima, the divisions and the half roundings is block j's (the same operations as one
// block's scalars, so the same bits), instead of a chain of scalar steps per block.
KN_SIMD void q8_0_row_avx2(const float* x, int64_t K, bool with_sum, int8_t* q, float* d, float* s,
                           int32_t* qsum) {
  const int64_t nb = K / 32;
  for (int64_t b0 = 0; b0 < nb; b0 += 8) {
    const int n = int(nb - b0 < 8 ? nb - b0 : 8);
    __m256 m[8];
    for (int j = 0; j < 8; ++j) m[j] = j < n ? amax8(x + (b0 + j) * 32, 32, _mm256_setzero_ps()) : _mm256_setzero_ps();
    const __m256 amax = lanes_max8(m);
    const __m256 db = _mm256_div_ps(amax, _mm256_set1_ps(127.f));
    // db > 0 ? 1 / db : 0 (db is never NaN: amax skips NaN)
    const __m256 id = _mm256_and_ps(_mm256_cmp_ps(db, _mm256_setzero_ps(), _CMP_GT_OQ),
                                    _mm256_div_ps(_mm256_set1_ps(1.f), db));
    alignas(32) float idv[8];
    _mm256_store_ps(idv, id);
    __m256i sums[8];
    for (int j = 0; j < n; ++j) {
      const float* xb = x + (b0 + j) * 32;
      const __m256 sv = _mm256_set1_ps(idv[j]);
      const __m256i v0 = q8(sv, xb), v1 = q8(sv, xb + 8), v2 = q8(sv, xb + 16), v3 = q8(sv, xb + 24);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + (b0 + j) * 32), pack16(v0, v1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + (b0 + j) * 32 + 16), pack16(v2, v3));
      sums[j] = _mm256_add_epi32(_mm256_add_epi32(v0, v1), _mm256_add_epi32(v2, v3));
    }
    for (int j = n; j < 8; ++j) sums[j] = _mm256_setzero_si256();
    const __m256i sum = lanes_sum8(sums);
    alignas(32) float dv[8], sv[8];
    alignas(32) int32_t qv[8];
    _mm256_store_ps(dv, round_half8(db));
    _mm256_store_si256(reinterpret_cast<__m256i*>(qv), sum);
    if (with_sum) _mm256_store_ps(sv, round_half8(_mm256_mul_ps(db, _mm256_cvtepi32_ps(sum))));
    for (int j = 0; j < n; ++j) {
      d[b0 + j] = dv[j];
      qsum[b0 + j] = qv[j];
      if (with_sum) s[b0 + j] = sv[j];
    }
  }
}

KN_SIMD void q8_k_row_avx2(const float* x, int64_t K, int8_t* q, float* d, int32_t* bsum) {
  for (int64_t b = 0; b < K / 256; ++b) {
    const float* xb = x + b * 256;
    int8_t* qb = q + b * 256;
    const float amax = hmax8(amax8(xb, 256, _mm256_setzero_ps()));
    if (amax == 0.f) {
      d[b] = 0.f;
      std::memset(qb, 0, 256);
      for (int g = 0; g < 16; ++g) bsum[b * 16 + g] = 0;
      continue;
    }
    // the first value of the largest magnitude, with its sign (one exists)
    const __m256 av = _mm256_set1_ps(amax);
    int first = 0;
    for (int i = 0;; i += 8)
      if (int hit = _mm256_movemask_ps(_mm256_cmp_ps(abs8(_mm256_loadu_ps(xb + i)), av, _CMP_EQ_OQ))) {
        first = i + __builtin_ctz(unsigned(hit));
        break;
      }
    const float iscale = -127.f / xb[first];
    const __m256 sv = _mm256_set1_ps(iscale);
    for (int h = 0; h < 2; ++h) {   // the 16-value sums 8 at a time, as one vector's lanes
      __m256i sums[8];
      for (int g = 0; g < 8; ++g) {
        const float* xg = xb + 128 * h + 16 * g;
        const __m256i v0 = q8(sv, xg), v1 = q8(sv, xg + 8);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 128 * h + 16 * g), pack16(v0, v1));
        sums[g] = _mm256_add_epi32(v0, v1);
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(bsum + b * 16 + 8 * h), lanes_sum8(sums));
    }
    d[b] = 1.f / iscale;
  }
}

KN_SIMD void round_f16_avx2(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, round_half8(_mm256_loadu_ps(x + i)));
  for (; i < n; ++i) y[i] = round_f16(x[i]);
}

}  // namespace kn
