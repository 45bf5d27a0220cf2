// AVX2 path (chosen at run time; compiled with target attributes, never -march=native).
// Integer block sums with maddubs / madd, the float part exactly as the reference
// (simd_driver.h); the format unpacking is shared with the AVX-512 path (simd_formats.h).
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "qmatmul.h"

namespace kn {
namespace {

#define KN_SIMD __attribute__((target("avx2,fma,f16c")))  // ISA_AVX2 requires F16C (cpu.cc)
#define KN_INL KN_SIMD inline __attribute__((always_inline))

// acc + the 8 int32 sums of 4 products u8 * s8. maddubs saturates its int16 pair sums, so
// u must be at most 128 (2 * 128 * 127 < 32768): true of every unsigned weight here.
KN_INL __m256i dotu(__m256i acc, __m256i u, __m256i x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
}

// Byte i = 0x10 where bit i of bits is set (each byte picks its bit from a broadcast).
KN_INL __m256i bit4_of(uint32_t bits) {
  const __m256i spread = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(int(bits)), spread);
  v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_and_si256(_mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}

// No wider vectors here: the K-quant dot stays on 256-bit chunks (simd_formats.h dot256).
#define KN_NO_WIDE 1

#include "simd_formats.h"

// Q8_0 (d | int8 qs[32]): signed weights down to -128, so the sign trick: |w| (as unsigned,
// 128 included) times x with w's sign, which never overflows since |x| <= 127.
struct FQ8_0 {
  static constexpr int QK = 32, BYTES = 34, KIND = 0, XOFF = 0, DOFF = 0, DHI = 0;
  static constexpr int W16 = 1;
  static constexpr bool SIGNED = true;
  using W = W32;
  KN_INL static void load(const uint8_t* b, W& w) {
    w.u = ld256(b + 2);
  }
  template <bool>
  KN_INL static __m256i dot(const W& w, const int8_t* xq, const int16_t*, __m256i&) {
    const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(w.u), _mm256_sign_epi8(ld256(xq), w.u));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
  }
};

// Block scales through F16C's vcvtph2ps (simd_driver.h f16x8).
#define KN_F16C_SCALES 1
// F16 weights: fused multiply-adds where the product is exact (simd_driver.h mul_add).
#define KN_F16_FMA 1
#include "simd_driver.h"

}  // namespace

bool qmatmul_cols_avx2(const MatmulArgs& a, int64_t n0, int64_t n1) { return dispatch(a, n0, n1); }

}  // namespace kn
