// A standalone check of the kernels for sanitizer builds (scripts/sanitize_kernels.sh): every
// format, every ISA path this CPU has, 1 and 2 threads, several M; attention over random
// float32, float16 and bfloat16 caches, single rows, prompt chunks and rows that see past
// their position (ends: an image attending to itself both ways); the row pieces; the JSON
// writer of float vectors (float_json.h); the greedy row argmax (argmax.h); weights in the
// 16-column layout (repack.h); a mixture's projections over (row, expert) pairs; the
// gated delta rule; the gated feed-forward's silu(gate) * up (glu.h); memory pages handed
// back inside a range, its ends kept (lazyzero.h release_pages). Each path must
// give the reference path's bits. Exit status 0 when every case matches; the sanitizers
// abort on any undefined behaviour or bad access.
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#include "argmax.h"
#include "attention.h"
#include "delta_rule.h"
#include "float_json.h"
#include "glu.h"
#include "hadamard.h"
#include "kvwrite.h"
#include "lazyzero.h"
#include "qmatmul_api.h"
#include "repack.h"
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

void check_matmul_format(int fmt, int64_t n, int64_t k, std::mt19937& rng) {
  const std::vector<uint8_t> w = random_weight(fmt, n, k, rng);
  std::normal_distribution<float> normal;
  // the multi-row groups: 1, 3, 8 + 1, 8 + 8 (float tiles: 6 + 3, 6 + 6 + 4)
  for (int64_t m : {1, 3, 9, 16}) {
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
      // every other row live (qmatmul_rows, written in place): those rows get ref's, the
      // others keep what they held
      std::vector<int32_t> live(static_cast<size_t>(m));
      for (int64_t r = 0; r < m; ++r) live[size_t(r)] = int32_t(r % 2 == 0);
      std::vector<float> part(size_t(m * n), -7.0f), want(part);
      for (int64_t r = 0; r < m; r += 2)
        std::copy(ref.begin() + r * n, ref.begin() + (r + 1) * n, want.begin() + r * n);
      const MatmulPart one{fmt, w.data(), n, part.data()};
      if (const char* e = qmatmul_rows(&one, 1, k, x.data(), m, live.data(), isa, 2, Schedule())) {
        std::printf("qmatmul_rows error: %s\n", e);
        ++failures;
      }
      expect_same(want, part, "qmatmul_rows in place");
    }
  }
  std::vector<int32_t> rows = {0, int32_t(n - 1), int32_t(std::min<int64_t>(5, n - 1))};
  std::vector<float> out(size_t(3 * k));
  if (const char* e = dequant_rows(fmt, w.data(), n, k, rows.data(), 3, out.data())) {
    std::printf("dequant error: %s\n", e);
    ++failures;
  }
}

