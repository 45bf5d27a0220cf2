// Rows of a weight matrix as float32, for the token embedding (a step gathers only its rows).
// The values equal kinetic/model/quants.py's, which equal ggml's reference dequantizers.
#include "qmatmul_api.h"

#include "repack.h"

namespace kn {

const char* dequant_rows(int fmt, const uint8_t* w, int64_t N, int64_t K, const int32_t* rows,
                         int64_t n_rows, float* out) {
  if (const char* e = check_matmul(fmt, N, K, 1)) return e;
  const FormatInfo& f = *format_info(fmt);
  const int64_t rb = row_bytes(fmt, K);
  for (int64_t t = 0; t < n_rows; ++t)
    if (rows[t] < 0 || rows[t] >= N) return "a row index is outside the matrix";
  // A repacked weight's grouped rows (repack.h) are read one plain block at a time.
  const int plain = base_format(fmt);
  const int64_t grouped = is_repacked(fmt) ? repacked_rows(N) : 0;
  uint8_t block[256];  // one plain block of any format (Q6_K: 210 bytes)
  Unpacked u;
  for (int64_t t = 0; t < n_rows; ++t) {
    const int64_t r = rows[t];
    const uint8_t* row = w + r * rb;
    float* o = out + t * K;
    if (f.qk == 1) {
      for (int64_t k = 0; k < K; ++k) o[k] = weight_value(plain, row, k);
      continue;
    }
    for (int64_t b = 0; b < K / f.qk; ++b, o += f.qk) {
      const uint8_t* src = row + b * f.bytes;
      if (r < grouped) {
        unrepack_block(plain, w + (r / 16) * 16 * rb, b, int(r % 16), block);
        src = block;
      }
      unpack_block(plain, src, u);
      for (int i = 0; i < f.qk; ++i) {
        if (f.qk == 32) {
          o[i] = f.has_min ? float(u.q[i]) * u.d + u.m : float(u.q[i]) * u.d;
        } else {
          int j = i / f.sub;
          o[i] = f.has_min ? float(u.q[i]) * (u.d * float(u.sc[j])) - u.m * float(u.mn[j])
                           : float(u.q[i]) * (u.d * float(u.sc[j]));
        }
      }
    }
  }
  return nullptr;
}

}  // namespace kn
