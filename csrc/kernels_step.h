// The steps: IVON family (with the correction and the next sample), SGD family, AdamW.
// Part of the C++ kernels: included by kernels_impl.h inside its per-instruction-set
// namespace (POCO_ISA) and anonymous namespace, after its tile helpers; not a
// header to include anywhere else.

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
