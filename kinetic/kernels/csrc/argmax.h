// The greedy draw: sampler.greedy's token for each row in one pass over its logits where XLA
// makes four (reference.greedy: the same in numpy). Row r's values are
//   y[t] = (allowed(t) ? x[t], NaN read as -inf : -inf) + bias(t)
// with bias(t) the value of the row's pair whose id is t (ids unique within a row; ids
// outside [0, v) are unused pairs) and 0 elsewhere, a NaN sum (a ban, -inf, on a +inf
// logit) read as -inf. Its token is the first t with the largest y[t], or -1 where that
// largest value is not finite.
#pragma once

#include <cstdint>

namespace kn {

// out[r] for r < rows. x: rows x v logits; ids, values: rows x w pairs; mask: rows x
// ceil(v / 32) words (bit t % 32 of word t / 32 allows token t), or nullptr for all allowed.
void row_argmax(const float* x, int64_t rows, int64_t v, const int32_t* ids,
                const float* values, int64_t w, const uint32_t* mask, int32_t* out);

}  // namespace kn
