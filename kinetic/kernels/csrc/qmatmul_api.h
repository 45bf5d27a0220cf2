// The plain C++ entry points behind the FFI handlers (ffi.cc) and the C ABI (capi.cc).
#pragma once

#include <cstdint>

#include "parallel.h"
#include "qmatmul.h"

namespace kn {

// y[M, N] = x[M, K] . W[N, K]^T; returns nullptr, or a message saying what does not fit.
const char* qmatmul(int fmt, const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t M,
                    float* y, Isa isa, int threads, const Schedule& schedule);

// Several weights that read the same activations (q, k, v; gate, up) in one call: the
// activations are rounded once per kind, and the columns of every part are split over the
// threads together. parts[p].y is [M, parts[p].n], or, with y_rows, a larger output whose
// row y_rows[m] row m of x writes (the others untouched). Each output is what qmatmul gives.
struct MatmulPart {
  int fmt;
  const uint8_t* w;
  int64_t n;
  float* y;
  const int64_t* y_rows = nullptr;
};
const char* qmatmul_parts(const MatmulPart* parts, int n_parts, int64_t K, const float* x,
                          int64_t M, Isa isa, int threads, const Schedule& schedule);

// qmatmul_parts over the rows m of x with live[m] != 0 (x and each y are [M, ...]): those
// rows get the bits qmatmul_parts gives them, written in place; every other row of each y is
// left as it was, unwritten (a step's sampled rows of the output projection: nothing reads
// the others, and writing them cost a prompt step more than its sampled rows did).
const char* qmatmul_rows(const MatmulPart* parts, int n_parts, int64_t K, const float* x,
                         int64_t M, const int32_t* live, Isa isa, int threads,
                         const Schedule& schedule);

// A mixture of experts' projections: pairs = rows * share (row, expert) pairs, pair p
// reading row p / share of x [rows, K] (share: the experts a row chose, for the gate and up
// projections; 1 for the down projection, whose x has a row per pair) and expert ids[p] in
// [0, n_expert). Expert e's weight of part j starts strides[j] * e bytes after parts[j].w
// (expert 0's), its n rows in parts[j].fmt; parts[j].y is [pairs, n]. Each pair gets the bits
// qmatmul gives its row against its expert's weight alone; each chosen expert's weights
// are read once per call.
const char* qmatmul_id(const MatmulPart* parts, const int64_t* strides, int n_parts,
                       int64_t n_expert, int64_t K, const float* x, int64_t rows,
                       const int32_t* ids, int64_t pairs, int64_t share, Isa isa, int threads,
                       const Schedule& schedule);

// out[t, :] = the dequantized row rows[t] of W[N, K] (the values quants.py gives).
const char* dequant_rows(int fmt, const uint8_t* w, int64_t N, int64_t K, const int32_t* rows,
                         int64_t n_rows, float* out);

// A schedule that starts a detached std::thread per task (the C ABI's threads; XLA's own
// pool is used under the FFI).
Schedule thread_schedule();

}  // namespace kn
