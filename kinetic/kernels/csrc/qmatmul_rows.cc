// qmatmul over only some rows of x (qmatmul_api.h, qmatmul_rows): the rows whose live flag
// is set are copied together, multiplied as one smaller x, and their results put back in
// place; every other row of y is zero. A row's result does not depend on which other rows
// share its call (the kernel's contract), so a live row gets the bits qmatmul gives it.
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
  std::vector<std::vector<float>> ys(static_cast<size_t>(n_parts));
  std::vector<MatmulPart> packed(parts, parts + n_parts);
  for (int p = 0; p < n_parts; ++p) {
    ys[size_t(p)].resize(size_t(L * parts[p].n));
    packed[size_t(p)].y = ys[size_t(p)].data();
  }
  if (L > 0)
    if (const char* e = qmatmul_parts(packed.data(), n_parts, K, xs.data(), L, isa, threads,
                                      schedule))
      return e;
  for (int p = 0; p < n_parts; ++p) {
    const int64_t N = parts[p].n;
    const float* from = ys[size_t(p)].data();
    for (int64_t m = 0; m < M; ++m) {
      float* to = parts[p].y + m * N;
      if (live[m]) {
        std::memcpy(to, from, size_t(N) * sizeof(float));
        from += N;
      } else {
        std::memset(to, 0, size_t(N) * sizeof(float));
      }
    }
  }
  return nullptr;
}

}  // namespace kn
