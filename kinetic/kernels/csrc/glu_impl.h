// One path of glu.h: its per-element sequence over KN_GLU_W lanes (GCC vector extensions;
// 1: plain floats), as `KN_GLU_NS::rows`. Not a standalone header: glu.cc includes it once
// per path, the wider ones under their target pragmas, with KN_GLU_W and KN_GLU_NS defined
// (and, for W > 1, after the 1-lane path `w1`, which takes the last n % W elements). Its own
// copy of exp_f32.h stays inside the path's anonymous namespace.
namespace KN_GLU_NS {
namespace {
#if KN_GLU_W > 1
typedef float V __attribute__((vector_size(KN_GLU_W * sizeof(float))));
typedef uint32_t VU __attribute__((vector_size(KN_GLU_W * sizeof(uint32_t))));
#define KN_EXP_V V
#define KN_EXP_VU VU
#endif
#include "exp_f32.h"
#undef KN_EXP_V
#undef KN_EXP_VU

// (g * (1 / (1 + exp_any(-g)))) * u, on one float or the lanes of V (TU: its uint32 twin).
template <class T, class TU>
inline T silu_times(T g, T u) {
  const T e = exp_any<T, TU>(-g);
  const T one = T{} + 1.0f;
  return (g * (one / (one + e))) * u;
}
}  // namespace

void rows(const float* g, const float* u, int64_t n, float* y) {
#if KN_GLU_W > 1
  int64_t i = 0;
  for (; i + KN_GLU_W <= n; i += KN_GLU_W) {
    V a, b;
    std::memcpy(&a, g + i, sizeof(V));
    std::memcpy(&b, u + i, sizeof(V));
    const V r = silu_times<V, VU>(a, b);
    std::memcpy(y + i, &r, sizeof(V));
  }
  w1::rows(g + i, u + i, n - i, y + i);
#else
  for (int64_t i = 0; i < n; ++i) y[i] = silu_times<float, uint32_t>(g[i], u[i]);
#endif
}
}  // namespace KN_GLU_NS
