// AVX-512, 256-value K-quant blocks, any M: 16 output columns per group, one per lane of a
// 512-bit vector, as simd_legacy16.h does for legacy blocks. Each column's block
// is unpacked ONCE per call into a Tile16 (lane c of every vector = column c): the packed
// bytes are transposed 32 at a time (transpose16) and the values unpacked in that layout,
// the header bytes likewise 16 at a time; a repacked weight (repack.h) holds its bytes
// already in that layout, and they are loaded instead (Rows16 / Words16 below). Then every row's block sums come out per lane:
//   sumi = sum_s sc_s * (u_s . x_s - OFF * xsum_s)   dpbusd against broadcast activation
//                                                    words, started at -OFF * xsum_s, then
//                                                    one int32 multiply by sc_s
//   summ = sum_s mn_s * xsum_s                       dpwssd of int16 (min, min) pairs
//                                                    against broadcast (xsum, xsum) pairs
// (xsum_s: the activation's sum over sub-block s, from the q8_K 16-value sums; integers,
// exact in any order), and the float part is the reference's combine, lane c doing column
// c's sequence. Unpacking in the transposed layout costs less than the 8-column path's
// per-column unpack, so this path serves M = 1 as well. Included by simd_driver.h inside
// the AVX-512 path's namespace (after simd_legacy16.h, whose helpers it uses).

// One weight block of 16 columns, lane c of every vector being column c.
struct Tile16 {
  __m512i u[64];   // u[j]: values 4j .. 4j + 3 as unsigned bytes (the format's value + OFF)
  __m512i sc[16];  // sc[s]: sub-block s's integer scale, int32
  __m512i mn[8];   // with mins: mn[2q + r] = int16 pair (min 4q + r, min 4q + r + 2)
  __m512 dw, mw;   // the block's d (and dmin) as floats
};

// Lane c of t[j] = the j-th u32 of the 32 bytes at rows[c] + off (j = 0..7).
KN_INL void transpose_bytes32(const uint8_t* const* rows, int64_t off, __m512i* t) {
  __m512i z[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    const int lo = i < 4 ? i : i + 4;  // transpose16's input order
    z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(ld256(rows[lo] + off)), ld256(rows[lo + 4] + off), 1);
  }
  transpose16(z, t);
}

// Lane c of v[q] = the q-th u32 of the 16 bytes at rows[c] + off (q = 0..3).
KN_INL void transpose_bytes16(const uint8_t* const* rows, int64_t off, __m512i* v) {
  // p[g]: 128-bit lane q = u32 q of columns 4g .. 4g + 3
  const __m512i by_word = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  __m512i p[4];
#pragma GCC unroll 4
  for (int g = 0; g < 4; ++g) {
    __m512i z = _mm512_castsi128_si512(ld128(rows[4 * g] + off));
    z = _mm512_inserti32x4(z, ld128(rows[4 * g + 1] + off), 1);
    z = _mm512_inserti32x4(z, ld128(rows[4 * g + 2] + off), 2);
    z = _mm512_inserti32x4(z, ld128(rows[4 * g + 3] + off), 3);
    p[g] = _mm512_permutexvar_epi32(by_word, z);
  }
  const __m512i lo01 = _mm512_shuffle_i32x4(p[0], p[1], 0x44), hi01 = _mm512_shuffle_i32x4(p[0], p[1], 0xEE);
  const __m512i lo23 = _mm512_shuffle_i32x4(p[2], p[3], 0x44), hi23 = _mm512_shuffle_i32x4(p[2], p[3], 0xEE);
  v[0] = _mm512_shuffle_i32x4(lo01, lo23, 0x88);
  v[1] = _mm512_shuffle_i32x4(lo01, lo23, 0xDD);
  v[2] = _mm512_shuffle_i32x4(hi01, hi23, 0x88);
  v[3] = _mm512_shuffle_i32x4(hi01, hi23, 0xDD);
}

