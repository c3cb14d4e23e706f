"""SVRG, alpha-SVRG (over SGD and over AdamW) and VSGD-PoCo: Alg. 1 and 2 of the paper.

* :class:`SVRG`: ``ghat = grad_B(theta_in) - alpha (grad_B(theta_out) - g_out)`` fed to
  ``torch.optim.SGD``'s update (momentum, dampening, weight decay, Nesterov), op for op.
  ``alpha = 1`` is SVRG, ``alpha < 1`` alpha-SVRG (Yin et al., 2025); before the first
  refresh, or with ``alpha = 0``, it is ``torch.optim.SGD`` exactly.
* :class:`SVRGAdamW`: the same corrected gradient fed to ``torch.optim.AdamW``'s update
  (the paper's alpha-SVRG baseline).
* :class:`VSGDPoCo`: variational SGD with posterior correction, an isotropic Gaussian
  ``N(m, sigma^2 I)``: ``theta_in = m + sigma eps`` at every inner step, and the refresh
  sample ``theta_out = m + sigma eps_r`` stays fixed for the inner loop.  ``sigma = 0`` is
  SVRG (Thm. 2).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor

from . import reference as R
from ._posterior import PosteriorOptimizer
from ._protocol import (COUNTER_REFRESHES, COUNTER_STEPS, KIND_INNER, KIND_OUTER, KIND_REFRESH,
                        KernelRefresh, KernelStep, SampleSpec)
from ._validation import check, check_range
from .kernels.interface import FAMILY_ADAMW, FAMILY_SGD, RefreshHP, StepHP, StepPath

__all__ = ["SVRG", "SVRGAdamW", "VSGDPoCo", "svrg_inner_update", "svrg_adamw_inner_update",
           "svrg_refresh_update"]


def _corrected(g_in: Tensor, outer: Optional[Tuple[Tensor, Any]], g_out: Tensor,
               alpha: float) -> Tensor:
    return g_in if outer is None else R.control_variate(g_in, outer[0], g_out, alpha)


def svrg_inner_update(*, mean: Tensor, momentum_buffer: Optional[Tensor], g_in: Tensor,
                      outer: Optional[Tuple[Tensor, Any]], g_out: Tensor,
                      group: Dict[str, Any]) -> Dict[str, Tensor]:
    """SVRG / alpha-SVRG / VSGD-PoCo inner step on flat buffers (Alg. 1 l. 7-8, Alg. 2):
    ``ghat = g_in - alpha (g_o - g_out)`` (``outer = (g_o, _)``, None before the first
    refresh), then torch.optim.SGD's update.  Returns the new mean (and momentum buffer)."""
    ghat = _corrected(g_in, outer, g_out, group["alpha"])
    m, buf = R.sgd_step(mean, ghat, momentum_buffer, lr=group["lr"], momentum=group["momentum"],
                        dampening=group["dampening"], weight_decay=group["weight_decay"],
                        nesterov=group["nesterov"])
    return {"mean": m} if buf is None else {"mean": m, "momentum_buffer": buf}


def svrg_adamw_inner_update(*, mean: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, g_in: Tensor,
                            outer: Optional[Tuple[Tensor, Any]], g_out: Tensor,
                            group: Dict[str, Any], step: int) -> Dict[str, Tensor]:
    """alpha-SVRG over AdamW: the corrected gradient through torch.optim.AdamW's update."""
    ghat = _corrected(g_in, outer, g_out, group["alpha"])
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


