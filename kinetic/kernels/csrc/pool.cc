#include "pool.h"

#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <algorithm>
#include <vector>

namespace kn {

namespace {

constexpr auto kSpin = std::chrono::microseconds(300);  // awake this long after a job
constexpr int kSpinsBeforeYield = 256;  // pause instructions between yields of the core

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// A job is published as one 64-bit ticket: generation (24 bits) | chunk count (20 bits) |
// next chunk index (20 bits). Claiming a chunk is one fetch_add on the ticket, so a claim
// always belongs to the job it names: a worker that arrives after a job ended, or after the
// next one began, can never take a chunk of the wrong job (it either gets a valid chunk of
// the current job, whose body and counters were written before the ticket, or an index past
// the count). A job cannot end before every valid claim has run, so the body stays valid.
constexpr int kIndexBits = 20;
constexpr uint64_t kIndexMask = (uint64_t(1) << kIndexBits) - 1;

class Pool {
 public:
  explicit Pool(int threads) {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { work(); });
  }
  // The workers are never joined: the pool lives until the process ends (a static's
  // destructor would race the interpreter's own shutdown).
  int threads() const { return int(workers_.size()) + 1; }

  void run(int64_t n_chunks, const std::function<void(int64_t)>& body) {
    std::unique_lock<std::mutex> busy(run_mu_, std::try_to_lock);
    if (!busy.owns_lock() || workers_.empty() || n_chunks <= 1 ||
        uint64_t(n_chunks) >= (kIndexMask >> 1)) {
      for (int64_t c = 0; c < n_chunks; ++c) body(c);
      return;
    }
    body_.store(&body, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = (ticket_.load(std::memory_order_relaxed) >> (2 * kIndexBits)) + 1;
    {
      std::lock_guard<std::mutex> lock(sleep_mu_);  // so that a worker going to sleep sees it
      ticket_.store((gen << (2 * kIndexBits)) | (uint64_t(n_chunks) << kIndexBits),
                    std::memory_order_release);
    }
    sleep_cv_.notify_all();
    take_chunks();
    // A worker holding a chunk may have lost its core to another thread (on 2 cores the
    // engine's Python thread, XLA's own): spin briefly, then yield so that it can finish.
    for (int spins = 0; done_.load(std::memory_order_acquire) < n_chunks; ++spins) {
      if (spins < kSpinsBeforeYield) relax(); else std::this_thread::yield();
    }
  }

 private:
  void take_chunks() {
    for (;;) {
      const uint64_t t = ticket_.fetch_add(1, std::memory_order_acq_rel);
      const uint64_t n = (t >> kIndexBits) & kIndexMask, i = t & kIndexMask;
      if (i >= n) return;
      (*body_.load(std::memory_order_relaxed))(int64_t(i));
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  uint64_t generation() const { return ticket_.load(std::memory_order_acquire) >> (2 * kIndexBits); }

  void work() {
    uint64_t seen = generation();
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + kSpin;
      for (int spins = 0; generation() == seen; ++spins) {
        if (spins % kSpinsBeforeYield == kSpinsBeforeYield - 1) std::this_thread::yield();
        else relax();
        if (std::chrono::steady_clock::now() > until) {
          std::unique_lock<std::mutex> lock(sleep_mu_);
          sleep_cv_.wait(lock, [&] { return generation() != seen; });
        }
      }
      seen = generation();
      take_chunks();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex run_mu_, sleep_mu_;
  std::condition_variable sleep_cv_;
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<const std::function<void(int64_t)>*> body_{nullptr};
};

int configured_threads() {
  if (const char* e = std::getenv("KINETIC_THREADS")) {
    int n = std::atoi(e);
    if (n >= 1) return n;
  }
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

Pool& pool() {
  static Pool* p = new Pool(configured_threads());  // leaked on purpose (see ~Pool above)
  return *p;
}

}  // namespace

void pool_run(int64_t n_chunks, const std::function<void(int64_t)>& body) {
  pool().run(n_chunks, body);
}

int pool_threads() { return pool().threads(); }

}  // namespace kn
