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

A reinstall compiles only what changed. An editable install (``pip install -e``) builds in
a fresh temporary directory each time, which would recompile every file (minutes on 2
cores); :func:`persistent_build_temp` keeps the object files under ``build/`` instead,
where ninja's incremental build recompiles a file only when it, a header it includes
(ninja's depfiles: torch's headers too) or its compile command changed. Then the library
is relinked (seconds) and replaces the one in ``poco_kernels/`` only if its bytes differ,
by a rename, so a process that has the old one loaded keeps it intact.
"""
import filecmp
import glob
import os
import sys
import sysconfig

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))


def persistent_build_temp(build_temp, root=HERE):
    """Where the object files go: ``build_temp`` when it lies in the source tree (a plain
    ``pip install .`` or ``setup.py build``), else (an editable install's temporary
    directory) ``<root>/build/temp.<platform>-<python>``, kept between installs."""
    root = os.path.abspath(root)
    if build_temp and os.path.abspath(build_temp).startswith(root + os.sep):
        return build_temp
    return os.path.join(root, "build",
                        f"temp.{sysconfig.get_platform()}-{sys.implementation.cache_tag}")


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

        class BuildExt(BuildExtension):
            """torch's BuildExtension with object files kept between installs (ninja then
            rebuilds only what changed) and the in-place library replaced only when it
            changed."""

            def finalize_options(self):
                super().finalize_options()
                self.build_temp = persistent_build_temp(self.build_temp)

            def copy_file(self, infile, outfile, *args, **kwargs):
                if os.path.exists(outfile) and filecmp.cmp(infile, outfile, shallow=False):
                    return outfile, False              # unchanged: leave it alone
                tmp = f"{outfile}.tmp{os.getpid()}"
                super().copy_file(infile, tmp, *args, **kwargs)
                os.replace(tmp, outfile)               # atomic: a loaded copy stays valid
                return outfile, True

        cmdclass = {"build_ext": BuildExt}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
