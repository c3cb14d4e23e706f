"""The typed interface of the fused kernels, stated once.

Each record below names, in order, the scalars or switches that one kernel family takes.
The Triton kernels (:mod:`~poco_kernels.kernels.triton_kernels`) have parameters of the
same names in the same order; the C++ operators read them through the X-macros of
``csrc/poco_kernels.h`` (``POCO_STEP_HYPER``, ``POCO_STEP_FLAGS``, ``POCO_REFRESH_HYPER``,
``POCO_REFRESH_FLAGS``); ``tests/repo/test_architecture.py`` fails if the three disagree in
names, order or count.

Every field is required: a record built without one raises ``TypeError`` (never a silent
default).  One record per kernel and kind: the rules fill a step's and a refresh's
hyperparameters and switches through the per-family constructors
(:meth:`StepHyper.ivon`, :meth:`StepFlags.sgd`, :meth:`RefreshHyper.ivon`, ...), which
name exactly the fields that family reads and set the others to zero; the host engine
sets its own fields on the same record (:meth:`StepHyper.counted`,
:meth:`StepFlags.routed`, :meth:`RefreshHyper.counted`).

**Hyperparameters reach the kernels as a row** (:func:`hyper_row`): the record's values
as one float64 tensor on the kernels' device, field ``i`` at index ``i``.  The kernels
read them there, not as launch arguments, so a value that changes between steps (a
learning-rate schedule, an alpha schedule) needs no new launch arguments: a captured
CUDA graph replays with the values the row holds at replay time.  A field may be a
Python float or a one-element tensor (``lr=torch.tensor(...)``, as ``torch.optim``'s
capturable optimizers take it), copied into the row on the device.  Both kernel sets
turn the float64 values into their float32 constants the same way, in double (the
reference's Python floats are doubles): ``csrc/ops.cpp`` and ``csrc/ops_update.cpp`` on
the host, the Triton kernels at the start of each program.

No triton and no extension import here: both kernel wrappers and the host engine use it.
"""
from __future__ import annotations

from itertools import compress
from typing import NamedTuple

import torch

from ..noise import STREAM_VERSION as _STREAM_VERSION

__all__ = ["SIGMA_NONE", "SIGMA_IVON", "SIGMA_BUFFER", "SIGMA_CONST", "FAMILY_IVON",
           "FAMILY_SGD", "FAMILY_ADAMW", "FAMILIES", "CTL_STEPS", "CTL_REFRESHES", "CTL_BAD",
           "CTL_SKIPPED", "CTL_SIZE", "StepHyper", "StepFlags", "StepStreams",
           "RefreshHyper", "RefreshFlags", "SampleHyper",
           "HYPER_RECORDS", "require", "hyper_row", "hyper_value"]

# ``sigma`` of a sample (``sample``)
SIGMA_NONE, SIGMA_IVON, SIGMA_BUFFER, SIGMA_CONST = 0, 1, 2, 3
# update family of ``step`` / ``refresh``
FAMILY_IVON, FAMILY_SGD, FAMILY_ADAMW = 0, 1, 2
FAMILIES = {"ivon": FAMILY_IVON, "sgd": FAMILY_SGD, "adamw": FAMILY_ADAMW}
# slots of the control tensor (int64, one per device): steps taken, refreshes taken,
# bad-gradient flag, skipped updates
CTL_STEPS, CTL_REFRESHES, CTL_BAD, CTL_SKIPPED = 0, 1, 2, 3
CTL_SIZE = 4


