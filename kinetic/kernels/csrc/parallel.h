// Splitting a kernel's output columns over threads. The split never changes a result: each
// output element is computed whole by one thread, in the same order whatever the split.
//
// The caller works too, taking chunks from a shared counter beside the tasks it scheduled,
// so a pool that is busy (or smaller than asked) only makes the call slower, never stuck:
// the caller waits only for chunks another thread has already started.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "pool.h"

namespace kn {

// schedule(task) runs task on some thread, now or later; threads: how many may work. An
// empty schedule with threads > 1 means kinetic's own spinning pool (pool.h), which is what
// the FFI handlers use.
using Schedule = std::function<void(std::function<void()>)>;

template <class Body>
void run_chunks(int64_t n_chunks, int threads, const Schedule& schedule, const Body& body) {
  if (threads <= 1 || n_chunks <= 1) {
    for (int64_t c = 0; c < n_chunks; ++c) body(c);
    return;
  }
  if (!schedule) {
    pool_run(n_chunks, [&body](int64_t c) { body(c); });
    return;
  }
  struct State {
    std::atomic<int64_t> next{0};
    int64_t done = 0;
    std::mutex mu;
    std::condition_variable cv;
  };
  auto st = std::make_shared<State>();
  const Body* b = &body;  // used only while chunks remain, i.e. before this call returns
  auto work = [st, b, n_chunks]() {
    int64_t mine = 0;
    for (int64_t c; (c = st->next.fetch_add(1)) < n_chunks; ++mine) (*b)(c);
    if (mine) {
      std::lock_guard<std::mutex> lock(st->mu);
      st->done += mine;
      if (st->done == n_chunks) st->cv.notify_all();
    }
  };
  int64_t helpers = std::min<int64_t>(threads, n_chunks) - 1;
  for (int64_t i = 0; i < helpers; ++i) schedule(work);
  work();
  std::unique_lock<std::mutex> lock(st->mu);
  st->cv.wait(lock, [&] { return st->done == n_chunks; });
}

}  // namespace kn
