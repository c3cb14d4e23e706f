// torch glue of the C++ kernels, the update operators: `poco_kernels_cpp::step` and
// `poco_kernels_cpp::refresh` (their schemas defined with the others in ops.cpp).  Each turns the
// hyperparameters into the float32 constants of the kernels (in double first, as the
// reference's Python floats are: the Triton kernels make the same constants the same way,
// poco_kernels/kernels/triton_common.py), handles a skipped update (AMP overflow, a bad
// gradient: nothing changes but the parameters handed back) and runs the kernels' tiles.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>

#include "ops_common.h"

namespace poco {
namespace {


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

}  // namespace
}  // namespace poco

TORCH_LIBRARY_IMPL(poco_kernels_cpp, CPU, m) {
  m.impl("step", &poco::step_op);
  m.impl("refresh", &poco::refresh_op);
}
