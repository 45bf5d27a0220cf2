// The body of one (group of rows, kv head) attention unit (attention.h gives the arithmetic
// and says what a group is), written once over a lane count KN_ATTN_W and compiled by three
// files: attention_scalar.cc (W = 1), attention_avx2.cc (W = 8) and attention_avx512.cc
// (W = 16), the last two under a `#pragma GCC target`. Each includes this file's headers
// (and <immintrin.h>, for the half -> float instructions) *before* its pragma, so that the
// inline functions they define (common.h, the standard library) are emitted for baseline
// x86-64 only; everything here has internal linkage, so no AVX copy can leak to another file.
//
// The lanes only ever hold independent elements (a key's score, a value column), each fed
// the same rounded products and sums in the same order as W = 1, and -ffp-contract=off
// keeps the multiply and the add apart: every path gives the same bits.
//
// No standard-library template is used below (an instantiation made under the pragma could
// be the copy the linker keeps for every file); the scratch memory comes from the caller.
//
// Define before including: KN_ATTN_W (lanes) and KN_ATTN_UNIT (the function's name).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "attention.h"
#include "common.h"
#include "quantize.h"

namespace kn {
namespace {

constexpr int W = KN_ATTN_W;
constexpr int64_t KB = ATTN_KEY_BLOCK;

#if KN_ATTN_W == 1
typedef float V;
#else
typedef float V __attribute__((vector_size(KN_ATTN_W * sizeof(float))));
#endif

inline V load(const float* p) { V v; std::memcpy(&v, p, sizeof(V)); return v; }
inline void store(float* p, V v) { std::memcpy(p, &v, sizeof(V)); }
inline V zero() { V v; std::memset(&v, 0, sizeof(V)); return v; }
#if KN_ATTN_W > 1
typedef uint32_t VU32 __attribute__((vector_size(KN_ATTN_W * sizeof(uint32_t))));
#endif
inline int64_t min64(int64_t x, int64_t y) { return x < y ? x : y; }
inline float max32(float x, float y) { return y > x ? y : x; }

// n halves (f16) or bfloat16s from b as float into buf, exactly. BF16 is a shift, W lanes
// at a time. F16 takes the hardware's half -> float on the SIMD paths (F16C's vcvtph2ps on
// AVX2, its 16-lane AVX-512F form), and common.h's software conversion on the scalar path
// and for the last n % W elements. Both are exact and give the same bits for every half
// but one kind: a signalling NaN, which vcvtph2ps returns quieted (mantissa bit 22 set)
// where the software keeps it signalling. A KV cache never holds one (what XLA's float ->
// half conversion writes is never a signalling NaN), so every path reads a cache alike.
void f16_to_f32_row(const uint8_t* b, int64_t n, float* buf) {
  int64_t i = 0;
#if KN_ATTN_W == 8
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128(
                                  reinterpret_cast<const __m128i_u*>(b + 2 * i))));
#elif KN_ATTN_W == 16
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(buf + i, _mm512_maskz_cvtph_ps(  // all lanes (maskz: no undefined)
                                  __mmask16(0xFFFF), _mm256_loadu_si256(
                                  reinterpret_cast<const __m256i_u*>(b + 2 * i))));
#endif
  for (; i < n; ++i) buf[i] = f16_to_f32(load_u16(b + i * 2));
}

void bf16_to_f32_row(const uint8_t* b, int64_t n, float* buf) {
  int64_t i = 0;
#if KN_ATTN_W > 1
  typedef uint16_t VH __attribute__((vector_size(KN_ATTN_W * sizeof(uint16_t))));
  typedef uint32_t VU __attribute__((vector_size(KN_ATTN_W * sizeof(uint32_t))));
  for (; i + W <= n; i += W) {
    VH h;
    std::memcpy(&h, b + 2 * i, sizeof(VH));
    const VU u = __builtin_convertvector(h, VU) << 16;
    std::memcpy(buf + i, &u, sizeof(VU));
  }
#endif
  for (; i < n; ++i) buf[i] = bf16_to_f32(load_u16(b + i * 2));
}

