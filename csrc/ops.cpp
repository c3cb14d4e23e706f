// torch glue of the C++ kernels: the `poco_kernels_cpp::*` operators.
//
// Each operator has the signature of its Triton twin in poco_kernels/kernels/triton_ops.py
// (same arguments, same control-tensor protocol), so one host engine
// (poco_kernels/backends/fused.py) drives either backend.  Here: check every tensor,
// read the control tensor and the AMP scalars (a CPU read costs nothing), turn the
// hyperparameters into the float32 constants of the kernels (in double first, as the
// reference's Python floats are), and run the kernels over fixed tiles with
// at::parallel_for (torch's intra-op threads, torch.set_num_threads).
//
// Registered with TORCH_LIBRARY, so torch.compile (with the fake kernels registered in
// poco_kernels/kernels/cpp_ops.py) and serialisation see them as operators.
#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "poco_kernels.h"

namespace poco {
namespace {

// Buffers below this many tiles run on one thread (the OpenMP fork costs more).
constexpr int64_t kGrainTiles = 32768 / kTile;

// ------------------------------------------------------------------ instruction set
bool isa_supported(const std::string& name) {
  if (name == "base") return true;
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (name == "avx2") return __builtin_cpu_supports("x86-64-v3");
  if (name == "avx512") return __builtin_cpu_supports("x86-64-v4");
#endif
  return false;
}

const KernelTable* table_of(const std::string& name) {
#if defined(__x86_64__)
  if (name == "avx512") return &kKernelsAvx512;
  if (name == "avx2") return &kKernelsAvx2;
#endif
  return &kKernelsBase;
}

std::string best_isa() {
  for (const char* name : {"avx512", "avx2"})
    if (isa_supported(name)) return name;
  return "base";
}

std::atomic<const KernelTable*> g_table{nullptr};

const KernelTable& kernels() {
  const KernelTable* t = g_table.load();
  if (t != nullptr) return *t;
  std::string name = best_isa();
  if (const char* env = std::getenv("POCO_KERNELS_CPU_ISA")) {
    const std::string want(env);
    TORCH_CHECK(want == "base" || want == "avx2" || want == "avx512",
                "POCO_KERNELS_CPU_ISA must be 'base', 'avx2' or 'avx512', got '", want, "'");
    TORCH_CHECK(isa_supported(want), "POCO_KERNELS_CPU_ISA='", want,
                "': this CPU does not support that instruction set");
    name = want;
  }
  g_table.store(table_of(name));
  return *g_table.load();
}

std::string isa_op() { return kernels().isa; }

// The instruction sets this CPU can run, best last.
std::vector<std::string> supported_isas_op() {
  std::vector<std::string> out;
  for (const char* name : {"base", "avx2", "avx512"})
    if (isa_supported(name)) out.emplace_back(name);
  return out;
}

// Select the instruction set ('base', 'avx2', 'avx512', or 'best'); returns the previous.
std::string set_isa_op(std::string name) {
  const std::string previous = kernels().isa;
  if (name == "best") name = best_isa();
  TORCH_CHECK(name == "base" || name == "avx2" || name == "avx512",
              "set_isa: expected 'base', 'avx2', 'avx512' or 'best', got '", name, "'");
  TORCH_CHECK(isa_supported(name), "set_isa('", name, "'): this CPU does not support it");
  g_table.store(table_of(name));
  return previous;
}

// ------------------------------------------------------------------ checks
void check_cpu_contiguous(const at::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "poco_kernels_cpp: '", name, "' must be a CPU tensor, got ",
              t.device());
  TORCH_CHECK(t.is_contiguous(), "poco_kernels_cpp: '", name, "' must be contiguous");
  TORCH_CHECK(t.numel() == n, "poco_kernels_cpp: '", name, "' has ", t.numel(),
              " elements, expected ", n);
}

float* state_ptr(const at::Tensor& t, int64_t n, const char* name) {
  check_cpu_contiguous(t, n, name);
  TORCH_CHECK(t.scalar_type() == at::kFloat, "poco_kernels_cpp: '", name,
              "' must be float32 (optimizer state), got ", t.scalar_type());
  return t.data_ptr<float>();
}

// An optional state buffer that the code path needs (`needed`) or ignores.
float* state_ptr(const c10::optional<at::Tensor>& t, int64_t n, const char* name, bool needed) {
  if (!needed) return nullptr;
  TORCH_CHECK(t.has_value(), "poco_kernels_cpp: '", name, "' is required on this code path");
  return state_ptr(*t, n, name);
}

// A state buffer that state_dtype (or outer_dtype) may keep in bfloat16: its pointer (as
// float*: the kernels read it as uint16 when its bit is set in `low`).
float* low_state_ptr(const c10::optional<at::Tensor>& t, int64_t n, const char* name,
                     bool needed, uint32_t& low, uint32_t bit) {
  if (!needed) return nullptr;
  TORCH_CHECK(t.has_value(), "poco_kernels_cpp: '", name, "' is required on this code path");
  check_cpu_contiguous(*t, n, name);
  const auto st = t->scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16, "poco_kernels_cpp: '", name,
              "' must be float32 or bfloat16 (optimizer state), got ", st);
  if (st == at::kBFloat16) low |= bit;
  return static_cast<float*>(t->data_ptr());
}
int pdtype_of(const at::Tensor& t, int64_t n, const char* name) {
  check_cpu_contiguous(t, n, name);
  switch (t.scalar_type()) {
    case at::kFloat: return kF32;
    case at::kBFloat16: return kBF16;
    case at::kHalf: return kF16;
    default:
      TORCH_CHECK(false, "poco_kernels_cpp: '", name,
                  "' must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
  return kF32;
}

int64_t* ctl_ptr(const at::Tensor& ctl) {
  TORCH_CHECK(ctl.device().is_cpu() && ctl.scalar_type() == at::kLong && ctl.is_contiguous() &&
                  ctl.numel() >= 4,
              "poco_kernels_cpp: 'ctl' must be a contiguous CPU int64 tensor of 4 elements");
  return ctl.data_ptr<int64_t>();
}

// The first element of a scalar tensor (AMP found_inf / grad_scale), as a double.
double scalar_of(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.numel() >= 1, "poco_kernels_cpp: '", name, "' is empty");
  TORCH_CHECK(t.device().is_cpu(), "poco_kernels_cpp: '", name, "' must be a CPU tensor");
  if (t.scalar_type() == at::kFloat && t.is_contiguous()) return t.data_ptr<float>()[0];
  return t.reshape(-1).select(0, 0).item<double>();
}

bool skip_update(const int64_t* ctl, const c10::optional<at::Tensor>& found_inf) {
  return ctl[2] != 0 || (found_inf.has_value() && scalar_of(*found_inf, "found_inf") != 0.0);
}

// 1 / grad_scale in float32, as the reference computes it
float inv_scale(const c10::optional<at::Tensor>& grad_scale) {
  if (!grad_scale.has_value()) return 1.0f;
  return 1.0f / (float)scalar_of(*grad_scale, "grad_scale");
}

uint32_t u32(int64_t v, const char* name) {
  TORCH_CHECK(v >= 0 && v <= (int64_t)0xFFFFFFFF, "poco_kernels_cpp: '", name,
              "' must be in [0, 2**32), got ", v);
  return (uint32_t)v;
}

// the noise stream definition (poco_kernels/noise.py: STREAM_VERSIONS)
uint32_t noise_version(int64_t v) {
  TORCH_CHECK(v == 1 || v == 2, "poco_kernels_cpp: noise version must be 1 or 2, got ", v);
  return (uint32_t)v;
}

// `offset`: the stream index of a buffer's element 0 (Noise::base)
uint64_t base_of(int64_t offset) {
  TORCH_CHECK(offset >= 0, "poco_kernels_cpp: offset must be >= 0, got ", offset);
  return (uint64_t)offset;
}

int64_t counter_of(const int64_t* ctl, int64_t slot) {
  TORCH_CHECK(slot == 0 || slot == 1, "poco_kernels_cpp: counter slot must be 0 or 1");
  return ctl[slot];
}

template <typename F>
void for_tiles(int64_t n, const F& f) {
  const int64_t ntiles = (n + kTile - 1) / kTile;
  if (ntiles > 0) at::parallel_for(0, ntiles, kGrainTiles, f);
}

constexpr float kInf = std::numeric_limits<float>::infinity();

// The typed interface (poco_kernels.h): the operator's float64 row (one value per field,
// poco_kernels.kernels.interface.hyper_row), read into its struct by name, and the flag
// bits unpacked in the declared order.
#define POCO_COUNT(name) +1
template <typename Hyper>
Hyper read_hyper(const at::Tensor& hp, int64_t count, const char* op, const char* names) {
  TORCH_CHECK(hp.device().is_cpu() && hp.scalar_type() == at::kDouble && hp.dim() == 1 &&
                  hp.is_contiguous() && hp.numel() == count,
              "poco_kernels_cpp::", op, ": hp must be a contiguous float64 CPU row of ", count,
              " hyperparameters (", names, "), got ", hp.scalar_type(), " of shape ",
              hp.sizes(), " on ", hp.device());
  Hyper h{};
  static_assert(std::is_standard_layout<Hyper>::value, "a plain struct of doubles");
  std::memcpy(&h, hp.data_ptr<double>(), sizeof(double) * count);
  return h;
}

StepHyper step_hyper(const at::Tensor& hp) {
  constexpr int64_t n = 0 POCO_STEP_HYPER(POCO_COUNT);
  static_assert(sizeof(StepHyper) == n * sizeof(double), "StepHyper is its doubles");
  return read_hyper<StepHyper>(hp, n, "step", "StepHyper");
}

RefreshHyper refresh_hyper(const at::Tensor& hp) {
  constexpr int64_t n = 0 POCO_REFRESH_HYPER(POCO_COUNT);
  static_assert(sizeof(RefreshHyper) == n * sizeof(double), "RefreshHyper is its doubles");
  return read_hyper<RefreshHyper>(hp, n, "refresh", "RefreshHyper");
}

SampleHyper sample_hyper(const at::Tensor& hp) {
  constexpr int64_t n = 0 POCO_SAMPLE_HYPER(POCO_COUNT);
  static_assert(sizeof(SampleHyper) == n * sizeof(double), "SampleHyper is its doubles");
  return read_hyper<SampleHyper>(hp, n, "sample", "SampleHyper");
}

// beta ** e by squaring (e >= 0), one IEEE double multiplication after another: the
// Triton kernels compute it the same way (triton_kernels._pow_steps), so both debias
// with the same float32 constant whatever the platform's pow()
double pow_steps(double b, int64_t e) {
  double r = 1.0;
  while (e > 0) {
    if (e & 1) r = r * b;
    b = b * b;
    e >>= 1;
  }
  return r;
}

// ------------------------------------------------------------------ operators
void sample_op(const at::Tensor& param, const at::Tensor& centre, const at::Tensor& mean,
               const c10::optional<at::Tensor>& h, const c10::optional<at::Tensor>& sigma,
               const at::Tensor& ctl, int64_t seed, int64_t noise, int64_t stream, int64_t counter_slot,
               const at::Tensor& hp_row, double sign, int64_t sigma_mode, bool sync,
               int64_t offset) {
  const uint32_t nv = noise_version(noise);
  const SampleHyper hp = sample_hyper(hp_row);
  const uint64_t base = base_of(offset);
  const int64_t n = param.numel();
  TORCH_CHECK(sigma_mode >= kSigmaNone && sigma_mode <= kSigmaConst,
              "poco_kernels_cpp: invalid sigma_mode ", sigma_mode);
  SampleArgs a{};
  a.pdtype = pdtype_of(param, n, "param");
  a.param = param.data_ptr();
  TORCH_CHECK(!sync || a.pdtype == kF32, "poco_kernels_cpp: sync needs float32 parameters");
  uint32_t low = 0;
  a.centre = sync ? nullptr : low_state_ptr(centre, n, "centre", true, low, 1u);
  a.mean = state_ptr(mean, n, "mean");
  a.h = state_ptr(h, n, "h", sigma_mode == kSigmaIvon);
  a.sigma = low_state_ptr(sigma, n, "sigma", sigma_mode == kSigmaBuffer, low, 2u);
  TORCH_CHECK(low == 0 || (low == 3u && sigma_mode == kSigmaBuffer), "poco_kernels_cpp::"
              "sample: a bfloat16 centre needs a bfloat16 sigma buffer, and the reverse (the "
              "outer sample's m_out and sigma_out share one dtype)");
  a.low = low != 0;
  const int64_t* c = ctl_ptr(ctl);
  a.n = n;
  a.noise = Noise{(uint64_t)seed, u32(counter_of(c, counter_slot), "counter"),
                  u32(stream, "stream"), (float)sign, nv, base};
  a.ess = (float)hp.ess;
  a.wd = (float)hp.wd;
  a.sigma_const = (float)hp.sigma;
  a.mode = (int)sigma_mode;
  a.sync = sync;
  const KernelTable& k = kernels();
  for_tiles(n, [&](int64_t t0, int64_t t1) { k.sample(a, t0, t1); });
}

void accumulate_op(const at::Tensor& grad, const at::Tensor& acc_g,
                   const c10::optional<at::Tensor>& acc_ge, const at::Tensor& ctl,
                   int64_t seed, int64_t noise, int64_t stream, int64_t counter_slot, double sign, bool first,
                   bool ge, int64_t offset) {
  const uint32_t nv = noise_version(noise);
  const uint64_t base = base_of(offset);
  const int64_t n = grad.numel();
  AccumulateArgs a{};
  a.pdtype = pdtype_of(grad, n, "grad");
  a.grad = grad.data_ptr();
  a.acc_g = state_ptr(acc_g, n, "acc_g");
  a.acc_ge = state_ptr(acc_ge, n, "acc_ge", ge);
  int64_t* c = ctl_ptr(ctl);
  a.n = n;
  a.noise = Noise{(uint64_t)seed, ge ? u32(counter_of(c, counter_slot), "counter") : 0u,
                  u32(stream, "stream"), (float)sign, nv, base};
  a.first = first;
  a.ge = ge;
  const KernelTable& k = kernels();
  std::atomic<bool> bad{false};
  for_tiles(n, [&](int64_t t0, int64_t t1) {
    if (k.accumulate(a, t0, t1)) bad.store(true);
  });
  if (bad.load()) c[2] = 1;     // the update that follows is skipped (or raises)
}

void check_op(const at::Tensor& grad, const at::Tensor& ctl) {
  const int64_t n = grad.numel();
  const int pd = pdtype_of(grad, n, "grad");
  int64_t* c = ctl_ptr(ctl);
  const void* g = grad.data_ptr();
  const KernelTable& k = kernels();
  std::atomic<bool> bad{false};
  for_tiles(n, [&](int64_t t0, int64_t t1) {
    if (k.check(g, pd, n, t0, t1)) bad.store(true);
  });
  if (bad.load()) c[2] = 1;     // the update that follows is skipped (or raises)
}

void fold_ge_op(const at::Tensor& acc_g, const at::Tensor& acc_ge, const at::Tensor& ctl,
                int64_t seed, int64_t noise, int64_t stream, int64_t counter_slot, double sign,
                int64_t offset) {
  const uint32_t nv = noise_version(noise);
  const uint64_t base = base_of(offset);
  const int64_t n = acc_g.numel();
  FoldArgs a{};
  a.acc_g = state_ptr(acc_g, n, "acc_g");
  a.acc_ge = state_ptr(acc_ge, n, "acc_ge");
  const int64_t* c = ctl_ptr(ctl);
  a.n = n;
  a.noise = Noise{(uint64_t)seed, u32(counter_of(c, counter_slot), "counter"),
                  u32(stream, "stream"), (float)sign, nv, base};
  const KernelTable& k = kernels();
  for_tiles(n, [&](int64_t t0, int64_t t1) { k.fold_ge(a, t0, t1); });
}

StepFlags step_flags(int64_t bits) {
  constexpr int64_t n = 0 POCO_STEP_FLAGS(POCO_COUNT);
  TORCH_CHECK(bits >= 0 && bits < (int64_t(1) << n), "poco_kernels_cpp::step: invalid flags ",
              bits);
  StepFlags f{};
  int i = 0;
#define POCO_BIT(name) f.name = ((bits >> i++) & 1) != 0;
  POCO_STEP_FLAGS(POCO_BIT)
#undef POCO_BIT
  return f;
}

RefreshFlags refresh_flags(int64_t bits) {
  constexpr int64_t n = 0 POCO_REFRESH_FLAGS(POCO_COUNT);
  TORCH_CHECK(bits >= 0 && bits < (int64_t(1) << n), "poco_kernels_cpp::refresh: invalid flags ",
              bits);
  RefreshFlags f{};
  int i = 0;
#define POCO_BIT(name) f.name = ((bits >> i++) & 1) != 0;
  POCO_REFRESH_FLAGS(POCO_BIT)
#undef POCO_BIT
  return f;
}
#undef POCO_COUNT

void step_op(const at::Tensor& mean, const at::Tensor& param,
             const c10::optional<at::Tensor>& s1, const c10::optional<at::Tensor>& s2,
             const at::Tensor& g_in, const c10::optional<at::Tensor>& ge_in,
             const c10::optional<at::Tensor>& g_at_out, const c10::optional<at::Tensor>& ge_at_out,
             const c10::optional<at::Tensor>& g_out, const c10::optional<at::Tensor>& h_out,
             const c10::optional<at::Tensor>& m_out, const c10::optional<at::Tensor>& sigma_out,
             const at::Tensor& ctl, const c10::optional<at::Tensor>& found_inf,
             const c10::optional<at::Tensor>& grad_scale, int64_t seed, int64_t noise, int64_t stream,
             int64_t stream_at_out, const at::Tensor& hp_list, int64_t family, int64_t flag_bits,
             int64_t offset) {
  const uint32_t nv = noise_version(noise);
  const uint64_t base = base_of(offset);
  const int64_t n = mean.numel();
  const StepHyper hp = step_hyper(hp_list);
  const StepFlags f = step_flags(flag_bits);
  StepArgs a{};
  a.family = (int)family;
  TORCH_CHECK(family >= kFamilyIvon && family <= kFamilyAdamw,
              "poco_kernels_cpp::step: invalid family ", family);
  a.corr = f.corr;
  a.ge_in_sum = f.ge_in;
  a.ge_at_out_sum = f.ge_at_out;
  a.shared_noise = f.shared_noise;
  a.next_sample = f.next_sample;
  a.hess_corr_on = f.hess_corr;
  a.momentum_on = f.momentum;
  a.nesterov = f.nesterov;
  TORCH_CHECK(!(a.shared_noise && a.ge_in_sum),
              "poco_kernels_cpp::step: shared noise is regenerated, not summed");
  const bool ivon = a.family == kFamilyIvon, sgd = a.family == kFamilySgd;
  a.mean = state_ptr(mean, n, "mean");
  a.pdtype = pdtype_of(param, n, "param");
  a.param = param.data_ptr();
  a.s2 = state_ptr(s2, n, "s2", !sgd);
  a.g_in = state_ptr(g_in, n, "g_in");
  a.ge_in = state_ptr(ge_in, n, "ge_in", ivon && a.ge_in_sum);
  a.g_at_out = state_ptr(g_at_out, n, "g_at_out", a.corr);
  a.ge_at_out = state_ptr(ge_at_out, n, "ge_at_out", ivon && a.corr && a.ge_at_out_sum);
  if (ivon) {          // momentum and outer buffers: each float32 or bfloat16 (LowBits)
    a.s1 = low_state_ptr(s1, n, "s1", true, a.low, kLowS1);
    a.g_out = low_state_ptr(g_out, n, "g_out", a.corr, a.low, kLowGOut);
    a.h_out = low_state_ptr(h_out, n, "h_out", a.corr, a.low, kLowHOut);
    a.m_out = low_state_ptr(m_out, n, "m_out", a.corr && a.hess_corr_on, a.low, kLowMOut);
    a.sigma_out = low_state_ptr(sigma_out, n, "sigma_out", a.corr, a.low, kLowSigmaOut);
  } else {
    a.s1 = state_ptr(s1, n, "s1", !sgd || a.momentum_on);
    a.g_out = state_ptr(g_out, n, "g_out", a.corr);
  }
  const int64_t* c = ctl_ptr(ctl);
  a.n = n;
  const KernelTable& k = kernels();
  TORCH_CHECK(!a.next_sample || ivon, "poco_kernels_cpp::step: next_sample is IVON's");
  if (skip_update(c, found_inf)) {      // AMP overflow or bad gradient: state unchanged
    if (a.next_sample) {                // the parameters get this step's inner sample back
      SampleArgs s{};
      s.param = a.param;
      s.pdtype = a.pdtype;
      s.centre = a.mean;
      s.mean = a.mean;
      s.h = a.s2;
      s.n = n;
      s.noise = Noise{(uint64_t)seed, u32(c[0], "step counter"), u32(stream, "stream"), 1.0f, nv,
                      base};
      s.ess = (float)hp.ess;
      s.wd = (float)hp.wd;
      s.mode = kSigmaIvon;
      s.sync = false;
      for_tiles(n, [&](int64_t t0, int64_t t1) { k.sample(s, t0, t1); });
    } else {                            // the old mean back
      for_tiles(n, [&](int64_t t0, int64_t t1) { k.write_params(a.param, a.pdtype, a.mean, n, t0, t1); });
    }
    return;
  }
  const int64_t steps = c[0];
  const int64_t t = steps + 1;
  const double lr = hp.lr, beta1 = hp.beta1, beta2 = hp.beta2, wd = hp.wd;
  const double alpha_eff = a.corr && c[1] > 0 ? hp.alpha : 0.0;
  a.seed = (uint64_t)seed;
  a.noise_version = nv;
  a.base = base;
  a.counter = u32(steps, "step counter");
  a.stream_in = u32(stream, "stream");
  a.stream_at_out = u32(stream_at_out, "stream_at_out");
  a.sign_at_out = (float)hp.sign_at_out;
  const float inv_gs = inv_scale(grad_scale);
  a.scale_in = (float)hp.inv_n_in * inv_gs;
  a.scale_at_out = (float)hp.inv_n_at_out * inv_gs;
  a.alpha = (float)alpha_eff;
  a.lr = (float)lr;
  a.beta1 = (float)beta1;
  a.one_m_beta1 = (float)(1.0 - beta1);
  a.beta2 = (float)beta2;
  a.one_m_beta2 = (float)(1.0 - beta2);
  a.half_sq_one_m_beta2 = (float)(0.5 * (1.0 - beta2) * (1.0 - beta2));
  a.wd = (float)wd;
  a.ess = (float)hp.ess;
  a.hess_corr_alpha = (float)(hp.hess_corr * alpha_eff);
  a.neg_floor = f.floor ? (float)(-hp.floor) : -kInf;
  a.clip = f.clip ? (float)hp.clip : kInf;
  a.inv_bias1 = f.debias ? (float)(1.0 / (1.0 - pow_steps(beta1, t))) : 1.0f;
  a.momentum = (float)hp.momentum;
  a.one_m_dampening = (float)(1.0 - hp.dampening);
  a.mom_first = hp.mom_first != 0.0;
  if (a.family == kFamilyAdamw) {
    const double bc1 = 1.0 - pow_steps(beta1, t), bc2 = 1.0 - pow_steps(beta2, t);
    a.decay = (float)(1.0 - lr * wd);
    a.step_size = (float)(lr / bc1);
    a.bias2_sqrt = (float)std::sqrt(bc2);
    a.eps = (float)hp.eps;
  }
  for_tiles(n, [&](int64_t t0, int64_t t1) { k.step(a, t0, t1); });
}

void refresh_op(const at::Tensor& mean, const c10::optional<at::Tensor>& h,
                const at::Tensor& acc_g, const c10::optional<at::Tensor>& acc_ge,
                const at::Tensor& g_out, const c10::optional<at::Tensor>& h_out,
                const at::Tensor& m_out, const c10::optional<at::Tensor>& sigma_out,
                const at::Tensor& ctl, const c10::optional<at::Tensor>& found_inf,
                const c10::optional<at::Tensor>& grad_scale, int64_t seed, int64_t noise, int64_t stream,
                const at::Tensor& hp_list, int64_t family, int64_t flag_bits, int64_t offset) {
  const uint32_t nv = noise_version(noise);
  const uint64_t base = base_of(offset);
  const int64_t n = mean.numel();
  const RefreshHyper hp = refresh_hyper(hp_list);
  const RefreshFlags f = refresh_flags(flag_bits);
  TORCH_CHECK(family >= kFamilyIvon && family <= kFamilyAdamw,
              "poco_kernels_cpp::refresh: invalid family ", family);
  const bool ivon = family == kFamilyIvon;
  RefreshArgs a{};
  a.mean = state_ptr(mean, n, "mean");
  a.h = state_ptr(h, n, "h", ivon);
  a.acc_g = state_ptr(acc_g, n, "acc_g");
  a.acc_ge = state_ptr(acc_ge, n, "acc_ge", ivon && f.ge);
  if (ivon) {          // each float32 or bfloat16 (LowBits)
    a.g_out = low_state_ptr(g_out, n, "g_out", true, a.low, kLowGOut);
    a.h_out = low_state_ptr(h_out, n, "h_out", true, a.low, kLowHOut);
    a.m_out = low_state_ptr(m_out, n, "m_out", true, a.low, kLowMOut);
    a.sigma_out = low_state_ptr(sigma_out, n, "sigma_out", true, a.low, kLowSigmaOut);
  } else {
    a.g_out = state_ptr(g_out, n, "g_out");
    a.m_out = state_ptr(m_out, n, "m_out");
  }
  const int64_t* c = ctl_ptr(ctl);
  if (skip_update(c, found_inf)) return;
  const int64_t refreshes = c[1];
  a.n = n;
  a.noise = Noise{(uint64_t)seed, u32(refreshes, "refresh counter"), u32(stream, "stream"), 1.0f, nv,
                  base};
  a.scale = (float)hp.inv_n * inv_scale(grad_scale);
  a.family = (int)family;
  a.ge = f.ge;
  a.noisy = f.noisy;
  a.first = refreshes == 0;
  a.ess = (float)hp.ess;
  a.wd = (float)hp.wd;
  a.rho1 = (float)hp.rho1;
  a.one_m_rho1 = (float)(1.0 - hp.rho1);
  a.rho2 = (float)hp.rho2;
  a.one_m_rho2 = (float)(1.0 - hp.rho2);
  a.sigma_const = (float)hp.sigma;
  const KernelTable& k = kernels();
  for_tiles(n, [&](int64_t t0, int64_t t1) { k.refresh(a, t0, t1); });
}

// After an update: advance the counter in `slot` unless the update was skipped, count
// skipped updates, clear the bad-gradient flag (= triton_kernels.finish_kernel).
void finish_op(const at::Tensor& ctl, const c10::optional<at::Tensor>& found_inf, int64_t slot) {
  int64_t* c = ctl_ptr(ctl);
  TORCH_CHECK(slot == 0 || slot == 1, "poco_kernels_cpp::finish: slot must be 0 or 1");
  const int64_t skip = skip_update(c, found_inf) ? 1 : 0;
  c[slot] += 1 - skip;
  c[3] += skip;
  c[2] = 0;
}

// out[j] = the normal of element index offset + j of stream (seed, counter, stream):
// poco_kernels.noise.randn, generated by the kernels' noise code.
void randn_op(const at::Tensor& out, int64_t seed, int64_t noise, int64_t counter, int64_t stream,
              int64_t offset) {
  const uint32_t nv = noise_version(noise);
  const int64_t n = out.numel();
  float* o = state_ptr(out, n, "out");
  TORCH_CHECK(offset >= 0, "poco_kernels_cpp::randn: offset must be >= 0");
  const Noise def{(uint64_t)seed, u32(counter, "counter"), u32(stream, "stream"), 1.0f, nv, 0};
  const KernelTable& k = kernels();
  for_tiles(n, [&](int64_t t0, int64_t t1) { k.randn(o, n, (uint64_t)offset, def, t0, t1); });
}

}  // namespace
}  // namespace poco

