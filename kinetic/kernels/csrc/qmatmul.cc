// The driver: check shapes, round the activations once, split N into chunks, and run each
// chunk on the chosen ISA path (the reference where that path lacks the format).
#include "qmatmul_api.h"

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "parallel.h"
#include "repack.h"

namespace kn {

int64_t row_bytes(int fmt, int64_t K) {
  const FormatInfo* f = format_info(fmt);
  return f ? K / f->qk * f->bytes : 0;
}

const char* check_matmul(int fmt, int64_t N, int64_t K, int64_t M) {
  const FormatInfo* f = format_info(fmt);
  if (!f) return "the weight's GGML type is not one the kernel multiplies";
  if (N <= 0 || K <= 0 || M < 0) return "empty or negative matrix dimensions";
  if (f->qk > 1 && K % f->qk) return "K is not a multiple of the format's block size";
  return nullptr;
}

namespace {

void run_plain(Isa isa, const MatmulArgs& a, int64_t n0, int64_t n1) {
  if (isa == ISA_AVX512 && qmatmul_cols_avx512(a, n0, n1)) return;
  if (isa >= ISA_AVX2 && qmatmul_cols_avx2(a, n0, n1)) return;
  qmatmul_cols_ref(a, n0, n1);
}

// A repacked weight (repack.h; n0 a multiple of 16, as every chunk starts): its groups on the
// AVX-512 path's 16-column loop, or, on the other paths, each group's plain rows rebuilt and
// multiplied as plain rows (the same arithmetic per column, so the same bits); the rows after
// the last group are plain rows.
void run_repacked(Isa isa, const MatmulArgs& a, int64_t n0, int64_t n1) {
  const int64_t n16 = std::min(n1, repacked_rows(a.N));
  if (n0 < n16 && !(isa == ISA_AVX512 && qmatmul_cols_avx512_r16(a, n0, n16))) {
    std::vector<uint8_t> rows(size_t(16 * a.row_bytes));
    std::vector<float> y(size_t(16 * a.M));
    MatmulArgs g = a;
    g.w = rows.data();
    g.N = 16;
    g.y = y.data();
    g.y_rows = nullptr;
    g.repacked = false;
    for (int64_t n = n0; n < n16; n += 16) {
      unrepack_group(a.fmt, a.w + n * a.row_bytes, a.K / a.info->qk, rows.data());
      run_plain(isa, g, 0, 16);
      for (int64_t m = 0; m < a.M; ++m)
        std::copy(y.begin() + m * 16, y.begin() + (m + 1) * 16, a.out(m) + n);
    }
  }
  if (std::max(n0, n16) < n1) run_plain(isa, a, std::max(n0, n16), n1);
}

void run_cols(Isa isa, const MatmulArgs& a, int64_t n0, int64_t n1) {
  if (a.repacked)
    run_repacked(isa, a, n0, n1);
  else
    run_plain(isa, a, n0, n1);
}

// Columns per chunk: enough chunks to balance the threads, each a whole number of 16
// columns. The choice changes no result (parallel.h).
int64_t chunk_cols(int64_t N, int threads) {
  int64_t want = std::max<int64_t>(1, int64_t(threads) * 4);
  int64_t cols = (N + want - 1) / want;
  return std::max<int64_t>(16, (cols + 15) / 16 * 16);
}

// Values of x from which its rounding is split over the threads (below, one thread: a
// dispatch costs about what rounding 4096 values does).
constexpr int64_t kSplitActs = 4096;

}  // namespace

const char* qmatmul_parts(const MatmulPart* parts, int n_parts, int64_t K, const float* x,
                          int64_t M, Isa isa, int threads, const Schedule& schedule) {
  for (int p = 0; p < n_parts; ++p)
    if (const char* e = check_matmul(parts[p].fmt, parts[p].n, K, M)) return e;
  if (M == 0 || n_parts == 0) return nullptr;
  if (!isa_supported(isa)) return "this CPU lacks the instruction set asked for";
  // Each activation rounding once, shared by the parts whose weights take it; its rows on
  // every thread where there are enough values to pay for the split (each row is rounded on
  // its own, so the split changes nothing).
  QuantActs acts[6];
  bool done[6] = {};
  std::vector<MatmulArgs> args;
  std::vector<int64_t> first_chunk{0};  // part p's chunks are [first_chunk[p], first_chunk[p+1])
  std::vector<int64_t> cols;
  const bool simd = isa != ISA_SCALAR;
  std::vector<std::vector<int32_t>> words(static_cast<size_t>(n_parts));
  for (int p = 0; p < n_parts; ++p) {
    const FormatInfo* f = format_info(parts[p].fmt);
    if (!done[f->act]) {
      quantize_begin(f->act, M, K, simd, acts[f->act]);
      const int64_t rows = M * K >= kSplitActs ? std::max<int64_t>(1, M / (int64_t(threads) * 2)) : M;
      run_chunks((M + rows - 1) / rows, threads, schedule, [&](int64_t c) {
        quantize_rows(x, c * rows, std::min(M, (c + 1) * rows), acts[f->act], simd);
      });
    }
    done[f->act] = true;
    args.push_back({base_format(parts[p].fmt), f, parts[p].w, row_bytes(parts[p].fmt, K),
                    parts[p].n, K, M, &acts[f->act], parts[p].y, is_repacked(parts[p].fmt)});
    args.back().y_rows = parts[p].y_rows;
    if (isa == ISA_AVX512 && qmatmul_words_avx512(args[size_t(p)], words[size_t(p)]))
      args[size_t(p)].words = words[size_t(p)].data();
    cols.push_back(chunk_cols(parts[p].n, threads));
    first_chunk.push_back(first_chunk.back() + (parts[p].n + cols[p] - 1) / cols[p]);
  }
  run_chunks(first_chunk.back(), threads, schedule, [&](int64_t c) {
    int p = 0;
    while (c >= first_chunk[p + 1]) ++p;
    const int64_t i = c - first_chunk[p];
    run_cols(isa, args[p], i * cols[p], std::min(args[p].N, (i + 1) * cols[p]));
  });
  return nullptr;
}

const char* qmatmul(int fmt, const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t M,
                    float* y, Isa isa, int threads, const Schedule& schedule) {
  const MatmulPart part{fmt, w, N, y};
  return qmatmul_parts(&part, 1, K, x, M, isa, threads, schedule);
}

Schedule thread_schedule() {
  return [](std::function<void()> task) { std::thread(std::move(task)).detach(); };
}

}  // namespace kn
