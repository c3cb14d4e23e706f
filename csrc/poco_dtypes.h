// Element-wise conversions of the C++ kernels: float32 to and from the parameter dtypes
// (bfloat16, float16), and the stochastic rounding of bfloat16 state.
//
// Included by kernels_impl.h inside the namespace of one instruction set, after
// poco_math.h (POCO_INLINE, f2u, u2f): no includes and no namespace here.
#pragma once

// ------------------------------------------------------------------ parameter dtypes
struct bf16 { uint16_t x; };
struct f16 { uint16_t x; };

POCO_INLINE float to_f32(float v) { return v; }
POCO_INLINE float to_f32(bf16 v) { return u2f((uint32_t)v.x << 16); }
POCO_INLINE float to_f32(f16 v) {
  const uint32_t h = v.x;
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  // normal: rebias the exponent (15 -> 127); inf/NaN: all-ones exponent, payload kept;
  // zero/subnormal: m * 2^-24 (exact in float32)
  const uint32_t normal = ((e + 112u) << 23) | (m << 13);
  const uint32_t special = 0x7F800000u | (m << 13);
  const uint32_t sub = f2u((float)m * 5.9604644775390625e-8f);
  const uint32_t mag = e == 0 ? sub : (e == 31 ? special : normal);
  return u2f(sign | mag);
}

// float32 -> parameter dtype, rounding to nearest even; NaN stays NaN (quiet), overflow
// goes to inf.  Bit-identical to torch's casts (tests/kernels/test_cpp_backend.py).
template <typename T> POCO_INLINE T from_f32(float v);
template <> POCO_INLINE float from_f32<float>(float v) { return v; }
template <> POCO_INLINE bf16 from_f32<bf16>(float v) {
  const uint32_t raw = f2u(v);
  const uint32_t rounded = (raw + 0x7FFFu + ((raw >> 16) & 1u)) >> 16;
  const uint32_t nan = ((raw >> 16) & 0x8000u) | 0x7FC0u;
  return bf16{(uint16_t)(v != v ? nan : rounded)};
}
template <> POCO_INLINE f16 from_f32<f16>(float v) {
  const uint32_t raw = f2u(v);
  const uint32_t sign = (raw >> 16) & 0x8000u;
  const uint32_t a = raw & 0x7FFFFFFFu;
  // normal range: rebias (127 -> 15) and round the mantissa from 23 to 10 bits; a carry
  // into exponent 31 is the correct overflow to inf, larger values are clamped to inf
  uint32_t normal = (a - 0x38000000u + 0xFFFu + ((a >> 13) & 1u)) >> 13;
  normal = normal > 0x7C00u ? 0x7C00u : normal;
  // below 2^-14: the FPU rounds |v| + 0.5 to a multiple of 2^-24, the half subnormal ulp
  const uint32_t sub = f2u(u2f(a) + 0.5f) - 0x3F000000u;
  uint32_t mag = a < 0x38800000u ? sub : normal;
  mag = a > 0x7F800000u ? 0x7E00u : (a == 0x7F800000u ? 0x7C00u : mag);
  return f16{(uint16_t)(sign | mag)};
}


// ------------------------------------------------------------------ low-precision state
// Stochastic rounding of float32 state to bfloat16 (state_dtype=torch.bfloat16):
// poco_kernels.reference.stochastic_round with the bits of poco_kernels.noise.rounding_bits
// (a salt per call and index high word, the index's low word times an odd constant,
// MurmurHash3's finaliser; 32-bit lanes, so the loops below vectorise).
constexpr uint32_t kRoundMulIndex = 0x9E3779B1u;
constexpr uint32_t kRoundMulSeed = 0x85EBCA6Bu;
constexpr uint32_t kRoundMulCounter = 0xC2B2AE35u;
constexpr uint32_t kRoundMulWhich = 0x27D4EB2Fu;
constexpr uint32_t kRoundMulIndexHi = 0x165667B1u;
// the tags of poco_kernels.noise.ROUND_TAGS
enum RoundTag : uint32_t { kTagMomentum = 0, kTagGOut = 1, kTagHOut = 2, kTagMOut = 3, kTagSigmaOut = 4 };

POCO_INLINE uint32_t round_salt(uint64_t seed, uint32_t counter, uint32_t bucket, uint32_t tag,
                                uint32_t index_hi) {
  const uint32_t which = ((bucket << 3) | tag) + 1u;
  return (uint32_t)seed ^ ((uint32_t)(seed >> 32) * kRoundMulSeed) ^ (counter * kRoundMulCounter) ^
         (which * kRoundMulWhich) ^ (index_hi * kRoundMulIndexHi);
}
POCO_INLINE uint32_t round_bits(uint32_t index_lo, uint32_t salt) {
  uint32_t x = (index_lo * kRoundMulIndex) ^ salt;
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  return x >> 16;
}
// float32 -> bfloat16 bits, rounded up (away from zero) when the dropped 16 bits plus
// `bits` carry: probability = the dropped fraction of an ulp.  inf stays, NaN stays quiet.
POCO_INLINE uint16_t round_bf16_sr(float v, uint32_t bits) {
  const uint32_t u = f2u(v);
  const bool finite = (u & 0x7F800000u) != 0x7F800000u;
  const uint32_t special = (u >> 16) | ((u & 0x007FFFFFu) != 0u ? 0x40u : 0u);
  return (uint16_t)(finite ? (u + bits) >> 16 : special);
}
// dst[j] <- stochastic rounding of src[j], element index i0 + j of the buffer's stream
// (j < len; split where the index crosses a multiple of 2^32, which a shard's base can make
// happen inside a tile)
POCO_INLINE void store_sr(uint16_t* __restrict dst, const float* __restrict src, int64_t len,
                          uint64_t i0, uint64_t seed, uint32_t counter, uint32_t bucket,
                          uint32_t tag) {
  while (len > 0) {
    const uint32_t lo0 = (uint32_t)i0;
    const uint64_t room = 0x100000000ull - (uint64_t)lo0;
    const int64_t m = (uint64_t)len < room ? len : (int64_t)room;
    const uint32_t salt = round_salt(seed, counter, bucket, tag, (uint32_t)(i0 >> 32));
#pragma omp simd
    for (int64_t j = 0; j < m; ++j)
      dst[j] = round_bf16_sr(src[j], round_bits(lo0 + (uint32_t)j, salt));
    dst += m;
    src += m;
    len -= m;
    i0 += (uint64_t)m;
  }
}
// dst[j] <- bfloat16 src[j], widened exactly
POCO_INLINE void load_bf16(float* __restrict dst, const uint16_t* __restrict src, int64_t len) {
#pragma omp simd
  for (int64_t j = 0; j < len; ++j) dst[j] = u2f((uint32_t)src[j] << 16);
}
