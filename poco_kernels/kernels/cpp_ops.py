"""Host wrappers of the C++ kernels (``csrc/``, the extension ``poco_kernels._C``).

The operators ``torch.ops.poco_kernels_cpp.*`` are registered by the extension with the
same arguments as the Triton wrappers in :mod:`poco_kernels.kernels.triton_ops`, so the
host engine (``poco_kernels/backends/fused.py``) calls either module the same way.  Here:
load the extension, register the fake (meta) kernels that ``torch.compile`` needs, and
expose one function per operation.  Import this module only when
:func:`poco_kernels.kernels.cpp_status` says the extension can be used.
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

import poco_kernels._C  # noqa: F401  (registers torch.ops.poco_kernels_cpp)

from .interface import (RefreshFlags, RefreshHyper, SampleHyper, StepFlags, StepHyper,
                        StepStreams, hyper_row, require)

__all__ = ["sample", "accumulate", "check", "fold_ge", "step", "refresh", "finish", "randn", "isa",
           "set_isa", "available_isas", "prepare"]

_ops = torch.ops.poco_kernels_cpp

# The operators mutate their arguments in place (declared in their schemas) and return
# nothing: under torch.compile their fake kernels have nothing to compute.
for _name in ("sample", "accumulate", "check", "fold_ge", "step", "refresh", "finish", "randn"):
    torch.library.register_fake(f"poco_kernels_cpp::{_name}")(lambda *args, **kwargs: None)


def sample(param: Tensor, centre: Tensor, mean: Tensor, h: Optional[Tensor],
           sigma: Optional[Tensor], ctl: Tensor, seed: int, noise: int, stream: int,
           counter_slot: int, hp, sign: float, sigma_mode: int, sync: bool,
           offset: int = 0) -> None:
    """``param = centre + sigma * sign * eps`` (see ``triton_kernels.sample_kernel``).
    ``hp``: a ``SampleHyper`` or its row (:func:`~poco_kernels.kernels.interface.hyper_row`;
    the same in every operator below); ``noise``: the stream definition, 1 or 2
    (:mod:`poco_kernels.noise`); ``offset``: the stream index of element 0 (a shard's place
    in its unsharded bucket)."""
    _call("sample", _sample_args(param, centre, mean, h, sigma, ctl, seed, noise, stream,
                                 counter_slot, hp, sign, sigma_mode, sync, offset))


def _sample_args(param, centre, mean, h, sigma, ctl, seed, noise, stream, counter_slot, hp,
                 sign, sigma_mode, sync, offset=0) -> tuple:
    return (param, centre, mean, h, sigma, ctl, seed, noise, stream, counter_slot,
            hyper_row(hp, SampleHyper), float(sign), sigma_mode, sync, int(offset))


def accumulate(grad: Tensor, acc_g: Tensor, acc_ge: Optional[Tensor], ctl: Tensor, seed: int,
               noise: int, stream: int, counter_slot: int, sign: float, first: bool,
               ge: bool, offset: int = 0) -> None:
    """``acc_g (+)= g`` (and ``acc_ge += g * eps``); flags non-finite gradients in ``ctl``."""
    _ops.accumulate(grad, acc_g, acc_ge, ctl, seed, noise, stream, counter_slot, float(sign),
                    first, ge, int(offset))


def check(grad: Tensor, ctl: Tensor) -> None:
    """Flag a non-finite element of ``grad`` in ``ctl`` (reads ``grad`` only)."""
    _ops.check(grad, ctl)


def fold_ge(acc_g: Tensor, acc_ge: Tensor, ctl: Tensor, seed: int, noise: int, stream: int,
            counter_slot: int, sign: float, offset: int = 0) -> None:
    """``acc_ge = acc_g * eps`` of draw 0."""
    _ops.fold_ge(acc_g, acc_ge, ctl, seed, noise, stream, counter_slot, float(sign), int(offset))


def step(mean: Tensor, param: Tensor, s1: Optional[Tensor], s2: Optional[Tensor],
         g_in: Tensor, ge_in: Optional[Tensor], g_at_out: Optional[Tensor],
         ge_at_out: Optional[Tensor],
         g_out: Optional[Tensor], h_out: Optional[Tensor], m_out: Optional[Tensor],
         sigma_out: Optional[Tensor], ctl: Tensor, found_inf: Optional[Tensor],
         grad_scale: Optional[Tensor], streams: StepStreams, hp,
         flags: StepFlags, offset: int = 0) -> None:
    """One inner step of every optimizer of the diagonal family (``step_kernel``); the
    records of :mod:`~poco_kernels.kernels.interface` are read by name in ``csrc/``."""
    _call("step", _step_args(mean, param, s1, s2, g_in, ge_in, g_at_out, ge_at_out, g_out,
                             h_out, m_out, sigma_out, ctl, found_inf, grad_scale, streams, hp,
                             flags, offset))


def _step_args(mean, param, s1, s2, g_in, ge_in, g_at_out, ge_at_out, g_out, h_out, m_out,
               sigma_out, ctl, found_inf, grad_scale, streams, hp, flags, offset=0) -> tuple:
    streams = require(streams, StepStreams, "streams")
    flags = require(flags, StepFlags, "flags")
    return (mean, param, s1, s2, g_in, ge_in, g_at_out, ge_at_out, g_out, h_out, m_out,
            sigma_out, ctl, found_inf, grad_scale, int(streams.seed), int(streams.noise),
            int(streams.stream), int(streams.stream_at_out), hyper_row(hp, StepHyper),
            int(flags.family), flags.bits(), int(offset))


def refresh(mean: Tensor, h: Optional[Tensor], acc_g: Tensor, acc_ge: Optional[Tensor],
            g_out: Tensor, h_out: Optional[Tensor], m_out: Tensor, sigma_out: Optional[Tensor],
            ctl: Tensor, found_inf: Optional[Tensor], grad_scale: Optional[Tensor], seed: int,
            noise: int, stream: int, hp, flags: RefreshFlags,
            offset: int = 0) -> None:
    """The outer refresh (``refresh_kernel``)."""
    flags = require(flags, RefreshFlags, "flags")
    _ops.refresh(mean, h, acc_g, acc_ge, g_out, h_out, m_out, sigma_out, ctl, found_inf,
                 grad_scale, seed, noise, stream, hyper_row(hp, RefreshHyper),
                 int(flags.family), flags.bits(), int(offset))


def prepare(name: str, args: tuple):
    """A call of this module's ``name`` with ``args`` (a step plan's, replayed many
    times), prepared once: the operator and the arguments this module would pass it, so
    that ``fn(*args)`` is that call without the records' conversions."""
    if name == "sample":
        return _bound(name, _sample_args(*args))
    if name == "step":
        return _bound(name, _step_args(*args))
    if name in ("check", "finish"):
        return _bound(name, tuple(args))
    return globals()[name], tuple(args)


