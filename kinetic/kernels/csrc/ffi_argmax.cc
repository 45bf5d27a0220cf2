// XLA FFI handler of argmax.h:
//   kinetic_row_argmax(x f32[B, V]) -> s32[B]
#include <limits>

#include "argmax.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error RowArgmax(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out) {
  auto xd = x.dimensions();
  if (xd.size() != 2)
    return ffi::Error::InvalidArgument("kinetic_row_argmax: x must be [B, V]");
  if (xd[1] > std::numeric_limits<int32_t>::max())
    return ffi::Error::InvalidArgument("kinetic_row_argmax: V must fit an int32 index");
  if (int64_t(out->element_count()) != xd[0])
    return ffi::Error::InvalidArgument("kinetic_row_argmax: the result must be [B]");
  kn::row_argmax(x.typed_data(), xd[0], xd[1], out->typed_data());
  return ffi::Error::Success();
}

}  // namespace

#pragma GCC visibility push(default)

XLA_FFI_DEFINE_HANDLER_SYMBOL(kinetic_row_argmax, RowArgmax,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

#pragma GCC visibility pop
