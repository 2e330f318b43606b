// y[M, N] = x[M, K] @ W[K, N] over GGUF-quantized weights kept as stored (Q8_0, Q4_0, Q4_1; and
// the record formats Q5_0, Q4_K, Q5_K, Q6_K, in their own section below),
// dequantized on the fly, as XLA FFI custom calls for the CPU.
//
// The weights are model/weights/quant_panels.py's QuantPanels: codes [L, P, Kb, B, 32] (P = N/32
// panels of 32 output columns, Kb = K/32 blocks; Q8_0 int8 with B = 32, codes[l, p, b, j, c]
// weight k = 32b + j of column 32p + c; Q4_* uint8 with B = 16, byte j holding weight 32b + j
// in its low nibble and 32b + j + 16 in its high one), scales [L, P, Kb, 32] float16 d and,
// for Q4_1, mins [L, P, Kb, 32] float16 m. Weight values: Q8_0 d q, Q4_0 d (q - 8), Q4_1
// d q + m. An int32 scalar operand picks matrix `layer` of the stack: the kernel offsets into
// the buffers, so a layer loop inside lax.scan reads the stacked weights in place (XLA would
// otherwise materialise a dynamic slice of them); one matrix is passed as L = 1, layer 0.
//
// Each panel is three contiguous streams (codes, scales, mins), read once per call. Two ways
// through a panel, chosen by the number of rows M:
//
// * Direct (few rows: a decode step's matmuls, bound by streaming the weights). A tile of up
//   to kDirectRows rows of x (packed per tile as [K, R], as panel_matmul.cc packs it) walks
//   the panel block by block: the block's codes, widened to float32 in registers, are
//   multiplied into R x 32 per-block sums s[r][c] = sum_j x[r, 32b + j] q[j, c], and the
//   block's scale is applied once to the sums: acc += d s (+ m * sum_j x[r, 32b + j] for
//   Q4_1, the row sums of x per block computed when x is packed; Q4_0 takes q - 8 directly,
//   so it needs no row sums). That is the dequantized product, mathematically; its rounding
//   differs from a float32 dot of the dequantized weights only as any reordering of the sum
//   does. It saves the per-weight dequantizing multiply-add, so each weight costs its
//   widening plus one FMA per row. The per-block sums take the registers (R x 32 floats, a
//   panel row's widened codes, the broadcast row value where an FMA cannot broadcast from
//   memory: kDirectRows), so the running totals are left to the stack frame, updated once per
//   block (32 k-steps). On AVX2 Q4_0, and Q4_1 at one row, take a tile of their own
//   (direct_tile_q4, q4_tile): a panel row's bytes split into nibbles by in-lane shifts and
//   masks, in a column order put right once per block, instead of vpmovzxbd widenings (two
//   uops each, on the ports the FMAs and shifts also use); Q4_0 there goes through the row
//   sums too (m = -8 d). At 1 row the Q4 tiles are bound by those instructions (a mask and a
//   conversion per 8 weights, a shift per 16), Q8_0 by the bytes.
// * Dequantized (more rows: prefill chunks, large decode batches). Each panel is dequantized
//   once into a per-work-item float32 scratch panel [K, 32] (an FMA d q + m: d q is exact,
//   so the scratch holds exactly gguf.quants.dequantize's values), which then serves every
//   tile of rows through panel_matmul.cc's register-tile micro-kernel (Goto & van de Geijn
//   2008, section 4: R x 32 accumulators over the whole of K, the panel read from L1/L2). The
//   widening is paid once per panel instead of once per tile of rows, as the direct path
//   pays it, and the float32 tiles take 3 rows on AVX2 against the direct path's 2 (the
//   widened codes need registers; float32 weights are FMA memory operands). So the direct path
//   wins at few rows, where the weights' bytes bound the call, and loses once a panel's widening
//   is shared by enough tiles of rows (kDirectMaxM). The scratch panel is 64-byte aligned, as
//   XLA aligns its buffers: otherwise the tiles' vector loads of it straddle cache lines.
//
// Work items are runs of panels shared by XLA's intra-op threads (ParallelFor), as in
// panel_matmul.cc. Float16 scales are widened with F16C (vcvtph2ps) where the target has it
// (every AVX2 and AVX-512 target here), an exact scalar conversion otherwise. Built and
// registered by model/native/__init__.py; model/native/quant_matmul.py is the Python side;
// docs/cpu-kernels.md has the measurements behind kDirectMaxM and the tile sizes.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "panel_tile.h"
#include "parallel_for.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using meshserve::kLanes;
using meshserve::load;
using meshserve::store;
using meshserve::vf;

enum class Format { kQ8_0, kQ4_0, kQ4_1 };

using meshserve::panel::kPanel;         // columns per panel, and weights per block
using meshserve::panel::kPanelVectors;  // vectors per panel row: 2 (AVX-512), 4 (AVX2), 8 (SSE2)
// Rows per tile of the dequantized path: the float32 tile's (3 on AVX2, 16 on AVX-512).
using meshserve::panel::kMaxRows;
constexpr int kBroadcastRegs = meshserve::kBroadcastOperand ? 0 : 1;
// Rows per tile of the direct path: R x kPanelVectors per-block sums, a panel row's widened
// codes (kPanelVectors registers: the codes, unlike float32 weights, cannot be an FMA's memory
// operand) and the broadcast row value fill the registers: 2 on AVX2, 15 on AVX-512, 1 on
// SSE2. With 3 rows on AVX2 GCC spilled sums to the stack inside the k loop.
constexpr int kDirectRows =
    std::max(1, (meshserve::kVectorRegisters - kBroadcastRegs - kPanelVectors) / kPanelVectors);
// The direct path up to this many rows, the dequantized one above: the direct path pays the
// widening once per tile of rows, the dequantized one once per panel, so the dequantized one
// wins as rows grow; 16 is where the two measured even on AVX2 (docs/cpu-kernels.md has the
// figures and the command).
constexpr int64_t kDirectMaxM = 16;
constexpr int64_t kAheadBytes = 2048;  // prefetch distance in the codes stream (Q4_1: 3.2 blocks of a panel)

