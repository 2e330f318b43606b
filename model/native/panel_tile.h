// The float32 register tile that the panel matmuls share (native/panel_matmul.cc, and the
// dequantized path of native/quant_matmul.cc): y[0:R, 0:32] = x[0:R, :] @ one 32-column panel
// [K, 32], its R x 32 outputs held in vector registers over the whole of K (the register-blocked
// micro-kernel of Goto & van de Geijn 2008, "Anatomy of high-performance matrix
// multiplication", section 4).
#pragma once

#include <cstdint>

#include "vec.h"

namespace meshserve::panel {

constexpr int64_t kPanel = 32;                // columns per panel (the Python-side layout)
constexpr int kPanelVectors = kPanel / kLanes;  // vectors per panel row: 2 (AVX-512) or 4 (AVX2)
static_assert(kPanel % kLanes == 0, "a panel row must be whole vectors");
// Rows of x per register tile: its kMaxRows x kPanelVectors accumulators fill the vector
// registers, less one for the broadcast row value where an FMA cannot broadcast from memory;
// the panel's vectors take what is left or come as FMA memory operands. 16 rows on AVX-512,
// 3 on AVX2. More rows spill accumulators to the stack every step of k; fewer re-read each
// panel from L2 more often.
constexpr int kMaxRows = (kVectorRegisters - (kBroadcastOperand ? 0 : 1)) / kPanelVectors;
constexpr int64_t kAhead = 4096;  // floats prefetched ahead in the panel stream (16 KiB, 128 rows of k)
// The prefetches' locality hint for a tile of R rows: 3 (prefetcht0, into L1) at one row, where
// each line is used at once; 1 (prefetcht2, into L2) at more rows, where the FMAs slow the
// stream's use and L1's few miss buffers capped the lines in flight.
template <int R>
constexpr int kLocality = R == 1 ? 3 : 1;

// y[0:R, 0:32] = x[0:R, :] @ panel; xt is the tile's rows of x packed as [K, R]; rows of y at
// a stride of N floats.
template <int R, bool kPrefetch>
void tile(const float* xt, const float* panel, float* y, int64_t K, int64_t N) {
  vf acc[R][kPanelVectors];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kPanelVectors; ++c) acc[r][c] = vf{};
  const float* w = panel;
  for (int64_t k = 0; k < K; ++k, w += kPanel, xt += R) {
    if (kPrefetch)
      for (int l = 0; l < kPanel; l += kLineFloats) __builtin_prefetch(w + kAhead + l, 0, kLocality<R>);
    for (int r = 0; r < R; ++r) {
      const float xr = xt[r];
      for (int c = 0; c < kPanelVectors; ++c) acc[r][c] += xr * load(w + c * kLanes);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kPanelVectors; ++c) store(y + r * N + c * kLanes, acc[r][c]);
}

template <bool kPrefetch, int R = kMaxRows>
void tile_rows(int rows, const float* x, const float* panel, float* y, int64_t K, int64_t N) {
  if constexpr (R >= 1) {
    if (rows == R) return tile<R, kPrefetch>(x, panel, y, K, N);
    return tile_rows<kPrefetch, R - 1>(rows, x, panel, y, K, N);
  }
}

}  // namespace meshserve::panel
