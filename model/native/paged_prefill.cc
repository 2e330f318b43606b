// Attention of prompt-chunk tokens over a paged KV cache, a block of consecutive query tokens of
// one sequence at a time (the prefill region of a ragged step), as an XLA FFI custom call for
// the CPU.
//
// The semantics are those of XLA's path, ragged_paged_attention_blocks: the N query tokens
// come in blocks of `block` consecutive tokens (the last one may be short); a block belongs to
// the sequence rows[n] of its first real token n (a real token: rows[n] in [0, R) and
// positions[n] >= 0), and each real token of that sequence (a member) attends positions
// 0 .. positions[n] of it, whose keys and values are in the pages page_tables[row, 0 ..] (already
// written, its own included); page ids are clipped into [0, P). Padding tokens and real tokens of
// another sequence than their block's (strays: the caller's broken promise) get zeros, so a
// block never reads another sequence's keys. With a sliding window (window > 0, a local
// layer's), a member attends only positions[n] - window + 1 .. positions[n]. Scaled dot-product attention, Vaswani et al. 2017,
// section 3.2.1, with grouped KV heads (Ainslie et al. 2023): the G query heads of a KV head
// share its keys and values.
//
// XLA:CPU runs the reference as a gather of one window per block followed by batched matmuls
// over the whole window, the masked (future) part included. Here one work item is (block, KV
// head, part), a part being a run of the block's query rows (a query row: one query head of one
// member token); a block is split into parts only when there are too few blocks x KV heads to
// keep every thread busy. An item:
//  * sorts the block's members by position (any order is allowed), so consecutive query rows
//    have nearly equal causal ranges and a tile of rows stops at its last row's position;
//  * packs the keys its rows need (positions up to its last row's) once, widened to float32, as
//    [key block][H][kKeys]: kKeys consecutive keys' h-th entries side by side, so the scores
//    loop broadcasts them from one pointer with constant offsets;
//  * per tile of kTileRows query rows (kLanes rows per vector, queries transposed to
//    [H][kTileRows] once per tile): scores of kKeys keys x the tile's rows per pass, register
//    tiled (every key read is shared by the tile's rows, i.e. by its tokens and the G query
//    heads), stored key-major as [key][row] so that the softmax runs across rows in vector
//    lanes: an exact max, e^(s - max) and sum per row over its own range 0 .. position, masked
//    per lane, with no horizontal reduction;
//  * accumulates the weighted values in registers, kValueRows rows x kValueVecs vectors of
//    head_dim per pass, each value vector read in place from its page (bfloat16 widened on the
//    fly) and shared by the pass's rows, the probabilities broadcast from the [key][row] scores;
//    then scales by each row's 1 / sum.
// Only keys and values of the item's own sequence up to its last row's position are read, and
// with a sliding window none below its first row's window. A row's range is [lo, len): lo 0, or
// len - window; a tile's keys run from its first row's lo to its last row's len (both ends
// grow with the sorted positions), masked per lane outside each row's range.
//
// Operands: q [N, K, G, H] f32 (already scaled by 1/sqrt(H)); k_pages, v_pages [L, P, K,
// page_size, H], both f32 or both bf16 (or both u16: bf16's bits), or both s8 [L, P, K, page_size, H + 2] (each row H codes
// and a float16 scale: model/attention/pages.py's to_stored) (the stacked pages of every
// layer); page_tables [R, M]
// s32; rows [N] s32; positions [N] s32; layer s32 [] (which of the L layers is read); window
// s32 [] (the sliding window, 0 = none); attribute
// `block` (int64 >= 1, tokens per block). Result: [N, K, G, H] f32. A member whose position is at
// or past M x page_size (beyond its table; ragged_paged_attention_blocks forbids it) gets zeros,
// as in the decode kernel (paged_attention.cc). head_dim a multiple of 16
// (meshserve::kHeadDimMultiple), 1 <= G <= 8, as the decode kernel; M x page_size at most 2^24
// (ranges are compared as float32 in vector lanes, exact up to there). Built and registered by
// model/native/__init__.py; model/native/cpu_paged_attention.py is its Python side.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "parallel_for.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using meshserve::exp_nonpositive;
using meshserve::kLanes;
using meshserve::kVectorRegisters;
using meshserve::load;
using meshserve::store;
using meshserve::vf;