class StepHyper(NamedTuple):
    """Every float the step kernel takes.  An optimizer's rule fills the hyperparameters
    through the per-family constructors (:meth:`ivon`, :meth:`sgd`, :meth:`adamw`), which
    name exactly the fields that family reads and set the others to zero; the host engine
    then sets the first three, which depend on what was collected (:meth:`counted`)."""
    sign_at_out: float   # host engine: sign of the outer draw (antithetic: -1)
    inv_n_in: float      # host engine: 1 / number of inner gradients summed
    inv_n_at_out: float  # host engine: 1 / number of outer gradients summed (0: no correction)
    lr: float            # IVON: already ivon_lr (rescaled)
    beta1: float         # IVON momentum / AdamW beta1
    beta2: float         # IVON Hessian / AdamW beta2
    wd: float            # weight decay
    ess: float           # IVON: effective sample size
    alpha: float         # correction weight
    hess_corr: float     # IVON-PoCo: scale c of the Hessian-correction term
    floor: float         # IVON-PoCo: hess_floor c (hhat >= -c (h + wd))
    clip: float          # IVON: clip radius
    momentum: float      # SGD momentum
    dampening: float     # SGD dampening
    eps: float           # AdamW eps
    mom_first: float     # SGD: 1 when the momentum buffer is created by this step

    @classmethod
    def ivon(cls, *, lr, beta1, beta2, wd, ess, alpha, hess_corr, floor, clip) -> "StepHyper":
        # (positional, in field order: sign_at_out, inv_n_in, inv_n_at_out, lr, beta1, beta2,
        # wd, ess, alpha, hess_corr, floor, clip, momentum, dampening, eps, mom_first)
        return cls._make((1.0, 1.0, 0.0, lr, beta1, beta2, wd, ess, alpha, hess_corr, floor,
                          clip, 0.0, 0.0, 0.0, 0.0))

    @classmethod
    def sgd(cls, *, lr, wd, alpha, momentum, dampening, mom_first) -> "StepHyper":
        return cls(sign_at_out=1.0, inv_n_in=1.0, inv_n_at_out=0.0, lr=lr, beta1=0.0, beta2=0.0,
                   wd=wd, ess=1.0, alpha=alpha, hess_corr=0.0, floor=0.0, clip=0.0, momentum=momentum,
                   dampening=dampening, eps=0.0, mom_first=mom_first)

    @classmethod
    def adamw(cls, *, lr, beta1, beta2, wd, eps, alpha) -> "StepHyper":
        return cls(sign_at_out=1.0, inv_n_in=1.0, inv_n_at_out=0.0, lr=lr, beta1=beta1, beta2=beta2,
                   wd=wd, ess=1.0, alpha=alpha, hess_corr=0.0, floor=0.0, clip=0.0,
                   momentum=0.0, dampening=0.0, eps=eps, mom_first=0.0)

    def counted(self, *, sign_at_out: float, inv_n_in: float, inv_n_at_out: float) -> "StepHyper":
        """This record with the host engine's three fields set (and every value a float or
        a one-element tensor, :func:`hyper_value`)."""
        return self._make((float(sign_at_out), float(inv_n_in), float(inv_n_at_out),
                           *hyper_values(self[3:])))


#: bit i of the switches' word (:meth:`StepFlags.bits`, :meth:`RefreshFlags.bits`)
_BITS = tuple(1 << i for i in range(32))


class StepFlags(NamedTuple):
    """The step kernel's code path: the family, five switches the host engine sets per call
    (:meth:`routed`), then the optimizer's switches, set by the per-family constructors
    (:meth:`ivon`, :meth:`sgd`, :meth:`adamw`).  Triton takes each as a ``constexpr`` of
    the upper-case name; the C++ operator takes ``family`` and the rest packed by
    :meth:`bits`."""
    family: int
    corr: bool           # host engine: the correction is applied (outer gradient collected)
    ge_in: bool          # host engine: the inner gradient * eps was summed (several draws)
    ge_at_out: bool      # host engine: the outer gradient * eps was summed
    shared_noise: bool   # host engine: the outer draw reuses the inner draw's eps
    next_sample: bool    # host engine, IVON: write the next step's inner sample, not the mean
    hess_corr: bool      # IVON-PoCo: the Hessian-correction term of the mean update
    floor: bool          # IVON-PoCo: hess_floor
    clip: bool           # IVON: finite clip radius
    debias: bool         # IVON: momentum debiasing
    momentum: bool       # SGD: momentum buffer
    nesterov: bool       # SGD: Nesterov

    @classmethod
    def ivon(cls, *, hess_corr, floor, clip, debias) -> "StepFlags":
        return cls(FAMILY_IVON, False, False, False, False, False, bool(hess_corr),
                   bool(floor), bool(clip), bool(debias), False, False)

    @classmethod
    def sgd(cls, *, momentum, nesterov) -> "StepFlags":
        return cls(FAMILY_SGD, False, False, False, False, False, False, False, False, False,
                   bool(momentum), bool(nesterov))

    @classmethod
    def adamw(cls) -> "StepFlags":
        return cls(FAMILY_ADAMW, *([False] * 11))

    def routed(self, *, corr, ge_in, ge_at_out, shared_noise, next_sample) -> "StepFlags":
        """This record with the host engine's five switches set."""
        return self._make((self[0], bool(corr), bool(ge_in), bool(ge_at_out),
                           bool(shared_noise), bool(next_sample), *self[6:]))

    def bits(self) -> int:
        """The switches (all fields but ``family``) as bits 0, 1, ... in field order."""
        return sum(compress(_BITS, self[1:]))

    def constexprs(self) -> dict:
        """Triton's ``constexpr`` arguments: the upper-case field names."""
        return {k.upper(): v for k, v in self._asdict().items()}