// Where a group's block is read from, as vectors whose lane c is column c's: words(w0, n, t)
// t[j] = u32 word w0 + j of the block (n = 4 or 8), word(w) one, tail() the u16 after the
// last whole word (Q3_K's and Q6_K's d) as int32 lanes. Rows16: 16 plain GGUF rows, their
// bytes transposed on every read; Words16: a repacked group's block (repack.h's word layout),
// already in lanes, so every read is loads.
struct Rows16 {
  const uint8_t* const* rows;
  int64_t off;  // the block's byte offset in each row
  KN_INL void words(int w0, int n, __m512i* t) const {
    if (n == 8)
      transpose_bytes32(rows, off + 4 * w0, t);
    else
      transpose_bytes16(rows, off + 4 * w0, t);
  }
  KN_INL __m512i word(int w) const { return gather16_u32(rows, off + 4 * w); }
  template <int B>
  KN_INL __m512i tail() const { return _mm512_srli_epi32(gather16_u32(rows, off + B - 4), 16); }
};

struct Words16 {
  const uint8_t* p;  // the block's 16 * B bytes
  KN_INL void words(int w0, int n, __m512i* t) const {
    for (int j = 0; j < n; ++j) t[j] = _mm512_loadu_si512(p + 64 * (w0 + j));
  }
  KN_INL __m512i word(int w) const { return _mm512_loadu_si512(p + 64 * w); }
  template <int B>
  KN_INL __m512i tail() const { return _mm512_cvtepu16_epi32(ld256(p + 64 * (B / 4))); }
};

KN_INL __m512i bytes64(int v) { return _mm512_set1_epi8(char(v)); }

// Unsigned byte i of every u32 lane, as int32; signed: sign-extended.
KN_INL __m512i byte_u32(__m512i v, int i) { return _mm512_and_si512(_mm512_srli_epi32(v, 8 * i), _mm512_set1_epi32(0xFF)); }
KN_INL __m512i byte_s32(__m512i v, int i) { return _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * i), 24); }

// Bit `from` of every byte, moved to bit `to` (the other bits zero).
KN_INL __m512i bit_to(__m512i v, int from, int to) {
  const __m512i moved = from < to ? _mm512_slli_epi32(v, unsigned(to - from)) : _mm512_srli_epi32(v, unsigned(from - to));
  return _mm512_and_si512(moved, bytes64(1 << to));
}

// Bits 2j, 2j + 1 of every byte as its value 0..3.
KN_INL __m512i crumb(__m512i v, int j) { return _mm512_and_si512(_mm512_srli_epi32(v, unsigned(2 * j)), bytes64(3)); }

// Q4_K / Q5_K header (d | dmin | scales[12]): d, dmin, and the 6-bit scales and mins
// (formats.cc k4_scale_min; simd_formats.h k4_scales_mins, lane by lane).
template <class Src>
KN_INL void k4_header16(const Src& src, Tile16& t) {
  __m512i v[4];
  src.words(0, 4, v);
  t.dw = f16x16(_mm512_and_si512(v[0], _mm512_set1_epi32(0xFFFF)));
  t.mw = f16x16(_mm512_srli_epi32(v[0], 16));
  const __m512i m6 = bytes64(0x3f), m4 = bytes64(0x0f), m2 = bytes64(0x03);
  const __m512i sc_lo = _mm512_and_si512(v[1], m6);
  const __m512i sc_hi = _mm512_or_si512(_mm512_and_si512(v[3], m4),
                                        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(v[1], 6), m2), 4));
  const __m512i mn_lo = _mm512_and_si512(v[2], m6);
  const __m512i mn_hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(v[3], 4), m4),
                                        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(v[2], 6), m2), 4));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    t.sc[i] = byte_u32(sc_lo, i);
    t.sc[i + 4] = byte_u32(sc_hi, i);
  }
  const __m512i pairs = _mm512_set1_epi32(0x00FF00FF);  // bytes r and r + 2 as int16
#pragma GCC unroll 2
  for (int r = 0; r < 2; ++r) {
    t.mn[r] = _mm512_and_si512(_mm512_srli_epi32(mn_lo, 8 * r), pairs);
    t.mn[2 + r] = _mm512_and_si512(_mm512_srli_epi32(mn_hi, 8 * r), pairs);
  }
}

// Q4_K / Q5_K values: the nibbles of qs[128] from word w0, chunk pair c of 32 bytes holding
// values 64c .. 64c + 31 (low nibbles) and 64c + 32 .. 64c + 63 (high).
template <class Src>
KN_INL void k4_values16(const Src& src, int w0, Tile16& t) {
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    __m512i q[8];
    src.words(w0 + 8 * c, 8, q);
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {
      t.u[16 * c + k] = _mm512_and_si512(q[k], bytes64(0x0F));
      t.u[16 * c + 8 + k] = _mm512_and_si512(_mm512_srli_epi32(q[k], 4), bytes64(0x0F));
    }
  }
}