// A mixture's projections over (row, expert) pairs (qmatmul_id): each pair is its row
// against its expert alone, on every path, for a gate/up pair of parts (share 3) and a row
// per pair (share 1); an id out of range is an error.
void check_experts(int fmt, int64_t k, std::mt19937& rng) {
  const int64_t E = 5, n = 21, rows = 4, share = 3;
  const std::vector<uint8_t> w = random_weight(fmt, E * n, k, rng);
  const int64_t stride = n * row_bytes(fmt, k);
  std::normal_distribution<float> normal;
  std::vector<float> x(size_t(rows * k));
  for (auto& v : x) v = normal(rng);
  std::vector<int32_t> ids(size_t(rows * share));
  for (auto& id : ids) id = int32_t(rng() % uint32_t(E));
  ids[1] = ids[0];  // a row choosing one expert twice
  for (Isa isa : {ISA_SCALAR, ISA_AVX2, ISA_AVX512}) {
    if (!isa_supported(isa)) continue;
    for (int64_t sh : {share, int64_t(1)}) {
      const int64_t R = rows * share / sh, pairs = rows * share;
      std::vector<float> xs(size_t(R * k));
      for (int64_t r = 0; r < R; ++r)
        std::memcpy(&xs[size_t(r * k)], &x[size_t((r * sh / share) % rows * k)],
                    size_t(k) * sizeof(float));
      std::vector<float> gate(size_t(pairs * n)), up(size_t(pairs * n));
      const MatmulPart parts[2] = {{fmt, w.data(), n, gate.data()}, {fmt, w.data(), n, up.data()}};
      const int64_t strides[2] = {stride, stride};
      if (const char* e = qmatmul_id(parts, strides, 2, E, k, xs.data(), R, ids.data(), pairs,
                                     sh, isa, 2, thread_schedule())) {
        std::printf("qmatmul_id error: %s\n", e);
        ++failures;
        continue;
      }
      for (int64_t p = 0; p < pairs; ++p) {
        std::vector<float> alone(static_cast<size_t>(n));
        qmatmul(fmt, w.data() + ids[size_t(p)] * stride, n, k, &xs[size_t(p / sh * k)], 1,
                alone.data(), isa, 1, Schedule());
        const std::vector<float> got(gate.begin() + p * n, gate.begin() + (p + 1) * n);
        expect_same(alone, got, "qmatmul_id pair");
        expect_same(got, std::vector<float>(up.begin() + p * n, up.begin() + (p + 1) * n),
                    "qmatmul_id parts");
      }
    }
  }
  std::vector<int32_t> bad(ids);
  bad[2] = int32_t(E);
  std::vector<float> y(size_t(rows * share * n));
  const MatmulPart part{fmt, w.data(), n, y.data()};
  if (!qmatmul_id(&part, &stride, 1, E, k, x.data(), rows, bad.data(), rows * share, share,
                  ISA_SCALAR, 1, Schedule())) {
    std::printf("qmatmul_id took an expert id out of range\n");
    ++failures;
  }
}

// The gated delta rule (delta_rule.h) on random states: a prompt row, a row from the zero
// state, a draft row, a replay; every path the scalar one's bits; an index out of range
// refused.
void check_delta_rule(std::mt19937& rng) {
  const int64_t H = 4, Hk = 2, d = 16, taps = 4, slots = 2, K1 = 3;
  const int64_t C = 2 * Hk * d + H * d, E = C + 2 * H, S = slots + 3, T = 4, R = 2;
  const DeltaShape shape{C, H, Hk, d, taps, S, slots + 1, K1, T, R, 1e-6f};
  std::normal_distribution<float> normal(0.f, 0.3f);
  auto fill = [&](int64_t n) {
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& x : v) x = normal(rng);
    return v;
  };
  const std::vector<float> conv_taps = fill(C * taps), events = fill(T * E);
  const std::vector<float> windows0 = fill(S * (taps - 1) * C), matrices0 = fill(S * H * d * d),
                           pending0 = fill((slots + 1) * K1 * E);
  const int32_t read[T] = {0, 4, 1, 0}, write[T] = {0, 1, 3, 0}, slot[T] = {0, 1, 1, 0},
                pend[T] = {-1, -1, 0, -1}, replay_slot[R] = {1, 0}, replay_idx[R] = {1, 0};
  std::vector<float> outs[3];
  for (Isa isa : {ISA_SCALAR, ISA_AVX2, ISA_AVX512}) {
    if (!isa_supported(isa)) continue;
    std::vector<float>& out = outs[isa];
    std::vector<float> windows = windows0, matrices = matrices0, pending = pending0;
    out.assign(static_cast<size_t>(T * H * d), 0.f);
    if (const char* e = delta_rule(shape, conv_taps.data(), windows.data(), matrices.data(),
                                   pending.data(), events.data(), read, write, slot, pend,
                                   replay_slot, replay_idx, 1, out.data(), isa, 2)) {
      std::printf("delta_rule error: %s\n", e);
      ++failures;
    }
    expect_same(outs[ISA_SCALAR], out, "delta_rule on every path");
  }
  std::vector<float> windows = windows0, matrices = matrices0, pending = pending0;
  const int32_t bad_read[T] = {0, int32_t(S), 1, 0};
  if (!delta_rule(shape, conv_taps.data(), windows.data(), matrices.data(), pending.data(),
                  events.data(), bad_read, write, slot, pend, replay_slot, replay_idx, 1,
                  outs[0].data(), ISA_SCALAR, 1)) {
    std::printf("delta_rule took a state index out of range\n");
    ++failures;
  }
}

