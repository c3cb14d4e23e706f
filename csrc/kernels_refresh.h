// The refreshes (IVON family, SGD family) and the parameters written from the mean.
// Part of the C++ kernels: included by kernels_impl.h inside its per-instruction-set
// namespace (POCO_ISA) and anonymous namespace, after its tile helpers; not a
// header to include anywhere else.

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