// acc + dpwssd(v, the int16 pair *x broadcast to every lane), the broadcast in the operand.
KN_INL __m512i dpwssd_bcast(__m512i acc, __m512i v, const int32_t* x) {
  __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(v), "m"(*x));
  return acc;
}

// Per format: SUB values per sub-block, OFF the value offset (taken off via the activation
// sums), MINS whether summ is used, load(src, t) the block src reads (Rows16, Words16) into t;
// FUSED: sums<R, E>(src, t, ...) as well, R rows' sums with the values never stored in t
// (up to kFewK rows, FEW_R a pass).
template <class F> struct K16 { static constexpr bool HAVE = false; };

template <> struct K16<FQ4_K> {  // d | dmin | scales[12] | qs[128]
  static constexpr bool HAVE = true, MINS = true, FUSED = true;
  static constexpr int SUB = 32, OFF = 0;
  template <class Src>
  KN_INL static void load(const Src& src, Tile16& t) {
    k4_header16(src, t);
    k4_values16(src, 4, t);
  }
  // R rows' sums (k16_sums') with the values unpacked straight into the dot products,
  // sub-block by sub-block, never stored in t (which gets the header alone): xb the first
  // row's k16_act_words entry, row r's E * r words after it. The sums are integers, exact
  // in any order, so the bits are the tile's.
  template <int R, int E, class Src>
  KN_INL static void sums(const Src& src, Tile16& t, const int32_t* xb, __m512i* isum,
                          __m512i* q) {
    k4_header16(src, t);
    const __m512i m4 = bytes64(0x0F);
    const uint32_t* xw = reinterpret_cast<const uint32_t*>(xb);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) isum[r] = q[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {  // sub-blocks 2c (low nibbles) and 2c + 1 (high)
      __m512i lo[R], hi[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) {
        const __m512i w = src.word(4 + 8 * c + k);
        const __m512i wl = _mm512_and_si512(w, m4), wh = _mm512_and_si512(_mm512_srli_epi32(w, 4), m4);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          lo[r] = dpbusd_bcast(lo[r], wl, xw + E * r + 16 * c + k);
          hi[r] = dpbusd_bcast(hi[r], wh, xw + E * r + 16 * c + 8 + k);
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(lo[r], t.sc[2 * c]));
        isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(hi[r], t.sc[2 * c + 1]));
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) q[r] = dpwssd_bcast(q[r], t.mn[i], xb + E * r + 64 + i);
  }
  static constexpr int FEW_R = 4;   // rows a pass of sums
};

template <> struct K16<FQ6_K> {  // ql[128] | qh[64] | scales int8[16] | d; value = (lo | hi << 4) - 32
  static constexpr bool HAVE = true, MINS = false, FUSED = true;
  static constexpr int SUB = 16, OFF = 32;
  // R rows' sums (k16_sums'), the values unpacked straight into the dot products (value
  // word i = 32h + 8j + k, load's u[i], is sub-block 8h + 2j + k / 4's): xb the first row's
  // k16_act_words entry, row r's E * r words after it. Integer sums: the tile's bits.
  template <int R, int E, class Src>
  KN_INL static void sums(const Src& src, Tile16& t, const int32_t* xb, __m512i* isum,
                          __m512i* q) {
    const __m512i m4 = bytes64(0x0F), m30 = bytes64(0x30);
    __m512i v[4];
    src.words(48, 4, v);
    t.dw = f16x16(src.template tail<210>());
    const uint32_t* xw = reinterpret_cast<const uint32_t*>(xb);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) isum[r] = q[r] = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j)