#: the argument types the extension's one-shot call takes as torch.ops would (anything
#: else, a tensor subclass with its own ``__torch_function__``, goes through torch.ops)
_PLAIN_ARGS = frozenset((torch.Tensor, torch.nn.Parameter, int, float, bool, str, type(None)))


def _call(name: str, args: tuple) -> None:
    """The operator ``name`` called once with ``args``: bound and called by the extension
    (the same dispatcher call as through ``torch.ops``, without the parsing of its many
    arguments against the schema in Python: about 2 us less for the step's 23; while a
    torch function mode is active, ``torch.ops``' own call, which the mode sees as
    before), or through ``torch.ops`` while torch.compile traces (its fake kernel), for
    an argument of another type (a tensor subclass), where binding fails (``torch.ops``
    then raises its own error, which names the argument) or where the extension
    predates ``bind``."""
    op = getattr(_ops, name)
    bind = getattr(poco_kernels._C, "bind", None)
    if bind is None or torch.compiler.is_compiling() or not set(map(type, args)) <= _PLAIN_ARGS:
        op(*args)
        return
    try:
        bound = bind(name, args, op)
    except (RuntimeError, TypeError, ValueError):
        op(*args)
        return
    poco_kernels._C.call(bound)


def _bound(name: str, args: tuple):
    """``(function, arguments)`` calling the operator ``name`` with ``args``: bound once by
    the extension (``_C.bind``: no conversion of the arguments at each call), or through
    ``torch.ops`` (an extension built before it).  Under a torch function mode the call is
    ``torch.ops``' own, the operator packet's, as every other call of this module: a mode
    sees the same object whichever way the engine made the call."""
    op = getattr(_ops, name)
    bind = getattr(poco_kernels._C, "bind", None)
    if bind is None:
        return op, args
    return poco_kernels._C.call, (bind(name, args, op),)   # (op: under a torch function mode)


def finish(ctl: Tensor, found_inf: Optional[Tensor], slot: int) -> None:
    """Advance a counter unless the update was skipped (``finish_kernel``)."""
    _ops.finish(ctl, found_inf, slot)


def randn(out: Tensor, seed: int, counter: int, stream: int, offset: int = 0,
          version: int = 2) -> Tensor:
    """``out[j]`` = the normal of element ``offset + j`` of stream ``(seed, counter,
    stream)``: :func:`poco_kernels.noise.randn` (of that ``version``) by the kernels' own
    noise code."""
    _ops.randn(out, seed, version, counter, stream, offset)
    return out


def isa() -> str:
    """The instruction set the kernels run with: ``'avx512'``, ``'avx2'`` or ``'base'``."""
    return _ops.isa()


def set_isa(name: str) -> str:
    """Use the kernels of another instruction set (``'base'``, ``'avx2'``, ``'avx512'``,
    ``'best'``); returns the previous one.  The environment variable
    ``POCO_KERNELS_CPU_ISA`` sets it at start-up."""
    return _ops.set_isa(name)


def available_isas() -> List[str]:
    """The instruction sets this CPU can run, best last."""
    return list(_ops.supported_isas())
