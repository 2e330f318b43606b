// The weight matmuls y[M, N] = x[M, K] @ W[K, N] on Intel AMX tiles, with float32 operands each
// split into two bfloat16 halves ("bf16x3": x W ~ xh Wh + xl Wh + xh Wl, accumulated in float32;
// the third-order term xl Wl is dropped). It is the precision JAX calls
// Precision.HIGH / "bfloat16_3x" and PyTorch's set_float32_matmul_precision("high") offers on
// CPUs with AMX: each operand keeps 16 of float32's 24 mantissa bits, so a product's relative
// error is about 2^-16 where float32's is 2^-24 (Henry, Tang & Heinecke 2019, "Leveraging the
// bfloat16 artificial intelligence datatype for higher-precision computations", section III).
//
// One AMX TDPBF16PS multiplies a 16 x 32 tile of bf16 by a 32 x 16 tile (row pairs interleaved,
// the "VNNI" layout) into a 16 x 16 float32 tile (Intel 64 and IA-32 Architectures Software
// Developer's Manual, vol. 1, ch. 20; vol. 2, TDPBF16PS). A block of 32 rows x 32 columns keeps
// four float32 tiles (tmm0-3) over the whole of K; per 32 values of k it loads two tiles of x
// and two of W per product, 12 products in all. A core's bf16 tile products run several times
// the rate of its float32 FMAs, so three of them per float32 product still leave bf16x3
// faster than AVX-512 FMAs where the matmul is compute-bound (docs/cpu-kernels.md).
//
// Operands: x [M, K] f32 (K a multiple of 32); W packed once by model/cpu_matmul.pack_bf16x3 as
// [N/32, K/32, 2 (hi, lo), 2 (column halves), 16, 32] bf16, where
// packed[p, b, s, c, r, 2j + t] = half s of W[32 b + 2 r + t, 32 p + 16 c + j]. Result: y [M, N]
// f32. x is split and packed per call as [ceil(M/32), K/32, 2 (hi, lo), 2 (row halves), 16, 32],
// rows past M zero. Work items are runs of 32-column panels on XLA's intra-op threads; every
// thread loads the tile configuration before its item and releases the tiles after it.
// Usable only after MeshserveAmxInit() returned 1 (the CPU has AMX-BF16 and AVX512-BF16 and
// the kernel let this process use the tile registers). Built and registered by
// model/native_kernels.py.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// AMX exists on x86-64 only, and GCC learned its intrinsics in version 11: elsewhere the
// library keeps the other kernels, MeshserveAmxInit() says 0 and the handler refuses.
#if defined(__x86_64__) && (defined(__clang__) || __GNUC__ >= 11)
#define MESHSERVE_HAVE_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define MESHSERVE_HAVE_AMX 0
#endif

namespace {

#if MESHSERVE_HAVE_AMX

constexpr int64_t kBlock = 32;        // rows, columns and k per block
constexpr int64_t kTile = 16 * 32;    // bf16 elements in one 16 x 64-byte tile
constexpr int64_t kStep = 4 * kTile;  // one k-block of a panel or of a row block: hi, lo x 2 halves
constexpr int64_t kAheadSteps = 4;    // k-blocks of W prefetched ahead (16 KiB) on the first pass

struct __attribute__((packed)) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

#define MESHSERVE_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16")))

MESHSERVE_AMX void load_config() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// The hi and lo bf16 halves of 16 floats: hi = RNE(v), lo = RNE(v - hi).
MESHSERVE_AMX void split16(const float* src, uint16_t* hi, uint16_t* lo) {
  const __m512 v = _mm512_loadu_ps(src);
  const __m256bh h = _mm512_cvtneps_pbh(v);
  const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
  const __m256bh l = _mm512_cvtneps_pbh(_mm512_sub_ps(v, hf));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), (__m256i)h);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), (__m256i)l);
}

// Rows [m0, m1) of x [M, K] into xp [ceil(M/32), K/32, 2, 2, 16, 32] bf16 (see the header);
// rows past M stay zero.
MESHSERVE_AMX void pack_x(const float* x, int64_t m0, int64_t m1, int64_t K, uint16_t* xp) {
  const int64_t KB = K / kBlock;
  for (int64_t m = m0; m < m1; ++m) {
    const int64_t mb = m / kBlock, half = (m % kBlock) / 16, r = m % 16;
    for (int64_t b = 0; b < KB; ++b) {
      uint16_t* hi = xp + (mb * KB + b) * kStep + half * kTile + r * 32;
      for (int64_t j = 0; j < kBlock; j += 16) split16(x + m * K + b * kBlock + j, hi + j, hi + 2 * kTile + j);
    }
  }
}

