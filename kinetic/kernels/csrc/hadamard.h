// The Walsh-Hadamard rotation of a quantized KV cache (kinetic/model/layers.py
// cached_attention), as butterflies: each block of n values (n a power of two) of a row
// becomes H_n x / sqrt(n), H_n Sylvester's matrix (H_1 = 1, H_2k = [[H_k, H_k], [H_k, -H_k]]).
//
// For h = 1, 2, 4 ... n/2, each pair (i, i + h) inside each run of 2h values becomes
// (a + b, a - b); then every value is multiplied by float(1 / sqrt(double(n))). Every step is
// one float32 operation, so a row's bits depend on its own values alone, and XLA's version
// of the same steps (layers.hadamard on a GPU) and the numpy reference (reference.hadamard)
// give the same bits.
#pragma once

#include <cstdint>

namespace kn {

// y = the rotation of x, `rows` rows of `width` values (width a multiple of n); y may be x.
// Returns an error message (nothing written) if n is not a power of two or does not divide
// width, else nullptr.
const char* hadamard_rows(const float* x, float* y, int64_t rows, int64_t width, int64_t n);

}  // namespace kn
