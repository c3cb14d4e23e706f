// The C++ operators' shared argument handling (ops.cpp, ops_update.cpp): every tensor
// checked (device, layout, size, dtype, inside its storage), the control tensor and the
// AMP scalars read, the float64 hyperparameter rows read into their structs and the flag
// bits unpacked (poco_kernels.h's X-macros), the tiles run with at::parallel_for.
// Internal to those two files; each includes it once.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "poco_kernels.h"

namespace poco {

// The kernels of the instruction set in use (ops.cpp: chosen when the first operator runs).
const KernelTable& kernels();

namespace {

// Buffers below this many tiles run on one thread (the OpenMP fork costs more).
constexpr int64_t kGrainTiles = 32768 / kTile;

// ------------------------------------------------------------------ checks
// The first `count` elements of a contiguous tensor (all of them: -1) lie inside its storage
// (one whose storage was shrunk after it was made, `untyped_storage().resize_()`, would be
// read and written past its end).
inline void check_in_storage(const at::Tensor& t, const char* name, int64_t count = -1) {
  if (!t.has_storage() || t.numel() == 0) return;
  const int64_t used = count < 0 ? t.numel() : std::min<int64_t>(count, t.numel());
  const int64_t need = (t.storage_offset() + used) * static_cast<int64_t>(t.itemsize());
  TORCH_CHECK(static_cast<int64_t>(t.storage().nbytes()) >= need, "poco_kernels_cpp: '", name,
              "' reaches past the end of its storage (", need, " bytes needed, ",
              t.storage().nbytes(), " there)");
}

inline void check_cpu_contiguous(const at::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "poco_kernels_cpp: '", name, "' must be a CPU tensor, got ",
              t.device());
  TORCH_CHECK(t.is_contiguous(), "poco_kernels_cpp: '", name, "' must be contiguous");
  TORCH_CHECK(t.numel() == n, "poco_kernels_cpp: '", name, "' has ", t.numel(),
              " elements, expected ", n);
  check_in_storage(t, name);
}

inline float* state_ptr(const at::Tensor& t, int64_t n, const char* name) {
  check_cpu_contiguous(t, n, name);
  TORCH_CHECK(t.scalar_type() == at::kFloat, "poco_kernels_cpp: '", name,
              "' must be float32 (optimizer state), got ", t.scalar_type());
  return t.data_ptr<float>();
}

// An optional state buffer that the code path needs (`needed`) or ignores.
inline float* state_ptr(const c10::optional<at::Tensor>& t, int64_t n, const char* name, bool needed) {
  if (!needed) return nullptr;
  TORCH_CHECK(t.has_value(), "poco_kernels_cpp: '", name, "' is required on this code path");
  return state_ptr(*t, n, name);
}

// A state buffer that state_dtype (or outer_dtype) may keep in bfloat16: its pointer (as
// float*: the kernels read it as uint16 when its bit is set in `low`).
inline float* low_state_ptr(const c10::optional<at::Tensor>& t, int64_t n, const char* name,
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
inline int pdtype_of(const at::Tensor& t, int64_t n, const char* name) {
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

inline int64_t* ctl_ptr(const at::Tensor& ctl) {
  TORCH_CHECK(ctl.device().is_cpu() && ctl.scalar_type() == at::kLong && ctl.is_contiguous() &&
                  ctl.numel() >= 4,
              "poco_kernels_cpp: 'ctl' must be a contiguous CPU int64 tensor of 4 elements");
  check_in_storage(ctl, "ctl");
  return ctl.data_ptr<int64_t>();
}

// The first element of a scalar tensor (AMP found_inf / grad_scale), as a double.
inline double scalar_of(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.numel() >= 1, "poco_kernels_cpp: '", name, "' is empty");
  TORCH_CHECK(t.device().is_cpu(), "poco_kernels_cpp: '", name, "' must be a CPU tensor");
  check_in_storage(t, name, 1);                 // (its first element, at its offset, is read)
  if (t.scalar_type() == at::kFloat && t.is_contiguous()) return t.data_ptr<float>()[0];
  return t.reshape(-1).select(0, 0).item<double>();
}

inline bool skip_update(const int64_t* ctl, const c10::optional<at::Tensor>& found_inf) {
  return ctl[2] != 0 || (found_inf.has_value() && scalar_of(*found_inf, "found_inf") != 0.0);
}

// 1 / grad_scale in float32, as the reference computes it
inline float inv_scale(const c10::optional<at::Tensor>& grad_scale) {
  if (!grad_scale.has_value()) return 1.0f;
  return 1.0f / (float)scalar_of(*grad_scale, "grad_scale");
}

inline uint32_t u32(int64_t v, const char* name) {
  TORCH_CHECK(v >= 0 && v <= (int64_t)0xFFFFFFFF, "poco_kernels_cpp: '", name,
              "' must be in [0, 2**32), got ", v);
  return (uint32_t)v;
}

// the noise stream definition (poco_kernels/noise.py: STREAM_VERSIONS)
inline uint32_t noise_version(int64_t v) {
  TORCH_CHECK(v == 1 || v == 2, "poco_kernels_cpp: noise version must be 1 or 2, got ", v);
  return (uint32_t)v;
}

// `offset`: the stream index of a buffer's element 0 (Noise::base)
inline uint64_t base_of(int64_t offset) {
  TORCH_CHECK(offset >= 0, "poco_kernels_cpp: offset must be >= 0, got ", offset);
  return (uint64_t)offset;
}

inline int64_t counter_of(const int64_t* ctl, int64_t slot) {
  TORCH_CHECK(slot == 0 || slot == 1, "poco_kernels_cpp: counter slot must be 0 or 1");
  return ctl[slot];
}

template <typename F>
inline void for_tiles(int64_t n, const F& f) {
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
  check_in_storage(hp, "hp");
  Hyper h{};
  static_assert(std::is_standard_layout<Hyper>::value, "a plain struct of doubles");
  std::memcpy(&h, hp.data_ptr<double>(), sizeof(double) * count);
  return h;
}

inline StepHyper step_hyper(const at::Tensor& hp) {
  constexpr int64_t n = 0 POCO_STEP_HYPER(POCO_COUNT);
  static_assert(sizeof(StepHyper) == n * sizeof(double), "StepHyper is its doubles");
  return read_hyper<StepHyper>(hp, n, "step", "StepHyper");
}

inline RefreshHyper refresh_hyper(const at::Tensor& hp) {
  constexpr int64_t n = 0 POCO_REFRESH_HYPER(POCO_COUNT);
  static_assert(sizeof(RefreshHyper) == n * sizeof(double), "RefreshHyper is its doubles");
  return read_hyper<RefreshHyper>(hp, n, "refresh", "RefreshHyper");
}

inline SampleHyper sample_hyper(const at::Tensor& hp) {
  constexpr int64_t n = 0 POCO_SAMPLE_HYPER(POCO_COUNT);
  static_assert(sizeof(SampleHyper) == n * sizeof(double), "SampleHyper is its doubles");
  return read_hyper<SampleHyper>(hp, n, "sample", "SampleHyper");
}

// beta ** e by squaring (e >= 0), one IEEE double multiplication after another: the
// Triton kernels compute it the same way (triton_kernels._pow_steps), so both debias
// with the same float32 constant whatever the platform's pow()
inline double pow_steps(double b, int64_t e) {
  double r = 1.0;
  while (e > 0) {
    if (e & 1) r = r * b;
    b = b * b;
    e >>= 1;
  }
  return r;
}

inline StepFlags step_flags(int64_t bits) {
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

inline RefreshFlags refresh_flags(int64_t bits) {
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

}  // namespace
}  // namespace poco
