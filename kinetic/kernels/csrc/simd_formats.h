// SIMD unpacking of every block format straight from its packed bytes, shared by the AVX2
// and AVX-512 paths (qmatmul_avx2.cc, qmatmul_avx512.cc). Not a standalone header: each of
// those files includes it inside its own anonymous namespace, after defining
//   KN_SIMD / KN_INL          its target attribute (and always_inline),
//   dotu(acc, u, x)           acc + the 8 int32 sums of 4 products u8 * s8 (u <= 128),
//   bit4_of(bits)             32 bytes, byte i = 0x10 where bit i of bits is set,
//   dot256_wide(u, s, x)      dot256 below over 8 chunks u[i] / scales s[i] held in memory
//                             (or KN_NO_WIDE, to keep dot256's own loop),
// so that every function here is compiled for that path only (internal linkage each time).
//
// A weight value is always held as an unsigned byte u, the format's value being u - OFF
// (Q4_0: OFF 8, Q5_0: 16, Q6_K: 32, Q3_K: 4, the others 0). The integer identity
//   sum_j sc_j * ((u_j - OFF) . x_j) = sum_j sc_j * (u_j . x_j) - OFF * sum_j sc_j * xsum_j
// is exact, so the block sums equal the reference's unpack_block + dot bit for bit.
//
// Format interface (the driver, simd_driver.h, uses nothing else):
//   QK, BYTES         values and bytes per block
//   KIND              0: acc + sumi*(d*dx); 1: Q8_1 (+ m*sx); 2: K-quant mins (- summ*(m*dx))
//   XOFF              legacy blocks: OFF, subtracted as XOFF * (sum of the 32 activations)
//   DOFF, DHI         the block's u32 at byte DOFF holds d in its low half (m, if any, in
//                     its high half), or with DHI set d in its high half
//   W, load(b, w)     unpack block b into w
//   dot<WIDE>(w, xq, bs16, q) 8 int32 partials of sumi (and of summ into q for KIND 2);
//                            bs16: the activation block's 16-value sums as int16 (K-quants)

// ---- small helpers ------------------------------------------------------------------

KN_INL __m256i ld256(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
KN_INL __m256i ld256(const int8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
KN_INL __m128i ld128(const uint8_t* p) { return _mm_loadu_si128((const __m128i*)p); }
KN_INL __m256i bytes8(int v) { return _mm256_set1_epi8(char(v)); }

// 16 packed bytes -> 32 values: low nibbles are values 0..15, high nibbles 16..31.
KN_INL __m256i nibbles16(const uint8_t* p) {
  const __m256i q = _mm256_broadcastsi128_si256(ld128(p));
  return _mm256_and_si256(_mm256_srlv_epi64(q, _mm256_set_epi64x(4, 4, 0, 0)), bytes8(0x0F));
}

// acc + scale-weighted pair sums: the 16 int16 pair sums of u * x (no saturation for
// u <= 63), each pair times its int16 scale, summed in pairs to 8 int32.
KN_INL __m256i dot_scaled(__m256i acc, __m256i u, __m256i x, __m256i sc) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), sc));
}

// Scale vectors for 32-value chunks from per-16-value-group int16 scales g[16]:
// chunk i gets g[2i] on its first 16 values (int16 lanes 0..7) and g[2i+1] on the rest.
KN_INL void chunk_scales(__m256i g, __m256i* s) {
  const __m256i lo = _mm256_permute2x128_si256(g, g, 0x00), hi = _mm256_permute2x128_si256(g, g, 0x11);
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const __m256i pick = _mm256_set_m128i(_mm_set1_epi16(short(0x0302 + 0x0404 * i)),
                                          _mm_set1_epi16(short(0x0100 + 0x0404 * i)));
    s[i] = _mm256_shuffle_epi8(lo, pick);
    s[i + 4] = _mm256_shuffle_epi8(hi, pick);
  }
}

