// The SIMD driver shared by the AVX2 and AVX-512 paths: loops over output columns 8 at a
// time (16 with KN_HAVE_COLS16, the AVX-512 path: legacy blocks below and
// K-quant blocks at any M in simd_kquant16.h), integer block sums from simd_formats.h, and
// the float part done exactly as the reference does it (qmatmul.h), vectorized ACROSS the
// columns: lane c of every float vector performs, in the same order, the scalar operations
// the reference performs for column c. Included like simd_formats.h (inside an ISA's
// anonymous namespace, after it).

// ---- exact helpers ------------------------------------------------------------------

// 8 IEEE halves (the low 16 bits of int32 lanes, the rest zero) -> floats, bit for bit what
// common.h f16_to_f32 gives (subnormals as man * 2^-24, inf / NaN payloads kept; no F16C,
// which would quiet a signalling NaN).
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
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
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
    t[j] = _mm256_permute2x128_si256(s[j], s[j + 4], 0x20);
    t[j + 4] = _mm256_permute2x128_si256(s[j], s[j + 4], 0x31);
  }
}

// Per-call activation extras: Q8_K rows' 16-value sums packed to int16 (|sum| <= 2032), and
// for legacy formats with an offset the sum of each 32-value activation block.
template <class F>
KN_SIMD void act_extras(const QuantActs& x, int64_t M, std::vector<int16_t>& bs, std::vector<int32_t>& xs) {
  const int64_t K = x.K;
  if (F::QK == 256) {
    bs.resize(size_t(M * K / 16));
    for (int64_t i = 0; i < M * K / 256; ++i) {
      const __m256i a = _mm256_loadu_si256((const __m256i*)&x.bsum[16 * i]);
      const __m256i b = _mm256_loadu_si256((const __m256i*)&x.bsum[16 * i + 8]);
      const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
      _mm256_storeu_si256((__m256i*)&bs[16 * i], p);
    }
  } else if (F::XOFF) {
    xs.resize(size_t(M * K / 32));
    for (int64_t i = 0; i < M * K / 32; ++i) {
      int32_t s = 0;
      for (int j = 0; j < 32; ++j) s += x.q[32 * i + j];
      xs[i] = s;
    }
  }
}

// ---- quantized formats --------------------------------------------------------------

#ifdef KN_HAVE_COLS16
#define KN_INL_LAMBDA KN_SIMD __attribute__((always_inline))
// AVX-512, 32-value legacy blocks at any M: 16 output columns per group, one per lane
// of a 512-bit vector. Each weight block is unpacked once for the 16 columns and transposed
// (t[j] lane c = int32 j of column c's unpacked bytes), then dotted with every row's
// activation block by dpbusd against broadcast activation words (integer: exact in any
// order). The float part is the reference's combine, lane c doing column c's sequence.

// 16 IEEE halves (low 16 bits of int32 lanes) -> floats, the same operations as f16x8.
KN_INL __m512 f16x16(__m512i h) {
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(h, _mm512_set1_epi32(0x8000)), 16);
  const __m512i em = _mm512_and_si512(h, _mm512_set1_epi32(0x7FFF));
  const __m512i exp = _mm512_srli_epi32(em, 10);
  const __mmask16 is_max = _mm512_cmpeq_epi32_mask(exp, _mm512_set1_epi32(31));
  const __mmask16 is_sub = _mm512_cmpeq_epi32_mask(exp, _mm512_setzero_si512());
  const __m512i b112 = _mm512_set1_epi32(112 << 23);
  const __m512i bias = _mm512_mask_add_epi32(b112, is_max, b112, b112);
  const __m512i normal = _mm512_or_si512(sign, _mm512_add_epi32(_mm512_slli_epi32(em, 13), bias));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(em), _mm512_set1_ps(1.0f / 16777216.0f));
  const __m512i subbits = _mm512_or_si512(_mm512_castps_si512(sub), sign);
  return _mm512_castsi512_ps(_mm512_mask_blend_epi32(is_sub, normal, subbits));
}

