// The C ABI that kinetic.kernels loads with ctypes: what tests and bench/kernel.py call
// directly, and how Python finds the FFI handlers (ffi.cc). Every function returns 0, or
// nonzero with a message in err; none aborts.
#include <cstdio>
#include <cstring>

#include "delta_rule.h"
#include "float_json.h"
#include "glu.h"
#include "hadamard.h"
#include "lazyzero.h"
#include "qmatmul_api.h"
#include "repack.h"

#define KN_API extern "C" __attribute__((visibility("default")))

namespace {

int fail(const char* msg, char* err, int errlen) {
  if (err && errlen > 0) std::snprintf(err, size_t(errlen), "%s", msg);
  return 1;
}

}  // namespace

KN_API int kn_best_isa() { return kn::best_isa(); }
KN_API int kn_active_isa() { return kn::active_isa(); }
KN_API int kn_isa_supported(int isa) { return kn::isa_supported(kn::Isa(isa)); }
KN_API int64_t kn_row_bytes(int fmt, int64_t K) { return kn::row_bytes(fmt, K); }

// glu.h on a chosen path, one thread: y[i] = silu(g[i]) * u[i].
KN_API int kn_swiglu(const float* g, const float* u, int64_t n, float* y, int isa, char* err,
                     int errlen) {
  if (isa < kn::ISA_SCALAR || isa > kn::ISA_AVX512) return fail("unknown ISA", err, errlen);
  if (!kn::isa_supported(kn::Isa(isa))) return fail("this CPU lacks the instruction set asked for", err, errlen);
  if (n < 0) return fail("swiglu: negative length", err, errlen);
  kn::swiglu_isa(g, u, n, y, isa);
  return 0;
}

KN_API int kn_hadamard(const float* x, float* y, int64_t rows, int64_t width, int64_t n,
                       char* err, int errlen) {
  if (const char* e = kn::hadamard_rows(x, y, rows, width, n)) return fail(e, err, errlen);
  return 0;
}

KN_API int kn_qmatmul(int fmt, const uint8_t* w, int64_t N, int64_t K, const float* x,
                      int64_t M, float* y, int isa, int threads, char* err, int errlen) {
  if (isa < kn::ISA_SCALAR || isa > kn::ISA_AVX512) return fail("unknown ISA", err, errlen);
  if (threads < 1) threads = 1;
  const char* e = kn::qmatmul(fmt, w, N, K, x, M, y, kn::Isa(isa), threads,
                              threads > 1 ? kn::thread_schedule() : kn::Schedule());
  return e ? fail(e, err, errlen) : 0;
}

// qmatmul_api.h qmatmul_rows with one part: y [M, N] gets the rows m with live[m] != 0;
// its other rows are left as they were.
KN_API int kn_qmatmul_rows(int fmt, const uint8_t* w, int64_t N, int64_t K, const float* x,
                           int64_t M, const int32_t* live, float* y, int isa, int threads,
                           char* err, int errlen) {
  if (isa < kn::ISA_SCALAR || isa > kn::ISA_AVX512) return fail("unknown ISA", err, errlen);
  if (threads < 1) threads = 1;
  const kn::MatmulPart part{fmt, w, N, y};
  const char* e = kn::qmatmul_rows(&part, 1, K, x, M, live, kn::Isa(isa), threads,
                                   threads > 1 ? kn::thread_schedule() : kn::Schedule());
  return e ? fail(e, err, errlen) : 0;
}

// qmatmul_api.h qmatmul_id with one part: y [rows * share, N]; expert e's weight starts
// e * stride bytes after w.
KN_API int kn_qmatmul_id(int fmt, const uint8_t* w, int64_t stride, int64_t n_expert,
                         int64_t N, int64_t K, const float* x, int64_t rows,
                         const int32_t* ids, int64_t share, float* y, int isa, int threads,
                         char* err, int errlen) {
  if (isa < kn::ISA_SCALAR || isa > kn::ISA_AVX512) return fail("unknown ISA", err, errlen);
  if (const char* e = kn::check_matmul(fmt, N, K, 1)) return fail(e, err, errlen);
  if (stride < N * kn::row_bytes(fmt, K))
    return fail("qmatmul_id: the experts' stride is less than one expert's bytes", err, errlen);
  if (threads < 1) threads = 1;
  const kn::MatmulPart part{fmt, w, N, y};
  const char* e = kn::qmatmul_id(&part, &stride, 1, n_expert, K, x, rows, ids, rows * share,
                                 share, kn::Isa(isa), threads,
                                 threads > 1 ? kn::thread_schedule() : kn::Schedule());
  return e ? fail(e, err, errlen) : 0;
}

// delta_rule.h on host arrays, on a chosen path: shape = C, H, Hk, d, taps, S, P, K1, T, R;
// rows [4, T] (read, write, slot, pend), replay [2, R] (slot, idx).
KN_API int kn_delta_rule(const int64_t* shape, float eps, const float* taps, float* windows,
                         float* matrices, float* pending, const float* events,
                         const int32_t* rows, const int32_t* replay, int64_t n_replay,
                         float* out, int isa, int threads, char* err, int errlen) {
  if (isa < kn::ISA_SCALAR || isa > kn::ISA_AVX512) return fail("unknown ISA", err, errlen);
  const kn::DeltaShape s{shape[0], shape[1], shape[2], shape[3], shape[4], shape[5],
                         shape[6], shape[7], shape[8], shape[9], eps};
  const char* e = kn::delta_rule(s, taps, windows, matrices, pending, events, rows,
                                 rows + s.T, rows + 2 * s.T, rows + 3 * s.T, replay,
                                 replay + s.R, n_replay, out, kn::Isa(isa),
                                 threads < 1 ? 1 : threads);
  return e ? fail(e, err, errlen) : 0;
}

KN_API int kn_dequant_rows(int fmt, const uint8_t* w, int64_t N, int64_t K, const int32_t* rows,
                           int64_t n_rows, float* out, char* err, int errlen) {
  const char* e = kn::dequant_rows(fmt, w, N, K, rows, n_rows, out);
  return e ? fail(e, err, errlen) : 0;
}

// repack.h: N rows of K values of plain format fmt rearranged in place into the 16-column
// layout (format id fmt | kn::kRepack16).
KN_API int kn_repack16(int fmt, uint8_t* w, int64_t N, int64_t K, char* err, int errlen) {
  const char* e = kn::repack16(fmt, w, N, K);
  return e ? fail(e, err, errlen) : 0;
}

// lazyzero.h on a host buffer: the bytes handed back to the system (the rest was memset).
KN_API int64_t kn_lazy_zero(void* p, int64_t bytes) {
  return bytes > 0 ? int64_t(kn::lazy_zero(p, size_t(bytes))) : 0;
}

// lazyzero.h release_pages on a host address: the bytes handed back to the system.
KN_API int64_t kn_release_pages(void* p, int64_t bytes) {
  return bytes > 0 ? int64_t(kn::release_pages(p, size_t(bytes))) : 0;
}

// float_json.h: x[0..n) as a JSON list into out (cap characters); the characters written, -1
// if a value is not finite, -2 if cap is short of 2 + n * kn::kJsonFloatChars.
KN_API int64_t kn_json_floats(const float* x, int64_t n, char* out, int64_t cap) {
  if (n < 0 || cap < 2 || (cap - 2) / int64_t(kn::kJsonFloatChars) < n) return -2;
  return kn::json_floats(x, size_t(n), out);
}
