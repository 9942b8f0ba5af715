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
// register each).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vf __attribute__((vector_size(4 * kLanes)));

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

// A tile of columns is one cache line of codes (64 values): each row of codes read is a whole line. It is worked
// in sub-tiles of four vectors, each over the block's rows in turn, so the line comes from memory once and the
// second sub-tile finds it in L1.
constexpr int64_t kTile = 64;
constexpr int kSubs = 64 / (4 * kLanes);  // sub-tiles of a tile: 1 with AVX-512, 2 with AVX2
// Rows of codes fetched ahead of the one being read: they lie n bytes apart, which the hardware prefetcher follows
// poorly from one row to the next.
constexpr int64_t kAhead = 8;
// Rows of x per tile: their block sums (R x 4 vectors), one vector of codes and R broadcasts fit the registers
// (16 with AVX2, 32 with AVX-512).
#if defined(__AVX512F__)
constexpr int kRows = 4;
#else
constexpr int kRows = 2;
#endif

inline vf load_vf(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof(vf));
  return v;
}
inline void store_vf(float* p, vf v) { __builtin_memcpy(p, &v, sizeof(vf)); }

// Rows [r0, r0 + R) of y[:, c : c + kTile] (a full tile of columns). Per block and sub-tile, the sums on the codes
// stay in registers and each vector of codes, converted once, serves all R rows; then the block's scale and offset
// fold them into y.
template <int R>
void qtile(const float* x, const int8_t* codes, const float* scale, const float* offset, const float* xs, float* y,
           int64_t r0, int64_t k, int64_t n, int64_t group, int64_t c) {
  const int64_t groups = k / group;
  for (int r = 0; r < R; ++r) std::fill(y + (r0 + r) * n + c, y + (r0 + r) * n + c + kTile, 0.0f);
  for (int64_t g = 0; g < groups; ++g) {
    for (int h = 0; h < kSubs; ++h) {
      const int64_t col = c + h * 4 * kLanes;
      vf part[R][4] = {};
      for (int64_t kk = g * group; kk < (g + 1) * group; ++kk) {
        const int8_t* row = codes + kk * n + col;
        if (h == 0) __builtin_prefetch(row + kAhead * n);
        float a[R];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) a[r] = x[(r0 + r) * k + kk];
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) {
          const vf w = load_codes(row + v * kLanes);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) part[r][v] += a[r] * w;
        }
      }
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        const vf sv = load_vf(scale + g * n + col + v * kLanes), ov = load_vf(offset + g * n + col + v * kLanes);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          float* out = y + (r0 + r) * n + col + v * kLanes;
          store_vf(out, load_vf(out) + sv * part[r][v] + ov * xs[(r0 + r) * groups + g]);
        }
      }
    }
  }
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

// Up to this many rows of x, qgemm streams the codes row after row (``qstream``) instead of by panels of columns:
// a panel reads each of K rows 64 bytes apart, a latency-bound walk that held one row of x to ~8 GB/s of codes.
constexpr int64_t kMaxStreamRows = 4;

// y[0:m, :] = the part of x @ w that blocks [g0, g1) of K contribute: every row of codes is read whole, in order,
// four at a time; the block's sums on the codes are kept per output column in ``part`` (L1/L2) and folded into y
// with the block's scale and offset once its rows are done.
void qstream(const float* x, const int8_t* codes, const float* scale, const float* offset, const float* xs, float* y,
             int64_t m, int64_t k, int64_t n, int64_t group, int64_t g0, int64_t g1) {
  const int64_t groups = k / group;
  const int64_t n_vec = n / kLanes * kLanes;
  thread_local std::vector<float> buf;
  if (buf.size() < static_cast<size_t>(m * n)) buf.resize(m * n);
  float* part = buf.data();
  std::fill(y, y + m * n, 0.0f);
  for (int64_t g = g0; g < g1; ++g) {
    std::fill(part, part + m * n, 0.0f);
    for (int64_t kk = g * group; kk < (g + 1) * group; kk += 4) {
      const int8_t* c0 = codes + kk * n;
      const int8_t *c1 = c0 + n, *c2 = c1 + n, *c3 = c2 + n;
      for (int64_t r = 0; r < m; ++r) {
        const float* xr = x + r * k + kk;
        const float a0 = xr[0], a1 = xr[1], a2 = xr[2], a3 = xr[3];
        float* pr = part + r * n;
        for (int64_t j = 0; j < n_vec; j += kLanes) {
          vf acc = load_vf(pr + j);
          acc += a0 * load_codes(c0 + j) + a1 * load_codes(c1 + j);
          acc += a2 * load_codes(c2 + j) + a3 * load_codes(c3 + j);
          store_vf(pr + j, acc);
        }
        for (int64_t j = n_vec; j < n; ++j) pr[j] += a0 * c0[j] + a1 * c1[j] + a2 * c2[j] + a3 * c3[j];
      }
    }
    const float* s = scale + g * n;
    const float* o = offset + g * n;
    for (int64_t r = 0; r < m; ++r) {
      const float sx = xs[r * groups + g];
      float* yr = y + r * n;
      const float* pr = part + r * n;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) yr[j] += s[j] * pr[j] + o[j] * sx;
    }
  }
}

