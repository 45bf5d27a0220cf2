// Float32 vectors as JSON text, fast: an embeddings answer holds hundreds of thousands of
// numbers, and Python's json writes each through float.__repr__ (tens of ms per answer).
#pragma once

#include <cstddef>
#include <cstdint>

namespace kn {

// The most characters json_floats writes per value, its comma included.
constexpr size_t kJsonFloatChars = 32;

// Writes "[v0,v1,...]" for x[0..n) into out (room for 2 + n * kJsonFloatChars characters),
// each value as Python's json.dumps writes float(x[i]): the shortest digits that read back
// as the same double, in fixed notation for decimal exponents -4 to 15 (".0" after a whole
// number), else as d.ddde-XX. Returns the characters written, or -1 if a value is not
// finite (json.dumps writes those as NaN or Infinity, which is not JSON).
int64_t json_floats(const float* x, size_t n, char* out);

}  // namespace kn
