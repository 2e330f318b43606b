// Causal self-attention of a prompt chunk with nothing cached (a first prefill chunk), as an
// XLA FFI custom call for the CPU.
//
// Query t attends keys 0 .. t of the chunk: scaled dot-product attention (Vaswani et al. 2017,
// section 3.2.1) with grouped KV heads (Ainslie et al. 2023) and a causal mask. XLA:CPU runs
// it as batched dots over query blocks, each block computing its whole key range including the
// masked upper triangle, and copies the scores between the dots and the softmax. Here one work
// item is (KV head, 16 query positions): its G x 16 query vectors' scores against keys
// [0, t0 + 16) only, kept in L1 (keys re-laid out per call as [K, H, T], so a score vector is
// kLanes consecutive keys), an exact softmax per row over its own causal range, and the
// weighted values accumulated in registers over head_dim (values read in their [T, K, H] order).
//
// Operands: q [T, K, G, H] f32 (already scaled by 1/sqrt(H)); k, v [T, K, H] f32. Result:
// [T, K, G, H] f32. H a multiple of 16 (meshserve::kHeadDimMultiple). Built and registered by
// model/native_kernels.py.
#include <algorithm>
#include <cmath>
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

constexpr int64_t kRows = 16;  // query positions per work item
constexpr int kBroadcast = meshserve::kBroadcastOperand ? 0 : 1;  // registers a broadcast scalar takes
// Query vectors per score tile: two accumulator vectors each, plus two key vectors and the
// broadcast, within the vector registers (8 on AVX-512, 6 on AVX2), so the tile never spills.
constexpr int kQueries = std::min(8, (meshserve::kVectorRegisters - 2 - kBroadcast) / 2);

struct Problem {
  const float *q, *k, *v;
  float* out;
  int64_t T, K, G, H, Tp;  // Tp: keys per (head, h) row of kt, T rounded up to whole vectors
  std::vector<float> kt;   // keys [K, H, Tp], zero past T
};

// scores[j, u] for query vectors j in [0, nq) (pointers qs) and keys u in [0, n rounded up to
// whole vectors), kt the head's keys [H, Tp]; rows of scores W floats apart.
template <int Q>
void scores_tile(const float* const* qs, const float* kt, int64_t H, int64_t Tp, int64_t n, float* scores,
                 int64_t W) {
  for (int64_t u = 0; u < n; u += 2 * kLanes) {
    const bool two = u + kLanes < n;
    vf a0[Q], a1[Q];
    for (int j = 0; j < Q; ++j) a0[j] = a1[j] = vf{};
    for (int64_t h = 0; h < H; ++h) {
      const vf k0 = load(kt + h * Tp + u);
      const vf k1 = two ? load(kt + h * Tp + u + kLanes) : vf{};
      for (int j = 0; j < Q; ++j) {
        a0[j] += qs[j][h] * k0;
        a1[j] += qs[j][h] * k1;
      }
    }
    for (int j = 0; j < Q; ++j) {
      store(scores + j * W + u, a0[j]);
      if (two) store(scores + j * W + u + kLanes, a1[j]);
    }
  }
}

// scores_tile<q> for 1 <= q <= Q, q known only at run time.
template <int Q = kQueries>
void scores_rows(int q, const float* const* qs, const float* kt, int64_t H, int64_t Tp, int64_t n, float* scores,
                 int64_t W) {
  if constexpr (Q >= 1) {
    if (q == Q) return scores_tile<Q>(qs, kt, H, Tp, n, scores, W);
    return scores_rows<Q - 1>(q, qs, kt, H, Tp, n, scores, W);
  }
}

// out rows j (pointers os) = sum over u < len[j] of probs[j, u] * v[u, :] (v rows vstride
// floats apart), times inv[j]; kTiles vectors of head_dim per pass.
template <int Q, int kTiles>
void values_tile(const float* probs, int64_t W, const int64_t* len, const float* v, int64_t vstride, int64_t h0,
                 const float* inv, float* const* os) {
  vf acc[Q][kTiles];
  for (int j = 0; j < Q; ++j)
    for (int t = 0; t < kTiles; ++t) acc[j][t] = vf{};
  int64_t n = 0;
  for (int j = 0; j < Q; ++j) n = std::max(n, len[j]);
  for (int64_t u = 0; u < n; ++u) {  // probabilities past a row's own length are zero
    vf vv[kTiles];
    for (int t = 0; t < kTiles; ++t) vv[t] = load(v + u * vstride + h0 + t * kLanes);
    for (int j = 0; j < Q; ++j) {
      const float p = probs[j * W + u];
      for (int t = 0; t < kTiles; ++t) acc[j][t] += p * vv[t];
    }
  }
  for (int j = 0; j < Q; ++j)
    for (int t = 0; t < kTiles; ++t) store(os[j] + h0 + t * kLanes, acc[j][t] * inv[j]);
}

template <int Q>
void values_all(const float* probs, int64_t W, const int64_t* len, const float* v, int64_t vstride, int64_t H,
                const float* inv, float* const* os) {
  constexpr int t = kValueTiles<Q>;
  int64_t h0 = 0;
  for (; h0 + t * kLanes <= H; h0 += t * kLanes) values_tile<Q, t>(probs, W, len, v, vstride, h0, inv, os);
  for (; h0 < H; h0 += kLanes) values_tile<Q, 1>(probs, W, len, v, vstride, h0, inv, os);
}

