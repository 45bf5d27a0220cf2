// exp in float32 operations only (exp_softmax for x <= 0: the attention's softmax,
// csrc/attention_impl.h; exp_any for any x: the gated feed-forward's sigmoid, csrc/glu.cc),
// the same sequence in every lane, on every path and in the numpy references
// (kernels/reference.py exp_softmax, exp_any).
//
// Not a standalone header: its includer puts it inside its own anonymous namespace (one
// copy per instruction-set path, each with internal linkage), after <cstring>, <cstdint>
// and common.h, and with KN_EXP_V / KN_EXP_VU defined where it has a vector of floats and
// its uint32 twin (GCC vector extensions) to run it on as well as on one float.

// exp(x) for the softmax's x = score - max <= 0, in float32 operations only, each rounded
// on its own (-ffp-contract=off), the same sequence in every lane and on every path, and
// in attention.py's numpy reference (exp_softmax): no libm, whose expf is a scalar call.
//   n = round(x * log2(e)) (adding 1.5 * 2^23 rounds to the nearest integer, ties to even,
//       and leaves n in the sum's low bits); r = (x - n * ln2_hi) - n * ln2_lo
//   p = ((((((P0 r + P1) r + P2) r + P3) r + P4) r + P5) * r^2 + r) + 1   (Cephes' expf)
//   exp = p * 2^n, by adding n to p's exponent bits; 0 below x = -86 (where 2^n would leave
//       the normal floats; e^-86 < 5e-38 next to the max's weight 1) and for a NaN.
// Within 2 ulp of e^x; x = 0 gives exactly 1.
constexpr float kExpLog2e = 1.44269504088896341f, kExpMagic = 12582912.0f;
constexpr float kExpLn2Hi = 0.693359375f, kExpLn2Lo = -2.12194440e-4f;
constexpr float kExpP0 = 1.9875691500e-4f, kExpP1 = 1.3981999507e-3f,
                kExpP2 = 8.3334519073e-3f, kExpP3 = 4.1665795894e-2f,
                kExpP4 = 1.6666665459e-1f, kExpP5 = 5.0000001201e-1f, kExpLow = -86.0f,
                kExpHigh = 88.0f;

// All ones where exp_softmax keeps x's value, zero below kExpLow and for a NaN: for one
// float, and for each lane of KN_EXP_V.
inline uint32_t exp_softmax_kept(float x) { return x >= kExpLow ? ~0u : 0u; }
#ifdef KN_EXP_V
inline KN_EXP_VU exp_softmax_kept(KN_EXP_V x) { return (KN_EXP_VU)(x >= kExpLow); }
#endif

// The sequence above on T, one float or the lanes of KN_EXP_V (TU: its uint32 twin): the
// same operations for both.
template <class T, class TU>
inline T exp_softmax(T x) {
  const T t = x * kExpLog2e + kExpMagic;
  const T n = t - kExpMagic;
  TU tb;
  std::memcpy(&tb, &t, sizeof(TU));
  const TU shift = (tb - f32_to_bits(kExpMagic)) << 23;
  T r = x - n * kExpLn2Hi;
  r = r - n * kExpLn2Lo;
  const T z = r * r;
  T p = r * kExpP0 + kExpP1;
  p = p * r + kExpP2;
  p = p * r + kExpP3;
  p = p * r + kExpP4;
  p = p * r + kExpP5;
  p = p * z + r;
  p = p + 1.0f;
  TU pb;
  std::memcpy(&pb, &p, sizeof(TU));
  pb = (pb + shift) & exp_softmax_kept(x);
  T out;
  std::memcpy(&out, &pb, sizeof(T));
  return out;
}

// e^x for any x: exp_softmax's sequence up to x = 88 (2^n still a normal float's exponent
// there), +inf above (e^88.72 is the largest float; between, the answer is rounded up to
// +inf), 0 below -86 and for a NaN as exp_softmax.
template <class T, class TU>
inline T exp_any(T x) {
  const T big = x > kExpHigh ? T{} + INFINITY : T{};
  const T e = exp_softmax<T, TU>(x > kExpHigh ? T{} : x);
  return x > kExpHigh ? big : e;
}
