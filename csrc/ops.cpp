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
// This file: the instruction set's choice, the operators but the updates (ops_update.cpp:
// step, refresh, registered there), and the schemas of all of them; ops_common.h: the
// checks and readers both files share.
//
// Registered with TORCH_LIBRARY, so torch.compile (with the fake kernels registered in
// poco_kernels/kernels/cpp_ops.py) and serialisation see them as operators.
#include <Python.h>

#include <ATen/ATen.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <vector>

#include "ops_common.h"

namespace poco {
namespace {

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

}  // namespace

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

namespace {

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

// step and refresh: ops_update.cpp
TORCH_LIBRARY_IMPL(poco_kernels_cpp, CPU, m) {
  m.impl("sample", &poco::sample_op);
  m.impl("accumulate", &poco::accumulate_op);
  m.impl("check", &poco::check_op);
  m.impl("fold_ge", &poco::fold_ge_op);
  m.impl("finish", &poco::finish_op);
  m.impl("randn", &poco::randn_op);
}

// The Python module `poco_kernels._C` that loads this library: sweeps.cpp.