// 8 uint8 values -> 16 int16, each twice (a 32-value sub-block covers two 16-value groups).
KN_INL __m256i twice16(__m128i v8) {
  const __m128i w = _mm_cvtepu8_epi16(v8);
  return _mm256_set_m128i(_mm_unpackhi_epi16(w, w), _mm_unpacklo_epi16(w, w));
}

// ---- 32-value legacy blocks ---------------------------------------------------------

struct W32 { __m256i u; };

KN_INL __m256i dot32(const W32& w, const int8_t* xq) {
  return dotu(_mm256_setzero_si256(), w.u, ld256(xq));
}

// Legacy formats also give the multi-row loops (simd_legacy8.h, simd_legacy16.h) W16: how
// many activation words' maddubs pair sums can be added as int16 without overflow (u <= 15:
// 8, u <= 31: 4), and SIGNED: the values are signed weights (Q8_0 on AVX2's sign trick).

struct FQ4_0 {  // d | qs[16]
  static constexpr int QK = 32, BYTES = 18, KIND = 0, XOFF = 8, DOFF = 0, DHI = 0;
  static constexpr int W16 = 8;
  static constexpr bool SIGNED = false;
  using W = W32;
  KN_INL static void load(const uint8_t* b, W& w) {
    w.u = nibbles16(b + 2);
  }
  template <bool>
  KN_INL static __m256i dot(const W& w, const int8_t* xq, const int16_t*, __m256i&) { return dot32(w, xq); }
};

struct FQ4_1 {  // d | m | qs[16]
  static constexpr int QK = 32, BYTES = 20, KIND = 1, XOFF = 0, DOFF = 0, DHI = 0;
  static constexpr int W16 = 8;
  static constexpr bool SIGNED = false;
  using W = W32;
  KN_INL static void load(const uint8_t* b, W& w) {
    w.u = nibbles16(b + 4);
  }
  template <bool>
  KN_INL static __m256i dot(const W& w, const int8_t* xq, const int16_t*, __m256i&) { return dot32(w, xq); }
};

struct FQ5_0 {  // d | qh u32 | qs[16]
  static constexpr int QK = 32, BYTES = 22, KIND = 0, XOFF = 16, DOFF = 0, DHI = 0;
  static constexpr int W16 = 4;
  static constexpr bool SIGNED = false;
  using W = W32;
  KN_INL static void load(const uint8_t* b, W& w) {
    w.u = _mm256_or_si256(nibbles16(b + 6), bit4_of(load_u32(b + 2)));
  }
  template <bool>
  KN_INL static __m256i dot(const W& w, const int8_t* xq, const int16_t*, __m256i&) { return dot32(w, xq); }
};

struct FQ5_1 {  // d | m | qh u32 | qs[16]
  static constexpr int QK = 32, BYTES = 24, KIND = 1, XOFF = 0, DOFF = 0, DHI = 0;
  static constexpr int W16 = 4;
  static constexpr bool SIGNED = false;
  using W = W32;
  KN_INL static void load(const uint8_t* b, W& w) {
    w.u = _mm256_or_si256(nibbles16(b + 8), bit4_of(load_u32(b + 4)));
  }
  template <bool>
  KN_INL static __m256i dot(const W& w, const int8_t* xq, const int16_t*, __m256i&) { return dot32(w, xq); }
};

// ---- 256-value K-quant blocks -------------------------------------------------------

// u[i]: values 32i .. 32i+31; s[i]: their int16 scales (chunk_scales); c: the per-16-group
// int16 coefficient on the activation's 16-value sums (OFF * scale, or the min).
struct W256 { __m256i u[8], s[8], c; };

