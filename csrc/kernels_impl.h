// The C++ kernels, compiled once per instruction set by kernels_<isa>.cpp, which define
// POCO_ISA (the namespace) and POCO_TABLE (the KernelTable) before including this file.
// This file holds the tile helpers and the entry points; the kernels themselves are in
// kernels_sample.h (sample, accumulate, check, fold_ge), kernels_step.h (the steps) and
// kernels_refresh.h (the refreshes, the parameters written from the mean).
//
// Each kernel is the CPU twin of a Triton kernel of poco_kernels/kernels/triton_kernels.py
// and fuses the same reference functions (poco_kernels/reference.py), named in its
// comment; tests/kernels/test_kernels_*.py check both against them.  Per tile of kTile elements:
// first the noise the tile needs, generated into an L1-resident buffer (Philox with
// intrinsics, the transform by the vectoriser), then ONE vectorised pass over the
// buffers.  The arithmetic follows the reference maths op for op (ops.cpp builds the float32
// constants the way the reference's Python floats become float32 scalars, and the build
// turns off floating-point contraction), so the only differences are the last bit of
// the noise transform and of a few reordered products.
#include <cstdint>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "poco_kernels.h"

namespace poco {
namespace POCO_ISA {

#include "poco_math.h"
#include "poco_dtypes.h"

namespace {

template <typename T> POCO_INLINE T min_(T a, T b) { return a < b ? a : b; }

// prefetch for reading / for writing (all cache levels)
template <typename T> POCO_INLINE void pf_r(const T* p) { __builtin_prefetch(p, 0, 3); }
template <typename T> POCO_INLINE void pf_w(const T* p) { __builtin_prefetch(p, 1, 3); }

POCO_INLINE int64_t tile_len(int64_t t, int64_t n) { return min_<int64_t>(kTile, n - t * kTile); }

#include "kernels_sample.h"
#include "kernels_step.h"
#include "kernels_refresh.h"

}  // namespace

// ------------------------------------------------------------------ entry points
#define POCO_BY_PDTYPE(pd, fn, ...)                        \
  switch (pd) {                                           \
    case kBF16: return fn<bf16>(__VA_ARGS__);             \
    case kF16: return fn<f16>(__VA_ARGS__);               \
    default: return fn<float>(__VA_ARGS__);               \
  }

void sample(const SampleArgs& a, int64_t t0, int64_t t1) { POCO_BY_PDTYPE(a.pdtype, sample_pt, a, t0, t1) }
bool accumulate(const AccumulateArgs& a, int64_t t0, int64_t t1) { POCO_BY_PDTYPE(a.pdtype, accumulate_pt, a, t0, t1) }
bool check(const void* grad, int pdtype, int64_t n, int64_t t0, int64_t t1) { POCO_BY_PDTYPE(pdtype, check_pt, grad, n, t0, t1) }
void fold_ge(const FoldArgs& a, int64_t t0, int64_t t1) { fold_ge_impl(a, t0, t1); }
void step(const StepArgs& a, int64_t t0, int64_t t1) { POCO_BY_PDTYPE(a.pdtype, step_pt, a, t0, t1) }
void refresh(const RefreshArgs& a, int64_t t0, int64_t t1) {
  if (a.family == kFamilyIvon) {
    if (a.low) return a.ge ? refresh_ivon<true, true>(a, t0, t1) : refresh_ivon<false, true>(a, t0, t1);
    return a.ge ? refresh_ivon<true, false>(a, t0, t1) : refresh_ivon<false, false>(a, t0, t1);
  }
  return a.noisy ? refresh_sgd<true>(a, t0, t1) : refresh_sgd<false>(a, t0, t1);
}
void write_params(void* param, int pdtype, const float* mean, int64_t n, int64_t t0, int64_t t1) {
  POCO_BY_PDTYPE(pdtype, write_params_pt, param, mean, n, t0, t1)
}
// out[j] = randn(offset + j): the stream itself (tests, and the noise of the tiles above).
void randn(float* out, int64_t n, uint64_t offset, const Noise& noise, int64_t t0, int64_t t1) {
  const PhiloxKey key(noise.seed, noise.version);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t i0 = t * kTile, len = tile_len(t, n);
    noise_tile(out + i0, len, offset + (uint64_t)i0, key, noise.counter, noise.stream, noise.sign);
  }
}
#undef POCO_BY_PDTYPE

}  // namespace POCO_ISA

extern const KernelTable POCO_TABLE = {
    POCO_ISA_NAME,          POCO_ISA::sample, POCO_ISA::accumulate,   POCO_ISA::check,
    POCO_ISA::fold_ge,
    POCO_ISA::step,         POCO_ISA::refresh, POCO_ISA::write_params, POCO_ISA::randn};

}  // namespace poco
