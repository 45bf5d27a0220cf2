// Activation rounding before a weight dot, as llama.cpp's CPU backend does for each weight
// type (formats.h ActKind). Scalar: it is O(M * K), small beside the weights' M * N * K.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "formats.h"

namespace kn {

struct QuantActs {
  ActKind kind = ACT_F32;
  int64_t M = 0, K = 0;
  std::vector<int8_t> q;      // [M, K] int8 values (block kinds)
  std::vector<float> d;       // [M, K / block] scales
  std::vector<float> s;       // ACT_Q8_1: [M, K / 32] f16(d * sum of the block's values)
  std::vector<int32_t> qsum;  // ACT_Q8_0 / ACT_Q8_1: [M, K / 32] sum of the block's values
  std::vector<int32_t> bsum;  // ACT_Q8_K: [M, K / 16] sums of each 16 values
  std::unique_ptr<float[]> f;  // float kinds: [M, K] rounded values (not zeroed first)

  // ACT_Q8_0 / ACT_Q8_1, block-major (index b * M + m for row m, block b), for the SIMD
  // paths' multi-row loops, which walk the rows of one block with one pointer: filled by
  // by_block() once per call, shared by every thread's columns.
  std::vector<uint32_t> bq;     // the block's 32 values as 8 words
  std::vector<float> bd, bs;    // d, and ACT_Q8_1's s
  std::vector<int32_t> bnsum;   // minus the sum of the block's values

  int64_t blocks_per_row() const { return kind == ACT_Q8_K ? K / 256 : K / 32; }
};

// Round x [M, K] for `kind`. K must be a multiple of the kind's block (32 or 256).
void quantize_acts(ActKind kind, const float* x, int64_t M, int64_t K, QuantActs& out);

// The float kinds (ACT_F32 / F16 / BF16) in two steps, so that the rows can be rounded on
// several threads: size `out` for [M, K], then round rows [m0, m1) into it (each value on its
// own: the split changes nothing). quantize_acts does both for every row.
void float_acts_begin(ActKind kind, int64_t M, int64_t K, QuantActs& out);
// f16c: round to half with F16C (round_f16_avx2: the same values, NaN included)
void float_acts_rows(const float* x, int64_t m0, int64_t m1, QuantActs& out, bool f16c = false);

// y[i] = round_f16(x[i]) (common.h) by F16C's conversions, for CPUs of the AVX2 path and up.
void round_f16_avx2(const float* x, float* y, int64_t n);

// Fill the block-major copies of x (ACT_Q8_0 / ACT_Q8_1; nothing for other kinds).
void by_block(QuantActs& x);

}  // namespace kn
