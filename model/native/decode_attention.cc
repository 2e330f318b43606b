// A decode step's KV-cache write and attention over a blocked KV cache, as an XLA FFI custom
// call for the CPU.
//
// Each slot's new key and value are written at its position, then its one query token attends
// to the first position[s] + 1 cached positions of the slot, W being the window (the sum of
// the block lengths); a position outside [0, W) marks an idle slot: nothing is written and its
// output is zeros. XLA:CPU runs this attention as 2 * S * K tiny batched matmuls per block
// ([G, H] x [H, n]), bound by per-product overhead rather than by memory, and the write as four
// scatters per layer; here each (slot, KV head) pair is one work item that writes its entries
// and streams its keys and values once, only up to its own length, vectorised over positions
// (scores) and over head_dim (values). Scaled dot-product attention, Vaswani et al. 2017,
// section 3.2.1, with grouped KV heads (Ainslie et al. 2023).
//
// Operands: q [S, K, G, H] f32 (already scaled by 1/sqrt(H)); positions [S] s32; new keys and
// values [S, K, H] f32; then nb key blocks [S, K, H, n_j] and nb value blocks [S, K, n_j, H],
// all f32 or all bf16. Results: the attention [S, K, G, H] f32, then the 2 nb blocks, written
// (aliased to the operand blocks by the caller; copied from them first where they are not).
// head_dim a multiple of 16 (meshserve::kHeadDimMultiple). Built and registered by
// model/native_kernels.py; docs/cpu-kernels.md has the measurements behind the choices here.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "cache_blocks.h"
#include "parallel_for.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using meshserve::from_f32;
using meshserve::to_f32;

struct Problem {
  int64_t S, K, G, H;
  const float* q;
  const int32_t* positions;
  const float* k_new;  // [S, K, H]: each slot's new key, written at its position first
  const float* v_new;  // [S, K, H]
  meshserve::CacheBlocks cache;  // the result blocks (aliased to the operands), their lengths
  float* out;
};

constexpr int64_t kMaxGroup = 8;  // attend_item's largest G
using meshserve::exp_minus_max;
using meshserve::kLanes;
using meshserve::kValueTiles;
using meshserve::load;
using meshserve::store;
using meshserve::vf;
constexpr int kAhead = 16;  // rows prefetched ahead (hardware prefetchers restart at every 4 KiB page)
// Into L2 (locality 1, prefetcht2), not L1 (3): a (slot, head)'s keys and values outgrow L1,
// and L1's few miss buffers cap the lines in flight; L2 took the stream faster.
constexpr int kLocality = 1;

// The scores of G query heads over positions [0, m) of one block, keys stored [H, n]. The
// keys of one (slot, head) are read in storage order: 4 head_dim rows at a time, each swept
// along its positions, the partial sums kept in `scores` (G * W floats, in L1). (Tiles of
// positions accumulated over all of head_dim in registers read the rows with an n-float
// stride instead, several times slower than this stream.) When n is a
// multiple of kLanes, m is rounded up to whole vectors inside the row: the scores past m are
// computed from stale keys and never read. Requires H % 4 == 0.
template <int G, typename T>
void block_scores(const float* q, const T* kb, int64_t H, int64_t n, int64_t m, float* scores, int64_t W) {
  const int64_t mv = n % kLanes == 0 ? (m + kLanes - 1) / kLanes * kLanes : m / kLanes * kLanes;
  for (int g = 0; g < G; ++g) std::fill(scores + g * W, scores + g * W + mv, 0.0f);
  for (int64_t h = 0; h < H; h += 4) {
    const T* k = kb + h * n;
    float qv[G][4];
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < 4; ++r) qv[g][r] = q[g * H + h + r];
    for (int64_t w = 0; w < mv; w += kLanes) {
      const vf k0 = load(k + w), k1 = load(k + n + w), k2 = load(k + 2 * n + w), k3 = load(k + 3 * n + w);
      if (w % meshserve::kLineFloats == 0)  // once per cache line of each row
        for (int r = kAhead; r < kAhead + 4; ++r) __builtin_prefetch(k + r * n + w, 0, kLocality);
      for (int g = 0; g < G; ++g) {
        float* s = scores + g * W + w;
        store(s, load(s) + qv[g][0] * k0 + qv[g][1] * k1 + qv[g][2] * k2 + qv[g][3] * k3);
      }
    }
  }
  for (int64_t w = mv; w < m; ++w)  // a block shorter than a multiple of kLanes: its tail
    for (int g = 0; g < G; ++g) {
      float acc = 0.0f;
      for (int64_t h = 0; h < H; ++h) acc += q[g * H + h] * to_f32(kb[h * n + w]);
      scores[g * W + w] = acc;
    }
}