TORCH_LIBRARY(poco_kernels_cpp, m) {
  m.def("sample(Tensor(a!) param, Tensor centre, Tensor(b!) mean, Tensor? h, Tensor? sigma, "
        "Tensor ctl, int seed, int noise, int stream, int counter_slot, Tensor hp, float sign, "
        "int sigma_mode, bool sync, int offset=0) -> ()");
  m.def("accumulate(Tensor grad, Tensor(a!) acc_g, Tensor(b!)? acc_ge, Tensor(c!) ctl, "
        "int seed, int noise, int stream, int counter_slot, float sign, bool first, bool ge, "
        "int offset=0) -> ()");
  m.def("check(Tensor grad, Tensor(a!) ctl) -> ()");
  m.def("fold_ge(Tensor acc_g, Tensor(a!) acc_ge, Tensor ctl, int seed, int noise, int stream, "
        "int counter_slot, float sign, int offset=0) -> ()");
  m.def("step(Tensor(a!) mean, Tensor(b!) param, Tensor(c!)? s1, Tensor(d!)? s2, Tensor g_in, "
        "Tensor? ge_in, Tensor? g_at_out, Tensor? ge_at_out, Tensor? g_out, Tensor? h_out, "
        "Tensor? m_out, Tensor? sigma_out, Tensor ctl, Tensor? found_inf, "
        "Tensor? grad_scale, int seed, int noise, int stream, int stream_at_out, Tensor hp, "
        "int family, int flags, int offset=0) -> ()");
  m.def("refresh(Tensor mean, Tensor? h, Tensor acc_g, Tensor? acc_ge, Tensor(a!) g_out, "
        "Tensor(b!)? h_out, Tensor(c!) m_out, Tensor(d!)? sigma_out, Tensor ctl, "
        "Tensor? found_inf, Tensor? grad_scale, int seed, int noise, int stream, Tensor hp, int family, "
        "int flags, int offset=0) -> ()");
  m.def("finish(Tensor(a!) ctl, Tensor? found_inf, int slot) -> ()");
  m.def("randn(Tensor(a!) out, int seed, int noise, int counter, int stream, int offset) -> ()");
  m.def("isa() -> str", &poco::isa_op);
  m.def("supported_isas() -> str[]", &poco::supported_isas_op);
  m.def("set_isa(str name) -> str", &poco::set_isa_op);
}

TORCH_LIBRARY_IMPL(poco_kernels_cpp, CPU, m) {
  m.impl("sample", &poco::sample_op);
  m.impl("accumulate", &poco::accumulate_op);
  m.impl("check", &poco::check_op);
  m.impl("fold_ge", &poco::fold_ge_op);
  m.impl("step", &poco::step_op);
  m.impl("refresh", &poco::refresh_op);
  m.impl("finish", &poco::finish_op);
  m.impl("randn", &poco::randn_op);
}

// The Python module `poco_kernels._C` that loads this library: sweeps.cpp.
