// Which instruction-set path the kernels take: the best this CPU has, or the one that
// KINETIC_KERNEL_ISA (scalar | avx2 | avx512) forces.
#pragma once

namespace kn {

enum Isa : int { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

// Best path this CPU supports (CPUID, once).
Isa best_isa();
// Whether this CPU can run `isa`.
bool isa_supported(Isa isa);
// The path in use: KINETIC_KERNEL_ISA if set (and supported), else best_isa().
Isa active_isa();
const char* isa_name(Isa isa);

// Whether the matmul loops prefetch the next column group in software: KINETIC_PREFETCH=0|1
// if set, else on but on AMD CPUs before Zen 5 (family 0x1A), whose hardware prefetchers
// already stream the weights (measured on a Zen 4: software prefetches cut a 2-thread read
// from 28 to 20 GB/s). On a Zen 5 they pay, as on Intel: LFM2-350M's decode step 12.7 ->
// 9.4-10.0 ms (docs/performance.md, Speed III). It changes no bits, only where the time
// goes. Decided once.
bool software_prefetch();

}  // namespace kn
