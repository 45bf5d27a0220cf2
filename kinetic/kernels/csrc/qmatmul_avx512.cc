// AVX-512 (F, BW, VL, VNNI) path (chosen at run time; target attributes, never -march=native).
#include "qmatmul.h"

namespace kn {

bool qmatmul_cols_avx512(const MatmulArgs& a, int64_t n0, int64_t n1) { return false; }

}  // namespace kn