// z[i] = (column lo(i) | column lo(i) + 4), lo(i) = i < 4 ? i : i + 4; returns t[0..7],
// lane c of t[j] = int32 j of column c.
KN_INL void transpose16(const __m512i* z, __m512i* t) {
  __m512i a[8], s[8];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
  }
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    s[4 * h + 0] = _mm512_unpacklo_epi64(a[4 * h], a[4 * h + 2]);
    s[4 * h + 1] = _mm512_unpackhi_epi64(a[4 * h], a[4 * h + 2]);
    s[4 * h + 2] = _mm512_unpacklo_epi64(a[4 * h + 1], a[4 * h + 3]);
    s[4 * h + 3] = _mm512_unpackhi_epi64(a[4 * h + 1], a[4 * h + 3]);
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    t[j] = _mm512_shuffle_i64x2(s[j], s[j + 4], 0x88);
    t[j + 4] = _mm512_shuffle_i64x2(s[j], s[j + 4], 0xDD);
  }
}

// Two columns' unpacked blocks as one vector (lo in bits 0..255, hi in 256..511), bytes as
// F::load gives them; the legacy formats unpack both at once.
template <class F>
KN_INL __m512i load_pair(const uint8_t* lo, const uint8_t* hi) {
  constexpr int QS = std::is_same_v<F, FQ4_0> ? 2 : std::is_same_v<F, FQ4_1> ? 4
                   : std::is_same_v<F, FQ5_0> ? 6 : std::is_same_v<F, FQ5_1> ? 8 : 0;
  if constexpr (QS != 0) {
    // [qs_lo, qs_lo, qs_hi, qs_hi] >> (0, 4, 0, 4) per 128 bits, & 0x0F: nibbles16 twice.
    const __m512i q = _mm512_mask_broadcast_i32x4(_mm512_broadcast_i32x4(ld128(lo + QS)), 0xFF00, ld128(hi + QS));
    __m512i u = _mm512_and_si512(_mm512_srlv_epi64(q, _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0)), _mm512_set1_epi8(0x0F));
    if constexpr (QS == 6 || QS == 8) {
      const uint64_t bits = uint64_t(load_u32(lo + QS - 4)) | (uint64_t(load_u32(hi + QS - 4)) << 32);
      u = _mm512_or_si512(u, _mm512_maskz_mov_epi8(__mmask64(bits), _mm512_set1_epi8(0x10)));
    }
    return u;
  } else {
    typename F::W w0, w1;
    F::load(lo, w0);
    F::load(hi, w1);
    return _mm512_inserti64x4(_mm512_castsi256_si512(w0.u), w1.u, 1);
  }
}

// acc + dpbusd(u, the s8 word *x broadcast to every lane), the broadcast folded into the
// instruction's memory operand (one micro-op).
KN_INL __m512i dpbusd_bcast(__m512i acc, __m512i u, const uint32_t* x) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*x));
  return acc;
}

