// AVX-512 (F, BW, VL, VNNI) path (chosen at run time; target attributes, never -march=native).
// The AVX2 path's block formats (simd_formats.h) under simd_driver.h's 16-column loops, one
// output column per lane of a 512-bit vector, for every quantized format at any M
// (simd_legacy16.h for the 32-value blocks, simd_kquant16.h for the K-quants; the float
// formats in 512-bit registers: simd_float16.h), with VNNI's dpbusd for the unscaled block
// dots (no int16 saturation, so Q8_0 can be offset by 128 instead of the sign trick) and
// mask registers for the 5th bits of Q5_0 / Q5_1.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "qmatmul.h"

namespace kn {
namespace {

#define KN_SIMD __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))
#define KN_INL KN_SIMD inline __attribute__((always_inline))

// acc + the 8 int32 sums of 4 products u8 * s8, exact for every u8.
KN_INL __m256i dotu(__m256i acc, __m256i u, __m256i x) { return _mm256_dpbusd_epi32(acc, u, x); }

// Byte i = 0x10 where bit i of bits is set.
KN_INL __m256i bit4_of(uint32_t bits) { return _mm256_maskz_mov_epi8(__mmask32(bits), _mm256_set1_epi8(0x10)); }

// The formats' 8-column dots (dot256_wide) serve only simd_driver.h's 8-column loops, which
// this path never runs (KN_HAVE_COLS16): keep simd_formats.h's own loop for them.
#define KN_NO_WIDE 1

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
};

#define KN_HAVE_COLS16 1
// Block scales and F16 weights through F16C's vcvtph2ps (simd_driver.h f16x8).
#define KN_F16C_SCALES 1

#include "simd_driver.h"

}  // namespace

bool qmatmul_cols_avx512(const MatmulArgs& a, int64_t n0, int64_t n1) { return dispatch(a, n0, n1); }

bool qmatmul_cols_avx512_r16(const MatmulArgs& a, int64_t n0, int64_t n1) {
  return dispatch_r16(a, n0, n1);
}

bool qmatmul_words_avx512(const MatmulArgs& a, std::vector<int32_t>& out) { return dispatch_words(a, out); }

}  // namespace kn