class _SVRGBase(PosteriorOptimizer):
    """Outer loop shared by the first-order family: ``g_out`` (mean mega-batch gradient)
    and ``theta_out`` (the point it was taken at)."""

    noisy = False
    uses_hessian = False

    def _validate_group(self, group):
        check_range(group, "lr", lo=0.0, tensor=True)
        check_range(group, "alpha", lo=0.0, hi=1.0, tensor=True)
        check_range(group, "weight_decay", lo=0.0)

    def _noise_sigma(self, group) -> float:
        return 0.0

    def _init_buffers(self, b, group) -> Dict[str, Tensor]:
        return {"g_out": torch.zeros(b.numel, device=b.device, dtype=b.dtype),
                "theta_out": torch.zeros(b.numel, device=b.device, dtype=b.dtype)}

    def _sample_spec(self, b, group, kind, draw):
        if kind == KIND_OUTER:             # the fixed refresh sample
            return SampleSpec(b.buffers["theta_out"])
        if not self.noisy:
            return SampleSpec(b.buffers["mean"])
        slot = COUNTER_STEPS if kind == KIND_INNER else COUNTER_REFRESHES
        return SampleSpec(b.buffers["mean"], (kind, draw, slot, 1.0),
                          sigma=self._noise_sigma(group))

    def _kernel_refresh(self, b, group) -> KernelRefresh:
        """The refresh kernel's records (first-order family): :func:`svrg_refresh_update`."""
        return KernelRefresh(FAMILY_SGD, h=None, g_out=b.buffers["g_out"], h_out=None,
                             m_out=b.buffers["theta_out"], sigma_out=None,
                             hp=RefreshHP.sgd(sigma=float(self._noise_sigma(group))))

    def _refresh_update(self, b, group, gM, geM, first):
        eps = self._eps(b, KIND_REFRESH, 0, self._refreshes) if self.noisy else None
        return svrg_refresh_update(mean=b.buffers["mean"], gM=gM,
                                   sigma=self._noise_sigma(group), eps=eps)


class SVRG(_SVRGBase):
    """SVRG and alpha-SVRG over SGD (Alg. 1): ``torch.optim.SGD``'s update of the corrected
    gradient ``g_B(m) - alpha (g_B(theta_out) - g_out)``.

    Arguments (all but the last three per parameter group), as ``torch.optim.SGD`` plus
    ``alpha``:

    * ``lr``: learning rate (``>= 0``, default 1e-3).
    * ``alpha``: correction weight in ``[0, 1]`` (default 1.0: SVRG; below 1: alpha-SVRG;
      0: SGD).
    * ``momentum``: heavy-ball momentum (``>= 0``, default 0).
    * ``dampening``: dampening of the momentum (``>= 0``, default 0).
    * ``weight_decay``: L2 penalty added to the gradient (``>= 0``, default 0).
    * ``nesterov``: Nesterov momentum (needs momentum > 0 and zero dampening).
    {common_arguments}
    """

    _lazy_buffers = ("momentum_buffer",)

    def __init__(self, params, lr: float = 1e-3, alpha: float = 1.0, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
                 *, seed: Optional[int] = None, backend: str = "auto",
                 check_finite: Optional[bool] = None, grad_views: bool = True):
        defaults = dict(lr=lr, alpha=alpha, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov)
        super().__init__(params, defaults, seed=seed, backend=backend, check_finite=check_finite, grad_views=grad_views)

    def _validate_group(self, group):
        super()._validate_group(group)
        check_range(group, "momentum", lo=0.0)
        check_range(group, "dampening", lo=0.0)
        check(isinstance(group["nesterov"], bool), "invalid nesterov: expected a bool")
        if group["nesterov"]:
            check(group["momentum"] > 0 and group["dampening"] == 0,
                   "Nesterov momentum requires a momentum and zero dampening")

    def _kernel_step(self, b, group) -> KernelStep:
        """The step kernel's records (SGD family): :func:`svrg_inner_update`."""
        mom = group["momentum"]
        first = 0.0
        if mom != 0 and "momentum_buffer" not in b.buffers:   # torch.optim.SGD: buf = d_p
            b.buffers["momentum_buffer"] = b.new_buffer()
            self._expose(b)
            first = 1.0
        return KernelStep(FAMILY_SGD, s1=b.buffers.get("momentum_buffer"), s2=None,
                          hp=StepHP.sgd(lr=group["lr"], wd=group["weight_decay"],
                                        alpha=group["alpha"], momentum=mom,
                                        dampening=group["dampening"], mom_first=first),
                          path=StepPath.sgd(momentum=mom != 0, nesterov=group["nesterov"]))

    def _inner_update(self, b, group, g_in, ge_in, outer, t):
        return svrg_inner_update(mean=b.buffers["mean"],
                                 momentum_buffer=b.buffers.get("momentum_buffer"), g_in=g_in,
                                 outer=outer, g_out=b.buffers["g_out"], group=group)


