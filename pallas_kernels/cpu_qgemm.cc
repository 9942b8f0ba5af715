// Products with block-quantized weights on the CPU, on every core: XLA FFI custom calls for the projections and
// the tied output head of a GGUF model kept quantized (models/quantized.py).
//
// A weight is int8 codes plus, for each block of G consecutive values along its input axis, a float32 scale and
// offset: w = scale * code + offset. That covers GGUF's Q8_0 (offset 0), Q4_0 (codes q - 8, offset 0) and Q4_1
// (codes q, offset m) exactly, at 1.25 bytes a weight against float32's 4. A decode step reads every weight once
// and does almost no arithmetic, so fewer bytes are the speed-up (docs/BENCHMARKS.md §44).
//
// Instead of dequantizing each weight, a block's products are summed on the codes and scaled once:
//   sum_k x[k] w[k] = sum_blocks ( scale * sum_{k in block} x[k] code[k] + offset * sum_{k in block} x[k] ),
// so the inner loop converts codes to float and multiplies-adds, as a float32 product would; the block sums of x
// are computed once per call.
//
// - qgemm:   x [M, K] f32 times codes [K, N] (scale, offset [K/G, N]) -> y [M, N]: a Linear's kernel, [in, out].
//            Work is split by panels of columns, one part each (cpu_threads.h); a part keeps its rows' partial
//            sums for one block in a small buffer that stays in the core's L1 cache.
// - qgemm_t: x [M, K] f32 against codes [N, K] (scale, offset [N, K/G]) -> y [M, N]: the tied head, whose
//            embedding table is [vocab, hidden]; each part takes a slice of the table's rows (dot products).

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_threads.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {


// xs[m * groups + g] = sum of x[m, g*G : (g+1)*G].
std::vector<float> block_sums(const float* x, int64_t m, int64_t k, int64_t group) {
  const int64_t groups = k / group;
  std::vector<float> xs(m * groups);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.0f;
      const float* p = x + r * k + g * group;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < group; ++i) s += p[i];
      xs[r * groups + g] = s;
    }
  }
  return xs;
}

// Vectors of float32 in the machine's widest registers (GCC/Clang vector extensions: one AVX-512 or AVX2
// register each); a tile of columns is four of them.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vf __attribute__((vector_size(4 * kLanes)));
// A tile of columns is one cache line of codes (64), kVecs vectors: each row of codes read is a whole line.
constexpr int kVecs = 64 / kLanes;
constexpr int64_t kTile = 64;
// Rows of codes fetched ahead of the one being read: they lie n bytes apart, which the hardware prefetcher follows
// poorly across rows.
constexpr int64_t kAhead = 8;

// kLanes codes as float32. Written with intrinsics: GCC turns a vector-extension conversion of int8 into one scalar
// conversion per lane.
inline vf load_codes(const int8_t* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  vf out;
  for (int i = 0; i < kLanes; ++i) out[i] = static_cast<float>(p[i]);
  return out;
#endif
}

// Rows [r0, r0 + R) of y[:, c : c + kTile] (a full tile of columns): each block's sums on the codes stay in
// registers (R x kVecs vectors), the codes of a row are converted once for all R rows.
template <int R>
void qtile(const float* x, const int8_t* codes, const float* scale, const float* offset, const float* xs, float* y,
           int64_t r0, int64_t k, int64_t n, int64_t group, int64_t c) {
  const int64_t groups = k / group;
  vf acc[R][kVecs] = {};
  for (int64_t g = 0; g < groups; ++g) {
    vf part[R][kVecs] = {};
    for (int64_t kk = g * group; kk < (g + 1) * group; ++kk) {
      const int8_t* row = codes + kk * n + c;
      __builtin_prefetch(row + kAhead * n);
      vf w[kVecs];
#pragma GCC unroll 8
      for (int v = 0; v < kVecs; ++v) w[v] = load_codes(row + v * kLanes);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float a = x[(r0 + r) * k + kk];
#pragma GCC unroll 8
        for (int v = 0; v < kVecs; ++v) part[r][v] += a * w[v];
      }
    }
    vf sv[kVecs], ov[kVecs];
#pragma GCC unroll 8
    for (int v = 0; v < kVecs; ++v) {
      __builtin_memcpy(&sv[v], scale + g * n + c + v * kLanes, sizeof(vf));
      __builtin_memcpy(&ov[v], offset + g * n + c + v * kLanes, sizeof(vf));
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float sx = xs[(r0 + r) * groups + g];
#pragma GCC unroll 8
      for (int v = 0; v < kVecs; ++v) acc[r][v] += sv[v] * part[r][v] + ov[v] * sx;
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v) __builtin_memcpy(y + (r0 + r) * n + c + v * kLanes, &acc[r][v], sizeof(vf));
}

// The same for any width (the last, partial tile of columns), one value at a time.
void qtile_any(const float* x, const int8_t* codes, const float* scale, const float* offset, const float* xs,
               float* y, int64_t m, int64_t k, int64_t n, int64_t group, int64_t c, int64_t width) {
  const int64_t groups = k / group;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t j = c; j < c + width; ++j) {
      float total = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        float dot = 0.0f;
        for (int64_t kk = g * group; kk < (g + 1) * group; ++kk) dot += x[r * k + kk] * codes[kk * n + j];
        total += scale[g * n + j] * dot + offset[g * n + j] * xs[r * groups + g];
      }
      y[r * n + j] = total;
    }
  }
}

