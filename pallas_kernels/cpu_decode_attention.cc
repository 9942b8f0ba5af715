// Paged attention on the CPU that reads the cache in place: an XLA FFI custom call.
//
// Each query row (a token) attends over its own sequence's pages, read where they lie in the cache, up to its own
// position: a decode step's last tokens, and in a mixed step every token, prompts' included (the pages already
// hold this step's keys). The
// jnp version (xla_attention.py, route 1) first gathers each sequence's pages into a [K, C, D] copy, and
// with the pages cold behind a layer's weights that gather cost more than the products themselves:
// 145 µs a layer for 393 KB of K and V (docs/BENCHMARKS.md §35). Here every K and V row is read once,
// straight from its page, into a score buffer and an accumulator that stay in L1.
//
// Shapes (heads-major cache, kv_layout.py): q [R, K, G, D] float32; k_pages, v_pages [N, K, P, D] float32 or
// bfloat16 (or bfloat16 bits in uint16, as fp8.storage_dtype keeps a bf16 cache on the CPU); block_tables [S, B]
// int32; row_tables [R] int32 (the block table each row reads: its sequence); row_lens [R] int32 (the context
// length it sees, its position + 1; 0, or a row_tables entry outside [0, S), marks a padding row: zeros out).
// Attributes: scale (float), window (int32: a sliding window in tokens, or -1 for none).
// A call that reads more than a few hundred KB of K and V is split over the cores (cpu_threads.h) in parts of about
// equal context: decode steps of 16-48 sequences ran 7-10% faster for it on two cores, and taking every token of a
// mixed step here (not only the last ones) made those steps 27% faster (docs/BENCHMARKS.md §37).
// Output [R, K, G, D] float32. Built and registered by cpu_native.py; the pure-jnp routes of xla_attention.py are
// its reference.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu_threads.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float load(const float* p) { return *p; }

inline float load(const uint16_t* p) {  // bfloat16: the high half of a float32
  uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// exp(x) for x <= 0 (scores minus their row maximum), branch-free so that the loop over a row vectorizes:
// 2^n * e^r with n = round(x / ln 2) (by the 1.5 * 2^23 trick) and |r| <= ln2 / 2, e^r by a degree-6 Taylor
// polynomial (relative error below 2e-7, about float32's own rounding). Below -87 the result is flushed to 0.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;  // ln 2 in two parts
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // n >= -126 here, so a normal power of two
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

// One (sequence, KV head): its G query rows (already scaled) over context positions [start, len), pages read in
// place. DIM > 0 fixes the head size at compile time (the common 64 and 128: fully unrolled dot products);
// DIM = 0 takes it from ``dim``. ``scores`` holds G * (len - start) floats.
template <int DIM, typename T>
void one_head(const float* qs, const T* k_head, const T* v_head, const int32_t* table, int64_t page_stride,
              int64_t page, int64_t dim_rt, int64_t group, int64_t start, int64_t len, float* scores, float* acc,
              float* out) {
  const int64_t dim = DIM > 0 ? DIM : dim_rt;
  const int64_t n = len - start;
  // Scores: one pass over the sequence's K rows, page by page, every query head of the group per row.
  for (int64_t t = start; t < len;) {
    const int64_t off = t % page, stop = std::min(len, t - off + page);
    const T* kr = k_head + table[t / page] * page_stride + off * dim;
    for (; t < stop; ++t, kr += dim) {
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = qs + g * dim;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < dim; ++d) dot += qg[d] * load(kr + d);
        scores[g * n + (t - start)] = dot;
      }
    }
  }
  // Softmax weights, unnormalised; each row's sum divides its output once at the end.
  float row_sum[64];  // group <= 64 (checked by the caller)
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * n;
    float m = sg[0];
#pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < n; ++i) m = sg[i] > m ? sg[i] : m;
    float l = 0.0f;
#pragma omp simd reduction(+ : l)
    for (int64_t i = 0; i < n; ++i) {
      const float e = exp_nonpositive(sg[i] - m);
      sg[i] = e;
      l += e;
    }
    row_sum[g] = l;
  }
  // Weighted values: one pass over the V rows.
  std::fill(acc, acc + group * dim, 0.0f);
  for (int64_t t = start; t < len;) {
    const int64_t off = t % page, stop = std::min(len, t - off + page);
    const T* vr = v_head + table[t / page] * page_stride + off * dim;
    for (; t < stop; ++t, vr += dim) {
      for (int64_t g = 0; g < group; ++g) {
        const float w = scores[g * n + (t - start)];
        float* a = acc + g * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) a[d] += w * load(vr + d);
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = 1.0f / row_sum[g];
    for (int64_t d = 0; d < dim; ++d) out[g * dim + d] = acc[g * dim + d] * inv;
  }
}

// Calls that read less K and V than this run on the calling thread alone: waking a task of the pool costs more.
constexpr int64_t kMinParallelBytes = 256 * 1024;

// One call: its operands and the (row, KV head) items it computes; item i is row i / K, head i % K. A row is a
// query token with the block table it reads (table_of) and the context length it sees (lens).
template <typename T>
struct AttentionCall {
  const float* q;
  const T* k_pages;
  const T* v_pages;
  const int32_t* tables;
  const int32_t* table_of;
  const int32_t* lens;
  float* out;
  int64_t rows, num_tables, kv_heads, group, page, dim, blocks;
  float scale;
  int32_t window;

  // Context positions [start, len) that row r attends to (none for a row naming no table: padding).
  std::pair<int64_t, int64_t> span(int64_t r) const {
    if (table_of[r] < 0 || table_of[r] >= num_tables) return {0, 0};
    const int64_t len = std::min<int64_t>(lens[r], blocks * page);
    return {window >= 0 ? std::max<int64_t>(0, len - window) : 0, len};
  }

