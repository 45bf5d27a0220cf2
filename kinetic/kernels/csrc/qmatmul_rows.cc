// qmatmul over only some rows of x (qmatmul_api.h, qmatmul_rows): the rows whose live flag
// is set are copied together and multiplied as one smaller x, each result written straight
// to its row of y (MatmulPart::y_rows); no other row of y is touched. A row's result does
// not depend on which other rows share its call (the kernel's contract), so a live row gets
// the bits qmatmul gives it.
#include <cstring>
#include <vector>

#include "qmatmul_api.h"

namespace kn {

const char* qmatmul_rows(const MatmulPart* parts, int n_parts, int64_t K, const float* x,
                         int64_t M, const int32_t* live, Isa isa, int threads,
                         const Schedule& schedule) {
  if (M < 0 || K < 1) return "qmatmul_rows: bad shape";
  std::vector<int64_t> rows;
  for (int64_t m = 0; m < M; ++m)
    if (live[m]) rows.push_back(m);
  const int64_t L = int64_t(rows.size());
  if (L == M) return qmatmul_parts(parts, n_parts, K, x, M, isa, threads, schedule);
  std::vector<float> xs(size_t(L * K));
  for (int64_t i = 0; i < L; ++i)
    std::memcpy(&xs[size_t(i * K)], x + rows[size_t(i)] * K, size_t(K) * sizeof(float));
  std::vector<MatmulPart> placed(parts, parts + n_parts);
  for (MatmulPart& part : placed) part.y_rows = rows.data();
  // (no live row: qmatmul_parts checks the shapes and runs nothing)
  return qmatmul_parts(placed.data(), n_parts, K, xs.data(), L, isa, threads, schedule);
}

}  // namespace kn
