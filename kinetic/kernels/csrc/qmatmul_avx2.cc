// AVX2 path (chosen at run time; compiled with target attributes, never -march=native).
#include "qmatmul.h"

namespace kn {

bool qmatmul_cols_avx2(const MatmulArgs& a, int64_t n0, int64_t n1) { return false; }

}  // namespace kn