typedef int32_t vi __attribute__((vector_size(kLanes * sizeof(int32_t))));

constexpr int64_t kMaxGroup = 8;
constexpr int kBroadcast = meshserve::kBroadcastOperand ? 0 : 1;  // registers a broadcast scalar takes
// Score tiles: kQV vectors of query rows (kTileRows rows) x kKeys keys per pass, so kKeys x kQV
// accumulators, the kQV query vectors of one h and (AVX2) the broadcast key entry stay in
// registers: 12 keys x 2 vectors in AVX-512's 32 registers, 6 x 2 in AVX2's 16.
constexpr int kQV = 2;
constexpr int kTileRows = kQV * kLanes;
constexpr int kKeys = kVectorRegisters >= 32 ? 12 : 6;
static_assert(kKeys * kQV + kQV + kBroadcast <= kVectorRegisters, "the score tile must fit the registers");
// Values passes: kValueRows query rows x kValueVecs vectors of head_dim accumulators plus the
// pass's value vectors and the broadcast probability, one register spare: 6 x 4 on AVX-512,
// 6 x 2 on AVX2.
constexpr int kValueRows = 6;
constexpr int kValueVecs = [] {
  for (int t : {4, 2})
    if (kValueRows * t + t + kBroadcast <= kVectorRegisters - 1) return t;
  return 1;
}();
// Splitting blocks into parts: at least this many query rows a part, so the key packing (once
// per item) stays small next to the scores (a multiple of kTileRows); and parts enough for this
// many items per thread, so that dynamic claiming evens out items of unequal causal ranges.
constexpr int64_t kMinPartRows = 64;
constexpr int64_t kItemsPerThread = 2;
static_assert(kMinPartRows % kTileRows == 0, "parts are whole tiles");
constexpr float kNegInf = -1e30f;  // finite, as in XLA's path
constexpr int64_t kMaxPositions = int64_t{1} << 24;  // positions (and ranges) exact as float32

