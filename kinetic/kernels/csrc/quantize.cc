#include "quantize.h"

#include <cmath>

namespace kn {

namespace {

// nearbyint (round half to even) clamped to int8's symmetric range; NaN becomes 0 so that a
// damaged activation never reaches an undefined float-to-int conversion.
inline int8_t to_q(float v) {
  v = std::nearbyint(v);
  if (v != v) return 0;
  return int8_t(v > 127.f ? 127.f : v < -127.f ? -127.f : v);
}

void q8_0_row(const float* x, int64_t K, bool with_sum, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* xb = x + b * 32;
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
    float db = amax / 127.f;
    float id = db > 0.f ? 1.f / db : 0.f;
    int32_t sum = 0;
    for (int i = 0; i < 32; ++i) {
      q[b * 32 + i] = to_q(xb[i] * id);
      sum += q[b * 32 + i];
    }
    d[b] = round_f16(db);
    if (with_sum) s[b] = round_f16(db * float(sum));
  }
}

void q8_k_row(const float* x, int64_t K, int8_t* q, float* d, int32_t* bsum) {
  for (int64_t b = 0; b < K / 256; ++b) {
    const float* xb = x + b * 256;
    float amax = 0.f, max = 0.f;  // the first value of largest magnitude, with its sign
    for (int i = 0; i < 256; ++i) {
      float a = std::fabs(xb[i]);
      if (a > amax) { amax = a; max = xb[i]; }
    }
    int8_t* qb = q + b * 256;
    if (amax == 0.f) {
      d[b] = 0.f;
      for (int i = 0; i < 256; ++i) qb[i] = 0;
    } else {
      float iscale = -127.f / max;
      for (int i = 0; i < 256; ++i) qb[i] = to_q(iscale * xb[i]);
      d[b] = 1.f / iscale;
    }
    for (int g = 0; g < 16; ++g) {
      int32_t sum = 0;
      for (int i = 0; i < 16; ++i) sum += qb[g * 16 + i];
      bsum[b * 16 + g] = sum;
    }
  }
}

}  // namespace

void quantize_acts(ActKind kind, const float* x, int64_t M, int64_t K, QuantActs& out) {
  out.kind = kind;
  out.M = M;
  out.K = K;
  if (kind == ACT_F32 || kind == ACT_F16 || kind == ACT_BF16) {
    out.f.resize(size_t(M * K));
    for (int64_t i = 0; i < M * K; ++i)
      out.f[i] = kind == ACT_F16 ? round_f16(x[i]) : kind == ACT_BF16 ? round_bf16(x[i]) : x[i];
    return;
  }
  const int64_t nb = out.blocks_per_row();
  out.q.resize(size_t(M * K));
  out.d.resize(size_t(M * nb));
  if (kind == ACT_Q8_K) {
    out.bsum.resize(size_t(M * K / 16));
    for (int64_t m = 0; m < M; ++m)
      q8_k_row(x + m * K, K, &out.q[m * K], &out.d[m * nb], &out.bsum[m * K / 16]);
    return;
  }
  if (kind == ACT_Q8_1) out.s.resize(size_t(M * nb));
  for (int64_t m = 0; m < M; ++m)
    q8_0_row(x + m * K, K, kind == ACT_Q8_1, &out.q[m * K], &out.d[m * nb],
             kind == ACT_Q8_1 ? &out.s[m * nb] : nullptr);
}

}  // namespace kn
