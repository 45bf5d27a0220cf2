// The attention driver: check every index the kernel will follow, then run the (row, kv
// head) units on the chosen ISA path, split over threads (each unit whole on one thread,
// so neither the split nor the thread count changes a bit).
#include "attention.h"

#include <vector>

#include "common.h"

namespace kn {

namespace {

bool cache_format(int fmt) { return fmt == F32 || fmt == F16 || fmt == BF16; }

void run_unit(Isa isa, const AttnArgs& a, int64_t t, int64_t kh, float* scratch,
              int64_t* rows) {
  if (isa == ISA_AVX512) return attention_unit_avx512(a, t, kh, scratch, rows);
  if (isa == ISA_AVX2) return attention_unit_avx2(a, t, kh, scratch, rows);
  attention_unit_scalar(a, t, kh, scratch, rows);
}

}  // namespace

const char* check_attention(const AttnArgs& a) {
  if (a.T < 0) return "negative number of rows";
  if (a.H < 1 || a.K < 1 || a.Q < 1 || a.Qv < 1) return "empty head dimensions";
  if (a.H % a.K) return "the query heads H are not a multiple of the kv heads K";
  if (a.num_pages < 1 || a.page_size < 1) return "the cache has no pages";
  if (a.S < 1 || a.P < 1) return "the page table is empty";
  if (!cache_format(a.k_fmt) || !cache_format(a.v_fmt))
    return "the cache must be float32, float16 or bfloat16";
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
  }
  return nullptr;
}

const char* attention(const AttnArgs& a, Isa isa, int threads, const Schedule& schedule) {
  if (const char* e = check_attention(a)) return e;
  if (!isa_supported(isa)) return "this CPU lacks the instruction set asked for";
  const int64_t units = a.T * a.K;  // unit c: row c / K, kv head c % K
  run_chunks(units, threads, schedule, [&](int64_t c) {
    const int64_t t = c / a.K, kh = c % a.K;
    std::vector<float> scratch(size_t(attention_scratch(a, t)));
    std::vector<int64_t> rows(size_t(attention_span(a, t).n));
    run_unit(isa, a, t, kh, scratch.data(), rows.data());
  });
  return nullptr;
}

}  // namespace kn