// The 16-column layout (repack.h): every path on a repacked weight gives the plain weight's
// bits, its rows gather to the plain rows, and undoing it gives the plain bytes back.
void check_repacked_format(int fmt, int64_t n, int64_t k, std::mt19937& rng) {
  const std::vector<uint8_t> w = random_weight(fmt, n, k, rng);
  std::vector<uint8_t> rep = w;
  if (const char* e = repack16(fmt, rep.data(), n, k)) {
    std::printf("repack error: %s\n", e);
    ++failures;
    return;
  }
  const int rfmt = fmt | kRepack16;
  const int64_t rb = row_bytes(fmt, k);
  std::vector<uint8_t> back(size_t(16 * rb));
  for (int64_t g = 0; g < n / 16; ++g) {
    unrepack_group(fmt, rep.data() + g * 16 * rb, k / format_info(fmt)->qk, back.data());
    if (std::memcmp(back.data(), w.data() + g * 16 * rb, back.size()) != 0) {
      std::printf("MISMATCH: unrepack_group fmt %d group %lld\n", fmt, (long long)g);
      ++failures;
    }
  }
  std::normal_distribution<float> normal;
  for (int64_t m : {1, 3, 9, 16, 17}) {   // 9, 16: in registers 8 rows a pass; 17: a strip
    std::vector<float> x(size_t(m * k));
    for (auto& v : x) v = normal(rng);
    std::vector<float> ref(size_t(m * n));
    qmatmul(fmt, w.data(), n, k, x.data(), m, ref.data(), ISA_SCALAR, 1, Schedule());
    for (Isa isa : {ISA_SCALAR, ISA_AVX2, ISA_AVX512}) {
      if (!isa_supported(isa)) continue;
      for (int threads : {1, 2}) {
        std::vector<float> y(size_t(m * n));
        qmatmul(rfmt, rep.data(), n, k, x.data(), m, y.data(), isa, threads, thread_schedule());
        char what[96];
        std::snprintf(what, sizeof(what), "repacked qmatmul fmt %d N %lld M %lld %s threads %d",
                      fmt, (long long)n, (long long)m, isa_name(isa), threads);
        expect_same(ref, y, what);
      }
    }
  }
  std::vector<int32_t> rows;
  for (int64_t r = 0; r < n; r += 7) rows.push_back(int32_t(r));
  rows.push_back(int32_t(n - 1));
  std::vector<float> a(rows.size() * size_t(k)), b(a.size());
  dequant_rows(fmt, w.data(), n, k, rows.data(), int64_t(rows.size()), a.data());
  dequant_rows(rfmt, rep.data(), n, k, rows.data(), int64_t(rows.size()), b.data());
  expect_same(a, b, "repacked dequant_rows");
}

// A cache of n floats in fmt (F32, F16 or BF16), as the kernel reads it.
std::vector<uint8_t> cache_bytes(int fmt, const std::vector<float>& x) {
  std::vector<uint8_t> b(x.size() * (fmt == F32 ? 4 : 2));
  for (size_t i = 0; i < x.size(); ++i) {
    if (fmt == F32) std::memcpy(&b[4 * i], &x[i], 4);
    uint16_t h = fmt == F16 ? f32_to_f16(x[i]) : f32_to_bf16(x[i]);
    if (fmt != F32) std::memcpy(&b[2 * i], &h, 2);
  }
  return b;
}