  void item(int64_t i) const {
    thread_local std::vector<float> qs, acc, scores;  // [G, D], [G, D], [G, C]: each thread its own
    const int64_t r = i / kv_heads, kh = i % kv_heads;
    const auto [start, len] = span(r);
    float* o = out + i * group * dim;
    if (len - start <= 0) {  // a padding row
      std::fill(o, o + group * dim, 0.0f);
      return;
    }
    qs.resize(group * dim);
    acc.resize(group * dim);
    const float* qh = q + i * group * dim;
    for (int64_t j = 0; j < group * dim; ++j) qs[j] = qh[j] * scale;
    if (scores.size() < static_cast<size_t>(group * (len - start))) scores.resize(group * (len - start));
    const int64_t page_stride = kv_heads * page * dim;  // one block of the cache, all heads
    const T* k_head = k_pages + kh * page * dim;
    const T* v_head = v_pages + kh * page * dim;
    const int32_t* table = tables + table_of[r] * blocks;
    if (dim == 64) {
      one_head<64>(qs.data(), k_head, v_head, table, page_stride, page, dim, group, start, len, scores.data(),
                   acc.data(), o);
    } else if (dim == 128) {
      one_head<128>(qs.data(), k_head, v_head, table, page_stride, page, dim, group, start, len, scores.data(),
                    acc.data(), o);
    } else {
      one_head<0>(qs.data(), k_head, v_head, table, page_stride, page, dim, group, start, len, scores.data(),
                  acc.data(), o);
    }
  }

  // Runs every item: on the calling thread for a small call, else split over the cores in parts of about equal
  // context (rows differ in length, and padding rows cost nothing).
  void run(ffi::ThreadPool& pool) const {
    const int64_t items = rows * kv_heads;
    const int64_t threads = std::max<int64_t>(1, pool.num_threads());
    std::vector<int64_t> cost(items + 1, 0);  // cost[i]: context positions of items before i, plus a little each
    for (int64_t i = 0; i < items; ++i) {
      const auto [start, len] = span(i / kv_heads);
      cost[i + 1] = cost[i] + std::max<int64_t>(0, len - start) + 8;
    }
    const int64_t bytes = (cost[items] - 8 * items) * dim * 2 * static_cast<int64_t>(sizeof(T));
    const int64_t parts = std::min<int64_t>(items, 4 * threads);  // a few per thread: claimed as they finish
    if (threads == 1 || parts < 2 || bytes < kMinParallelBytes) {
      for (int64_t i = 0; i < items; ++i) item(i);
      return;
    }
    std::vector<int64_t> bounds(parts + 1, items);  // part p: items [bounds[p], bounds[p + 1])
    bounds[0] = 0;
    for (int64_t p = 1, i = 0; p < parts; ++p) {
      while (i < items && cost[i] * parts < cost[items] * p) ++i;
      bounds[p] = i;
    }
    const int64_t* b = bounds.data();
    jaxserve_cpu::parallel_for(pool, parts, [this, b](int64_t p) {
      for (int64_t i = b[p]; i < b[p + 1]; ++i) item(i);
    });
  }
};

ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                               ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> block_tables,
                               ffi::Buffer<ffi::S32> row_tables, ffi::Buffer<ffi::S32> row_lens,
                               ffi::ResultBuffer<ffi::F32> out, float scale, int32_t window) {
  const auto qd = q.dimensions();
  const auto kd = k_pages.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || block_tables.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument("cpu_decode_attention: q and pages must be 4-D, block_tables 2-D");
  }
  const int64_t rows = qd[0], kv_heads = qd[1], group = qd[2], dim = qd[3];
  const int64_t page = kd[2], num_tables = block_tables.dimensions()[0], blocks = block_tables.dimensions()[1];
  if (kd[1] != kv_heads || kd[3] != dim || group > 64 || k_pages.element_type() != v_pages.element_type()) {
    return ffi::Error::InvalidArgument("cpu_decode_attention: q [R, K, G<=64, D] does not match pages [N, K, P, D]");
  }
  if (row_tables.element_count() != rows || row_lens.element_count() != rows) {
    return ffi::Error::InvalidArgument("cpu_decode_attention: row_tables and row_lens need one entry per row of q");
  }
  const int32_t* tables = block_tables.typed_data();
  const int32_t* table_of = row_tables.typed_data();
  const int32_t* lens = row_lens.typed_data();
  switch (k_pages.element_type()) {
    case ffi::F32:
      AttentionCall<float>{q.typed_data(), static_cast<const float*>(k_pages.untyped_data()),
                        static_cast<const float*>(v_pages.untyped_data()), tables, table_of, lens,
                        out->typed_data(), rows, num_tables, kv_heads, group, page, dim, blocks, scale, window}
          .run(pool);
      return ffi::Error::Success();
    case ffi::BF16:
    case ffi::U16:  // bfloat16 bits: how a CPU gather backend stores a bf16 cache (fp8.storage_dtype)
      AttentionCall<uint16_t>{q.typed_data(), static_cast<const uint16_t*>(k_pages.untyped_data()),
                           static_cast<const uint16_t*>(v_pages.untyped_data()), tables, table_of, lens,
                           out->typed_data(), rows, num_tables, kv_heads, group, page, dim, blocks, scale, window}
          .run(pool);
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("cpu_decode_attention: pages must be float32 or bfloat16 (or its bits)");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveCpuDecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("window"));
