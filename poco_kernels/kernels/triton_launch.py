"""Triton launches without the JIT's per-call work: the compiled kernel looked up by a
key computed in a few Python operations, then launched through its own launcher.

``kernel[grid](*args, **constexprs)`` on a ``triton.jit`` function binds every argument,
specialises each one, formats the specialisation and the options into a string cache
key, looks the compiled kernel up by it, and only then launches: 13-16 µs per launch on
an H200's host (2026-11-27), and an optimizer step makes one launch per bucket per
phase.  :class:`Launcher` keeps, per call site and key, the compiled kernel the JIT
returned the first time, and launches it the way the JIT does (``CompiledKernel.run``
with every bound argument, constexprs included, in signature order: Triton >= 3.4).

**The key is at least as fine as what the JIT keys on**, so a cached kernel is the one
the JIT would have picked (:func:`spec`): per positional tensor its dtype and whether its
address is a multiple of 16; per positional integer whether it is 1 or a multiple of 16
and its width (i32, i64, u64); per bool, float and None its type; per keyword constexpr
its type and value; the current device; and the Triton knobs the JIT reads at each
launch (``debug``, ``instrumentation_mode``, a stages-inspection hook).

The JIT is used instead, unchanged, for: the interpreter; a Triton older than 3.4; a
backend other than NVIDIA's (AMD's specialises tensors on their size too); a kernel
with ``*args``; a constexpr passed by position; a keyword value that is not a bool,
int, str or None; an argument of another type; a grid given as a function; a kernel with
``pre_run_hooks``; and ``ENABLED = False``.

Not seen by the cache: a change of a global the kernel reads (the JIT raises; this
package's kernels read module constants only), and ``device_caches`` cleared by hand.

``tests/kernels/test_triton_launch.py`` checks the key against Triton's specialiser and
the argument list against its binder for every launch the optimizers make, and drives
the cache with a stand-in driver and compiled kernel; on a GPU the quick check compares
the cached launches with the JIT's bit for bit (``benchmarks/gpu/checks.py``).
"""
from __future__ import annotations

import inspect
from typing import Any, Dict, Optional, Tuple

import torch
import triton

__all__ = ["Launcher", "spec", "ENABLED", "fast_path_available"]

#: False: every launch goes through the JIT (for comparisons and debugging)
ENABLED = True

_I32_LO, _I32_HI, _I64_HI = -(1 << 31), (1 << 31) - 1, (1 << 63) - 1
#: the keyword value types keyed by value (a float would be keyed by a NaN-unsafe ==)
_KEYWORD_TYPES = (bool, int, str, type(None))
#: the launch options a launch may pass as keywords
_OPTIONS = frozenset({"num_warps", "num_stages", "enable_fp_fusion"})


class _Unkeyed(Exception):
    """An argument :func:`spec` does not know: the call goes through the JIT."""


def spec(a: Any):
    """The part of positional argument ``a`` that Triton's specialisation can depend on
    (or a finer one); raises :class:`_Unkeyed` for a type it does not know."""
    t = type(a)
    if t is bool:
        return t
    if t is int:
        width = 0 if _I32_LO <= a <= _I32_HI else (1 if a <= _I64_HI else 2)
        return (a == 1, (a & 15) == 0, width)
    if t is float or a is None:
        return t
    if isinstance(a, torch.Tensor):
        return (a.dtype, (a.data_ptr() & 15) == 0)
    raise _Unkeyed(t)


def fast_path_available() -> bool:
    """Whether launches can skip the JIT here: Triton >= 3.4 (``triton.knobs``), not
    the interpreter, an NVIDIA GPU whose backend specialises as Triton's base backend
    does.  Asked at a launcher's first launch (it needs the active driver)."""
    try:
        major, minor = (int(x) for x in triton.__version__.split(".")[:2])
        from triton import knobs
        if (major, minor) < (3, 4) or knobs.runtime.interpret:
            return False
        from triton.backends.compiler import BaseBackend
        from triton.compiler.compiler import make_backend
        target = triton.runtime.driver.active.get_current_target()
        backend = type(make_backend(target))
        return (target.backend == "cuda"
                and backend.get_tensor_specialization is BaseBackend.get_tensor_specialization
                and backend.get_int_specialization is BaseBackend.get_int_specialization)
    except Exception:                      # no driver, no GPU, an unexpected Triton
        return False