// Three steps over float32, float16 and bfloat16 caches: single rows of two slots, prompt
// chunks (runs of rows of one slot at consecutive positions, one across a key block edge
// and longer than a group) beside single rows, and the same chunks with ends: images whose
// rows all see the image's last key (one inside the long run, across the key block edge,
// one a whole run), single rows that see past themselves. Every path, thread count and group
// size must give the bits of the scalar path with every row on its own; ends equal to the
// positions must give the bits of no ends; a bad end must be refused.
// a's output on the scalar path with every row on its own, into ref; then every path this
// CPU has, 1 and 2 threads and groups of 1, 3 and ATTN_MAX_GROUP rows must give its bits.
// False (a failure counted) where the kernel refused a.
bool check_attention_paths(AttnArgs a, std::vector<float>& ref, const char* what) {
  ref.assign(size_t(a.T * a.H * a.Qv), 0.f);
  a.out = ref.data();
  if (const char* e = attention(a, ISA_SCALAR, 1, Schedule(), 1)) {
    std::printf("%s error: %s\n", what, e);
    ++failures;
    return false;
  }
  for (Isa isa : {ISA_SCALAR, ISA_AVX2, ISA_AVX512}) {
    if (!isa_supported(isa)) continue;
    for (int threads : {1, 2})
      for (int64_t group : {int64_t(1), int64_t(3), ATTN_MAX_GROUP}) {
        std::vector<float> y(ref.size());
        a.out = y.data();
        attention(a, isa, threads, threads > 1 ? thread_schedule() : Schedule(), group);
        char label[160];
        std::snprintf(label, sizeof(label), "%s %s threads %d group %lld", what,
                      isa_name(isa), threads, (long long)group);
        expect_same(ref, y, label);
      }
  }
  return true;
}

// hadamard_rows against Sylvester's matrix (within float rounding), in place as out of
// place, its own inverse; a block that is no power of two, or does not divide the row, is
// refused.
void check_hadamard(std::mt19937& rng) {
  std::normal_distribution<float> normal;
  for (int64_t n : {1, 2, 64, 256}) {
    const int64_t rows = 3, width = 2 * n;
    std::vector<float> x(size_t(rows * width)), y(x.size()), z(x.size());
    for (auto& v : x) v = normal(rng);
    hadamard_rows(x.data(), y.data(), rows, width, n);
    z = x;
    hadamard_rows(z.data(), z.data(), rows, width, n);
    expect_same(y, z, "hadamard in place");
    for (int64_t b = 0; b < rows * width / n; ++b)
      for (int64_t i = 0; i < n; ++i) {
        double want = 0;
        for (int64_t j = 0; j < n; ++j)
          want += (__builtin_popcountll(uint64_t(i & j)) % 2 ? -1.0 : 1.0) * x[size_t(b * n + j)];
        want /= std::sqrt(double(n));
        if (std::fabs(want - y[size_t(b * n + i)]) > 1e-4 * (1 + std::fabs(want))) {
          std::printf("MISMATCH: hadamard n %lld block %lld value %lld\n", (long long)n,
                      (long long)b, (long long)i);
          ++failures;
          return;
        }
      }
    hadamard_rows(y.data(), z.data(), rows, width, n);
    for (size_t i = 0; i < x.size(); ++i)
      if (std::fabs(z[i] - x[i]) > 1e-4f * (1 + std::fabs(x[i]))) {
        std::printf("MISMATCH: hadamard n %lld is not its own inverse\n", (long long)n);
        ++failures;
        return;
      }
  }
  std::vector<float> x(96);
  if (!hadamard_rows(x.data(), x.data(), 1, 96, 48) ||
      !hadamard_rows(x.data(), x.data(), 1, 96, 64)) {
    std::printf("MISMATCH: hadamard took a bad block\n");
    ++failures;
  }
}

