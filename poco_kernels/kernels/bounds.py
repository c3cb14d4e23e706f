"""Running error bounds of float32 arithmetic, evaluated in float64.

A :class:`Tracked` value is a float64 tensor ``v`` (the exact result of the maths on the
exact inputs, to float64 precision) and a float64 tensor ``e`` that bounds how far a
float32 computation of it, operation by operation in a given order, can be from ``v``.
Each operation propagates the errors of its operands and adds the rounding of its own
result: with round-to-nearest, ``|fl(x) - x| <= u |x|`` (``u = 2**-24``) for a normal
result, and at most half the smallest subnormal (``TINY``) below that.  The bounds are
rigorous, second-order terms included (``e_a e_b`` of a product, the computed operand's
own rounding ``u (|v| + e)``), for the operations the kernels use: ``+ - * /``, square
root, selects, min/max (1-Lipschitz) and the rounding of a float64 constant to float32.

:mod:`poco_kernels.kernels.openloop` writes each kernel's arithmetic with these, in the
kernel's order (``csrc/kernels_*.h``, ``triton_kernels.py``): the bound of an output
element is then justified by the operations that produced it, and a kernel output is
within it of the reference maths evaluated in float64 (``|out - v| <= e``), whatever the
cancellation in the element's inputs.  Where there is none, ``e`` is a few ulps of the
result: one half-ulp per rounding on the element's path, scaled by how each operation
propagates it.
"""
from __future__ import annotations

from typing import Union

import torch
from torch import Tensor

#: unit roundoff of float32, round to nearest
U = 2.0 ** -24
#: the largest rounding error of a float32 result in the subnormal range (half of 2**-149)
TINY = 2.0 ** -150
#: the float64 evaluation of the bounds rounds too: a relative margin far above it
SLACK = 1.0 + 1e-9

Num = Union[float, int, Tensor]


def _t(x) -> Tensor:
    return x if isinstance(x, Tensor) else torch.tensor(float(x), dtype=torch.float64)


def f32(x: Num) -> Tensor:
    """``x`` (float64) rounded to float32, back in float64."""
    return _t(x).double().to(torch.float32).double()


