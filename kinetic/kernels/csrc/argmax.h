// The greedy draw of rows that allow every token: per row of logits, the first index of its
// largest value with NaN read as -inf, or -1 where that largest value is not finite (every
// logit -inf or NaN, or a +inf). sampler.greedy's tokens for such rows without bias, in one
// pass over the row where XLA makes four (reference.row_argmax: the same in numpy).
#pragma once

#include <cstdint>

namespace kn {

// out[r] for r < rows, x: rows x v floats.
void row_argmax(const float* x, int64_t rows, int64_t v, int32_t* out);

}  // namespace kn
