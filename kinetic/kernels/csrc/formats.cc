#include "formats.h"

#include "repack.h"

namespace kn {

const FormatInfo* format_info(int fmt) {
  if (is_repacked(fmt))  // the 16-column layout (repack.h): the base format's blocks
    return repackable(base_format(fmt)) ? format_info(base_format(fmt)) : nullptr;
  static const FormatInfo q4_0{32, 18, 32, ACT_Q8_0, false}, q4_1{32, 20, 32, ACT_Q8_1, true},
      q5_0{32, 22, 32, ACT_Q8_0, false}, q5_1{32, 24, 32, ACT_Q8_1, true},
      q8_0{32, 34, 32, ACT_Q8_0, false}, q2_k{256, 84, 16, ACT_Q8_K, true},
      q3_k{256, 110, 16, ACT_Q8_K, false}, q4_k{256, 144, 32, ACT_Q8_K, true},
      q5_k{256, 176, 32, ACT_Q8_K, true}, q6_k{256, 210, 16, ACT_Q8_K, false},
      f32{1, 4, 1, ACT_F32, false}, f16{1, 2, 1, ACT_F16, false}, bf16{1, 2, 1, ACT_BF16, false};
  switch (fmt) {
    case Q4_0: return &q4_0;
    case Q4_1: return &q4_1;
    case Q5_0: return &q5_0;
    case Q5_1: return &q5_1;
    case Q8_0: return &q8_0;
    case Q2_K: return &q2_k;
    case Q3_K: return &q3_k;
    case Q4_K: return &q4_k;
    case Q5_K: return &q5_k;
    case Q6_K: return &q6_k;
    case F32: return &f32;
    case F16: return &f16;
    case BF16: return &bf16;
  }
  return nullptr;
}

namespace {

// Q4_0 / Q4_1 / Q5_0 / Q5_1: element i < 16 is the low nibble of qs[i], element i + 16 the
// high nibble; the 5-bit types take bit i of the little-endian u32 qh as bit 4 of element i.
void legacy32(const uint8_t* qs, const uint8_t* qh, int offset, int8_t* q) {
  uint32_t h = qh ? load_u32(qh) : 0;
  for (int i = 0; i < 16; ++i) {
    int lo = qs[i] & 0x0F, hi = qs[i] >> 4;
    if (qh) {
      lo |= int((h >> i) & 1) << 4;
      hi |= int((h >> (i + 16)) & 1) << 4;
    }
    q[i] = int8_t(lo - offset);
    q[i + 16] = int8_t(hi - offset);
  }
}

// Q4_K / Q5_K: the 6-bit scale and min of sub-block j from the 12 packed bytes.
void k4_scale_min(const uint8_t* s, int j, int32_t& sc, int32_t& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

}  // namespace

void unpack_block(int fmt, const uint8_t* b, Unpacked& u) {
  switch (fmt) {
    case Q4_0: u.d = load_f16(b); legacy32(b + 2, nullptr, 8, u.q); return;
    case Q4_1: u.d = load_f16(b); u.m = load_f16(b + 2); legacy32(b + 4, nullptr, 0, u.q); return;
    case Q5_0: u.d = load_f16(b); legacy32(b + 6, b + 2, 16, u.q); return;
    case Q5_1: u.d = load_f16(b); u.m = load_f16(b + 2); legacy32(b + 8, b + 4, 0, u.q); return;
    case Q8_0:
      u.d = load_f16(b);
      for (int i = 0; i < 32; ++i) u.q[i] = int8_t(b[2 + i]);
      return;
    case Q2_K: {  // scales[16] | qs[64] | d | dmin
      const uint8_t* qs = b + 16;
      for (int e = 0; e < 256; ++e) {
        int h = e / 128, j = (e % 128) / 32, l = e % 32;
        u.q[e] = int8_t((qs[h * 32 + l] >> (2 * j)) & 3);
      }
      for (int k = 0; k < 16; ++k) { u.sc[k] = b[k] & 0x0F; u.mn[k] = b[k] >> 4; }
      u.d = load_f16(b + 80);
      u.m = load_f16(b + 82);
      return;
    }
    case Q3_K: {  // hmask[32] | qs[64] | scales[12] | d; a clear hmask bit means "minus 4"
      const uint8_t *hm = b, *qs = b + 32, *s = b + 96;
      for (int e = 0; e < 256; ++e) {
        int h = e / 128, j = (e % 128) / 32, l = e % 32;
        int low = (qs[h * 32 + l] >> (2 * j)) & 3;
        int high = (hm[l] >> (e / 32)) & 1;
        u.q[e] = int8_t(low - (high ? 0 : 4));
      }
      for (int k = 0; k < 16; ++k) {
        int lo = k < 8 ? (s[k] & 0x0F) : (s[k - 8] >> 4);
        int hi = (s[8 + k % 4] >> (2 * (k / 4))) & 3;
        u.sc[k] = (lo | (hi << 4)) - 32;
      }
      u.d = load_f16(b + 108);
      return;
    }
    case Q4_K:
    case Q5_K: {  // d | dmin | scales[12] | (Q5_K: qh[32]) | qs[128]
      const uint8_t* qs = b + (fmt == Q4_K ? 16 : 48);
      const uint8_t* qh = fmt == Q5_K ? b + 16 : nullptr;
      for (int e = 0; e < 256; ++e) {
        int c = e / 64, h = (e % 64) / 32, l = e % 32;
        int v = (qs[c * 32 + l] >> (4 * h)) & 0x0F;
        if (qh) v |= ((qh[e % 32] >> (e / 32)) & 1) << 4;
        u.q[e] = int8_t(v);
      }
      for (int j = 0; j < 8; ++j) k4_scale_min(b + 4, j, u.sc[j], u.mn[j]);
      u.d = load_f16(b);
      u.m = load_f16(b + 2);
      return;
    }
    case Q6_K: {  // ql[128] | qh[64] | scales int8[16] | d
      const uint8_t *ql = b, *qh = b + 128;
      for (int e = 0; e < 256; ++e) {
        int h = e / 128, k = (e % 128) / 32, l = e % 32;
        int lo = (ql[h * 64 + (k % 2) * 32 + l] >> (4 * (k / 2))) & 0x0F;
        int hi = (qh[h * 32 + l] >> (2 * k)) & 3;
        u.q[e] = int8_t((lo | (hi << 4)) - 32);
      }
      for (int k = 0; k < 16; ++k) u.sc[k] = int8_t(b[192 + k]);
      u.d = load_f16(b + 208);
      return;
    }
  }
}

}  // namespace kn