// n values (a multiple of 32) of Q8_0 blocks from b as float, d * q for each: exact (an f16
// scale's 11 bits times an int8's 8 fit a float's 24).
// The SIMD paths convert W int8 at a time (the same exact products, lane by lane).
void q8_0_to_f32_row(const uint8_t* b, int64_t n, float* buf) {
#if KN_ATTN_W > 1
  typedef int8_t VQ __attribute__((vector_size(KN_ATTN_W)));
#endif
  for (int64_t k = 0; k < n / Q8_0_BLOCK; ++k, b += Q8_0_BYTES) {
    const float d = load_f16(b);
#if KN_ATTN_W > 1
    V dv;
    for (int j = 0; j < W; ++j) dv[j] = d;
    for (int64_t i = 0; i < Q8_0_BLOCK; i += W) {
      VQ q;
      std::memcpy(&q, b + 2 + i, sizeof(VQ));
      store(buf + k * Q8_0_BLOCK + i, dv * __builtin_convertvector(q, V));
    }
#else
    for (int64_t i = 0; i < Q8_0_BLOCK; ++i)
      buf[k * Q8_0_BLOCK + i] = d * float(int8_t(b[2 + i]));
#endif
  }
}

// A cache row of n elements from element `start` of `base` (format fmt) as float: for F32
// a pointer into the cache itself, else converted (exactly) into buf.
const float* row_f32(int fmt, const void* base, int64_t start, int64_t n, float* buf) {
  if (fmt == F32) return static_cast<const float*>(base) + start;
  if (fmt == Q8_0) {
    q8_0_to_f32_row(static_cast<const uint8_t*>(base) + start / Q8_0_BLOCK * Q8_0_BYTES, n, buf);
    return buf;
  }
  const uint8_t* b = static_cast<const uint8_t*>(base) + start * 2;
  if (fmt == F16)
    f16_to_f32_row(b, n, buf);
  else  // BF16 (check_attention admits nothing else)
    bf16_to_f32_row(b, n, buf);
  return buf;
}

// x rounded to the cache's storage type (exact conversions, common.h).
inline float round_to(int fmt, float x) {
  return fmt == F16 ? round_f16(x) : fmt == BF16 ? round_bf16(x) : x;
}

// dst[j] = round_to(fmt, src[j]) * scale for j < n. For a half cache the SIMD paths round
// with F16C (float -> half -> float, round to nearest even: f32_to_f16's bits for every
// number; a NaN keeps part of its payload where the software drops it, and no output bit
// depends on a NaN's payload: a NaN score weighs 0, exp_softmax), the scalar path and the
// last n % W values with common.h's.
// For q8_0 keys the row (a whole number of heads, so of blocks) is quantized in blocks of 32
// as llama.cpp quantizes a query that meets q8_0 keys (quantize.h q8_0_row, the same bits on
// every path), then read back, d * q, and scaled.
void round_scale_row(int fmt, const float* src, int64_t n, float scale, float* dst) {
  if (fmt == Q8_0) {
    for (int64_t b = 0; b < n / Q8_0_BLOCK; ++b) {
      int8_t q[Q8_0_BLOCK];
      float d;
      int32_t sum;
      q8_0_row(src + b * Q8_0_BLOCK, Q8_0_BLOCK, false, q, &d, nullptr, &sum);
      for (int64_t i = 0; i < Q8_0_BLOCK; ++i) dst[b * Q8_0_BLOCK + i] = d * float(q[i]) * scale;
    }
    return;
  }
  int64_t j = 0;
#if KN_ATTN_W == 8
  if (fmt == F16)
    for (; j + 8 <= n; j += 8)
      _mm256_storeu_ps(dst + j, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_cvtps_ph(
          _mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)),
          _mm256_set1_ps(scale)));
