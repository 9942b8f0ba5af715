// Products of a few rows on the CPU, on every core: an XLA FFI custom call for the projections of a decode step of
// 2 to 64 sequences (float32).
//
// XLA:CPU hands such products to its GEMM library, which is fast for large ones (~190 GF/s on two Xeon cores at
// 256 rows) but reached only 60-130 GF/s here at 16-64 rows, with a cliff at 36-48 rows (docs/BENCHMARKS.md §37).
// A decode step of a few dozen sequences spends most of its time in them. This kernel does what a GEMM library
// does, sized for this case:
//
// - y [M, N] = x [M, K] @ w [K, N], w row-major, float32 sums.
// - Work is split by columns, in panels of 64: each panel is one part, claimed by whichever thread is free
//   (cpu_threads.h), so the weight is read from memory once in all. (Runs of panels per thread, with the next
//   panel prefetched during the current one's tiles, measured no faster.)
// - A panel's columns are copied ("packed") into a contiguous [K, 64] buffer that stays in the core's L2 cache:
//   the rows of a panel lie N floats apart in w, and every group of rows would read them strided from memory
//   again otherwise (a 64-row product ran at ~60 GF/s a core unpacked, ~90 packed). The first tile of rows does
//   the copy as it reads w. Up to kMaxRowsUnpacked rows read w in place: one pass, no copy to pay for.
// - A tied output head (x @ table.T) stays with XLA:CPU: a variant that transposed each panel of the table into
//   the packed layout measured no faster (§37).
// - The inner tile is 6 rows x 64 columns: 24 AVX-512 accumulators, each step of k loading four vectors of the
//   panel and broadcasting six x values.

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

constexpr int64_t kPanel = 64;  // columns of one part (four 16-float vectors)
constexpr int kTileRows = 6;
constexpr int64_t kMaxRowsUnpacked = kTileRows;  // one tile of rows reads the panel once: no packing

#if defined(__AVX512F__)
// The four 16-lane masks of a panel ``width`` columns wide (64: all lanes).
struct PanelMasks {
  __mmask16 m[4];
  explicit PanelMasks(int64_t width) {
    for (int v = 0; v < 4; ++v) {
      const int64_t lanes = std::clamp<int64_t>(width - 16 * v, 0, 16);
      m[v] = static_cast<__mmask16>((1u << lanes) - 1);
    }
  }
};

// y[0:R, 0:width] = x[0:R, :] @ panel, where panel row k is at panel + k * ldp (a packed buffer, or w in place). Up
// to PREFETCH_ROWS ahead the panel's rows are prefetched: set when reading w in place from memory.
template <int R, bool FULL>
inline void tile(const float* x, int64_t ldx, const float* panel, int64_t ldp, float* y, int64_t ldy, int64_t k,
                 const PanelMasks& masks, int64_t prefetch_rows, float* copy_to) {
  __m512 acc[R][4];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* p = panel + kk * ldp;
    if (prefetch_rows > 0) {
      const char* ahead = reinterpret_cast<const char*>(p + prefetch_rows * ldp);
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) _mm_prefetch(ahead + 64 * v, _MM_HINT_T0);
    }
    __m512 b[4];
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      b[v] = FULL ? _mm512_loadu_ps(p + 16 * v) : _mm512_maskz_loadu_ps(masks.m[v], p + 16 * v);
    }
    if (copy_to != nullptr) {
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) _mm512_storeu_ps(copy_to + kk * kPanel + 16 * v, b[v]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * ldx + kk]);
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_fmadd_ps(a, b[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      if (FULL) {
        _mm512_storeu_ps(y + r * ldy + 16 * v, acc[r][v]);
      } else {
        _mm512_mask_storeu_ps(y + r * ldy + 16 * v, masks.m[v], acc[r][v]);
      }
    }
}

// The tile for ``rows`` (1 to kTileRows) rows: the row count is a template argument, so each size is unrolled.
template <bool FULL, int R = kTileRows>
inline void tile_of(int64_t rows, const float* x, int64_t ldx, const float* panel, int64_t ldp, float* y,
                    int64_t ldy, int64_t k, const PanelMasks& masks, int64_t prefetch_rows, float* copy_to) {
  if constexpr (R > 0) {
    if (rows == R) return tile<R, FULL>(x, ldx, panel, ldp, y, ldy, k, masks, prefetch_rows, copy_to);
    return tile_of<FULL, R - 1>(rows, x, ldx, panel, ldp, y, ldy, k, masks, prefetch_rows, copy_to);
  }
}

// Columns [c, c + width) of y for every row.
void panel_product(const float* x, const float* w, float* y, int64_t m, int64_t k, int64_t n, int64_t c,
                   int64_t width) {
  const PanelMasks masks(width);
  const bool full = width == kPanel;
  // Rows of w this far ahead are fetched while a pass works (~100 ns of memory latency at a few ns a row).
  constexpr int64_t kAhead = 16;
  // The first tile reads the panel in place, prefetching w's rows ahead (they lie n floats apart), and copies it
  // into this thread's buffer as it goes; later tiles read the copy. Copying in a pass of its own first left the
  // cores waiting on memory with nothing to compute.
  float* packed = nullptr;
  if (m > kMaxRowsUnpacked) {
    thread_local std::vector<float> buffer;
    if (buffer.size() < static_cast<size_t>(k * kPanel)) buffer.resize(k * kPanel);
    packed = buffer.data();
  }
  for (int64_t r = 0; r < m; r += kTileRows) {
    const int64_t rows = std::min<int64_t>(kTileRows, m - r);
    const bool first = r == 0;
    const float* panel = first ? w + c : packed;
    const int64_t ldp = first ? n : kPanel;
    float* copy_to = first ? packed : nullptr;
    const int64_t ahead = first ? kAhead : 0;
    if (full) {
      tile_of<true>(rows, x + r * k, k, panel, ldp, y + r * n + c, n, k, masks, ahead, copy_to);
    } else {
      tile_of<false>(rows, x + r * k, k, panel, ldp, y + r * n + c, n, k, masks, ahead, copy_to);
    }
  }
}
#else
// Without AVX-512: the same split into panels, each a plain loop the compiler vectorizes.
void panel_product(const float* x, const float* w, float* y, int64_t m, int64_t k, int64_t n, int64_t c,
                   int64_t width) {
  for (int64_t r = 0; r < m; ++r) {
    float* yr = y + r * n + c;
    std::fill(yr, yr + width, 0.0f);
    for (int64_t kk = 0; kk < k; ++kk) {
      const float a = x[r * k + kk];
      const float* wr = w + kk * n + c;
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) yr[j] += a * wr[j];
    }
  }
}
#endif

ffi::Error GemmImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                    ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2 || xd[1] != wd[0] || yd[0] != xd[0] || yd[1] != wd[1]) {
    return ffi::Error::InvalidArgument("cpu_gemm: x [M, K] times w [K, N] -> y [M, N]");
  }
  const int64_t m = xd[0], k = xd[1], n = wd[1];
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  const int64_t panels = (n + kPanel - 1) / kPanel;
  jaxserve_cpu::parallel_for(pool, panels, [=](int64_t i) {
    panel_product(xp, wp, yp, m, k, n, i * kPanel, std::min(kPanel, n - i * kPanel));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveCpuGemm, GemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
