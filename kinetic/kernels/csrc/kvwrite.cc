#include "kvwrite.h"

#include <cstring>

#include "common.h"

namespace kn {

const char* kv_write(void* cache, int fmt, int64_t rows, int64_t width, const float* src,
                     const int32_t* index, int64_t t) {
  if (fmt != F32 && fmt != F16 && fmt != BF16) return "the cache must be float32, float16 or bfloat16";
  for (int64_t i = 0; i < t; ++i)
    if (index[i] < 0 || index[i] >= rows) return "a write index lies outside the cache";
  for (int64_t i = 0; i < t; ++i) {
    const float* x = src + i * width;
    const int64_t at = int64_t(index[i]) * width;
    if (fmt == F32) {
      std::memcpy(static_cast<float*>(cache) + at, x, size_t(width) * sizeof(float));
    } else {
      uint16_t* out = static_cast<uint16_t*>(cache) + at;
      for (int64_t j = 0; j < width; ++j) out[j] = fmt == F16 ? f32_to_f16(x[j]) : f32_to_bf16(x[j]);
    }
  }
  return nullptr;
}

}  // namespace kn