// Rows [0, q) of a values pass, q <= 4.
void values_rows(int q, const float* s, int64_t W, const int64_t* len, const float* v, int64_t vstride, int64_t H,
                 const float* inv, float* const* os) {
  switch (q) {
    case 4: values_all<4>(s, W, len, v, vstride, H, inv, os); break;
    case 3: values_all<3>(s, W, len, v, vstride, H, inv, os); break;
    case 2: values_all<2>(s, W, len, v, vstride, H, inv, os); break;
    default: values_all<1>(s, W, len, v, vstride, H, inv, os); break;
  }
}

void attend_item(const Problem& p, int64_t item, std::vector<float>& scores) {
  const int64_t blocks = (p.T + kRows - 1) / kRows;
  // The longest rows first, so the last items claimed are the short ones.
  const int64_t kh = item / blocks, t0 = (blocks - 1 - item % blocks) * kRows;
  const int64_t rows = std::min(kRows, p.T - t0), n = t0 + rows;  // keys [0, n)
  const int64_t W = (n + 2 * kLanes - 1) / (2 * kLanes) * (2 * kLanes);
  const int64_t nq = rows * p.G;  // query vectors: j = r * G + g
  scores.resize(static_cast<size_t>(nq * W));
  const float* kt = p.kt.data() + kh * p.H * p.Tp;
  const float* qs[kQueries];
  float* os[kQueries];
  int64_t len[kQueries];
  float inv[kQueries];
  for (int64_t j0 = 0; j0 < nq; j0 += kQueries) {
    const int q = static_cast<int>(std::min<int64_t>(kQueries, nq - j0));
    for (int j = 0; j < kQueries; ++j) {
      const int64_t jj = j0 + std::min(j, q - 1), t = t0 + jj / p.G, g = jj % p.G;
      qs[j] = p.q + ((t * p.K + kh) * p.G + g) * p.H;
      os[j] = p.out + ((t * p.K + kh) * p.G + g) * p.H;
      len[j] = t + 1;
    }
    float* s = scores.data() + j0 * W;
    // Scores up to the group's longest row (its causal range), whole vectors.
    const int64_t ns = len[q - 1];
    scores_rows(q, qs, kt, p.H, p.Tp, ns, s, W);
    // Softmax of each row over [0, len), zeros past len.
    for (int j = 0; j < q; ++j) {
      float* sj = s + j * W;
      const int64_t m = len[j];
      const float sum = exp_minus_max(sj, m);
      std::fill(sj + m, sj + ns, 0.0f);  // the values pass reads every row up to the longest
      inv[j] = 1.0f / sum;
    }
    const float* v = p.v + kh * p.H;
    for (int64_t jv = 0; jv < q; jv += 4) {  // values 4 rows at a time
      const int qv = static_cast<int>(std::min<int64_t>(4, q - jv));
      values_rows(qv, s + jv * W, W, len + jv, v, p.K * p.H, p.H, inv + jv, os + jv);
    }
  }
}

ffi::Error CausalAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                           ffi::Buffer<ffi::F32> v, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), od = out->dimensions();
  if (qd.size() != 4) return ffi::Error::InvalidArgument("q must be [T, K, G, H]");
  Problem p;
  p.T = qd[0], p.K = qd[1], p.G = qd[2], p.H = qd[3];
  if (p.H % meshserve::kHeadDimMultiple != 0) return ffi::Error::InvalidArgument("head_dim must be a multiple of 16");
  if (kd.size() != 3 || kd[0] != p.T || kd[1] != p.K || kd[2] != p.H || vd.size() != 3 || vd[0] != p.T ||
      vd[1] != p.K || vd[2] != p.H)
    return ffi::Error::InvalidArgument("k and v must be [T, K, H] with q's T, K, H");
  if (od.size() != 4 || od[0] != p.T || od[1] != p.K || od[2] != p.G || od[3] != p.H)
    return ffi::Error::InvalidArgument("the result must be q's shape");
  if (p.T == 0 || p.K == 0 || p.G == 0) return ffi::Error::Success();
  p.q = q.typed_data(), p.k = k.typed_data(), p.v = v.typed_data(), p.out = out->typed_data();
  p.Tp = (p.T + 2 * kLanes - 1) / (2 * kLanes) * (2 * kLanes);
  p.kt.assign(static_cast<size_t>(p.K * p.H * p.Tp), 0.0f);
  constexpr int64_t kRun = meshserve::kLineFloats;  // by blocks of a cache line of positions: whole-line runs written
  for (int64_t kh = 0; kh < p.K; ++kh)
    for (int64_t t0 = 0; t0 < p.T; t0 += kRun)
      for (int64_t h = 0; h < p.H; ++h)
        for (int64_t t = t0; t < std::min(t0 + kRun, p.T); ++t)
          p.kt[(kh * p.H + h) * p.Tp + t] = p.k[(t * p.K + kh) * p.H + h];
  const int64_t blocks = (p.T + kRows - 1) / kRows;
  meshserve::ParallelFor(pool, p.K * blocks, [&p](int64_t item) {
    thread_local std::vector<float> scores;
    attend_item(p, item, scores);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshserveCausalAttention, CausalAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [T, K, G, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k [T, K, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v [T, K, H]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // [T, K, G, H]
