// The gated delta rule, one row at a time (delta_rule.h).
#include "delta_rule.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu.h"
#include "parallel.h"

namespace kn {

namespace {

constexpr int64_t kMaxHeadWidth = 1024;

float exp_f(float x) { return float(std::exp(double(x))); }

// 16 floats as one GCC vector: each ISA's copy of head_body lowers its elementwise
// operations to that ISA's registers (one 512-bit, two 256-bit or four 128-bit), the same
// bits.
// They never cross a call (load16 is always inlined, stores are a memcpy in place), so GCC's
// notes on how such vectors are passed between functions (-Wpsabi) do not apply.
#pragma GCC diagnostic ignored "-Wpsabi"
typedef float v16f __attribute__((vector_size(64)));
__attribute__((always_inline)) inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
#define KN_STORE16(p, v) std::memcpy((p), &(v), sizeof(v16f))

// One value head's state m [d, d] (in place) and output o [d]: decay, what the state
// remembers for k (sum over i of m[i, :] k[i]), the delta rule's update, the output read
// through q. Vectorised across j only, 16 columns at a time (each element's sums in i
// order), so every ISA's copy (head_update below) and the scalar tail give the same bits.
__attribute__((always_inline)) inline void head_body(
    float* __restrict m, const float* __restrict k, const float* __restrict q,
    const float* __restrict v, float beta, float decay, float* __restrict o, int64_t d) {
  float acc[kMaxHeadWidth];
  const int64_t d16 = d / 16 * 16;
  for (int64_t j = 0; j < d; ++j) acc[j] = 0.0f;
  for (int64_t i = 0; i < d; ++i) {
    float* mi = m + i * d;
    for (int64_t j = 0; j < d16; j += 16) {
      const v16f x = load16(mi + j) * decay;
      const v16f a = load16(acc + j) + x * k[i];
      KN_STORE16(mi + j, x);
      KN_STORE16(acc + j, a);
    }
    for (int64_t j = d16; j < d; ++j) {
      const float x = mi[j] * decay;
      mi[j] = x;
      acc[j] = acc[j] + x * k[i];
    }
  }
  for (int64_t j = 0; j < d; ++j) acc[j] = (v[j] - acc[j]) * beta;
  for (int64_t j = 0; j < d; ++j) o[j] = 0.0f;
  for (int64_t i = 0; i < d; ++i) {
    float* mi = m + i * d;
    for (int64_t j = 0; j < d16; j += 16) {
      const v16f x = load16(mi + j) + k[i] * load16(acc + j);
      const v16f y = load16(o + j) + x * q[i];
      KN_STORE16(mi + j, x);
      KN_STORE16(o + j, y);
    }
    for (int64_t j = d16; j < d; ++j) {
      const float x = mi[j] + k[i] * acc[j];
      mi[j] = x;
      o[j] = o[j] + x * q[i];
    }
  }
}

__attribute__((target("avx512f"))) void head_avx512(float* m, const float* k, const float* q,
                                                    const float* v, float beta, float decay,
                                                    float* o, int64_t d) {
  head_body(m, k, q, v, beta, decay, o, d);
}
__attribute__((target("avx2"))) void head_avx2(float* m, const float* k, const float* q,
                                               const float* v, float beta, float decay,
                                               float* o, int64_t d) {
  head_body(m, k, q, v, beta, decay, o, d);
}
void head_scalar(float* m, const float* k, const float* q, const float* v, float beta,
                 float decay, float* o, int64_t d) {
  head_body(m, k, q, v, beta, decay, o, d);
}

// head_body compiled for the ISA the kernels run on (cpu.h; KINETIC_KERNEL_ISA forces one).
void head_update(Isa isa, float* m, const float* k, const float* q, const float* v, float beta,
                 float decay, float* o, int64_t d) {
  if (isa == ISA_AVX512)
    head_avx512(m, k, q, v, beta, decay, o, d);
  else if (isa == ISA_AVX2)
    head_avx2(m, k, q, v, beta, decay, o, d);
  else
    head_scalar(m, k, q, v, beta, decay, o, d);
}

// One event through one state (window [taps - 1, C], matrix [H, d, d]) in place; o [H, d].
void update(const DeltaShape& s, Isa isa, int threads, const float* taps, float* window,
            float* matrix, const float* event, float* o, std::vector<float>& conv) {
  const int64_t C = s.C, H = s.H, Hk = s.Hk, d = s.d, W = s.taps - 1;
  const float* mixed = event;
  const float* g = event + C;
  const float* beta = event + C + H;
  // taps added oldest first: the window's rows, then the row's own mixed input
  for (int64_t c = 0; c < C; ++c) {
    float acc = W > 0 ? window[c] * taps[c * s.taps] : mixed[c] * taps[c * s.taps];
    for (int64_t j = 1; j < s.taps; ++j) {
      const float in = j < W ? window[j * C + c] : mixed[c];
      acc = acc + in * taps[c * s.taps + j];
    }
    conv[size_t(c)] = acc * (1.0f / (1.0f + exp_f(-acc)));   // silu
  }
  // the window moves on by one input
  if (W > 0) {
    std::memmove(window, window + C, size_t((W - 1) * C) * sizeof(float));
    std::memcpy(window + (W - 1) * C, mixed, size_t(C) * sizeof(float));
  }
  // q and k per key head, L2-normed (q also scaled by 1 / sqrt(d))
  float* q = conv.data();
  float* k = conv.data() + Hk * d;
  const float* v = conv.data() + 2 * Hk * d;
  const float scale = float(1.0 / std::sqrt(double(d)));
  for (int64_t h = 0; h < Hk; ++h) {
    for (float* x : {q + h * d, k + h * d}) {
      float ss = 0.0f;
      for (int64_t i = 0; i < d; ++i) ss = ss + x[i] * x[i];
      const float norm = std::max(std::sqrt(ss), s.eps);
      for (int64_t i = 0; i < d; ++i) x[i] = x[i] / norm;
    }
    for (int64_t i = 0; i < d; ++i) q[h * d + i] = q[h * d + i] * scale;
  }
  run_chunks(H, threads, Schedule(), [&](int64_t h) {
    head_update(isa, matrix + h * d * d, k + (h % Hk) * d, q + (h % Hk) * d, v + h * d,
                beta[h], exp_f(g[h]), o + h * d, d);
  });
}

}  // namespace

const char* delta_rule(const DeltaShape& s, const float* conv_taps, float* windows,
                       float* matrices, float* pending, const float* events,
                       const int32_t* read, const int32_t* write, const int32_t* slot,
                       const int32_t* pend, const int32_t* replay_slot,
                       const int32_t* replay_idx, int64_t n_replay, float* out, Isa isa,
                       int threads) {
  if (!isa_supported(isa)) return "delta_rule: this CPU cannot run that path";
  if (s.C != 2 * s.Hk * s.d + s.H * s.d || s.Hk < 1 || s.d < 1 || s.d > kMaxHeadWidth ||
      s.H % s.Hk || s.taps < 1 || s.S < 1 || s.P < 1 || s.K1 < 1 || s.T < 0 || s.R < 1 ||
      n_replay < 0 || n_replay > s.R)
    return "delta_rule: bad shape";
  const auto in = [](int64_t i, int64_t n) { return i >= 0 && i < n; };
  for (int64_t r = 0; r < s.T; ++r)
    if (!in(read[r], s.S) || !in(write[r], s.S) || !in(slot[r], s.P) || pend[r] >= s.K1 - 1)
      return "delta_rule: a row's state, slot or pending place is out of range";
  for (int64_t i = 0; i < n_replay; ++i)
    if (!in(replay_slot[i], std::min(s.S, s.P)) || !in(replay_idx[i], s.K1))
      return "delta_rule: a replay's slot or pending place is out of range";
  const int64_t E = s.C + 2 * s.H, win = (s.taps - 1) * s.C, mat = s.H * s.d * s.d;
  std::vector<float> conv(static_cast<size_t>(s.C)), event(static_cast<size_t>(E)),
      o(static_cast<size_t>(s.H * s.d));
  for (int64_t i = 0; i < n_replay + s.T; ++i) {
    const bool is_row = i >= n_replay;
    const int64_t r = is_row ? i - n_replay : 0;
    const int64_t from = is_row ? read[r] : replay_slot[i];
    const int64_t to = is_row ? write[r] : replay_slot[i];
    const int64_t at_slot = is_row ? slot[r] : replay_slot[i];
    const float* src = is_row ? events + r * E
                              : pending + (replay_slot[i] * s.K1 + replay_idx[i]) * E;
    std::memcpy(event.data(), src, size_t(E) * sizeof(float));
    if (from != to) {
      std::memcpy(windows + to * win, windows + from * win, size_t(win) * sizeof(float));
      std::memcpy(matrices + to * mat, matrices + from * mat, size_t(mat) * sizeof(float));
    }
    update(s, isa, threads, conv_taps, windows + to * win, matrices + to * mat, event.data(),
           o.data(), conv);
    // a draft row keeps its inputs; the others write their slot's extra place
    const int64_t at = is_row && pend[r] >= 0 ? pend[r] : s.K1 - 1;
    std::memcpy(pending + (at_slot * s.K1 + at) * E, event.data(), size_t(E) * sizeof(float));
    if (is_row) std::memcpy(out + r * s.H * s.d, o.data(), size_t(s.H * s.d) * sizeof(float));
  }
  return nullptr;
}

}  // namespace kn