template <class F>
KN_SIMD void quant_cols16(const MatmulArgs& a, int64_t n0, int64_t n1) {
  const QuantActs& x = *a.acts;
  const int64_t M = a.M, K = a.K, nb = K / F::QK, xbr = x.blocks_per_row();
  std::vector<int16_t> bs;
  std::vector<int32_t> xs;
  act_extras<F>(x, M, bs, xs);
  std::vector<float> acc(size_t(M * 16));
  const uint32_t* xw = reinterpret_cast<const uint32_t*>(x.q.data());
  for (int64_t n = n0; n < n1; n += 16) {
    const uint8_t* rows[16];
    alignas(64) int32_t off[16];
    for (int c = 0; c < 16; ++c) rows[c] = a.w + std::min(n + c, n1 - 1) * a.row_bytes;
    for (int c = 0; c < 16; ++c) off[c] = int32_t(rows[c] - rows[0]);
    const __m512i vidx = _mm512_load_si512(off);
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t b = 0; b < nb; ++b) {
      __m512i z[8], t[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        const int lo = i < 4 ? i : i + 4;
        z[i] = load_pair<F>(rows[lo] + b * F::BYTES, rows[lo + 4] + b * F::BYTES);
      }
      transpose16(z, t);
      const __m512i dm = _mm512_i32gather_epi32(vidx, rows[0] + b * F::BYTES + F::DOFF, 1);
      const __m512 dw = f16x16(_mm512_and_si512(dm, _mm512_set1_epi32(0xFFFF)));
      const __m512 mw = F::KIND ? f16x16(_mm512_srli_epi32(dm, 16)) : _mm512_setzero_ps();
      // The reference's combine (qmatmul.h), operand for operand, for row m.
      auto finish = [&](int64_t m, __m512i isum) KN_INL_LAMBDA {
        if (F::XOFF) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(F::XOFF * xs[size_t(m * nb + b)]));
        const int64_t ib = m * xbr + b;
        const __m512 dx = _mm512_set1_ps(x.d[size_t(ib)]);
        __m512 step = _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, dx));
        if (F::KIND == 1) step = _mm512_add_ps(step, _mm512_mul_ps(mw, _mm512_set1_ps(x.s[size_t(ib)])));
        float* am = &acc[size_t(m * 16)];
        _mm512_storeu_ps(am, _mm512_add_ps(_mm512_loadu_ps(am), step));
      };
      // Integer sums of one row: 8 dpbusd against its 8 broadcast activation words.
      auto sums = [&](int64_t m) KN_INL_LAMBDA {
        const uint32_t* xb = xw + size_t((m * K + b * F::QK) / 4);
        __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int j = 0; j < 8; j += 2) {
          i0 = dpbusd_bcast(i0, t[j], xb + j);
          i1 = dpbusd_bcast(i1, t[j + 1], xb + j + 1);
        }
        return _mm512_add_epi32(i0, i1);
      };
      int64_t m = 0;
      for (; m + 2 <= M; m += 2) {
        const __m512i s0 = sums(m), s1 = sums(m + 1);
        finish(m, s0);
        finish(m + 1, s1);
      }
      if (m < M) finish(m, sums(m));
    }
    const int valid = int(std::min<int64_t>(16, n1 - n));
    for (int64_t m = 0; m < M; ++m)
      for (int c = 0; c < valid; ++c) a.y[m * a.N + n + c] = acc[size_t(m * 16 + c)];
  }
}

#include "simd_kquant16.h"
#endif

// Output columns [n0, n1) of every row for format F; ONE: M is 1 (lets the compiler keep
// everything in registers). Columns past n1 in the last group repeat column n1 - 1 and
// are not stored.
template <class F, bool ONE>
KN_SIMD void quant_cols(const MatmulArgs& a, int64_t n0, int64_t n1) {
  const QuantActs& x = *a.acts;
  const int64_t M = ONE ? 1 : a.M, K = a.K, nb = K / F::QK, xbr = x.blocks_per_row();
  std::vector<int16_t> bs;
  std::vector<int32_t> xs;
  act_extras<F>(x, M, bs, xs);
  std::vector<float> acc(size_t(M * 8));
  for (int64_t n = n0; n < n1; n += 8) {
    const uint8_t* rows[8];
    for (int c = 0; c < 8; ++c) rows[c] = a.w + std::min(n + c, n1 - 1) * a.row_bytes;
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t b = 0; b < nb; ++b) {
      typename F::W w[8];
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) F::load(rows[c] + b * F::BYTES, w[c]);
      const __m256i dm = gather8_u32(rows, b * F::BYTES + F::DOFF);  // d | m << 16, per column
      const __m256 dw = f16x8(F::DHI ? _mm256_srli_epi32(dm, 16) : _mm256_and_si256(dm, _mm256_set1_epi32(0xFFFF)));
      const __m256 mw = F::KIND ? f16x8(_mm256_srli_epi32(dm, 16)) : _mm256_setzero_ps();
      // Legacy blocks with several rows: transpose once so that lane c holds column c, and
      // each row's block sums come out per lane with no horizontal reduction.
      constexpr bool LANES = !ONE && F::QK == 32;
      __m256i t[8];
      if constexpr (LANES) {
        __m256i v[8];
        for (int c = 0; c < 8; ++c) v[c] = w[c].u;
        transpose8(v, t);
      }
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* xq = &x.q[size_t(m * K + b * F::QK)];
        const int16_t* bsm = F::QK == 256 ? &bs[size_t((m * K + b * F::QK) / 16)] : nullptr;
        __m256i isum = _mm256_setzero_si256(), q[8];
        if constexpr (LANES) {
          const uint8_t* xb = reinterpret_cast<const uint8_t*>(xq);
#pragma GCC unroll 8
          for (int j = 0; j < 8; ++j) isum = F::acc4(isum, t[j], _mm256_set1_epi32(int(load_u32(xb + 4 * j))));
        } else {
          __m256i p[8];
#pragma GCC unroll 8
          for (int c = 0; c < 8; ++c) p[c] = F::template dot<!ONE>(w[c], xq, bsm, q[c]);
          isum = reduce8(p);
        }
        if (F::XOFF) isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(F::XOFF * xs[size_t(m * nb + b)]));
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
      for (int c = 0; c < valid; ++c) a.y[m * a.N + n + c] = acc[size_t(m * 8 + c)];
  }
}

