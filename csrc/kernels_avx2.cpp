// The kernels for x86-64-v3 CPUs (AVX2, FMA): 8-lane Philox, 256-bit vectorised passes.
// Compiled for that instruction set whatever the build flags; ops.cpp calls it only on
// CPUs that have it.
#if defined(__x86_64__)
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#pragma GCC target("avx2,fma,bmi,bmi2,f16c,lzcnt,popcnt,movbe")
#define POCO_ISA avx2
#define POCO_ISA_NAME "avx2"
#define POCO_TABLE kKernelsAvx2
#define POCO_SIMD 256
#include "kernels_impl.h"
#endif
