// The GGUF weight block formats as data: bytes and values per block, which activation
// rounding meets them, and one scalar unpack routine per type that turns a block into small
// integers plus its scales. The reference path and the SIMD paths share these; the numpy
// reference (kinetic/kernels/reference.py) mirrors them line by line.
//
// An unpacked block holds the values as int8 (already offset: Q4_0 holds q - 8, Q6_K q - 32)
// and, for K-quants, the integer scale (and min) of each sub-block.
#pragma once

#include <cstdint>

#include "common.h"

namespace kn {

// How llama.cpp's CPU backend rounds the activations that meet a weight type.
enum ActKind : int {
  ACT_F32 = 0,   // F32 weights: x as is
  ACT_F16 = 1,   // F16 weights: x rounded to half
  ACT_BF16 = 2,  // BF16 weights: x rounded to bfloat16
  ACT_Q8_0 = 3,  // blocks of 32: int8 values, f16 scale
  ACT_Q8_1 = 4,  // q8_0 plus s = f16(d * sum of the block's values), for Q4_1 / Q5_1
  ACT_Q8_K = 5,  // blocks of 256: int8 values, f32 scale, sums of each 16 values
};

struct FormatInfo {
  int qk;           // values per block
  int bytes;        // bytes per block
  int sub;          // values per sub-block with its own integer scale (= qk when none)
  ActKind act;
  bool has_min;     // a per-block (Q4_1, Q5_1) or per-sub-block (Q2_K, Q4_K, Q5_K) min
};

// nullptr for a type the kernel does not multiply. A repacked id (repack.h) has its base
// format's info; unpack_block takes plain ids only.
const FormatInfo* format_info(int fmt);

struct Unpacked {
  alignas(64) int8_t q[256];
  float d = 0.f;       // block scale
  float m = 0.f;       // Q4_1 / Q5_1: block min; K-quants with mins: dmin
  int32_t sc[16] = {};  // K-quants: sub-block scales
  int32_t mn[16] = {};  // K-quants with mins: sub-block mins
};

// Unpack block `b` (format fmt) into u. Scalar; the reference for every path.
void unpack_block(int fmt, const uint8_t* b, Unpacked& u);

}  // namespace kn