// A q8_0 cache written by kv_write (64-wide keys, 32-wide values; an outlier channel, an
// all-zero block): every path, thread count and group size gives the scalar path's bits with
// every row on its own, rows and prompt chunks; a row that is not whole blocks is refused.
void check_attention_q8_0(std::mt19937& rng) {
  std::normal_distribution<float> normal;
  const int64_t H = 4, K = 2, Q = 64, Qv = 32, pages = 12, ps = 4, S = 2, P = 6;
  const int64_t rows = pages * ps;
  std::vector<float> kf(size_t(rows * K * Q)), vf(size_t(rows * K * Qv));
  for (auto* v : {&kf, &vf})
    for (auto& x : *v) x = normal(rng);
  for (int64_t r = 0; r < rows * K; ++r) kf[size_t(r * Q + 5)] *= 40.f;
  for (int64_t j = 0; j < 32; ++j) kf[size_t(j)] = 0.f;
  std::vector<uint8_t> kc(size_t(rows * K * Q / 32 * 34)), vc(size_t(rows * K * Qv / 32 * 34));
  std::vector<int32_t> index(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) index[size_t(r)] = int32_t(r);
  if (const char* e = kv_write(kc.data(), Q8_0, rows, K * Q, kf.data(), index.data(), rows)) {
    std::printf("kv_write q8_0 error: %s\n", e);
    ++failures;
    return;
  }
  kv_write(vc.data(), Q8_0, rows, K * Qv, vf.data(), index.data(), rows);
  if (kv_write(kc.data(), Q8_0, rows, 48, kf.data(), index.data(), 1) == nullptr) {
    std::printf("MISMATCH: kv_write took a q8_0 row of 48 values\n");
    ++failures;
  }
  std::vector<int32_t> table(size_t(S * P));
  for (size_t i = 0; i < table.size(); ++i) table[i] = int32_t(1 + (i * 5) % (pages - 1));
  const std::vector<int32_t> slots = {0, 1, 0, 0, 0, 1}, positions = {0, 11, 7, 8, 9, 23};
  const int64_t T = int64_t(slots.size());
  std::vector<float> q(size_t(T * H * Q)), ref;
  for (auto& x : q) x = normal(rng);
  AttnArgs a{q.data(), kc.data(), vc.data(), Q8_0, Q8_0, table.data(), slots.data(),
             positions.data(), nullptr, nullptr, T, H, K, Q, Qv, pages, ps, S, P, 0.125f,
             0, 0.f};
  if (!check_attention_paths(a, ref, "attention q8_0")) return;
  std::vector<float> y(ref.size());
  AttnArgs bad = a;
  bad.Q = 48;
  bad.out = y.data();
  const char* e = attention(bad, ISA_SCALAR, 1, Schedule());
  if (!e || !std::strstr(e, "32")) {
    std::printf("MISMATCH: attention took q8_0 heads 48 wide\n");
    ++failures;
  }
}

