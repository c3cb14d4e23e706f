// The C++ kernels, compiled once per instruction set by kernels_<isa>.cpp, which define
// POCO_ISA (the namespace) and POCO_TABLE (the KernelTable) before including this file.
//
// Each kernel is the CPU twin of a Triton kernel of poco_kernels/kernels/triton_kernels.py
// and fuses the same reference functions (poco_kernels/reference.py), named in its
// comment; tests/kernels/test_kernels.py checks both against them.  Per tile of kTile elements:
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

// ------------------------------------------------------------------ sample
// Reference: perturb, ivon_sigma.  SYNC: the parameters hold the mean (float32
// parameters, torch.optim convention): copy it to the mean buffer first; it is the centre.
template <typename PT, int MODE, bool SYNC, bool LOW = false>
void sample_impl(const SampleArgs& a, int64_t t0, int64_t t1) {
  static_assert(!LOW || (MODE == kSigmaBuffer && !SYNC), "a bfloat16 centre is the outer sample's");
  const PhiloxKey key(a.noise.seed, a.noise.version);
  alignas(64) float eps[kTile];
  alignas(64) float low_centre[LOW ? kTile : 1], low_sigma[LOW ? kTile : 1];
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t i0 = t * kTile, len = tile_len(t, a.n);
    if (MODE != kSigmaNone) {
      auto prefetch = [&](int64_t j) {
        const int64_t i = i0 + j;
        pf_w((PT*)a.param + i);
        if (LOW) {
          pf_r((const uint16_t*)a.centre + i);
          pf_r((const uint16_t*)a.sigma + i);
        } else {
          if (SYNC) pf_w(a.mean + i); else pf_r(a.centre + i);
          if (MODE == kSigmaIvon) pf_r(a.h + i);
          if (MODE == kSigmaBuffer) pf_r(a.sigma + i);
        }
      };
      noise_tile(eps, len, a.noise.base + (uint64_t)i0, key, a.noise.counter, a.noise.stream, a.noise.sign,
                 prefetch);
    }
    if (LOW) {       // widen the tile's bfloat16 centre and sigma into L1 first
      load_bf16(low_centre, (const uint16_t*)a.centre + i0, len);
      load_bf16(low_sigma, (const uint16_t*)a.sigma + i0, len);
    }
    PT* __restrict p = (PT*)a.param + i0;
    const float* __restrict centre = LOW ? low_centre : a.centre + i0;
    float* __restrict mean = a.mean + i0;
    const float* __restrict h = a.h + i0;
    const float* __restrict sig = LOW ? low_sigma : a.sigma + i0;
    const float ess = a.ess, wd = a.wd, sigma_const = a.sigma_const;
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) {
      float c;
      if (SYNC) {
        c = to_f32(p[j]);
        mean[j] = c;
      } else {
        c = centre[j];
      }
      float theta = c;
      if (MODE != kSigmaNone) {
        float sigma;
        if (MODE == kSigmaIvon) sigma = 1.0f / __builtin_sqrtf(ess * (h[j] + wd));
        else if (MODE == kSigmaBuffer) sigma = sig[j];
        else sigma = sigma_const;
        theta = c + sigma * eps[j];
      }
      p[j] = from_f32<PT>(theta);
    }
  }
}

template <typename PT>
void sample_pt(const SampleArgs& a, int64_t t0, int64_t t1) {
  if (a.low) return sample_impl<PT, kSigmaBuffer, false, true>(a, t0, t1);
  switch (a.mode * 2 + (a.sync ? 1 : 0)) {
    case kSigmaNone * 2: return sample_impl<PT, kSigmaNone, false>(a, t0, t1);
    case kSigmaNone * 2 + 1: return sample_impl<PT, kSigmaNone, true>(a, t0, t1);
    case kSigmaIvon * 2: return sample_impl<PT, kSigmaIvon, false>(a, t0, t1);
    case kSigmaIvon * 2 + 1: return sample_impl<PT, kSigmaIvon, true>(a, t0, t1);
    case kSigmaBuffer * 2: return sample_impl<PT, kSigmaBuffer, false>(a, t0, t1);
    case kSigmaBuffer * 2 + 1: return sample_impl<PT, kSigmaBuffer, true>(a, t0, t1);
    case kSigmaConst * 2: return sample_impl<PT, kSigmaConst, false>(a, t0, t1);
    default: return sample_impl<PT, kSigmaConst, true>(a, t0, t1);
  }
}