// Rows of y in tiles of kRows (then the rest), columns [c, c + width) with width <= kTile.
constexpr int kRows = 2;
void qpanel(const float* x, const int8_t* codes, const float* scale, const float* offset, const float* xs, float* y,
            int64_t m, int64_t k, int64_t n, int64_t group, int64_t c, int64_t width) {
  if (width < kTile) return qtile_any(x, codes, scale, offset, xs, y, m, k, n, group, c, width);
  int64_t r = 0;
  for (; r + kRows <= m; r += kRows) qtile<kRows>(x, codes, scale, offset, xs, y, r, k, n, group, c);
  for (; r < m; ++r) qtile<1>(x, codes, scale, offset, xs, y, r, k, n, group, c);
}

// Rows [v0, v1) of the table against every row of x: y[r, v].
void qdots(const float* x, const int8_t* codes, const float* scale, const float* offset, const float* xs, float* y,
           int64_t m, int64_t k, int64_t n, int64_t group, int64_t v0, int64_t v1) {
  const int64_t groups = k / group;
  for (int64_t v = v0; v < v1; ++v) {
    const int8_t* row = codes + v * k;
    const float* s = scale + v * groups;
    const float* o = offset + v * groups;
    for (int64_t r = 0; r < m; ++r) {
      const float* xr = x + r * k;
      const float* xsr = xs + r * groups;
      float total = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        float dot = 0.0f;
        const int8_t* cg = row + g * group;
        const float* xg = xr + g * group;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < group; ++i) dot += static_cast<float>(cg[i]) * xg[i];
        total += s[g] * dot + o[g] * xsr[g];
      }
      y[r * n + v] = total;
    }
  }
}

bool shapes_ok(const ffi::Span<const int64_t>& xd, const ffi::Span<const int64_t>& cd,
               const ffi::Span<const int64_t>& sd, const ffi::Span<const int64_t>& od, bool transposed) {
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2 || od.size() != 2) return false;
  const int64_t k = xd[1];
  const int64_t code_k = transposed ? cd[1] : cd[0], code_n = transposed ? cd[0] : cd[1];
  const int64_t groups = transposed ? sd[1] : sd[0], scale_n = transposed ? sd[0] : sd[1];
  return code_k == k && scale_n == code_n && groups > 0 && k % groups == 0 && sd[0] == od[0] && sd[1] == od[1];
}

ffi::Error QgemmImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> codes,
                     ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> offset, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), cd = codes.dimensions();
  if (!shapes_ok(xd, cd, scale.dimensions(), offset.dimensions(), false) || y->element_count() != xd[0] * cd[1]) {
    return ffi::Error::InvalidArgument("cpu_qgemm: x [M, K] times codes [K, N] (scale, offset [K/G, N]) -> [M, N]");
  }
  const int64_t m = xd[0], k = xd[1], n = cd[1], group = k / scale.dimensions()[0];
  const float* xp = x.typed_data();
  const std::vector<float> xs = block_sums(xp, m, k, group);
  const int8_t* cp = codes.typed_data();
  const float *sp = scale.typed_data(), *op = offset.typed_data(), *xsp = xs.data();
  float* yp = y->typed_data();
  const int64_t panels = (n + kTile - 1) / kTile;
  jaxserve_cpu::parallel_for(pool, panels, [=](int64_t i) {
    qpanel(xp, cp, sp, op, xsp, yp, m, k, n, group, i * kTile, std::min(kTile, n - i * kTile));
  });
  return ffi::Error::Success();
}

ffi::Error QgemmTImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> codes,
                      ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> offset, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), cd = codes.dimensions();
  if (!shapes_ok(xd, cd, scale.dimensions(), offset.dimensions(), true) || y->element_count() != xd[0] * cd[0]) {
    return ffi::Error::InvalidArgument("cpu_qgemm_t: x [M, K] against codes [N, K] (scale, offset [N, K/G]) -> [M, N]");
  }
  const int64_t m = xd[0], k = xd[1], n = cd[0], group = k / scale.dimensions()[1];
  const float* xp = x.typed_data();
  const std::vector<float> xs = block_sums(xp, m, k, group);
  const int8_t* cp = codes.typed_data();
  const float *sp = scale.typed_data(), *op = offset.typed_data(), *xsp = xs.data();
  float* yp = y->typed_data();
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), n / 64));
  jaxserve_cpu::parallel_for(pool, parts, [=](int64_t i) {
    qdots(xp, cp, sp, op, xsp, yp, m, k, n, group, n * i / parts, n * (i + 1) / parts);
  });
  return ffi::Error::Success();
}

}  // namespace

#define JAXSERVE_QGEMM_HANDLER(symbol, impl)                                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, impl,                                         \
                                ffi::Ffi::Bind()                                      \
                                    .Ctx<ffi::ThreadPool>()                           \
                                    .Arg<ffi::Buffer<ffi::F32>>()                     \
                                    .Arg<ffi::Buffer<ffi::S8>>()                      \
                                    .Arg<ffi::Buffer<ffi::F32>>()                     \
                                    .Arg<ffi::Buffer<ffi::F32>>()                     \
                                    .Ret<ffi::Buffer<ffi::F32>>());

JAXSERVE_QGEMM_HANDLER(JaxserveCpuQgemm, QgemmImpl)
JAXSERVE_QGEMM_HANDLER(JaxserveCpuQgemmT, QgemmTImpl)
