// Element-wise maths of the C++ kernels: the counter-based normal noise (the conversions
// between float32 and the parameter dtypes, and the stochastic rounding of bfloat16
// state, are poco_dtypes.h).
//
// Everything here is a branch-free scalar function on 32-bit lanes, written so that a
// `#pragma omp simd` loop over elements vectorises it (selects instead of branches, no
// library calls: the compiler cannot vectorise glibc's logf/cosf without -ffast-math,
// which the kernels must not use since they test for NaN and inf).
//
// Noise: exactly poco_kernels/noise.py (and the Triton kernels' `_noise`):
//   Philox4x32-10 keyed by the 64-bit seed, counters (call low word, call high word,
//   counter, stream), uniforms by `uint_to_uniform_float`, Box-Muller.  Version 2 (the
//   default): element i is lane i mod 4 of call i div 4, both branches of both word
//   pairs (tl.randn4x).  Version 1 (old checkpoints): call i, the cosine branch of the
//   first pair (tl.randn).  The Philox words and the uniforms are bit-identical to
//   Triton's; log, cos and sin are our own polynomials (about one float32 ulp), so the
//   normals agree with torch/numpy/libdevice to float rounding.
//
// Included by kernels_impl.h inside the namespace of one instruction set (each ISA gets
// its own copy of these inline functions): no includes and no namespace here.
#pragma once

#define POCO_INLINE inline __attribute__((always_inline))

