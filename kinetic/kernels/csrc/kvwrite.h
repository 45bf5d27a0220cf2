// Writing a step's new keys and values into the paged KV cache in place. XLA's scatter of a
// few rows into a donated cache costs about 15 us per layer and array on the CPU (a
// dynamic-update-slice, a copy and a slice thunk); this is one pass over the rows.
#pragma once

#include <cstdint>

namespace kn {

// cache: `rows` rows of `width` elements of type fmt (F32, F16, BF16, or Q8_0: a row of
// width / 32 blocks, common.h); src: t rows of `width` float32 values; row i goes to cache
// row index[i], converted with round to nearest even (numpy's and XLA's astype), or for Q8_0
// quantized in blocks of 32 as llama.cpp quantizes its q8_0 cache (quantize.h q8_0_row).
// Rows are written in order, so of two rows with the same index the later one stays. Returns
// an error message (nothing written) if an index lies outside 0 .. rows - 1, fmt is not a
// cache type or a q8_0 row is not whole blocks, else nullptr.
const char* kv_write(void* cache, int fmt, int64_t rows, int64_t width, const float* src,
                     const int32_t* index, int64_t t);

}  // namespace kn
