// Attention of ragged query tokens over a paged KV cache, one token at a time (the decode
// tokens of a ragged step), as an XLA FFI custom call for the CPU.
//
// Token n attends positions 0 .. positions[n] of its sequence rows[n] (only the `window` latest,
// positions[n] - window + 1 .. positions[n], when window > 0: a local layer's sliding window),
// whose keys and values are in the pages page_tables[rows[n], 0 ..] (already written, its own
// included). XLA:CPU runs this
// as per-token gathers of a whole window followed by 2 x N x K tiny batched matmuls ([G, H] x
// [H, window]), bound by per-product overhead, not by memory; here each (token, KV head) pair is
// one work item that reads its pages in place, only up to its own position: scores by one
// vectorised dot product per position (a page's keys are [page_size, H], each key one
// contiguous row), an exact softmax over its range, then the weighted values accumulated in
// registers over head_dim. Scaled dot-product attention, Vaswani et al. 2017, section 3.2.1,
// with grouped KV heads (Ainslie et al. 2023).
//
// Operands: q [N, K, G, H] f32 (already scaled by 1/sqrt(H)); k_pages, v_pages [L, P, K,
// page_size, H], both f32 or both bf16 (or both u16: bf16's bits), or both s8 [L, P, K, page_size, H + 2] (each row H codes
// and a float16 scale: model/attention/pages.py's to_stored; a row's dot products and value
// weights are scaled once) (the stacked pages of every layer); page_tables [R, M]
// s32; rows [N] s32; positions [N] s32; layer s32 [] (which of the L layers is read); window s32
// [] (the sliding window, 0 = none). Result:
// [N, K, G, H] f32, zeros for a padding token (a row outside [0, R), or a position outside
// [0, M x page_size)). Page ids are clipped into [0, P), as the XLA path clips them. head_dim a
// multiple of 16 (meshserve::kHeadDimMultiple), 1 <= G <= 8. Built and registered by
// model/native/__init__.py; model/native/cpu_paged_attention.py is its Python side.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "parallel_for.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using meshserve::exp_minus_max;
using meshserve::kLanes;
using meshserve::kValueTiles;
using meshserve::load;
using meshserve::store;
using meshserve::vf;

constexpr int64_t kMaxGroup = 8;

struct Problem {
  int64_t N, K, G, H, L, P, ps, R, M;
  const float* q;
  const void* k;  // [L, P, K, ps, H]
  const void* v;
  const int32_t* tables;  // [R, M]
  const int32_t* rows;
  const int32_t* positions;
  int64_t layer;
  int64_t window;  // 0: every earlier position
  float* out;
};

// The sum of x's lanes, by halving shuffles where the target has them (a lane-by-lane sum is a
// chain of kLanes dependent scalar adds, once per position and query head).
inline float hsum(vf x) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)x);
#elif defined(__AVX2__)
  __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)x), _mm256_extractf128_ps((__m256)x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#else
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += x[i];
  return s;
#endif
}

