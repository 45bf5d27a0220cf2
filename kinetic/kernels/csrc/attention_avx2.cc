// AVX2 path of the attention kernel: attention_impl.h with 8 lanes, and F16C's half -> float
// for half caches. The headers come before the target pragma so that their inline
// functions stay baseline x86-64 (attention_impl.h).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "attention.h"
#include "common.h"
#include "quantize.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define KN_ATTN_W 8
#define KN_ATTN_UNIT attention_unit_avx2
#include "attention_impl.h"
#pragma GCC pop_options
#else  // no such path off x86: isa_supported() never admits it; keep the symbol defined
namespace kn {
void attention_unit_avx2(const AttnArgs& a, int64_t t0, int64_t R, int64_t kh,
                         float* scratch, int64_t* rows) {
  attention_unit_scalar(a, t0, R, kh, scratch, rows);
}
}  // namespace kn
#endif
