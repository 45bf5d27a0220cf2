// The attention driver: check every index the kernel will follow, cut the rows into groups
// (attention.h), then run the (group, kv head) units on the chosen ISA path, split over
// threads (each unit whole on one thread, so neither the groups nor the split nor the
// thread count changes a bit).
#include "attention.h"

#include <memory>
#include <vector>

#include "common.h"

namespace kn {

namespace {

void run_unit(Isa isa, const AttnArgs& a, int64_t t0, int64_t R, int64_t kh, float* scratch,
              int64_t* rows) {
  if (isa == ISA_AVX512) return attention_unit_avx512(a, t0, R, kh, scratch, rows);
  if (isa == ISA_AVX2) return attention_unit_avx2(a, t0, R, kh, scratch, rows);
  attention_unit_scalar(a, t0, R, kh, scratch, rows);
}

struct Group { int64_t t0, R; };  // rows t0..t0+R-1

// The step's groups: each run of rows of one slot at consecutive positions whose ends
// never decrease (a prompt chunk: the scheduler puts its rows together; an image's rows
// share one end) cut into as few near-equal pieces of at most cap rows as there can be;
// any other row is a group of one. So the group's last row has its largest end and its
// first row the smallest lo, and attention_group_span covers every row's keys.
std::vector<Group> make_groups(const AttnArgs& a, int64_t cap) {
  std::vector<Group> groups;
  for (int64_t t = 0; t < a.T;) {
    int64_t stop = t + 1;
    while (stop < a.T && a.slots[stop] == a.slots[t] &&
           a.positions[stop] == int64_t(a.positions[stop - 1]) + 1 &&
           attention_end(a, stop) >= attention_end(a, stop - 1))
      ++stop;
    const int64_t run = stop - t, pieces = (run + cap - 1) / cap;
    for (int64_t p = 0; p < pieces; ++p) {
      const int64_t R = run / pieces + (p < run % pieces ? 1 : 0);
      groups.push_back({t, R});
      t += R;
    }
  }
  return groups;
}

// The groups of at most max_group rows, made smaller (cap halved) while their units would
// leave some of the threads idle or unevenly loaded: fewer than 4 units a thread and not a
// whole number of them. Which rows share a unit never changes a result.
std::vector<Group> balanced_groups(const AttnArgs& a, int64_t max_group, int threads) {
  int64_t cap = max_group < 1 ? 1 : max_group > ATTN_MAX_GROUP ? ATTN_MAX_GROUP : max_group;
  for (;;) {
    std::vector<Group> groups = make_groups(a, cap);
    const int64_t units = int64_t(groups.size()) * a.K;
    if (cap == 1 || threads <= 1 || units >= 4 * threads ||
        (units >= threads && units % threads == 0))
      return groups;
    cap = (cap + 1) / 2;
  }
}

}  // namespace

const char* check_attention(const AttnArgs& a) {
  if (a.T < 0) return "negative number of rows";
  if (a.H < 1 || a.K < 1 || a.Q < 1 || a.Qv < 1) return "empty head dimensions";
  if (a.H % a.K) return "the query heads H are not a multiple of the kv heads K";
  if (a.num_pages < 1 || a.page_size < 1) return "the cache has no pages";
  if (a.S < 1 || a.P < 1) return "the page table is empty";
  if (!cache_format(a.k_fmt) || !cache_format(a.v_fmt))
    return "the cache must be float32, float16, bfloat16 or q8_0";
  if (cache_row_width(a.k_fmt, a.Q) < 0 || cache_row_width(a.v_fmt, a.Qv) < 0)
    return "a q8_0 cache needs head widths that are multiples of 32";
  if (a.window < 0) return "negative window";
  if (a.T == 0) return nullptr;
  if (!a.q || !a.k || !a.v || !a.page_table || !a.slots || !a.positions || !a.out)
    return "a null buffer";
  for (int64_t i = 0; i < a.S * a.P; ++i)
    if (a.page_table[i] < 0 || a.page_table[i] >= a.num_pages)
      return "a page id in the page table is outside [0, num_pages)";
  for (int64_t t = 0; t < a.T; ++t) {
    if (a.slots[t] < 0 || a.slots[t] >= a.S) return "a row's slot is outside [0, S)";
    if (a.positions[t] < 0 || a.positions[t] >= a.P * a.page_size)
      return "a row's position is negative or past its page table (P * page_size keys)";
    if (a.ends && a.ends[t] < a.positions[t])
      return "a row's end (its last visible key) is before its position";
    if (a.ends && a.ends[t] >= a.P * a.page_size)
      return "a row's end (its last visible key) is past its page table (P * page_size keys)";
  }
  return nullptr;
}

const char* attention(const AttnArgs& a, Isa isa, int threads, const Schedule& schedule,
                      int64_t max_group) {
  if (const char* e = check_attention(a)) return e;
  if (!isa_supported(isa)) return "this CPU lacks the instruction set asked for";
  const std::vector<Group> groups = balanced_groups(a, max_group, threads);
  const int64_t units = int64_t(groups.size()) * a.K;  // unit c: group c / K, kv head c % K
  run_chunks(units, threads, schedule, [&](int64_t c) {
    const Group& g = groups[size_t(c / a.K)];
    // Not zeroed: a unit writes every scratch value before it reads it (attention_impl.h),
    // and zeroing it (52 KB at head size 64) cost a decode row's unit as much as its sums.
    std::unique_ptr<float[]> scratch(new float[size_t(attention_scratch(a, g.t0, g.R))]);
    std::unique_ptr<int64_t[]> rows(new int64_t[size_t(attention_group_span(a, g.t0, g.R).n)]);
    run_unit(isa, a, g.t0, g.R, c % a.K, scratch.get(), rows.get());
  });
  return nullptr;
}

}  // namespace kn
