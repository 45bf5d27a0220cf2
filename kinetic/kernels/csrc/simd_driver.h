// The SIMD driver shared by the AVX2 and AVX-512 paths: loops over output columns, integer
// block sums from simd_formats.h, and the float part done exactly as the reference does it
// (qmatmul.h), vectorized ACROSS the columns: lane c of every float vector performs, in the
// same order, the scalar operations the reference performs for column c. AVX2 (8 columns a
// group): quant_cols below at M = 1 and for K-quants, simd_legacy8.h for 32-value blocks at
// M > 1. AVX-512 (KN_HAVE_COLS16, 16 columns a group, every M): simd_legacy16.h and
// simd_kquant16.h. Included like simd_formats.h (inside an ISA's anonymous namespace, after
// it).

// ---- exact helpers ------------------------------------------------------------------

// 8 IEEE halves (the low 16 bits of int32 lanes, the rest zero) -> floats.
//
// With KN_F16C_SCALES (both SIMD paths) F16C's vcvtph2ps: 3 instructions where the software
// conversion below takes 14, and the block scales are converted for every 8 columns of
// every block (about a fifth of the one-row loop's instructions). It gives common.h
// f16_to_f32's bits for every half (subnormals exactly, as normal floats; MXCSR's DAZ does not
// apply to a half source) but a signalling NaN, which it returns quieted. Every value
// converted here only ever enters a product (a scale times the activation's scale, a float
// weight times an activation), and a product with a signalling NaN operand is that NaN
// quieted, so the products, and every result, have the reference's bits either way.
//
// Without it the software conversion, bit for bit f16_to_f32 (subnormals as man * 2^-24,
// inf / NaN payloads kept).
#ifdef KN_F16C_SCALES
KN_INL __m256 f16x8(__m256i h) {
  // the lanes hold 0 .. 0xFFFF, so the unsigned saturating pack keeps every one exactly
  return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
}

KN_INL __m256 f16x8(__m128i h16) { return _mm256_cvtph_ps(h16); }
#else
KN_INL __m256 f16x8(__m256i h) {
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(h, _mm256_set1_epi32(0x8000)), 16);
  const __m256i em = _mm256_and_si256(h, _mm256_set1_epi32(0x7FFF));
  const __m256i exp = _mm256_srli_epi32(em, 10);
  const __m256i is_max = _mm256_cmpeq_epi32(exp, _mm256_set1_epi32(31));
  const __m256i is_sub = _mm256_cmpeq_epi32(exp, _mm256_setzero_si256());
  // exponent rebias: + 112 for normals, + 224 for inf / NaN (31 + 224 = 255)
  const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(112 << 23), _mm256_and_si256(is_max, _mm256_set1_epi32(112 << 23)));
  const __m256i normal = _mm256_or_si256(sign, _mm256_add_epi32(_mm256_slli_epi32(em, 13), bias));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(1.0f / 16777216.0f));  // exp 0: em = man
  const __m256i subbits = _mm256_or_si256(_mm256_castps_si256(sub), sign);
  return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, subbits, is_sub));
}

KN_INL __m256 f16x8(__m128i h16) { return f16x8(_mm256_cvtepu16_epi32(h16)); }
#endif

// The u32 at p[c] + off for 8 pointers, as the 8 int32 lanes of one vector.
KN_INL __m256i gather8_u32(const uint8_t* const* p, int64_t off) {
  __m128i v[8];
#pragma GCC unroll 8
  for (int c = 0; c < 8; ++c) v[c] = _mm_cvtsi32_si128(int(load_u32(p[c] + off)));
  const __m128i a0 = _mm_unpacklo_epi32(v[0], v[1]), a1 = _mm_unpacklo_epi32(v[2], v[3]);
  const __m128i a2 = _mm_unpacklo_epi32(v[4], v[5]), a3 = _mm_unpacklo_epi32(v[6], v[7]);
  return _mm256_set_m128i(_mm_unpacklo_epi64(a2, a3), _mm_unpacklo_epi64(a0, a1));
}

// Lane c = the sum of the 8 int32 lanes of v[c] (integer: exact in any order).
KN_INL __m256i reduce8(const __m256i* v) {
  const __m256i t0 = _mm256_hadd_epi32(v[0], v[1]), t1 = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i t2 = _mm256_hadd_epi32(v[4], v[5]), t3 = _mm256_hadd_epi32(v[6], v[7]);
  const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
  // the halves of u0 added, then of u1 (extract / insert: vperm2i128 is 8 micro-ops on Zen 1)
  const __m128i lo = _mm_add_epi32(_mm256_castsi256_si128(u0), _mm256_extracti128_si256(u0, 1));
  const __m128i hi = _mm_add_epi32(_mm256_castsi256_si128(u1), _mm256_extracti128_si256(u1, 1));
  return _mm256_set_m128i(hi, lo);
}

