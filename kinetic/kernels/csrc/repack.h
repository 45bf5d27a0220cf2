// The 16-column layout of the block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; the K-quants): the
// same bytes as the GGUF rows, rearranged once at load so that the AVX-512 path reads each
// block of 16 columns as the vectors it multiplies, instead of transposing 16 rows' bytes
// and gathering their scales on every call. The arithmetic does not change, so neither do
// the bits: a repacked weight gives every path the plain weight's results.
//
// A repacked matrix (format id fmt | kRepack16) of N rows: rows [0, N16), N16 = N / 16 * 16,
// form groups of 16 rows; rows [N16, N) stay plain GGUF rows where they were. Group g fills
// the bytes of its 16 plain rows (16 * row_bytes from row 16 g), block after block; block b
// of the group is 16 * B bytes (B: the format's block bytes) at b * 16 * B:
//
//   d[16]      u16 halves, column c's block scale                  32 bytes
//   m[16]      Q4_1 / Q5_1: u16 halves, column c's block min       32 bytes
//   hi[8]      Q5_0 / Q5_1: u64; bit 4c + i of hi[j] is the 5th    64 bytes
//              bit of column c's value 4j + i
//   v[J][64]   the values; byte 4c + i of v[j] is column c's       Q8_0: 8 x 64 bytes
//              value 4j + i (Q8_0: the int8 value xor 0x80, i.e.   the rest: 4 x 64 bytes
//              value + 128); the 4-bit formats hold two values
//              a byte, as their qs: value 4j + i in the low
//              nibble, value 16 + 4j + i in the high one
//
// A K-quant block (Q2_K .. Q6_K, 256 values, B = 84, 110, 144, 176 or 210 bytes) of a group
// is its 16 columns' blocks word by word: W = B / 4 vectors of 64 bytes, byte 4c + i of
// vector w being byte 4w + i of column c's block, then the B % 4 bytes left of each block
// (Q3_K's and Q6_K's d), column after column. The AVX-512 path's loads then replace the
// transposes it did on plain rows (simd_kquant16.h).
//
// Sizes: 16 * B for each format (Q8_0 32 + 512 = 16 * 34; Q4_0 32 + 256 = 16 * 18; Q4_1 64 +
// 256; Q5_0 32 + 64 + 256; Q5_1 64 + 64 + 256), so a repacked matrix is its plain size and
// every offset into the file stays valid. kinetic/kernels/reference.py repack16 is the same
// layout in numpy.
#pragma once

#include <cstdint>

namespace kn {

constexpr int kRepack16 = 256;  // format id flag: the 16-column layout of the base format

inline bool is_repacked(int fmt) { return (fmt & kRepack16) != 0; }
inline int base_format(int fmt) { return fmt & ~kRepack16; }
inline int64_t repacked_rows(int64_t N) { return N / 16 * 16; }

// Whether fmt (a plain id) has a 16-column layout.
bool repackable(int fmt);

// Rearrange N rows of K values of format fmt (plain) in place into fmt | kRepack16. nullptr,
// or a message saying why not (the bytes are then untouched).
const char* repack16(int fmt, uint8_t* w, int64_t N, int64_t K);

// The 16 plain rows (16 * row_bytes) of one repacked group of nb blocks; fmt plain.
void unrepack_group(int fmt, const uint8_t* group, int64_t nb, uint8_t* rows);

// Column c's plain block b (B bytes) of one repacked group; fmt plain.
void unrepack_block(int fmt, const uint8_t* group, int64_t b, int c, uint8_t* block);

}  // namespace kn
