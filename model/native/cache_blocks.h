// The blocked KV cache's operands of meshserve's XLA:CPU custom calls: nb key blocks
// [S, K, H, n_j] then nb value blocks [S, K, n_j, H], all float32 or all bfloat16, each
// returned as a result aliased to its operand (input_output_aliases). Shared by the decode
// step's write-and-attend kernel and a prefill chunk's write kernel.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace meshserve {

struct CacheBlocks {
  std::vector<void*> k, v;    // the result buffers, in the operands' order
  std::vector<int64_t> len;   // n_j, positions per block
  int64_t slots = 0, width = 0;  // S, and the sum of the n_j
  bool bf16 = false;
};

// Checks the blocks against K and H and binds their results: a result that is not its
// operand's own buffer gets the operand copied into it first, so the caller writes into results
// that start out equal to the operands either way.
inline xla::ffi::Error BindCacheBlocks(const xla::ffi::RemainingArgs& blocks, const xla::ffi::RemainingRets& results,
                                       int64_t K, int64_t H, CacheBlocks* out) {
  namespace ffi = xla::ffi;
  if (blocks.size() == 0 || blocks.size() % 2 != 0 || results.size() != blocks.size())
    return ffi::Error::InvalidArgument("expected the same number (>= 1) of key and value blocks, in and out");
  const size_t nb = blocks.size() / 2;
  for (size_t j = 0; j < 2 * nb; ++j) {
    auto b = blocks.get<ffi::AnyBuffer>(j);
    if (b.has_error()) return b.error();
    auto r = results.get<ffi::AnyBuffer>(j);
    if (r.has_error()) return r.error();
    const bool bf16 = b->element_type() == ffi::DataType::BF16;
    if (!bf16 && b->element_type() != ffi::DataType::F32)
      return ffi::Error::InvalidArgument("cache blocks must be float32 or bfloat16");
    if (j == 0) out->bf16 = bf16;
    if (bf16 != out->bf16) return ffi::Error::InvalidArgument("all cache blocks must share one dtype");
    auto d = b->dimensions();
    if (d.size() != 4 || d[1] != K) return ffi::Error::InvalidArgument("cache blocks must be [S, K, ...]");
    if (j == 0) out->slots = d[0];
    if (d[0] != out->slots) return ffi::Error::InvalidArgument("all cache blocks must have the same slots");
    if ((*r)->element_type() != b->element_type() || (*r)->size_bytes() != b->size_bytes())
      return ffi::Error::InvalidArgument("each result block must match its operand block");
    void* dst = (*r)->untyped_data();
    if (dst != b->untyped_data()) std::memcpy(dst, b->untyped_data(), b->size_bytes());
    if (j < nb) {  // key block [S, K, H, n]
      if (d[2] != H) return ffi::Error::InvalidArgument("key block must be [S, K, H, n]");
      out->k.push_back(dst);
      out->len.push_back(d[3]);
      out->width += d[3];
    } else {  // value block [S, K, n, H]
      if (d[3] != H || d[2] != out->len[j - nb])
        return ffi::Error::InvalidArgument("value block j must be [S, K, n_j, H] with key block j's n_j");
      out->v.push_back(dst);
    }
  }
  return ffi::Error::Success();
}

}  // namespace meshserve
