// The driver of kernel_ab.py: the C++ kernels of two source trees ("base" and "work"),
// each compiled into its own namespace by kernel_ab.py, run on the same buffers with the
// calls of the two trees interleaved rep by rep, so that a machine whose speed drifts
// (a shared VM) drifts under both alike.  Prints one CSV line per (case, tree, rep):
// case,tree,rep,ms.
//
// Cases, float32, n elements, the IVON family: the IVON step with the next sample (the
// parked default's step), the IVON-PoCoMo step with shared noise with and without the
// next sample, the outer sample (sigma from its buffer), and the noise stream alone.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <omp.h>

#include "poco_kernels.h"

namespace poco {
extern const KernelTable kKernels_base, kKernels_work;
int64_t tile_base();
int64_t tile_work();
}  // namespace poco
using namespace poco;

// f(t0, t1) on the tiles split evenly between the OpenMP threads; milliseconds
template <typename F>
static double timed(int64_t ntiles, const F& f) {
  const auto a = std::chrono::steady_clock::now();
#pragma omp parallel
  {
    const int nt = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t per = (ntiles + nt - 1) / nt;
    const int64_t t0 = id * per, t1 = std::min(ntiles, t0 + per);
    if (t0 < t1) f(t0, t1);
  }
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count();
}

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s numel reps\n", argv[0]);
    return 2;
  }
  const int64_t n = std::atoll(argv[1]);
  const int reps = std::atoi(argv[2]);
  std::vector<float*> buf;
  for (int i = 0; i < 11; ++i) {
    float* p = static_cast<float*>(std::aligned_alloc(64, ((n * 4 + 63) / 64) * 64));
    for (int64_t j = 0; j < n; ++j) p[j] = 0.5f + (float)(j % 7) * 0.1f;
    buf.push_back(p);
  }
  StepArgs s{};
  s.mean = buf[0];
  s.param = buf[1];
  s.pdtype = kF32;
  s.s1 = buf[2];
  s.s2 = buf[3];
  s.g_in = buf[4];
  s.g_at_out = buf[5];
  s.g_out = buf[6];
  s.h_out = buf[7];
  s.m_out = buf[8];
  s.sigma_out = buf[9];
  s.n = n;
  s.seed = 7;
  s.noise_version = 2;
  s.counter = 3;
  s.stream_in = 1;
  s.stream_at_out = 2;
  s.sign_at_out = 1.0f;
  s.scale_in = s.scale_at_out = 1.0f;
  s.family = kFamilyIvon;
  s.shared_noise = true;
  s.alpha = 0.5f;
  s.lr = 1e-3f;
  s.beta1 = 0.9f;
  s.one_m_beta1 = 0.1f;
  s.beta2 = 0.99999f;
  s.one_m_beta2 = 1e-5f;
  s.half_sq_one_m_beta2 = 5e-11f;
  s.wd = 1e-4f;
  s.ess = 1.0f;
  s.hess_corr_alpha = 0.005f;
  s.neg_floor = -INFINITY;
  s.clip = INFINITY;
  s.inv_bias1 = 1.0f;
  StepArgs ivon_next = s, poco_next = s, poco = s;
  ivon_next.next_sample = true;
  poco_next.corr = poco_next.hess_corr_on = poco_next.next_sample = true;
  poco.corr = poco.hess_corr_on = true;
  SampleArgs sa{};
  sa.param = buf[1];
  sa.pdtype = kF32;
  sa.centre = buf[8];
  sa.sigma = buf[9];
  sa.n = n;
  sa.noise = Noise{7, 3, 2, 1.0f, 2, 0};
  sa.mode = kSigmaBuffer;
  const Noise stream{7, 3, 1, 1.0f, 2, 0};

  const KernelTable* table[2] = {&kKernels_base, &kKernels_work};
  const char* tree[2] = {"base", "work"};
  const int64_t tiles[2] = {(n + tile_base() - 1) / tile_base(), (n + tile_work() - 1) / tile_work()};
  for (int rep = 0; rep < reps; ++rep) {
    for (int v = 0; v < 2; ++v) {
      const KernelTable& K = *table[v];
      const double ms[5] = {
          timed(tiles[v], [&](int64_t a, int64_t b) { K.step(ivon_next, a, b); }),
          timed(tiles[v], [&](int64_t a, int64_t b) { K.step(poco_next, a, b); }),
          timed(tiles[v], [&](int64_t a, int64_t b) { K.step(poco, a, b); }),
          timed(tiles[v], [&](int64_t a, int64_t b) { K.sample(sa, a, b); }),
          timed(tiles[v], [&](int64_t a, int64_t b) { K.randn(buf[10], n, 0, stream, a, b); })};
      const char* names[5] = {"step_ivon_next", "step_poco_next", "step_poco", "sample_outer",
                              "noise_stream"};
      for (int k = 0; k < 5; ++k) std::printf("%s,%s,%d,%.4f\n", names[k], tree[v], rep, ms[k]);
    }
  }
  return 0;
}
