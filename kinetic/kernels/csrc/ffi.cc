// XLA FFI handlers: check what XLA hands over, then call the plain functions of
// qmatmul_api.h. A bad shape is an ffi::Error with a message, never an abort.
//
//   kinetic_qmatmul(x f32[M, K], w u8[bytes]; fmt, offset, n, k) -> y f32[M, n]
//     the weight is n rows of k values in GGUF block format `fmt`, starting `offset` bytes
//     into w (w is the whole memory-mapped GGUF file: one buffer, never a copy per tensor)
//   kinetic_dequant_rows(rows s32[T], w u8[bytes]; fmt, offset, n, k) -> out f32[T, k]
#include <string>

#include "qmatmul_api.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error check_weight(const ffi::Buffer<ffi::U8>& w, int64_t fmt, int64_t offset, int64_t n,
                        int64_t k) {
  if (!kn::format_info(int(fmt)))
    return ffi::Error::InvalidArgument("kinetic_qmatmul: unsupported weight format " +
                                       std::to_string(fmt));
  if (const char* e = kn::check_matmul(int(fmt), n, k, 1))
    return ffi::Error::InvalidArgument(std::string("kinetic_qmatmul: ") + e);
  const int64_t need = offset + n * kn::row_bytes(int(fmt), k);
  if (offset < 0 || need > int64_t(w.element_count()))
    return ffi::Error::InvalidArgument("kinetic_qmatmul: the weight lies outside its buffer");
  return ffi::Error::Success();
}

ffi::Error QMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                   ffi::ResultBuffer<ffi::F32> y, int64_t fmt, int64_t offset, int64_t n,
                   int64_t k) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || xd[1] != k)
    return ffi::Error::InvalidArgument("kinetic_qmatmul: x must be [M, K] with K = " +
                                       std::to_string(k));
  if (ffi::Error e = check_weight(w, fmt, offset, n, k); e.failure()) return e;
  auto yd = y->dimensions();
  if (yd.size() != 2 || yd[0] != xd[0] || yd[1] != n)
    return ffi::Error::InvalidArgument("kinetic_qmatmul: y must be [M, N]");
  const int threads = int(std::max<int64_t>(1, pool.num_threads()));
  kn::Schedule schedule = [&pool](std::function<void()> task) { pool.Schedule(std::move(task)); };
  const char* err = kn::qmatmul(int(fmt), w.typed_data() + offset, n, k, x.typed_data(), xd[0],
                                y->typed_data(), kn::active_isa(), threads, schedule);
  if (err) return ffi::Error::InvalidArgument(std::string("kinetic_qmatmul: ") + err);
  return ffi::Error::Success();
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
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("fmt")
                                  .Attr<int64_t>("offset")
                                  .Attr<int64_t>("n")
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
