// AVX2, 32-value legacy blocks with several rows: 8 output columns per group, one per int32
// lane of a 256-bit vector. A strip of up to kStrip blocks is unpacked and transposed once
// for every row (t[8 * b + j] lane c = int32 j of column c's values in block b), then rows
// go through it R at a time with their accumulators in registers. Per row and block the
// integer sum comes from maddubs against broadcast activation words; the int16 pair sums of
// F::W16 words are added as int16 before one madd to int32 (4-bit values: 8 words, at most
// 8 * 2 * 15 * 127 = 30480; 5-bit: 4 words, 31496; Q8_0's sign trick: 1 word, 32512), so
// nothing saturates and the sum is the reference's integer. The float part is the
// reference's combine (qmatmul.h) operand for operand, lane c doing column c's sequence.
// Included by simd_driver.h inside the AVX2 path's namespace.

struct Strip8 {
  __m256i t[8 * kStrip];   // the unsigned values (Q8_0: |w|)
  __m256i ts[8 * kStrip];  // F::SIGNED: the signed weights, whose signs go to the activations
  __m256 dw[kStrip], mw[kStrip];
};

// Blocks b0 .. b0 + nbs - 1 of the 8 columns at rows into s; next: the next group's rows.
template <class F>
KN_INL void unpack_strip8(const uint8_t* const* rows, int64_t b0, int nbs, uintptr_t next, Strip8& s) {
  for (int b = 0; b < nbs; ++b) {
    const int64_t off = (b0 + b) * F::BYTES;
    prefetch_slice(next, b0 + b, 8 * F::BYTES);
    __m256i v[8];
    typename F::W w[8];
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      F::load(rows[c] + off, w[c]);
      v[c] = w[c].u;
    }
    if constexpr (F::SIGNED) {
      transpose8(v, s.ts + 8 * b);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) s.t[8 * b + j] = _mm256_abs_epi8(s.ts[8 * b + j]);
    } else {
      transpose8(v, s.t + 8 * b);
    }
    const __m256i dm = gather8_u32(rows, off + F::DOFF);  // d | m << 16, per column
    s.dw[b] = f16x8(_mm256_and_si256(dm, _mm256_set1_epi32(0xFFFF)));
    s.mw[b] = F::KIND ? f16x8(_mm256_srli_epi32(dm, 16)) : _mm256_setzero_ps();
  }
}

// R rows from m against the strip's nbs blocks from b0 (acc8: their 8 columns, kept in
// registers across the strip).
template <class F, int R>
KN_SIMD void rows_strip8(const Strip8& s, int nbs, int64_t b0, const QuantActs& x, const int32_t* init,
                         int64_t m, float* acc8) {
  __m256 acc[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r] = _mm256_loadu_ps(acc8 + 8 * r);
  const int64_t i0 = b0 * x.M + m;
  const uint32_t* xw = x.bq.data() + 8 * i0;
  const float* d = x.bd.data() + i0;
  const float* sx = F::KIND == 1 ? x.bs.data() + i0 : nullptr;
  const int32_t* start = F::XOFF ? init + i0 : nullptr;  // the rows' -XOFF * sums
  const __m256i ones = _mm256_set1_epi16(1);
  for (int b = 0; b < nbs; ++b) {
    __m256i p[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) p[r] = F::XOFF ? _mm256_set1_epi32(start[r]) : _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int g = 0; g < 8; g += F::W16) {
      __m256i h[R];
#pragma GCC unroll 8
      for (int j = g; j < g + F::W16; ++j) {
        const __m256i u = _mm256_load_si256(&s.t[8 * b + j]);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          __m256i xb = _mm256_set1_epi32(int(xw[8 * r + j]));
          if constexpr (F::SIGNED) xb = _mm256_sign_epi8(xb, _mm256_load_si256(&s.ts[8 * b + j]));
          const __m256i q = _mm256_maddubs_epi16(u, xb);
          h[r] = j == g ? q : _mm256_add_epi16(h[r], q);
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) p[r] = _mm256_add_epi32(p[r], _mm256_madd_epi16(h[r], ones));
    }
    const __m256 dw = s.dw[b], mw = s.mw[b];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      __m256 step = _mm256_mul_ps(_mm256_cvtepi32_ps(p[r]), _mm256_mul_ps(dw, _mm256_set1_ps(d[r])));
      if (F::KIND == 1) step = _mm256_add_ps(step, _mm256_mul_ps(mw, _mm256_set1_ps(sx[r])));
      acc[r] = _mm256_add_ps(acc[r], step);
    }
    xw += 8 * x.M;
    d += x.M;
    if (F::KIND == 1) sx += x.M;
    if (F::XOFF) start += x.M;
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc8 + 8 * r, acc[r]);
}

template <class F>
KN_SIMD void legacy_cols8(const MatmulArgs& a, int64_t n0, int64_t n1) {
  const int64_t M = a.M, nb = a.K / 32;
  const QuantActs& acts = *a.acts;
  const std::vector<int32_t> init = offset_init<F>(acts);
  std::vector<float> acc(size_t(M * 8));
  Strip8 strip;
  for (int64_t n = n0; n < n1; n += 8) {
    const uint8_t* rows[8];
    for (int c = 0; c < 8; ++c) rows[c] = a.w + std::min(n + c, n1 - 1) * a.row_bytes;
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t b0 = 0; b0 < nb; b0 += kStrip) {
      const int nbs = int(std::min<int64_t>(kStrip, nb - b0));
      unpack_strip8<F>(rows, b0, nbs, next_group(a, n, 8), strip);
      for (int64_t m = 0; m < M;) {  // 4 rows at a time (16 registers), the rest in one group
        const int r = int(std::min<int64_t>(4, M - m));
        float* am = &acc[size_t(8 * m)];
        switch (r) {
          case 4: rows_strip8<F, 4>(strip, nbs, b0, acts, init.data(), m, am); break;
          case 3: rows_strip8<F, 3>(strip, nbs, b0, acts, init.data(), m, am); break;
          case 2: rows_strip8<F, 2>(strip, nbs, b0, acts, init.data(), m, am); break;
          default: rows_strip8<F, 1>(strip, nbs, b0, acts, init.data(), m, am); break;
        }
        m += r;
      }
    }
    const int valid = int(std::min<int64_t>(8, n1 - n));
    for (int64_t m = 0; m < M; ++m)
      for (int c = 0; c < valid; ++c) a.out(m)[n + c] = acc[size_t(m * 8 + c)];
  }
}