typedef int32_t vi __attribute__((vector_size(kLanes * sizeof(int32_t))));

// float16 bits -> float32, exactly (normals, subnormals, zeros, infinities; NaNs keep their
// payload, quieted): bit for bit what F16C gives for all 65536 inputs.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13) | (mant ? 0x400000u : 0);  // NaNs quieted, as vcvtph2ps does
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else {
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;  // mant * 2^-24, exact
    std::memcpy(&bits, &v, sizeof bits);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// kLanes float16 values widened to float32.
inline vf load_half(const uint16_t* p) {
#if defined(__AVX512F__)
  static_assert(kLanes == 16, "one zmm");
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  static_assert(kLanes == 8, "one ymm");
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  vf v;
  for (int i = 0; i < kLanes; ++i) v[i] = half_to_float(p[i]);
  return v;
#endif
}

// The codes of one panel row of a block as float32, vector c: Q8_0 one row j of int8 codes;
// Q4_* the low (weight 32b + j) or high (32b + j + 16) nibbles of byte row j, Q4_0 less 8.
// The bytes are widened to int32 first (vpmovzxbd / vpmovsxbd), the nibbles split there: GCC
// 12 took a byte vector's shift, and its widening by __builtin_convertvector, apart lane by lane.
template <Format F>
inline vi widen(const void* row, int c) {
  const void* p = static_cast<const uint8_t*>(row) + c * kLanes;
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(static_cast<const __m128i*>(p));
  return (vi)(F == Format::kQ8_0 ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadl_epi64(static_cast<const __m128i*>(p));
  return (vi)(F == Format::kQ8_0 ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#else
  vi v;  // GCC 12 widens a byte vector lane by lane anyway
  for (int i = 0; i < kLanes; ++i)
    v[i] = F == Format::kQ8_0 ? static_cast<const int8_t*>(p)[i] : static_cast<const uint8_t*>(p)[i];
  return v;
#endif
}
template <Format F>
inline vf codes_low(vi v) {
  if constexpr (F == Format::kQ8_0) return __builtin_convertvector(v, vf);
  v &= 0x0f;
  return __builtin_convertvector(F == Format::kQ4_0 ? v - 8 : v, vf);
}
template <Format F>
inline vf codes_high(vi v) {
  v >>= 4;
  return __builtin_convertvector(F == Format::kQ4_0 ? v - 8 : v, vf);
}

constexpr int64_t code_rows(Format f) { return f == Format::kQ8_0 ? kPanel : kPanel / 2; }  // B

// One matrix's panels: codes [P, Kb, B, 32], scales and mins [P, Kb, 32].
struct Weights {
  const void* codes;
  const uint16_t* scales;
  const uint16_t* mins;  // Q4_1 only
  int64_t K, P;
};

// ---- direct path ---------------------------------------------------------------------------

// y[0:R, 0:32] = x[0:R, :] @ panel p. xt: the tile's rows packed as [K, R]; xs: their sums per
// block [Kb, R] (Q4_1 only); rows of y at a stride of N floats.
template <Format F, int R>
void direct_tile(const float* xt, const float* xs, const Weights& w, int64_t p, float* y, int64_t N) {
  constexpr int64_t B = code_rows(F);
  const int64_t Kb = w.K / kPanel;
  const uint8_t* codes = static_cast<const uint8_t*>(w.codes) + p * Kb * B * kPanel;
  const uint16_t* scales = w.scales + p * Kb * kPanel;
  const uint16_t* mins = F == Format::kQ4_1 ? w.mins + p * Kb * kPanel : nullptr;
  vf total[R][kPanelVectors];  // running totals: in the stack frame, touched once per block
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kPanelVectors; ++c) total[r][c] = vf{};
  for (int64_t b = 0; b < Kb; ++b, codes += B * kPanel, xt += kPanel * R) {
    for (int64_t l = 0; l < B * kPanel; l += 64) __builtin_prefetch(codes + kAheadBytes + l, 0, 3);
    vf s[R][kPanelVectors];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kPanelVectors; ++c) s[r][c] = vf{};
    for (int64_t j = 0; j < B; ++j) {
      const uint8_t* row = codes + j * kPanel;
      for (int c = 0; c < kPanelVectors; ++c) {
        const vi v = widen<F>(row, c);
        const vf q = codes_low<F>(v);
        for (int r = 0; r < R; ++r) s[r][c] += xt[j * R + r] * q;
        if constexpr (F != Format::kQ8_0) {
          const vf h = codes_high<F>(v);
          for (int r = 0; r < R; ++r) s[r][c] += xt[(j + 16) * R + r] * h;
        }
      }
    }
    for (int c = 0; c < kPanelVectors; ++c) {
      const vf d = load_half(scales + b * kPanel + c * kLanes);
      for (int r = 0; r < R; ++r) total[r][c] += d * s[r][c];
      if constexpr (F == Format::kQ4_1) {
        const vf m = load_half(mins + b * kPanel + c * kLanes);
        for (int r = 0; r < R; ++r) total[r][c] += xs[b * R + r] * m;
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kPanelVectors; ++c) store(y + r * N + c * kLanes, total[r][c]);
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// The Q4 direct tile on AVX2. A panel row's 32 bytes are loaded as one vector of 8 int32
// lanes, lane i holding the bytes of columns 4i .. 4i + 3, and vector t takes byte t of every
// lane by shifts and masks inside the lanes: (v >> 8t) & 0x0f the low nibbles, & 0xf0 sixteen
// times the high ones (x's rows 16 .. 31 of each block come packed divided by 16: exact for
// every normal x). Vector t so holds columns t, t + 4, ..., t + 28; the per-block sums are put back in
// column order once per block (a 4 x 4 transpose in each 128-bit half and a swap of halves).
// This replaces vpmovzxbd (two uops, cross-lane, on the shuffle ports the shifts and FMAs also
// use) by in-lane ALU work: one load, 3 shifts and 8 masks per 64 weights. Q4_0 and Q4_1 take
// the same sums of x q: Q4_0's d (q - 8) is d q + m with m = -8 d, applied through the row sums.
// At one row the low and high nibbles go to sums of their own (8 chains of FMAs, not 4 of
// twice the length), and the running totals are kept in y, not in registers (they would take
// 4 of the 16, and GCC then spilled the masks and broadcasts inside the k loop).
inline void column_order(vf& t0, vf& t1, vf& t2, vf& t3) {
  const __m256 a0 = _mm256_unpacklo_ps((__m256)t0, (__m256)t1), a1 = _mm256_unpackhi_ps((__m256)t0, (__m256)t1);
  const __m256 a2 = _mm256_unpacklo_ps((__m256)t2, (__m256)t3), a3 = _mm256_unpackhi_ps((__m256)t2, (__m256)t3);
  const __m256 b0 = (__m256)_mm256_unpacklo_pd((__m256d)a0, (__m256d)a2);
  const __m256 b1 = (__m256)_mm256_unpackhi_pd((__m256d)a0, (__m256d)a2);
  const __m256 b2 = (__m256)_mm256_unpacklo_pd((__m256d)a1, (__m256d)a3);
  const __m256 b3 = (__m256)_mm256_unpackhi_pd((__m256d)a1, (__m256d)a3);
  t0 = (vf)_mm256_permute2f128_ps(b0, b1, 0x20);
  t1 = (vf)_mm256_permute2f128_ps(b2, b3, 0x20);
  t2 = (vf)_mm256_permute2f128_ps(b0, b1, 0x31);
  t3 = (vf)_mm256_permute2f128_ps(b2, b3, 0x31);
}

template <Format F, int R>
void direct_tile_q4(const float* xt, const float* xs, const Weights& w, int64_t p, float* y, int64_t N) {
  static_assert(kPanelVectors == 4, "AVX2: 4 vectors a panel row");
  typedef uint32_t vu __attribute__((vector_size(32)));
  constexpr int64_t B = code_rows(F);
  const int64_t Kb = w.K / kPanel;
  const uint8_t* codes = static_cast<const uint8_t*>(w.codes) + p * Kb * B * kPanel;
  const uint16_t* scales = w.scales + p * Kb * kPanel;
  const uint16_t* mins = F == Format::kQ4_1 ? w.mins + p * Kb * kPanel : nullptr;
  constexpr int S = R == 1 ? 2 : 1;  // one row: low and high nibbles in sums of their own (latency)
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) store(y + r * N + c * kLanes, vf{});
  for (int64_t b = 0; b < Kb; ++b, codes += B * kPanel, xt += kPanel * R) {
    for (int64_t l = 0; l < B * kPanel; l += 64) __builtin_prefetch(codes + kAheadBytes + l, 0, 3);
    vf s[S][R][4];
    for (int i = 0; i < S; ++i)
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < 4; ++t) s[i][r][t] = vf{};
    const vu low = vu{} + 0x0f, high = vu{} + 0xf0;
    for (int64_t j = 0; j < B; ++j) {
      const vu* row = reinterpret_cast<const vu*>(codes + j * kPanel);
      for (int t = 0; t < 4; ++t) {
        vu u;
        std::memcpy(&u, row, sizeof u);
        u >>= 8 * t;
        const vf lo = __builtin_convertvector((vi)(u & low), vf), hi = __builtin_convertvector((vi)(u & high), vf);
        for (int r = 0; r < R; ++r) s[0][r][t] += xt[j * R + r] * lo;
        for (int r = 0; r < R; ++r) s[S - 1][r][t] += xt[(j + 16) * R + r] * hi;
      }
    }
    for (int r = 0; r < R; ++r) {
      if constexpr (S == 2)
        for (int t = 0; t < 4; ++t) s[0][r][t] += s[1][r][t];
      column_order(s[0][r][0], s[0][r][1], s[0][r][2], s[0][r][3]);
    }
    for (int c = 0; c < 4; ++c) {
      const vf d = load_half(scales + b * kPanel + c * kLanes);
      const vf m = F == Format::kQ4_1 ? load_half(mins + b * kPanel + c * kLanes) : -8.0f * d;
      for (int r = 0; r < R; ++r)
        store(y + r * N + c * kLanes, load(y + r * N + c * kLanes) + d * s[0][r][c] + xs[b * R + r] * m);
    }
    // The running totals stay in y, not in registers: the sums and the widened codes need them all.
    asm volatile("" ::: "memory");
  }
}
constexpr bool kQ4Lanes = true;
#else
constexpr bool kQ4Lanes = false;
#endif
// Whether a direct tile of `rows` rows takes direct_tile_q4 (and its x packed for it): Q4_0 at
// every tile size, Q4_1 at one row (its 2-row tiles measured no faster than direct_tile's,
// which already takes Q4_1's minimum through the row sums: docs/cpu-kernels.md).
constexpr bool q4_tile(Format f, int rows) {
  return kQ4Lanes && (f == Format::kQ4_0 || (f == Format::kQ4_1 && rows == 1));
}

template <Format F, int R = kDirectRows>
void direct_rows(int rows, const float* xt, const float* xs, const Weights& w, int64_t p, float* y, int64_t N) {
  if constexpr (R >= 1) {
    if (rows == R) {
#if defined(__AVX2__) && !defined(__AVX512F__)
      if constexpr (q4_tile(F, R)) return direct_tile_q4<F, R>(xt, xs, w, p, y, N);
#endif
      return direct_tile<F, R>(xt, xs, w, p, y, N);
    }
    return direct_rows<F, R - 1>(rows, xt, xs, w, p, y, N);
  }
}

// ---- dequantized path ----------------------------------------------------------------------

// Panel p dequantized into out [K, 32]: exactly the values gguf.quants.dequantize gives.
template <Format F>
void dequantize_panel(const Weights& w, int64_t p, float* out) {
  constexpr int64_t B = code_rows(F);
  const int64_t Kb = w.K / kPanel;
  const uint8_t* codes = static_cast<const uint8_t*>(w.codes) + p * Kb * B * kPanel;
  const uint16_t* scales = w.scales + p * Kb * kPanel;
  const uint16_t* mins = F == Format::kQ4_1 ? w.mins + p * Kb * kPanel : nullptr;
  for (int64_t b = 0; b < Kb; ++b, codes += B * kPanel, out += kPanel * kPanel) {
    for (int64_t l = 0; l < B * kPanel; l += 64) __builtin_prefetch(codes + kAheadBytes + l, 0, 3);
    vf d[kPanelVectors], m[kPanelVectors];
    for (int c = 0; c < kPanelVectors; ++c) {
      d[c] = load_half(scales + b * kPanel + c * kLanes);
      m[c] = F == Format::kQ4_1 ? load_half(mins + b * kPanel + c * kLanes) : vf{};
    }
    for (int64_t j = 0; j < B; ++j) {
      const uint8_t* row = codes + j * kPanel;
      for (int c = 0; c < kPanelVectors; ++c) {
        const vi v = widen<F>(row, c);
        if constexpr (F == Format::kQ4_1) {
          store(out + j * kPanel + c * kLanes, codes_low<F>(v) * d[c] + m[c]);
          store(out + (j + 16) * kPanel + c * kLanes, codes_high<F>(v) * d[c] + m[c]);
        } else {
          store(out + j * kPanel + c * kLanes, codes_low<F>(v) * d[c]);
          if constexpr (F == Format::kQ4_0) store(out + (j + 16) * kPanel + c * kLanes, codes_high<F>(v) * d[c]);
        }
      }
    }
  }
}

// ---- packing x -----------------------------------------------------------------------------

// Rows m .. m+R-1 of x [M, K] re-laid out as [K, R] (k by k: one contiguous run of R writes),
// and, when sums is set, their sums per 32-weight block as [Kb, R]. With high_sixteenths the
// packed rows 16 .. 31 of each block are divided by 16 (exact but below 2^-122), for
// direct_tile_q4's sixteen-times high nibbles; the sums are of x itself.
template <int R>
void pack_tile(const float* x, int64_t K, float* tile, float* sums, bool high_sixteenths) {
  for (int64_t k = 0; k < K; ++k) {
    const float f = high_sixteenths && k % kPanel >= 16 ? 0.0625f : 1.0f;
    for (int r = 0; r < R; ++r) tile[k * R + r] = x[r * K + k] * f;
  }
  if (sums)
    for (int64_t b = 0; b < K / kPanel; ++b)
      for (int r = 0; r < R; ++r) {
        float s = 0.0f;
        for (int64_t j = 0; j < kPanel; ++j) s += x[r * K + b * kPanel + j];
        sums[b * R + r] = s;
      }
}

template <int R>
void pack_rows(int rows, const float* x, int64_t K, float* tile, float* sums, bool high_sixteenths) {
  if constexpr (R >= 1) {
    if (rows == R) return pack_tile<R>(x, K, tile, sums, high_sixteenths);
    return pack_rows<R - 1>(rows, x, K, tile, sums, high_sixteenths);
  }
}

// ---- the call ------------------------------------------------------------------------------

// y [M, 32 P] = x [M, K] @ the P panels, over XLA's threads. x is packed per tile of rows
// (direct: tiles of up to DirectRows rows, with their sums per block where `sums`;
// high_sixteenths(rows): whether a direct tile's x is packed for direct_tile_q4), then runs of
// panels go to the threads: direct(rows, xt, xs, p, y) multiplies one tile by panel p, or
// dequantize(p, panel) writes panel p as float32 [K, 32] for the float32 register tiles.
template <int DirectRows, class HighSixteenths, class Direct, class Dequantize>
void matmul_panels(ffi::ThreadPool& pool, const float* x, int64_t K, int64_t P, float* y, int64_t M, bool direct,
                   bool sums, HighSixteenths high_sixteenths, Direct direct_tile, Dequantize dequantize) {
  static_assert(DirectRows <= kDirectRows, "x is packed by pack_rows<kDirectRows>");
  const int64_t N = P * kPanel, Kb = K / kPanel;
  const int tile_rows = direct ? DirectRows : kMaxRows;
  sums = sums && direct;
  const int64_t tiles = (M + tile_rows - 1) / tile_rows;
  std::unique_ptr<float[]> xp(new float[static_cast<size_t>(M * K)]);  // every element written
  std::unique_ptr<float[]> xs(sums ? new float[static_cast<size_t>(M * Kb)] : nullptr);
  meshserve::ParallelFor(pool, tiles, [&](int64_t t) {
    const int64_t m = t * tile_rows;
    const int rows = static_cast<int>(std::min<int64_t>(tile_rows, M - m));
    float* s = sums ? xs.get() + m * Kb : nullptr;
    if (direct)
      pack_rows<kDirectRows>(rows, x + m * K, K, xp.get() + m * K, s, high_sixteenths(rows));
    else
      pack_rows<kMaxRows>(rows, x + m * K, K, xp.get() + m * K, s, false);
  });
  // Runs of panels, about four per thread: long contiguous streams, and a thread that
  // finishes early takes the next run.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t per_item = std::max<int64_t>(1, (P + 4 * threads - 1) / (4 * threads));
  meshserve::ParallelFor(pool, (P + per_item - 1) / per_item, [&](int64_t i) {
    const int64_t p0 = i * per_item, p1 = std::min(P, p0 + per_item);
    if (direct) {
      for (int64_t p = p0; p < p1; ++p)
        for (int64_t m = 0; m < M; m += DirectRows) {
          const int rows = static_cast<int>(std::min<int64_t>(DirectRows, M - m));
          direct_tile(rows, xp.get() + m * K, sums ? xs.get() + m * Kb : nullptr, p, y + m * N + p * kPanel);
        }
      return;
    }
    // The scratch panel 64-byte aligned, as XLA aligns its buffers: at new[]'s 16 bytes every
    // other 32-byte load of it would cross a cache line, which the float32 panels' tiles never
    // do (docs/cpu-kernels.md has what it cost).
    std::unique_ptr<float[]> scratch(new float[static_cast<size_t>(K * kPanel + 16)]);  // every used element written
    float* panel = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.get()) + 63) & ~uintptr_t{63});
    for (int64_t p = p0; p < p1; ++p) {
      dequantize(p, panel);
      for (int64_t m = 0; m < M; m += kMaxRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, M - m));
        meshserve::panel::tile_rows<false>(rows, xp.get() + m * K, panel, y + m * N + p * kPanel, K, N);
      }
    }
  });
}

