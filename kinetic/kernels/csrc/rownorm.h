// Small row-wise pieces of a step whose XLA versions change a row's bits with the number of
// rows (their reductions and transcendental loops are vectorized per shape): the RMS norm,
// the layer norm of encoder models and the rotary angles' cos and sin. Plain C++, one fixed
// order per element.
#pragma once

#include <cstdint>

namespace kn {

// y[r, :] = (x[r, :] * (1 / sqrt(mean(x[r, :]^2) + eps))) * w. The sum of squares takes
// value d into lane d % 16 in order of d, then sums the lanes by halving (qmatmul.h).
void rms_norm_rows(const float* x, const float* w, int64_t rows, int64_t d, float eps, float* y);

// y[r, :] = ((x[r, :] - mean) * (1 / sqrt(var + eps))) * w + b, mean and var (the mean of
// (x - mean)^2) over the row. Both sums take value d into lane d % 16 in order of d, then sum
// the lanes by halving, as rms_norm_rows does.
void layer_norm_rows(const float* x, const float* w, const float* b, int64_t rows, int64_t d,
                     float eps, float* y);

// c[i] = cosf(theta[i]), s[i] = sinf(theta[i]) (the C library's, element by element).
void cos_sin(const float* theta, int64_t n, float* c, float* s);

}  // namespace kn
