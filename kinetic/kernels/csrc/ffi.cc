// XLA FFI handlers: check what XLA hands over, then call the plain functions of
// qmatmul_api.h. A bad shape is an ffi::Error with a message, never an abort.
//
//   kinetic_qmatmul(x f32[M, K], w u8[bytes]; fmts, offsets, ns, k) -> y_p f32[M, n_p], ...
//     weight p is n_p rows of k values in GGUF block format fmts[p], starting offsets[p]
//     bytes into w (w is the whole memory-mapped GGUF file: one buffer, never a copy per
//     tensor); several weights that read the same x go through one call
//   kinetic_qmatmul_rows(x, w, live s32[M]; as kinetic_qmatmul) -> the same, computed for
//     the rows m with live[m] != 0 only, every other row unwritten (a step's sampled rows)
//   kinetic_dequant_rows(rows s32[T], w u8[bytes]; fmt, offset, n, k) -> out f32[T, k]
#include <algorithm>
#include <string>
#include <vector>

#include "ffi_util.h"
#include "qmatmul_api.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error check_weight(const ffi::Buffer<ffi::U8>& w, int64_t fmt, int64_t offset, int64_t n,
                        int64_t k) {
  if (const char* e = kn::check_matmul(int(fmt), n, k, 1))
    return ffi::Error::InvalidArgument(std::string("kinetic_qmatmul: ") + e);
  const int64_t need = offset + n * kn::row_bytes(int(fmt), k);
  if (offset < 0 || need > int64_t(w.element_count()))
    return ffi::Error::InvalidArgument("kinetic_qmatmul: the weight lies outside its buffer");
  return ffi::Error::Success();
}

// The parts of one kinetic_qmatmul call, checked against x [M, K]; bytes: the weight bytes
// the call reads.
ffi::Error matmul_parts(const ffi::Buffer<ffi::F32>& x, const ffi::Buffer<ffi::U8>& w,
                        ffi::RemainingRets& ys, ffi::Span<const int64_t> fmts,
                        ffi::Span<const int64_t> offsets, ffi::Span<const int64_t> ns, int64_t k,
                        std::vector<kn::MatmulPart>& list, int64_t& bytes) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || xd[1] != k)
    return ffi::Error::InvalidArgument("kinetic_qmatmul: x must be [M, K] with K = " +
                                       std::to_string(k));
  const size_t parts = fmts.size();
  if (offsets.size() != parts || ns.size() != parts || ys.size() != parts || parts == 0)
    return ffi::Error::InvalidArgument("kinetic_qmatmul: one format, offset, n and result per "
                                       "weight");
  bytes = 0;
  for (size_t p = 0; p < parts; ++p) {
    if (ffi::Error e = check_weight(w, fmts[p], offsets[p], ns[p], k); e.failure()) return e;
    auto y = ys.get<ffi::Buffer<ffi::F32>>(p);
    if (y.has_error()) return y.error();
    auto yd = (*y)->dimensions();
    if (yd.size() != 2 || yd[0] != xd[0] || yd[1] != ns[p])
      return ffi::Error::InvalidArgument("kinetic_qmatmul: each result must be [M, N]");
    list.push_back({int(fmts[p]), w.typed_data() + offsets[p], ns[p], (*y)->typed_data()});
    bytes += ns[p] * kn::row_bytes(int(fmts[p]), k);
  }
  return ffi::Error::Success();
}

// Both matmul handlers: the parts checked, then every row of x (live nullptr, qmatmul_parts)
// or the rows whose live flag is set (qmatmul_rows; live_count flags, which must be M).
ffi::Error run_matmul(const char* name, const ffi::Buffer<ffi::F32>& x,
                      const ffi::Buffer<ffi::U8>& w, ffi::RemainingRets& ys,
                      ffi::Span<const int64_t> fmts, ffi::Span<const int64_t> offsets,
                      ffi::Span<const int64_t> ns, int64_t k, const int32_t* live,
                      int64_t live_count) {
  std::vector<kn::MatmulPart> list;
  int64_t bytes = 0;
  if (ffi::Error e = matmul_parts(x, w, ys, fmts, offsets, ns, k, list, bytes); e.failure())
    return e;
  const int64_t M = x.dimensions()[0];
  if (live && live_count != M)
    return ffi::Error::InvalidArgument(std::string(name) + ": live must be [M]");
  const int64_t rows = live ? std::count_if(live, live + M, [](int32_t f) { return f != 0; }) : M;
  const int threads = kn::matmul_threads(bytes, rows);
  const char* err =
      live ? kn::qmatmul_rows(list.data(), int(list.size()), k, x.typed_data(), M, live,
                              kn::active_isa(), threads, kn::Schedule())
           : kn::qmatmul_parts(list.data(), int(list.size()), k, x.typed_data(), M,
                               kn::active_isa(), threads, kn::Schedule());
  if (err) return ffi::Error::InvalidArgument(std::string(name) + ": " + err);
  return ffi::Error::Success();
}

ffi::Error QMatmul(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                   ffi::RemainingRets ys, ffi::Span<const int64_t> fmts,
                   ffi::Span<const int64_t> offsets, ffi::Span<const int64_t> ns, int64_t k) {
  return run_matmul("kinetic_qmatmul", x, w, ys, fmts, offsets, ns, k, nullptr, 0);
}

// kinetic_qmatmul over the rows whose live flag is set (kn::qmatmul_rows); the others are
// not written.
ffi::Error QMatmulRows(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                       ffi::Buffer<ffi::S32> live, ffi::RemainingRets ys,
                       ffi::Span<const int64_t> fmts, ffi::Span<const int64_t> offsets,
                       ffi::Span<const int64_t> ns, int64_t k) {
  return run_matmul("kinetic_qmatmul_rows", x, w, ys, fmts, offsets, ns, k, live.typed_data(),
                    int64_t(live.element_count()));
}

ffi::Error DequantRows(ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::U8> w,
                       ffi::ResultBuffer<ffi::F32> out, int64_t fmt, int64_t offset, int64_t n,
                       int64_t k) {
  if (ffi::Error e = check_weight(w, fmt, offset, n, k); e.failure()) return e;
  const int64_t t = int64_t(rows.element_count());
  auto od = out->dimensions();
  if (od.size() != 2 || od[0] != t || od[1] != k)
    return ffi::Error::InvalidArgument("kinetic_dequant_rows: out must be [T, K]");
  const char* err = kn::dequant_rows(int(fmt), w.typed_data() + offset, n, k, rows.typed_data(),
                                     t, out->typed_data());
  if (err) return ffi::Error::InvalidArgument(std::string("kinetic_dequant_rows: ") + err);
  return ffi::Error::Success();
}

}  // namespace

// The library is built with -fvisibility=hidden; the handlers are what Python looks up.
#pragma GCC visibility push(default)

XLA_FFI_DEFINE_HANDLER_SYMBOL(kinetic_qmatmul, QMatmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("fmts")
                                  .Attr<ffi::Span<const int64_t>>("offsets")
                                  .Attr<ffi::Span<const int64_t>>("ns")
                                  .Attr<int64_t>("k"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kinetic_qmatmul_rows, QMatmulRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("fmts")
                                  .Attr<ffi::Span<const int64_t>>("offsets")
                                  .Attr<ffi::Span<const int64_t>>("ns")
                                  .Attr<int64_t>("k"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kinetic_dequant_rows, DequantRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("fmt")
                                  .Attr<int64_t>("offset")
                                  .Attr<int64_t>("n")
                                  .Attr<int64_t>("k"));

#pragma GCC visibility pop