// Rows of y in tiles of kRows (then the rest), columns [c, c + width) with width <= kTile.
void qpanel(const float* x, const int8_t* codes, const float* scale, const float* offset, const float* xs, float* y,
            int64_t m, int64_t k, int64_t n, int64_t group, int64_t c, int64_t width) {
  if (width < kTile) return qtile_any(x, codes, scale, offset, xs, y, m, k, n, group, c, width);
  int64_t r = 0;
  for (; r + kRows <= m; r += kRows) qtile<kRows>(x, codes, scale, offset, xs, y, r, k, n, group, c);
  for (; r < m; ++r) qtile<1>(x, codes, scale, offset, xs, y, r, k, n, group, c);
}

// Rows [v0, v1) of the table against every row of x: y[r, v]. A row's block products stay in one vector
// accumulator, scaled per block, and are summed across lanes once per (row, v).
void qdots(const float* x, const int8_t* codes, const float* scale, const float* offset, const float* xs, float* y,
           int64_t m, int64_t k, int64_t n, int64_t group, int64_t v0, int64_t v1) {
  const int64_t groups = k / group;
  const bool vectors = group % kLanes == 0;
  for (int64_t v = v0; v < v1; ++v) {
    const int8_t* row = codes + v * k;
    const float* s = scale + v * groups;
    const float* o = offset + v * groups;
    if (v + 4 < v1) __builtin_prefetch(row + 4 * k);
    for (int64_t r = 0; r < m; ++r) {
      const float* xr = x + r * k;
      const float* xsr = xs + r * groups;
      float total = 0.0f;
      if (vectors) {
        vf acc = {};
        for (int64_t g = 0; g < groups; ++g) {
          vf part = {};
          for (int64_t i = g * group; i < (g + 1) * group; i += kLanes) part += load_codes(row + i) * load_vf(xr + i);
          acc += s[g] * part;
          total += o[g] * xsr[g];
        }
        for (int i = 0; i < kLanes; ++i) total += acc[i];
      } else {
        for (int64_t g = 0; g < groups; ++g) {
          float dot = 0.0f;
          for (int64_t i = g * group; i < (g + 1) * group; ++i) dot += static_cast<float>(row[i]) * xr[i];
          total += s[g] * dot + o[g] * xsr[g];
        }
      }
      y[r * n + v] = total;
    }
  }
}

// w [K, N] = scale * codes + offset, float32, for a product too large for the kernels above (a prefill chunk),
// which XLA:CPU's GEMM then runs: rows [k0, k1).
void dequant_rows(const int8_t* codes, const float* scale, const float* offset, float* w, int64_t n, int64_t group,
                  int64_t k0, int64_t k1) {
  for (int64_t kk = k0; kk < k1; ++kk) {
    const int8_t* c = codes + kk * n;
    const float* s = scale + (kk / group) * n;
    const float* o = offset + (kk / group) * n;
    float* out = w + kk * n;
    const int64_t n_vec = n / kLanes * kLanes;
    for (int64_t j = 0; j < n_vec; j += kLanes) store_vf(out + j, load_vf(s + j) * load_codes(c + j) + load_vf(o + j));
    for (int64_t j = n_vec; j < n; ++j) out[j] = s[j] * static_cast<float>(c[j]) + o[j];
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
  if (m <= kMaxStreamRows && group % 4 == 0) {
    // Blocks of K split among the threads, each streaming its own rows of codes; slice 0 writes y, the others
    // partial sums added after.
    const int64_t groups = k / group;
    const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), groups));
    std::vector<float> partial((parts - 1) * m * n);
    float* pp = partial.data();
    jaxserve_cpu::parallel_for(pool, parts, [=](int64_t i) {
      qstream(xp, cp, sp, op, xsp, i == 0 ? yp : pp + (i - 1) * m * n, m, k, n, group, groups * i / parts,
              groups * (i + 1) / parts);
    });
    for (int64_t i = 1; i < parts; ++i) {
      const float* src = pp + (i - 1) * m * n;
#pragma omp simd
      for (int64_t j = 0; j < m * n; ++j) yp[j] += src[j];
    }
    return ffi::Error::Success();
  }
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

ffi::Error DequantImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> codes, ffi::Buffer<ffi::F32> scale,
                       ffi::Buffer<ffi::F32> offset, ffi::ResultBuffer<ffi::F32> w) {
  const auto cd = codes.dimensions(), sd = scale.dimensions();
  if (cd.size() != 2 || sd.size() != 2 || sd[1] != cd[1] || sd[0] == 0 || cd[0] % sd[0] ||
      offset.element_count() != scale.element_count() || w->element_count() != codes.element_count()) {
    return ffi::Error::InvalidArgument("cpu_dequantize: codes [K, N], scale and offset [K/G, N] -> w [K, N]");
  }
  const int64_t k = cd[0], n = cd[1], group = k / sd[0];
  const int8_t* cp = codes.typed_data();
  const float *sp = scale.typed_data(), *op = offset.typed_data();
  float* wp = w->typed_data();
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), k / 8));
  jaxserve_cpu::parallel_for(pool, parts, [=](int64_t i) { dequant_rows(cp, sp, op, wp, n, group, k * i / parts, k * (i + 1) / parts); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveCpuDequantize, DequantImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

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