#pragma GCC unroll 2
        for (int half = 0; half < 2; ++half) {
          const int sb = 8 * h + 2 * j + half;
          __m512i p[R];
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) p[r] = _mm512_set1_epi32(xb[E * r + 64 + sb]);
#pragma GCC unroll 4
          for (int kk = 0; kk < 4; ++kk) {
            const int k = 4 * half + kk;
            const __m512i l = src.word(16 * h + (j & 1) * 8 + k), qh = src.word(32 + 8 * h + k);
            const __m512i lo = j < 2 ? l : _mm512_srli_epi32(l, 4);
            const __m512i hi = j == 0 ? _mm512_slli_epi32(qh, 4) : j == 1 ? _mm512_slli_epi32(qh, 2)
                               : j == 2 ? qh : _mm512_srli_epi32(qh, 2);
            const __m512i u = _mm512_or_si512(_mm512_and_si512(lo, m4), _mm512_and_si512(hi, m30));
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) p[r] = dpbusd_bcast(p[r], u, xw + E * r + 32 * h + 8 * j + k);
          }
          const __m512i sc = byte_s32(v[sb / 4], sb % 4);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(p[r], sc));
        }
  }
  static constexpr int FEW_R = 8;   // rows a pass of sums
  template <class Src>
  KN_INL static void load(const Src& src, Tile16& t) {
    const __m512i m4 = bytes64(0x0F), m30 = bytes64(0x30);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // values 128h ..: ql[64h .. 64h + 63], qh[32h .. 32h + 31]
      __m512i l0[8], l1[8], qh[8];
      src.words(16 * h, 8, l0);
      src.words(16 * h + 8, 8, l1);
      src.words(32 + 8 * h, 8, qh);
      __m512i* u = t.u + 32 * h;
#pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) {  // simd_formats.h FQ6_K::load, lane by lane
        u[k] = _mm512_or_si512(_mm512_and_si512(l0[k], m4), _mm512_and_si512(_mm512_slli_epi32(qh[k], 4), m30));
        u[8 + k] = _mm512_or_si512(_mm512_and_si512(l1[k], m4), _mm512_and_si512(_mm512_slli_epi32(qh[k], 2), m30));
        u[16 + k] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(l0[k], 4), m4), _mm512_and_si512(qh[k], m30));
        u[24 + k] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(l1[k], 4), m4),
                                    _mm512_and_si512(_mm512_srli_epi32(qh[k], 2), m30));
      }
    }
    __m512i v[4];
    src.words(48, 4, v);
#pragma GCC unroll 16
    for (int s = 0; s < 16; ++s) t.sc[s] = byte_s32(v[s / 4], s % 4);
    t.dw = f16x16(src.template tail<210>());
  }
};

template <> struct K16<FQ5_K> {  // d | dmin | scales[12] | qh[32] | qs[128]; bit i of qh[l]: bit 4 of 32i + l
  static constexpr bool HAVE = true, MINS = true, FUSED = false;
  static constexpr int SUB = 32, OFF = 0;
  template <class Src>
  KN_INL static void load(const Src& src, Tile16& t) {
    k4_header16(src, t);
    k4_values16(src, 12, t);
    __m512i qh[8];
    src.words(4, 8, qh);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i)  // chunk i: bit i of each qh byte to bit 4
#pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) t.u[8 * i + k] = _mm512_or_si512(t.u[8 * i + k], bit_to(qh[k], i, 4));
  }
};

template <> struct K16<FQ3_K> {  // hmask[32] | qs[64] | scales[12] | d; value = (lo | hbit << 2) - 4
  static constexpr bool HAVE = true, MINS = false, FUSED = false;
  static constexpr int SUB = 16, OFF = 4;
  template <class Src>
  KN_INL static void load(const Src& src, Tile16& t) {
    __m512i hm[8];
    src.words(0, 8, hm);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // chunks 4h + j: bits 2j, 2j + 1 of qs[32h + l], hmask bit 4h + j
      __m512i q[8];
      src.words(8 + 8 * h, 8, q);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j)
#pragma GCC unroll 8
        for (int k = 0; k < 8; ++k)
          t.u[8 * (4 * h + j) + k] = _mm512_or_si512(crumb(q[k], j), bit_to(hm[k], 4 * h + j, 2));
    }
    // The 16 6-bit scales (simd_formats.h FQ3_K::load, lane by lane), then minus 32: the u32
    // words t0, t1, t2 at bytes 96, 100, 104 (read from byte 92, not past the block's end).
    __m512i v[4];
    src.words(23, 4, v);
    const __m512i t0 = v[1], t1 = v[2], t2 = v[3], m4 = bytes64(0x0f), m2 = bytes64(0x03);
    const __m512i s[4] = {
        _mm512_or_si512(_mm512_and_si512(t0, m4), _mm512_slli_epi32(_mm512_and_si512(t2, m2), 4)),
        _mm512_or_si512(_mm512_and_si512(t1, m4), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(t2, 2), m2), 4)),
        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(t0, 4), m4),
                        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(t2, 4), m2), 4)),
        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(t1, 4), m4),
                        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(t2, 6), m2), 4))};
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) t.sc[i] = _mm512_sub_epi32(byte_u32(s[i / 4], i % 4), _mm512_set1_epi32(32));
    t.dw = f16x16(src.template tail<110>());
  }
};

