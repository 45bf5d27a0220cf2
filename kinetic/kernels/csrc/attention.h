// Paged attention with one fixed order of operations per (row, query head), so that a row's
// output bits depend only on its own query, its own slot's keys and values, and its position:
// never on the other rows of the step, on T, on S or P, on the thread count or on the ISA.
//
// For row t (slot s = slots[t], position pos = positions[t], end e = ends[t], or pos
// without ends) and query head h (kv head kh = h / (H / K)), the visible keys are
// l = lo..e (lo = 0, or max(0, pos - window + 1) with a window: the window's lower bound is
// always from the row's own position), key l being row l % page_size of page
// page_table[s, l / page_size]. Causal rows have e = pos; a row of an image that attends to
// itself both ways (Gemma 3's) has e = the image's last position, e >= pos, as llama.cpp
// masks key p0 for query p1 when (causal and p0 > p1) or p1 - p0 >= window:
//
//   qs[j]    = round_to_cache_dtype(q[t, h, j]) * scale                 (f32; a q8_0 cache:
//              q8_0(q[t, h, :])[j] * scale, the head's row quantized in blocks of 32 as
//              llama.cpp quantizes a query for q8_0 keys, then read back exactly)
//   score_l  = ((0 + qs[0]*k_l[0]) + qs[1]*k_l[1]) + ... + qs[Q-1]*k_l[Q-1]
//              (every product rounded, then added: no FMA)
//   score_l  = softcap * tanhf(score_l / softcap)                       (if softcap > 0)
//   m        = max_l score_l
//   p_l      = exp_softmax(score_l - m)   (attention_impl.h: float32 operations only)
//   den      = ((0 + p_lo) + p_lo+1) + ... + p_e
//   o[j]     = ((0 + p_lo*v_lo[j]) + p_lo+1*v_lo+1[j]) + ... + p_e*v_e[j]
//   out[t, h, j] = o[j] / den
//
// q is rounded to the cache's storage type first, as layers.paged_attention does (llama.cpp
// meets an f16 cache with f16 queries); for an f32 cache that is the identity. The SIMD
// paths round to half with F16C, the scalar path in software: the same bits for every
// number (attention_impl.h, round_scale_row).
//
// The SIMD paths vectorize the scores across keys (a lane per key, each lane summing over j
// in order) and the weighted values across j (a lane per j, summing over l in order), so
// every element sees exactly the scalar sequence above. exp_softmax is written out in
// float32 multiplies, adds and bit moves (a lane per key on the SIMD paths, the same
// sequence); tanhf, for a softcap only, is the scalar libm function on every path. Cache
// elements are read as float exactly (half and bfloat16 -> float lose nothing, nor does a
// q8_0 block's d * q: 11 bits times 8); the one exception is a signalling-NaN half, which
// the SIMD paths' hardware conversion reads quieted, and which no KV cache holds
// (attention_impl.h).
//
// A prompt chunk's rows (one slot, consecutive positions, ends that never decrease: an
// image's rows share one end, the rows after it go on from there) run as one unit, a group:
// their keys together (the first row's lo to the last row's end) are gathered, converted
// and moved to a lane per key once, block by block, each block is scored for every row of
// the group that sees some of its keys, and each value row is converted once for all the
// rows that weigh it. A key's score is the same sum whichever rows share its block, a row
// reads only the scores of its own keys lo..e, and its softmax and value sums run over them
// in the order above; so a group, like the thread split, changes no bit of any row.
#pragma once

#include <cstdint>

#include "cpu.h"
#include "parallel.h"

