#include "hadamard.h"

#include <cmath>
#include <cstring>

namespace kn {

namespace {
typedef float V4 __attribute__((vector_size(16)));   // SSE2's width: every x86-64 has it
}  // namespace

const char* hadamard_rows(const float* x, float* y, int64_t rows, int64_t width, int64_t n) {
  if (n < 1 || (n & (n - 1)) != 0) return "the rotation's block is not a power of two";
  if (width % n != 0) return "the rotation's block does not divide the row";
  if (rows < 0) return "negative number of rows";
  const float scale = float(1.0 / std::sqrt(double(n)));
  for (int64_t b = 0; b < rows * (width / n); ++b) {
    float* v = y + b * n;
    if (v != x + b * n) std::memmove(v, x + b * n, size_t(n) * sizeof(float));
    for (int64_t h = 1; h < n; h *= 2) {
      if (h % 4 == 0) {   // 4 pairs at a time: the same additions, lane by lane
        for (int64_t s = 0; s < n; s += 2 * h)
          for (int64_t i = s; i < s + h; i += 4) {
            V4 a, c;
            std::memcpy(&a, v + i, sizeof(V4));
            std::memcpy(&c, v + i + h, sizeof(V4));
            const V4 sum = a + c, diff = a - c;
            std::memcpy(v + i, &sum, sizeof(V4));
            std::memcpy(v + i + h, &diff, sizeof(V4));
          }
        continue;
      }
      for (int64_t s = 0; s < n; s += 2 * h)
        for (int64_t i = s; i < s + h; ++i) {
          const float a = v[i], c = v[i + h];
          v[i] = a + c;
          v[i + h] = a - c;
        }
    }
    for (int64_t i = 0; i < n; ++i) v[i] *= scale;
  }
  return nullptr;
}

}  // namespace kn
