// The gated delta rule of Qwen3.5's linear-attention layers, a step's rows one after the
// other (kinetic/model/delta_net.py has the model's side and the state's layout):
//
//   for each of the step's replays, then each row, in order:
//     state (window [taps - 1, C], matrix [H, d, d]) = states[read]
//     conv = the causal convolution of the window and the row's mixed inputs, silu'd
//     q, k (key heads, L2-normed; value head h reads key head h % Hk), v from conv
//     matrix *= exp(g_h); delta = (v - matrix^T k) * beta_h; matrix += k delta^T
//     out = matrix^T q (q scaled by 1 / sqrt(d)); states[write] = the new state
//     the row's event goes to pending[slot, pend] (a draft's) or [slot, K] (the others)
//
// Every sum runs in index order (sequential, float32, no fused multiply-add: the build's
// -ffp-contract=off); exp is computed in double and rounded to float. So a row's bits
// depend only on its own state and event, and kinetic/kernels/reference.py delta_rule gives
// the same bits (tests/test_delta_rule.py). The states are updated in place.
#pragma once

#include <cstdint>

#include "cpu.h"

namespace kn {

struct DeltaShape {
  int64_t C;       // convolution channels: q and k (2 Hk d), then v (H d)
  int64_t H, Hk;   // value heads, key heads (H a multiple of Hk)
  int64_t d;       // a head's width (key and value)
  int64_t taps;    // the convolution's taps (the window keeps taps - 1 inputs)
  int64_t S;       // state entries (slots plus the extra ones)
  int64_t P, K1;   // pending: P slots' K1 places (K1 - 1 is the non-draft place)
  int64_t T, R;    // rows, replay entries (of which n_replay are real)
  float eps;       // the L2 norm's floor
};

// events [T, C + 2H] (mixed C, then g H, then beta H); read, write, slot, pend [T];
// replay_slot, replay_idx [R]; out [T, H, d]. windows [S, taps - 1, C], matrices [S, H, d, d]
// and pending [P, K1, C + 2H] are updated in place. Returns nullptr, or what is wrong (an
// index out of range) before anything is written.
// isa: the path the head updates take (every path gives the same bits); threads: how many
// share a row's heads (kinetic's pool).
const char* delta_rule(const DeltaShape& s, const float* conv_taps, float* windows,
                       float* matrices, float* pending, const float* events,
                       const int32_t* read, const int32_t* write, const int32_t* slot,
                       const int32_t* pend, const int32_t* replay_slot,
                       const int32_t* replay_idx, int64_t n_replay, float* out, Isa isa,
                       int threads);

}  // namespace kn
