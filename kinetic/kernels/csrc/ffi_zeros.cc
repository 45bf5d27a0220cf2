// XLA FFI handler of lazyzero.h: a buffer of zeros whose memory is taken as it is written.
//
//   kinetic_lazy_zeros() -> out (any shape and type)
// jnp.zeros would fill the buffer, committing every page of it; this drops its whole pages
// instead (they read as zeros), so a KV cache allocated at start costs memory only for the
// pages the engine writes.
#include "lazyzero.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error LazyZeros(ffi::Result<ffi::AnyBuffer> out) {
  kn::lazy_zero(out->untyped_data(), out->size_bytes());
  return ffi::Error::Success();
}

}  // namespace

#pragma GCC visibility push(default)

XLA_FFI_DEFINE_HANDLER_SYMBOL(kinetic_lazy_zeros, LazyZeros,
                              ffi::Ffi::Bind().Ret<ffi::AnyBuffer>());

#pragma GCC visibility pop
