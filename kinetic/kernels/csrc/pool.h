// kinetic's own worker threads for the FFI kernels. A step makes a few hundred short kernel
// calls (tens of microseconds each); waking a sleeping thread per call (XLA's pool, or any
// condition variable) costs about as much as the work. So the workers spin for a while
// after each job, then sleep until the next: back-to-back calls find them awake.
//
// Only the split changes, never a result: each chunk is computed whole by one thread.
#pragma once

#include <cstdint>
#include <functional>

namespace kn {

// Run body(0 .. n_chunks - 1) on the calling thread and the pool's workers, and return when
// all are done. When another call holds the pool (XLA runs independent ops concurrently),
// the caller runs every chunk itself.
void pool_run(int64_t n_chunks, const std::function<void(int64_t)>& body);

// Threads that work on a pool_run, the caller included: KINETIC_THREADS, else the CPUs this
// process may use.
int pool_threads();

}  // namespace kn
