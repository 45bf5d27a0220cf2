// AVX-512, 32-value legacy blocks at any M: 16 output columns per group, one per lane of a
// 512-bit vector. A strip of up to kStrip blocks is unpacked once for the 16 columns and
// transposed (t[8 * b + j] lane c = int32 j of column c's unsigned values in block b), then
// rows go through it up to 8 at a time, their accumulators in registers: per row and block
// the integer sum by 8 dpbusd against broadcast activation words (exact in any order),
// started from -XOFF * (sum of the activations) for the formats with an offset, then the
// reference's combine (qmatmul.h) operand for operand, lane c doing column c's sequence.
// Included by simd_driver.h inside the AVX-512 path's namespace (simd_kquant16.h, after
// it, uses its helpers).

// 16 IEEE halves (low 16 bits of int32 lanes) -> floats, as f16x8 (simd_driver.h): F16C's
// vcvtph2ps after a truncating pack (the lanes hold 0 .. 0xFFFF), else the software
// conversion's operations.
#ifdef KN_F16C_SCALES
KN_INL __m512 f16x16(__m512i h) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h)); }
#else
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
#endif

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
// F::load gives them, both unpacked at once.
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
  } else {  // Q8_0: qs[32] from byte 2, offset by 128 (FQ8_0::load)
    static_assert(std::is_same_v<F, FQ8_0>, "a 32-value format load_pair does not know");
    const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(ld256(lo + 2)), ld256(hi + 2), 1);
    return _mm512_xor_si512(q, _mm512_set1_epi8(char(0x80)));
  }
}

// The u32 at rows[c] + off of the 16 columns (d | m << 16 for legacy blocks): 16 loads, not
// vpgatherdd, which microcode makes slow on CPUs mitigated for Gather Data Sampling.
KN_INL __m512i gather16_u32(const uint8_t* const* rows, int64_t off) {
  const __m256i lo = gather8_u32(rows, off), hi = gather8_u32(rows + 8, off);
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// acc + dpbusd(u, the s8 word *x broadcast to every lane), the broadcast folded into the
// instruction's memory operand (one micro-op).
KN_INL __m512i dpbusd_bcast(__m512i acc, __m512i u, const uint32_t* x) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*x));
  return acc;
}

// One strip of a 16-column group: t as above; dw[b] / mw[b] block b's d and m per column.
struct Strip16 {
  __m512i t[8 * kStrip];
  __m512 dw[kStrip], mw[kStrip];
};

// Blocks b0 .. b0 + nbs - 1 of the 16 columns at rows into s; next: the next group's rows.
template <class F>
KN_INL void unpack_strip(const uint8_t* const* rows, int64_t b0, int nbs, uintptr_t next, Strip16& s) {
  for (int b = 0; b < nbs; ++b) {
    const int64_t off = (b0 + b) * F::BYTES;
    prefetch_slice(next, b0 + b, 16 * F::BYTES);
    __m512i z[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const int lo = i < 4 ? i : i + 4;
      z[i] = load_pair<F>(rows[lo] + off, rows[lo + 4] + off);
    }
    transpose16(z, s.t + 8 * b);
    const __m512i dm = gather16_u32(rows, off + F::DOFF);
    s.dw[b] = f16x16(_mm512_and_si512(dm, _mm512_set1_epi32(0xFFFF)));
    s.mw[b] = F::KIND ? f16x16(_mm512_srli_epi32(dm, 16)) : _mm512_setzero_ps();
  }
}

// One block against R rows: t[j] the block's 8 vectors, dw / mw its d and m per column, i0
// the first row's index into the activations' block-major arrays (block b, row m: b * M + m).
// Per row the integer sum by 8 dpbusd from -XOFF * (sum of its activations), then the
// reference's combine into acc[r]. Every path through a legacy block takes this sequence.
template <class F, int R>
KN_INL void block_rows(const __m512i* t, __m512 dw, __m512 mw, const QuantActs& x,
                       const int32_t* init, int64_t i0, __m512* acc) {
  const uint32_t* xw = x.bq.data() + 8 * i0;
  __m512i p[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) p[r] = F::XOFF ? _mm512_set1_epi32(init[i0 + r]) : _mm512_setzero_si512();
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    const __m512i u = _mm512_load_si512(&t[j]);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) p[r] = dpbusd_bcast(p[r], u, xw + 8 * r + j);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    __m512 step = _mm512_mul_ps(_mm512_cvtepi32_ps(p[r]), _mm512_mul_ps(dw, _mm512_set1_ps(x.bd[size_t(i0 + r)])));
    if (F::KIND == 1) step = _mm512_add_ps(step, _mm512_mul_ps(mw, _mm512_set1_ps(x.bs[size_t(i0 + r)])));
    acc[r] = _mm512_add_ps(acc[r], step);
  }
}