// out[g, :] += sum over positions w < m of probs[g, w] * values[w, :], values stored [n, H]:
// kTiles vectors of head_dim entries per pass held in registers for all G heads, the value
// rows read in storage order. Requires H % kLanes == 0.
template <int G, int kTiles, typename T>
void values_pass(const float* probs, const T* vb, int64_t H, int64_t h0, int64_t m, float* out, int64_t W) {
  vf acc[G][kTiles];
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < kTiles; ++t) acc[g][t] = vf{};
  for (int64_t w = 0; w < m; ++w) {
    vf v[kTiles];
    for (int t = 0; t < kTiles; ++t) v[t] = load(vb + w * H + h0 + t * kLanes);
    for (int l = 0; l < kTiles * kLanes; l += 2 * meshserve::kLineFloats)  // a line pair at a time
      __builtin_prefetch(vb + (w + kAhead) * H + h0 + l, 0, kLocality);
    for (int g = 0; g < G; ++g) {
      const float pw = probs[g * W + w];
      for (int t = 0; t < kTiles; ++t) acc[g][t] += pw * v[t];
    }
  }
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < kTiles; ++t) {
      float* o = out + g * H + h0 + t * kLanes;
      store(o, load(o) + acc[g][t]);
    }
}

template <int G, typename T>
void block_values(const float* probs, const T* vb, int64_t H, int64_t m, float* out, int64_t W) {
  constexpr int t = kValueTiles<G>;
  int64_t h0 = 0;
  for (; h0 + t * kLanes <= H; h0 += t * kLanes) values_pass<G, t>(probs, vb, H, h0, m, out, W);
  for (; h0 < H; h0 += kLanes) values_pass<G, 1>(probs, vb, H, h0, m, out, W);
}

// One (slot, KV head) pair: scores over its first len positions, softmax, weighted values.
template <int G, typename T>
void attend_one(const Problem& p, int64_t item, std::vector<float>& scores) {
  const int64_t s = item / p.K, H = p.H, W = p.cache.width;
  const int64_t pos = p.positions[s];
  float* out = p.out + item * G * H;
  if (pos < 0 || pos >= W) {  // an idle slot
    std::fill(out, out + G * H, 0.0f);
    return;
  }
  const int64_t len = pos + 1;
  scores.resize(G * W + kLanes);
  const float* q = p.q + item * G * H;

  // The new value goes in first, at the slot's position (values [n, H]: one contiguous row).
  // The new key is scored straight from k_new (rounded to the cache dtype, as stored) and
  // written after the scores pass, which has brought the lines of its column into cache:
  // written first, its H entries n floats apart would each miss to memory.
  T* k_column = nullptr;  // the new key's place: H entries n_column apart
  int64_t n_column = 0;
  int64_t b0 = 0;
  for (size_t j = 0; j < p.cache.k.size(); b0 += p.cache.len[j], ++j) {
    const int64_t n = p.cache.len[j];
    if (pos < b0 || pos >= b0 + n) continue;
    k_column = static_cast<T*>(p.cache.k[j]) + item * H * n + (pos - b0);
    n_column = n;
    T* vb = static_cast<T*>(p.cache.v[j]) + item * n * H + (pos - b0) * H;
    for (int64_t h = 0; h < H; ++h) from_f32(p.v_new[item * H + h], vb + h);
  }

  b0 = 0;  // the cached positions [0, pos)
  for (size_t j = 0; j < p.cache.k.size() && b0 < pos; ++j) {
    const int64_t n = p.cache.len[j];
    const T* kb = static_cast<const T*>(p.cache.k[j]) + item * H * n;
    block_scores<G, T>(q, kb, H, n, std::min(n, pos - b0), scores.data() + b0, W);
    b0 += n;
  }
  // Then position pos's scores, after the passes (which may leave stale scores past their m).
  const float* k_new = p.k_new + item * H;
  for (int g = 0; g < G; ++g) {
    float acc = 0.0f;
    for (int64_t h = 0; h < H; ++h) {
      T stored;
      from_f32(k_new[h], &stored);
      acc += q[g * H + h] * to_f32(stored);
    }
    scores[g * W + pos] = acc;
  }
  for (int64_t h = 0; h < H; ++h) from_f32(k_new[h], k_column + h * n_column);

  // Softmax over [0, len) per query head; the normaliser is applied to the output.
  float inv_sum[G];
  for (int g = 0; g < G; ++g) inv_sum[g] = 1.0f / exp_minus_max(scores.data() + g * W, len);

  std::fill(out, out + G * H, 0.0f);
  b0 = 0;
  for (size_t j = 0; j < p.cache.v.size() && b0 < len; ++j) {
    const int64_t n = p.cache.len[j];
    const T* vb = static_cast<const T*>(p.cache.v[j]) + item * n * H;
    block_values<G, T>(scores.data() + b0, vb, H, std::min(n, len - b0), out, W);
    b0 += n;
  }
  for (int g = 0; g < G; ++g)
    for (int64_t h = 0; h < H; ++h) out[g * H + h] *= inv_sum[g];
}

