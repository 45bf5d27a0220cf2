// Small pieces the XLA FFI handlers share.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common.h"
#include "pool.h"
#include "xla/ffi/api/ffi.h"

namespace kn {

// The kn::Format id of a KV cache buffer's element type (F32, F16, BF16; uint8: Q8_0
// blocks, common.h), or -1.
inline int cache_fmt(xla::ffi::DataType t) {
  switch (t) {
    case xla::ffi::DataType::F32: return F32;
    case xla::ffi::DataType::F16: return F16;
    case xla::ffi::DataType::BF16: return BF16;
    case xla::ffi::DataType::U8: return Q8_0;
    default: return -1;
  }
}

// The threads a weight product runs on: `bytes` of weights read for `rows` rows (or
// (row, expert) pairs). Products this small (bytes x rows / 4 under 2^16) run on the calling
// thread alone: waking another costs more than it saves. Which thread computes a column
// never changes its bits.
inline int matmul_threads(int64_t bytes, int64_t rows) {
  constexpr int64_t kMinSplitWork = int64_t(1) << 16;
  return bytes * std::max<int64_t>(1, rows / 4) < kMinSplitWork ? 1 : pool_threads();
}

}  // namespace kn