// out[g, h0 .. h0 + kTiles x kLanes) = sum over positions w in [lo, len) of probs[g, w - w00] x
// value w, value w being row w % ps of page pages[(w - w00) / ps] (rows of H entries), w00 the
// first page's first position (lo rounded down to a page).
template <int G, int kTiles, typename T>
void values_pass(const float* probs, int64_t W, const T* const* pages, int64_t ps, int64_t lo, int64_t len,
                 int64_t H, int64_t h0, float* out) {
  const int64_t Hs = meshserve::row_entries<T>(H);  // a row's entries in the pages
  vf acc[G][kTiles];
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < kTiles; ++t) acc[g][t] = vf{};
  const int64_t w00 = lo / ps * ps;
  for (int64_t w0 = w00, j = 0; w0 < len; w0 += ps, ++j) {
    const T* page = pages[j];
    const int64_t m = std::min(ps, len - w0);
    for (int64_t o = std::max<int64_t>(0, lo - w0); o < m; ++o) {
      vf v[kTiles];
      for (int t = 0; t < kTiles; ++t) v[t] = load(page + o * Hs + h0 + t * kLanes);
      const float scale = meshserve::row_scale(page + o * Hs, H);  // 1 but in an 8-bit cache
      for (int g = 0; g < G; ++g) {
        const float pw = probs[g * W + w0 - w00 + o] * scale;
        for (int t = 0; t < kTiles; ++t) acc[g][t] += pw * v[t];
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < kTiles; ++t) store(out + g * H + h0 + t * kLanes, acc[g][t]);
}

// One (token, KV head) pair.
template <int G, typename T>
void attend_one(const Problem& p, int64_t item, std::vector<float>& scores, std::vector<const T*>& kp,
                std::vector<const T*>& vp) {
  const int64_t n = item / p.K, kh = item % p.K, H = p.H, ps = p.ps;
  float* out = p.out + item * G * H;
  const int64_t row = p.rows[n], pos = p.positions[n];
  if (row < 0 || row >= p.R || pos < 0 || pos >= p.M * ps) {  // padding
    std::fill(out, out + G * H, 0.0f);
    return;
  }
  // Positions [lo, len): all up to its own, or the window's latest. Pages from lo's on.
  const int64_t len = pos + 1, lo = p.window > 0 ? std::max<int64_t>(0, len - p.window) : 0;
  const int64_t first_page = lo / ps, num_pages = (len + ps - 1) / ps - first_page;
  const int64_t w00 = first_page * ps;  // the first page's first position
  const int64_t W = num_pages * ps;     // scores per query head, whole pages
  scores.resize(G * W);
  kp.resize(num_pages);
  vp.resize(num_pages);
  const int32_t* table = p.tables + row * p.M + first_page;
  const int64_t Hs = meshserve::row_entries<T>(H);  // a row's entries: H, and an 8-bit row's scale
  const int64_t page_elems = ps * Hs;                // one (page, KV head)'s keys
  const T* k = static_cast<const T*>(p.k) + p.layer * p.P * p.K * page_elems;
  const T* v = static_cast<const T*>(p.v) + p.layer * p.P * p.K * page_elems;
  for (int64_t j = 0; j < num_pages; ++j) {
    const int64_t page = std::clamp<int64_t>(table[j], 0, p.P - 1);
    kp[j] = k + (page * p.K + kh) * page_elems;
    vp[j] = v + (page * p.K + kh) * page_elems;
  }
  const float* q = p.q + item * G * H;

  // Scores: one dot product over head_dim per (query head, position), keys read once each;
  // score w - w00 is position w's (those below lo unused).
  for (int64_t w0 = w00, j = 0; w0 < len; w0 += ps, ++j) {
    const int64_t m = std::min(ps, len - w0);
    for (int64_t o = std::max<int64_t>(0, lo - w0); o < m; ++o) {
      const T* key = kp[j] + o * Hs;
      vf acc[G];
      for (int g = 0; g < G; ++g) acc[g] = vf{};
      for (int64_t h = 0; h < H; h += kLanes) {
        const vf kv = load(key + h);
        for (int g = 0; g < G; ++g) acc[g] += load(q + g * H + h) * kv;
      }
      const float scale = meshserve::row_scale(key, H);
      for (int g = 0; g < G; ++g) scores[g * W + w0 - w00 + o] = hsum(acc[g]) * scale;
    }
  }
  // Softmax over [lo, len) per query head; the normaliser is applied to the output.
  float inv_sum[G];
  for (int g = 0; g < G; ++g) inv_sum[g] = 1.0f / exp_minus_max(scores.data() + g * W + lo - w00, len - lo);

  const float* probs = scores.data();
  constexpr int t = kValueTiles<G>;
  int64_t h0 = 0;
  for (; h0 + t * kLanes <= H; h0 += t * kLanes) values_pass<G, t>(probs, W, vp.data(), ps, lo, len, H, h0, out);
  for (; h0 < H; h0 += kLanes) values_pass<G, 1>(probs, W, vp.data(), ps, lo, len, H, h0, out);
  for (int g = 0; g < G; ++g)
    for (int64_t h = 0; h < H; ++h) out[g * H + h] *= inv_sum[g];
}

template <typename T>
void attend_item(const Problem& p, int64_t item) {
  thread_local std::vector<float> scores;
  thread_local std::vector<const T*> kp, vp;
  switch (p.G) {  // query heads per KV head: compile-time, so the register tiles stay registers
    case 1: return attend_one<1, T>(p, item, scores, kp, vp);
    case 2: return attend_one<2, T>(p, item, scores, kp, vp);
    case 3: return attend_one<3, T>(p, item, scores, kp, vp);
    case 4: return attend_one<4, T>(p, item, scores, kp, vp);
    case 5: return attend_one<5, T>(p, item, scores, kp, vp);
    case 6: return attend_one<6, T>(p, item, scores, kp, vp);
    case 7: return attend_one<7, T>(p, item, scores, kp, vp);
    case 8: return attend_one<8, T>(p, item, scores, kp, vp);
  }
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                          ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> page_tables, ffi::Buffer<ffi::S32> rows,
                          ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> layer,
                          ffi::Buffer<ffi::S32> window, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto qd = q.dimensions();
  auto kd = k_pages.dimensions();
  auto td = page_tables.dimensions();
  if (qd.size() != 4) return ffi::Error::InvalidArgument("q must be [N, K, G, H]");
  if (kd.size() != 5) return ffi::Error::InvalidArgument("pages must be [L, P, K, page_size, H]");
  if (td.size() != 2) return ffi::Error::InvalidArgument("page tables must be [R, M]");
  Problem p;
  p.N = qd[0], p.K = qd[1], p.G = qd[2], p.H = qd[3];
  p.L = kd[0], p.P = kd[1], p.ps = kd[3], p.R = td[0], p.M = td[1];
  if (p.G < 1 || p.G > kMaxGroup) return ffi::Error::InvalidArgument("query heads per KV head must be between 1 and 8");
  if (p.H % meshserve::kHeadDimMultiple != 0) return ffi::Error::InvalidArgument("head_dim must be a multiple of 16");
  auto vd = v_pages.dimensions();
  bool same = vd.size() == kd.size();
  for (size_t i = 0; same && i < kd.size(); ++i) same = vd[i] == kd[i];
  const auto dtype = k_pages.element_type();
  // A bfloat16 cache's pages come as its bits, uint16 (model/attention/pages.py: storage_dtype).
  const bool bf16 = dtype == ffi::DataType::BF16 || dtype == ffi::DataType::U16;
  if (v_pages.element_type() != dtype || (dtype != ffi::DataType::F32 && !bf16 && dtype != ffi::DataType::S8))
    return ffi::Error::InvalidArgument("pages must be both float32, both bfloat16 (or its bits, uint16) or both int8");
  const int64_t Hs = dtype == ffi::DataType::S8 ? p.H + 2 : p.H;  // an 8-bit row: H codes and a float16 scale
  if (kd[2] != p.K || kd[4] != Hs || !same)
    return ffi::Error::InvalidArgument(
        "pages must be [L, P, K, page_size, H] (H + 2 in int8) with q's K and H, keys and values alike");
  if (rows.element_count() != static_cast<size_t>(p.N) || positions.element_count() != static_cast<size_t>(p.N))
    return ffi::Error::InvalidArgument("rows and positions must be [N]");
  if (layer.element_count() != 1) return ffi::Error::InvalidArgument("layer must be a scalar");
  if (window.element_count() != 1) return ffi::Error::InvalidArgument("window must be a scalar");
  p.layer = layer.typed_data()[0];
  if (p.layer < 0 || p.layer >= p.L) return ffi::Error::InvalidArgument("layer out of range");
  p.window = window.typed_data()[0];
  if (p.window < 0) return ffi::Error::InvalidArgument("window must be >= 0");
  p.q = q.typed_data();
  p.k = k_pages.untyped_data();
  p.v = v_pages.untyped_data();
  p.tables = page_tables.typed_data();
  p.rows = rows.typed_data();
  p.positions = positions.typed_data();
  p.out = out->typed_data();
  meshserve::ParallelFor(pool, p.N * p.K, [&p, dtype, bf16](int64_t item) {  // one item per (token, KV head)
    if (bf16)
      attend_item<uint16_t>(p, item);
    else if (dtype == ffi::DataType::S8)
      attend_item<int8_t>(p, item);
    else
      attend_item<float>(p, item);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshservePagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // key pages
                                  .Arg<ffi::AnyBuffer>()         // value pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window
                                  .Ret<ffi::Buffer<ffi::F32>>());  // attention output
