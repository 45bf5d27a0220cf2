#include "rownorm.h"

#include <cmath>

#include "qmatmul.h"

namespace kn {

void rms_norm_rows(const float* x, const float* w, int64_t rows, int64_t d, float eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    float lanes[16] = {};
    for (int64_t i = 0; i < d; ++i) lanes[i % 16] = lanes[i % 16] + xr[i] * xr[i];
    const float mean = reduce_lanes(lanes) / float(d);
    const float inv = 1.0f / std::sqrt(mean + eps);
    for (int64_t i = 0; i < d; ++i) y[r * d + i] = (xr[i] * inv) * w[i];
  }
}

void layer_norm_rows(const float* x, const float* w, const float* b, int64_t rows, int64_t d,
                     float eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    float lanes[16] = {};
    for (int64_t i = 0; i < d; ++i) lanes[i % 16] = lanes[i % 16] + xr[i];
    const float mean = reduce_lanes(lanes) / float(d);
    float sq[16] = {};
    for (int64_t i = 0; i < d; ++i) {
      const float c = xr[i] - mean;
      sq[i % 16] = sq[i % 16] + c * c;
    }
    const float inv = 1.0f / std::sqrt(reduce_lanes(sq) / float(d) + eps);
    for (int64_t i = 0; i < d; ++i) y[r * d + i] = ((xr[i] - mean) * inv) * w[i] + b[i];
  }
}

void cos_sin(const float* theta, int64_t n, float* c, float* s) {
  for (int64_t i = 0; i < n; ++i) {
    c[i] = std::cos(theta[i]);
    s[i] = std::sin(theta[i]);
  }
}

}  // namespace kn