#elif KN_ATTN_W == 16
  if (fmt == F16)
    for (; j + 16 <= n; j += 16)
      _mm512_storeu_ps(dst + j, _mm512_mul_ps(_mm512_maskz_cvtph_ps(__mmask16(0xFFFF),
          _mm512_cvtps_ph(_mm512_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)),
          _mm512_set1_ps(scale)));
#endif
#if KN_ATTN_W > 1
  if (fmt == F32)
    for (; j + W <= n; j += W) store(dst + j, load(src + j) * scale);
#endif
  for (; j < n; ++j) dst[j] = round_to(fmt, src[j]) * scale;
}

// kt[j * KB + i] = kp[i][j] for the KB key rows kp of a block: the keys moved to a lane per
// key. Only bits move. With W lanes, W x W tiles go through log2(W) rounds of interleaving
// row i with row i + W/2 (a perfect shuffle; after log2(W) rounds the tile is transposed).
#if KN_ATTN_W > 1
typedef int32_t VI __attribute__((vector_size(KN_ATTN_W * sizeof(int32_t))));
#if KN_ATTN_W == 8
#define KN_ATTN_LO {0, 8, 1, 9, 2, 10, 3, 11}
#define KN_ATTN_HI {4, 12, 5, 13, 6, 14, 7, 15}
constexpr int LOG2W = 3;
#elif KN_ATTN_W == 16
#define KN_ATTN_LO {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23}
#define KN_ATTN_HI {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31}
constexpr int LOG2W = 4;
#endif

// dst[c * ds + r] = src[r][c0 + c] for r, c < W.
inline void transpose_tile(const float* const* src, int64_t c0, float* dst, int64_t ds) {
  const VI lo = KN_ATTN_LO, hi = KN_ATTN_HI;
  V r[W], x[W];
#pragma GCC unroll 16
  for (int i = 0; i < W; ++i) r[i] = load(src[i] + c0);
#pragma GCC unroll 4
  for (int round = 0; round < LOG2W; ++round) {
#pragma GCC unroll 8
    for (int i = 0; i < W / 2; ++i) {
      x[2 * i] = __builtin_shuffle(r[i], r[i + W / 2], lo);
      x[2 * i + 1] = __builtin_shuffle(r[i], r[i + W / 2], hi);
    }
#pragma GCC unroll 16
    for (int i = 0; i < W; ++i) r[i] = x[i];
  }
#pragma GCC unroll 16
  for (int i = 0; i < W; ++i) store(dst + i * ds, r[i]);
}
#endif

// The first nk keys of the block (nk a multiple of W, at most KB): a short last block (a
// short context's only one) moves and scores only the lanes it has.
void transpose_keys(const float* const* kp, int64_t Q, int64_t nk, float* kt) {
  int64_t j0 = 0;
#if KN_ATTN_W > 1
  for (; j0 + W <= Q; j0 += W)
    for (int64_t i0 = 0; i0 < nk; i0 += W) transpose_tile(kp + i0, j0, kt + j0 * KB + i0, KB);
#endif
  for (int64_t j = j0; j < Q; ++j)  // columns past the last whole tile
    for (int64_t i = 0; i < nk; ++i) kt[j * KB + i] = kp[i][j];
}

