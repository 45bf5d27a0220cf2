// The plain C++ entry points behind the FFI handlers (ffi.cc) and the C ABI (capi.cc).
#pragma once

#include <cstdint>

#include "parallel.h"
#include "qmatmul.h"

namespace kn {

// y[M, N] = x[M, K] . W[N, K]^T; returns nullptr, or a message saying what does not fit.
const char* qmatmul(int fmt, const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t M,
                    float* y, Isa isa, int threads, const Schedule& schedule);

// out[t, :] = the dequantized row rows[t] of W[N, K] (the values quants.py gives).
const char* dequant_rows(int fmt, const uint8_t* w, int64_t N, int64_t K, const int32_t* rows,
                         int64_t n_rows, float* out);

// A schedule that starts a detached std::thread per task (the C ABI's threads; XLA's own
// pool is used under the FFI).
Schedule thread_schedule();

}  // namespace kn