POCO_INLINE uint32_t f2u(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
POCO_INLINE float u2f(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// ------------------------------------------------------------------ Philox4x32-10
constexpr uint32_t kPhiloxKeyA = 0x9E3779B9u;    // key bump of k0
constexpr uint32_t kPhiloxKeyB = 0xBB67AE85u;    // key bump of k1
constexpr uint32_t kPhiloxRoundA = 0xD2511F53u;  // multiplies c0
constexpr uint32_t kPhiloxRoundB = 0xCD9E8D57u;  // multiplies c2

// The round keys of a 64-bit seed: k0 = low word, k1 = high word, bumped every round;
// and the stream definition (noise version 1 or 2) the keyed noise follows.
struct PhiloxKey {
  uint32_t k0[10], k1[10];
  uint32_t version;
  PhiloxKey(uint64_t seed, uint32_t version_) : version(version_) {
    uint32_t a = (uint32_t)seed, b = (uint32_t)(seed >> 32);
    for (int r = 0; r < 10; ++r) {
      k0[r] = a;
      k1[r] = b;
      a += kPhiloxKeyA;
      b += kPhiloxKeyB;
    }
  }
};

// The first two output words of Philox4x32-10 (all that the normal transform needs).
POCO_INLINE void philox2(const PhiloxKey& key, uint32_t c0, uint32_t c1, uint32_t c2,
                         uint32_t c3, uint32_t& o0, uint32_t& o1) {
#pragma GCC unroll 10
  for (int r = 0; r < 10; ++r) {
    const uint64_t pb = (uint64_t)kPhiloxRoundB * c2;   // 32 x 32 -> 64 bits
    const uint64_t pa = (uint64_t)kPhiloxRoundA * c0;
    const uint32_t n0 = (uint32_t)(pb >> 32) ^ c1 ^ key.k0[r];
    const uint32_t n2 = (uint32_t)(pa >> 32) ^ c3 ^ key.k1[r];
    c1 = (uint32_t)pb;
    c3 = (uint32_t)pa;
    c0 = n0;
    c2 = n2;
  }
  o0 = c0;
  o1 = c1;
}

// All four output words.
POCO_INLINE void philox4(const PhiloxKey& key, uint32_t c0, uint32_t c1, uint32_t c2,
                         uint32_t c3, uint32_t* o) {
#pragma GCC unroll 10
  for (int r = 0; r < 10; ++r) {
    const uint64_t pb = (uint64_t)kPhiloxRoundB * c2;
    const uint64_t pa = (uint64_t)kPhiloxRoundA * c0;
    const uint32_t n0 = (uint32_t)(pb >> 32) ^ c1 ^ key.k0[r];
    const uint32_t n2 = (uint32_t)(pa >> 32) ^ c3 ^ key.k1[r];
    c1 = (uint32_t)pb;
    c3 = (uint32_t)pa;
    c0 = n0;
    c2 = n2;
  }
  o[0] = c0;
  o[1] = c1;
  o[2] = c2;
  o[3] = c3;
}

// tl.uint_to_uniform_float: read as int32, fold negatives (x -> -x - 1), scale.
POCO_INLINE float uniform01(uint32_t x) {
  const uint32_t folded = x ^ (uint32_t)((int32_t)x >> 31);   // in [0, 2**31)
  return (float)(int32_t)folded * 4.6566127342e-10f;
}

// ------------------------------------------------------------------ log and cos
// log(x) for positive normal x (the Box-Muller argument is in [1e-7, 1]).
// x = 2^k (1 + f), 1 + f in [sqrt(1/2), sqrt(2)); log(1 + f) = 2 atanh(s), s = f / (2 + f),
// written as f - s (f - R(z)), z = s^2, R = 2z/3 + 2z^2/5 + 2z^3/7 + 2z^4/9 (|z| < 0.0295:
// the next term is below 1e-9 relative); k ln2 in two parts so k * ln2_hi is exact.
POCO_INLINE float log_pos(float x) {
  uint32_t ix = f2u(x);
  // 0x3f3504f3 = sqrt(1/2): shift the exponent boundary so the mantissa lands around 1
  ix += 0x3F800000u - 0x3F3504F3u;
  const int32_t k = (int32_t)(ix >> 23) - 0x7F;
  const float f = u2f((ix & 0x007FFFFFu) + 0x3F3504F3u) - 1.0f;   // exact (Sterbenz)
  const float s = f / (2.0f + f);
  const float z = s * s;
  const float R = z * (0.66666666666f + z * (0.4f + z * (0.28571428571f + z * 0.22222222222f)));
  const float log1pf = f - s * (f - R);
  const float kf = (float)k;
  return kf * 0.6923828125f + (kf * 7.6436804e-4f + log1pf);
}

// cos(x) and sin(x) for x in [0, 2 pi] (the Box-Muller angle): x = q pi/2 + r,
// |r| <= pi/4, with pi/2 in three parts (q * C1 exact); then +-cos r or +-sin r by the
// quadrant q mod 4: cos(q pi/2 + r) = c, -s, -c, s and sin = s, c, -s, -c for q = 0..3.
// Taylor polynomials to r^11 (sin) and r^10 (cos): truncation below 0.1 ulp on |r| <= pi/4.
POCO_INLINE void sincos_0_2pi(float x, float& cos_x, float& sin_x) {
  const float q = __builtin_rintf(x * 0.63661975f);
  const float r = ((x - q * 1.5703125f) - q * 4.8375130e-4f) - q * 7.5497901e-8f;
  const float r2 = r * r;
  const float c = 1.0f + r2 * (-0.5f + r2 * (4.1666667e-2f + r2 * (-1.3888889e-3f +
                  r2 * (2.4801587e-5f + r2 * -2.7557319e-7f))));
  const float s = r + r * r2 * (-0.16666667f + r2 * (8.3333333e-3f + r2 * (-1.9841270e-4f +
                  r2 * (2.7557319e-6f + r2 * -2.5052108e-8f))));
  const int32_t qi = (int32_t)q;
  const bool odd = (qi & 1) != 0;
  const float vc = odd ? s : c, vs = odd ? c : s;
  cos_x = ((qi + 1) & 2) ? -vc : vc;                 // q = 1, 2 (mod 4): negated
  sin_x = (qi & 2) ? -vs : vs;                       // q = 2, 3 (mod 4): negated
}

// cos(x) for x in [0, 2 pi] (version 1's branch): the cosine of sincos_0_2pi (the sine's
// polynomial is dead code once inlined).
POCO_INLINE float cos_0_2pi(float x) {
  float c, s;
  sincos_0_2pi(x, c, s);
  return c;
}

// Box-Muller of one word pair, both branches, times `sign` (+-1: exact), version 2.
POCO_INLINE void normal_pair(uint32_t w0, uint32_t w1, float sign, float& n_cos, float& n_sin) {
  float u1 = uniform01(w0);
  const float u2 = uniform01(w1);
  u1 = u1 < 1.0e-7f ? 1.0e-7f : u1;                  // max(1e-7, u1)
  const float th = 6.283185307179586f * u2;
  const float r = __builtin_sqrtf(-2.0f * log_pos(u1)) * sign;
  float c, sn;
  sincos_0_2pi(th, c, sn);
  n_cos = r * c;
  n_sin = r * sn;
}

// tl.randn's transform of two Philox words: Box-Muller, cosine branch (version 1).
POCO_INLINE float normal_of(uint32_t w0, uint32_t w1) {
  float u1 = uniform01(w0);
  const float u2 = uniform01(w1);
  u1 = u1 < 1.0e-7f ? 1.0e-7f : u1;                  // max(1e-7, u1)
  const float th = 6.283185307179586f * u2;
  const float r = __builtin_sqrtf(-2.0f * log_pos(u1));
  return r * cos_0_2pi(th);
}

// ------------------------------------------------------------------ Philox, SIMD
// The vectoriser turns the 32 x 32 -> 64-bit products into 64-bit lanes (vpmullq, slow),
// so Philox is written with intrinsics: even and odd lanes through the unsigned 32-bit
// widening multiply, the odd lanes brought down by a pair swap, and the high and low
// words put back in place by permutes (AVX-512) or blends (AVX2).  Shuffles and permutes
// rather than 64-bit shifts: those would queue on the same port as the multiplies
// (measured: 1.32 against 1.75 ns per element on one Sapphire Rapids core).
#if POCO_SIMD == 512
constexpr int kLanes = 16;
constexpr int kBatch = 1;     // (philox_vb below: AVX2 only)
POCO_INLINE void mulhilo_v(__m512i m, __m512i x, __m512i& hi, __m512i& lo) {
  const __m512i pe = _mm512_mul_epu32(m, x);                                       // even lanes
  const __m512i po = _mm512_mul_epu32(m, _mm512_shuffle_epi32(x, _MM_PERM_CDAB));  // odd lanes
  // lane 2i <- word 2i+1 (high) of pe, lane 2i+1 <- word 2i+1 of po; low words alike
  hi = _mm512_permutex2var_epi32(
      pe, _mm512_setr_epi32(1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31), po);
  lo = _mm512_permutex2var_epi32(
      pe, _mm512_setr_epi32(0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30), po);
}
// words of the kLanes consecutive indices (lo0 + l, hi) (lo0 + kLanes - 1 must not wrap)
template <bool FOUR = false>
POCO_INLINE void philox_v(const PhiloxKey& key, uint32_t lo0, uint32_t hi, uint32_t counter,
                          uint32_t stream, uint32_t* o0, uint32_t* o1, uint32_t* o2 = nullptr,
                          uint32_t* o3 = nullptr) {
  __m512i c0 = _mm512_add_epi32(_mm512_set1_epi32((int)lo0),
                                _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                                  13, 14, 15));
  __m512i c1 = _mm512_set1_epi32((int)hi);
  __m512i c2 = _mm512_set1_epi32((int)counter);
  __m512i c3 = _mm512_set1_epi32((int)stream);
  const __m512i A = _mm512_set1_epi32((int)kPhiloxRoundA);
  const __m512i B = _mm512_set1_epi32((int)kPhiloxRoundB);
#pragma GCC unroll 10
  for (int r = 0; r < 10; ++r) {
    __m512i hb, lb, ha, la;
    mulhilo_v(B, c2, hb, lb);
    mulhilo_v(A, c0, ha, la);
    c0 = _mm512_ternarylogic_epi32(hb, c1, _mm512_set1_epi32((int)key.k0[r]), 0x96);  // xor3
    c2 = _mm512_ternarylogic_epi32(ha, c3, _mm512_set1_epi32((int)key.k1[r]), 0x96);
    c1 = lb;
    c3 = la;
  }
  _mm512_storeu_si512(o0, c0);
  _mm512_storeu_si512(o1, c1);
  if (FOUR) {
    _mm512_storeu_si512(o2, c2);
    _mm512_storeu_si512(o3, c3);
  }
}
#elif POCO_SIMD == 256
constexpr int kLanes = 8;
POCO_INLINE void mulhilo_v(__m256i m, __m256i x, __m256i& hi, __m256i& lo) {
  const __m256i pe = _mm256_mul_epu32(m, x);
  const __m256i po = _mm256_mul_epu32(m, _mm256_shuffle_epi32(x, 0xB1));    // pair swap
  hi = _mm256_blend_epi32(_mm256_shuffle_epi32(pe, 0xB1), po, 0xAA);
  lo = _mm256_blend_epi32(pe, _mm256_shuffle_epi32(po, 0xB1), 0xAA);
}
// one Philox round of a vector of calls (round keys k0, k1)
POCO_INLINE void round_v(__m256i k0, __m256i k1, __m256i& c0, __m256i& c1, __m256i& c2,
                         __m256i& c3) {
  const __m256i A = _mm256_set1_epi32((int)kPhiloxRoundA);
  const __m256i B = _mm256_set1_epi32((int)kPhiloxRoundB);
  __m256i hb, lb, ha, la;
  mulhilo_v(B, c2, hb, lb);
  mulhilo_v(A, c0, ha, la);
  c0 = _mm256_xor_si256(_mm256_xor_si256(hb, c1), k0);
  c2 = _mm256_xor_si256(_mm256_xor_si256(ha, c3), k1);
  c1 = lb;
  c3 = la;
}
template <bool FOUR = false>
POCO_INLINE void philox_v(const PhiloxKey& key, uint32_t lo0, uint32_t hi, uint32_t counter,
                          uint32_t stream, uint32_t* o0, uint32_t* o1, uint32_t* o2 = nullptr,
                          uint32_t* o3 = nullptr) {
  __m256i c0 = _mm256_add_epi32(_mm256_set1_epi32((int)lo0),
                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256i c1 = _mm256_set1_epi32((int)hi);
  __m256i c2 = _mm256_set1_epi32((int)counter);
  __m256i c3 = _mm256_set1_epi32((int)stream);
#pragma GCC unroll 10
  for (int r = 0; r < 10; ++r)
    round_v(_mm256_set1_epi32((int)key.k0[r]), _mm256_set1_epi32((int)key.k1[r]), c0, c1, c2, c3);
  _mm256_storeu_si256((__m256i*)o0, c0);
  _mm256_storeu_si256((__m256i*)o1, c1);
  if (FOUR) {
    _mm256_storeu_si256((__m256i*)o2, c2);
    _mm256_storeu_si256((__m256i*)o3, c3);
  }
}
// kBatch vectors at once, their rounds interleaved: one vector's chain of multiplies,
// shuffles and blends is latency-bound.  Four (16 vectors of state, more than AVX2's 16
// registers with the round's temporaries) ran 2^22 calls in 11.6 ms against 17.7 one at a
// time on a Sapphire Rapids core, and the AVX2 kernels 5-11% faster there, but up to 17%
// slower on an AMD EPYC (kernel_ab, 2026-11-28), where two (8 vectors of state) are level
// with one (0.96-1.05).  Vector v is the kLanes calls lo0 + v kLanes + l (lo0 + kBatch
// kLanes - 1 must not wrap).
constexpr int kBatch = 2;
POCO_INLINE void philox_vb(const PhiloxKey& key, uint32_t lo0, uint32_t hi, uint32_t counter,
                           uint32_t stream, uint32_t* o0, uint32_t* o1, uint32_t* o2,
                           uint32_t* o3) {
  __m256i c0[kBatch], c1[kBatch], c2[kBatch], c3[kBatch];
  for (int v = 0; v < kBatch; ++v) {
    c0[v] = _mm256_add_epi32(_mm256_set1_epi32((int)(lo0 + (uint32_t)(v * kLanes))),
                             _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    c1[v] = _mm256_set1_epi32((int)hi);
    c2[v] = _mm256_set1_epi32((int)counter);
    c3[v] = _mm256_set1_epi32((int)stream);
  }
#pragma GCC unroll 10
  for (int r = 0; r < 10; ++r) {
    const __m256i k0 = _mm256_set1_epi32((int)key.k0[r]), k1 = _mm256_set1_epi32((int)key.k1[r]);
#pragma GCC unroll 4
    for (int v = 0; v < kBatch; ++v) round_v(k0, k1, c0[v], c1[v], c2[v], c3[v]);
  }
  for (int v = 0; v < kBatch; ++v) {
    _mm256_storeu_si256((__m256i*)(o0 + v * kLanes), c0[v]);
    _mm256_storeu_si256((__m256i*)(o1 + v * kLanes), c1[v]);
    _mm256_storeu_si256((__m256i*)(o2 + v * kLanes), c2[v]);
    _mm256_storeu_si256((__m256i*)(o3 + v * kLanes), c3[v]);
  }
}
#else
constexpr int kLanes = 0;     // scalar Philox only
#endif

struct NoPrefetch {
  POCO_INLINE void operator()(int64_t) const {}
};

// Version 1: eps[j] = sign * randn(idx0 + j), one Philox call per element.
template <typename Prefetch>
POCO_INLINE void noise_tile_v1(float* __restrict eps, int64_t len, uint64_t idx0,
                               const PhiloxKey& key, uint32_t counter, uint32_t stream,
                               float sign, const Prefetch& prefetch) {
  alignas(64) uint32_t w0[kTile], w1[kTile];
  int64_t j = 0;
#if POCO_SIMD
  for (; j + kLanes <= len; j += kLanes) {
    prefetch(j);
    const uint64_t idx = idx0 + (uint64_t)j;
    if ((uint32_t)idx <= 0xFFFFFFFFu - (kLanes - 1)) {   // the low word does not wrap
      philox_v(key, (uint32_t)idx, (uint32_t)(idx >> 32), counter, stream, w0 + j, w1 + j);
    } else {
      for (int l = 0; l < kLanes; ++l) {
        const uint64_t i = idx + (uint64_t)l;
        philox2(key, (uint32_t)i, (uint32_t)(i >> 32), counter, stream, w0[j + l], w1[j + l]);
      }
    }
  }
#endif
  for (; j < len; ++j) {
    const uint64_t i = idx0 + (uint64_t)j;
    philox2(key, (uint32_t)i, (uint32_t)(i >> 32), counter, stream, w0[j], w1[j]);
  }
#pragma omp simd
  for (int64_t k = 0; k < len; ++k) eps[k] = sign * normal_of(w0[k], w1[k]);
}

// Version 2: call q gives the normals of elements 4q .. 4q + 3.  The calls that cover
// idx0 .. idx0 + len - 1 are generated kLanes at a time (each SIMD lane one call, all four
// words kept), then transformed four normals per call; a tile that does not start and end
// on a multiple of 4 (only the stream operator's arbitrary offsets) goes through `quad`.
constexpr int64_t kCalls = kTile / 4 + 2;       // calls covering kTile elements at any offset
template <typename Prefetch>
POCO_INLINE void noise_tile_v2(float* __restrict eps, int64_t len, uint64_t idx0,
                               const PhiloxKey& key, uint32_t counter, uint32_t stream,
                               float sign, const Prefetch& prefetch) {
  alignas(64) uint32_t w0[kCalls], w1[kCalls], w2[kCalls], w3[kCalls];
  alignas(64) float quad[4 * kCalls];
  const uint64_t q0 = idx0 >> 2;
  const int64_t lead = (int64_t)(idx0 & 3u);
  const int64_t ncalls = (lead + len + 3) >> 2;
  int64_t c = 0;
#if POCO_SIMD == 256
  for (; c + kBatch * kLanes <= ncalls &&
         (uint32_t)(q0 + (uint64_t)c) <= 0xFFFFFFFFu - (kBatch * kLanes - 1);
       c += kBatch * kLanes) {
    for (int64_t e = 4 * c; e < 4 * (c + kBatch * kLanes) && e < len; e += kLanes) prefetch(e);
    const uint64_t q = q0 + (uint64_t)c;
    philox_vb(key, (uint32_t)q, (uint32_t)(q >> 32), counter, stream, w0 + c, w1 + c, w2 + c,
              w3 + c);
  }
#endif
#if POCO_SIMD
  for (; c + kLanes <= ncalls; c += kLanes) {
    for (int64_t e = 4 * c; e < 4 * (c + kLanes) && e < len; e += kLanes) prefetch(e);
    const uint64_t q = q0 + (uint64_t)c;
    if ((uint32_t)q <= 0xFFFFFFFFu - (kLanes - 1)) {     // the low word does not wrap
      philox_v<true>(key, (uint32_t)q, (uint32_t)(q >> 32), counter, stream, w0 + c, w1 + c,
                     w2 + c, w3 + c);
      continue;
    }
    for (int l = 0; l < kLanes; ++l) {
      uint32_t o[4];
      const uint64_t ql = q + (uint64_t)l;
      philox4(key, (uint32_t)ql, (uint32_t)(ql >> 32), counter, stream, o);
      w0[c + l] = o[0]; w1[c + l] = o[1]; w2[c + l] = o[2]; w3[c + l] = o[3];
    }
  }
#endif
  for (; c < ncalls; ++c) {
    uint32_t o[4];
    const uint64_t q = q0 + (uint64_t)c;
    philox4(key, (uint32_t)q, (uint32_t)(q >> 32), counter, stream, o);
    w0[c] = o[0]; w1[c] = o[1]; w2[c] = o[2]; w3[c] = o[3];
  }
  const bool direct = lead == 0 && (len & 3) == 0;
  float* __restrict dst = direct ? eps : quad;
#pragma omp simd
  for (int64_t k = 0; k < ncalls; ++k) {
    float a, b, d, e;
    normal_pair(w0[k], w1[k], sign, a, b);
    normal_pair(w2[k], w3[k], sign, d, e);
    dst[4 * k] = a;
    dst[4 * k + 1] = b;
    dst[4 * k + 2] = d;
    dst[4 * k + 3] = e;
  }
  if (!direct)
    for (int64_t k = 0; k < len; ++k) eps[k] = quad[lead + k];
}

// eps[j] = sign * randn(idx0 + j) of stream (key, counter, stream), j < len <= kTile, in
// the key's noise version.  `prefetch(j)` is called once per kLanes elements while the
// (compute-bound) Philox rounds run: a caller that streams buffers from memory prefetches
// the tile's cache lines there, so the memory traffic overlaps the noise instead of
// following it.
template <typename Prefetch = NoPrefetch>
POCO_INLINE void noise_tile(float* __restrict eps, int64_t len, uint64_t idx0,
                            const PhiloxKey& key, uint32_t counter, uint32_t stream,
                            float sign, const Prefetch& prefetch = Prefetch()) {
  if (key.version == 1)
    noise_tile_v1(eps, len, idx0, key, counter, stream, sign, prefetch);
  else
    noise_tile_v2(eps, len, idx0, key, counter, stream, sign, prefetch);
}