// s[i] = sum over j in order of qs[j] * kt[j * KB + i], for the first nk keys of a block
// (nk a multiple of W). Four vectors of keys at a time, in registers: four independent
// chains in flight; then the vectors left one at a time (each lane the same chain).
void score_block(const float* qs, const float* kt, int64_t Q, int64_t nk, float* s) {
  static_assert(KB % (4 * W) == 0, "a key block is a whole number of four vectors");
  int64_t u = 0;
  for (; u + 4 * W <= nk; u += 4 * W) {
    V a0 = zero(), a1 = zero(), a2 = zero(), a3 = zero();
    for (int64_t j = 0; j < Q; ++j) {
      const float qj = qs[j];
      const float* r = kt + j * KB + u;
      a0 = a0 + qj * load(r);
      a1 = a1 + qj * load(r + W);
      a2 = a2 + qj * load(r + 2 * W);
      a3 = a3 + qj * load(r + 3 * W);
    }
    store(s + u, a0); store(s + u + W, a1); store(s + u + 2 * W, a2); store(s + u + 3 * W, a3);
  }
  for (; u < nk; u += W) {
    V a0 = zero();
    for (int64_t j = 0; j < Q; ++j) a0 = a0 + qs[j] * load(kt + j * KB + u);
    store(s + u, a0);
  }
}

// score_block for two queries at once (two heads, or a head of two rows): each lane's sum
// is score_block's chain; the two share the loads of kt and keep eight chains in flight.
void score_pair(const float* qa, const float* qb, const float* kt, int64_t Q, int64_t nk,
                float* sa, float* sb) {
  int64_t u = 0;
  for (; u + 4 * W <= nk; u += 4 * W) {
    V a0 = zero(), a1 = zero(), a2 = zero(), a3 = zero();
    V b0 = zero(), b1 = zero(), b2 = zero(), b3 = zero();
    for (int64_t j = 0; j < Q; ++j) {
      const float qaj = qa[j], qbj = qb[j];
      const float* r = kt + j * KB + u;
      const V k0 = load(r), k1 = load(r + W), k2 = load(r + 2 * W), k3 = load(r + 3 * W);
      a0 = a0 + qaj * k0; a1 = a1 + qaj * k1; a2 = a2 + qaj * k2; a3 = a3 + qaj * k3;
      b0 = b0 + qbj * k0; b1 = b1 + qbj * k1; b2 = b2 + qbj * k2; b3 = b3 + qbj * k3;
    }
    store(sa + u, a0); store(sa + u + W, a1); store(sa + u + 2 * W, a2); store(sa + u + 3 * W, a3);
    store(sb + u, b0); store(sb + u + W, b1); store(sb + u + 2 * W, b2); store(sb + u + 3 * W, b3);
  }
  for (; u < nk; u += W) {
    V a0 = zero(), b0 = zero();
    for (int64_t j = 0; j < Q; ++j) {
      const V k0 = load(kt + j * KB + u);
      a0 = a0 + qa[j] * k0;
      b0 = b0 + qb[j] * k0;
    }
    store(sa + u, a0);
    store(sb + u, b0);
  }
}

// o[j] += p[i] * vp[i][j] for i = 0..nb-1 in order: a lane per j, four vectors at a time
// (independent chains), then single vectors, then the last Qv % W columns one by one.
void value_block(const float* p, const float* const* vp, int64_t nb, int64_t Qv, float* o) {
  const int64_t NV = Qv / W;
  int64_t u = 0;
  for (; u + 4 <= NV; u += 4) {
    const int64_t c = u * W;
    V a0 = load(o + c), a1 = load(o + c + W), a2 = load(o + c + 2 * W), a3 = load(o + c + 3 * W);
    for (int64_t i = 0; i < nb; ++i) {
      const float pi = p[i];
      const float* r = vp[i] + c;
      a0 = a0 + pi * load(r);
      a1 = a1 + pi * load(r + W);
      a2 = a2 + pi * load(r + 2 * W);
      a3 = a3 + pi * load(r + 3 * W);
    }
    store(o + c, a0); store(o + c + W, a1); store(o + c + 2 * W, a2); store(o + c + 3 * W, a3);
  }
  for (; u < NV; ++u) {
    V acc = load(o + u * W);
    for (int64_t i = 0; i < nb; ++i) acc = acc + p[i] * load(vp[i] + u * W);
    store(o + u * W, acc);
  }
  for (int64_t j = NV * W; j < Qv; ++j) {
    float acc = o[j];
    for (int64_t i = 0; i < nb; ++i) acc = acc + p[i] * vp[i][j];
    o[j] = acc;
  }
}