// 8x8 transpose of int32 lanes: t[j] lane c = v[c] lane j.
KN_INL void transpose8(const __m256i* v, __m256i* t) {
  __m256i a[8], s[8];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    a[2 * i] = _mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
    a[2 * i + 1] = _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
  }
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {  // columns 4h .. 4h + 3
    s[4 * h + 0] = _mm256_unpacklo_epi64(a[4 * h], a[4 * h + 2]);
    s[4 * h + 1] = _mm256_unpackhi_epi64(a[4 * h], a[4 * h + 2]);
    s[4 * h + 2] = _mm256_unpacklo_epi64(a[4 * h + 1], a[4 * h + 3]);
    s[4 * h + 3] = _mm256_unpackhi_epi64(a[4 * h + 1], a[4 * h + 3]);
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    // [s[j].lo, s[j+4].lo] and [s[j].hi, s[j+4].hi] by inserts (not vperm2i128: see reduce8)
    t[j] = _mm256_inserti128_si256(s[j], _mm256_castsi256_si128(s[j + 4]), 1);
    t[j + 4] = _mm256_inserti128_si256(s[j + 4], _mm256_extracti128_si256(s[j], 1), 0);
  }
}

// Per call, for K-quants: Q8_K rows' 16-value sums packed to int16 (|sum| <= 2032).
template <class F>
KN_SIMD void act_extras(const QuantActs& x, int64_t M, std::vector<int16_t>& bs) {
  const int64_t K = x.K;
  if (F::QK == 256) {
    bs.resize(size_t(M * K / 16));
    for (int64_t i = 0; i < M * K / 256; ++i) {
      const __m256i a = _mm256_loadu_si256((const __m256i*)&x.bsum[16 * i]);
      const __m256i b = _mm256_loadu_si256((const __m256i*)&x.bsum[16 * i + 8]);
      const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
      _mm256_storeu_si256((__m256i*)&bs[16 * i], p);
    }
  }
}

// ---- quantized formats --------------------------------------------------------------

// The multi-row loops of 32-value legacy blocks (simd_legacy8.h, simd_legacy16.h) unpack a
// column group's blocks kStrip at a time (16 blocks of 16 columns: 10 KB, held in L1), then
// take every row through them.
constexpr int kStrip = 16;

// The address of the column group `width` columns past column n, for prefetch_slice: 0 where
// software prefetch is off (cpu.h).
KN_INL uintptr_t next_group(const MatmulArgs& a, int64_t n, int width) {
  return software_prefetch() ? uintptr_t(a.w) + uintptr_t((n + width) * a.row_bytes) : 0;
}

// Prefetch slice g of the bytes from p, `per` bytes a slice: the next column group's weights,
// a slice per block unpacked, so that they arrive while this group computes (unpacking a
// strip at once leaves the loads no compute to hide behind). p is an address, not a
// pointer: past the last group it lies beyond the weight, and prefetches never fault.
KN_INL void prefetch_slice(uintptr_t p, int64_t g, int64_t per) {
  if (p == 0) return;   // software prefetch off (next_group)
  for (int64_t o = g * per; o < (g + 1) * per; o += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(p + uintptr_t(o)), 0, 3);
}

// Per call, for formats with an offset: -XOFF * (sum of the block's activations) of every row
// and block, block-major, which the row's block sum starts from (no instruction per row).
template <class F>
std::vector<int32_t> offset_init(const QuantActs& x) {
  std::vector<int32_t> init(F::XOFF ? x.bnsum.size() : 0);
  for (size_t i = 0; i < init.size(); ++i) init[i] = F::XOFF * x.bnsum[i];
  return init;
}

#ifdef KN_HAVE_COLS16
#define KN_INL_LAMBDA KN_SIMD __attribute__((always_inline))
#include "simd_legacy16.h"
#include "simd_kquant16.h"
#else
#include "simd_legacy8.h"
#endif