struct Problem {
  int64_t N, K, G, H, L, P, ps, R, M;
  int64_t block, blocks, parts, part_rows;  // parts per block; query rows per part
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

// Per-thread buffers for pages of T, reused across items (grown, never shrunk).
template <typename T>
struct Scratch {
  std::vector<std::pair<int32_t, int32_t>> members;  // (position, token), sorted
  std::vector<const T*> krow, vrow;                  // key and value u's rows in the pages
  std::vector<float> kpack;                          // packed keys [key block][H][kKeys]
  std::vector<float> qt;                             // a tile's queries [H][kTileRows]
  std::vector<float> st;                             // a tile's scores, then probabilities [key][kTileRows]
};

typedef float v4 __attribute__((vector_size(4 * sizeof(float))));  // the 4 x 4 transposes' unit
typedef int32_t v4i __attribute__((vector_size(4 * sizeof(int32_t))));

inline v4 load4(const float* p) {
  v4 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline v4 load4(const uint16_t* p) {  // 4 bfloat16 values widened exactly
  typedef uint16_t v4h __attribute__((vector_size(4 * sizeof(uint16_t))));
  typedef uint32_t v4u __attribute__((vector_size(4 * sizeof(uint32_t))));
  v4h h;
  std::memcpy(&h, p, sizeof h);
  const v4u u = __builtin_convertvector(h, v4u) << 16;
  v4 v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

inline v4 load4(const int8_t* p) {  // 4 int8 codes widened exactly (unscaled)
  return v4{static_cast<float>(p[0]), static_cast<float>(p[1]), static_cast<float>(p[2]), static_cast<float>(p[3])};
}

// The keys [0, n) (rows krow[u] of H entries; an 8-bit row times its scale) packed into ceil(n / kKeys) blocks [H][kKeys],
// zeros past n. Whole blocks go by 4 x 4 transposes of 4 keys' 4 consecutive entries (two
// rounds of interleaving shuffles), which take a fraction of the time of moving one float at a
// time; the rest one at a time.
template <typename T>
void pack_keys(const T* const* krow, int64_t n, int64_t H, float* kpack) {
  const int64_t nblk = (n + kKeys - 1) / kKeys;
  for (int64_t b = 0; b < nblk; ++b) {
    float* dst = kpack + b * H * kKeys;
    const int64_t u0 = b * kKeys;
    int c = 0;
    if (u0 + kKeys <= n && !std::is_same<T, int8_t>::value) {  // 8-bit rows: scaled, one at a time
      for (; c + 4 <= kKeys; c += 4) {
        const T *s0 = krow[u0 + c], *s1 = krow[u0 + c + 1], *s2 = krow[u0 + c + 2], *s3 = krow[u0 + c + 3];
        for (int64_t h = 0; h < H; h += 4) {
          const v4 a0 = load4(s0 + h), a1 = load4(s1 + h), a2 = load4(s2 + h), a3 = load4(s3 + h);
          const v4 t0 = __builtin_shuffle(a0, a1, v4i{0, 4, 1, 5}), t1 = __builtin_shuffle(a0, a1, v4i{2, 6, 3, 7});
          const v4 t2 = __builtin_shuffle(a2, a3, v4i{0, 4, 1, 5}), t3 = __builtin_shuffle(a2, a3, v4i{2, 6, 3, 7});
          const v4 r[4] = {__builtin_shuffle(t0, t2, v4i{0, 1, 4, 5}), __builtin_shuffle(t0, t2, v4i{2, 3, 6, 7}),
                           __builtin_shuffle(t1, t3, v4i{0, 1, 4, 5}), __builtin_shuffle(t1, t3, v4i{2, 3, 6, 7})};
          for (int i = 0; i < 4; ++i) std::memcpy(dst + (h + i) * kKeys + c, &r[i], sizeof(v4));
        }
      }
    }
    for (; c < kKeys; ++c) {
      if (u0 + c >= n) {
        for (int64_t h = 0; h < H; ++h) dst[h * kKeys + c] = 0.0f;
        continue;
      }
      const T* src = krow[u0 + c];
      const float scale = meshserve::row_scale(src, H);  // 1 but in an 8-bit cache
      for (int64_t h = 0; h < H; h += kLanes) {
        const vf x = load(src + h) * scale;  // bfloat16 or int8 widened exactly
        for (int l = 0; l < kLanes; ++l) dst[(h + l) * kKeys + c] = x[l];
      }
    }
  }
}

// st[u - base, i] = sum over h of qt[h, i] x key u [h], for keys u in [base, base + nblk x
// kKeys) (kpack: their packed blocks) and rows i in [0, QV x kLanes) (rows of st kTileRows
// apart); and mx[i] = the largest st[u - base, i] over u in [lo[i], len[i]), the range of row i,
// taken from the registers as they are stored. Every row's range covers [below, all): only key
// blocks outside it need the per-lane mask.
template <int QV>
void scores_tile(const float* qt, const float* kpack, int64_t H, int64_t nblk, int64_t base, int64_t below,
                 int64_t all, const float* lo, const float* len, float* st, float* mx) {
  vf lov[QV], lv[QV], m[QV];
  for (int i = 0; i < QV; ++i) {
    lov[i] = load(lo + i * kLanes);
    lv[i] = load(len + i * kLanes);
    m[i] = vf{} + kNegInf;
  }
  for (int64_t b = 0; b < nblk; ++b) {
    const float* kb = kpack + b * H * kKeys;
    vf acc[kKeys][QV];
#pragma GCC unroll 16
    for (int c = 0; c < kKeys; ++c)
#pragma GCC unroll 4
      for (int i = 0; i < QV; ++i) acc[c][i] = vf{};
    for (int64_t h = 0; h < H; ++h) {
      vf qv[QV];
#pragma GCC unroll 4
      for (int i = 0; i < QV; ++i) qv[i] = load(qt + h * kTileRows + i * kLanes);
#pragma GCC unroll 16
      for (int c = 0; c < kKeys; ++c) {
        const float kc = kb[h * kKeys + c];
#pragma GCC unroll 4
        for (int i = 0; i < QV; ++i) acc[c][i] += kc * qv[i];
      }
    }
    float* s = st + b * kKeys * kTileRows;
#pragma GCC unroll 16
    for (int c = 0; c < kKeys; ++c)
#pragma GCC unroll 4
      for (int i = 0; i < QV; ++i) store(s + c * kTileRows + i * kLanes, acc[c][i]);
    const int64_t u0 = base + b * kKeys;
    if (u0 >= below && u0 + kKeys <= all) {
#pragma GCC unroll 16
      for (int c = 0; c < kKeys; ++c)
#pragma GCC unroll 4
        for (int i = 0; i < QV; ++i) m[i] = acc[c][i] > m[i] ? acc[c][i] : m[i];
    } else {
      for (int c = 0; c < kKeys; ++c) {
        const vf uf = vf{} + static_cast<float>(u0 + c);
        for (int i = 0; i < QV; ++i) {
          const vi take = (uf < lv[i]) & (uf >= lov[i]) & (acc[c][i] > m[i]);
          m[i] = take ? acc[c][i] : m[i];
        }
      }
    }
  }
  for (int i = 0; i < QV; ++i) store(mx + i * kLanes, m[i]);
}

// In place over st [u - base][kTileRows] for keys u in [first, n): row i's scores at keys u in
// [lo[i], len[i]) become e^(s - mx[i]), the others 0; inv[i] = 1 / their sum. Every row's range
// covers [below, all): only keys outside it need the per-lane mask.
template <int QV>
void softmax_tile(float* st, int64_t base, int64_t first, int64_t n, int64_t below, int64_t all, const float* lo,
                  const float* len, const float* mx, float* inv) {
  vf lov[QV], lv[QV], m[QV], sum[QV];
  for (int i = 0; i < QV; ++i) {
    lov[i] = load(lo + i * kLanes);
    lv[i] = load(len + i * kLanes);
    m[i] = load(mx + i * kLanes);
    sum[i] = vf{};
  }
  const vf out = vf{} - 100.0f;  // e^-100 underflows to 0 in exp_nonpositive
  auto masked = [&](int64_t u) {
    const vf uf = vf{} + static_cast<float>(u);
    for (int i = 0; i < QV; ++i) {
      float* p = st + (u - base) * kTileRows + i * kLanes;
      const vi in = (uf < lv[i]) & (uf >= lov[i]);
      const vf e = exp_nonpositive(in ? load(p) - m[i] : out);
      store(p, e);
      sum[i] += e;
    }
  };
  const int64_t a = std::max(first, below), z = std::max(a, std::min(n, all));  // [a, z): unmasked
  for (int64_t u = first; u < a; ++u) masked(u);
  for (int64_t u = a; u < z; ++u)
    for (int i = 0; i < QV; ++i) {
      float* p = st + (u - base) * kTileRows + i * kLanes;
      const vf e = exp_nonpositive(load(p) - m[i]);
      store(p, e);
      sum[i] += e;
    }
  for (int64_t u = z; u < n; ++u) masked(u);
  for (int i = 0; i < QV; ++i) {
    const vi some = sum[i] > vf{};
    const vf one = vf{} + 1.0f;
    store(inv + i * kLanes, some ? one / (some ? sum[i] : one) : vf{});
  }
}

// out rows os[r] (r < Rn), entries [h0, h0 + T x kLanes) = inv[r] x sum over u in [first, n) of
// probs[u - first, r] x value u, value u being vrow[u] (H entries); probs rows kTileRows apart.
template <int Rn, int T, typename V>
void values_pass(const float* probs, const V* const* vrow, int64_t first, int64_t n, int64_t H, int64_t h0,
                 const float* inv, float* const* os) {
  vf acc[Rn][T];
#pragma GCC unroll 8
  for (int r = 0; r < Rn; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) acc[r][t] = vf{};
  for (int64_t u = first; u < n; ++u) {
    const V* vr = vrow[u] + h0;
    vf v[T];
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) v[t] = load(vr + t * kLanes);
    const float* p = probs + (u - first) * kTileRows;
    const float scale = meshserve::row_scale(vrow[u], H);  // 1 but in an 8-bit cache
#pragma GCC unroll 8
    for (int r = 0; r < Rn; ++r) {
      const float pr = p[r] * scale;
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) acc[r][t] += pr * v[t];
    }
  }
  for (int r = 0; r < Rn; ++r)
    for (int t = 0; t < T; ++t) store(os[r] + h0 + t * kLanes, acc[r][t] * inv[r]);
}

template <int Rn, typename V>
void values_rows(const float* probs, const V* const* vrow, int64_t first, int64_t n, int64_t H, const float* inv,
                 float* const* os) {
  int64_t h0 = 0;
  for (; h0 + kValueVecs * kLanes <= H; h0 += kValueVecs * kLanes)
    values_pass<Rn, kValueVecs>(probs, vrow, first, n, H, h0, inv, os);
  for (; h0 < H; h0 += kLanes) values_pass<Rn, 1>(probs, vrow, first, n, H, h0, inv, os);
}

// values_rows for rn rows, 1 <= rn <= kValueRows, rn known only at run time.
template <typename V, int Rn = kValueRows>
void values_some(int rn, const float* probs, const V* const* vrow, int64_t first, int64_t n, int64_t H,
                 const float* inv, float* const* os) {
  if constexpr (Rn >= 1) {
    if (rn == Rn) return values_rows<Rn>(probs, vrow, first, n, H, inv, os);
    return values_some<V, Rn - 1>(rn, probs, vrow, first, n, H, inv, os);
  }
}

// One (block, KV head, part) item.
template <typename T>
void attend_item(const Problem& p, int64_t item, Scratch<T>& s) {
  const int64_t per_block = p.parts * p.K;
  // The last blocks first (in one prompt the longest causal ranges), so the last items claimed
  // are short ones; likewise a block's last part (its latest positions) first.
  const int64_t b = p.blocks - 1 - item / per_block;
  const int64_t part = p.parts - 1 - item % per_block / p.K, kh = item % p.K;
  const int64_t G = p.G, H = p.H, ps = p.ps;
  const int64_t n0 = b * p.block, n1 = std::min(p.N, n0 + p.block);
  auto out_row = [&](int64_t n, int64_t g) { return p.out + ((n * p.K + kh) * G + g) * H; };

  // The block's sequence: its first real token's.
  int64_t seq = -1;
  for (int64_t n = n0; n < n1 && seq < 0; ++n)
    if (p.rows[n] >= 0 && p.rows[n] < p.R && p.positions[n] >= 0) seq = p.rows[n];
  s.members.clear();
  const int64_t window = p.M * ps;  // positions a table reaches
  for (int64_t n = n0; n < n1; ++n) {
    const bool member = seq >= 0 && p.rows[n] == seq && p.positions[n] >= 0 && p.positions[n] < window;
    if (member)
      s.members.emplace_back(p.positions[n], static_cast<int32_t>(n));
    else if (part == 0)  // padding, strays, beyond the table: zeros, written once per KV head
      std::fill(out_row(n, 0), out_row(n, 0) + G * H, 0.0f);
  }
  const int64_t J = static_cast<int64_t>(s.members.size()) * G;  // query rows: j = member x G + g
  const int64_t j0 = part * p.part_rows, j1 = std::min(J, j0 + p.part_rows);
  if (j0 >= j1) return;
  std::sort(s.members.begin(), s.members.end());
  auto len_of = [&](int64_t j) { return static_cast<int64_t>(s.members[j / G].first) + 1; };
  auto lo_of = [&](int64_t j) { return p.window > 0 ? std::max<int64_t>(0, len_of(j) - p.window) : int64_t{0}; };

  // Rows of the keys and values [k0, n) the part reads (k0: its first row's lo, rounded down to
  // a key block), from the sequence's pages; krow and vrow are indexed by position.
  const int64_t n = len_of(j1 - 1), b0 = lo_of(j0) / kKeys, k0 = b0 * kKeys;
  const int64_t Hs = meshserve::row_entries<T>(H);  // a row's entries: H, and an 8-bit row's scale
  const int64_t page_elems = ps * Hs;
  const T* kbase = static_cast<const T*>(p.k) + p.layer * p.P * p.K * page_elems;
  const T* vbase = static_cast<const T*>(p.v) + p.layer * p.P * p.K * page_elems;
  const int32_t* table = p.tables + seq * p.M;
  s.krow.resize(n);
  s.vrow.resize(n);
  for (int64_t w0 = k0 / ps * ps, pg = k0 / ps; w0 < n; w0 += ps, ++pg) {
    const int64_t page = std::clamp<int64_t>(table[pg], 0, p.P - 1);
    const int64_t at = (page * p.K + kh) * page_elems;
    for (int64_t o = 0; o < ps && w0 + o < n; ++o) {
      s.krow[w0 + o] = kbase + at + o * Hs;
      s.vrow[w0 + o] = vbase + at + o * Hs;
    }
  }
  const int64_t nblk = (n - k0 + kKeys - 1) / kKeys;  // key blocks b0 .. b0 + nblk, packed from 0
  s.kpack.resize(nblk * kKeys * H);
  pack_keys(s.krow.data() + k0, n - k0, H, s.kpack.data());
  s.qt.resize(H * kTileRows);
  s.st.resize(nblk * kKeys * kTileRows);

  alignas(64) float lo[kTileRows], len[kTileRows], mx[kTileRows], inv[kTileRows];
  float* os[kTileRows];
  for (int64_t t0 = j0; t0 < j1; t0 += kTileRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kTileRows, j1 - t0));
    const int64_t nt = len_of(t0 + rows - 1);  // the tile's longest range: its last row's
    const int64_t all = len_of(t0);            // the range every row covers, [below, all)
    const int64_t first = lo_of(t0), below = lo_of(t0 + rows - 1);
    const int64_t tb = first / kKeys, base = tb * kKeys;  // the tile's first key block, its first key
    // The tile's queries, transposed. Filler rows (past the part's last) are zero queries over
    // the tile's longest range: finite scores, never written out.
    for (int i = 0; i < kTileRows; ++i) {
      if (i < rows) {
        const int64_t j = t0 + i, tok = s.members[j / G].second, g = j % G;
        const float* qr = p.q + ((tok * p.K + kh) * G + g) * H;
        for (int64_t h = 0; h < H; ++h) s.qt[h * kTileRows + i] = qr[h];
        lo[i] = static_cast<float>(lo_of(j));
        len[i] = static_cast<float>(len_of(j));
        os[i] = out_row(tok, g);
      } else {
        for (int64_t h = 0; h < H; ++h) s.qt[h * kTileRows + i] = 0.0f;
        lo[i] = static_cast<float>(below);
        len[i] = static_cast<float>(nt);
      }
    }
    const int64_t tblk = (nt + kKeys - 1) / kKeys - tb;
    const float* kp = s.kpack.data() + (tb - b0) * kKeys * H;
    if (rows <= kLanes) {
      scores_tile<1>(s.qt.data(), kp, H, tblk, base, below, all, lo, len, s.st.data(), mx);
      softmax_tile<1>(s.st.data(), base, first, nt, below, all, lo, len, mx, inv);
    } else {
      scores_tile<kQV>(s.qt.data(), kp, H, tblk, base, below, all, lo, len, s.st.data(), mx);
      softmax_tile<kQV>(s.st.data(), base, first, nt, below, all, lo, len, mx, inv);
    }
    for (int r0 = 0; r0 < rows; r0 += kValueRows) {
      const int rn = std::min(kValueRows, rows - r0);
      const int64_t nv = static_cast<int64_t>(len[r0 + rn - 1]);  // the pass's longest range
      const int64_t fv = static_cast<int64_t>(lo[r0]);             // and its lowest key
      const float* probs = s.st.data() + (fv - base) * kTileRows + r0;
      values_some<T>(rn, probs, s.vrow.data(), fv, nv, H, inv + r0, os + r0);
    }
  }
}

