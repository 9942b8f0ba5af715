// Work split over the cores for the native CPU kernels. cpu_native.py builds all the kernels' sources into one
// library, so one crew of helper threads (below) serves them all; this header's text is part of the build's key.
//
// ``parallel_for(pool, parts, work)`` runs work(i) for i in [0, parts) on the calling thread and the crew, whose
// size follows XLA's intra-op pool (its threads - 1). A call that finds the crew busy (two programs running at once)
// uses tasks of XLA's pool instead (``pool_parallel_for``). Either way parts are claimed from an atomic counter by
// whoever is free, the caller included, so a call finishes even if no helper or task ever comes (e.g. in a forked
// child).

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxserve_cpu {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// The state the pool's tasks share lives in a shared_ptr: a task that starts late may run after the call has
// returned, and then finds no part left.
struct PoolShared {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};
};

template <typename Work>
void pool_parallel_for(xla::ffi::ThreadPool& pool, int64_t parts, Work work) {
  auto shared = std::make_shared<PoolShared>();
  auto run = [shared, parts, work]() {
    for (int64_t i; (i = shared->next.fetch_add(1)) < parts;) {
      work(i);
      shared->finished.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t tasks = std::min<int64_t>(parts, std::max<int64_t>(1, pool.num_threads())) - 1;
  for (int64_t t = 0; t < tasks; ++t) {
    auto task = run;  // Schedule takes its task by value (an rvalue)
    pool.Schedule(std::move(task));
  }
  run();
  while (shared->finished.load(std::memory_order_acquire) < parts) cpu_relax();
}

// How long a helper spins after a call before it sleeps: longer than the gaps between one step's kernel calls (a few
// to ~60 us), shorter than the host's work between steps.
inline constexpr auto kSpin = std::chrono::microseconds(200);

// Helper threads of the kernels' own. A call lasts 40 us to a few ms, and handing a part to a task of XLA's pool
// cost a good part of that (the pool's thread is woken for each call, 30-100 us on a 2-core VM); these helpers spin
// for a while after each call, so the next call of the same step finds them awake, and then sleep until a call
// wakes them.
class Crew {
 public:
  explicit Crew(int helpers) : helpers_(helpers) {
    for (int t = 0; t < helpers; ++t) std::thread([this] { Serve(); }).detach();
  }
  int helpers() const { return helpers_; }

  // Runs fn(ctx, i) for i in [0, parts) on the calling thread and the helpers; false (nothing run) if another
  // call holds the crew.
  bool Run(int64_t parts, void (*fn)(const void*, int64_t), const void* ctx) {
    std::unique_lock<std::mutex> owner(busy_, std::try_to_lock);
    if (!owner.owns_lock()) return false;
    fn_ = fn;
    ctx_ = ctx;
    finished_.store(0, std::memory_order_relaxed);
    const uint64_t gen = ++gen_;
    ticket_.store(gen << 32 | static_cast<uint64_t>(parts) << 16);  // generation | parts | next part
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(sleep_);
      wake_.notify_all();
    }
    Work(gen);
    while (finished_.load(std::memory_order_acquire) < parts) cpu_relax();
    return true;
  }

 private:
  // Claims parts of call ``gen`` until none is left; a helper that comes late finds the generation changed.
  void Work(uint64_t gen) {
    uint64_t t = ticket_.load();
    while (t >> 32 == gen && (t & 0xffff) < ((t >> 16) & 0xffff)) {
      if (ticket_.compare_exchange_weak(t, t + 1)) {
        fn_(ctx_, static_cast<int64_t>(t & 0xffff));
        finished_.fetch_add(1, std::memory_order_release);
        t = ticket_.load();
      }
    }
  }

  void Serve() {
    uint64_t seen = 0;
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + kSpin;
      uint64_t t;
      for (int n = 1; (t = ticket_.load()) >> 32 == seen; ++n) {
        if (n % 64 == 0 && std::chrono::steady_clock::now() > until) {
          std::unique_lock<std::mutex> lock(sleep_);
          sleepers_.fetch_add(1);
          wake_.wait(lock, [&] { return ticket_.load() >> 32 != seen; });
          sleepers_.fetch_sub(1);
        }
        cpu_relax();
      }
      seen = t >> 32;
      Work(seen);
    }
  }

  const int helpers_;
  std::mutex busy_;  // one call at a time
  uint64_t gen_ = 0;
  void (*fn_)(const void*, int64_t) = nullptr;
  const void* ctx_ = nullptr;
  // The call's generation (high 32 bits), its number of parts and the next part to claim (16 bits each): one word,
  // so a helper's claim fails once a newer call has begun.
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int64_t> finished_{0};
  std::atomic<int> sleepers_{0};
  std::mutex sleep_;
  std::condition_variable wake_;
};

inline Crew& crew(int helpers) {
  static Crew* c = new Crew(helpers);  // never destroyed: detached helpers may still be waiting at exit
  return *c;
}

template <typename Work>
void call_work(const void* ctx, int64_t i) {
  (*static_cast<const Work*>(ctx))(i);
}

// Runs ``work(i)`` for i in [0, parts) on the calling thread and the crew (sized by XLA's pool on first use); if
// another call holds the crew, on up to threads - 1 tasks of XLA's pool instead, each claiming parts until none is
// left. Returns when all ran.
template <typename Work>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t parts, Work work) {
  if (crew(std::max<int64_t>(1, pool.num_threads()) - 1).Run(parts, &call_work<Work>, &work)) return;
  jaxserve_cpu::pool_parallel_for(pool, parts, work);
}

}  // namespace jaxserve_cpu
