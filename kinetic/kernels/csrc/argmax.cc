#include "argmax.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "pool.h"

namespace kn {
namespace {

constexpr float kNeg = -std::numeric_limits<float>::infinity();

// The largest non-NaN value of x[0..n) (-inf if none). A maximum does not depend on the
// order it is taken in (+0 and -0 aside, which compare equal, and equality is all the
// caller asks of it), so 16 lanes over the run then met give the scalar loop's value. On
// x86-64, four SSE2 registers (baseline: no run-time choice): maxps(x, m) is x > m ? x : m,
// m for a NaN x, as the scalar loop's comparison.
float run_max(const float* x, int64_t n) {
  int64_t i = 0;
  float top = kNeg;
#if defined(__SSE2__)
  if (n >= 16) {
    __m128 m0 = _mm_set1_ps(kNeg), m1 = m0, m2 = m0, m3 = m0;
    for (; i + 16 <= n; i += 16) {
      m0 = _mm_max_ps(_mm_loadu_ps(x + i), m0);
      m1 = _mm_max_ps(_mm_loadu_ps(x + i + 4), m1);
      m2 = _mm_max_ps(_mm_loadu_ps(x + i + 8), m2);
      m3 = _mm_max_ps(_mm_loadu_ps(x + i + 12), m3);
    }
    alignas(16) float lanes[16];
    _mm_store_ps(lanes, m0);
    _mm_store_ps(lanes + 4, m1);
    _mm_store_ps(lanes + 8, m2);
    _mm_store_ps(lanes + 12, m3);
    for (float l : lanes) top = l > top ? l : top;
  }
#endif
  for (; i < n; ++i) top = x[i] > top ? x[i] : top;
  return top;
}

// The first i < n with x[i] == top (n if none).
int64_t first_equal(const float* x, int64_t n, float top) {
  int64_t i = 0;
#if defined(__SSE2__)
  const __m128 t = _mm_set1_ps(top);
  for (; i + 4 <= n; i += 4) {
    const int hit = _mm_movemask_ps(_mm_cmpeq_ps(_mm_loadu_ps(x + i), t));
    if (hit) return i + __builtin_ctz(unsigned(hit));
  }
#endif
  for (; i < n; ++i)
    if (x[i] == top) return i;
  return n;
}

// The first token at or after t whose mask bit is `bit` (v if none), skipping whole words.
int64_t next_with_bit(const uint32_t* mask, int64_t t, int64_t v, bool bit) {
  while (t < v) {
    const uint32_t word = (bit ? mask[t >> 5] : ~mask[t >> 5]) >> (t & 31);
    if (word) return std::min(v, t + __builtin_ctz(word));
    t = (t | 31) + 1;
  }
  return v;
}

// Calls fn(begin, end) for each maximal run of tokens that the mask allows and no pair
// names, in order, until fn returns true. pair_ids: sorted ids in [0, v).
template <class Fn>
void for_each_run(const uint32_t* mask, int64_t v, const std::vector<int32_t>& pair_ids,
                  Fn&& fn) {
  size_t p = 0;
  for (int64_t t = 0; t < v;) {
    if (mask) t = next_with_bit(mask, t, v, true);
    if (t >= v) return;
    while (p < pair_ids.size() && pair_ids[p] < t) ++p;
    if (p < pair_ids.size() && pair_ids[p] == t) {
      ++t;
      continue;
    }
    int64_t end = mask ? next_with_bit(mask, t, v, false) : v;
    if (p < pair_ids.size()) end = std::min<int64_t>(end, pair_ids[p]);
    if (fn(t, end)) return;
    t = end;
  }
}

// One row's token (argmax.h).
int32_t one_row(const float* x, int64_t v, const int32_t* ids, const float* values, int64_t w,
                const uint32_t* mask, std::vector<std::pair<int32_t, float>>& pairs,
                std::vector<int32_t>& pair_ids) {
  pairs.clear();
  for (int64_t j = 0; j < w; ++j) {
    const int32_t t = ids[j];
    if (t < 0 || t >= v) continue;
    const bool allowed = !mask || ((mask[t >> 5] >> (t & 31)) & 1);
    const float base = allowed && !std::isnan(x[t]) ? x[t] : kNeg;
    const float y = base + values[j];   // NaN for a ban (-inf) on a +inf logit: -inf
    pairs.emplace_back(t, std::isnan(y) ? kNeg : y);
  }
  std::sort(pairs.begin(), pairs.end());
  pair_ids.clear();
  float top = kNeg;
  for (const auto& [t, y] : pairs) {
    pair_ids.push_back(t);
    top = y > top ? y : top;
  }
  float run_top = kNeg;
  for_each_run(mask, v, pair_ids, [&](int64_t b, int64_t e) {
    run_top = std::max(run_top, run_max(x + b, e - b));
    return false;
  });
  top = std::max(top, run_top);
  if (!std::isfinite(top)) return -1;
  int64_t best = v;
  for (const auto& [t, y] : pairs) {   // sorted: the first one equal is the lowest id
    if (y == top) {
      best = t;
      break;
    }
  }
  if (run_top == top) {
    for_each_run(mask, v, pair_ids, [&](int64_t b, int64_t e) {
      if (b >= best) return true;
      const int64_t i = first_equal(x + b, e - b, top);
      if (i < e - b) best = b + i;
      return i < e - b;
    });
  }
  return int32_t(best);
}

}  // namespace

void row_argmax(const float* x, int64_t rows, int64_t v, const int32_t* ids,
                const float* values, int64_t w, const uint32_t* mask, int32_t* out) {
  const int64_t words = (v + 31) / 32;
  // a row per chunk, on the kernels' threads (a row is one thread's whole: no bit changes)
  pool_run(rows, [&](int64_t r) {
    std::vector<std::pair<int32_t, float>> pairs;
    std::vector<int32_t> pair_ids;
    pairs.reserve(size_t(w));
    pair_ids.reserve(size_t(w));
    out[r] = one_row(x + r * v, v, ids + r * w, values + r * w, w, mask ? mask + r * words : nullptr,
                     pairs, pair_ids);
  });
}

}  // namespace kn
