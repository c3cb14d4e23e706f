"""Triton launches without the JIT's per-call work: the compiled kernel looked up by a
key computed in a few Python operations, then launched through its own launcher.

``kernel[grid](*args, **constexprs)`` on a ``triton.jit`` function binds every argument,
specialises each one in C, formats the specialisation and the options into a string
cache key, looks the compiled kernel up by it, and only then launches.  At GPT-2's 148
tensors an optimizer iteration makes 4 to 7 launches, and on a GPU host that binding is
a visible share of the optimizer's host time.  :class:`Launcher` keeps, per call site
and specialisation, the compiled kernel the JIT returned the first time, and launches it
the way the JIT does (``CompiledKernel.run`` with every bound argument, constexprs
included, in signature order: Triton >= 3.3).

**The key is at least as fine as Triton's specialisation** (:func:`spec`), so two calls
with the same key get the same compiled kernel from the JIT: per tensor its dtype and
whether its address is a multiple of 16; per integer whether it is 1, 0 or a multiple
of 16 and its width (i32, i64, u64); per bool, float and None its type; per constexpr
(keyword) its value; plus the current device.  An argument of any other type, the
interpreter (``TRITON_INTERPRET=1``), a Triton older than 3.3 or ``ENABLED = False``
send the call to the JIT unchanged.  ``tests/kernels/test_triton_launch.py`` checks the
key against Triton's own specialiser and the argument order against its binder; on a GPU
the fast launch is compared with the JIT's bit for bit.
"""
from __future__ import annotations

import inspect
from typing import Any, Dict, Tuple

import torch
import triton

__all__ = ["Launcher", "spec", "ENABLED", "fast_path_available"]

#: False: every launch goes through the JIT (for comparisons and debugging)
ENABLED = True

_I32_LO, _I32_HI, _I64_HI = -(1 << 31), (1 << 31) - 1, (1 << 63) - 1


class _Unkeyed(Exception):
    """An argument :func:`spec` does not know: the call goes through the JIT."""


def spec(a: Any):
    """The part of argument ``a`` that Triton's specialisation can depend on (or a finer
    one); raises :class:`_Unkeyed` for a type it does not know."""
    t = type(a)
    if t is bool:
        return t
    if t is int:
        width = 0 if _I32_LO <= a <= _I32_HI else (1 if a <= _I64_HI else 2)
        return (a == 1, a == 0, a & 15 == 0, width)
    if t is float or a is None:
        return t
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() & 15 == 0)
    raise _Unkeyed(t)


def fast_path_available() -> bool:
    """Whether launches can skip the JIT here: a GPU build of Triton >= 3.3, not the
    interpreter."""
    try:
        major, minor = (int(x) for x in triton.__version__.split(".")[:2])
        from triton import knobs
        return (major, minor) >= (3, 3) and not knobs.runtime.interpret
    except Exception:                      # pragma: no cover - an unexpected Triton
        return False


class Launcher:
    """``Launcher(module, name)[grid](*args, **constexprs)``: launch the ``triton.jit``
    function ``module.name`` (looked up at each launch) as ``fn[grid](*args,
    **constexprs)`` does (the options ``num_warps`` and ``enable_fp_fusion`` among the
    keywords), with the compiled kernel cached per key.  ``hits``/``misses`` count the
    launches each way (misses went through the JIT)."""

    def __init__(self, module, name: str):
        self._module, self._name = module, name
        self._bind(getattr(module, name))

    def _bind(self, fn) -> None:
        self.fn = fn
        self.cache: Dict[Tuple, Tuple[Any, tuple]] = {}
        self.hits = self.misses = 0
        py = getattr(fn, "fn", None)
        sig = inspect.signature(py) if callable(py) else inspect.Signature()
        self._names = list(sig.parameters)
        self._defaults = {k: p.default for k, p in sig.parameters.items()
                          if p.default is not inspect.Parameter.empty}
        #: the keywords a keyed launch may take: the constexprs and the launch options
        self._keywords = frozenset(
            k for k, p in sig.parameters.items()
            if "constexpr" in str(p.annotation)) | {"num_warps", "num_stages", "enable_fp_fusion"}
        jit = getattr(triton.runtime.jit, "JITFunction", None)
        self._fast = jit is not None and isinstance(fn, jit) and fast_path_available()
        if self._fast:
            from triton import knobs
            self._runtime = knobs.runtime
            self._device = torch.cuda.current_device
            self._stream = triton.runtime.driver.active.get_current_stream

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def tail(self, args: tuple, kwargs: dict) -> tuple:
        """The bound arguments after the positional ones, in signature order: each
        parameter's keyword value, else its default (the JIT's binder, which passes
        every parameter to the launcher, constexprs included)."""
        return tuple(kwargs[k] if k in kwargs else self._defaults[k]
                     for k in self._names[len(args):])

    def launch(self, grid, args: tuple, kwargs: dict):
        fn = getattr(self._module, self._name)
        if fn is not self.fn:                # (the module's kernel replaced: a test's spy)
            self._bind(fn)
        if not (self._fast and ENABLED and kwargs.keys() <= self._keywords):
            return self.fn[grid](*args, **kwargs)
        try:
            dev = self._device()
            key = (dev, tuple([spec(a) for a in args]),
                   tuple([(k, type(v), v) for k, v in kwargs.items()]))
            hit = self.cache.get(key)
        except (_Unkeyed, TypeError):            # TypeError: an unhashable keyword value
            return self.fn[grid](*args, **kwargs)
        if hit is None:
            self.misses += 1
            kernel = self.fn[grid](*args, **kwargs)
            if (getattr(kernel, "function", None) is not None
                    and hasattr(kernel, "packed_metadata") and len(args) <= len(self._names)
                    and all(k in kwargs or k in self._defaults
                            for k in self._names[len(args):])):
                self.cache[key] = (kernel, self.tail(args, kwargs))
            return kernel
        self.hits += 1
        kernel, tail = hit
        full = args + tail
        stream = self._stream(dev)
        n = len(grid)
        rt = self._runtime
        kernel.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream,
                   kernel.function, kernel.packed_metadata,
                   kernel.launch_metadata(grid, stream, *full),
                   rt.launch_enter_hook, rt.launch_exit_hook, *full)
        return kernel