namespace kn {

struct AttnArgs {
  const float* q;            // [T, H, Q]
  const void* k;             // [num_pages, page_size, K, Q]  in k_fmt (F32, F16, BF16 or
                             // Q8_0: a row of Q values is Q / 32 blocks, common.h)
  const void* v;             // [num_pages, page_size, K, Qv] in v_fmt
  int k_fmt, v_fmt;          // kn::Format ids: F32, F16, BF16, Q8_0
  const int32_t* page_table; // [S, P]
  const int32_t* slots;      // [T]
  const int32_t* positions;  // [T]
  const int32_t* ends;       // [T] each row's last visible key, >= its position; nullptr:
                             // the positions (causal)
  float* out;                // [T, H, Qv]
  int64_t T, H, K, Q, Qv;
  int64_t num_pages, page_size, S, P;
  float scale;
  int64_t window;            // 0: none; else keys with key_pos > pos - window
  float softcap;             // <= 0: none
};

// nullptr if every index the kernel would follow is in range, else what is wrong.
const char* check_attention(const AttnArgs& a);

constexpr int64_t ATTN_KEY_BLOCK = 64;  // keys per block: lanes of the score pass
constexpr int64_t ATTN_MAX_GROUP = 16;  // most rows of a prompt chunk in one unit

// out = attention(a), checked first (returns check_attention's message, or nullptr).
// Work is split over (group of rows, kv head) units; each unit is computed whole by one
// thread. A group is at most max_group rows (fewer when that keeps the threads evenly
// busy; 1: every row on its own). Neither changes a bit of the result.
const char* attention(const AttnArgs& a, Isa isa, int threads, const Schedule& schedule,
                      int64_t max_group = ATTN_MAX_GROUP);

// Row t's last visible key: ends[t], or its position without ends.
inline int64_t attention_end(const AttnArgs& a, int64_t t) {
  return a.ends ? a.ends[t] : a.positions[t];
}

// Row t's visible keys lo..lo+n-1 (lo from its position and the window, the last its end)
// and the scores' length npad (whole key blocks); a checked row has 0 <= pos <= end, so
// n >= 1.
struct AttnSpan { int64_t lo, n, npad; };
inline AttnSpan attention_span(const AttnArgs& a, int64_t t) {
  const int64_t pos = a.positions[t];
  int64_t lo = a.window > 0 ? pos - a.window + 1 : 0;
  if (lo < 0) lo = 0;
  const int64_t n = attention_end(a, t) - lo + 1;
  return {lo, n, (n + ATTN_KEY_BLOCK - 1) / ATTN_KEY_BLOCK * ATTN_KEY_BLOCK};
}

// The keys of a group, rows t0..t0+R-1 of one slot at consecutive positions with ends that
// never decrease (R = 1: any row): from the first row's lo to the last row's end, scored
// in whole key blocks from there (npad). Row t0 + r's own keys are a part of them, from
// attention_span's lo to its end.
inline AttnSpan attention_group_span(const AttnArgs& a, int64_t t0, int64_t R) {
  const int64_t lo = attention_span(a, t0).lo, n = attention_end(a, t0 + R - 1) - lo + 1;
  return {lo, n, (n + ATTN_KEY_BLOCK - 1) / ATTN_KEY_BLOCK * ATTN_KEY_BLOCK};
}

// Floats of scratch one unit of group (t0, R) needs (attention_impl.h lays them out); it
// also takes attention_group_span(a, t0, R).n int64 cache-row indices.
inline int64_t attention_scratch(const AttnArgs& a, int64_t t0, int64_t R) {
  const AttnSpan sp = attention_group_span(a, t0, R);
  const int64_t G = a.H / a.K;
  return R * G * a.Q + a.Q + 2 * a.Q * ATTN_KEY_BLOCK + R * G * sp.npad +
         ATTN_KEY_BLOCK * a.Qv + R * G * a.Qv + R * G;
}

// One (group, kv head) unit: the H / K query heads of kv head kh for rows t0..t0+R-1
// (1 <= R <= ATTN_MAX_GROUP), written to a.out (the per-ISA bodies of attention_impl.h; the
// caller has checked `a`, made the group as attention_group_span describes and passes
// attention_scratch(a, t0, R) floats and n int64s of scratch).
void attention_unit_scalar(const AttnArgs& a, int64_t t0, int64_t R, int64_t kh,
                           float* scratch, int64_t* rows);
void attention_unit_avx2(const AttnArgs& a, int64_t t0, int64_t R, int64_t kh,
                         float* scratch, int64_t* rows);
void attention_unit_avx512(const AttnArgs& a, int64_t t0, int64_t R, int64_t kh,
                           float* scratch, int64_t* rows);

}  // namespace kn