// sum_i (u_i . x_i) weighted by the sub-block scales, as 8 int32 partials. WIDE: w lives in
// memory (several rows), so a path may read chunk pairs as one wider vector (dot256_wide).
template <bool WIDE>
KN_INL __m256i dot256(const W256& w, const int8_t* xq) {
#ifndef KN_NO_WIDE
  if (WIDE) return dot256_wide(w.u, w.s, xq);
#endif
  __m256i acc = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) acc = dot_scaled(acc, w.u[i], ld256(xq + 32 * i), w.s[i]);
  return acc;
}

KN_INL __m256i ld_bs16(const int16_t* bs) { return _mm256_loadu_si256((const __m256i*)bs); }

// Q4_K / Q5_K: the 12 packed bytes -> bytes 0..7 the 6-bit scales, 8..15 the 6-bit mins
// (formats.cc k4_scale_min, four at a time in 32-bit words).
KN_INL __m128i k4_scales_mins(const uint8_t* s) {
  uint32_t t[3];
  std::memcpy(t, s, 12);
  const uint32_t m6 = 0x3f3f3f3fu, m4 = 0x0f0f0f0fu, m2 = 0x03030303u;
  const uint32_t sc_lo = t[0] & m6, sc_hi = (t[2] & m4) | (((t[0] >> 6) & m2) << 4);
  const uint32_t mn_lo = t[1] & m6, mn_hi = ((t[2] >> 4) & m4) | (((t[1] >> 6) & m2) << 4);
  return _mm_set_epi32(int(mn_hi), int(mn_lo), int(sc_hi), int(sc_lo));
}

// Shared by Q4_K and Q5_K: scales, mins and the nibbles of qs[128].
KN_INL void k4_common(const uint8_t* b, const uint8_t* qs, W256& w) {
  const __m128i sm = k4_scales_mins(b + 4);
  chunk_scales(twice16(sm), w.s);
  w.c = twice16(_mm_unpackhi_epi64(sm, sm));
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    const __m256i q = ld256(qs + 32 * c);
    w.u[2 * c] = _mm256_and_si256(q, bytes8(0x0F));
    w.u[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), bytes8(0x0F));
  }
}

struct FQ4_K {  // d | dmin | scales[12] | qs[128]
  static constexpr int QK = 256, BYTES = 144, KIND = 2, XOFF = 0, DOFF = 0, DHI = 0;
  using W = W256;
  KN_INL static void load(const uint8_t* b, W& w) {
    k4_common(b, b + 16, w);
  }
  template <bool WIDE>
  KN_INL static __m256i dot(const W& w, const int8_t* xq, const int16_t* bs, __m256i& q) {
    q = _mm256_madd_epi16(w.c, ld_bs16(bs));
    return dot256<WIDE>(w, xq);
  }
};

struct FQ5_K {  // d | dmin | scales[12] | qh[32] | qs[128]; bit i of qh[l]: bit 4 of 32i + l
  static constexpr int QK = 256, BYTES = 176, KIND = 2, XOFF = 0, DOFF = 0, DHI = 0;
  using W = W256;
  KN_INL static void load(const uint8_t* b, W& w) {
    k4_common(b, b + 48, w);
    const __m256i qh = ld256(b + 16);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const __m256i bit = bytes8(1 << i);
      const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
      w.u[i] = _mm256_or_si256(w.u[i], _mm256_and_si256(set, bytes8(0x10)));
    }
  }
  template <bool WIDE>
  KN_INL static __m256i dot(const W& w, const int8_t* xq, const int16_t* bs, __m256i& q) {
    q = _mm256_madd_epi16(w.c, ld_bs16(bs));
    return dot256<WIDE>(w, xq);
  }
};