// fn(std::integral_constant<int, r>()) for r = 1 .. 8: the row-group size as a constant.
template <class Fn>
KN_INL void with_rows(int r, Fn&& fn) {
  switch (r) {
    case 8: fn(std::integral_constant<int, 8>()); break;
    case 7: fn(std::integral_constant<int, 7>()); break;
    case 6: fn(std::integral_constant<int, 6>()); break;
    case 5: fn(std::integral_constant<int, 5>()); break;
    case 4: fn(std::integral_constant<int, 4>()); break;
    case 3: fn(std::integral_constant<int, 3>()); break;
    case 2: fn(std::integral_constant<int, 2>()); break;
    default: fn(std::integral_constant<int, 1>()); break;
  }
}

// R rows from m against the strip's nbs blocks from b0: acc[r] (16 columns of row m + r) in
// registers across the strip, each strip vector loaded once for the R rows.
template <class F, int R>
KN_SIMD void rows_strip(const Strip16& s, int nbs, int64_t b0, const QuantActs& x, const int32_t* init,
                        int64_t m, float* acc16) {
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_loadu_ps(acc16 + 16 * r);
  for (int b = 0; b < nbs; ++b)
    block_rows<F, R>(s.t + 8 * b, s.dw[b], s.mw[b], x, init, (b0 + b) * x.M + m, acc);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc16 + 16 * r, acc[r]);
}

// Rows up to 8 at a time (the rest in one smaller group).
template <class F>
KN_SIMD void rows_any(const Strip16& s, int nbs, int64_t b0, const QuantActs& x, const int32_t* init, float* acc) {
  for (int64_t m = 0; m < x.M;) {
    const int r = int(std::min<int64_t>(8, x.M - m));
    with_rows(r, [&](auto rows) KN_INL_LAMBDA {
      rows_strip<F, decltype(rows)::value>(s, nbs, b0, x, init, m, acc + 16 * m);
    });
    m += r;
  }
}

// ---- repacked weights (repack.h) ------------------------------------------------------------
// A group's blocks are stored as the vectors unpack_strip builds: a strip is loads, the
// 4-bit formats' nibbles split, the 5th bits added from their masks, the 16 scales converted
// from one load. rows_any then runs as for plain rows, so the bits are the same.

// 16 halves (one 256-bit load) -> floats.
KN_INL __m512 f16x16_halves(__m256i h) {
#ifdef KN_F16C_SCALES
  return _mm512_cvtph_ps(h);
#else
  return f16x16(_mm512_cvtepu16_epi32(h));
#endif
}

// One repacked block of a group (at p): t[j] as unpack_strip builds it, its d and m per column.
template <class F>
KN_INL void unpack_block_r16(const uint8_t* p, __m512i* t, __m512& dw, __m512& mw) {
  constexpr bool Q8 = std::is_same_v<F, FQ8_0>;
  constexpr bool HI = std::is_same_v<F, FQ5_0> || std::is_same_v<F, FQ5_1>;
  constexpr int HI_AT = F::KIND ? 64 : 32, V_AT = HI_AT + (HI ? 64 : 0);  // repack.h Parts
  const __m512i low4 = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
  dw = f16x16_halves(ld256(p));
  mw = F::KIND ? f16x16_halves(ld256(p + 32)) : _mm512_setzero_ps();
  if constexpr (Q8) {
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) t[j] = _mm512_loadu_si512(p + V_AT + 64 * j);
  } else {
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i q = _mm512_loadu_si512(p + V_AT + 64 * j);
      __m512i lo = _mm512_and_si512(q, low4), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4);
      if constexpr (HI) {
        uint64_t mlo, mhi;
        std::memcpy(&mlo, p + HI_AT + 8 * j, 8);
        std::memcpy(&mhi, p + HI_AT + 8 * (j + 4), 8);
        lo = _mm512_or_si512(lo, _mm512_maskz_mov_epi8(__mmask64(mlo), bit4));
        hi = _mm512_or_si512(hi, _mm512_maskz_mov_epi8(__mmask64(mhi), bit4));
      }
      t[j] = lo;
      t[j + 4] = hi;
    }
  }
}

