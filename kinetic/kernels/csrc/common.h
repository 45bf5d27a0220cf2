// Shared scalar helpers of kinetic's kernels: half and bfloat16 conversions (exact, in
// software, so every path and the numpy reference agree), and the GGML type ids.
#pragma once

#include <cstdint>
#include <cstring>

namespace kn {

// GGML type ids as stored in GGUF files (ggml.h's enum ggml_type).
enum Format : int {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30,
};

inline float bits_to_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t f32_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

// IEEE half -> float, exact for every input (subnormals, inf, NaN).
inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  if (exp == 0x1F) return bits_to_f32(sign | 0x7F800000u | (man << 13));
  if (exp == 0) {
    if (man == 0) return bits_to_f32(sign);
    // subnormal: man * 2^-24, exact in float
    float v = float(man) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  return bits_to_f32(sign | ((exp + 112) << 23) | (man << 13));
}

// float -> IEEE half, round to nearest even (as numpy's astype(float16) and F16C do).
inline uint16_t f32_to_f16(float f) {
  uint32_t u = f32_to_bits(f);
  uint32_t sign = (u >> 16) & 0x8000;
  uint32_t a = u & 0x7FFFFFFFu;
  if (a >= 0x7F800000u) return uint16_t(sign | 0x7C00 | (a > 0x7F800000u ? 0x200 : 0));
  if (a >= 0x477FF000u) return uint16_t(sign | 0x7C00);  // rounds to inf
  if (a < 0x38800000u) {  // result is subnormal or zero: scale to units of 2^-24
    float v = bits_to_f32(a) * 16777216.0f;  // exact (power-of-two scaling of a small value)
    // round half to even via the float adder's own rounding
    float r = (v + 12582912.0f) - 12582912.0f;  // 1.5 * 2^23 trick, v < 1024
    return uint16_t(sign | uint32_t(r));
  }
  uint32_t mant_odd = (a >> 13) & 1;
  a += 0xFFF + mant_odd;  // round to nearest even on the 13 dropped bits
  return uint16_t(sign | ((a - 0x38000000u) >> 13));
}

inline float round_f16(float f) { return f16_to_f32(f32_to_f16(f)); }

inline float bf16_to_f32(uint16_t h) { return bits_to_f32(uint32_t(h) << 16); }

// float -> bfloat16, round to nearest even (NaN stays NaN).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_to_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

inline uint16_t load_u16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }
inline uint32_t load_u32(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }
inline float load_f16(const uint8_t* p) { return f16_to_f32(load_u16(p)); }

// A KV cache's element types: F32, F16, BF16, or Q8_0 (rows of blocks of 32 values: an f16
// scale d then 32 int8 q, each value d * q, as GGUF stores Q8_0 weights; a row's length a
// multiple of 32).
inline bool cache_format(int fmt) { return fmt == F32 || fmt == F16 || fmt == BF16 || fmt == Q8_0; }
constexpr int64_t Q8_0_BLOCK = 32, Q8_0_BYTES = 34;

// The units a cache row of n values takes in its array's last dimension: n for the float
// types, Q8_0's bytes for Q8_0 (n / 32 blocks of 34), or -1 where n does not fit fmt.
inline int64_t cache_row_width(int fmt, int64_t n) {
  if (fmt != Q8_0) return n;
  return n % Q8_0_BLOCK ? -1 : n / Q8_0_BLOCK * Q8_0_BYTES;
}

}  // namespace kn