struct FQ6_K {  // ql[128] | qh[64] | scales int8[16] | d; value = (lo | hi << 4) - 32
  static constexpr int QK = 256, BYTES = 210, KIND = 0, XOFF = 0, DOFF = 206, DHI = 1;
  using W = W256;
  KN_INL static void load(const uint8_t* b, W& w) {
    const __m256i m4 = bytes8(0x0F), m30 = bytes8(0x30);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // 128 values: ql[64h..64h+63], qh[32h..32h+31]
      const __m256i l0 = ld256(b + 64 * h), l1 = ld256(b + 64 * h + 32), qh = ld256(b + 128 + 32 * h);
      w.u[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
      w.u[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
      w.u[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(qh, m30));
      w.u[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                       _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
    }
    const __m256i g = _mm256_cvtepi8_epi16(ld128(b + 192));
    chunk_scales(g, w.s);
    w.c = _mm256_slli_epi16(g, 5);  // OFF 32 times the scale
  }
  template <bool WIDE>
  KN_INL static __m256i dot(const W& w, const int8_t* xq, const int16_t* bs, __m256i&) {
    return _mm256_sub_epi32(dot256<WIDE>(w, xq), _mm256_madd_epi16(w.c, ld_bs16(bs)));
  }
};

struct FQ3_K {  // hmask[32] | qs[64] | scales[12] | d; value = (lo | hbit << 2) - 4
  static constexpr int QK = 256, BYTES = 110, KIND = 0, XOFF = 0, DOFF = 106, DHI = 1;
  using W = W256;
  KN_INL static void load(const uint8_t* b, W& w) {
    const __m256i hm = ld256(b), m3 = bytes8(3);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256i q = ld256(b + 32 + 32 * h);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const int i = 4 * h + j;
        const __m256i bit = bytes8(1 << i);
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit);
        w.u[i] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 2 * j), m3),
                                 _mm256_and_si256(set, bytes8(4)));
      }
    }
    // 16 6-bit scales (formats.cc), four at a time in 32-bit words, then minus 32.
    uint32_t t[3];
    std::memcpy(t, b + 96, 12);
    const uint32_t m4 = 0x0f0f0f0fu, m2 = 0x03030303u;
    const uint32_t s0 = (t[0] & m4) | ((t[2] & m2) << 4), s1 = (t[1] & m4) | (((t[2] >> 2) & m2) << 4);
    const uint32_t s2 = ((t[0] >> 4) & m4) | (((t[2] >> 4) & m2) << 4);
    const uint32_t s3 = ((t[1] >> 4) & m4) | (((t[2] >> 6) & m2) << 4);
    const __m256i g = _mm256_sub_epi16(
        _mm256_cvtepu8_epi16(_mm_set_epi32(int(s3), int(s2), int(s1), int(s0))), _mm256_set1_epi16(32));
    chunk_scales(g, w.s);
    w.c = _mm256_slli_epi16(g, 2);  // OFF 4 times the scale
  }
  template <bool WIDE>
  KN_INL static __m256i dot(const W& w, const int8_t* xq, const int16_t* bs, __m256i&) {
    return _mm256_sub_epi32(dot256<WIDE>(w, xq), _mm256_madd_epi16(w.c, ld_bs16(bs)));
  }
};

struct FQ2_K {  // scales[16] (lo 4 scale, hi 4 min) | qs[64] | d | dmin
  static constexpr int QK = 256, BYTES = 84, KIND = 2, XOFF = 0, DOFF = 80, DHI = 0;
  using W = W256;
  KN_INL static void load(const uint8_t* b, W& w) {
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256i q = ld256(b + 16 + 32 * h);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) w.u[4 * h + j] = _mm256_and_si256(_mm256_srli_epi16(q, 2 * j), bytes8(3));
    }
    const __m128i s = ld128(b), m4 = _mm_set1_epi8(0x0F);
    chunk_scales(_mm256_cvtepu8_epi16(_mm_and_si128(s, m4)), w.s);
    w.c = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s, 4), m4));
  }
  template <bool WIDE>
  KN_INL static __m256i dot(const W& w, const int8_t* xq, const int16_t* bs, __m256i& q) {
    q = _mm256_madd_epi16(w.c, ld_bs16(bs));
    return dot256<WIDE>(w, xq);
  }
};
