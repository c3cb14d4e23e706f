// The sample, the gradient accumulation, the finiteness check and fold_ge.
// Part of the C++ kernels: included by kernels_impl.h inside its per-instruction-set
// namespace (POCO_ISA) and anonymous namespace, after its tile helpers; not a
// header to include anywhere else.

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
