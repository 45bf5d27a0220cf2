// The reference path: plain C++ that any compiler builds, checked line by line against the
// numpy reference (kinetic/kernels/reference.py). The SIMD paths must give its bits.
#include <vector>

#include "qmatmul.h"

namespace kn {

namespace {

int32_t dot(const int8_t* w, const int8_t* x, int n) {
  int32_t s = 0;
  for (int i = 0; i < n; ++i) s += int32_t(w[i]) * int32_t(x[i]);
  return s;
}

BlockSums block_sums(const FormatInfo& f, const Unpacked& u, const int8_t* xq,
                     const int32_t* bsum) {
  if (f.act != ACT_Q8_K) return {dot(u.q, xq, f.qk), 0};
  BlockSums s{0, 0};
  const int groups = f.qk / f.sub, per = f.sub / 16;  // 16-value activation sums per sub-block
  for (int j = 0; j < groups; ++j) {
    s.sumi += u.sc[j] * dot(u.q + j * f.sub, xq + j * f.sub, f.sub);
    if (f.has_min) {
      int32_t xs = 0;
      for (int g = 0; g < per; ++g) xs += bsum[j * per + g];
      s.summ += u.mn[j] * xs;
    }
  }
  return s;
}

void float_cols(const MatmulArgs& a, int64_t n0, int64_t n1) {
  const QuantActs& x = *a.acts;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = a.w + n * a.row_bytes;
    for (int64_t m = 0; m < a.M; ++m) {
      const float* xm = &x.f[m * a.K];
      float lanes[16] = {};
      for (int64_t k = 0; k < a.K; ++k)
        lanes[k % 16] = lanes[k % 16] + xm[k] * weight_value(a.fmt, row, k);
      a.out(m)[n] = reduce_lanes(lanes);
    }
  }
}

}  // namespace

void qmatmul_cols_ref(const MatmulArgs& a, int64_t n0, int64_t n1) {
  const FormatInfo& f = *a.info;
  if (f.qk == 1) return float_cols(a, n0, n1);
  const QuantActs& x = *a.acts;
  // an activation block is as long as a weight block (q8_0 / q8_1: 32; q8_K: 256)
  const int64_t nb = a.K / f.qk;
  std::vector<float> acc(size_t(a.M));
  Unpacked u;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = a.w + n * a.row_bytes;
    for (float& v : acc) v = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      unpack_block(a.fmt, row + b * f.bytes, u);
      for (int64_t m = 0; m < a.M; ++m) {
        const int8_t* xq = &x.q[m * a.K + b * f.qk];
        const int32_t* bs = x.kind == ACT_Q8_K ? &x.bsum[(m * a.K + b * f.qk) / 16] : nullptr;
        const int64_t ib = m * nb + b;  // this weight block's activation block
        float sx = x.kind == ACT_Q8_1 ? x.s[ib] : 0.f;
        acc[m] = combine(f, acc[m], block_sums(f, u, xq, bs), u.d, u.m, x.d[ib], sx);
      }
    }
    for (int64_t m = 0; m < a.M; ++m) a.out(m)[n] = acc[m];
  }
}

}  // namespace kn