template <Format F>
void quant_matmul(ffi::ThreadPool& pool, const float* x, const Weights& w, float* y, int64_t M, bool direct) {
  const int64_t N = w.P * kPanel;
  matmul_panels<kDirectRows>(
      pool, x, w.K, w.P, y, M, direct, F == Format::kQ4_1 || q4_tile(F, 1), [](int rows) { return q4_tile(F, rows); },
      [&](int rows, const float* xt, const float* xs, int64_t p, float* yp) {
        direct_rows<F>(rows, xt, xs, w, p, yp, N);
      },
      [&](int64_t p, float* panel) { dequantize_panel<F>(w, p, panel); });
}

// Checks the operands' shapes against x [M, K] and y [M, N]; fills w with matrix `layer`.
ffi::Error check(Format f, ffi::Span<const int64_t> xd, ffi::Span<const int64_t> cd, ffi::Span<const int64_t> sd,
                 const ffi::Span<const int64_t>* md, ffi::Span<const int64_t> yd, int32_t layer, Weights& w) {
  if (xd.size() != 2) return ffi::Error::InvalidArgument("quant_matmul: x must be [M, K]");
  if (cd.size() != 5 || cd[3] != code_rows(f) || cd[4] != kPanel)
    return ffi::Error::InvalidArgument(f == Format::kQ8_0 ? "quant_matmul: q8_0 codes must be [L, P, Kb, 32, 32]"
                                                          : "quant_matmul: q4 codes must be [L, P, Kb, 16, 32]");
  const int64_t L = cd[0], P = cd[1], Kb = cd[2];
  if (xd[1] != Kb * kPanel) return ffi::Error::InvalidArgument("quant_matmul: x's K differs from the weights' 32 * Kb");
  if (sd.size() != 4 || sd[0] != L || sd[1] != P || sd[2] != Kb || sd[3] != kPanel)
    return ffi::Error::InvalidArgument("quant_matmul: scales must be [L, P, Kb, 32] like the codes");
  if (md && (md->size() != 4 || (*md)[0] != L || (*md)[1] != P || (*md)[2] != Kb || (*md)[3] != kPanel))
    return ffi::Error::InvalidArgument("quant_matmul: mins must be [L, P, Kb, 32] like the codes");
  if (yd.size() != 2 || yd[0] != xd[0] || yd[1] != P * kPanel)
    return ffi::Error::InvalidArgument("quant_matmul: y must be [M, 32 * P]");
  if (layer < 0 || layer >= L) return ffi::Error::InvalidArgument("quant_matmul: layer index outside [0, L)");
  w.K = Kb * kPanel;
  w.P = P;
  const int64_t codes_per_layer = P * Kb * code_rows(f) * kPanel, scales_per_layer = P * Kb * kPanel;
  w.codes = static_cast<const uint8_t*>(w.codes) + layer * codes_per_layer;
  w.scales += layer * scales_per_layer;
  if (w.mins) w.mins += layer * scales_per_layer;
  return ffi::Error::Success();
}