template <> struct K16<FQ2_K> {  // scales[16] (lo 4 scale, hi 4 min) | qs[64] | d | dmin
  static constexpr bool HAVE = true, MINS = true, FUSED = false;
  static constexpr int SUB = 16, OFF = 0;
  template <class Src>
  KN_INL static void load(const Src& src, Tile16& t) {
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // chunks 4h + j: bits 2j, 2j + 1 of qs[32h + l]
      __m512i q[8];
      src.words(4 + 8 * h, 8, q);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j)
#pragma GCC unroll 8
        for (int k = 0; k < 8; ++k) t.u[8 * (4 * h + j) + k] = crumb(q[k], j);
    }
    __m512i v[4];
    src.words(0, 4, v);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) t.sc[i] = _mm512_and_si512(byte_u32(v[i / 4], i % 4), _mm512_set1_epi32(0x0F));
    const __m512i pairs = _mm512_set1_epi32(0x000F000F);  // high nibbles of bytes r, r + 2
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q)
#pragma GCC unroll 2
      for (int r = 0; r < 2; ++r) t.mn[2 * q + r] = _mm512_and_si512(_mm512_srli_epi32(v[q], 8 * r + 4), pairs);
    const __m512i dm = src.word(20);
    t.dw = f16x16(_mm512_and_si512(dm, _mm512_set1_epi32(0xFFFF)));
    t.mw = f16x16(_mm512_srli_epi32(dm, 16));
  }
};

// Per call, the activations of every (block, row) in one block-major array of int32 words:
// entry (b * M + m) is row m's block b, kEntry<KQ> words: its 256 values as 64 words (the
// dot products' broadcast operands), then the words the tile's extras meet. OFF: the int32
// -OFF * xsum_s of each sub-block s; MINS: the int16 pairs (xsum_{4q+r}, xsum_{4q+r+2}) in
// the mn[2q + r] order. |xsum_s| <= 32 * 127, so the pairs are exact. Block-major, the rows
// of one block lie a constant number of words apart, so a pass over R rows (K16<>::sums,
// k16_sums) reads them all from one pointer at constant offsets, one register for 8 rows.
template <class KQ>
constexpr int kExtra = KQ::MINS ? 128 / KQ::SUB : 256 / KQ::SUB;
template <class KQ>
constexpr int kEntry = 64 + kExtra<KQ>;

template <class KQ>
void k16_act_words(const QuantActs& x, int64_t M, std::vector<int32_t>& out) {
  constexpr int NSUB = 256 / KQ::SUB, PER = KQ::SUB / 16, NW = kExtra<KQ>;
  const int64_t nb = x.K / 256;
  out.resize(size_t(M * nb * kEntry<KQ>));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t i = m * nb + b;   // the row-major block index of x.q and x.bsum
      int32_t* e = &out[size_t((b * M + m) * kEntry<KQ>)];
      std::memcpy(e, &x.q[size_t(i * 256)], 256);
      int32_t xs[16];
      for (int s = 0; s < NSUB; ++s) {
        xs[s] = 0;
        for (int g = 0; g < PER; ++g) xs[s] += x.bsum[size_t(16 * i + PER * s + g)];
      }
      int32_t* w = e + 64;
      if (KQ::MINS) {
        for (int t = 0; t < NW; ++t) {
          const int s = 4 * (t / 2) + t % 2;
          w[t] = int32_t(uint32_t(uint16_t(xs[s])) | uint32_t(uint16_t(xs[s + 2])) << 16);
        }
      } else {
        for (int s = 0; s < NSUB; ++s) w[s] = -KQ::OFF * xs[s];
      }
    }
}

// sumi (and summ into q) of R rows against the tile: xb the first row's k16_act_words entry
// for this block, row r's kEntry<KQ> * r words after it. Each tile vector is loaded once
// for the R rows.
template <class KQ, int R>
KN_INL void k16_sums(const Tile16& t, const int32_t* xb, __m512i* isum, __m512i* q) {
  constexpr int NSUB = 256 / KQ::SUB, WPS = KQ::SUB / 4, E = kEntry<KQ>;
  const uint32_t* xw = reinterpret_cast<const uint32_t*>(xb);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) isum[r] = q[r] = _mm512_setzero_si512();