// ------------------------------------------------------------------ accumulate
// acc_g (+)= g; with GE also acc_ge += g * eps of the active draw.  Returns whether a
// gradient element was inf or NaN.
template <typename PT, bool FIRST, bool GE>
bool accumulate_impl(const AccumulateArgs& a, int64_t t0, int64_t t1) {
  const PhiloxKey key(a.noise.seed, a.noise.version);
  alignas(64) float eps[kTile];
  uint32_t bad = 0;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t i0 = t * kTile, len = tile_len(t, a.n);
    if (GE) {
      auto prefetch = [&](int64_t j) {
        pf_r((const PT*)a.grad + i0 + j);
        pf_w(a.acc_g + i0 + j);
        pf_w(a.acc_ge + i0 + j);
      };
      noise_tile(eps, len, a.noise.base + (uint64_t)i0, key, a.noise.counter, a.noise.stream, a.noise.sign,
                 prefetch);
    }
    const PT* __restrict grad = (const PT*)a.grad + i0;
    float* __restrict acc_g = a.acc_g + i0;
    float* __restrict acc_ge = a.acc_ge + i0;
#pragma omp simd reduction(| : bad)
    for (int64_t j = 0; j < len; ++j) {
      const float g = to_f32(grad[j]);
      bad |= (uint32_t)((f2u(g) & 0x7F800000u) == 0x7F800000u);
      acc_g[j] = FIRST ? g : acc_g[j] + g;
      if (GE) acc_ge[j] = acc_ge[j] + g * eps[j];
    }
  }
  return bad != 0;
}

template <typename PT>
bool accumulate_pt(const AccumulateArgs& a, int64_t t0, int64_t t1) {
  if (a.first) return a.ge ? accumulate_impl<PT, true, true>(a, t0, t1)
                           : accumulate_impl<PT, true, false>(a, t0, t1);
  return a.ge ? accumulate_impl<PT, false, true>(a, t0, t1)
              : accumulate_impl<PT, false, false>(a, t0, t1);
}

// ------------------------------------------------------------------ check
// Whether a gradient element is inf or NaN (a gradient buffer adopted as its own sum:
// read only).
template <typename PT>
bool check_pt(const void* grad, int64_t n, int64_t t0, int64_t t1) {
  uint32_t bad = 0;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t i0 = t * kTile, len = tile_len(t, n);
    const PT* __restrict g = (const PT*)grad + i0;
#pragma omp simd reduction(| : bad)
    for (int64_t j = 0; j < len; ++j)
      bad |= (uint32_t)((f2u(to_f32(g[j])) & 0x7F800000u) == 0x7F800000u);
  }
  return bad != 0;
}

// ------------------------------------------------------------------ fold_ge
// acc_ge = acc_g * eps of draw 0 (when a second draw of a kind starts).
void fold_ge_impl(const FoldArgs& a, int64_t t0, int64_t t1) {
  const PhiloxKey key(a.noise.seed, a.noise.version);
  alignas(64) float eps[kTile];
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t i0 = t * kTile, len = tile_len(t, a.n);
    auto prefetch = [&](int64_t j) {
      pf_r(a.acc_g + i0 + j);
      pf_w(a.acc_ge + i0 + j);
    };
    noise_tile(eps, len, a.noise.base + (uint64_t)i0, key, a.noise.counter, a.noise.stream, a.noise.sign,
               prefetch);
    const float* __restrict acc_g = a.acc_g + i0;
    float* __restrict acc_ge = a.acc_ge + i0;
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) acc_ge[j] = acc_g[j] * eps[j];
  }
}

