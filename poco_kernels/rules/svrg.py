"""The first-order family's rules: SVRG and alpha-SVRG over SGD (:class:`SGDRule`),
VSGD-PoCo (:class:`VSGDRule`), alpha-SVRG over AdamW (:class:`AdamWRule`): Alg. 1 and 2 of
the paper, and their functional forms (the reference maths composed: what the torch
backend runs and the step and refresh kernels fuse)."""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor

from .. import reference as R
from .._protocol import (COUNTER_REFRESHES, COUNTER_STEPS, KIND_INNER, KIND_OUTER, KIND_REFRESH,
                         KernelRefresh, KernelStep, SampleSpec)
from .._validation import check
from ..kernels.interface import FAMILY_SGD, RefreshHyper, StepFlags, StepHyper
from .base import Rule

__all__ = ["corrected_gradient", "svrg_inner_update", "svrg_adamw_inner_update",
           "svrg_refresh_update", "SGDRule", "VSGDRule", "AdamWRule"]


def corrected_gradient(g_in: Tensor, outer: Optional[Tuple[Tensor, Any]], g_out: Tensor,
                       alpha: float) -> Tensor:
    """``ghat = g_in - alpha (g_at_out - g_out)`` (Alg. 1 l. 7), or ``g_in`` without the outer
    gradient (``outer`` None)."""
    return g_in if outer is None else R.control_variate(g_in, outer[0], g_out, alpha)


def svrg_inner_update(*, mean: Tensor, momentum_buffer: Optional[Tensor], g_in: Tensor,
                      outer: Optional[Tuple[Tensor, Any]], g_out: Tensor,
                      group: Dict[str, Any]) -> Dict[str, Tensor]:
    """SVRG / alpha-SVRG / VSGD-PoCo inner step on flat buffers (Alg. 1 l. 7-8, Alg. 2):
    ``ghat = g_in - alpha (g_at_out - g_out)`` (``outer = (g_at_out, _)``, None before the first
    refresh), then torch.optim.SGD's update.  Returns the new mean (and momentum buffer)."""
    ghat = corrected_gradient(g_in, outer, g_out, group["alpha"])
    m, buf = R.sgd_step(mean, ghat, momentum_buffer, lr=group["lr"], momentum=group["momentum"],
                        dampening=group["dampening"], weight_decay=group["weight_decay"],
                        nesterov=group["nesterov"])
    return {"mean": m} if buf is None else {"mean": m, "momentum_buffer": buf}


def svrg_adamw_inner_update(*, mean: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, g_in: Tensor,
                            outer: Optional[Tuple[Tensor, Any]], g_out: Tensor,
                            group: Dict[str, Any], step: int) -> Dict[str, Tensor]:
    """alpha-SVRG over AdamW: the corrected gradient through torch.optim.AdamW's update."""
    ghat = corrected_gradient(g_in, outer, g_out, group["alpha"])
    beta1, beta2 = group["betas"]
    m, ea, eas = R.adamw_step(mean, ghat, exp_avg, exp_avg_sq, step=step, lr=group["lr"],
                              beta1=beta1, beta2=beta2, eps=group["eps"],
                              weight_decay=group["weight_decay"])
    return {"mean": m, "exp_avg": ea, "exp_avg_sq": eas}


def svrg_refresh_update(*, mean: Tensor, gM: Tensor, sigma: float,
                        eps: Optional[Tensor]) -> Dict[str, Tensor]:
    """The outer refresh of the first-order family: ``g_out = gM`` and the refresh point
    ``theta_out = m (+ sigma eps)``, fixed for the inner loop (Alg. 1, Alg. 2)."""
    return {"g_out": gM.clone(), "theta_out": R.perturb(mean, sigma, eps)}