// next: the next group (its blocks prefetched as this group's are read, as unpack_strip does:
// the hardware prefetcher stops at page boundaries).
template <class F>
KN_INL void unpack_strip_r16(const uint8_t* group, int64_t b0, int nbs, uintptr_t next, Strip16& s) {
  for (int b = 0; b < nbs; ++b) {
    prefetch_slice(next, b0 + b, 16 * F::BYTES);
    unpack_block_r16<F>(group + (b0 + b) * 16 * F::BYTES, s.t + 8 * b, s.dw[b], s.mw[b]);
  }
}

// Rows m0 .. m0 + R - 1 (R <= 8) against a repacked group's nb blocks, a block at a time, its
// vectors in registers and the rows' accumulators too (no strip in memory: at few rows,
// storing and reloading the strip cost as much as the sums). Per row and block the sums and
// the combine are rows_strip's (block_rows), in the same order, so the bits are the same.
// The results go straight to a's output, columns n.. of those rows (valid: the columns that
// exist). next: the group to prefetch (0: none, on a second pass over a group already in the
// caches).
template <class F>
KN_SIMD void few_rows_r16(const uint8_t* group, int64_t nb, uintptr_t next, const QuantActs& x,
                          const int32_t* init, int64_t m0, int rows_n, const MatmulArgs& a,
                          int64_t n, __mmask16 valid) {
  with_rows(rows_n, [&](auto rows) KN_INL_LAMBDA {
    constexpr int R = decltype(rows)::value;
    __m512 acc[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      prefetch_slice(next, b, 16 * F::BYTES);
      __m512i t[8];
      __m512 dw, mw;
      unpack_block_r16<F>(group + b * 16 * F::BYTES, t, dw, mw);
      block_rows<F, R>(t, dw, mw, x, init, b * x.M + m0, acc);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(a.out(m0 + r) + n, valid, acc[r]);
  });
}

// Rows up to which a repacked weight's groups run block by block in registers (few_rows_r16),
// 8 rows at a time, each group read again from the caches for every 8 rows: at 16 rows that
// beats unpacking a strip into memory and reading it back (bench/kernel.py, Qwen2.5-0.5B at
// 16 rows: the Q8_0 output 5.99 -> 4.70 ms, the Q5_0 gate and up 0.145 -> 0.132 ms); at 32
// and 64 rows the strip was as fast or faster (Q5_0 0.269 against 0.301 ms at 32).
constexpr int64_t kFewRows = 16;

// Columns [n0, n1), 16 at a time. R16: the weight is repacked (repack.h; n0 and n1 multiples
// of 16), each group's blocks read as stored (unpack_strip_r16, above); else plain rows.
template <class F, bool R16>
KN_SIMD void legacy_cols16(const MatmulArgs& a, int64_t n0, int64_t n1) {
  const int64_t M = a.M, nb = a.K / F::QK;
  const QuantActs& acts = *a.acts;
  const std::vector<int32_t> own = a.words ? std::vector<int32_t>() : offset_init<F>(acts);
  const int32_t* init = a.words ? a.words : own.data();
  std::vector<float> acc(size_t(M * 16));
  Strip16 strip;
  for (int64_t n = n0; n < n1; n += 16) {
    const uint8_t* rows[16];
    if constexpr (!R16)
      for (int c = 0; c < 16; ++c) rows[c] = a.w + std::min(n + c, n1 - 1) * a.row_bytes;
    const uintptr_t next = next_group(a, n, 16);
    const __mmask16 valid = __mmask16((1u << std::min<int64_t>(16, n1 - n)) - 1);
    if (R16 && M <= kFewRows) {   // a block at a time, in registers, 8 rows at a time
      for (int64_t m0 = 0; m0 < M; m0 += 8)
        few_rows_r16<F>(a.w + n * a.row_bytes, nb, m0 == 0 ? next : 0, acts, init, m0,
                        int(std::min<int64_t>(8, M - m0)), a, n, valid);
      continue;
    }
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t b0 = 0; b0 < nb; b0 += kStrip) {
      const int nbs = int(std::min<int64_t>(kStrip, nb - b0));
      if constexpr (R16)
        unpack_strip_r16<F>(a.w + n * a.row_bytes, b0, nbs, next, strip);
      else
        unpack_strip<F>(rows, b0, nbs, next, strip);
      rows_any<F>(strip, nbs, b0, acts, init, acc.data());
    }
    for (int64_t m = 0; m < M; ++m)
      _mm512_mask_storeu_ps(a.out(m) + n, valid, _mm512_loadu_ps(&acc[size_t(16 * m)]));
  }
}