void check_attention(std::mt19937& rng) {
  std::normal_distribution<float> normal;
  const int64_t H = 6, K = 2, Q = 40, Qv = 24, pages = 41, ps = 4, S = 2, P = 20;
  std::vector<float> kf(size_t(pages * ps * K * Q)), vf(size_t(pages * ps * K * Qv));
  for (auto* v : {&kf, &vf})
    for (auto& x : *v) x = normal(rng);
  std::vector<int32_t> table(size_t(S * P));
  for (size_t i = 0; i < table.size(); ++i) table[i] = int32_t(1 + (i * 7) % (pages - 1));
  std::vector<int32_t> rows_slots = {0, 1, 0, 1, 1, 0, 0},
                       rows_positions = {0, 15, 3, 7, 9, 12, 1}, chunk_slots, chunk_positions;
  for (auto [slot, pos, n] : {std::array<int, 3>{0, 55, 20}, {1, 0, 5}, {1, 70, 1},
                              {0, 3, 1}, {1, 5, 3}})
    for (int i = 0; i < n; ++i) chunk_slots.push_back(slot), chunk_positions.push_back(pos + i);
  std::vector<int32_t> chunk_ends = chunk_positions;  // images: rows 3..13 (58..68), 20..24
  for (int i = 3; i <= 13; ++i) chunk_ends[size_t(i)] = 68;
  for (int i = 20; i <= 24; ++i) chunk_ends[size_t(i)] = 4;
  chunk_ends[25] = 75;  // slot 1's row at 70 sees 71..75 too
  chunk_ends[27] = 9;   // slot 1's row at 5 sees 6..9; the rows at 6 and 7 end before it
  for (int fmt : {F32, F16, BF16}) {
    const std::vector<uint8_t> kc = cache_bytes(fmt, kf), vc = cache_bytes(fmt, vf);
    for (int chunks : {0, 1, 2}) {  // 2: the chunks with ends
      const std::vector<int32_t>& slots = chunks ? chunk_slots : rows_slots;
      const std::vector<int32_t>& positions = chunks ? chunk_positions : rows_positions;
      const int32_t* ends = chunks == 2 ? chunk_ends.data() : nullptr;
      const int64_t T = int64_t(slots.size());
      std::vector<float> q(size_t(T * H * Q));
      for (auto& x : q) x = normal(rng);
      for (auto [window, softcap] : {std::pair<int64_t, float>{0, 0.f}, {5, 0.f}, {0, 2.f}}) {
        AttnArgs a{q.data(), kc.data(), vc.data(), fmt, fmt, table.data(), slots.data(),
                   positions.data(), ends, nullptr, T, H, K, Q, Qv, pages, ps, S, P, 0.125f,
                   window, softcap};
        std::vector<float> ref;
        char what[96];
        std::snprintf(what, sizeof(what), "attention fmt %d %s window %lld", fmt,
                      chunks == 2 ? "ends" : chunks ? "chunks" : "rows", (long long)window);
        if (!check_attention_paths(a, ref, what)) return;
        if (chunks == 1) {  // ends equal to the positions: the causal bits
          std::vector<float> y(ref.size());
          a.ends = positions.data();
          a.out = y.data();
          attention(a, best_isa(), 2, thread_schedule());
          expect_same(ref, y, "attention with ends = positions");
        }
      }
    }
  }
  // a bad end is refused: before its row's position, or past its page table
  for (int32_t bad : {54, int32_t(P * ps)}) {
    std::vector<int32_t> ends = chunk_ends;
    ends[0] = bad;  // row 0 is at position 55
    std::vector<float> q(size_t(int64_t(ends.size()) * H * Q)), y(size_t(ends.size()) * H * Qv);
    AttnArgs a{q.data(), kf.data(), vf.data(), F32, F32, table.data(), chunk_slots.data(),
               chunk_positions.data(), ends.data(), y.data(), int64_t(ends.size()), H, K, Q,
               Qv, pages, ps, S, P, 0.125f, 0, 0.f};
    const char* e = attention(a, ISA_SCALAR, 1, Schedule());
    if (!e || !std::strstr(e, "end")) {
      std::printf("MISMATCH: attention took a row's end %d\n", bad);
      ++failures;
    }
  }
  std::vector<float> q(size_t(7 * H * Q)), w(Q), y(q.size()), c(q.size()), s(q.size());
  for (auto& v : q) v = normal(rng);
  for (auto& v : w) v = normal(rng);
  rms_norm_rows(q.data(), w.data(), 7 * H, Q, 1e-6f, y.data());
  cos_sin(q.data(), int64_t(q.size()), c.data(), s.data());
}

