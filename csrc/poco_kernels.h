// The C++ (CPU) kernels of poco_kernels: what the torch glue (ops.cpp, ops_update.cpp)
// hands to them.
//
// The kernels are the CPU twins of poco_kernels/kernels/triton_kernels.py: the same
// operations (sample, accumulate, check, fold_ge, step, refresh), the same noise stream and the
// same code paths, over flat buffers.  They hold no torch types: ops.cpp validates the
// tensors, reads the control tensor, turns the hyperparameters into the float32 constants
// below (in double first, as the reference's Python floats are) and splits the buffer into
// tiles for at::parallel_for.
//
// Tiles: a buffer is processed in tiles of kTile elements at fixed offsets, each tile by
// one thread, and every element by the same code whatever tile it is in.  So results do
// not depend on the number of threads, bit for bit.
//
// ISA: kernels_impl.h is compiled once per instruction set (kernels_*.cpp, each under its
// own `#pragma GCC target` and namespace); ops.cpp picks the best one the CPU supports
// at load time (POCO_KERNELS_CPU_ISA overrides).  Different ISAs may differ in the last
// bit of the noise transform; one ISA is deterministic.
#pragma once

#include <cstdint>

namespace poco {

constexpr int64_t kTile = 128;

// dtypes of parameters and gradients (state is float32; with state_dtype=bfloat16 the
// IVON family's momentum and outer buffers are bfloat16: the `low` flags below)
enum PDtype : int { kF32 = 0, kBF16 = 1, kF16 = 2 };
// sigma of a sample (= kernels/interface.py SIGMA_*)
enum SigmaMode : int { kSigmaNone = 0, kSigmaIvon = 1, kSigmaBuffer = 2, kSigmaConst = 3 };
// update family of the step (= kernels/interface.py FAMILY_*)
enum Family : int { kFamilyIvon = 0, kFamilySgd = 1, kFamilyAdamw = 2 };

// ------------------------------------------------------------------ the typed interface
// The scalars and switches each operator takes, in order: the mirror of the records of
// poco_kernels/kernels/interface.py (StepHyper, StepFlags, RefreshHyper, RefreshFlags,
// SampleHyper), which the Triton kernels also take by these names;
// tests/repo/test_architecture.py parses these lists and fails if Python, C++ and Triton
// disagree.  ops_common.h reads the operator's float64 row (one value per field, in this order;
// count checked) into the structs below and unpacks the flag bits (bit i = the i-th name
// after `family`).
#define POCO_STEP_HYPER(X) \
  X(sign_at_out) X(inv_n_in) X(inv_n_at_out) X(lr) X(beta1) X(beta2) X(wd) X(ess) X(alpha) \
  X(hess_corr) X(floor) X(clip) X(momentum) X(dampening) X(eps) X(mom_first)
#define POCO_STEP_FLAGS(X) \
  X(corr) X(ge_in) X(ge_at_out) X(shared_noise) X(next_sample) X(hess_corr) X(floor) X(clip) \
  X(debias) \
  X(momentum) X(nesterov)
#define POCO_REFRESH_HYPER(X) X(inv_n) X(ess) X(wd) X(rho1) X(rho2) X(sigma)
#define POCO_REFRESH_FLAGS(X) X(ge) X(noisy)
#define POCO_SAMPLE_HYPER(X) X(ess) X(wd) X(sigma)

#define POCO_DOUBLE_FIELD(name) double name;
#define POCO_BOOL_FIELD(name) bool name;
struct StepHyper { POCO_STEP_HYPER(POCO_DOUBLE_FIELD) };
struct StepFlags { POCO_STEP_FLAGS(POCO_BOOL_FIELD) };
struct RefreshHyper { POCO_REFRESH_HYPER(POCO_DOUBLE_FIELD) };
struct RefreshFlags { POCO_REFRESH_FLAGS(POCO_BOOL_FIELD) };
struct SampleHyper { POCO_SAMPLE_HYPER(POCO_DOUBLE_FIELD) };
#undef POCO_DOUBLE_FIELD
#undef POCO_BOOL_FIELD

// One noise stream: element i of a buffer gets randn(seed, base + i, counter, stream) *
// sign, drawn under the stream definition `version` (1 or 2: poco_kernels/noise.py).
// `base`: the index of the buffer's first element in the stream (0 for a whole bucket; a
// shard's place in the unsharded bucket under FSDP2); the stochastic rounding of
// low-precision state uses the same indices.
struct Noise {
  uint64_t seed;
  uint32_t counter;
  uint32_t stream;
  float sign;
  uint32_t version;
  uint64_t base;
};

// Which of the IVON family's state buffers are bfloat16 (StepArgs::low, RefreshArgs::low;
// 0: all float32): state_dtype makes the momentum and the four outer buffers bfloat16,
// outer_dtype the outer estimates g_out and h_out.
enum LowBits : uint32_t {
  kLowS1 = 1u, kLowGOut = 2u, kLowHOut = 4u, kLowMOut = 8u, kLowSigmaOut = 16u
};

struct SampleArgs {
  void* param;                // written: theta in the parameter dtype
  int pdtype;
  const float* centre;        // read unless sync
  float* mean;                // written when sync (the parameters hold the mean)
  const float* h;             // kSigmaIvon
  const float* sigma;         // kSigmaBuffer
  int64_t n;
  Noise noise;
  float ess, wd, sigma_const;
  int mode;
  bool sync;
  bool low;                   // centre and sigma are bfloat16 (the outer sample, state_dtype)
};

struct AccumulateArgs {
  const void* grad;
  int pdtype;
  float* acc_g;
  float* acc_ge;              // with ge
  int64_t n;
  Noise noise;                // of the active draw, for ge
  bool first, ge;
};

struct FoldArgs {
  const float* acc_g;
  float* acc_ge;
  int64_t n;
  Noise noise;
};

struct StepArgs {
  float* mean;
  void* param;
  int pdtype;
  float* s1;                  // IVON: momentum g; SGD: momentum buffer; AdamW: exp_avg
  float* s2;                  // IVON: h; AdamW: exp_avg_sq
  // gradient sums (ge_*: with ge_in_sum, ge_at_out_sum)
  const float *g_in, *ge_in, *g_at_out, *ge_at_out;
  const float *g_out, *h_out, *m_out, *sigma_out;
  int64_t n;
  uint64_t seed;
  uint32_t noise_version;     // the stream definition (1 or 2)
  uint64_t base;              // stream index of element 0 (Noise::base)
  uint32_t counter;           // the step: noise counter of inner and outer samples
  uint32_t stream_in, stream_at_out;
  float sign_at_out;
  float scale_in, scale_at_out;  // 1/count * 1/grad_scale
  int family;
  bool corr, ge_in_sum, ge_at_out_sum, shared_noise, hess_corr_on;
  bool next_sample;           // IVON: write the next inner sample (counter + 1), not the mean
  uint32_t low;               // IVON: LowBits of the bfloat16 buffers (s1 and the outer ones)
  bool momentum_on, nesterov, mom_first;
  // float32 constants (computed in double on the host)
  float alpha;                // alpha once a refresh has been taken, else 0
  float lr, beta1, one_m_beta1, beta2, one_m_beta2, half_sq_one_m_beta2, wd, ess;
  float hess_corr_alpha;      // hess_corr_scale * alpha
  float neg_floor;            // -hess_floor (-inf: no floor)
  float clip;                 // clip radius (inf: no clipping)
  float inv_bias1;            // 1 / (1 - beta1^t) (1 when not debiasing)
  float momentum, one_m_dampening;
  // AdamW
  float decay;                // 1 - lr * wd
  float step_size;            // lr / (1 - beta1^t)
  float bias2_sqrt;           // sqrt(1 - beta2^t)
  float eps;
};

struct RefreshArgs {
  const float* mean;
  const float* h;
  const float* acc_g;
  const float* acc_ge;        // with ge
  float *g_out, *h_out, *m_out, *sigma_out;
  int64_t n;
  Noise noise;                // counter = refreshes taken
  float scale;                // 1/count * 1/grad_scale
  int family;
  bool ge, noisy, first;
  uint32_t low;               // IVON: LowBits of the bfloat16 outer buffers
  float ess, wd, rho1, one_m_rho1, rho2, one_m_rho2, sigma_const;
};

// The kernels of one instruction set; each works on tiles [t0, t1).
struct KernelTable {
  const char* isa;
  void (*sample)(const SampleArgs&, int64_t t0, int64_t t1);
  bool (*accumulate)(const AccumulateArgs&, int64_t t0, int64_t t1);   // true: non-finite seen
  bool (*check)(const void* grad, int pdtype, int64_t n, int64_t t0, int64_t t1);  // the same
  void (*fold_ge)(const FoldArgs&, int64_t t0, int64_t t1);
  void (*step)(const StepArgs&, int64_t t0, int64_t t1);
  void (*refresh)(const RefreshArgs&, int64_t t0, int64_t t1);
  void (*write_params)(void* param, int pdtype, const float* mean, int64_t n, int64_t t0,
                       int64_t t1);
  void (*randn)(float* out, int64_t n, uint64_t offset, const Noise& noise, int64_t t0,
                int64_t t1);
};

extern const KernelTable kKernelsBase;
#if defined(__x86_64__)
extern const KernelTable kKernelsAvx2;
extern const KernelTable kKernelsAvx512;
#endif

}  // namespace poco
