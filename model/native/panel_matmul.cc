// A decode step's weight matmuls, y[M, N] = x[M, K] @ W[K, N] with M the few rows of a decode
// batch, as an XLA FFI custom call for the CPU, over weights re-laid out once in column panels.
//
// With M of 1 to 64 rows a decode step's matmuls are bound by streaming the weights from
// memory. XLA:CPU's small-M matmuls walk W [K, N] at a stride of N floats per output block, and
// the hardware prefetchers restart at every 4 KiB page. Here W is stored as panels [N/32, K, 32]
// (panel p holds columns 32p .. 32p+31 of every row, contiguous), so each panel is one
// contiguous, software-prefetched stream; a tile of up to kMaxRows rows of x keeps its
// kMaxRows x 32 outputs in vector registers over the whole of K (the register-blocked
// micro-kernel of Goto & van de Geijn 2008, "Anatomy of high-performance matrix
// multiplication", section 4), reading x re-laid out per tile as [K, rows] (packed once per
// call, so a step of k reads one short contiguous run of x). A panel is read from memory once,
// by the first tile; later tiles of a larger M read it from the core's L2.
//
// Operands: x [M, K] f32; panels [L, P, K, 32] f32 (L = 1 for one matrix); layer, an int32
// scalar in [0, L): the matrix of the stack multiplied, read in place (the scanned paged
// engine's layer loop passes the whole stack and its index, as quant_matmul.cc's callers do, so
// XLA materialises no slice of it per layer). Result: y [M, 32 P] f32. Work items are runs of
// panels, shared by XLA's intra-op threads. Built and registered by model/native/__init__.py;
// docs/cpu-kernels.md has the measurements behind the tile and prefetch choices.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

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

using meshserve::panel::kMaxRows;
using meshserve::panel::kPanel;
using meshserve::panel::tile_rows;

// One tile of x, rows m .. m+R-1 of x [M, K], re-laid out as [K, R] at xp + m * K. Written k by
// k (R strided reads, one contiguous run of R writes), faster than row by row, whose writes
// land R floats apart.
template <int R>
void pack_tile(const float* x, int64_t K, float* tile) {
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < R; ++r) tile[k * R + r] = x[r * K + k];
}

template <int R = kMaxRows>
void pack_rows(int rows, const float* x, int64_t K, float* tile) {
  if constexpr (R >= 1) {
    if (rows == R) return pack_tile<R>(x, K, tile);
    return pack_rows<R - 1>(rows, x, K, tile);
  }
}

// y[:, panels p0 .. p1) = x @ those panels; xp is x packed by pack_rows. The first tile of
// rows streams each panel from memory (prefetching ahead); later tiles find it in L2.
void panel_run(const float* xp, const float* panels, float* y, int64_t M, int64_t K, int64_t P, int64_t p0,
               int64_t p1) {
  const int64_t N = P * kPanel;
  for (int64_t p = p0; p < p1; ++p) {
    const float* panel = panels + p * K * kPanel;
    for (int64_t m = 0; m < M; m += kMaxRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, M - m));
      float* out = y + m * N + p * kPanel;
      if (m == 0)
        tile_rows<true>(rows, xp + m * K, panel, out, K, N);
      else
        tile_rows<false>(rows, xp + m * K, panel, out, K, N);
    }
  }
}

ffi::Error PanelMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> panels,
                       ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  auto xd = x.dimensions();
  auto pd = panels.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("x must be [M, K]");
  if (pd.size() != 4 || pd[3] != kPanel || pd[2] != xd[1])
    return ffi::Error::InvalidArgument("panels must be [L, N/32, K, 32] with x's K");
  if (layer.dimensions().size() != 0) return ffi::Error::InvalidArgument("layer must be a scalar");
  const int32_t l = *layer.typed_data();
  if (l < 0 || l >= pd[0]) return ffi::Error::InvalidArgument("layer index outside [0, L)");
  auto yd = y->dimensions();
  if (yd.size() != 2 || yd[0] != xd[0] || yd[1] != pd[1] * kPanel)
    return ffi::Error::InvalidArgument("y must be [M, 32 * panels]");
  const int64_t M = xd[0], K = xd[1], P = pd[1];
  if (M == 0 || P == 0) return ffi::Error::Success();
  // x packed tile by tile (pack_rows), the tiles shared by the pool's threads (packing is a
  // small fraction of the matmul's time, even for a prefill chunk's x).
  std::unique_ptr<float[]> xp(new float[static_cast<size_t>(M * K)]);  // every element written
  const float* xs = x.typed_data();
  meshserve::ParallelFor(pool, (M + kMaxRows - 1) / kMaxRows, [&](int64_t t) {
    const int64_t m = t * kMaxRows;
    pack_rows(static_cast<int>(std::min<int64_t>(kMaxRows, M - m)), xs + m * K, K, xp.get() + m * K);
  });
  // Work items are runs of panels, about four per thread: long contiguous streams, and a
  // thread that finishes early takes the next run.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t per_item = std::max<int64_t>(1, (P + 4 * threads - 1) / (4 * threads));
  const float* w = panels.typed_data() + l * P * K * kPanel;  // matrix `layer` of the stack
  float* out = y->typed_data();
  meshserve::ParallelFor(pool, (P + per_item - 1) / per_item, [&](int64_t i) {
    panel_run(xp.get(), w, out, M, K, P, i * per_item, std::min(P, (i + 1) * per_item));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshservePanelMatmul, PanelMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // panels [L, N/32, K, 32]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer, a scalar in [0, L)
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]