class Tracked:
    """A float32 computation's exact value ``v`` and error bound ``e`` (float64)."""

    __slots__ = ("v", "e")

    def __init__(self, v: Num, e: Num = 0.0):
        self.v = _t(v).double()
        self.e = _t(e).double()

    # ------------------------------------------------------------------ leaves
    @staticmethod
    def exact(x: Tensor) -> "Tracked":
        """A float32 (or narrower) input: exact."""
        return Tracked(x.double(), 0.0)

    @staticmethod
    def const(c: Num) -> "Tracked":
        """A constant the kernels compute in double and round once to float32 (or a
        float32 literal of the source): its exact value ``c``, its rounding error exact."""
        c = _t(c).double()
        return Tracked(c, (f32(c) - c).abs())

    @staticmethod
    def lift(x: "Num | Tracked") -> "Tracked":
        if isinstance(x, Tracked):
            return x
        if isinstance(x, Tensor) and x.dtype != torch.float64:
            return Tracked.exact(x)
        return Tracked.const(x)

    # ------------------------------------------------------------------ rounding
    @staticmethod
    def _rounded(v: Tensor, e: Tensor) -> "Tracked":
        """The result of one float32 operation whose exact-operand error is ``e``: plus
        the rounding of the computed result (within ``|v| + e`` of zero)."""
        return Tracked(v, (e * (1.0 + U) + U * v.abs() + TINY) * SLACK)

    # ------------------------------------------------------------------ arithmetic
    def __add__(self, o) -> "Tracked":
        o = Tracked.lift(o)
        return Tracked._rounded(self.v + o.v, self.e + o.e)

    __radd__ = __add__

    def __sub__(self, o) -> "Tracked":
        o = Tracked.lift(o)
        return Tracked._rounded(self.v - o.v, self.e + o.e)

    def __rsub__(self, o) -> "Tracked":
        return Tracked.lift(o) - self

    def __neg__(self) -> "Tracked":
        return Tracked(-self.v, self.e)

    def __mul__(self, o) -> "Tracked":
        o = Tracked.lift(o)
        e = self.v.abs() * o.e + o.v.abs() * self.e + self.e * o.e
        return Tracked._rounded(self.v * o.v, e)

    __rmul__ = __mul__

    def __truediv__(self, o) -> "Tracked":
        o = Tracked.lift(o)
        v = self.v / o.v
        room = o.v.abs() - o.e                   # the computed divisor is at least this
        e = torch.where(room > 0, (self.e + v.abs() * o.e) / room.clamp_min(1e-300),
                        torch.full_like(v, float("inf")))
        return Tracked._rounded(v, e)

    def __rtruediv__(self, o) -> "Tracked":
        return Tracked.lift(o) / self

    def sqrt(self) -> "Tracked":
        v = self.v.clamp_min(0.0).sqrt()
        lo = (self.v - self.e).clamp_min(0.0).sqrt()
        # |sqrt(x) - sqrt(y)| = |x - y| / (sqrt(x) + sqrt(y)) <= e / (sqrt(v) + sqrt(v - e))
        e = torch.where(v + lo > 0, self.e / (v + lo).clamp_min(1e-300), self.e.sqrt())
        return Tracked._rounded(v, e)

    # ------------------------------------------------------------------ selects
    @staticmethod
    def where(cond: Tensor, a, b) -> "Tracked":
        """A select on an exact condition (a flag, a counter, an exact comparison)."""
        a, b = Tracked.lift(a), Tracked.lift(b)
        return Tracked(torch.where(cond, a.v, b.v), torch.where(cond, a.e, b.e))

    @staticmethod
    def maximum(a, b) -> "Tracked":
        """``max(a, b)``: 1-Lipschitz in each operand, so the larger error bounds it."""
        a, b = Tracked.lift(a), Tracked.lift(b)
        return Tracked(torch.maximum(a.v, b.v), torch.maximum(a.e, b.e))

    @staticmethod
    def clamp(x, lo, hi) -> "Tracked":
        """``min(max(x, lo), hi)`` (clipping)."""
        x, lo, hi = Tracked.lift(x), Tracked.lift(lo), Tracked.lift(hi)
        v = torch.minimum(torch.maximum(x.v, lo.v), hi.v)
        return Tracked(v, torch.maximum(torch.maximum(x.e, lo.e), hi.e))

    # ------------------------------------------------------------------ stores
    def stored_as(self, dtype: torch.dtype) -> "Tracked":
        """A float32 result stored in ``dtype`` rounding to nearest (the parameters): plus
        half an ulp of ``dtype`` at the computed value."""
        if dtype == torch.float32:
            return self
        mant = {torch.bfloat16: 8, torch.float16: 11}[dtype]
        tiny = {torch.bfloat16: 2.0 ** -134, torch.float16: 2.0 ** -25}[dtype]
        mag = self.v.abs() + self.e
        return Tracked(self.v, (self.e + mag * 2.0 ** -mant + tiny) * SLACK)

    def stochastically_rounded(self) -> "Tracked":
        """A float32 result stored in bfloat16 with stochastic rounding (``state_dtype``):
        within one bfloat16 ulp (at most ``2**-7`` relative) of the computed value."""
        mag = self.v.abs() + self.e
        return Tracked(self.v, (self.e + mag * 2.0 ** -7 + 2.0 ** -133) * SLACK)

    def check(self, out: Tensor) -> Tensor:
        """``|out - v| / e`` per element (<= 1: within the bound; NaN or inf: outside)."""
        d = (out.double() - self.v).abs()
        ratio = d / self.e.clamp_min(1e-300)
        return torch.where(d == 0, torch.zeros_like(ratio), ratio)