// Output columns [n0, n1) of every row for format F; ONE: M is 1 (lets the compiler keep
// everything in registers). Columns past n1 in the last group repeat column n1 - 1 and
// are not stored.
template <class F, bool ONE>
KN_SIMD void quant_cols(const MatmulArgs& a, int64_t n0, int64_t n1) {
  const QuantActs& x = *a.acts;
  const int64_t M = ONE ? 1 : a.M, K = a.K, nb = K / F::QK, xbr = x.blocks_per_row();
  std::vector<int16_t> bs;
  act_extras<F>(x, M, bs);
  std::vector<float> acc(size_t(M * 8));
  for (int64_t n = n0; n < n1; n += 8) {
    const uint8_t* rows[8];
    for (int c = 0; c < 8; ++c) rows[c] = a.w + std::min(n + c, n1 - 1) * a.row_bytes;
    std::fill(acc.begin(), acc.end(), 0.f);
    // the next group's 8 rows (contiguous) are prefetched a slice per block, as the strips
    // do: rows of a few hundred bytes are too short for the hardware's stream prefetchers
    const uintptr_t next = next_group(a, n, 8);
    for (int64_t b = 0; b < nb; ++b) {
      prefetch_slice(next, b, 8 * F::BYTES);
      typename F::W w[8];
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) F::load(rows[c] + b * F::BYTES, w[c]);
      const __m256i dm = gather8_u32(rows, b * F::BYTES + F::DOFF);  // d | m << 16, per column
      const __m256 dw = f16x8(F::DHI ? _mm256_srli_epi32(dm, 16) : _mm256_and_si256(dm, _mm256_set1_epi32(0xFFFF)));
      const __m256 mw = F::KIND ? f16x8(_mm256_srli_epi32(dm, 16)) : _mm256_setzero_ps();
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* xq = &x.q[size_t(m * K + b * F::QK)];
        const int16_t* bsm = F::QK == 256 ? &bs[size_t((m * K + b * F::QK) / 16)] : nullptr;
        __m256i p[8], q[8];
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) p[c] = F::template dot<!ONE>(w[c], xq, bsm, q[c]);
        __m256i isum = reduce8(p);
        if (F::XOFF) isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(F::XOFF * x.qsum[size_t(m * nb + b)]));
        // The reference's combine (qmatmul.h), operand for operand.
        const int64_t ib = m * xbr + b;
        const __m256 dx = _mm256_set1_ps(x.d[size_t(ib)]);
        __m256 step = _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, dx));
        if (F::KIND == 1) step = _mm256_add_ps(step, _mm256_mul_ps(mw, _mm256_set1_ps(x.s[size_t(ib)])));
        if (F::KIND == 2)
          step = _mm256_sub_ps(step, _mm256_mul_ps(_mm256_cvtepi32_ps(reduce8(q)), _mm256_mul_ps(mw, dx)));
        float* am = &acc[size_t(m * 8)];
        _mm256_storeu_ps(am, _mm256_add_ps(_mm256_loadu_ps(am), step));
      }
    }
    const int valid = int(std::min<int64_t>(8, n1 - n));
    for (int64_t m = 0; m < M; ++m)
      for (int c = 0; c < valid; ++c) a.out(m)[n + c] = acc[size_t(m * 8 + c)];
  }
}

// With KN_HAVE_COLS16 (AVX-512) every quantized format takes a 16-column path at any M (it
// beats the 8-column loops at M = 1 too), and the 8-column loops are not instantiated. On
// AVX2, 32-value blocks with several rows take simd_legacy8.h's strips.
template <class F>
KN_SIMD void quant_run(const MatmulArgs& a, int64_t n0, int64_t n1) {
#ifdef KN_HAVE_COLS16
  static_assert(K16<F>::HAVE || F::QK == 32, "a quantized format without a 16-column path");
  if constexpr (K16<F>::HAVE)
    kquant_cols16<F, false>(a, n0, n1);
  else
    legacy_cols16<F, false>(a, n0, n1);
#else
  if (a.M == 1)
    quant_cols<F, true>(a, n0, n1);
  else if constexpr (F::QK == 32)
    legacy_cols8<F>(a, n0, n1);
  else
    quant_cols<F, false>(a, n0, n1);
#endif
}

// ---- float formats ------------------------------------------------------------------
// The end of one (row, column) pair of a float-weight dot, on both paths: its 16 lane
// accumulators (l0: lanes 0..7, l1: 8..15) summed by reduce_lanes' halving in vector
// registers, or, with a tail (K % 16 values), the tail and the halving by the reference's own
// scalar code.
KN_INL void float_tail(const float* xm, const uint8_t* row, int fmt, int64_t K16, int64_t K,
                       __m256 l0, __m256 l1, float* out) {
  if (K16 == K) {   // no tail: reduce_lanes' halving in vector registers, pair for pair
    const __m256 h8 = _mm256_add_ps(l0, l1);                       // lane i + lane i + 8
    const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
    const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));       // + 2
    *out = _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));  // + 1
    return;
  }
  float lanes[16];
  _mm256_storeu_ps(lanes, l0);
  _mm256_storeu_ps(lanes + 8, l1);
  for (int64_t k = K16; k < K; ++k) lanes[k % 16] = lanes[k % 16] + xm[k] * weight_value(fmt, row, k);
  *out = reduce_lanes(lanes);
}