template <Format F>
ffi::Error run(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, const void* codes, ffi::Span<const int64_t> cd,
               ffi::Buffer<ffi::F16>& scales, ffi::Buffer<ffi::F16>* mins, ffi::Buffer<ffi::S32>& layer,
               ffi::Result<ffi::Buffer<ffi::F32>>& y, int64_t path) {
  if (layer.dimensions().size() != 0) return ffi::Error::InvalidArgument("quant_matmul: layer must be a scalar");
  if (path < 0 || path > 2) return ffi::Error::InvalidArgument("quant_matmul: path must be 0 (auto), 1 or 2");
  Weights w{codes, reinterpret_cast<const uint16_t*>(scales.typed_data()),
            mins ? reinterpret_cast<const uint16_t*>(mins->typed_data()) : nullptr, 0, 0};
  ffi::Span<const int64_t> md = mins ? mins->dimensions() : ffi::Span<const int64_t>();
  ffi::Error e = check(F, x.dimensions(), cd, scales.dimensions(), mins ? &md : nullptr, y->dimensions(),
                       *layer.typed_data(), w);
  if (e.failure()) return e;
  const int64_t M = x.dimensions()[0];
  if (M == 0 || w.P == 0) return ffi::Error::Success();
  if (w.K == 0) {
    std::fill(y->typed_data(), y->typed_data() + M * w.P * kPanel, 0.0f);
    return ffi::Error::Success();
  }
  const bool direct = path == 0 ? M <= kDirectMaxM : path == 1;
  quant_matmul<F>(pool, x.typed_data(), w, y->typed_data(), M, direct);
  return ffi::Error::Success();
}