// ------------------------------------------------------------------ step
// Per tile, the products g * eps of the inner and the outer sample that the Price
// estimates divide by sigma: formed from the regenerated noise (one draw), or the summed
// products of several draws, scaled.  Staged in L1 so the main pass reads them
// unconditionally (a select on a flag would keep it from vectorising).
struct StepTile {
  alignas(64) float eps[kTile];
  // the tile's bfloat16 buffers (LowBits) widened (and the new momentum, rounded back
  // after the pass)
  alignas(64) float s1[kTile];
  alignas(64) float g_out[kTile];
  alignas(64) float h_out[kTile];
  alignas(64) float m_out[kTile];
  alignas(64) float sigma_out[kTile];
  alignas(64) float eps_next[kTile];    // the next inner sample's noise (next_sample)
  alignas(64) float ge_in[kTile];
  alignas(64) float ge_at_out[kTile];
};

POCO_INLINE void scaled_copy(float* __restrict dst, const float* __restrict src, float s,
                             int64_t len) {
#pragma omp simd
  for (int64_t j = 0; j < len; ++j) dst[j] = src[j] * s;
}

// dst = (g * s) * e  (the gradient estimate times its noise)
POCO_INLINE void ge_product(float* __restrict dst, const float* __restrict g, float s,
                            const float* __restrict e, float sign, int64_t len) {
#pragma omp simd
  for (int64_t j = 0; j < len; ++j) dst[j] = (g[j] * s) * (e[j] * sign);
}

// Prefetch of the cache lines of elements [j, j + kLanes) of a tile of the IVON step's
// streams (kLanes floats = one 64-byte line with AVX-512).
template <typename PT>
struct StepPrefetch {
  const StepArgs& a;
  int64_t i0;
  POCO_INLINE void operator()(int64_t j) const {
    const int64_t i = i0 + j;
    pf_w(a.mean + i);
    pf_w(a.s2 + i);
    pf_w((const PT*)a.param + i);
    pf_r(a.g_in + i);
    if (a.corr) pf_r(a.g_at_out + i);
    // each state buffer as it is stored: float32 or bfloat16 (LowBits)
    auto pf_state = [&](const float* p, uint32_t bit, bool write) {
      if (a.low & bit) {
        if (write) pf_w((const uint16_t*)p + i); else pf_r((const uint16_t*)p + i);
      } else {
        if (write) pf_w(p + i); else pf_r(p + i);
      }
    };
    pf_state(a.s1, kLowS1, true);
    if (a.corr) {
      pf_state(a.g_out, kLowGOut, false);
      pf_state(a.h_out, kLowHOut, false);
      pf_state(a.sigma_out, kLowSigmaOut, false);
      if (a.hess_corr_on) pf_state(a.m_out, kLowMOut, false);
    }
  }
};

template <typename PT>
POCO_INLINE void step_prelude(const StepArgs& a, const PhiloxKey& key, int64_t i0, int64_t len,
                              StepTile& st) {
  if (a.ge_in_sum) {
    scaled_copy(st.ge_in, a.ge_in + i0, a.scale_in, len);
  } else {
    noise_tile(st.eps, len, a.base + (uint64_t)i0, key, a.counter, a.stream_in, 1.0f,
               StepPrefetch<PT>{a, i0});
    ge_product(st.ge_in, a.g_in + i0, a.scale_in, st.eps, 1.0f, len);
  }
  if (!a.corr) return;
  if (a.ge_at_out_sum) {
    scaled_copy(st.ge_at_out, a.ge_at_out + i0, a.scale_at_out, len);
  } else {
    if (!a.shared_noise)      // (shared: the inner draw's eps, still in st.eps)
      noise_tile(st.eps, len, a.base + (uint64_t)i0, key, a.counter, a.stream_at_out, 1.0f);
    ge_product(st.ge_at_out, a.g_at_out + i0, a.scale_at_out, st.eps, a.sign_at_out, len);
  }
}

