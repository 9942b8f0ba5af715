// One-row products on the CPU, on every core: XLA FFI custom calls for a single-stream decode's projections.
//
// A decode step of one sequence multiplies one row by every weight matrix: it reads the weights once and does
// almost no arithmetic, so its speed is the rate at which the cores stream the weights from memory. XLA:CPU's
// one-row products reached 9-17 GB/s on a 2-core Xeon, where two cores streaming halves of a weight read 21-25
// GB/s (docs/BENCHMARKS.md §36). These kernels split each weight into contiguous slices, one per thread (as many
// threads as XLA's intra-op pool has: the caller and helpers of the kernel's own), and add the partial results.
//
// - gemv:   x [K] times w [K, N] (row-major: each task reads whole rows) -> y [N] float32.
// - gemv_t: w [N, K] times x [K] -> y [N] float32 (the tied output head, an embedding table [V, E]): each task
//           takes a slice of w's rows, so no partial results are needed.
//
// Each comes in float32 and in bfloat16 (x and w bf16, widened to float32 as they are read, float32 sums): a
// bf16 model streams half the bytes, and XLA:CPU has no fast one-row bf16 product at all (models/cpu_bf16.py).
//
// The slices are shared out by cpu_threads.h's parallel_for (the calling thread and the kernels' helper threads).

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_threads.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxserve_cpu::parallel_for;

// Slices of at least this many weight bytes: smaller ones cost more in hand-off than they gain.
constexpr int64_t kMinSliceBytes = 256 * 1024;

int64_t num_parts(ffi::ThreadPool& pool, int64_t bytes, int64_t max_parts) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // One slice per thread: more, smaller slices measured no faster (docs/BENCHMARKS.md §36).
  return std::max<int64_t>(1, std::min({threads, bytes / kMinSliceBytes, max_parts}));
}

// A weight element as float32: itself, or a bfloat16's bits (the high half of a float32's).
inline float widen(float v) { return v; }
inline float widen(uint16_t bits) { return __builtin_bit_cast(float, static_cast<uint32_t>(bits) << 16); }

// x as float32: the buffer itself, or a bf16 row widened into ``scratch`` (K values: small beside the weight).
inline const float* row_as_float(const float* x, int64_t, std::vector<float>&) { return x; }
inline const float* row_as_float(const uint16_t* x, int64_t k, std::vector<float>& scratch) {
  scratch.resize(k);
  for (int64_t i = 0; i < k; ++i) scratch[i] = widen(x[i]);
  return scratch.data();
}

#if defined(__AVX512F__)
// With AVX-512 the loops below are written out by hand, so that they can prefetch: the hardware prefetcher follows
// each of the four rows a pass reads, but not from one group of rows into the next, and on short rows (576 to 3072
// weights) every switch of group stalled the stream. Prefetching the next group's lines one per step took a bf16
// one-row product from ~16 to 27 GB/s on two cores (§36). Prefetches never fault, so reading ahead past a slice's
// or the weight's end is harmless.

// Weight elements that fill one 64-byte cache line.
template <typename W>
constexpr int64_t kLine = 64 / sizeof(W);

// Sixteen weight elements as float32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

template <typename W>
inline void prefetch_rows(const W* p, int64_t stride) {
  for (int r = 0; r < 4; ++r) _mm_prefetch(reinterpret_cast<const char*>(p + r * stride), _MM_HINT_T0);
}
#endif

// y[0:n] = x[k0:k1] @ w[k0:k1, 0:n], four rows of w per pass so that y is loaded and stored once per four.
template <typename W>
void rows_times(const float* x, const W* w, float* y, int64_t k0, int64_t k1, int64_t n) {
  std::fill(y, y + n, 0.0f);
  int64_t k = k0;
#if defined(__AVX512F__)
  const int64_t n_lines = n / kLine<W> * kLine<W>;
  for (; k + 4 <= k1; k += 4) {
    const __m512 x0 = _mm512_set1_ps(x[k]), x1 = _mm512_set1_ps(x[k + 1]);
    const __m512 x2 = _mm512_set1_ps(x[k + 2]), x3 = _mm512_set1_ps(x[k + 3]);
    const W* w0 = w + k * n;
    const W *w1 = w0 + n, *w2 = w1 + n, *w3 = w2 + n;
    for (int64_t j = 0; j < n_lines; j += kLine<W>) {
      prefetch_rows(w0 + 4 * n + j, n);  // the same line of the next group's four rows
      for (int64_t c = j; c < j + kLine<W>; c += 16) {
        __m512 acc = _mm512_loadu_ps(y + c);
        acc = _mm512_fmadd_ps(x0, load16(w0 + c), acc);
        acc = _mm512_fmadd_ps(x1, load16(w1 + c), acc);
        acc = _mm512_fmadd_ps(x2, load16(w2 + c), acc);
        acc = _mm512_fmadd_ps(x3, load16(w3 + c), acc);
        _mm512_storeu_ps(y + c, acc);
      }
    }
    const float s0 = x[k], s1 = x[k + 1], s2 = x[k + 2], s3 = x[k + 3];
    for (int64_t j = n_lines; j < n; ++j) {
      y[j] += s0 * widen(w0[j]) + s1 * widen(w1[j]) + s2 * widen(w2[j]) + s3 * widen(w3[j]);
    }
  }
#endif
  for (; k + 4 <= k1; k += 4) {
    const float x0 = x[k], x1 = x[k + 1], x2 = x[k + 2], x3 = x[k + 3];
    const W* w0 = w + k * n;
    const W *w1 = w0 + n, *w2 = w1 + n, *w3 = w2 + n;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      y[j] += x0 * widen(w0[j]) + x1 * widen(w1[j]) + x2 * widen(w2[j]) + x3 * widen(w3[j]);
    }
  }
  for (; k < k1; ++k) {
    const float x0 = x[k];
    const W* w0 = w + k * n;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) y[j] += x0 * widen(w0[j]);
  }
}