// float_json.h on values that take each of its layouts; Python's json.dumps wrote `want`
// (tests/test_float_json.py compares millions of values with it).
void check_json_floats() {
  const float x[] = {0.0f, -0.0f, 1.0f, 0.1f, 1e-4f, 1e-5f, -1.5e-7f, 1e15f, 1e16f,
                     123456.0f, 3.4028235e38f, 1.4e-45f};
  const char* want = "[0.0,-0.0,1.0,0.10000000149011612,9.999999747378752e-05,"
                     "9.999999747378752e-06,-1.500000053056283e-07,999999986991104.0,"
                     "1.0000000272564224e+16,123456.0,3.4028234663852886e+38,1.401298464324817e-45]";
  const size_t n = sizeof x / sizeof x[0];
  std::vector<char> out(2 + n * kJsonFloatChars);
  const int64_t len = json_floats(x, n, out.data());
  if (len < 0 || std::string(out.data(), size_t(len)) != want) {
    std::printf("json_floats: %s\n", len < 0 ? "refused" : std::string(out.data(), size_t(len)).c_str());
    ++failures;
  }
  const float nan = std::nanf("");
  if (json_floats(&nan, 1, out.data()) != -1) {
    std::printf("json_floats: a NaN was written\n");
    ++failures;
  }
}

// argmax.h on rows whose answers are known: ties (the first), NaN (never), a maximum in the
// scalar tail, no finite maximum (-1), +inf (-1), a row of 1 value; then a mask and bias
// pairs: a masked maximum, a banned one, a pair raising a token past the rest, and a ban on a
// +inf logit (NaN, read as -inf).
void check_row_argmax() {
  const float inf = INFINITY, nan = std::nanf("");
  const int64_t v = 21;   // 5 vectors of 4 and a tail of 1
  std::vector<float> x(6 * v, 0.0f);
  x[3] = 2.0f, x[9] = 2.0f;                           // row 0: tie, first at 3
  for (int64_t i = 0; i < v; ++i) x[v + i] = i % 2 ? nan : -1.0f;
  x[v + v - 1] = 5.0f;                               // row 1: NaNs, the maximum last
  for (int64_t i = 0; i < v; ++i) x[2 * v + i] = -inf;            // row 2: -1
  for (int64_t i = 0; i < v; ++i) x[3 * v + i] = nan;             // row 3: -1
  x[4 * v + 7] = inf;                                // row 4: -1
  x[5 * v + 1] = -0.0f;                              // row 5: 0 (+0 and -0 are equal)
  int32_t got[6];
  row_argmax(x.data(), 6, v, nullptr, nullptr, 0, nullptr, got);
  const int32_t want[6] = {3, int32_t(v - 1), -1, -1, -1, 0};
  if (std::memcmp(got, want, sizeof want) != 0) {
    std::printf("row_argmax: %d %d %d %d %d %d\n", got[0], got[1], got[2], got[3], got[4],
                got[5]);
    ++failures;
  }
  const float one = 4.0f;
  int32_t single = 7;
  row_argmax(&one, 1, 1, nullptr, nullptr, 0, nullptr, &single);
  if (single != 0) {
    std::printf("row_argmax of one value: %d\n", single);
    ++failures;
  }
  const int64_t vm = 40;   // two mask words, the second partial
  std::vector<float> y(4 * vm, 0.0f);
  for (int64_t r = 0; r < 4; ++r) y[r * vm + 33] = 2.0f, y[r * vm + 5] = 1.0f;
  y[3 * vm + 33] = inf;
  const uint32_t all = ~0u, mask[8] = {1u << 5, 0, all, all, all, all, all, all};
  const int32_t ids[8] = {-1, -1, 33, -1, 20, 33, 33, 40};
  const float values[8] = {0, 0, -inf, 0, 3.0f, -1.0f, -inf, 9.0f};
  int32_t pick[4];
  row_argmax(y.data(), 4, vm, ids, values, 2, mask, pick);
  const int32_t want_pick[4] = {5, 5, 20, 5};
  if (std::memcmp(pick, want_pick, sizeof want_pick) != 0) {
    std::printf("row_argmax with a mask and pairs: %d %d %d %d\n", pick[0], pick[1], pick[2],
                pick[3]);
    ++failures;
  }
}

