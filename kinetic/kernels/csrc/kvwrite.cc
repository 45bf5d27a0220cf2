#include "kvwrite.h"

#include <cstring>

#include "common.h"
#include "quantize.h"

namespace kn {

namespace {

// n values (a multiple of 32) as Q8_0 blocks at out: each block quantized as llama.cpp
// quantizes a q8_0 cache row (quantize.h q8_0_row), d stored as its f16 bits.
void q8_0_write_row(const float* x, int64_t n, uint8_t* out) {
  for (int64_t b = 0; b < n / Q8_0_BLOCK; ++b, out += Q8_0_BYTES) {
    int8_t q[Q8_0_BLOCK];
    float d;
    int32_t sum;
    q8_0_row(x + b * Q8_0_BLOCK, Q8_0_BLOCK, false, q, &d, nullptr, &sum);
    const uint16_t h = f32_to_f16(d);   // d is already a half's value: exact
    std::memcpy(out, &h, 2);
    std::memcpy(out + 2, q, Q8_0_BLOCK);
  }
}

}  // namespace

const char* kv_write(void* cache, int fmt, int64_t rows, int64_t width, const float* src,
                     const int32_t* index, int64_t t) {
  if (!cache_format(fmt)) return "the cache must be float32, float16, bfloat16 or q8_0";
  const int64_t stored = cache_row_width(fmt, width);
  if (stored < 0) return "a q8_0 cache row must hold a multiple of 32 values";
  for (int64_t i = 0; i < t; ++i)
    if (index[i] < 0 || index[i] >= rows) return "a write index lies outside the cache";
  for (int64_t i = 0; i < t; ++i) {
    const float* x = src + i * width;
    const int64_t at = int64_t(index[i]) * width;
    if (fmt == Q8_0) {
      q8_0_write_row(x, width, static_cast<uint8_t*>(cache) + int64_t(index[i]) * stored);
    } else if (fmt == F32) {
      std::memcpy(static_cast<float*>(cache) + at, x, size_t(width) * sizeof(float));
    } else {
      uint16_t* out = static_cast<uint16_t*>(cache) + at;
      for (int64_t j = 0; j < width; ++j) out[j] = fmt == F16 ? f32_to_f16(x[j]) : f32_to_bf16(x[j]);
    }
  }
  return nullptr;
}

}  // namespace kn
