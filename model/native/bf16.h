// bfloat16 <-> float32 for meshserve's CPU kernels: a bfloat16 is stored as the high 16 bits of
// a float32 (uint16_t here); float32 rounds to it to nearest even, as XLA's convert does.
#pragma once

#include <cstdint>
#include <cstring>

namespace meshserve {

inline float to_f32(float x) { return x; }
inline void from_f32(float x, float* out) { *out = x; }
inline void from_f32(float x, uint16_t* out) {  // round to nearest even, as XLA's convert does
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN stays NaN
    *out = static_cast<uint16_t>((bits >> 16) | 0x40);
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *out = static_cast<uint16_t>(bits >> 16);
}
inline float to_f32(uint16_t x) {  // bfloat16: the high half of a float32
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

}  // namespace meshserve
