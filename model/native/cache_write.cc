// A prefill chunk's KV-cache write into a blocked KV cache, as an XLA FFI custom call for the CPU.
//
// The chunk's T new keys and values go into one slot at positions start .. start + T - 1, each
// into the block holding it; positions outside the window are dropped. XLA:CPU writes these as
// scatters, and has no bfloat16 scatter: its float normalisation converts each bfloat16 block
// to float32 and back around every one, whole blocks for a few entries (most of a prefill's
// op time at 64 slots; docs/cpu-kernels.md). Here the entries are
// rounded to the cache dtype (nearest even, as XLA's convert) and stored in place; a float32
// cache takes the same path.
//
// Operands: slot and start (s32 scalars); k and v [T, K, H] f32; then nb key blocks
// [S, K, H, n_j] and nb value blocks [S, K, n_j, H], all f32 or all bf16. Results: the 2 nb
// blocks, written (aliased to the operand blocks by the caller; copied from them first where
// they are not). Built and registered by model/native_kernels.py.
#include <algorithm>
#include <cstdint>

#include "bf16.h"
#include "cache_blocks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Writes rows [t0, t1) of the chunk (positions start + t) into one slot's key block [K, H, n]
// and value block [K, n, H], whose first position is b0.
template <typename T>
void write_block(const float* k, const float* v, int64_t K, int64_t H, int64_t start, int64_t t0, int64_t t1,
                 int64_t b0, int64_t n, T* kb, T* vb) {
  for (int64_t kh = 0; kh < K; ++kh) {
    T* keys = kb + kh * H * n;  // [H, n]: each head_dim row takes the chunk's positions in order
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = t0; t < t1; ++t) meshserve::from_f32(k[(t * K + kh) * H + h], keys + h * n + (start + t - b0));
    T* values = vb + kh * n * H;  // [n, H]: one contiguous row per position
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < H; ++h) meshserve::from_f32(v[(t * K + kh) * H + h], values + (start + t - b0) * H + h);
  }
}

ffi::Error CacheWrite(ffi::Buffer<ffi::S32> slot_buf, ffi::Buffer<ffi::S32> start_buf, ffi::Buffer<ffi::F32> k,
                      ffi::Buffer<ffi::F32> v, ffi::RemainingArgs blocks, ffi::RemainingRets blocks_out) {
  auto kd = k.dimensions();
  if (kd.size() != 3) return ffi::Error::InvalidArgument("k must be [T, K, H]");
  if (v.element_count() != k.element_count()) return ffi::Error::InvalidArgument("v must be shaped like k");
  if (slot_buf.element_count() != 1 || start_buf.element_count() != 1)
    return ffi::Error::InvalidArgument("slot and start must be scalars");
  const int64_t T = kd[0], K = kd[1], H = kd[2];
  meshserve::CacheBlocks cb;
  if (auto e = meshserve::BindCacheBlocks(blocks, blocks_out, K, H, &cb); e.failure()) return e;
  const size_t nb = cb.len.size();
  const int64_t S = cb.slots;
  const int64_t slot = slot_buf.typed_data()[0], start = start_buf.typed_data()[0];
  if (slot < 0 || slot >= S) return ffi::Error::Success();  // nothing to write, as a dropped scatter
  int64_t b0 = 0;
  for (size_t j = 0; j < nb; b0 += cb.len[j], ++j) {
    const int64_t n = cb.len[j];
    const int64_t t0 = std::clamp<int64_t>(b0 - start, 0, T), t1 = std::clamp<int64_t>(b0 + n - start, 0, T);
    if (t0 >= t1) continue;
    const size_t item = static_cast<size_t>(slot * K * H * n);
    if (cb.bf16)
      write_block(k.typed_data(), v.typed_data(), K, H, start, t0, t1, b0, n, static_cast<uint16_t*>(cb.k[j]) + item,
                  static_cast<uint16_t*>(cb.v[j]) + item);
    else
      write_block(k.typed_data(), v.typed_data(), K, H, start, t0, t1, b0, n, static_cast<float*>(cb.k[j]) + item,
                  static_cast<float*>(cb.v[j]) + item);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshserveCacheWrite, CacheWrite,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot
                                  .Arg<ffi::Buffer<ffi::S32>>()  // start
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k [T, K, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v [T, K, H]
                                  .RemainingArgs()               // key blocks, then value blocks
                                  .RemainingRets());             // the blocks, written