#pragma GCC unroll 16
  for (int s = 0; s < NSUB; ++s) {
    // two partial sums per row (even and odd words), added at the end: two chains of
    // dependent dot products instead of one; integers, so the same sum in any order
    __m512i p[R], p2[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      p[r] = KQ::OFF ? _mm512_set1_epi32(xb[E * r + 64 + s]) : _mm512_setzero_si512();
      p2[r] = _mm512_setzero_si512();
    }
#pragma GCC unroll 8
    for (int k = 0; k < WPS; k += 2) {
      const __m512i u = _mm512_load_si512(&t.u[WPS * s + k]), u2 = _mm512_load_si512(&t.u[WPS * s + k + 1]);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        p[r] = dpbusd_bcast(p[r], u, xw + E * r + WPS * s + k);
        p2[r] = dpbusd_bcast(p2[r], u2, xw + E * r + WPS * s + k + 1);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(_mm512_add_epi32(p[r], p2[r]), t.sc[s]));
  }
  if (KQ::MINS)
#pragma GCC unroll 8
    for (int i = 0; i < NSUB / 2; ++i)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) q[r] = dpwssd_bcast(q[r], t.mn[i], xb + E * r + 64 + i);
}

// Rows up to which the K-quants with a fused path (FUSED) unpack each block straight into
// the rows' dot products, FEW_R rows a pass, instead of into a tile in memory read back for
// every 4 rows.
constexpr int64_t kFewK = 16;

// fn(std::integral_constant<int, R>(), m) for groups of rows covering [0, M): R = MAXR while
// that many are left, then 4 (where MAXR is more), 2 and 1.
template <int MAXR, class Fn>
KN_INL void row_groups(int64_t M, Fn&& fn) {
  int64_t m = 0;
  for (; m + MAXR <= M; m += MAXR) fn(std::integral_constant<int, MAXR>(), m);
  if constexpr (MAXR > 4)
    if (m + 4 <= M) {
      fn(std::integral_constant<int, 4>(), m);
      m += 4;
    }
  for (; m + 2 <= M; m += 2) fn(std::integral_constant<int, 2>(), m);
  if (m < M) fn(std::integral_constant<int, 1>(), m);
}