// (The rest is the AVX2 path's; the AVX-512 path's is in simd_float16.h.)
#ifndef KN_HAVE_COLS16

// 8 weights from index k as floats (exact conversions).
template <int FMT>
KN_INL __m256 wload8(const uint8_t* row, int64_t k) {
  if (FMT == F32) return _mm256_loadu_ps((const float*)(row + 4 * k));
  const __m128i h = _mm_loadu_si128((const __m128i*)(row + 2 * k));
  if (FMT == F16) return f16x8(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// The 16-lane scheme: lanes 0..7 and 8..15 as two vectors, 16 values per step in order of
// k; the tail (K % 16 values) and the halving reduction are the reference's own scalar code.
// Each (row m, column n) pair has its own two accumulators, so computing pairs side by side
// changes no pair's order of operations: M > 1 runs 4 rows x 2 columns at a time, one half of
// the lanes after the other (eight independent add chains, where one pair's two would wait on
// the add latency; each vector loaded once for two products). Rows go in blocks (float_rows), each block against every column
// of the range, so that the block's activations stay in cache while the weights stream (a
// weight row is small; the activations of hundreds of rows are not).

// rows of a block: their activations about 128 KiB (in L2), 4 to 64 rows, a multiple of 4
inline int64_t float_rows(int64_t K) {
  return std::max<int64_t>(4, std::min<int64_t>(64, (32768 / std::max<int64_t>(K, 1)) / 4 * 4));
}

// 4 rows x 2 columns of one half of the 16 lanes (off 0: lanes 0..7, 8: lanes 8..15): acc[2i + j]
// gathers x[i][k] * w[j][k] for k = 16 t + off ... + 7, t in order. Eight chains, each weight
// and activation vector loaded once for two products.
// acc + x * w with the product rounded, as the reference adds it. Where both factors are
// half floats (F16 weights meet activations rounded to half: ACT_F16) the product of two
// 11-bit significands is exact in float32 (and far from its range's ends), so rounding it
// changes nothing and one fused multiply-add gives the same bits as the multiply and the add
// (KN_F16_FMA: the AVX2 path; half the floating-point micro-ops).
template <bool EXACT_PRODUCT>
KN_INL __m256 mul_add(__m256 acc, __m256 x, __m256 w) {
#ifdef KN_F16_FMA
  if (EXACT_PRODUCT) return _mm256_fmadd_ps(x, w, acc);
#endif
  return _mm256_add_ps(acc, _mm256_mul_ps(x, w));
}

template <int FMT>
KN_INL void float_half8(const float* const* x, const uint8_t* const* w, int64_t K16, int64_t off,
                        __m256* acc) {
  constexpr bool EXACT_PRODUCT = FMT == F16;
  // named accumulators and pointers (no arrays), so that all eight stay in registers
  const float *x0 = x[0], *x1 = x[1], *x2 = x[2], *x3 = x[3];
  const uint8_t *p0 = w[0], *p1 = w[1];
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00;
  __m256 c20 = c00, c21 = c00, c30 = c00, c31 = c00;
  // (KN_REG: the compiler would otherwise fold each load into both of its products, loading
  // the vector twice)
#define KN_REG(v) __asm__("" : "+x"(v))
  for (int64_t k = off; k < K16; k += 16) {
    const __m256 w0 = wload8<FMT>(p0, k), w1 = wload8<FMT>(p1, k);   // (converted here)
    __m256 xi = _mm256_loadu_ps(x0 + k);
    KN_REG(xi);
    c00 = mul_add<EXACT_PRODUCT>(c00, xi, w0);
    c01 = mul_add<EXACT_PRODUCT>(c01, xi, w1);
    xi = _mm256_loadu_ps(x1 + k);
    KN_REG(xi);
    c10 = mul_add<EXACT_PRODUCT>(c10, xi, w0);
    c11 = mul_add<EXACT_PRODUCT>(c11, xi, w1);
    xi = _mm256_loadu_ps(x2 + k);
    KN_REG(xi);
    c20 = mul_add<EXACT_PRODUCT>(c20, xi, w0);
    c21 = mul_add<EXACT_PRODUCT>(c21, xi, w1);
    xi = _mm256_loadu_ps(x3 + k);
    KN_REG(xi);
    c30 = mul_add<EXACT_PRODUCT>(c30, xi, w0);
    c31 = mul_add<EXACT_PRODUCT>(c31, xi, w1);
  }
#undef KN_REG
  acc[0] = c00; acc[1] = c01; acc[2] = c10; acc[3] = c11;
  acc[4] = c20; acc[5] = c21; acc[6] = c30; acc[7] = c31;
}

template <int FMT>
KN_SIMD void float_cols(const MatmulArgs& a, int64_t n0, int64_t n1) {
  const QuantActs& x = *a.acts;
  const int64_t K = a.K, K16 = K / 16 * 16;
  const int64_t rows = float_rows(K);
  for (int64_t m0 = 0; m0 < a.M; m0 += rows) {
  const int64_t m1 = std::min(a.M, m0 + rows);
  for (int64_t n = n0; n < n1; n += 2) {
    const int64_t nn = std::min<int64_t>(2, n1 - n);
    const uint8_t* row[2] = {a.w + n * a.row_bytes, a.w + (n + nn - 1) * a.row_bytes};
    int64_t m = m0;
    if (nn == 2) {
      for (; m + 4 <= m1; m += 4) {
        const float* xr[4];
        for (int i = 0; i < 4; ++i) xr[i] = &x.f[size_t((m + i) * K)];
        // lanes 0..7 of the 8 pairs (values k in [16j, 16j + 8)), then lanes 8..15: each
        // accumulator still takes its values in order of k
        __m256 lo[8], hi[8];
        float_half8<FMT>(xr, row, K16, 0, lo);
        float_half8<FMT>(xr, row, K16, 8, hi);
        for (int i = 0; i < 4; ++i)
          for (int j = 0; j < 2; ++j)
            float_tail(xr[i], row[j], FMT, K16, K, lo[2 * i + j], hi[2 * i + j],
                       a.out(m + i) + n + j);
      }
    }
    for (; m < m1; ++m) {   // one pair at a time: M = 1, the last row, the last column
      const float* xm = &x.f[size_t(m * K)];
      for (int j = 0; j < nn; ++j) {
        __m256 l0 = _mm256_setzero_ps(), l1 = _mm256_setzero_ps();
        for (int64_t k = 0; k < K16; k += 16) {
          const __m256 w0 = wload8<FMT>(row[j], k), w1 = wload8<FMT>(row[j], k + 8);
          l0 = mul_add<FMT == F16>(l0, _mm256_loadu_ps(xm + k), w0);
          l1 = mul_add<FMT == F16>(l1, _mm256_loadu_ps(xm + k + 8), w1);
        }
        float_tail(xm, row[j], FMT, K16, K, l0, l1, a.out(m) + n + j);
      }
    }
  }
  }
}

#else
#include "simd_float16.h"
#endif

// Every format this file accelerates; false hands the format to the reference.
KN_SIMD bool dispatch(const MatmulArgs& a, int64_t n0, int64_t n1) {
  switch (a.fmt) {
    case Q4_0: quant_run<FQ4_0>(a, n0, n1); return true;
    case Q4_1: quant_run<FQ4_1>(a, n0, n1); return true;
    case Q5_0: quant_run<FQ5_0>(a, n0, n1); return true;
    case Q5_1: quant_run<FQ5_1>(a, n0, n1); return true;
    case Q8_0: quant_run<FQ8_0>(a, n0, n1); return true;
    case Q2_K: quant_run<FQ2_K>(a, n0, n1); return true;
    case Q3_K: quant_run<FQ3_K>(a, n0, n1); return true;
    case Q4_K: quant_run<FQ4_K>(a, n0, n1); return true;
    case Q5_K: quant_run<FQ5_K>(a, n0, n1); return true;
    case Q6_K: quant_run<FQ6_K>(a, n0, n1); return true;
#ifdef KN_HAVE_COLS16
    case F32: float_cols16<F32>(a, n0, n1); return true;
    case F16: float_cols16<F16>(a, n0, n1); return true;
    case BF16: float_cols16<BF16>(a, n0, n1); return true;
#else
    case F32: float_cols<F32>(a, n0, n1); return true;
    case F16: float_cols<F16>(a, n0, n1); return true;
    case BF16: float_cols<BF16>(a, n0, n1); return true;
#endif
  }
  return false;
}