// IVON, IVON-PoCo(Mo).  Reference: ivon_sigma, price_hessian, control_variate,
// hessian_floor, ivon_momentum, ivon_hessian, ivon_direction, ivon_hessian_correction,
// ivon_mean (lr already ivon_lr).  Two divisions of the reference are multiplications
// here (g eps / sigma = g eps sqrt(ess (h + wd)); g / (1 - beta1^t) by its reciprocal):
// within an ulp, and the divider is what this pass waits for on the CPU.
template <typename PT, bool CORR, bool HC, bool NEXT, bool LOW>
void step_ivon(const StepArgs& a, int64_t t0, int64_t t1) {
  const PhiloxKey key(a.seed, a.noise_version);
  StepTile st;
  const float alpha = a.alpha, lr = a.lr, beta1 = a.beta1, one_m_beta1 = a.one_m_beta1;
  const float beta2 = a.beta2, one_m_beta2 = a.one_m_beta2, half_sq = a.half_sq_one_m_beta2;
  const float wd = a.wd, ess = a.ess, hca = a.hess_corr_alpha, neg_floor = a.neg_floor;
  const float clip = a.clip, inv_bias1 = a.inv_bias1, scale_in = a.scale_in;
  const float scale_at_out = a.scale_at_out;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t i0 = t * kTile, len = tile_len(t, a.n);
    step_prelude<PT>(a, key, i0, len, st);
    if (NEXT)      // the next step's inner sample: draw 0 of the inner stream, counter + 1
      noise_tile(st.eps_next, len, a.base + (uint64_t)i0, key, a.counter + 1u, a.stream_in, 1.0f);
    // a bfloat16 buffer (LowBits) is widened into the tile and read from there
    auto widened = [&](float* tile, const float* buf, uint32_t bit, bool used) -> float* {
      if (!LOW || !(a.low & bit)) return const_cast<float*>(buf) + i0;
      if (used) load_bf16(tile, (const uint16_t*)buf + i0, len);
      return tile;
    };
    const float* __restrict eps_next = st.eps_next;
    float* __restrict mean = a.mean + i0;
    PT* __restrict param = (PT*)a.param + i0;
    float* __restrict gm = widened(st.s1, a.s1, kLowS1, true);
    float* __restrict hh = a.s2 + i0;
    const float* __restrict g_in_p = a.g_in + i0;
    const float* __restrict g_at_out_p = a.g_at_out + i0;
    const float* __restrict g_out = widened(st.g_out, a.g_out, kLowGOut, CORR);
    const float* __restrict h_out = widened(st.h_out, a.h_out, kLowHOut, CORR);
    const float* __restrict m_out = widened(st.m_out, a.m_out, kLowMOut, CORR && HC);
    const float* __restrict sigma_out = widened(st.sigma_out, a.sigma_out, kLowSigmaOut, CORR);
    const float* __restrict ge_in_t = st.ge_in;
    const float* __restrict ge_at_out_t = st.ge_at_out;
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) {
      const float m = mean[j];
      const float g_in = g_in_p[j] * scale_in;
      const float g = gm[j], h = hh[j];
      const float inv_sigma = __builtin_sqrtf(ess * (h + wd));    // 1 / sigma, unrounded
      float ghat = g_in;
      float hhat = ge_in_t[j] * inv_sigma;
      float extra = 0.0f;
      if (CORR) {
        const float g_at_out = g_at_out_p[j] * scale_at_out;
        ghat = g_in - alpha * (g_at_out - g_out[j]);
        const float h_at_out = ge_at_out_t[j] / sigma_out[j];
        hhat = hhat - alpha * (h_at_out - h_out[j]);
        const float fl = neg_floor * (h + wd);     // -inf without a floor: a no-op
        hhat = hhat < fl ? fl : hhat;
        if (HC) extra = hca * (h_out[j] - h_at_out) * (m - m_out[j]);
      }
      const float g_new = beta1 * g + one_m_beta1 * ghat;
      const float d = h - hhat;
      const float h_new = (beta2 * h + one_m_beta2 * hhat) + half_sq * (d * d) / (h + wd);
      float num = g_new * inv_bias1 + wd * m;
      if (HC) num = num + extra;
      float u = num / (h_new + wd);
      u = u < -clip ? -clip : (u > clip ? clip : u);   // clip = inf without clipping
      const float m_new = m - lr * u;
      gm[j] = g_new;
      hh[j] = h_new;
      mean[j] = m_new;
      if (NEXT) {    // as sample_impl<PT, kSigmaIvon> computes it from the new m and h
        const float sigma = 1.0f / __builtin_sqrtf(ess * (h_new + wd));
        param[j] = from_f32<PT>(m_new + sigma * eps_next[j]);
      } else {
        param[j] = from_f32<PT>(m_new);
      }
    }
    if (LOW && (a.low & kLowS1))
      store_sr((uint16_t*)a.s1 + i0, st.s1, len, a.base + (uint64_t)i0, a.seed, a.counter, a.stream_in >> 16,
               kTagMomentum);
  }
}