ffi::Error Q8_0(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> codes,
                ffi::Buffer<ffi::F16> scales, ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::Buffer<ffi::F32>> y,
                int64_t path) {
  return run<Format::kQ8_0>(pool, x, codes.typed_data(), codes.dimensions(), scales, nullptr, layer, y, path);
}

ffi::Error Q4_0(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> codes,
                ffi::Buffer<ffi::F16> scales, ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::Buffer<ffi::F32>> y,
                int64_t path) {
  return run<Format::kQ4_0>(pool, x, codes.typed_data(), codes.dimensions(), scales, nullptr, layer, y, path);
}

ffi::Error Q4_1(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> codes,
                ffi::Buffer<ffi::F16> scales, ffi::Buffer<ffi::F16> mins, ffi::Buffer<ffi::S32> layer,
                ffi::Result<ffi::Buffer<ffi::F32>> y, int64_t path) {
  return run<Format::kQ4_1>(pool, x, codes.typed_data(), codes.dimensions(), scales, &mins, layer, y, path);
}


// ---- record formats (Q5_0, Q4_K, Q5_K, Q6_K) ------------------------------------------------
//
// model/weights/record_panels.py's records: codes [L, P, Ku, R, 32] uint8, one record of R rows
// of 32 bytes per unit (U = 1 or 8 blocks of 32 weights) and 32 columns: 16 U rows of nibbles
// (byte j of block b: weight j low, j + 16 high), the codes' high bits (4 U rows of 1 bit: row
// i bit t for weight 4t + i; or 8 U rows of 2 bits: row i bits 2t for weight 8t + i), the int8
// scales (one or two rows per block: weights 0-15, 16-31), the uint8 minimums (one row per
// block), then d and dmin as 32 float16 each (two rows each). Weight value: D_h (q - offset) -
// M with D_h = d sc_h and M = dmin m, both exact in float32, as gguf.quants.dequantize has it.
// The direct path sums x q per block (at one row the two halves apart; at more rows Q6_K's codes
// times their half's scale) and applies the block's scale once, M through the row sums of x; the dequantized path
// writes D_h (q - offset) - M into the scratch panel (bit for bit gguf's values: D_h q is exact
// where M is not zero, and M is zero where it is not).

