"""Build script: the pure-Python package plus the C++ CPU extension ``poco_kernels._C``
(``csrc/``, built with ninja through torch's cpp_extension).

Install with ``pip install --no-build-isolation`` so the extension builds against the
torch already installed (build isolation would fetch another, multi-GB, torch).

The extension is optional: if it cannot be built (no compiler, no torch at build time,
``POCO_KERNELS_NO_EXTENSION=1``), the package installs without it, works on the reference
and Triton backends, and ``backend="cpp"`` says how to build it.

Compiler flags (GCC or Clang):
* ``-fopenmp``: at::parallel_for runs on torch's OpenMP threads;
* ``-fno-math-errno -fno-trapping-math``: lets sqrt and the selects of the kernels
  vectorise (neither changes an IEEE result; the kernels never read errno or FP flags);
* ``-ffp-contract=off``: no fused multiply-adds, so the kernels round like the reference
  (which runs one torch op at a time) and every ISA path gives the same arithmetic.
No ``-ffast-math`` (the kernels test for NaN and inf) and no ``-march=native``: the AVX2
and AVX-512 kernels are compiled by their own files and chosen at run time.
"""
import glob
import os
import sys

from setuptools import setup

ext_modules, cmdclass = [], {}
sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
if sources and os.environ.get("POCO_KERNELS_NO_EXTENSION") != "1":
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError as exc:     # pragma: no cover - depends on the build environment
        print(f"poco_kernels: torch is not importable at build time ({exc}); installing "
              "without the C++ extension (install torch first and use --no-build-isolation)",
              file=sys.stderr)
    else:
        flags = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"]
        ext_modules = [CppExtension("poco_kernels._C", sources, optional=True,
                                    depends=sorted(glob.glob(os.path.join("csrc", "*.h"))),
                                    extra_compile_args=flags, extra_link_args=["-fopenmp"])]
        cmdclass = {"build_ext": BuildExtension}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
