// AVX-512 (F, BW, VL, VNNI) path (chosen at run time; target attributes, never -march=native).
// The same loops as the AVX2 path (simd_formats.h, simd_driver.h) on 256-bit vectors (plus,
// for several rows of 32-value blocks, simd_driver.h's 16-column quant_cols16, and for the
// 256-value K-quants at any M, simd_kquant16.h's kquant_cols16), with
// VNNI's dpbusd for the unscaled block dots (no int16 saturation, so Q8_0 can be offset by
// 128 instead of the sign trick) and mask registers for the 5th bits of Q5_0 / Q5_1.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "qmatmul.h"

namespace kn {
namespace {

#define KN_SIMD __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define KN_INL KN_SIMD inline __attribute__((always_inline))

// acc + the 8 int32 sums of 4 products u8 * s8, exact for every u8.
KN_INL __m256i dotu(__m256i acc, __m256i u, __m256i x) { return _mm256_dpbusd_epi32(acc, u, x); }

// Byte i = 0x10 where bit i of bits is set.
KN_INL __m256i bit4_of(uint32_t bits) { return _mm256_maskz_mov_epi8(__mmask32(bits), _mm256_set1_epi8(0x10)); }

// The 8 scaled chunk dots of a K-quant block, two chunks per 512-bit vector (u[2i], u[2i+1]
// are adjacent in memory), the scale multiply-add fused by VNNI's dpwssd, folded back to 8
// int32 partials.
KN_INL __m256i dot256_wide(const __m256i* u, const __m256i* s, const int8_t* xq) {
  __m512i acc = _mm512_setzero_si512();
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const __m512i p = _mm512_maddubs_epi16(_mm512_loadu_si512(u + 2 * i), _mm512_loadu_si512(xq + 64 * i));
    // dpwssd: acc + the pair sums p * s in int32 (no saturation; |p| <= 2 * 63 * 128, |s| <= 128)
    acc = _mm512_dpwssd_epi32(acc, p, _mm512_loadu_si512(s + 2 * i));
  }
  return _mm256_add_epi32(_mm512_maskz_extracti64x4_epi64(0xFF, acc, 0), _mm512_maskz_extracti64x4_epi64(0xFF, acc, 1));
}

#include "simd_formats.h"

// Q8_0 (d | int8 qs[32]): u = w + 128 (w xor 0x80) in [0, 255]; the driver subtracts
// 128 * (sum of the activations), which dpbusd's exact int32 sums make exact.
struct FQ8_0 {
  static constexpr int QK = 32, BYTES = 34, KIND = 0, XOFF = 128, DOFF = 0, DHI = 0;
  using W = W32;
  KN_INL static void load(const uint8_t* b, W& w) {
    w.u = _mm256_xor_si256(ld256(b + 2), _mm256_set1_epi8(char(0x80)));
  }
  template <bool>
  KN_INL static __m256i dot(const W& w, const int8_t* xq, const int16_t*, __m256i&) { return dot32(w, xq); }
  KN_INL static __m256i acc4(__m256i acc, __m256i u, __m256i x) { return dotu(acc, u, x); }
};

#define KN_HAVE_COLS16 1

#include "simd_driver.h"

}  // namespace

bool qmatmul_cols_avx512(const MatmulArgs& a, int64_t n0, int64_t n1) { return dispatch(a, n0, n1); }

}  // namespace kn
