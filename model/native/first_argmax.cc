// Greedy decoding's argmax over a decode step's logits, as an XLA FFI custom call for the CPU.
//
// XLA:CPU (jaxlib 0.10) runs model.sampling.first_argmax's max-then-first-index over a decode
// step's logits as a single-threaded reduce_max fusion, a select and a reduce-window, many
// times slower than streaming the logits once (docs/cpu-kernels.md). Here each row is one work
// item on XLA's intra-op threads: a vectorised max (NaN noted, not propagated), then a scan
// for the first index holding it, the row still in L2.
//
// Operand: logits [R, V] f32. Result: ids [R] s32, each row's first index of its largest value
// (jnp.argmax's tie rule); a row holding a NaN gives V - 1 (a valid id, as
// model.sampling.first_argmax gives).
// Built and registered by model/native/__init__.py.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "parallel_for.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using meshserve::kLanes;
using meshserve::load;
using meshserve::vf;

int32_t row_first_argmax(const float* x, int64_t V) {
  const int64_t nv = V / kLanes * kLanes;
  float mx = -INFINITY;
  bool nan = false;
  if (nv > 0) {
    vf vmx = load(x), vnan = vf{};
    for (int64_t u = 0; u < nv; u += kLanes) {
      const vf v = load(x + u);
      vmx = v > vmx ? v : vmx;
      vnan = v != v ? vf{} + 1.0f : vnan;
    }
    for (int i = 0; i < kLanes; ++i) {
      mx = std::max(mx, vmx[i]);
      nan = nan || vnan[i] != 0.0f;
    }
  }
  for (int64_t u = nv; u < V; ++u) {
    nan = nan || std::isnan(x[u]);
    mx = std::max(mx, x[u]);
  }
  if (nan) return static_cast<int32_t>(V - 1);
  for (int64_t u = 0; u < V; ++u)
    if (x[u] == mx) return static_cast<int32_t>(u);
  return static_cast<int32_t>(V - 1);  // not reached: mx is one of the row's values
}

ffi::Error FirstArgmax(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Result<ffi::Buffer<ffi::S32>> ids) {
  auto d = logits.dimensions();
  if (d.size() != 2 || d[1] < 1) return ffi::Error::InvalidArgument("logits must be [R, V] with V >= 1");
  if (ids->element_count() != static_cast<size_t>(d[0])) return ffi::Error::InvalidArgument("ids must be [R]");
  const int64_t V = d[1];
  const float* x = logits.typed_data();
  int32_t* out = ids->typed_data();
  meshserve::ParallelFor(pool, d[0], [&](int64_t r) { out[r] = row_first_argmax(x + r * V, V); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshserveFirstArgmax, FirstArgmax,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // logits [R, V]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // ids [R]