// glu.h on every path this CPU has against the 1-lane path, over lengths with and without
// a tail past the last 8 and 16 lanes and special values (zeros, infinities, NaN, past exp's
// cut-off, subnormals); then the threaded entry (several chunks) against it too.
void check_swiglu(std::mt19937& rng) {
  std::normal_distribution<float> normal;
  std::vector<float> g(40000), u(g.size());
  for (size_t i = 0; i < g.size(); ++i) g[i] = normal(rng) * float(1 + i % 4 * 30), u[i] = normal(rng);
  const float inf = INFINITY, special[] = {0.0f, -0.0f, inf, -inf, std::nanf(""), 86.5f,
                                           -86.5f, 100.0f, -100.0f, 1e-40f, -1e-40f};
  std::copy(std::begin(special), std::end(special), g.begin());
  for (int64_t n : {int64_t(1), int64_t(11), int64_t(23), int64_t(g.size())}) {
    std::vector<float> want(static_cast<size_t>(n)), got(static_cast<size_t>(n));
    swiglu_isa(g.data(), u.data(), n, want.data(), ISA_SCALAR);
    for (Isa isa : {ISA_AVX2, ISA_AVX512})
      if (isa_supported(isa)) {
        swiglu_isa(g.data(), u.data(), n, got.data(), isa);
        expect_same(got, want, (std::string("swiglu on ") + isa_name(isa)).c_str());
      }
    swiglu(g.data(), u.data(), n, got.data());
    expect_same(got, want, "swiglu on the kernel's threads");
  }
}

// release_pages on private anonymous memory (what malloc gives the KV cache): the whole
// pages inside the range read as zeros after, the bytes of the partial pages at its ends
// and outside it keep their values, and a range with no whole page changes nothing.
void check_release_pages() {
  const long ps = sysconf(_SC_PAGESIZE);
  const size_t page = ps > 0 ? size_t(ps) : 4096, bytes = 8 * page;
  void* m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) {
    std::printf("release_pages: mmap failed, not checked\n");
    return;
  }
  unsigned char* b = static_cast<unsigned char*>(m);
  std::memset(b, 7, bytes);
  const size_t from = page + 100, len = 4 * page;   // whole pages 2, 3 and 4 inside
  const size_t released = release_pages(b + from, len);
  bool ok = released == 3 * page && release_pages(b + 10, page) == 0;
  for (size_t i = 0; i < bytes; ++i)
    ok = ok && b[i] == ((i >= 2 * page && i < 5 * page) ? 0 : 7);
  if (!ok) {
    std::printf("MISMATCH release_pages\n");
    ++failures;
  }
  munmap(m, bytes);
}

}  // namespace

int main() {
  std::mt19937 rng(1234);
  for (int fmt : {F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K})
    for (int64_t k : {512, 768})  // 768: 24 blocks of 32, more than one strip of 16
      for (int64_t n : {37, 1})   // 1: a one-output projection (a shared expert's gate)
        check_matmul_format(fmt, n, k, rng);
  for (int fmt : {Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K})
    for (int64_t n : {37, 16, 5})   // groups and plain rows after them; one group; none
      check_repacked_format(fmt, n, 768, rng);
  for (int fmt : {F16, Q4_0, Q8_0, Q4_K, Q6_K}) check_experts(fmt, 512, rng);
  check_attention(rng);
  check_attention_q8_0(rng);
  check_hadamard(rng);
  check_delta_rule(rng);
  check_json_floats();
  check_row_argmax();
  check_swiglu(rng);
  check_release_pages();
  std::printf("%s (best path here: %s)\n", failures ? "FAILED" : "all paths agree",
              isa_name(best_isa()));
  return failures ? 1 : 0;
}
