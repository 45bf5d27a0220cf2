// XLA FFI handlers of rownorm.h:
//   kinetic_rms_norm(x f32[..., D], w f32[D]; eps) -> y f32[..., D]
//   kinetic_layer_norm(x f32[..., D], w f32[D], b f32[D]; eps) -> y f32[..., D]
//   kinetic_cos_sin(theta f32[...]) -> (cos f32[...], sin f32[...])
// of glu.h:
//   kinetic_swiglu(gate f32[...], up f32[...]) -> silu(gate) * up f32[...]
// and of hadamard.h:
//   kinetic_hadamard(x f32[..., D]; n) -> each block of n of the last axis rotated
#include <string>

#include "glu.h"
#include "hadamard.h"
#include "rownorm.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error RmsNorm(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                   ffi::ResultBuffer<ffi::F32> y, float eps) {
  auto xd = x.dimensions();
  if (xd.size() < 1 || w.dimensions().size() != 1 || w.dimensions()[0] != xd.back())
    return ffi::Error::InvalidArgument("kinetic_rms_norm: w must be [D] for x [..., D]");
  const int64_t d = xd.back(), rows = d ? int64_t(x.element_count()) / d : 0;
  if (int64_t(y->element_count()) != rows * d)
    return ffi::Error::InvalidArgument("kinetic_rms_norm: y must have x's shape");
  kn::rms_norm_rows(x.typed_data(), w.typed_data(), rows, d, eps, y->typed_data());
  return ffi::Error::Success();
}

ffi::Error LayerNorm(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> b,
                     ffi::ResultBuffer<ffi::F32> y, float eps) {
  auto xd = x.dimensions();
  if (xd.size() < 1 || w.dimensions().size() != 1 || w.dimensions()[0] != xd.back() ||
      b.dimensions().size() != 1 || b.dimensions()[0] != xd.back())
    return ffi::Error::InvalidArgument("kinetic_layer_norm: w and b must be [D] for x [..., D]");
  const int64_t d = xd.back(), rows = d ? int64_t(x.element_count()) / d : 0;
  if (int64_t(y->element_count()) != rows * d)
    return ffi::Error::InvalidArgument("kinetic_layer_norm: y must have x's shape");
  kn::layer_norm_rows(x.typed_data(), w.typed_data(), b.typed_data(), rows, d, eps,
                      y->typed_data());
  return ffi::Error::Success();
}

ffi::Error CosSin(ffi::Buffer<ffi::F32> theta, ffi::ResultBuffer<ffi::F32> c,
                  ffi::ResultBuffer<ffi::F32> s) {
  const int64_t n = int64_t(theta.element_count());
  if (int64_t(c->element_count()) != n || int64_t(s->element_count()) != n)
    return ffi::Error::InvalidArgument("kinetic_cos_sin: outputs must have theta's shape");
  kn::cos_sin(theta.typed_data(), n, c->typed_data(), s->typed_data());
  return ffi::Error::Success();
}

ffi::Error Swiglu(ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> u,
                  ffi::ResultBuffer<ffi::F32> y) {
  const int64_t n = int64_t(g.element_count());
  if (int64_t(u.element_count()) != n || int64_t(y->element_count()) != n)
    return ffi::Error::InvalidArgument("kinetic_swiglu: gate, up and the result must have one shape");
  kn::swiglu(g.typed_data(), u.typed_data(), n, y->typed_data());
  return ffi::Error::Success();
}

ffi::Error Hadamard(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y, int64_t n) {
  auto d = x.dimensions();
  if (d.size() < 1) return ffi::Error::InvalidArgument("kinetic_hadamard: x must be [..., D]");
  if (y->element_count() != x.element_count())
    return ffi::Error::InvalidArgument("kinetic_hadamard: y must have x's shape");
  const int64_t D = d.back(), rows = D ? int64_t(x.element_count()) / D : 0;
  if (const char* e = kn::hadamard_rows(x.typed_data(), y->typed_data(), rows, D, n))
    return ffi::Error::InvalidArgument(std::string("kinetic_hadamard: ") + e);
  return ffi::Error::Success();
}

}  // namespace

#pragma GCC visibility push(default)

XLA_FFI_DEFINE_HANDLER_SYMBOL(kinetic_rms_norm, RmsNorm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kinetic_layer_norm, LayerNorm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kinetic_cos_sin, CosSin,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(kinetic_hadamard, Hadamard,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("n"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kinetic_swiglu, Swiglu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

#pragma GCC visibility pop
