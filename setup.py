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

``POCO_KERNELS_SANITIZE=address`` (or ``undefined``, or ``address,undefined``) builds the
extension with GCC's or Clang's sanitizers instead of ``-O3`` (``-O1 -g``), its object files
in a build folder of their own; how to run the tests with it: ``csrc/README.md``, 'Memory
checks'.

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
    directory) ``<root>/build/temp.<platform>-<python>``, kept between installs; a
    sanitized build's name ends in :func:`sanitized_suffix`."""
    root = os.path.abspath(root)
    if build_temp and os.path.abspath(build_temp).startswith(root + os.sep):
        return build_temp + sanitized_suffix()
    return os.path.join(root, "build", f"temp.{sysconfig.get_platform()}-"
                        f"{sys.implementation.cache_tag}{sanitized_suffix()}")


#: the sanitizers ``POCO_KERNELS_SANITIZE`` may name
SANITIZERS = ("address", "undefined")


def sanitizers(value=None):
    """The sanitizers asked for by ``POCO_KERNELS_SANITIZE`` (a comma-separated list of
    :data:`SANITIZERS`; empty: none), sorted; another name is refused."""
    value = os.environ.get("POCO_KERNELS_SANITIZE", "") if value is None else value
    names = sorted({n.strip() for n in value.split(",") if n.strip()})
    unknown = [n for n in names if n not in SANITIZERS]
    if unknown:
        raise ValueError(f"POCO_KERNELS_SANITIZE: unknown sanitizer(s) {unknown}; "
                         f"known: {', '.join(SANITIZERS)}")
    return names


def sanitized_suffix(value=None):
    """The build folder's suffix of a sanitized build (its object files never mix with
    the optimised build's): '' when none is asked for."""
    names = sanitizers(value)
    return "-sanitize-" + "-".join(names) if names else ""


def compile_flags(value=None):
    """(compiler flags, linker flags) of the extension: optimised, or sanitized."""
    common = ["-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"]
    names = sanitizers(value)
    if not names:
        return ["-O3"] + common, ["-fopenmp"]
    san = "-fsanitize=" + ",".join(names)
    return (["-O1", "-g", "-fno-omit-frame-pointer", san] + common,
            ["-fopenmp", san])


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
        flags, link_flags = compile_flags()
        ext_modules = [CppExtension("poco_kernels._C", sources, optional=True,
                                    depends=sorted(glob.glob(os.path.join("csrc", "*.h"))),
                                    extra_compile_args=flags, extra_link_args=link_flags)]

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
