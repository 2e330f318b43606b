// Work sharing for meshserve's XLA:CPU custom calls: items claimed one at a time by the
// calling thread and by tasks it schedules on XLA's intra-op pool (ffi::ThreadPool).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace meshserve {

// Calls body(i) once for every i in [0, items), on the calling thread and on up to
// pool.num_threads() - 1 pool tasks, and returns when every call has returned. A task that
// starts after the last item is claimed calls nothing, so body may refer to the caller's
// stack: it is never called once ParallelFor has returned.
template <typename Body>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t items, const Body& body) {
  struct Counters {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto counters = std::make_shared<Counters>();
  auto run = [counters, items, &body] {
    for (int64_t i; (i = counters->next.fetch_add(1)) < items;) {
      body(i);
      counters->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), items) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([run] { run(); });
  run();
  while (counters->done.load(std::memory_order_acquire) < items) std::this_thread::yield();
}

}  // namespace meshserve
