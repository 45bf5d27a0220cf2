#include "cpu.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#include <cstdlib>
#include <cstring>
#include <initializer_list>

namespace kn {

#if defined(__x86_64__) || defined(__i386__)
namespace {
// CPUID leaf 1, ECX bit 29 (cpuid.h's bit_F16C).
bool has_f16c() {
  unsigned eax, ebx, ecx, edx;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
}

// CPUID leaf 0's vendor: AMD's, or Hygon's (the same cores).
bool amd_vendor() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return false;
  char v[13];
  std::memcpy(v, &ebx, 4);
  std::memcpy(v + 4, &edx, 4);
  std::memcpy(v + 8, &ecx, 4);
  v[12] = 0;
  return std::strcmp(v, "AuthenticAMD") == 0 || std::strcmp(v, "HygonGenuine") == 0;
}

// CPUID leaf 1's display family (base family, plus the extended family where the base is 15):
// AMD's 0x17 is Zen 1 and 2, 0x19 Zen 3 and 4, 0x1A Zen 5.
unsigned cpu_family() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return 0;
  const unsigned base = (eax >> 8) & 0xF;
  return base == 0xF ? base + ((eax >> 20) & 0xFF) : base;
}
}  // namespace
#endif

namespace {
bool probe_isa(Isa isa) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  switch (isa) {
    case ISA_SCALAR: return true;
    case ISA_AVX2:  // and F16C, for the attention kernel's half caches (every AVX2 CPU has it)
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c();
    case ISA_AVX512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
             __builtin_cpu_supports("fma") && has_f16c();  // (every AVX-512 CPU has both)
  }
  return false;
#else
  return isa == ISA_SCALAR;
#endif
}
}  // namespace

// Probed once: every kernel call asks, and CPUID is slow under a hypervisor (a VM exit).
bool isa_supported(Isa isa) {
  static const bool has[3] = {probe_isa(ISA_SCALAR), probe_isa(ISA_AVX2), probe_isa(ISA_AVX512)};
  return isa >= ISA_SCALAR && isa <= ISA_AVX512 && has[isa];
}

bool software_prefetch() {
  static const bool on = [] {
    const char* env = std::getenv("KINETIC_PREFETCH");
    if (env && *env) return std::strcmp(env, "0") != 0;
#if defined(__x86_64__) || defined(__i386__)
    return !(amd_vendor() && cpu_family() < 0x1A);
#else
    return true;
#endif
  }();
  return on;
}

Isa best_isa() {
  static const Isa best = isa_supported(ISA_AVX512) ? ISA_AVX512
                          : isa_supported(ISA_AVX2) ? ISA_AVX2 : ISA_SCALAR;
  return best;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case ISA_SCALAR: return "scalar";
    case ISA_AVX2: return "avx2";
    case ISA_AVX512: return "avx512";
  }
  return "unknown";
}

Isa active_isa() {
  const char* env = std::getenv("KINETIC_KERNEL_ISA");
  if (env && *env) {
    for (Isa isa : {ISA_SCALAR, ISA_AVX2, ISA_AVX512})
      if (std::strcmp(env, isa_name(isa)) == 0 && isa_supported(isa)) return isa;
    // An unknown or unsupported name is reported by the Python side (kinetic.kernels), which
    // checks the variable before it loads anything; here the safe choice is the reference.
    return ISA_SCALAR;
  }
  return best_isa();
}

}  // namespace kn
