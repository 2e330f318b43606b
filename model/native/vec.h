// Vectors of the build target's native width (GCC vector extensions) and the vector helpers
// meshserve's CPU kernels share, with the register facts the kernels size their tiles by.
//
// A vector must be exactly one hardware register: GCC lowers a vector wider than the target's
// registers piece by piece through the stack (on AVX2 a 16-float vector became 16-byte loads
// and stores of spilled halves), so kLanes follows the target. The kernels' operand layouts
// (head_dim a multiple of 16, 32-column weight panels) are whole numbers of vectors at every
// width here, so one Python-side layout serves every build.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace meshserve {

#if defined(__AVX512F__)
constexpr int kLanes = 16;            // floats per vector: one zmm register
constexpr int kVectorRegisters = 32;  // zmm0-31
constexpr bool kBroadcastOperand = true;  // an FMA can broadcast its scalar operand from memory ({1to16})
#elif defined(__AVX__)
constexpr int kLanes = 8;             // one ymm register (AVX2 with FMA at -march=x86-64-v3)
constexpr int kVectorRegisters = 16;  // ymm0-15
constexpr bool kBroadcastOperand = false;  // a broadcast takes a register of its own
#elif defined(__aarch64__)
constexpr int kLanes = 4;  // one NEON q register
constexpr int kVectorRegisters = 32;
constexpr bool kBroadcastOperand = false;
#else
constexpr int kLanes = 4;  // SSE2, x86-64's baseline: one xmm register
constexpr int kVectorRegisters = 16;
constexpr bool kBroadcastOperand = false;
#endif
constexpr int kLineFloats = 16;  // floats per 64-byte cache line, the unit of a software prefetch
constexpr int kHeadDimMultiple = 16;  // head_dim the kernels take: whole vectors at every kLanes above
static_assert(kHeadDimMultiple % kLanes == 0, "head_dim rows must be whole vectors");

// Vectors of head_dim per values pass of the attention kernels for G rows of output (the query
// heads of one KV head in decode, a tile's query rows in prefill): the largest of 4, 2, 1 whose
// G x t accumulators, t value vectors and (where an FMA cannot broadcast from memory) the
// broadcast probability fit the vector registers, so the pass never spills (AVX-512: 4 up to
// G = 7, 2 at 8; AVX2: 4 up to G = 2, 2 up to 6, 1 at 7 and 8).
template <int G>
constexpr int kValueTiles = [] {
  for (int t : {4, 2})
    if ((G + 1) * t + (kBroadcastOperand ? 0 : 1) <= kVectorRegisters) return t;
  return 1;
}();

typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// kLanes bfloat16 values (the high halves of float32s, uint16_t here) widened exactly to float32.
inline vf load(const uint16_t* p) {
  typedef uint16_t vh __attribute__((vector_size(kLanes * sizeof(uint16_t))));
  typedef uint32_t vu __attribute__((vector_size(kLanes * sizeof(uint32_t))));
  vh h;
  std::memcpy(&h, p, sizeof h);
  vu u = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

// kLanes int8 codes (an 8-bit KV cache's, model/attention/pages.py) widened exactly to float32.
// By the sign-extending conversions where the target has them: GCC 12 lowers a vector
// extension's char-to-float conversion to one scalar conversion per lane.
inline vf load(const int8_t* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__) && !defined(__AVX512F__)
  static_assert(kLanes == 8, "an AVX2 vector is 8 floats");
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  vf v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

// An IEEE binary16 value's bits widened exactly to float32 (zero, subnormal, normal, inf, NaN).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: man x 2^-24
    const float f = static_cast<float>(man) * 5.9604644775390625e-08f;
    return sign ? -f : f;
  }
  const uint32_t bits = sign | (exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112u) << 23) | (man << 13));
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The factor a KV page row of head_dim H entries is multiplied by when read: 1 for float rows;
// an 8-bit row's scale, the float16 in its 2 bytes after the H codes (pages.py's ``to_stored``).
template <typename T>
inline float row_scale(const T*, int64_t) {
  return 1.0f;
}
template <>
inline float row_scale<int8_t>(const int8_t* row, int64_t H) {
  uint16_t h;
  std::memcpy(&h, row + H, sizeof h);
  return half_to_float(h);
}

// Entries of a KV page row of head_dim H in the cache's type T: H, and an 8-bit row's scale.
template <typename T>
constexpr int64_t row_entries(int64_t H) {
  return std::is_same<T, int8_t>::value ? H + 2 : H;
}

// e^x for x <= 0 (softmax after max subtraction), kLanes at a time: x = k ln2 + r with
// |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (relative error < 3e-7 there), 2^k
// through the exponent bits; x below -87 (e^x < 2^-126) gives 0.
inline vf exp_nonpositive(vf x) {
  typedef int32_t vi __attribute__((vector_size(kLanes * sizeof(int32_t))));
  const vf lo = vf{} - 87.0f;
  const vi tiny = x < lo;
  x = tiny ? lo : x;
  const vf kf = __builtin_convertvector(__builtin_convertvector(x * 1.44269504f - 0.5f, vi), vf);  // round(x / ln2)
  const vf r = x - kf * 0.693145752f - kf * 1.42860677e-6f;  // ln2 split in two for precision
  vf e = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
  vi bits;
  std::memcpy(&bits, &e, sizeof bits);
  bits += __builtin_convertvector(kf, vi) << 23;
  bits = tiny ? vi{} : bits;
  std::memcpy(&e, &bits, sizeof e);
  return e;
}

// One softmax row in place, unnormalised: s[0, n) becomes e^(s - max) (by vectors, the tail
// one at a time); returns their sum (n >= 1). The caller scales by 1 / sum where it is cheaper.
inline float exp_minus_max(float* s, int64_t n) {
  const int64_t nv = n / kLanes * kLanes;
  float mx = s[0];
  if (nv > 0) {
    vf vmx = load(s);
    for (int64_t u = kLanes; u < nv; u += kLanes) {
      const vf x = load(s + u);
      vmx = x > vmx ? x : vmx;
    }
    for (int i = 0; i < kLanes; ++i) mx = std::max(mx, vmx[i]);
  }
  for (int64_t u = nv; u < n; ++u) mx = std::max(mx, s[u]);
  vf vsum = vf{};
  for (int64_t u = 0; u < nv; u += kLanes) {
    const vf e = exp_nonpositive(load(s + u) - mx);
    store(s + u, e);
    vsum += e;
  }
  float sum = 0.0f;
  for (int i = 0; i < kLanes; ++i) sum += vsum[i];
  for (int64_t u = nv; u < n; ++u) {
    s[u] = std::exp(s[u] - mx);
    sum += s[u];
  }
  return sum;
}

}  // namespace meshserve