// One block: y[0:16 H, 0:32] = x's row block (H = 1 or 2 row halves) @ one panel, over KB
// k-blocks. Rows of y at a stride of N floats; `rows` of them are written (<= 16 H).
template <int H, bool kPrefetch>
MESHSERVE_AMX void block(const uint16_t* a, const uint16_t* w, float* y, int64_t KB, int64_t N, int rows) {
  _tile_zero(0);
  _tile_zero(1);
  if (H == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t b = 0; b < KB; ++b, a += kStep, w += kStep) {
    if (kPrefetch)
      for (int64_t line = 0; line < kStep; line += 32) _mm_prefetch(w + kAheadSteps * kStep + line, _MM_HINT_T0);
    _tile_loadd(6, w, 64);  // W hi, columns 0-15 and 16-31
    _tile_loadd(7, w + kTile, 64);
    _tile_loadd(4, a + 2 * kTile, 64);  // x lo
    if (H == 2) _tile_loadd(5, a + 3 * kTile, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (H == 2) {
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_loadd(4, a, 64);  // x hi
    if (H == 2) _tile_loadd(5, a + kTile, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (H == 2) {
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_loadd(6, w + 2 * kTile, 64);  // W lo
    _tile_loadd(7, w + 3 * kTile, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (H == 2) {
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  if (rows == 16 * H) {
    _tile_stored(0, y, N * 4);
    _tile_stored(1, y + 16, N * 4);
    if (H == 2) {
      _tile_stored(2, y + 16 * N, N * 4);
      _tile_stored(3, y + 16 * N + 16, N * 4);
    }
    return;
  }
  float tmp[32 * 32];  // a partial block goes through a buffer; only its rows are copied out
  _tile_stored(0, tmp, 32 * 4);
  _tile_stored(1, tmp + 16, 32 * 4);
  if (H == 2) {
    _tile_stored(2, tmp + 16 * 32, 32 * 4);
    _tile_stored(3, tmp + 16 * 32 + 16, 32 * 4);
  }
  for (int r = 0; r < rows; ++r) std::memcpy(y + r * N, tmp + r * 32, 32 * sizeof(float));
}

// y[:, panels p0 .. p1) for all rows; the first row block streams each panel from memory.
MESHSERVE_AMX void panel_run(const uint16_t* xp, const uint16_t* w, float* y, int64_t M, int64_t K, int64_t N,
                             int64_t p0, int64_t p1) {
  load_config();
  const int64_t KB = K / kBlock;
  for (int64_t p = p0; p < p1; ++p) {
    const uint16_t* panel = w + p * KB * kStep;
    for (int64_t m = 0; m < M; m += kBlock) {
      const int rows = static_cast<int>(std::min<int64_t>(kBlock, M - m));
      const uint16_t* a = xp + (m / kBlock) * KB * kStep;
      float* out = y + m * N + p * kBlock;
      if (rows > 16)
        m == 0 ? block<2, true>(a, panel, out, KB, N, rows) : block<2, false>(a, panel, out, KB, N, rows);
      else
        m == 0 ? block<1, true>(a, panel, out, KB, N, rows) : block<1, false>(a, panel, out, KB, N, rows);
    }
  }
  _tile_release();
}

ffi::Error AmxMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> packed,
                     ffi::Result<ffi::Buffer<ffi::F32>> y) {
  auto xd = x.dimensions();
  auto pd = packed.dimensions();
  if (xd.size() != 2 || xd[1] % kBlock != 0) return ffi::Error::InvalidArgument("x must be [M, K], K a multiple of 32");
  if (pd.size() != 6 || pd[1] * kBlock != xd[1] || pd[2] != 2 || pd[3] != 2 || pd[4] != 16 || pd[5] != 32)
    return ffi::Error::InvalidArgument("packed W must be [N/32, K/32, 2, 2, 16, 32] with x's K");
  auto yd = y->dimensions();
  if (yd.size() != 2 || yd[0] != xd[0] || yd[1] != pd[0] * kBlock)
    return ffi::Error::InvalidArgument("y must be [M, 32 * panels]");
  const int64_t M = xd[0], K = xd[1], P = pd[0], N = P * kBlock;
  if (M == 0 || P == 0) return ffi::Error::Success();
  std::vector<uint16_t> xp(static_cast<size_t>((M + kBlock - 1) / kBlock * kBlock * K * 2), 0);
  const float* xs = x.typed_data();
  meshserve::ParallelFor(pool, (M + kBlock - 1) / kBlock, [&](int64_t b) {  // one 32-row block per item
    pack_x(xs, b * kBlock, std::min(M, (b + 1) * kBlock), K, xp.data());
  });
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t per_item = std::max<int64_t>(1, (P + 4 * threads - 1) / (4 * threads));
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.typed_data());
  float* out = y->typed_data();
  meshserve::ParallelFor(pool, (P + per_item - 1) / per_item, [&](int64_t i) {
    panel_run(xp.data(), w, out, M, K, N, i * per_item, std::min(P, (i + 1) * per_item));
  });
  return ffi::Error::Success();
}

#else  // no AMX in this build

ffi::Error AmxMatmul(ffi::ThreadPool, ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::BF16>, ffi::Result<ffi::Buffer<ffi::F32>>) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented, "meshserve was built without the AMX kernel");
}

#endif

}  // namespace

// 1 where this CPU and kernel can run the AMX kernel in this process, else 0: CPUID says
// AMX-TILE, AMX-BF16, AVX512F and AVX512-BF16, and Linux granted the tile-data state
// (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA; Linux >= 5.16).
extern "C" int MeshserveAmxInit() {
#if !MESHSERVE_HAVE_AMX
  return 0;
#else
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
  const bool avx512f = b & (1u << 16), amx_bf16 = d & (1u << 22), amx_tile = d & (1u << 24);
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return 0;
  const bool avx512_bf16 = a & (1u << 5);
  if (!(avx512f && amx_bf16 && amx_tile && avx512_bf16)) return 0;
  constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0 ? 1 : 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshserveAmxMatmul, AmxMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // packed W
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]