// SVRG, alpha-SVRG, VSGD-PoCo.  Reference: control_variate, sgd_step.
template <typename PT, bool CORR, bool MOM>
void step_sgd(const StepArgs& a, int64_t t0, int64_t t1) {
  const float alpha = a.alpha, lr = a.lr, wd = a.wd, momentum = a.momentum;
  const float one_m_damp = a.one_m_dampening, scale_in = a.scale_in, scale_at_out = a.scale_at_out;
  const bool first = a.mom_first, nesterov = a.nesterov;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t i0 = t * kTile, len = tile_len(t, a.n);
    float* __restrict mean = a.mean + i0;
    PT* __restrict param = (PT*)a.param + i0;
    float* __restrict buf = a.s1 + i0;
    const float* __restrict g_in_p = a.g_in + i0;
    const float* __restrict g_at_out_p = a.g_at_out + i0;
    const float* __restrict g_out = a.g_out + i0;
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) {
      const float m = mean[j];
      const float g_in = g_in_p[j] * scale_in;
      const float ghat = CORR ? g_in - alpha * (g_at_out_p[j] * scale_at_out - g_out[j]) : g_in;
      float d_p = ghat + wd * m;
      if (MOM) {
        const float b = first ? d_p : momentum * buf[j] + one_m_damp * d_p;
        buf[j] = b;
        d_p = nesterov ? d_p + momentum * b : b;
      }
      const float m_new = m - lr * d_p;
      mean[j] = m_new;
      param[j] = from_f32<PT>(m_new);
    }
  }
}

// alpha-SVRG over AdamW.  Reference: control_variate, adamw_step.
template <typename PT, bool CORR>
void step_adamw(const StepArgs& a, int64_t t0, int64_t t1) {
  const float alpha = a.alpha, beta2 = a.beta2, one_m_beta1 = a.one_m_beta1;
  const float one_m_beta2 = a.one_m_beta2, decay = a.decay, step_size = a.step_size;
  const float bias2_sqrt = a.bias2_sqrt, eps = a.eps, scale_in = a.scale_in;
  const float scale_at_out = a.scale_at_out;
  const bool lerp_low = one_m_beta1 < 0.5f;          // torch.lerp's two formulas
  const float one_m_w = 1.0f - one_m_beta1;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t i0 = t * kTile, len = tile_len(t, a.n);
    float* __restrict mean = a.mean + i0;
    PT* __restrict param = (PT*)a.param + i0;
    float* __restrict ea_p = a.s1 + i0;
    float* __restrict eas_p = a.s2 + i0;
    const float* __restrict g_in_p = a.g_in + i0;
    const float* __restrict g_at_out_p = a.g_at_out + i0;
    const float* __restrict g_out = a.g_out + i0;
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) {
      const float m = mean[j];
      const float g_in = g_in_p[j] * scale_in;
      const float ghat = CORR ? g_in - alpha * (g_at_out_p[j] * scale_at_out - g_out[j]) : g_in;
      const float m_dec = m * decay;
      const float ea0 = ea_p[j];
      const float ea = lerp_low ? ea0 + one_m_beta1 * (ghat - ea0) : ghat - (ghat - ea0) * one_m_w;
      const float eas = eas_p[j] * beta2 + one_m_beta2 * ghat * ghat;
      const float denom = __builtin_sqrtf(eas) / bias2_sqrt + eps;
      const float m_new = m_dec - step_size * (ea / denom);
      ea_p[j] = ea;
      eas_p[j] = eas;
      mean[j] = m_new;
      param[j] = from_f32<PT>(m_new);
    }
  }
}

