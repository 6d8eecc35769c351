// Dynamic work split for the kernels' parallel loops (gguf_packed.cpp, gguf_tiles.cpp).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace trio_llm {

// Runs task(t) for t in [0, tasks) on the intra-op threads, each taking the next task as
// it finishes one (a thread slowed by a neighbour takes fewer). `setup` runs once per
// thread first, `teardown` after.
template <class Task, class Setup, class Teardown>
void dynamic_tasks(int64_t tasks, Task task, Setup setup, Teardown teardown) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks));
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    if (begin >= end) return;
    setup();
    for (int64_t t = next.fetch_add(1); t < tasks; t = next.fetch_add(1)) task(t);
    teardown();
  });
}

}  // namespace trio_llm
