// A standalone check of the kernels for sanitizer builds (scripts/sanitize_kernels.sh): every
// format, every ISA path this CPU has, 1 and 2 threads, several M; attention over random
// caches; the row pieces. Each path must give the reference path's bits. Exit status 0 when
// every case matches; the sanitizers abort on any undefined behaviour or bad access.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "attention.h"
#include "qmatmul_api.h"
#include "rownorm.h"

using namespace kn;

namespace {

int failures = 0;

void expect_same(const std::vector<float>& a, const std::vector<float>& b, const char* what) {
  if (a.size() != b.size() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) != 0) {
    std::printf("MISMATCH: %s\n", what);
    ++failures;
  }
}

// n rows of k values of fmt: random bytes with every f16 scale field a small finite half.
std::vector<uint8_t> random_weight(int fmt, int64_t n, int64_t k, std::mt19937& rng) {
  const FormatInfo* f = format_info(fmt);
  std::vector<uint8_t> w(size_t(n * row_bytes(fmt, k)));
  for (auto& b : w) b = uint8_t(rng());
  std::uniform_real_distribution<float> scale(1e-3f, 3e-2f), value(-1.f, 1.f);
  if (f->qk == 1) {  // float formats: finite values
    for (int64_t i = 0; i < n * k; ++i) {
      float v = value(rng);
      if (fmt == F32) std::memcpy(&w[size_t(4 * i)], &v, 4);
      uint16_t h = fmt == F16 ? f32_to_f16(v) : f32_to_bf16(v);
      if (fmt != F32) std::memcpy(&w[size_t(2 * i)], &h, 2);
    }
    return w;
  }
  std::vector<int> halves;  // byte offsets of the f16 fields in a block
  switch (fmt) {
    case Q4_0: case Q5_0: case Q8_0: halves = {0}; break;
    case Q4_1: case Q5_1: case Q4_K: case Q5_K: halves = {0, 2}; break;
    case Q2_K: halves = {80, 82}; break;
    case Q3_K: halves = {108}; break;
    case Q6_K: halves = {208}; break;
  }
  for (size_t b = 0; b < w.size(); b += size_t(f->bytes))
    for (int at : halves) {
      uint16_t h = f32_to_f16(scale(rng));
      std::memcpy(&w[b + size_t(at)], &h, 2);
    }
  return w;
}

void check_matmul_format(int fmt, std::mt19937& rng) {
  const int64_t k = 512, n = 37;
  const std::vector<uint8_t> w = random_weight(fmt, n, k, rng);
  std::normal_distribution<float> normal;
  for (int64_t m : {1, 3, 16}) {
    std::vector<float> x(size_t(m * k));
    for (auto& v : x) v = normal(rng);
    std::vector<float> ref(size_t(m * n));
    if (const char* e = qmatmul(fmt, w.data(), n, k, x.data(), m, ref.data(), ISA_SCALAR, 1,
                                Schedule())) {
      std::printf("error: %s\n", e);
      ++failures;
      return;
    }
    for (Isa isa : {ISA_SCALAR, ISA_AVX2, ISA_AVX512}) {
      if (!isa_supported(isa)) continue;
      for (int threads : {1, 2}) {
        std::vector<float> y(size_t(m * n));
        qmatmul(fmt, w.data(), n, k, x.data(), m, y.data(), isa, threads, thread_schedule());
        char what[96];
        std::snprintf(what, sizeof(what), "qmatmul fmt %d M %lld %s threads %d", fmt,
                      (long long)m, isa_name(isa), threads);
        expect_same(ref, y, what);
      }
      std::vector<float> y(size_t(m * n));  // kinetic's own spinning pool (pool.h)
      qmatmul(fmt, w.data(), n, k, x.data(), m, y.data(), isa, 2, Schedule());
      expect_same(ref, y, "qmatmul on the pool");
    }
  }
  std::vector<int32_t> rows = {0, int32_t(n - 1), 5};
  std::vector<float> out(size_t(3 * k));
  if (const char* e = dequant_rows(fmt, w.data(), n, k, rows.data(), 3, out.data())) {
    std::printf("dequant error: %s\n", e);
    ++failures;
  }
}

void check_attention(std::mt19937& rng) {
  std::normal_distribution<float> normal;
  const int64_t T = 7, H = 6, K = 2, Q = 40, Qv = 24, pages = 9, ps = 4, S = 2, P = 4;
  std::vector<float> q(size_t(T * H * Q)), kc(size_t(pages * ps * K * Q)),
      vc(size_t(pages * ps * K * Qv));
  for (auto* v : {&q, &kc, &vc})
    for (auto& x : *v) x = normal(rng);
  std::vector<int32_t> table = {1, 2, 3, 4, 5, 6, 7, 8}, slots = {0, 1, 0, 1, 1, 0, 0},
                       positions = {0, 15, 3, 7, 9, 12, 1};
  for (int64_t window : {0, 5}) {
    AttnArgs a{q.data(), kc.data(), vc.data(), F32, F32, table.data(), slots.data(),
               positions.data(), nullptr, T, H, K, Q, Qv, pages, ps, S, P, 0.125f, window, 0.f};
    std::vector<float> ref(size_t(T * H * Qv));
    a.out = ref.data();
    if (const char* e = attention(a, ISA_SCALAR, 1, Schedule())) {
      std::printf("attention error: %s\n", e);
      ++failures;
      return;
    }
    for (Isa isa : {ISA_AVX2, ISA_AVX512}) {
      if (!isa_supported(isa)) continue;
      std::vector<float> y(ref.size());
      a.out = y.data();
      attention(a, isa, 2, thread_schedule());
      expect_same(ref, y, isa == ISA_AVX2 ? "attention avx2" : "attention avx512");
    }
  }
  std::vector<float> w(Q), y(q.size()), c(q.size()), s(q.size());
  for (auto& v : w) v = normal(rng);
  rms_norm_rows(q.data(), w.data(), T * H, Q, 1e-6f, y.data());
  cos_sin(q.data(), int64_t(q.size()), c.data(), s.data());
}

}  // namespace

int main() {
  std::mt19937 rng(1234);
  for (int fmt : {F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K})
    check_matmul_format(fmt, rng);
  check_attention(rng);
  std::printf("%s (best path here: %s)\n", failures ? "FAILED" : "all paths agree",
              isa_name(best_isa()));
  return failures ? 1 : 0;
}