ffi::Error PagedPrefill(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                        ffi::Buffer<ffi::S32> page_tables, ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::S32> positions,
                        ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> window, int64_t block,
                        ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto qd = q.dimensions();
  auto kd = k_pages.dimensions();
  auto td = page_tables.dimensions();
  auto od = out->dimensions();
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
  if (p.P < 1 || p.ps < 1) return ffi::Error::InvalidArgument("pages must hold at least one page of one position");
  if (rows.element_count() != static_cast<size_t>(p.N) || positions.element_count() != static_cast<size_t>(p.N))
    return ffi::Error::InvalidArgument("rows and positions must be [N]");
  if (layer.element_count() != 1) return ffi::Error::InvalidArgument("layer must be a scalar");
  if (window.element_count() != 1) return ffi::Error::InvalidArgument("window must be a scalar");
  if (block < 1) return ffi::Error::InvalidArgument("block must be >= 1");
  if (p.M * p.ps > kMaxPositions) return ffi::Error::InvalidArgument("page tables must reach at most 2^24 positions");
  bool out_ok = od.size() == 4;
  for (size_t i = 0; out_ok && i < 4; ++i) out_ok = od[i] == qd[i];
  if (!out_ok) return ffi::Error::InvalidArgument("the result must be q's shape");
  p.layer = layer.typed_data()[0];
  if (p.layer < 0 || p.layer >= p.L) return ffi::Error::InvalidArgument("layer out of range");
  p.window = window.typed_data()[0];
  if (p.window < 0) return ffi::Error::InvalidArgument("window must be >= 0");
  if (p.N == 0 || p.K == 0) return ffi::Error::Success();
  p.q = q.typed_data();
  p.k = k_pages.untyped_data();
  p.v = v_pages.untyped_data();
  p.tables = page_tables.typed_data();
  p.rows = rows.typed_data();
  p.positions = positions.typed_data();
  p.out = out->typed_data();
  p.block = block;
  p.blocks = (p.N + block - 1) / block;
  // Parts: enough items for every thread (kItemsPerThread each), each part at least
  // kMinPartRows query rows, in whole tiles.
  const int64_t block_rows = std::min(block, p.N) * p.G;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t want = std::max<int64_t>(1, (kItemsPerThread * threads + p.blocks * p.K - 1) / (p.blocks * p.K));
  int64_t part_rows = (block_rows + want - 1) / want;
  part_rows = std::max(kMinPartRows, (part_rows + kTileRows - 1) / kTileRows * kTileRows);
  p.part_rows = part_rows;
  p.parts = (block_rows + part_rows - 1) / part_rows;
  meshserve::ParallelFor(pool, p.blocks * p.parts * p.K, [&p, dtype, bf16](int64_t item) {
    if (bf16) {
      thread_local Scratch<uint16_t> scratch;
      attend_item(p, item, scratch);
    } else if (dtype == ffi::DataType::S8) {
      thread_local Scratch<int8_t> scratch;
      attend_item(p, item, scratch);
    } else {
      thread_local Scratch<float> scratch;
      attend_item(p, item, scratch);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshservePagedPrefill, PagedPrefill,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [N, K, G, H]
                                  .Arg<ffi::AnyBuffer>()         // key pages [L, P, K, page_size, H]
                                  .Arg<ffi::AnyBuffer>()         // value pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page tables [R, M]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows [N]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions [N]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window [] (0: none)
                                  .Attr<int64_t>("block")        // tokens per block
                                  .Ret<ffi::Buffer<ffi::F32>>());  // [N, K, G, H]
