// The 16-column layout (repack.h): plain rows <-> repacked groups, in plain C++.
#include "repack.h"

#include <cstring>
#include <vector>

#include "common.h"
#include "formats.h"

namespace kn {

namespace {

// Where a plain 32-value block keeps its fields (formats.cc unpack_block), -1: absent.
struct Fields {
  int bytes, m, qh, qs;
  bool q8;
};

bool fields_of(int fmt, Fields& f) {
  switch (fmt) {
    case Q4_0: f = {18, -1, -1, 2, false}; return true;
    case Q4_1: f = {20, 2, -1, 4, false}; return true;
    case Q5_0: f = {22, -1, 2, 6, false}; return true;
    case Q5_1: f = {24, 2, 4, 8, false}; return true;
    case Q8_0: f = {34, -1, -1, 2, true}; return true;
  }
  return false;
}

// Whether fmt is a K-quant: repacked word by word (repack.h), its block size from format_info.
bool word_layout(int fmt) {
  return fmt == Q2_K || fmt == Q3_K || fmt == Q4_K || fmt == Q5_K || fmt == Q6_K;
}

// The 16 columns' plain K-quant blocks src[c] (B bytes) -> one block in the word layout.
void pack_words(int B, const uint8_t* const* src, uint8_t* dst) {
  const int W = B / 4;
  for (int w = 0; w < W; ++w)
    for (int c = 0; c < 16; ++c) std::memcpy(dst + 64 * w + 4 * c, src[c] + 4 * w, 4);
  for (int c = 0; c < 16; ++c) std::memcpy(dst + 64 * W + (B % 4) * c, src[c] + 4 * W, size_t(B % 4));
}

// Column c's plain K-quant block from the word-layout block at src.
void unpack_words(int B, const uint8_t* src, int c, uint8_t* block) {
  const int W = B / 4;
  for (int w = 0; w < W; ++w) std::memcpy(block + 4 * w, src + 64 * w + 4 * c, 4);
  std::memcpy(block + 4 * W, src + 64 * W + (B % 4) * c, size_t(B % 4));
}

// The byte offsets of the repacked block's parts: m, hi (when present) and v.
struct Parts {
  int m, hi, v;
};

Parts parts_of(const Fields& f) {
  Parts p{-1, -1, 32};
  if (f.m >= 0) { p.m = p.v; p.v += 32; }
  if (f.qh >= 0) { p.hi = p.v; p.v += 64; }
  return p;
}

// The 16 columns' plain blocks src[c] -> one repacked block at dst.
void pack_block(const Fields& f, const uint8_t* const* src, uint8_t* dst) {
  const Parts p = parts_of(f);
  for (int c = 0; c < 16; ++c) {
    std::memcpy(dst + 2 * c, src[c], 2);
    if (p.m >= 0) std::memcpy(dst + p.m + 2 * c, src[c] + f.m, 2);
  }
  if (p.hi >= 0) {
    for (int j = 0; j < 8; ++j) {
      uint64_t h = 0;
      for (int c = 0; c < 16; ++c) {
        const uint32_t qh = load_u32(src[c] + f.qh);
        h |= uint64_t((qh >> (4 * j)) & 0xF) << (4 * c);
      }
      std::memcpy(dst + p.hi + 8 * j, &h, 8);
    }
  }
  const int words = f.q8 ? 8 : 4;
  for (int j = 0; j < words; ++j)
    for (int c = 0; c < 16; ++c)
      for (int i = 0; i < 4; ++i) {
        const uint8_t q = src[c][f.qs + 4 * j + i];
        dst[p.v + 64 * j + 4 * c + i] = f.q8 ? uint8_t(q ^ 0x80) : q;
      }
}

// Column c's plain block from the repacked block at src.
void unpack_column(const Fields& f, const uint8_t* src, int c, uint8_t* block) {
  const Parts p = parts_of(f);
  std::memcpy(block, src + 2 * c, 2);
  if (p.m >= 0) std::memcpy(block + f.m, src + p.m + 2 * c, 2);
  if (p.hi >= 0) {
    uint32_t qh = 0;
    for (int j = 0; j < 8; ++j) {
      uint64_t h;
      std::memcpy(&h, src + p.hi + 8 * j, 8);
      qh |= uint32_t((h >> (4 * c)) & 0xF) << (4 * j);
    }
    std::memcpy(block + f.qh, &qh, 4);
  }
  const int words = f.q8 ? 8 : 4;
  for (int j = 0; j < words; ++j)
    for (int i = 0; i < 4; ++i) {
      const uint8_t q = src[p.v + 64 * j + 4 * c + i];
      block[f.qs + 4 * j + i] = f.q8 ? uint8_t(q ^ 0x80) : q;
    }
}

}  // namespace

bool repackable(int fmt) {
  Fields f;
  return word_layout(fmt) || fields_of(fmt, f);
}

const char* repack16(int fmt, uint8_t* w, int64_t N, int64_t K) {
  if (!repackable(fmt)) return "the weight's format has no 16-column layout";
  Fields f;
  const bool words = !fields_of(fmt, f);
  const int qk = format_info(fmt)->qk, B = format_info(fmt)->bytes;
  if (N <= 0 || K <= 0 || K % qk) return "empty matrix, or K is not a multiple of the block size";
  const int64_t nb = K / qk, rb = nb * B;
  std::vector<uint8_t> rows(size_t(16 * rb));
  for (int64_t g = 0; g < N / 16; ++g) {
    uint8_t* group = w + g * 16 * rb;
    std::memcpy(rows.data(), group, rows.size());
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* src[16];
      for (int c = 0; c < 16; ++c) src[c] = rows.data() + c * rb + b * B;
      if (words)
        pack_words(B, src, group + b * 16 * B);
      else
        pack_block(f, src, group + b * 16 * B);
    }
  }
  return nullptr;
}

void unrepack_block(int fmt, const uint8_t* group, int64_t b, int c, uint8_t* block) {
  Fields f;
  if (fields_of(fmt, f))
    unpack_column(f, group + b * 16 * f.bytes, c, block);
  else if (word_layout(fmt))
    unpack_words(format_info(fmt)->bytes, group + b * 16 * format_info(fmt)->bytes, c, block);
}

void unrepack_group(int fmt, const uint8_t* group, int64_t nb, uint8_t* rows) {
  if (!repackable(fmt)) return;
  const int B = format_info(fmt)->bytes;
  const int64_t rb = nb * B;
  for (int64_t b = 0; b < nb; ++b)
    for (int c = 0; c < 16; ++c) unrepack_block(fmt, group, b, c, rows + c * rb + b * B);
}

}  // namespace kn