struct RecordFormat {
  int blocks, high_bits, halves;
  bool mins;
  int offset;
  constexpr int high_rows() const { return high_bits == 0 ? 0 : high_bits == 1 ? 4 : 8; }
  constexpr int sc_row() const { return 16 * blocks + high_rows() * blocks; }
  constexpr int m_row() const { return sc_row() + halves * blocks; }
  constexpr int d_row() const { return m_row() + (mins ? blocks : 0); }
  constexpr int rows() const { return d_row() + (mins ? 4 : 2); }
  constexpr int unit() const { return blocks * kPanel; }
};
constexpr RecordFormat kQ5_0{1, 1, 0, false, 16};
constexpr RecordFormat kQ4_K{8, 0, 1, true, 0};
constexpr RecordFormat kQ5_K{8, 1, 1, true, 0};
constexpr RecordFormat kQ6_K{8, 2, 2, true, 32};

// Rows per direct tile. One row keeps the sums of a block's two halves apart (two chains of FMAs
// a column vector, and Q6_K's halves have scales of their own); more rows share one sum a row and
// column vector, Q6_K's codes multiplied by their half's int8 scale first (an exact product, at
// most 32 x 128), which takes 2 x kPanelVectors registers for the scales. So 15 rows on AVX-512
// (13 for Q6_K), 2 on AVX2 (1 for Q6_K), as the blocks' direct tiles.
constexpr int record_rows_max(const RecordFormat& f) {
  return f.halves == 2 ? std::max(1, (meshserve::kVectorRegisters - kBroadcastRegs - 3 * kPanelVectors) / kPanelVectors)
                       : kDirectRows;
}

inline vi widen_u8(const uint8_t* row, int c) { return widen<Format::kQ4_0>(row, c); }
inline vi widen_s8(const uint8_t* row, int c) { return widen<Format::kQ8_0>(row, c); }

// Codes of row j (0..15) of block b of a record for all 32 columns, less the offset: weights j
// (lo) and j + 16 (hi) as one byte each (int8 where the format has an offset, else uint8). The
// nibbles and high bits are put together on the bytes of the whole row at once, in 16-bit lanes
// whose masks keep every shifted bit inside its byte: 4 to 8 vector operations per 64 codes,
// where splitting them after widening took 18 (docs/cpu-kernels.md).
template <const RecordFormat& F>
inline void record_row(const uint8_t* rec, int b, int j, uint8_t* lo_out, uint8_t* hi_out) {
  typedef uint16_t vw __attribute__((vector_size(kPanel)));
  typedef uint8_t vb __attribute__((vector_size(kPanel)));
  vw v, lo, hi;
  std::memcpy(&v, rec + (16 * b + j) * kPanel, sizeof v);
  lo = v & 0x0f0f;
  hi = (v >> 4) & 0x0f0f;
  if constexpr (F.high_bits != 0) {
    constexpr uint16_t mask = F.high_bits == 1 ? 0x0101 : 0x0303;
    const int s = F.high_bits == 1 ? j / 4 : 2 * (j / 8);
    vw h;
    std::memcpy(&h, rec + (16 * F.blocks + F.high_rows() * b + j % F.high_rows()) * kPanel, sizeof h);
    lo |= ((h >> s) & mask) << 4;
    hi |= ((h >> (s + 4)) & mask) << 4;
  }
  vb l = (vb)lo, u = (vb)hi;
  if constexpr (F.offset != 0) {
    l -= static_cast<uint8_t>(F.offset);
    u -= static_cast<uint8_t>(F.offset);
  }
  std::memcpy(lo_out, &l, sizeof l);
  std::memcpy(hi_out, &u, sizeof u);
}

// Row c of such bytes widened to int32 (signed where the format has an offset).
template <const RecordFormat& F>
inline vf record_widen(const uint8_t* bytes, int c) {
  return __builtin_convertvector(F.offset != 0 ? widen_s8(bytes, c) : widen_u8(bytes, c), vf);
}