class VSGDPoCo(SVRG):
    """Variational SGD with posterior correction (Alg. 2): SVRG on the mean of an isotropic
    Gaussian ``N(m, sigma^2 I)``.  ``sigma = 0`` is SVRG exactly (Thm. 2).

    Arguments: :class:`SVRG`'s (``lr``, ``alpha``, ``momentum``, ``dampening``,
    ``weight_decay``, ``nesterov``), and per group:

    * ``sigma``: standard deviation of the posterior (``>= 0``, default 1e-3).  The inner
      sample ``m + sigma eps`` is drawn at every step, the refresh sample once per refresh.
    * ``mc_samples``: inner samples per step, 1-4096 (default 1).
    {common_arguments}
    """

    noisy = True

    def __init__(self, params, lr: float = 1e-3, sigma: float = 1e-3, alpha: float = 1.0,
                 momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False, mc_samples: int = 1, *, seed: Optional[int] = None,
                 backend: str = "auto", check_finite: Optional[bool] = None, grad_views: bool = True):
        defaults = dict(lr=lr, alpha=alpha, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov, sigma=sigma,
                        mc_samples=mc_samples)
        PosteriorOptimizer.__init__(self, params, defaults, seed=seed, backend=backend,
                                    check_finite=check_finite, grad_views=grad_views)

    def _validate_group(self, group):
        super()._validate_group(group)
        check_range(group, "sigma", lo=0.0)
        check_range(group, "mc_samples", lo=1, hi=4096, kind=int)

    def _noise_sigma(self, group) -> float:
        return float(group["sigma"])


class SVRGAdamW(_SVRGBase):
    """alpha-SVRG over AdamW: the corrected gradient fed to ``torch.optim.AdamW``'s update,
    op for op (hyperparameters and defaults as ``torch.optim.AdamW``).

    Arguments (all but the last three per parameter group):

    * ``lr``: learning rate (``>= 0``, default 1e-3).
    * ``betas``: AdamW's ``(beta1, beta2)``, each in ``[0, 1)`` (default (0.9, 0.999)).
    * ``eps``: added to the denominator (``>= 0``, default 1e-8).
    * ``weight_decay``: decoupled weight decay (``>= 0``, default 1e-2).
    * ``alpha``: correction weight in ``[0, 1]`` (default 1.0; 0 is AdamW).
    {common_arguments}
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, alpha: float = 1.0, *, seed: Optional[int] = None,
                 backend: str = "auto", check_finite: Optional[bool] = None, grad_views: bool = True):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        alpha=alpha)
        super().__init__(params, defaults, seed=seed, backend=backend, check_finite=check_finite, grad_views=grad_views)

    def _validate_group(self, group):
        super()._validate_group(group)
        check_range(group, "eps", lo=0.0)
        betas = group["betas"]
        check(isinstance(betas, (tuple, list)) and len(betas) == 2,
               f"invalid betas: {betas!r} (expected a pair)")
        for i, v in enumerate(betas):
            check_range({f"betas[{i}]": v}, f"betas[{i}]", lo=0.0, hi=1.0, hi_open=True)

    def _check_state_value(self, name, t, group, what):
        if name == "exp_avg_sq":
            check(bool((t >= 0).all()), f"{what}: a second moment must be >= 0")

    def _init_buffers(self, b, group):
        bufs = super()._init_buffers(b, group)
        bufs["exp_avg"] = torch.zeros(b.numel, device=b.device, dtype=b.dtype)
        bufs["exp_avg_sq"] = torch.zeros(b.numel, device=b.device, dtype=b.dtype)
        return bufs

    def _kernel_step(self, b, group) -> KernelStep:
        """The step kernel's records (AdamW family): :func:`svrg_adamw_inner_update`."""
        beta1, beta2 = group["betas"]
        return KernelStep(FAMILY_ADAMW, s1=b.buffers["exp_avg"], s2=b.buffers["exp_avg_sq"],
                          hp=StepHP.adamw(lr=group["lr"], beta1=beta1, beta2=beta2,
                                          wd=group["weight_decay"], eps=group["eps"],
                                          alpha=group["alpha"]),
                          path=StepPath.adamw())

    def _inner_update(self, b, group, g_in, ge_in, outer, t):
        return svrg_adamw_inner_update(mean=b.buffers["mean"], exp_avg=b.buffers["exp_avg"],
                                       exp_avg_sq=b.buffers["exp_avg_sq"], g_in=g_in,
                                       outer=outer, g_out=b.buffers["g_out"], group=group,
                                       step=t)
