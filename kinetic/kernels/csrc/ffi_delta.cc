// XLA FFI handler of delta_rule.h: a step's rows through the gated delta rule, the states
// updated in place.
//
//   kinetic_delta_rule(taps f32[C, taps], windows f32[S, taps - 1, C], matrices f32[S, H, d, d],
//                      pending f32[P, K1, E], events f32[T, E], rows s32[4, T] (read, write,
//                      slot, pend), replay s32[2, R] (slot, idx), n_replay s32[1]; hk, eps)
//     -> (out f32[T, H, d], windows, matrices, pending)   the last three alias their
//                                                           arguments (input_output_aliases)
// A bad shape or index is an ffi::Error with a message, never an abort or a stray write.
#include <cstring>
#include <string>

#include "delta_rule.h"
#include "pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error bad(const std::string& msg) {
  return ffi::Error::InvalidArgument("kinetic_delta_rule: " + msg);
}

// The result holds its argument's values (XLA may not have aliased the two: copy then).
void hold(const ffi::Buffer<ffi::F32>& arg, ffi::Result<ffi::Buffer<ffi::F32>>& res) {
  if (res->typed_data() != arg.typed_data())
    std::memcpy(res->typed_data(), arg.typed_data(), arg.size_bytes());
}

ffi::Error DeltaRule(ffi::Buffer<ffi::F32> taps, ffi::Buffer<ffi::F32> windows,
                     ffi::Buffer<ffi::F32> matrices, ffi::Buffer<ffi::F32> pending,
                     ffi::Buffer<ffi::F32> events, ffi::Buffer<ffi::S32> rows,
                     ffi::Buffer<ffi::S32> replay, ffi::Buffer<ffi::S32> n_replay,
                     ffi::Result<ffi::Buffer<ffi::F32>> out,
                     ffi::Result<ffi::Buffer<ffi::F32>> windows_out,
                     ffi::Result<ffi::Buffer<ffi::F32>> matrices_out,
                     ffi::Result<ffi::Buffer<ffi::F32>> pending_out, int64_t hk, float eps) {
  auto td = taps.dimensions(), wd = windows.dimensions(), md = matrices.dimensions(),
       pd = pending.dimensions(), ed = events.dimensions(), rd = rows.dimensions(),
       pl = replay.dimensions();
  if (td.size() != 2 || wd.size() != 3 || md.size() != 4 || pd.size() != 3 || ed.size() != 2 ||
      rd.size() != 2 || pl.size() != 2 || n_replay.element_count() != 1)
    return bad("arguments of the wrong rank");
  kn::DeltaShape s{td[0], md[1], hk, md[2], td[1], md[0], pd[0], pd[1], ed[0], pl[1], eps};
  if (md[3] != s.d || wd[0] != s.S || wd[1] != s.taps - 1 || wd[2] != s.C ||
      ed[1] != s.C + 2 * s.H || pd[2] != ed[1] || rd[0] != 4 || rd[1] != s.T || pl[0] != 2)
    return bad("shapes that do not fit together");
  auto od = out->dimensions();
  if (od.size() != 3 || od[0] != s.T || od[1] != s.H || od[2] != s.d)
    return bad("out must be [T, H, d]");
  if (windows_out->size_bytes() != windows.size_bytes() ||
      matrices_out->size_bytes() != matrices.size_bytes() ||
      pending_out->size_bytes() != pending.size_bytes())
    return bad("each state result must be its argument's size");
  hold(windows, windows_out);
  hold(matrices, matrices_out);
  hold(pending, pending_out);
  const int32_t* r = rows.typed_data();
  const int32_t* p = replay.typed_data();
  if (const char* e = kn::delta_rule(s, taps.typed_data(), windows_out->typed_data(),
                                     matrices_out->typed_data(), pending_out->typed_data(),
                                     events.typed_data(), r, r + s.T, r + 2 * s.T, r + 3 * s.T,
                                     p, p + s.R, n_replay.typed_data()[0], out->typed_data(),
                                     kn::active_isa(), kn::pool_threads()))
    return bad(e);
  return ffi::Error::Success();
}

}  // namespace

#pragma GCC visibility push(default)

XLA_FFI_DEFINE_HANDLER_SYMBOL(kinetic_delta_rule, DeltaRule,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("hk")
                                  .Attr<float>("eps"));

#pragma GCC visibility pop