// With KN_HAVE_COLS16 (AVX-512) every quantized format takes a 16-column path at any M (it
// beats the 8-column loops at M = 1 too), and the 8-column loops are not instantiated.
template <class F>
KN_SIMD void quant_run(const MatmulArgs& a, int64_t n0, int64_t n1) {
#ifdef KN_HAVE_COLS16
  static_assert(K16<F>::HAVE || F::QK == 32, "a quantized format without a 16-column path");
  if constexpr (K16<F>::HAVE)
    kquant_cols16<F>(a, n0, n1);
  else
    quant_cols16<F>(a, n0, n1);
#else
  if (a.M == 1)
    quant_cols<F, true>(a, n0, n1);
  else
    quant_cols<F, false>(a, n0, n1);
#endif
}

// ---- float formats ------------------------------------------------------------------

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
template <int FMT>
KN_SIMD void float_cols(const MatmulArgs& a, int64_t n0, int64_t n1) {
  const QuantActs& x = *a.acts;
  const int64_t K = a.K, K16 = K / 16 * 16;
  // M > 1 with half weights: convert each row once (exactly) and reuse it for every row.
  std::vector<float> wf(FMT != F32 && a.M > 1 ? size_t(K) : 0);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = a.w + n * a.row_bytes;
    if (!wf.empty()) {
      for (int64_t k = 0; k + 8 <= K; k += 8) _mm256_storeu_ps(&wf[size_t(k)], wload8<FMT>(row, k));
      for (int64_t k = K / 8 * 8; k < K; ++k) wf[size_t(k)] = weight_value(FMT, row, k);
    }
    for (int64_t m = 0; m < a.M; ++m) {
      const float* xm = &x.f[size_t(m * K)];
      __m256 l0 = _mm256_setzero_ps(), l1 = _mm256_setzero_ps();
      for (int64_t k = 0; k < K16; k += 16) {
        const __m256 w0 = wf.empty() ? wload8<FMT>(row, k) : _mm256_loadu_ps(&wf[size_t(k)]);
        const __m256 w1 = wf.empty() ? wload8<FMT>(row, k + 8) : _mm256_loadu_ps(&wf[size_t(k + 8)]);
        l0 = _mm256_add_ps(l0, _mm256_mul_ps(_mm256_loadu_ps(xm + k), w0));
        l1 = _mm256_add_ps(l1, _mm256_mul_ps(_mm256_loadu_ps(xm + k + 8), w1));
      }
      float lanes[16];
      _mm256_storeu_ps(lanes, l0);
      _mm256_storeu_ps(lanes + 8, l1);
      for (int64_t k = K16; k < K; ++k) lanes[k % 16] = lanes[k % 16] + xm[k] * weight_value(FMT, row, k);
      a.y[m * a.N + n] = reduce_lanes(lanes);
    }
  }
}

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
    case F32: float_cols<F32>(a, n0, n1); return true;
    case F16: float_cols<F16>(a, n0, n1); return true;
    case BF16: float_cols<BF16>(a, n0, n1); return true;
  }
  return false;
}