// Columns [n0, n1), 16 at a time. R16: the weight is repacked (repack.h's word layout; n0 and
// n1 multiples of 16), each group's block read with loads (Words16); else plain rows (Rows16).
template <class F, bool R16>
KN_SIMD void kquant_cols16(const MatmulArgs& a, int64_t n0, int64_t n1) {
  using KQ = K16<F>;
  constexpr int E = kEntry<KQ>;
  const QuantActs& x = *a.acts;
  const int64_t M = a.M, K = a.K, nb = K / 256;
  std::vector<int32_t> own;
  if (!a.words) k16_act_words<KQ>(x, M, own);
  const int32_t* xa = a.words ? a.words : own.data();   // k16_act_words' entries
  std::vector<float> acc(size_t(M * 16));
  Tile16 t;
  for (int64_t n = n0; n < n1; n += 16) {
    const uint8_t* rows[16];
    if constexpr (!R16)
      for (int c = 0; c < 16; ++c) rows[c] = a.w + std::min(n + c, n1 - 1) * a.row_bytes;
    std::fill(acc.begin(), acc.end(), 0.f);
    // the next group's rows (contiguous), a slice per block, as the legacy path does
    const uintptr_t next = next_group(a, n, 16);
    for (int64_t b = 0; b < nb; ++b) {
      prefetch_slice(next, b, 16 * F::BYTES);
      // The reference's combine (qmatmul.h), operand for operand, for row m.
      auto finish = [&](int64_t m, __m512i isum, __m512i q) KN_INL_LAMBDA {
        const __m512 dx = _mm512_set1_ps(x.d[size_t(m * nb + b)]);
        __m512 step = _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(t.dw, dx));
        if (KQ::MINS) step = _mm512_sub_ps(step, _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_mul_ps(t.mw, dx)));
        float* am = &acc[size_t(m * 16)];
        _mm512_storeu_ps(am, _mm512_add_ps(_mm512_loadu_ps(am), step));
      };
      const int32_t* xb = xa + b * M * E;   // row m's entry: xb + m * E
      if constexpr (KQ::FUSED) {
        // Up to kFewK rows (decode): the values go straight into the rows' dot products,
        // FEW_R rows a pass, the tile never stored; its integer sums are exact in any order,
        // so the bits are the tile's.
        if (M <= kFewK) {
          row_groups<KQ::FEW_R>(M, [&](auto r_const, int64_t m) KN_INL_LAMBDA {
            constexpr int R = decltype(r_const)::value;
            __m512i isum[R], q[R];
            if constexpr (R16)
              KQ::template sums<R, E>(Words16{a.w + n * a.row_bytes + b * 16 * F::BYTES}, t, xb + m * E, isum, q);
            else
              KQ::template sums<R, E>(Rows16{rows, b * F::BYTES}, t, xb + m * E, isum, q);
            for (int r = 0; r < R; ++r) finish(m + r, isum[r], q[r]);
          });
          continue;
        }
      }
      if constexpr (R16)
        KQ::load(Words16{a.w + n * a.row_bytes + b * 16 * F::BYTES}, t);
      else
        KQ::load(Rows16{rows, b * F::BYTES}, t);
      // R rows from m (4, then 2, then 1): their sums, then combine.
      row_groups<4>(M, [&](auto r_const, int64_t m) KN_INL_LAMBDA {
        constexpr int R = decltype(r_const)::value;
        __m512i isum[R], q[R];
        k16_sums<KQ, R>(t, xb + m * E, isum, q);
        for (int r = 0; r < R; ++r) finish(m + r, isum[r], q[r]);
      });
    }
    const __mmask16 valid = __mmask16((1u << std::min<int64_t>(16, n1 - n)) - 1);
    for (int64_t m = 0; m < M; ++m)
      _mm512_mask_storeu_ps(a.out(m) + n, valid, _mm512_loadu_ps(&acc[size_t(16 * m)]));
  }
}

// The activation words of a's format (MatmulArgs::words): offset_init's for the 32-value
// blocks with an offset, k16_act_words' for the K-quants; false: none.
KN_SIMD bool dispatch_words(const MatmulArgs& a, std::vector<int32_t>& out) {
  const QuantActs& x = *a.acts;
  switch (a.fmt) {
    case Q4_0: out = offset_init<FQ4_0>(x); return true;
    case Q5_0: out = offset_init<FQ5_0>(x); return true;
    case Q8_0: out = offset_init<FQ8_0>(x); return true;
    case Q2_K: k16_act_words<K16<FQ2_K>>(x, a.M, out); return true;
    case Q3_K: k16_act_words<K16<FQ3_K>>(x, a.M, out); return true;
    case Q4_K: k16_act_words<K16<FQ4_K>>(x, a.M, out); return true;
    case Q5_K: k16_act_words<K16<FQ5_K>>(x, a.M, out); return true;
    case Q6_K: k16_act_words<K16<FQ6_K>>(x, a.M, out); return true;
  }
  return false;
}

// A repacked weight's whole groups (qmatmul_cols_avx512_r16); false: not a repackable format.
KN_SIMD bool dispatch_r16(const MatmulArgs& a, int64_t n0, int64_t n1) {
  switch (a.fmt) {
    case Q4_0: legacy_cols16<FQ4_0, true>(a, n0, n1); return true;
    case Q4_1: legacy_cols16<FQ4_1, true>(a, n0, n1); return true;
    case Q5_0: legacy_cols16<FQ5_0, true>(a, n0, n1); return true;
    case Q5_1: legacy_cols16<FQ5_1, true>(a, n0, n1); return true;
    case Q8_0: legacy_cols16<FQ8_0, true>(a, n0, n1); return true;
    case Q2_K: kquant_cols16<FQ2_K, true>(a, n0, n1); return true;
    case Q3_K: kquant_cols16<FQ3_K, true>(a, n0, n1); return true;
    case Q4_K: kquant_cols16<FQ4_K, true>(a, n0, n1); return true;
    case Q5_K: kquant_cols16<FQ5_K, true>(a, n0, n1); return true;
    case Q6_K: kquant_cols16<FQ6_K, true>(a, n0, n1); return true;
  }
  return false;
}
