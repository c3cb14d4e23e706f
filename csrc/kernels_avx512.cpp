// The kernels for x86-64-v4 CPUs (AVX-512 F/BW/DQ/VL): 16-lane Philox, 512-bit passes.
// Compiled for that instruction set whatever the build flags; ops.cpp calls it only on
// CPUs that have it.
#if defined(__x86_64__)
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,bmi,bmi2,f16c,lzcnt,popcnt,movbe,prefer-vector-width=512")
#define POCO_ISA avx512
#define POCO_ISA_NAME "avx512"
#define POCO_TABLE kKernelsAvx512
#define POCO_SIMD 512
#include "kernels_impl.h"
#endif
