// One-row products on the CPU, on every core: XLA FFI custom calls for a single-stream decode's projections.
//
// A decode step of one sequence multiplies one row by every weight matrix: it reads the weights once and does
// almost no arithmetic, so its speed is the rate at which the cores stream the weights from memory. XLA:CPU's
// one-row products reached 9-17 GB/s on a 2-core Xeon, where two cores streaming halves of a weight read 21-25
// GB/s (docs/BENCHMARKS.md §36). These kernels split each weight into contiguous slices, one per task on XLA's
// own intra-op thread pool, and add the partial results.
//
// - gemv:   x [K] float32 times w [K, N] float32 (row-major: each task reads whole rows) -> y [N].
// - gemv_t: w [N, K] float32 times x [K] -> y [N] (the tied output head, an embedding table [V, E]): each task
//           takes a slice of w's rows, so no partial results are needed.
//
// Work is claimed from an atomic counter by the calling thread and by the pooled tasks alike, so the call
// finishes even if the pool never runs a task; state the tasks share lives in a shared_ptr, since a task that
// starts late may run after the call has returned.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Slices of at least this many weight bytes: smaller ones cost more in hand-off than they gain.
constexpr int64_t kMinSliceBytes = 256 * 1024;

struct Shared {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};
};

// Runs ``work(i)`` for i in [0, parts) on the calling thread and up to parts - 1 pool tasks; returns when all ran.
template <typename Work>
void parallel_for(ffi::ThreadPool& pool, int64_t parts, Work work) {
  auto shared = std::make_shared<Shared>();
  auto run = [shared, parts, work]() {
    for (int64_t i; (i = shared->next.fetch_add(1)) < parts;) {
      work(i);
      shared->finished.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < parts; ++t) {
    auto task = run;  // Schedule takes its task by value (an rvalue)
    pool.Schedule(std::move(task));
  }
  run();
  while (shared->finished.load(std::memory_order_acquire) < parts) cpu_relax();
}

int64_t num_parts(ffi::ThreadPool& pool, int64_t bytes, int64_t max_parts) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  return std::max<int64_t>(1, std::min({threads, bytes / kMinSliceBytes, max_parts}));
}

// y[0:n] = x[k0:k1] @ w[k0:k1, 0:n], four rows of w per pass so that y is loaded and stored once per four.
void rows_times(const float* x, const float* w, float* y, int64_t k0, int64_t k1, int64_t n) {
  std::fill(y, y + n, 0.0f);
  int64_t k = k0;
  for (; k + 4 <= k1; k += 4) {
    const float x0 = x[k], x1 = x[k + 1], x2 = x[k + 2], x3 = x[k + 3];
    const float* w0 = w + k * n;
    const float *w1 = w0 + n, *w2 = w1 + n, *w3 = w2 + n;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) y[j] += x0 * w0[j] + x1 * w1[j] + x2 * w2[j] + x3 * w3[j];
  }
  for (; k < k1; ++k) {
    const float x0 = x[k];
    const float* w0 = w + k * n;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) y[j] += x0 * w0[j];
  }
}

ffi::Error GemvImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                    ffi::ResultBuffer<ffi::F32> y) {
  const auto wd = w.dimensions();
  if (wd.size() != 2 || x.element_count() != wd[0] || y->element_count() != wd[1]) {
    return ffi::Error::InvalidArgument("cpu_gemv: x [K] times w [K, N] -> y [N]");
  }
  const int64_t k = wd[0], n = wd[1];
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  const int64_t parts = num_parts(pool, k * n * 4, k / 4);
  if (parts == 1) {
    rows_times(xp, wp, yp, 0, k, n);
    return ffi::Error::Success();
  }
  // Slice i covers rows [bounds[i], bounds[i+1]), multiples of 4; slice 0 writes y, the others partial rows.
  std::vector<int64_t> bounds(parts + 1);
  for (int64_t i = 0; i <= parts; ++i) bounds[i] = i == parts ? k : (k * i / parts) / 4 * 4;
  std::vector<float> partial((parts - 1) * n);
  float* pp = partial.data();
  const int64_t* bp = bounds.data();
  parallel_for(pool, parts, [=](int64_t i) {
    rows_times(xp, wp, i == 0 ? yp : pp + (i - 1) * n, bp[i], bp[i + 1], n);
  });
  for (int64_t i = 1; i < parts; ++i) {
    const float* src = pp + (i - 1) * n;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) yp[j] += src[j];
  }
  return ffi::Error::Success();
}

// y[r0:r1] = w[r0:r1, :] @ x: four rows at a time, each a dot product over k.
void dots(const float* w, const float* x, float* y, int64_t r0, int64_t r1, int64_t k) {
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) {
    const float *w0 = w + r * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t j = 0; j < k; ++j) {
      s0 += w0[j] * x[j];
      s1 += w1[j] * x[j];
      s2 += w2[j] * x[j];
      s3 += w3[j] * x[j];
    }
    y[r] = s0;
    y[r + 1] = s1;
    y[r + 2] = s2;
    y[r + 3] = s3;
  }
  for (; r < r1; ++r) {
    const float* w0 = w + r * k;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t j = 0; j < k; ++j) s += w0[j] * x[j];
    y[r] = s;
  }
}

ffi::Error GemvTImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> x,
                     ffi::ResultBuffer<ffi::F32> y) {
  const auto wd = w.dimensions();
  if (wd.size() != 2 || x.element_count() != wd[1] || y->element_count() != wd[0]) {
    return ffi::Error::InvalidArgument("cpu_gemv_t: w [N, K] times x [K] -> y [N]");
  }
  const int64_t n = wd[0], k = wd[1];
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  const int64_t parts = num_parts(pool, n * k * 4, n / 4);
  if (parts == 1) {
    dots(wp, xp, yp, 0, n, k);
    return ffi::Error::Success();
  }
  parallel_for(pool, parts, [=](int64_t i) {
    dots(wp, xp, yp, (n * i / parts) / 4 * 4, i + 1 == parts ? n : (n * (i + 1) / parts) / 4 * 4, k);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveCpuGemv, GemvImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveCpuGemvT, GemvTImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