// value_block for two weightings of the same value rows (two heads of a row): each column's
// sum is value_block's chain; the two share the loads of the rows.
void value_pair(const float* pa, const float* pb, const float* const* vp, int64_t nb,
                int64_t Qv, float* oa, float* ob) {
  const int64_t NV = Qv / W;
  int64_t u = 0;
  for (; u + 4 <= NV; u += 4) {
    const int64_t c = u * W;
    V a0 = load(oa + c), a1 = load(oa + c + W), a2 = load(oa + c + 2 * W);
    V a3 = load(oa + c + 3 * W);
    V b0 = load(ob + c), b1 = load(ob + c + W), b2 = load(ob + c + 2 * W);
    V b3 = load(ob + c + 3 * W);
    for (int64_t i = 0; i < nb; ++i) {
      const float pai = pa[i], pbi = pb[i];
      const float* r = vp[i] + c;
      const V v0 = load(r), v1 = load(r + W), v2 = load(r + 2 * W), v3 = load(r + 3 * W);
      a0 = a0 + pai * v0; a1 = a1 + pai * v1; a2 = a2 + pai * v2; a3 = a3 + pai * v3;
      b0 = b0 + pbi * v0; b1 = b1 + pbi * v1; b2 = b2 + pbi * v2; b3 = b3 + pbi * v3;
    }
    store(oa + c, a0); store(oa + c + W, a1); store(oa + c + 2 * W, a2); store(oa + c + 3 * W, a3);
    store(ob + c, b0); store(ob + c + W, b1); store(ob + c + 2 * W, b2); store(ob + c + 3 * W, b3);
  }
  for (; u < NV; ++u) {
    V acc_a = load(oa + u * W), acc_b = load(ob + u * W);
    for (int64_t i = 0; i < nb; ++i) {
      const V v = load(vp[i] + u * W);
      acc_a = acc_a + pa[i] * v;
      acc_b = acc_b + pb[i] * v;
    }
    store(oa + u * W, acc_a);
    store(ob + u * W, acc_b);
  }
  for (int64_t j = NV * W; j < Qv; ++j) {
    float acc_a = oa[j], acc_b = ob[j];
    for (int64_t i = 0; i < nb; ++i) {
      acc_a = acc_a + pa[i] * vp[i][j];
      acc_b = acc_b + pb[i] * vp[i][j];
    }
    oa[j] = acc_a;
    ob[j] = acc_b;
  }
}

#if KN_ATTN_W > 1
#define KN_EXP_V V
#define KN_EXP_VU VU32
#endif
#include "exp_f32.h"

// x[l] = exp_softmax(x[l] - m) for l < n: W lanes at a time, then the last n % W one by one.
void exp_shifted(float* x, int64_t n, float m) {
  int64_t l = 0;
#if KN_ATTN_W > 1
  for (; l + W <= n; l += W) store(x + l, exp_softmax<V, VU32>(load(x + l) - m));
#endif
  for (; l < n; ++l) x[l] = exp_softmax<float, uint32_t>(x[l] - m);
}

// max of x[0..n): exact in any grouping (a NaN is skipped in every grouping alike), so
// lanes and four chains may share the work.
float max_of(const float* x, int64_t n) {
  float m = -INFINITY;
  int64_t l = 0;
#if KN_ATTN_W > 1
  V m0 = zero() - INFINITY, m1 = m0, m2 = m0, m3 = m0;
  for (; l + 4 * W <= n; l += 4 * W) {
    const V x0 = load(x + l), x1 = load(x + l + W), x2 = load(x + l + 2 * W),
            x3 = load(x + l + 3 * W);
    m0 = x0 > m0 ? x0 : m0;
    m1 = x1 > m1 ? x1 : m1;
    m2 = x2 > m2 ? x2 : m2;
    m3 = x3 > m3 ? x3 : m3;
  }
  m0 = m1 > m0 ? m1 : m0;
  m2 = m3 > m2 ? m3 : m2;
  m0 = m2 > m0 ? m2 : m0;
  for (int i = 0; i < W; ++i) m = max32(m, m0[i]);
#endif
  for (; l < n; ++l) m = max32(m, x[l]);
  return m;
}

}  // namespace