template <ffi::DataType T>
ffi::Error GemvImpl(ffi::ThreadPool pool, ffi::Buffer<T> x, ffi::Buffer<T> w, ffi::ResultBuffer<ffi::F32> y) {
  const auto wd = w.dimensions();
  if (wd.size() != 2 || x.element_count() != wd[0] || y->element_count() != wd[1]) {
    return ffi::Error::InvalidArgument("cpu_gemv: x [K] times w [K, N] -> y [N]");
  }
  const int64_t k = wd[0], n = wd[1];
  std::vector<float> x_float;
  const float* xp = row_as_float(x.typed_data(), k, x_float);
  const auto* wp = w.typed_data();
  float* yp = y->typed_data();
  const int64_t parts = num_parts(pool, k * n * static_cast<int64_t>(sizeof(*wp)), k / 4);
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
template <typename W>
void dots(const W* w, const float* x, float* y, int64_t r0, int64_t r1, int64_t k) {
  int64_t r = r0;
#if defined(__AVX512F__)
  const int64_t k_lines = k / kLine<W> * kLine<W>;
  for (; r + 4 <= r1; r += 4) {
    const W *w0 = w + r * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    for (int64_t j = 0; j < k_lines; j += kLine<W>) {
      prefetch_rows(w0 + 4 * k + j, k);
      for (int64_t c = j; c < j + kLine<W>; c += 16) {
        const __m512 xv = _mm512_loadu_ps(x + c);
        a0 = _mm512_fmadd_ps(load16(w0 + c), xv, a0);
        a1 = _mm512_fmadd_ps(load16(w1 + c), xv, a1);
        a2 = _mm512_fmadd_ps(load16(w2 + c), xv, a2);
        a3 = _mm512_fmadd_ps(load16(w3 + c), xv, a3);
      }
    }
    float s0 = _mm512_reduce_add_ps(a0), s1 = _mm512_reduce_add_ps(a1);
    float s2 = _mm512_reduce_add_ps(a2), s3 = _mm512_reduce_add_ps(a3);
    for (int64_t j = k_lines; j < k; ++j) {
      s0 += widen(w0[j]) * x[j];
      s1 += widen(w1[j]) * x[j];
      s2 += widen(w2[j]) * x[j];
      s3 += widen(w3[j]) * x[j];
    }
    y[r] = s0;
    y[r + 1] = s1;
    y[r + 2] = s2;
    y[r + 3] = s3;
  }
#endif
  for (; r + 4 <= r1; r += 4) {
    const W *w0 = w + r * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t j = 0; j < k; ++j) {
      s0 += widen(w0[j]) * x[j];
      s1 += widen(w1[j]) * x[j];
      s2 += widen(w2[j]) * x[j];
      s3 += widen(w3[j]) * x[j];
    }
    y[r] = s0;
    y[r + 1] = s1;
    y[r + 2] = s2;
    y[r + 3] = s3;
  }
  for (; r < r1; ++r) {
    const W* w0 = w + r * k;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t j = 0; j < k; ++j) s += widen(w0[j]) * x[j];
    y[r] = s;
  }
}

template <ffi::DataType T>
ffi::Error GemvTImpl(ffi::ThreadPool pool, ffi::Buffer<T> w, ffi::Buffer<T> x, ffi::ResultBuffer<ffi::F32> y) {
  const auto wd = w.dimensions();
  if (wd.size() != 2 || x.element_count() != wd[1] || y->element_count() != wd[0]) {
    return ffi::Error::InvalidArgument("cpu_gemv_t: w [N, K] times x [K] -> y [N]");
  }
  const int64_t n = wd[0], k = wd[1];
  std::vector<float> x_float;
  const float* xp = row_as_float(x.typed_data(), k, x_float);
  const auto* wp = w.typed_data();
  float* yp = y->typed_data();
  const int64_t parts = num_parts(pool, n * k * static_cast<int64_t>(sizeof(*wp)), n / 4);
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

#define JAXSERVE_GEMV_HANDLER(symbol, impl, dtype)                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, impl<dtype>,                                  \
                                ffi::Ffi::Bind()                                      \
                                    .Ctx<ffi::ThreadPool>()                           \
                                    .Arg<ffi::Buffer<dtype>>()                        \
                                    .Arg<ffi::Buffer<dtype>>()                        \
                                    .Ret<ffi::Buffer<ffi::F32>>());

JAXSERVE_GEMV_HANDLER(JaxserveCpuGemv, GemvImpl, ffi::F32)
JAXSERVE_GEMV_HANDLER(JaxserveCpuGemvT, GemvTImpl, ffi::F32)
JAXSERVE_GEMV_HANDLER(JaxserveCpuGemvBf16, GemvImpl, ffi::BF16)
JAXSERVE_GEMV_HANDLER(JaxserveCpuGemvTBf16, GemvTImpl, ffi::BF16)
