// y[M, N] = x[M, K] . W[N, K]^T with W in a GGUF block format, exact by construction:
// activations rounded per block (quantize.h), integer block dot products (exact in any
// order), and one fixed float sequence per output element, the same on every path:
//
//   acc = 0; for each block b in order 0, 1, ...:  acc = combine(acc, block b)
//
// where combine (below) is a fixed expression of the block's integer sums and its scales.
// Float weights (F32, F16, BF16) use 16 lane accumulators instead: value k goes to lane
// k % 16 in order of k, then lanes are summed by halving (i + 8, i + 4, i + 2, i + 1).
// Nothing depends on M, on the other rows, on the thread count or on the ISA.
#pragma once

#include <cstdint>

#include "cpu.h"
#include "formats.h"
#include "quantize.h"

namespace kn {

struct MatmulArgs {
  int fmt;
  const FormatInfo* info;
  const uint8_t* w;   // N rows of row_bytes
  int64_t row_bytes;
  int64_t N, K, M;
  const QuantActs* acts;
  float* y;           // [M, N]
  bool repacked = false;  // rows [0, N / 16 * 16) in the 16-column layout of fmt (repack.h)
  // The activation words the AVX-512 path's loops read besides the values, made once per
  // call (qmatmul_words_avx512) instead of by every chunk; null: the loop makes its own.
  const int32_t* words = nullptr;
  // The row of y that row m of x writes (null: row m): a call over some rows of a larger y
  // (qmatmul_rows' live rows, qmatmul_id's pairs of one expert) writes them in place.
  const int64_t* y_rows = nullptr;
  float* out(int64_t m) const { return y + (y_rows ? y_rows[m] : m) * N; }
};

// The integer results of one weight block against one activation block.
struct BlockSums {
  int32_t sumi;  // sum over sub-blocks of scale * (weight values . activation values)
  int32_t summ;  // K-quants with mins: sum over sub-blocks of min * (sum of activation values)
};

// The fixed float step of one block. dx: activation scale; sx: ACT_Q8_1's scaled sum.
inline float combine(const FormatInfo& f, float acc, BlockSums s, float dw, float mw, float dx,
                     float sx) {
  if (f.act == ACT_Q8_1) return acc + (float(s.sumi) * (dw * dx) + mw * sx);
  if (f.has_min) return acc + (float(s.sumi) * (dw * dx) - float(s.summ) * (mw * dx));
  return acc + float(s.sumi) * (dw * dx);
}

// The 16-lane reduction of float formats, shared by every path.
inline float reduce_lanes(float* lanes) {
  for (int half = 8; half >= 1; half /= 2)
    for (int i = 0; i < half; ++i) lanes[i] = lanes[i] + lanes[i + half];
  return lanes[0];
}

inline float weight_value(int fmt, const uint8_t* row, int64_t k) {
  if (fmt == F32) { float v; std::memcpy(&v, row + 4 * k, 4); return v; }
  if (fmt == F16) return f16_to_f32(load_u16(row + 2 * k));
  return bf16_to_f32(load_u16(row + 2 * k));
}

// Output columns [n0, n1) of every row. The reference handles every format; the SIMD paths
// return false for a format they do not accelerate, and the reference takes it. The SIMD
// paths also read the activations' block-major copies (quantize.h, QuantActs::bq), which the
// driver fills once per call.
void qmatmul_cols_ref(const MatmulArgs& a, int64_t n0, int64_t n1);
bool qmatmul_cols_avx2(const MatmulArgs& a, int64_t n0, int64_t n1);
bool qmatmul_cols_avx512(const MatmulArgs& a, int64_t n0, int64_t n1);
// Columns [n0, n1) of a repacked weight, whole groups of 16 (n0, n1 multiples of 16).
bool qmatmul_cols_avx512_r16(const MatmulArgs& a, int64_t n0, int64_t n1);
// a's MatmulArgs::words for the AVX-512 path into out; false: its format reads none.
bool qmatmul_words_avx512(const MatmulArgs& a, std::vector<int32_t>& out);

// A plain error message, or nullptr when the shapes fit.
const char* check_matmul(int fmt, int64_t N, int64_t K, int64_t M);
int64_t row_bytes(int fmt, int64_t K);

}  // namespace kn