def _knobs():
    """A function of no arguments: the Triton knobs the JIT reads at each launch."""
    from triton import knobs
    rt, comp = knobs.runtime, knobs.compilation
    reads = [(rt, "debug"), (comp, "instrumentation_mode"),
             (rt, "add_stages_inspection_hook")]
    reads = [(o, n) for o, n in reads if hasattr(o, n)]
    return lambda: tuple([getattr(o, n) for o, n in reads])


class Launcher:
    """``Launcher(module, name)[grid](*args, **constexprs)``: launch the ``triton.jit``
    function ``module.name`` (looked up at each launch, so a test may replace it) as
    ``fn[grid](*args, **constexprs)`` does, the launch options (``num_warps``,
    ``num_stages``, ``enable_fp_fusion``) among the keywords, with the compiled kernel
    cached per key.  ``hits``: launches of a cached kernel; ``misses``: keyed launches
    that went through the JIT (the others, unkeyed, are counted nowhere)."""

    def __init__(self, module, name: str):
        self._module, self._name = module, name
        self._bind(getattr(module, name))

    def _bind(self, fn) -> None:
        py = getattr(fn, "fn", None)
        sig = inspect.signature(py) if callable(py) else inspect.Signature()
        params = list(sig.parameters.values())
        constexpr = [i for i, p in enumerate(params) if "constexpr" in str(p.annotation)]
        plain = all(p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params)
        self._names = [p.name for p in params]
        self._defaults = {p.name: p.default for p in params
                          if p.default is not inspect.Parameter.empty}
        #: the keywords a keyed launch may take: the constexprs and the launch options
        self._keywords = frozenset(self._names[i] for i in constexpr) | _OPTIONS
        #: positional arguments a keyed launch may take: those before the first constexpr
        self._positional = constexpr[0] if constexpr else len(params)
        jit = getattr(triton.runtime.jit, "JITFunction", None)
        #: None: not asked yet (at the first launch: the driver may not exist at import)
        self._fast: Optional[bool] = None if (jit is not None and isinstance(fn, jit)
                                              and plain) else False
        self.cache: Dict[Tuple, Tuple[Any, tuple]] = {}
        self.hits = self.misses = 0
        self.fn = fn

    def _setup(self) -> bool:
        self._fast = fast_path_available()
        if self._fast:
            from triton import knobs
            self._runtime = knobs.runtime
            self._knob_values = _knobs()
            self._device = torch.cuda.current_device
            self._stream = triton.runtime.driver.active.get_current_stream
        return self._fast

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def tail(self, args: tuple, kwargs: dict) -> tuple:
        """The bound arguments after the positional ones, in signature order: each
        parameter's keyword value, else its default (the JIT's binder, which passes
        every parameter to the launcher, constexprs included)."""
        return tuple(kwargs[k] if k in kwargs else self._defaults[k]
                     for k in self._names[len(args):])

    def _key(self, grid, args: tuple, kwargs: dict):
        """The cache key of a launch, or None where the JIT must take it."""
        if (not ENABLED or len(args) > self._positional or type(grid) not in (tuple, list)
                or not kwargs.keys() <= self._keywords
                or getattr(self.fn, "pre_run_hooks", None)):
            return None
        if self._fast is None and not self._setup():
            return None
        if not self._fast:
            return None
        kw = []
        for k, v in kwargs.items():
            if type(v) not in _KEYWORD_TYPES:
                return None
            kw.append((k, type(v), v))
        try:
            pos = tuple([spec(a) for a in args])
        except _Unkeyed:
            return None
        return (self._device(), pos, tuple(kw), self._knob_values())

    def launch(self, grid, args: tuple, kwargs: dict):
        fn = getattr(self._module, self._name)
        if fn is not self.fn:                # (the module's kernel replaced: a test's spy)
            self._bind(fn)
        if self._fast is False:
            return fn[grid](*args, **kwargs)
        key = self._key(grid, args, kwargs)
        if key is None:
            return fn[grid](*args, **kwargs)
        hit = self.cache.get(key)
        if hit is None:
            self.misses += 1
            kernel = fn[grid](*args, **kwargs)
            if (getattr(kernel, "function", None) is not None
                    and hasattr(kernel, "packed_metadata")
                    and all(k in kwargs or k in self._defaults
                            for k in self._names[len(args):])):
                self.cache[key] = (kernel, self.tail(args, kwargs))
            return kernel
        self.hits += 1
        kernel, tail = hit
        full = args + tail
        dev = key[0]
        stream = self._stream(dev)
        n = len(grid)
        rt = self._runtime
        kernel.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream,
                   kernel.function, kernel.packed_metadata,
                   kernel.launch_metadata(grid, stream, *full),
                   rt.launch_enter_hook, rt.launch_exit_hook, *full)
        return kernel