// Block b's scales of its two halves (D_0, D_1) and its minimum M, column vector c.
template <const RecordFormat& F>
inline void record_scales(const uint8_t* rec, int b, int c, vf& d0, vf& d1, vf& m) {
  const vf d = load_half(reinterpret_cast<const uint16_t*>(rec + F.d_row() * kPanel) + c * kLanes);
  if constexpr (F.halves == 0) {
    d0 = d1 = d;
  } else {
    d0 = d * __builtin_convertvector(widen_s8(rec + (F.sc_row() + F.halves * b) * kPanel, c), vf);
    d1 = F.halves == 2 ? d * __builtin_convertvector(widen_s8(rec + (F.sc_row() + 2 * b + 1) * kPanel, c), vf) : d0;
  }
  if constexpr (F.mins) {
    const vf dmin = load_half(reinterpret_cast<const uint16_t*>(rec + (F.d_row() + 2) * kPanel) + c * kLanes);
    m = dmin * __builtin_convertvector(widen_u8(rec + (F.m_row() + b) * kPanel, c), vf);
  } else {
    m = vf{};
  }
}

// y[0:R, 0:32] = x[0:R, :] @ panel p. xt: the rows packed as [K, R]; xs: their sums per block
// [K/32, R] (formats with minimums); codes: the matrix's records.
template <const RecordFormat& F, int R>
void record_tile(const float* xt, const float* xs, const uint8_t* codes, int64_t K, int64_t p, float* y, int64_t N) {
  constexpr int64_t bytes = static_cast<int64_t>(F.rows()) * kPanel;
  constexpr int S = R == 1 ? 2 : 1;             // sums a row and column vector: the halves apart at one row
  constexpr bool fold = S == 1 && F.halves == 2;  // Q6_K's half scales folded into the codes
  const int64_t Ku = K / F.unit();
  const uint8_t* rec = codes + p * Ku * bytes;
  vf total[R][kPanelVectors];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kPanelVectors; ++c) total[r][c] = vf{};
  for (int64_t u = 0; u < Ku; ++u, rec += bytes) {
    for (int64_t l = 0; l < bytes; l += 64) __builtin_prefetch(rec + kAheadBytes + l, 0, 3);
    for (int b = 0; b < F.blocks; ++b) {
      const int64_t blk = u * F.blocks + b;
      const float* xb = xt + blk * kPanel * R;
      vf s[S][R][kPanelVectors], sc0[kPanelVectors], sc1[kPanelVectors];
      for (int i = 0; i < S; ++i)
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < kPanelVectors; ++c) s[i][r][c] = vf{};
      if constexpr (fold)
        for (int c = 0; c < kPanelVectors; ++c) {
          sc0[c] = __builtin_convertvector(widen_s8(rec + (F.sc_row() + 2 * b) * kPanel, c), vf);
          sc1[c] = __builtin_convertvector(widen_s8(rec + (F.sc_row() + 2 * b + 1) * kPanel, c), vf);
        }
      // Unrolled: the high bits' shifts become immediates and the loop's scalar work goes.
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        alignas(kPanel) uint8_t lo[kPanel], hi[kPanel];
        record_row<F>(rec, b, j, lo, hi);
        for (int c = 0; c < kPanelVectors; ++c) {
          vf ql = record_widen<F>(lo, c), qh = record_widen<F>(hi, c);
          if constexpr (fold) {
            ql *= sc0[c];
            qh *= sc1[c];
          }
          for (int r = 0; r < R; ++r) s[0][r][c] += xb[j * R + r] * ql;
          for (int r = 0; r < R; ++r) s[S - 1][r][c] += xb[(j + 16) * R + r] * qh;
        }
      }
      for (int c = 0; c < kPanelVectors; ++c) {
        vf d0, d1, m;
        record_scales<F>(rec, b, c, d0, d1, m);
        if constexpr (fold) d0 = load_half(reinterpret_cast<const uint16_t*>(rec + F.d_row() * kPanel) + c * kLanes);
        for (int r = 0; r < R; ++r) {
          if constexpr (S == 2)
            total[r][c] += d0 * s[0][r][c] + d1 * s[1][r][c];
          else
            total[r][c] += d0 * s[0][r][c];  // one scale for both halves, or Q6_K's d (folded)
          if constexpr (F.mins) total[r][c] -= xs[blk * R + r] * m;
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kPanelVectors; ++c) store(y + r * N + c * kLanes, total[r][c]);
}

template <const RecordFormat& F, int R = record_rows_max(F)>
void record_rows(int rows, const float* xt, const float* xs, const uint8_t* codes, int64_t K, int64_t p, float* y,
                 int64_t N) {
  if constexpr (R >= 1) {
    if (rows == R) return record_tile<F, R>(xt, xs, codes, K, p, y, N);
    return record_rows<F, R - 1>(rows, xt, xs, codes, K, p, y, N);
  }
}

// Panel p dequantized into out [K, 32]: exactly the values gguf.quants.dequantize gives.
template <const RecordFormat& F>
void dequantize_record_panel(const uint8_t* codes, int64_t K, int64_t p, float* out) {
  constexpr int64_t bytes = static_cast<int64_t>(F.rows()) * kPanel;
  const int64_t Ku = K / F.unit();
  const uint8_t* rec = codes + p * Ku * bytes;
  for (int64_t u = 0; u < Ku; ++u, rec += bytes) {
    for (int64_t l = 0; l < bytes; l += 64) __builtin_prefetch(rec + kAheadBytes + l, 0, 3);
    for (int b = 0; b < F.blocks; ++b, out += kPanel * kPanel) {
      vf d0[kPanelVectors], d1[kPanelVectors], m[kPanelVectors];
      for (int c = 0; c < kPanelVectors; ++c) record_scales<F>(rec, b, c, d0[c], d1[c], m[c]);
      for (int j = 0; j < 16; ++j) {
        alignas(kPanel) uint8_t lo[kPanel], hi[kPanel];
        record_row<F>(rec, b, j, lo, hi);
        for (int c = 0; c < kPanelVectors; ++c) {
          // Not contracted into FMAs (-std=c++17): each product rounded, then the minimum.
          const vf a = d0[c] * record_widen<F>(lo, c), h = d1[c] * record_widen<F>(hi, c);
          store(out + j * kPanel + c * kLanes, F.mins ? a - m[c] : a);
          store(out + (j + 16) * kPanel + c * kLanes, F.mins ? h - m[c] : h);
        }
      }
    }
  }
}

