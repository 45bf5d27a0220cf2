// AVX-512, float weights (F32, F16, BF16) at any M: the reference's 16 lane accumulators
// (qmatmul.h: value k to lane k % 16 in order of k) are one 512-bit register per (row,
// column) pair, so a pair's sequence is exactly the reference's, and the pairs of a
// register tile (kRows rows x kCols columns) only run side by side. Each weight vector is
// converted once (F16C's vcvtph2ps: the same bits as common.h f16_to_f32, a signalling NaN
// quieted, which only enters products: simd_driver.h) for kRows products, each activation
// vector loaded once for kCols. Where both factors are halves (F16) the product is exact in
// float32, so one fused multiply-add gives the multiply-then-add's bits (simd_driver.h
// mul_add); F32 and BF16 keep the rounded product. The lanes are then summed by the
// reference's halving (i + 8, i + 4, i + 2, i + 1), and a K % 16 tail by its scalar code
// (simd_driver.h float_tail, shared with the AVX2 path).
//
// Loop order: columns in panels whose weights stay in L2, then rows kRows at a time (their
// activations in L1 while the panel's weights stream past), then the panel's columns kCols
// at a time. None of this changes any pair's arithmetic. Included by simd_driver.h inside
// the AVX-512 path's namespace (KN_HAVE_COLS16).

// 16 weights from index k as floats (exact conversions).
template <int FMT>
KN_INL __m512 wload16(const uint8_t* row, int64_t k) {
  if (FMT == F32) return _mm512_loadu_ps((const float*)(row + 4 * k));
  const __m256i h = _mm256_loadu_si256((const __m256i*)(row + 2 * k));
  if (FMT == F16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <int FMT>
KN_INL __m512 mul_add16(__m512 acc, __m512 x, __m512 w) {
  if (FMT == F16) return _mm512_fmadd_ps(x, w, acc);   // exact product: same bits
  return _mm512_add_ps(acc, _mm512_mul_ps(x, w));
}

// One register tile: R rows (x[0..R)) against C columns (w[0..C)), every pair over all K;
// row i's C results go to y[i][0..C).
template <int FMT, int R, int C>
KN_INL void float_tile16(const float* const* x, const uint8_t* const* w, int64_t K, int64_t K16,
                         float* const* y) {
  __m512 acc[R][C];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K16; k += 16) {
    __m512 wv[C];
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) wv[j] = wload16<FMT>(w[j], k);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m512 xv = _mm512_loadu_ps(x[i] + k);
#pragma GCC unroll 8
      for (int j = 0; j < C; ++j) acc[i][j] = mul_add16<FMT>(acc[i][j], xv, wv[j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) {
      const __m512 l = acc[i][j];
      const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(l), 1));
      float_tail(x[i], w[j], FMT, K16, K, _mm512_castps512_ps256(l), hi, y[i] + j);
    }
}

// Rows [m, m + R) against columns [n0, n1) of one panel, kCols at a time, then singly.
template <int FMT, int R>
KN_INL void float_rows16(const MatmulArgs& a, int64_t m, int64_t n0, int64_t n1, int64_t K16) {
  constexpr int kCols = 4;
  const float* xr[R];
  float* yr[R];
  for (int i = 0; i < R; ++i) {
    xr[i] = &a.acts->f[size_t((m + i) * a.K)];
    yr[i] = a.out(m + i) + n0;
  }
  int64_t n = n0;
  for (; n + kCols <= n1; n += kCols) {
    const uint8_t* wr[kCols];
    for (int j = 0; j < kCols; ++j) wr[j] = a.w + (n + j) * a.row_bytes;
    float_tile16<FMT, R, kCols>(xr, wr, a.K, K16, yr);
    for (int i = 0; i < R; ++i) yr[i] += kCols;
  }
  for (; n < n1; ++n) {
    const uint8_t* wr[1] = {a.w + n * a.row_bytes};
    float_tile16<FMT, R, 1>(xr, wr, a.K, K16, yr);
    for (int i = 0; i < R; ++i) yr[i] += 1;
  }
}

template <int FMT>
KN_SIMD void float_cols16(const MatmulArgs& a, int64_t n0, int64_t n1) {
  constexpr int kRows = 6;
  const int64_t K = a.K, K16 = K / 16 * 16;
  const int64_t wbytes = a.row_bytes;
  // a panel's weights about 256 KiB (in L2), at least 4 columns
  const int64_t panel = std::max<int64_t>(4, (262144 / std::max<int64_t>(wbytes, 1)) / 4 * 4);
  for (int64_t p0 = n0; p0 < n1; p0 += panel) {
    const int64_t p1 = std::min(n1, p0 + panel);
    int64_t m = 0;
    for (; m + kRows <= a.M; m += kRows) float_rows16<FMT, kRows>(a, m, p0, p1, K16);
    for (; m < a.M; ++m) float_rows16<FMT, 1>(a, m, p0, p1, K16);
  }
}