class StepStreams(NamedTuple):
    """The step's noise words: the key, the inner and outer stream ids, and the stream
    definition (``noise``: 1 or 2, :mod:`poco_kernels.noise`; Triton's ``NOISE``)."""
    seed: int
    stream: int
    stream_at_out: int
    noise: int = _STREAM_VERSION


class RefreshHyper(NamedTuple):
    """Every float the refresh kernel takes: the host engine's ``inv_n`` (:meth:`counted`),
    then the optimizer's hyperparameters, set by the per-family constructors
    (:meth:`ivon`, :meth:`sgd`)."""
    inv_n: float         # host engine: 1 / number of mega-batch chunks (and draws) summed
    ess: float
    wd: float
    rho1: float          # outer momentum of g_out (weights the OLD estimate)
    rho2: float          # outer momentum of h_out
    sigma: float         # VSGD-PoCo: the constant sigma of the refresh sample

    @classmethod
    def ivon(cls, *, ess, wd, rho1, rho2) -> "RefreshHyper":
        return cls(inv_n=1.0, ess=ess, wd=wd, rho1=rho1, rho2=rho2, sigma=0.0)

    @classmethod
    def sgd(cls, *, sigma) -> "RefreshHyper":
        return cls(inv_n=1.0, ess=1.0, wd=0.0, rho1=0.0, rho2=0.0, sigma=sigma)

    def counted(self, *, inv_n: float) -> "RefreshHyper":
        """This record with the host engine's ``inv_n`` set (values as :func:`hyper_value`)."""
        return self._make((float(inv_n), *hyper_values(self[1:])))


class SampleHyper(NamedTuple):
    """Every float the sample kernel takes: sigma's terms (IVON's ``ess`` and ``wd``, or
    the constant ``sigma`` of VSGD-PoCo)."""
    ess: float
    wd: float
    sigma: float


#: the records that travel as rows, and the kernel that reads each
HYPER_RECORDS = {"step": StepHyper, "refresh": RefreshHyper, "sample": SampleHyper}


class RefreshFlags(NamedTuple):
    """The refresh kernel's code path (Triton ``constexpr`` of the upper-case names)."""
    family: int
    ge: bool             # the gradient * eps was summed (several draws)
    noisy: bool          # the refresh sample has noise

    def bits(self) -> int:
        return sum(compress(_BITS, self[1:]))

    def constexprs(self) -> dict:
        return {k.upper(): v for k, v in self._asdict().items()}


def hyper_value(v):
    """A hyperparameter's value for a row: a float, or a one-element tensor kept as it is
    (read on the device, never on the host)."""
    if isinstance(v, torch.Tensor):
        return v
    return float(v)


_value = hyper_value


#: the types of plain numbers (``isinstance(v, Tensor)`` costs more than a type lookup)
PLAIN_NUMBERS = frozenset((float, int, bool))


def hyper_values(values) -> tuple:
    """:func:`hyper_value` of each of ``values`` (C-speed passes where each is a plain
    number, the usual case)."""
    if set(map(type, values)) <= PLAIN_NUMBERS:
        return tuple(map(float, values))
    return tuple(map(hyper_value, values))


def hyper_row(hp, cls, device=None) -> torch.Tensor:
    """The row of a ``cls`` record for the kernels: ``hp`` itself when it is one already
    (a float64 tensor of one value per field), else the record's values in a new float64
    tensor on ``device`` (what a direct caller of the kernels passes; the optimizers keep
    their rows, :mod:`poco_kernels.backends.hyper`).  Anything else is a TypeError that
    names the record."""
    n = len(cls._fields)
    if isinstance(hp, torch.Tensor):
        if hp.dtype != torch.float64 or hp.dim() != 1 or hp.numel() != n \
                or not hp.is_contiguous():
            raise TypeError(f"hp must be a {cls.__name__} or its row (a contiguous float64 "
                            f"tensor of {n} values: {', '.join(cls._fields)}), got a "
                            f"{hp.dtype} tensor of shape {tuple(hp.shape)}")
        return hp
    hp = require(hp, cls, "hp")
    row = torch.tensor([0.0 if isinstance(v, torch.Tensor) else float(v) for v in hp],
                       dtype=torch.float64)
    row = row.to(device) if device is not None else row
    for i, v in enumerate(hp):
        if isinstance(v, torch.Tensor):
            row[i].copy_(v.detach().reshape(()))
    return row


def require(record, cls, what: str):
    """``record`` if it is a ``cls``; else a TypeError (the kernels take records by name,
    never positional lists)."""
    if not isinstance(record, cls):
        raise TypeError(f"{what} must be a poco_kernels.kernels.interface.{cls.__name__}, "
                        f"got {type(record).__name__}")
    return record
