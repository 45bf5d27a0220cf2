// Activation rounding before a weight dot, as llama.cpp's CPU backend does for each weight
// type (formats.h ActKind). O(M * K) beside the weights' M * N * K, but done before any
// column can start: at 16 rows of 1536 values the one-thread SSE2 rounding took 12 us, a
// third of a SmolLM2 ffn_down call, so the driver rounds rows on every thread, with the
// AVX2 functions where the CPU has them.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "formats.h"

namespace kn {

struct QuantActs {
  ActKind kind = ACT_F32;
  int64_t M = 0, K = 0;
  bool block_major = false;   // the b* copies below are filled
  std::vector<int8_t> q;      // [M, K] int8 values (block kinds)
  std::vector<float> d;       // [M, K / block] scales
  std::vector<float> s;       // ACT_Q8_1: [M, K / 32] f16(d * sum of the block's values)
  std::vector<int32_t> qsum;  // ACT_Q8_0 / ACT_Q8_1: [M, K / 32] sum of the block's values
  std::vector<int32_t> bsum;  // ACT_Q8_K: [M, K / 16] sums of each 16 values
  std::unique_ptr<float[]> f;  // float kinds: [M, K] rounded values (not zeroed first)

  // ACT_Q8_0 / ACT_Q8_1, block-major (index b * M + m for row m, block b), for the SIMD
  // paths' multi-row loops, which walk the rows of one block with one pointer: filled with
  // the rows where quantize_begin asks for them, once per call, shared by every thread's
  // columns.
  std::vector<uint32_t> bq;     // the block's 32 values as 8 words
  std::vector<float> bd, bs;    // d, and ACT_Q8_1's s
  std::vector<int32_t> bnsum;   // minus the sum of the block's values

  int64_t blocks_per_row() const { return kind == ACT_Q8_K ? K / 256 : K / 32; }
};

// Rounding x [M, K] for `kind` (K a multiple of the kind's block, 32 or 256) in two steps,
// so that rows can be rounded on several threads: size `out` for M rows of K values
// (block_major: the block-major copies too, for the Q8_0 / Q8_1 kinds), then round rows
// [m0, m1) of x into it. Each row is rounded on its own, so a split changes
// nothing. simd: the rows through quantize_avx2.cc's AVX2 + F16C functions (for CPUs of the
// AVX2 path and up), which give the reference's bits for every input, NaN and inf included.
void quantize_begin(ActKind kind, int64_t M, int64_t K, bool block_major, QuantActs& out);
void quantize_rows(const float* x, int64_t m0, int64_t m1, QuantActs& out, bool simd);

// One row of each block kind (K values from x; the outputs of that row): the reference's,
// in quantize.cc, and the AVX2 path's, in quantize_avx2.cc, with the same bits.
void q8_0_row(const float* x, int64_t K, bool with_sum, int8_t* q, float* d, float* s, int32_t* qsum);
void q8_k_row(const float* x, int64_t K, int8_t* q, float* d, int32_t* bsum);
void q8_0_row_avx2(const float* x, int64_t K, bool with_sum, int8_t* q, float* d, float* s, int32_t* qsum);
void q8_k_row_avx2(const float* x, int64_t K, int8_t* q, float* d, int32_t* bsum);

// y[i] = round_f16(x[i]) (common.h) by F16C's conversions, for CPUs of the AVX2 path and up.
void round_f16_avx2(const float* x, float* y, int64_t n);

}  // namespace kn