void KN_ATTN_UNIT(const AttnArgs& a, int64_t t0, int64_t R, int64_t kh, float* scratch,
                  int64_t* rows) {
  const int64_t G = a.H / a.K, RG = R * G, Q = a.Q, Qv = a.Qv, ps = a.page_size;
  const AttnSpan sp = attention_group_span(a, t0, R);  // the group's keys L0..L0+N-1
  const int64_t L0 = sp.lo, N = sp.n, npad = sp.npad;
  const int32_t* pages = a.page_table + int64_t(a.slots[t0]) * a.P;

  // rows[i]: cache row (page * page_size + offset) * K + kh of key L0 + i, walking the
  // slot's pages in order
  for (int64_t i = 0, pi = L0 / ps, off = L0 % ps; i < N; ++i) {
    rows[i] = (int64_t(pages[pi]) * ps + off) * a.K + kh;
    if (++off == ps) off = 0, ++pi;
  }

  // scratch (attention_scratch floats): qs [R, G, Q], zeros [Q], kbuf [KB, Q], kt [Q, KB],
  // s [R, G, npad], vbuf [KB, Qv], o [R, G, Qv], den [R, G]. Row r, head g is rg = r * G + g;
  // its score of key L0 + i is s[rg * npad + i].
  float* qs = scratch;
  float* zeros = qs + RG * Q;
  float* kbuf = zeros + Q;
  float* kt = kbuf + KB * Q;
  float* s = kt + Q * KB;
  float* vbuf = s + RG * npad;
  float* o = vbuf + KB * Qv;
  float* den = o + RG * Qv;
  for (int64_t j = 0; j < Q; ++j) zeros[j] = 0.0f;
  for (int64_t i = 0; i < RG * Qv; ++i) o[i] = 0.0f;
  const float* rp[KB];  // the block's key (then value) rows as float

  // row r's own keys, as indices into the group's: first[r] .. last[r]
  int64_t first[ATTN_MAX_GROUP], last[ATTN_MAX_GROUP];
  for (int64_t r = 0; r < R; ++r) {
    first[r] = attention_span(a, t0 + r).lo - L0;
    last[r] = attention_end(a, t0 + r) - L0;
  }

  // qs = round_to_cache_dtype(q) * scale, for the G query heads of kv head kh of each row
  for (int64_t r = 0; r < R; ++r)   // a row's G heads of kv head kh are contiguous in q
    round_scale_row(a.k_fmt, a.q + ((t0 + r) * a.H + kh * G) * Q, G * Q, a.scale,
                    qs + r * G * Q);

  // scores, block by block of KB keys (a short last block: its keys rounded up to W lanes; the
  // lanes past the last key score a zero key, unused),
  // for the rows that see some key of the block (a row's lanes outside its own keys are
  // scores no step below reads)
  for (int64_t b0 = 0; b0 < N; b0 += KB) {
    const int64_t nb = min64(KB, N - b0);
    const int64_t nk = (nb + W - 1) / W * W;  // lanes to score
    for (int64_t i = 0; i < nk; ++i)
      rp[i] = i < nb ? row_f32(a.k_fmt, a.k, rows[b0 + i] * Q, Q, kbuf + i * Q) : zeros;
    transpose_keys(rp, Q, nk, kt);
    // the rows that see a key of the block, r0..r1-1: first[] and last[] never fall with r, so
    // they are the rows before the first that starts past the block, from the first that
    // ends in it or later; their (row, head)s rg are r0 * G .. r1 * G - 1, scored in pairs
    int64_t r0 = 0, r1 = R;
    while (r0 < R && last[r0] < b0) ++r0;
    while (r1 > r0 && first[r1 - 1] >= b0 + nb) --r1;
    int64_t rg = r0 * G;
    for (; rg + 1 < r1 * G; rg += 2)
      score_pair(&qs[rg * Q], &qs[(rg + 1) * Q], kt, Q, nk, &s[rg * npad + b0],
                 &s[(rg + 1) * npad + b0]);
    if (rg < r1 * G) score_block(&qs[rg * Q], kt, Q, nk, &s[rg * npad + b0]);
  }

  // per row and head, over its own n keys: softcap; m = max; p_l = exp_softmax(score_l - m);
  // den = sum of p_l in order of l
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = last[r] - first[r] + 1;
    for (int64_t g = 0; g < G; ++g) {
      float* sg = &s[(r * G + g) * npad + first[r]];
      if (a.softcap > 0)
        for (int64_t l = 0; l < n; ++l) sg[l] = a.softcap * std::tanh(sg[l] / a.softcap);
      exp_shifted(sg, n, max_of(sg, n));
    }
    // den: each head's sum in order of l, four heads' chains side by side (the same sums; a
    // last group of fewer than four repeats its last head in the spare chains, unstored)
    const float* s0 = &s[r * G * npad + first[r]];
    for (int64_t g = 0; g < G; g += 4) {
      const float* sh[4];
      for (int64_t i = 0; i < 4; ++i) sh[i] = s0 + (g + i < G ? g + i : G - 1) * npad;
      float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
      for (int64_t l = 0; l < n; ++l) {
        d0 = d0 + sh[0][l]; d1 = d1 + sh[1][l]; d2 = d2 + sh[2][l]; d3 = d3 + sh[3][l];
      }
      const float d[4] = {d0, d1, d2, d3};
      for (int64_t i = 0; i < 4 && g + i < G; ++i) den[r * G + g + i] = d[i];
    }
  }

  // o = sum over l in order of p_l * v_l, block by block (each row's own keys of the block:
  // i0..i1-1; the blocks only cut the sum, never reorder it)
  for (int64_t b0 = 0; b0 < N; b0 += KB) {
    const int64_t nb = min64(KB, N - b0);
    for (int64_t i = 0; i < nb; ++i)
      rp[i] = row_f32(a.v_fmt, a.v, rows[b0 + i] * Qv, Qv, vbuf + i * Qv);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t i0 = first[r] > b0 ? first[r] - b0 : 0;
      const int64_t i1 = min64(nb, last[r] + 1 - b0);
      if (i0 >= i1) continue;
      const float* pr = &s[r * G * npad + b0 + i0];  // head g's weights: pr + g * npad
      float* orow = &o[r * G * Qv];
      for (int64_t g = 0; g < G; g += 2)  // heads in pairs, sharing the value loads
        if (g + 1 < G)
          value_pair(pr + g * npad, pr + (g + 1) * npad, rp + i0, i1 - i0, Qv, orow + g * Qv,
                     orow + (g + 1) * Qv);
        else
          value_block(pr + g * npad, rp + i0, i1 - i0, Qv, orow + g * Qv);
    }
  }

  // out = o / den, W columns at a time (each lane the same one division)
  for (int64_t r = 0; r < R; ++r)
    for (int64_t g = 0; g < G; ++g) {
      float* dst = a.out + ((t0 + r) * a.H + kh * G + g) * Qv;
      const float* og = &o[(r * G + g) * Qv];
      const float d = den[r * G + g];
      int64_t j = 0;
#if KN_ATTN_W > 1
      for (; j + W <= Qv; j += W) store(dst + j, load(og + j) / d);
#endif
      for (; j < Qv; ++j) dst[j] = og[j] / d;
    }
}

}  // namespace kn
