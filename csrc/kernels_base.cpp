// The kernels for any CPU (the compiler's default instruction set; scalar Philox).
#define POCO_ISA base
#define POCO_ISA_NAME "base"
#define POCO_TABLE kKernelsBase
#define POCO_SIMD 0
#include "kernels_impl.h"
