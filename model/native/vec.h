// 16-float vectors (GCC vector extensions: one AVX-512 register, or two AVX2 ones) and the
// vector helpers meshserve's CPU kernels share.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace meshserve {

constexpr int kLanes = 16;  // floats per vector
typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

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
