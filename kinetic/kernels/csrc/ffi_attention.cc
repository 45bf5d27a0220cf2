// XLA FFI handler of the attention kernel (attention.h): check what XLA hands over, then
// call kn::attention on XLA's thread pool. A bad shape or index is an ffi::Error with a
// message, never an abort or an out-of-bounds read.
//
//   kinetic_attention(q f32[T, H, Q], k_cache [pages, page_size, K, Q],
//                     v_cache [pages, page_size, K, Qv], page_table s32[S, P], slots s32[T],
//                     positions s32[T], ends s32[T]; scale f32, window s64, softcap f32)
//     -> out f32[T, H, Qv]         (the caches: f32, f16, bf16 or q8_0, each on its own; a
//                                  q8_0 cache is uint8 [.., Q / 32 * 34], common.h)
//
// ends: each row's last visible key (attention.h), the positions themselves when causal.
#include <string>

#include "attention.h"
#include "common.h"
#include "ffi_util.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error bad(const std::string& msg) {
  return ffi::Error::InvalidArgument("kinetic_attention: " + msg);
}


ffi::Error Attention(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_cache,
                     ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> page_table,
                     ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> positions,
                     ffi::Buffer<ffi::S32> ends, ffi::ResultBuffer<ffi::F32> out,
                     float scale, int64_t window, float softcap) {
  auto qd = q.dimensions(), kd = k_cache.dimensions(), vd = v_cache.dimensions();
  auto pd = page_table.dimensions(), od = out->dimensions();
  if (qd.size() != 3) return bad("q must be [T, H, Q]");
  if (kd.size() != 4) return bad("k_cache must be [pages, page_size, K, Q]");
  if (vd.size() != 4) return bad("v_cache must be [pages, page_size, K, Qv]");
  if (pd.size() != 2) return bad("page_table must be [S, P]");
  const int k_fmt = kn::cache_fmt(k_cache.element_type());
  const int v_fmt = kn::cache_fmt(v_cache.element_type());
  if (k_fmt < 0 || v_fmt < 0)
    return bad("the caches must be float32, float16, bfloat16 or q8_0 (uint8)");
  const int64_t T = qd[0], H = qd[1], Q = qd[2], K = kd[2], Qv = od.size() == 3 ? od[2] : -1;
  if (kn::cache_row_width(k_fmt, Q) != kd[3]) return bad("k_cache's head width differs from q's");
  if (Qv < 1 || kn::cache_row_width(v_fmt, Qv) != vd[3])
    return bad("v_cache's head width differs from out's");
  if (vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != K)
    return bad("v_cache's pages, page size or kv heads differ from k_cache's");
  if (slots.dimensions().size() != 1 || slots.dimensions()[0] != T ||
      positions.dimensions().size() != 1 || positions.dimensions()[0] != T ||
      ends.dimensions().size() != 1 || ends.dimensions()[0] != T)
    return bad("slots, positions and ends must be [T] with T = q's rows");
  if (od.size() != 3 || od[0] != T || od[1] != H || od[2] != Qv)
    return bad("out must be [T, H, Qv]");
  kn::AttnArgs a{};
  a.q = q.typed_data();
  a.k = k_cache.untyped_data();
  a.v = v_cache.untyped_data();
  a.k_fmt = k_fmt;
  a.v_fmt = v_fmt;
  a.page_table = page_table.typed_data();
  a.slots = slots.typed_data();
  a.positions = positions.typed_data();
  a.ends = ends.typed_data();
  a.out = out->typed_data();
  a.T = T; a.H = H; a.K = K; a.Q = Q; a.Qv = Qv;
  a.num_pages = kd[0]; a.page_size = kd[1]; a.S = pd[0]; a.P = pd[1];
  a.scale = scale; a.window = window; a.softcap = softcap;

  if (const char* e = kn::attention(a, kn::active_isa(), kn::pool_threads(), kn::Schedule()))
    return bad(e);
  return ffi::Error::Success();
}

}  // namespace

// The library is built with -fvisibility=hidden; the handler is what Python looks up.
#pragma GCC visibility push(default)

XLA_FFI_DEFINE_HANDLER_SYMBOL(kinetic_attention, Attention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window")
                                  .Attr<float>("softcap"));

#pragma GCC visibility pop
