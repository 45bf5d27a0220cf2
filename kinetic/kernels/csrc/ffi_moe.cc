// XLA FFI handler of a mixture of experts' projections (qmatmul_api.h, qmatmul_id):
//
//   kinetic_qmatmul_id(x f32[R, K], w u8[bytes], ids s32[P]; fmts, offsets, strides, ns, k,
//                      n_expert, share) -> y_j f32[P, n_j], ...
//     P = R * share pairs; pair p multiplies x's row p / share by expert ids[p]'s weight of
//     part j: n_j rows of k values in format fmts[j], starting offsets[j] + ids[p] *
//     strides[j] bytes into w (the whole memory-mapped GGUF file). Several parts that read
//     the same x (an expert's gate and up) go through one call.
// A bad shape or an expert id out of range is an ffi::Error with a message, never an abort.
#include <string>
#include <vector>

#include "ffi_util.h"
#include "qmatmul_api.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error Fail(const std::string& what) {
  return ffi::Error::InvalidArgument("kinetic_qmatmul_id: " + what);
}

ffi::Error QMatmulId(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::S32> ids,
                     ffi::RemainingRets ys, ffi::Span<const int64_t> fmts,
                     ffi::Span<const int64_t> offsets, ffi::Span<const int64_t> strides,
                     ffi::Span<const int64_t> ns, int64_t k, int64_t n_expert, int64_t share) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || xd[1] != k) return Fail("x must be [R, K] with K = " + std::to_string(k));
  const size_t parts = fmts.size();
  if (parts == 0 || offsets.size() != parts || strides.size() != parts || ns.size() != parts ||
      ys.size() != parts)
    return Fail("one format, offset, stride, n and result per weight");
  if (n_expert < 1 || share < 1) return Fail("n_expert and share must be at least 1");
  const int64_t pairs = int64_t(ids.element_count());
  if (pairs != xd[0] * share) return Fail("ids must hold R * share expert ids");
  std::vector<kn::MatmulPart> list;
  int64_t bytes = 0;
  for (size_t j = 0; j < parts; ++j) {
    if (const char* e = kn::check_matmul(int(fmts[j]), ns[j], k, 1)) return Fail(e);
    const int64_t one = ns[j] * kn::row_bytes(int(fmts[j]), k);
    if (offsets[j] < 0 || strides[j] < one ||
        offsets[j] + (n_expert - 1) * strides[j] + one > int64_t(w.element_count()))
      return Fail("an expert's weight lies outside its buffer");
    auto y = ys.get<ffi::Buffer<ffi::F32>>(j);
    if (y.has_error()) return y.error();
    auto yd = (*y)->dimensions();
    if (yd.size() != 2 || yd[0] != pairs || yd[1] != ns[j])
      return Fail("each result must be [P, N]");
    list.push_back({int(fmts[j]), w.typed_data() + offsets[j], ns[j], (*y)->typed_data()});
    bytes += one;
  }
  const int threads = kn::matmul_threads(bytes, pairs);
  if (const char* e = kn::qmatmul_id(list.data(), strides.begin(), int(parts), n_expert, k,
                                     x.typed_data(), xd[0], ids.typed_data(), pairs, share,
                                     kn::active_isa(), threads, kn::Schedule()))
    return Fail(e);
  return ffi::Error::Success();
}

}  // namespace

#pragma GCC visibility push(default)

XLA_FFI_DEFINE_HANDLER_SYMBOL(kinetic_qmatmul_id, QMatmulId,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("fmts")
                                  .Attr<ffi::Span<const int64_t>>("offsets")
                                  .Attr<ffi::Span<const int64_t>>("strides")
                                  .Attr<ffi::Span<const int64_t>>("ns")
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("n_expert")
                                  .Attr<int64_t>("share"));

#pragma GCC visibility pop
