// qmatmul over (row, expert) pairs (qmatmul_api.h, qmatmul_id): a mixture-of-experts layer's
// projections in one call, as llama.cpp's mul_mat_id. The pairs are grouped by expert in one
// pass (in pair order within an expert); each expert with pairs gets one qmatmul_parts call
// over its pairs' rows copied together, so its weights are read once per call, each result
// written straight to its pair's row (MatmulPart::y_rows). A row's result does not depend on which other
// rows share its call (the kernel's contract), so a pair gets the bits qmatmul gives its row
// against its expert alone.
#include <cstring>
#include <vector>

#include "qmatmul_api.h"

namespace kn {

const char* qmatmul_id(const MatmulPart* parts, const int64_t* strides, int n_parts,
                       int64_t n_expert, int64_t K, const float* x, int64_t rows,
                       const int32_t* ids, int64_t pairs, int64_t share, Isa isa, int threads,
                       const Schedule& schedule) {
  if (K < 1 || rows < 0 || share < 1 || pairs != rows * share || n_expert < 1 || n_parts < 1)
    return "qmatmul_id: bad shape";
  for (int64_t p = 0; p < pairs; ++p)
    if (ids[p] < 0 || ids[p] >= n_expert) return "qmatmul_id: an expert id out of range";
  // counting sort of the pairs by expert: by_expert[start[e] .. start[e + 1]) are e's pairs
  std::vector<int64_t> start(static_cast<size_t>(n_expert + 1), 0);
  std::vector<int64_t> by_expert(static_cast<size_t>(pairs));
  for (int64_t p = 0; p < pairs; ++p) ++start[size_t(ids[p]) + 1];
  for (int64_t e = 0; e < n_expert; ++e) start[size_t(e + 1)] += start[size_t(e)];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) by_expert[size_t(fill[size_t(ids[p])]++)] = p;

  std::vector<float> xs;
  std::vector<MatmulPart> packed(parts, parts + n_parts);
  for (int64_t e = 0; e < n_expert; ++e) {
    const int64_t lo = start[size_t(e)], L = start[size_t(e + 1)] - lo;
    if (L == 0) continue;
    xs.resize(size_t(L * K));
    for (int64_t i = 0; i < L; ++i)
      std::memcpy(&xs[size_t(i * K)], x + by_expert[size_t(lo + i)] / share * K,
                  size_t(K) * sizeof(float));
    for (int p = 0; p < n_parts; ++p) {
      packed[size_t(p)].w = parts[p].w + e * strides[p];
      packed[size_t(p)].y_rows = &by_expert[size_t(lo)];
    }
    if (const char* err = qmatmul_parts(packed.data(), n_parts, K, xs.data(), L, isa, threads,
                                        schedule))
      return err;
  }
  return nullptr;
}

}  // namespace kn
