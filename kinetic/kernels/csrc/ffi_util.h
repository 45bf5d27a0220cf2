// Small pieces the XLA FFI handlers share.
#pragma once

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace kn {

// The kn::Format id of a KV cache buffer's element type (F32, F16, BF16), or -1.
inline int cache_fmt(xla::ffi::DataType t) {
  switch (t) {
    case xla::ffi::DataType::F32: return F32;
    case xla::ffi::DataType::F16: return F16;
    case xla::ffi::DataType::BF16: return BF16;
    default: return -1;
  }
}

}  // namespace kn
