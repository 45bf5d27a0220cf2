// C ABI of the attention kernel (attention.h), for tests and benchmarks through ctypes, in
// capi.cc's style: returns 0, or 1 with a message in err; never aborts.
#include <cstdio>

#include "attention.h"
#include "qmatmul_api.h"  // thread_schedule()

#define KN_API extern "C" __attribute__((visibility("default")))

// q f32[T, H, Q]; k [pages, page_size, K, Q] and v [pages, page_size, K, Qv] in GGML types
// k_fmt / v_fmt (0 F32, 1 F16, 30 BF16); page_table s32[S, P]; slots, positions s32[T];
// ends s32[T] (each row's last visible key) or null (the positions); out f32[T, H, Qv].
// isa: 0 scalar, 1 avx2, 2 avx512; threads >= 1; max_group: most rows of a prompt chunk in
// one unit (attention.h; 1: every row on its own, 0: the default).
KN_API int kn_attention(const float* q, int64_t T, int64_t H, int64_t Q, const void* k, int k_fmt,
                        const void* v, int v_fmt, int64_t num_pages, int64_t page_size, int64_t K,
                        int64_t Qv, const int32_t* page_table, int64_t S, int64_t P,
                        const int32_t* slots, const int32_t* positions, const int32_t* ends,
                        float scale, int64_t window, float softcap, float* out, int isa,
                        int threads, int max_group, char* err, int errlen) {
  auto fail = [&](const char* msg) {
    if (err && errlen > 0) std::snprintf(err, size_t(errlen), "%s", msg);
    return 1;
  };
  if (isa < kn::ISA_SCALAR || isa > kn::ISA_AVX512) return fail("unknown ISA");
  if (threads < 1) threads = 1;
  kn::AttnArgs a{};
  a.q = q; a.k = k; a.v = v; a.k_fmt = k_fmt; a.v_fmt = v_fmt;
  a.page_table = page_table; a.slots = slots; a.positions = positions; a.ends = ends;
  a.out = out;
  a.T = T; a.H = H; a.K = K; a.Q = Q; a.Qv = Qv;
  a.num_pages = num_pages; a.page_size = page_size; a.S = S; a.P = P;
  a.scale = scale; a.window = window; a.softcap = softcap;
  const char* e = kn::attention(a, kn::Isa(isa), threads,
                                threads > 1 ? kn::thread_schedule() : kn::Schedule(),
                                max_group > 0 ? max_group : kn::ATTN_MAX_GROUP);
  return e ? fail(e) : 0;
}