template <typename PT, bool LOW>
void step_ivon_low(const StepArgs& a, int64_t t0, int64_t t1) {
  if (a.next_sample) {
    if (!a.corr) return step_ivon<PT, false, false, true, LOW>(a, t0, t1);
    return a.hess_corr_on ? step_ivon<PT, true, true, true, LOW>(a, t0, t1)
                          : step_ivon<PT, true, false, true, LOW>(a, t0, t1);
  }
  if (!a.corr) return step_ivon<PT, false, false, false, LOW>(a, t0, t1);
  return a.hess_corr_on ? step_ivon<PT, true, true, false, LOW>(a, t0, t1)
                        : step_ivon<PT, true, false, false, LOW>(a, t0, t1);
}

template <typename PT>
void step_pt(const StepArgs& a, int64_t t0, int64_t t1) {
  if (a.family == kFamilyIvon)
    return a.low ? step_ivon_low<PT, true>(a, t0, t1) : step_ivon_low<PT, false>(a, t0, t1);
  if (a.family == kFamilySgd) {
    if (a.corr) return a.momentum_on ? step_sgd<PT, true, true>(a, t0, t1)
                                     : step_sgd<PT, true, false>(a, t0, t1);
    return a.momentum_on ? step_sgd<PT, false, true>(a, t0, t1)
                         : step_sgd<PT, false, false>(a, t0, t1);
  }
  return a.corr ? step_adamw<PT, true>(a, t0, t1) : step_adamw<PT, false>(a, t0, t1);
}

// ------------------------------------------------------------------ refresh
// The LowBits of g_out, h_out, m_out, sigma_out (in that order).
constexpr uint32_t kOutBits[4] = {kLowGOut, kLowHOut, kLowMOut, kLowSigmaOut};

