// XLA FFI handler of kvwrite.h: the step's new keys and values into the KV cache, in place.
//
//   kinetic_kv_write(k_cache [pages, page_size, K, Q], v_cache [pages, page_size, K, Qv],
//                    k f32[T, K, Q], v f32[T, K, Qv], index s32[T])
//     (a q8_0 cache: uint8 [pages, page_size, K, Q / 32 * 34], common.h)
//     -> (k_cache, v_cache)      each result aliases its cache argument (ffi_call's
//                                input_output_aliases), so nothing is copied
// Row t goes to the cache's flat row index[t] (page * page_size + offset). An index outside
// the cache is an ffi::Error, never a write out of bounds.
#include <cstring>
#include <string>

#include "common.h"
#include "kvwrite.h"
#include "ffi_util.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error bad(const std::string& msg) {
  return ffi::Error::InvalidArgument("kinetic_kv_write: " + msg);
}


// One cache: check the shapes, make the result hold the cache (when XLA did not alias the
// two, copy it first), then write the rows.
ffi::Error write_one(const ffi::AnyBuffer& cache, ffi::Result<ffi::AnyBuffer>& out,
                     const ffi::Buffer<ffi::F32>& src, const ffi::Buffer<ffi::S32>& index,
                     const char* name) {
  auto cd = cache.dimensions(), sd = src.dimensions();
  if (cd.size() != 4) return bad(std::string(name) + "_cache must be [pages, page_size, K, Q]");
  const int fmt = kn::cache_fmt(cache.element_type());
  if (fmt < 0 || out->element_type() != cache.element_type() ||
      out->size_bytes() != cache.size_bytes())
    return bad("the caches must be float32, float16, bfloat16 or q8_0 (uint8), each result "
               "its cache");
  if (sd.size() != 3 || sd[1] != cd[2] || kn::cache_row_width(fmt, sd[2]) != cd[3])
    return bad(std::string(name) + " must be [T, K, Q] with the cache's K and Q");
  if (int64_t(index.element_count()) != sd[0]) return bad("index must be [T]");
  if (out->untyped_data() != cache.untyped_data())
    std::memcpy(out->untyped_data(), cache.untyped_data(), cache.size_bytes());
  if (const char* e = kn::kv_write(out->untyped_data(), fmt, cd[0] * cd[1], cd[2] * sd[2],
                                   src.typed_data(), index.typed_data(), sd[0]))
    return bad(e);
  return ffi::Error::Success();
}

ffi::Error KvWrite(ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::Buffer<ffi::F32> k,
                   ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> index,
                   ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  if (ffi::Error e = write_one(k_cache, k_out, k, index, "k"); e.failure()) return e;
  return write_one(v_cache, v_out, v, index, "v");
}

}  // namespace

#pragma GCC visibility push(default)

XLA_FFI_DEFINE_HANDLER_SYMBOL(kinetic_kv_write, KvWrite,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

#pragma GCC visibility pop
