"""Build script.  Pure-Python install today; the C++ CPU extension (``csrc/``, built with
ninja through torch's cpp_extension) is compiled here once its sources exist.  Install
with ``pip install --no-build-isolation`` so the extension builds against the torch
already installed (build isolation would fetch another, multi-GB, torch)."""
import glob
import os

from setuptools import setup

ext_modules, cmdclass = [], {}
sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
if sources and os.environ.get("POCO_KERNELS_NO_EXTENSION") != "1":
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    ext_modules = [CppExtension("poco_kernels._C", sources,
                                extra_compile_args=["-O3", "-fopenmp"],
                                extra_link_args=["-fopenmp"])]
    cmdclass = {"build_ext": BuildExtension}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