// IVON family: the mega-batch gradient and its Price Hessian folded into the outer
// estimates with outer momentum (the first refresh takes them as they are), snapshot of
// the outer posterior.  Reference: ivon_sigma, price_hessian, outer_fold.
template <bool GE, bool LOW>
void refresh_ivon(const RefreshArgs& a, int64_t t0, int64_t t1) {
  const PhiloxKey key(a.noise.seed, a.noise.version);
  alignas(64) float eps[kTile];
  // the bfloat16 outer buffers of the tile in float32, rounded back after the pass
  alignas(64) float low[4][LOW ? kTile : 1];
  const float ess = a.ess, wd = a.wd, scale = a.scale;
  const float rho1 = a.rho1, one_m_rho1 = a.one_m_rho1, rho2 = a.rho2, one_m_rho2 = a.one_m_rho2;
  const bool keep_g = a.first || rho1 == 0.0f, keep_h = a.first || rho2 == 0.0f;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t i0 = t * kTile, len = tile_len(t, a.n);
    if (!GE) {
      auto prefetch = [&](int64_t j) {
        const int64_t i = i0 + j;
        pf_r(a.mean + i);
        pf_r(a.h + i);
        pf_r(a.acc_g + i);
        const float* const outs[4] = {a.g_out, a.h_out, a.m_out, a.sigma_out};
        for (int k = 0; k < 4; ++k) {
          if (LOW && (a.low & kOutBits[k])) pf_w((const uint16_t*)outs[k] + i);
          else pf_w(outs[k] + i);
        }
      };
      noise_tile(eps, len, a.noise.base + (uint64_t)i0, key, a.noise.counter, a.noise.stream, 1.0f, prefetch);
    }
    // a bfloat16 buffer (LowBits) is computed in the tile (the estimates widened into it
    // first: the outer momentum reads them) and rounded back after the pass
    float* const outs[4] = {a.g_out, a.h_out, a.m_out, a.sigma_out};
    float* tiles[4];
    for (int k = 0; k < 4; ++k) {
      const bool lo = LOW && (a.low & kOutBits[k]);
      if (lo && k < 2) load_bf16(low[k], (const uint16_t*)outs[k] + i0, len);
      tiles[k] = lo ? low[k] : outs[k] + i0;
    }
    const float* __restrict mean = a.mean + i0;
    const float* __restrict hh = a.h + i0;
    const float* __restrict acc_g = a.acc_g + i0;
    const float* __restrict acc_ge = a.acc_ge + i0;
    float* __restrict g_out = tiles[0];
    float* __restrict h_out = tiles[1];
    float* __restrict m_out = tiles[2];
    float* __restrict sigma_out = tiles[3];
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) {
      const float gM = acc_g[j] * scale;
      const float sigma = 1.0f / __builtin_sqrtf(ess * (hh[j] + wd));
      const float geM = GE ? acc_ge[j] * scale : gM * eps[j];
      const float hM = geM / sigma;
      const float g_new = keep_g ? gM : rho1 * g_out[j] + one_m_rho1 * gM;
      const float h_new = keep_h ? hM : rho2 * h_out[j] + one_m_rho2 * hM;
      g_out[j] = g_new;
      h_out[j] = h_new;
      m_out[j] = mean[j];
      sigma_out[j] = sigma;
    }
    if (LOW) {
      const uint32_t bucket = a.noise.stream >> 16;
      const uint32_t tags[4] = {kTagGOut, kTagHOut, kTagMOut, kTagSigmaOut};
      for (int k = 0; k < 4; ++k)
        if (a.low & kOutBits[k])
          store_sr((uint16_t*)outs[k] + i0, low[k], len, a.noise.base + (uint64_t)i0,
                   a.noise.seed, a.noise.counter, bucket, tags[k]);
    }
  }
}

// First-order family: g_out = gM and the refresh point theta_out = m (+ sigma eps).
// Reference: perturb.
template <bool NOISY>
void refresh_sgd(const RefreshArgs& a, int64_t t0, int64_t t1) {
  const PhiloxKey key(a.noise.seed, a.noise.version);
  alignas(64) float eps[kTile];
  const float scale = a.scale, sigma = a.sigma_const;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t i0 = t * kTile, len = tile_len(t, a.n);
    if (NOISY) {
      auto prefetch = [&](int64_t j) {
        const int64_t i = i0 + j;
        pf_r(a.mean + i);
        pf_r(a.acc_g + i);
        pf_w(a.g_out + i);
        pf_w(a.m_out + i);
      };
      noise_tile(eps, len, a.noise.base + (uint64_t)i0, key, a.noise.counter, a.noise.stream, 1.0f, prefetch);
    }
    const float* __restrict mean = a.mean + i0;
    const float* __restrict acc_g = a.acc_g + i0;
    float* __restrict g_out = a.g_out + i0;
    float* __restrict m_out = a.m_out + i0;
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) {
      g_out[j] = acc_g[j] * scale;
      m_out[j] = NOISY ? mean[j] + sigma * eps[j] : mean[j];
    }
  }
}

// ------------------------------------------------------------------ misc
template <typename PT>
void write_params_pt(void* param, const float* mean, int64_t n, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t i0 = t * kTile, len = tile_len(t, n);
    PT* __restrict p = (PT*)param + i0;
    const float* __restrict m = mean + i0;
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) p[j] = from_f32<PT>(m[j]);
  }
}

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