template <typename T>
void attend_item(const Problem& p, int64_t item, std::vector<float>& scores) {
  switch (p.G) {  // query heads per KV head: compile-time, so the register tiles stay registers
    case 1: return attend_one<1, T>(p, item, scores);
    case 2: return attend_one<2, T>(p, item, scores);
    case 3: return attend_one<3, T>(p, item, scores);
    case 4: return attend_one<4, T>(p, item, scores);
    case 5: return attend_one<5, T>(p, item, scores);
    case 6: return attend_one<6, T>(p, item, scores);
    case 7: return attend_one<7, T>(p, item, scores);
    case 8: return attend_one<8, T>(p, item, scores);
  }
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S32> positions,
                           ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new, ffi::RemainingArgs blocks,
                           ffi::Result<ffi::Buffer<ffi::F32>> out, ffi::RemainingRets blocks_out) {
  auto qd = q.dimensions();
  if (qd.size() != 4) return ffi::Error::InvalidArgument("q must be [S, K, G, H]");
  if (qd[2] < 1 || qd[2] > kMaxGroup)
    return ffi::Error::InvalidArgument("query heads per KV head must be between 1 and 8");
  if (qd[3] % meshserve::kHeadDimMultiple != 0) return ffi::Error::InvalidArgument("head_dim must be a multiple of 16");
  Problem p;
  p.S = qd[0], p.K = qd[1], p.G = qd[2], p.H = qd[3];
  if (positions.element_count() != static_cast<size_t>(p.S))
    return ffi::Error::InvalidArgument("positions must be [S]");
  const size_t kv_count = static_cast<size_t>(p.S * p.K * p.H);
  if (k_new.element_count() != kv_count || v_new.element_count() != kv_count)
    return ffi::Error::InvalidArgument("new keys and values must be [S, K, H]");
  p.q = q.typed_data();
  p.positions = positions.typed_data();
  p.k_new = k_new.typed_data();
  p.v_new = v_new.typed_data();
  p.out = out->typed_data();
  if (auto e = meshserve::BindCacheBlocks(blocks, blocks_out, p.K, p.H, &p.cache); e.failure()) return e;
  if (p.cache.slots != p.S) return ffi::Error::InvalidArgument("cache blocks must be [S, K, ...]");
  meshserve::ParallelFor(pool, p.S * p.K, [&p](int64_t item) {  // one item per (slot, KV head)
    thread_local std::vector<float> scores;
    if (p.cache.bf16)
      attend_item<uint16_t>(p, item, scores);
    else
      attend_item<float>(p, item, scores);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshserveDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions
                                  .Arg<ffi::Buffer<ffi::F32>>()  // new keys
                                  .Arg<ffi::Buffer<ffi::F32>>()  // new values
                                  .RemainingArgs()               // key blocks, then value blocks
                                  .Ret<ffi::Buffer<ffi::F32>>()  // attention output
                                  .RemainingRets());             // the blocks, written