class _OuterPointRule(Rule):
    """The outer loop shared by the first-order family: ``g_out`` (the mean mega-batch
    gradient) and ``theta_out`` (the point it was taken at), fixed for the inner loop."""

    noisy = False
    uses_hessian = False

    def noise_sigma(self, group) -> float:
        """The posterior's standard deviation (0: a point mass, SVRG)."""
        return 0.0

    def init_buffers(self, b, group) -> Dict[str, Tensor]:
        return {"g_out": torch.zeros(b.numel, device=b.device, dtype=b.dtype),
                "theta_out": torch.zeros(b.numel, device=b.device, dtype=b.dtype)}

    def sample_spec(self, b, group, kind, draw):
        if kind == KIND_OUTER:             # the fixed refresh sample
            return SampleSpec(b.buffers["theta_out"])
        if not self.noisy:
            return SampleSpec(b.buffers["mean"])
        slot = COUNTER_STEPS if kind == KIND_INNER else COUNTER_REFRESHES
        return SampleSpec(b.buffers["mean"], (kind, draw, slot, 1.0),
                          sigma=self.noise_sigma(group))

    def refresh_update(self, b, group, gM, geM, first, view):
        eps = view.eps(b, KIND_REFRESH, 0, view.refreshes) if self.noisy else None
        return svrg_refresh_update(mean=b.buffers["mean"], gM=gM,
                                   sigma=self.noise_sigma(group), eps=eps)

    def kernel_refresh(self, b, group, view) -> KernelRefresh:
        """The refresh kernel's records: :func:`svrg_refresh_update`."""
        return KernelRefresh(FAMILY_SGD, h=None, g_out=b.buffers["g_out"], h_out=None,
                             m_out=b.buffers["theta_out"], sigma_out=None,
                             hp=RefreshHyper.sgd(sigma=float(self.noise_sigma(group))))


class SGDRule(_OuterPointRule):
    """SVRG / alpha-SVRG: ``torch.optim.SGD``'s update of the corrected gradient; the
    momentum buffer is made at the first step that uses it, as in ``torch.optim.SGD``."""

    lazy_buffers = ("momentum_buffer",)

    def inner_update(self, b, group, g_in, ge_in, outer, t, view):
        return svrg_inner_update(mean=b.buffers["mean"],
                                 momentum_buffer=b.buffers.get("momentum_buffer"), g_in=g_in,
                                 outer=outer, g_out=b.buffers["g_out"], group=group)

    def kernel_step(self, b, group, view) -> KernelStep:
        """The step kernel's records: :func:`svrg_inner_update`."""
        mom = group["momentum"]
        first = 0.0
        if mom != 0 and "momentum_buffer" not in b.buffers:   # torch.optim.SGD: buf = d_p
            b.buffers["momentum_buffer"] = b.new_buffer()
            view.expose(b)
            first = 1.0
        return KernelStep(s1=b.buffers.get("momentum_buffer"), s2=None,
                          hp=StepHyper.sgd(lr=group["lr"], wd=group["weight_decay"],
                                           alpha=group["alpha"], momentum=mom,
                                           dampening=group["dampening"], mom_first=first),
                          flags=StepFlags.sgd(momentum=mom != 0, nesterov=group["nesterov"]))


class VSGDRule(SGDRule):
    """VSGD-PoCo: :class:`SGDRule` on the mean of an isotropic Gaussian, ``sigma`` per
    group: the inner sample at every step, the refresh sample once per refresh."""

    noisy = True

    def noise_sigma(self, group) -> float:
        return float(group["sigma"])


class AdamWRule(_OuterPointRule):
    """alpha-SVRG over AdamW: ``torch.optim.AdamW``'s update of the corrected gradient."""

    def check_state_value(self, name, t, group, what):
        if name == "exp_avg_sq":
            check(bool((t >= 0).all()), f"{what}: a second moment must be >= 0")

    def init_buffers(self, b, group):
        bufs = super().init_buffers(b, group)
        bufs["exp_avg"] = torch.zeros(b.numel, device=b.device, dtype=b.dtype)
        bufs["exp_avg_sq"] = torch.zeros(b.numel, device=b.device, dtype=b.dtype)
        return bufs

    def inner_update(self, b, group, g_in, ge_in, outer, t, view):
        return svrg_adamw_inner_update(mean=b.buffers["mean"], exp_avg=b.buffers["exp_avg"],
                                       exp_avg_sq=b.buffers["exp_avg_sq"], g_in=g_in,
                                       outer=outer, g_out=b.buffers["g_out"], group=group,
                                       step=t)

    def kernel_step(self, b, group, view) -> KernelStep:
        """The step kernel's records: :func:`svrg_adamw_inner_update`."""
        beta1, beta2 = group["betas"]
        return KernelStep(s1=b.buffers["exp_avg"], s2=b.buffers["exp_avg_sq"],
                          hp=StepHyper.adamw(lr=group["lr"], beta1=beta1, beta2=beta2,
                                             wd=group["weight_decay"], eps=group["eps"],
                                             alpha=group["alpha"]),
                          flags=StepFlags.adamw())