template <const RecordFormat& F>
void record_matmul(ffi::ThreadPool& pool, const float* x, const uint8_t* codes, int64_t K, int64_t P, float* y,
                   int64_t M, bool direct) {
  const int64_t N = P * kPanel;
  matmul_panels<record_rows_max(F)>(
      pool, x, K, P, y, M, direct, F.mins, [](int) { return false; },
      [&](int rows, const float* xt, const float* xs, int64_t p, float* yp) {
        record_rows<F>(rows, xt, xs, codes, K, p, yp, N);
      },
      [&](int64_t p, float* panel) { dequantize_record_panel<F>(codes, K, p, panel); });
}

template <const RecordFormat& F>
ffi::Error run_records(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::U8>& codes,
                       ffi::Buffer<ffi::S32>& layer, ffi::Result<ffi::Buffer<ffi::F32>>& y, int64_t path) {
  if (layer.dimensions().size() != 0) return ffi::Error::InvalidArgument("quant_matmul: layer must be a scalar");
  if (path < 0 || path > 2) return ffi::Error::InvalidArgument("quant_matmul: path must be 0 (auto), 1 or 2");
  const auto xd = x.dimensions(), cd = codes.dimensions(), yd = y->dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("quant_matmul: x must be [M, K]");
  if (cd.size() != 5 || cd[3] != F.rows() || cd[4] != kPanel)
    return ffi::Error::InvalidArgument("quant_matmul: records must be [L, P, Ku, R, 32] with the format's R");
  const int64_t L = cd[0], P = cd[1], Ku = cd[2], K = Ku * F.unit();
  if (xd[1] != K) return ffi::Error::InvalidArgument("quant_matmul: x's K differs from the records' units");
  if (yd.size() != 2 || yd[0] != xd[0] || yd[1] != P * kPanel)
    return ffi::Error::InvalidArgument("quant_matmul: y must be [M, 32 * P]");
  const int32_t l = *layer.typed_data();
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("quant_matmul: layer index outside [0, L)");
  const int64_t M = xd[0];
  if (M == 0 || P == 0) return ffi::Error::Success();
  if (K == 0) {
    std::fill(y->typed_data(), y->typed_data() + M * P * kPanel, 0.0f);
    return ffi::Error::Success();
  }
  const uint8_t* base = codes.typed_data() + static_cast<int64_t>(l) * P * Ku * F.rows() * kPanel;
  const bool direct = path == 0 ? M <= kDirectMaxM : path == 1;
  record_matmul<F>(pool, x.typed_data(), base, K, P, y->typed_data(), M, direct);
  return ffi::Error::Success();
}

#define MESHSERVE_RECORD_HANDLER(NAME, FMT)                                                                  \
  ffi::Error NAME(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> codes,                 \
                  ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::Buffer<ffi::F32>> y, int64_t path) {         \
    return run_records<FMT>(pool, x, codes, layer, y, path);                                                 \
  }
MESHSERVE_RECORD_HANDLER(Q5_0, kQ5_0)
MESHSERVE_RECORD_HANDLER(Q4_K, kQ4_K)
MESHSERVE_RECORD_HANDLER(Q5_K, kQ5_K)
MESHSERVE_RECORD_HANDLER(Q6_K, kQ6_K)

}  // namespace

// Operands: x [M, K] f32; codes [L, P, Kb, B, 32]; scales (and Q4_1's mins) [L, P, Kb, 32] f16;
// layer, an s32 scalar in [0, L). Attribute path (i64): 0 picks by M, 1 forces the direct
// path, 2 the dequantized one (tests and benchmarks). Result: y [M, 32 P] f32.
XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshserveQuantMatmulQ8_0, Q8_0,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // codes [L, P, Kb, 32, 32]
                                  .Arg<ffi::Buffer<ffi::F16>>()  // scales [L, P, Kb, 32]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<int64_t>("path"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshserveQuantMatmulQ4_0, Q4_0,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // codes [L, P, Kb, 16, 32]
                                  .Arg<ffi::Buffer<ffi::F16>>()  // scales [L, P, Kb, 32]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<int64_t>("path"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshserveQuantMatmulQ4_1, Q4_1,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // codes [L, P, Kb, 16, 32]
                                  .Arg<ffi::Buffer<ffi::F16>>()  // scales [L, P, Kb, 32]
                                  .Arg<ffi::Buffer<ffi::F16>>()  // mins [L, P, Kb, 32]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<int64_t>("path"));

// Record formats: x [M, K] f32; codes [L, P, Ku, R, 32] u8; layer []; attribute path; y [M, N].
#define MESHSERVE_RECORD_SYMBOL(SYMBOL, NAME)                     \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(SYMBOL, NAME,                     \
                                ffi::Ffi::Bind()                  \
                                    .Ctx<ffi::ThreadPool>()       \
                                    .Arg<ffi::Buffer<ffi::F32>>() \
                                    .Arg<ffi::Buffer<ffi::U8>>()  \
                                    .Arg<ffi::Buffer<ffi::S32>>() \
                                    .Ret<ffi::Buffer<ffi::F32>>() \
                                    .Attr<int64_t>("path"));
MESHSERVE_RECORD_SYMBOL(MeshserveQuantMatmulQ5_0, Q5_0)
MESHSERVE_RECORD_SYMBOL(MeshserveQuantMatmulQ4_K, Q4_K)
MESHSERVE_RECORD_SYMBOL(MeshserveQuantMatmulQ5_K, Q5_K)
MESHSERVE_RECORD_SYMBOL(MeshserveQuantMatmulQ6_K, Q6_K)
