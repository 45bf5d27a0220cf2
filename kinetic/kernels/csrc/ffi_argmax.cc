// XLA FFI handler of argmax.h:
//   kinetic_row_argmax(x f32[B, V], ids s32[B, W], values f32[B, W], mask s32[B, M]) -> s32[B]
// M is ceil(V / 32), or 0 for rows that allow every token.
#include <limits>

#include "argmax.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error RowArgmax(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids,
                     ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::S32> mask,
                     ffi::ResultBuffer<ffi::S32> out) {
  auto xd = x.dimensions(), id = ids.dimensions(), vd = values.dimensions();
  auto md = mask.dimensions();
  if (xd.size() != 2)
    return ffi::Error::InvalidArgument("kinetic_row_argmax: x must be [B, V]");
  if (xd[1] > std::numeric_limits<int32_t>::max())
    return ffi::Error::InvalidArgument("kinetic_row_argmax: V must fit an int32 index");
  if (id.size() != 2 || vd.size() != 2 || id[0] != xd[0] || vd[0] != xd[0] || id[1] != vd[1])
    return ffi::Error::InvalidArgument("kinetic_row_argmax: ids and values must be [B, W]");
  if (md.size() != 2 || md[0] != xd[0] || (md[1] != 0 && md[1] != (xd[1] + 31) / 32))
    return ffi::Error::InvalidArgument(
        "kinetic_row_argmax: the mask must be [B, ceil(V / 32)] or [B, 0]");
  if (int64_t(out->element_count()) != xd[0])
    return ffi::Error::InvalidArgument("kinetic_row_argmax: the result must be [B]");
  const auto* words = md[1] ? reinterpret_cast<const uint32_t*>(mask.typed_data()) : nullptr;
  kn::row_argmax(x.typed_data(), xd[0], xd[1], ids.typed_data(), values.typed_data(), id[1],
                 words, out->typed_data());
  return ffi::Error::Success();
}

}  // namespace

#pragma GCC visibility push(default)

XLA_FFI_DEFINE_HANDLER_SYMBOL(kinetic_row_argmax, RowArgmax,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

#pragma GCC visibility pop
