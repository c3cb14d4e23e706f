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

from typing import Optional, Dict

import torch
from torch import Tensor

from . import reference as R
from ._core import (COUNTER_REFRESHES, COUNTER_STEPS, KIND_INNER, KIND_OUTER, KIND_REFRESH,
                    PosteriorOptimizer, SampleSpec, _check, check_range)

from .kernels.common import FAMILY_ADAMW, FAMILY_SGD

__all__ = ["SVRG", "SVRGAdamW", "VSGDPoCo"]


class _SVRGBase(PosteriorOptimizer):
    """Outer loop shared by the first-order family: ``g_out`` (mean mega-batch gradient)
    and ``theta_out`` (the point it was taken at)."""

    noisy = False
    uses_hessian = False

    def _validate_group(self, group):
        check_range(group, "lr", lo=0.0)
        check_range(group, "alpha", lo=0.0, hi=1.0)
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

    def _corrected(self, group, g_in, outer, b) -> Tensor:
        if outer is None:
            return g_in
        g_o, _ = outer
        return R.control_variate(g_in, g_o, b.buffers["g_out"], group["alpha"])

    def _kernel_refresh(self, b, group):
        """The refresh kernel's arguments (first-order family): ``_refresh_update``."""
        return dict(family=FAMILY_SGD, g_out=b.buffers["g_out"], m_out=b.buffers["theta_out"],
                    hp=dict(sigma=float(self._noise_sigma(group))))

    def _refresh_update(self, b, group, gM, geM, first):
        sigma = self._noise_sigma(group)
        if self.noisy:
            eps = self._eps(b, KIND_REFRESH, 0, self._refreshes)
            theta = R.perturb(b.buffers["mean"], sigma, eps)
        else:
            theta = b.buffers["mean"].clone()
        return {"g_out": gM.clone(), "theta_out": theta}


class SVRG(_SVRGBase):
    """SVRG and alpha-SVRG over SGD (Alg. 1).  Hyperparameters as ``torch.optim.SGD``,
    plus ``alpha`` (correction weight, 1 = SVRG)."""

    _lazy_buffers = ("momentum_buffer",)

    def __init__(self, params, lr: float = 1e-3, alpha: float = 1.0, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
                 *, seed: int = 0, backend: str = "auto",
                 check_finite: Optional[bool] = None, **extra):
        defaults = dict(lr=lr, alpha=alpha, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov, **extra)
        super().__init__(params, defaults, seed=seed, backend=backend, check_finite=check_finite)

    def _validate_group(self, group):
        super()._validate_group(group)
        check_range(group, "momentum", lo=0.0)
        check_range(group, "dampening", lo=0.0)
        _check(isinstance(group["nesterov"], bool), "invalid nesterov: expected a bool")
        if group["nesterov"]:
            _check(group["momentum"] > 0 and group["dampening"] == 0,
                   "Nesterov momentum requires a momentum and zero dampening")

    def _kernel_step(self, b, group):
        """The step kernel's arguments (SGD family): ``control_variate`` + ``sgd_step``."""
        mom = group["momentum"]
        first = 0.0
        if mom != 0 and "momentum_buffer" not in b.buffers:   # torch.optim.SGD: buf = d_p
            b.buffers["momentum_buffer"] = torch.zeros(b.numel, device=b.device, dtype=b.dtype)
            self._expose(b)
            first = 1.0
        return dict(family=FAMILY_SGD, s1=b.buffers.get("momentum_buffer"),
                    flags=dict(MOMENTUM=mom != 0, NESTEROV=group["nesterov"]),
                    hp=dict(lr=group["lr"], wd=group["weight_decay"], momentum=mom,
                            dampening=group["dampening"], alpha=group["alpha"],
                            mom_first=first))

    def _inner_update(self, b, group, g_in, ge_in, outer, t):
        ghat = self._corrected(group, g_in, outer, b)
        m, buf = R.sgd_step(b.buffers["mean"], ghat, b.buffers.get("momentum_buffer"),
                            lr=group["lr"], momentum=group["momentum"],
                            dampening=group["dampening"], weight_decay=group["weight_decay"],
                            nesterov=group["nesterov"])
        new = {"mean": m}
        if buf is not None:
            new["momentum_buffer"] = buf
        return new


class VSGDPoCo(SVRG):
    """Variational SGD with posterior correction (Alg. 2): SVRG on the mean of an isotropic
    Gaussian ``N(m, sigma^2 I)``.  ``sigma = 0`` is SVRG exactly (Thm. 2)."""

    noisy = True

    def __init__(self, params, lr: float = 1e-3, sigma: float = 1e-3, alpha: float = 1.0,
                 momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False, mc_samples: int = 1, *, seed: int = 0,
                 backend: str = "auto", check_finite: Optional[bool] = None):
        super().__init__(params, lr, alpha, momentum, dampening, weight_decay, nesterov,
                         seed=seed, backend=backend, check_finite=check_finite, sigma=sigma, mc_samples=mc_samples)

    def _validate_group(self, group):
        super()._validate_group(group)
        check_range(group, "sigma", lo=0.0)
        check_range(group, "mc_samples", lo=1, hi=4096, kind=int)

    def _noise_sigma(self, group) -> float:
        return float(group["sigma"])


class SVRGAdamW(_SVRGBase):
    """alpha-SVRG over AdamW: the corrected gradient fed to ``torch.optim.AdamW``'s update,
    op for op (hyperparameters and defaults as ``torch.optim.AdamW``)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, alpha: float = 1.0, *, seed: int = 0,
                 backend: str = "auto", check_finite: Optional[bool] = None):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        alpha=alpha)
        super().__init__(params, defaults, seed=seed, backend=backend, check_finite=check_finite)

    def _validate_group(self, group):
        super()._validate_group(group)
        check_range(group, "eps", lo=0.0)
        betas = group["betas"]
        _check(isinstance(betas, (tuple, list)) and len(betas) == 2,
               f"invalid betas: {betas!r} (expected a pair)")
        for i, v in enumerate(betas):
            check_range({f"betas[{i}]": v}, f"betas[{i}]", lo=0.0, hi=1.0, hi_open=True)

    def _init_buffers(self, b, group):
        bufs = super()._init_buffers(b, group)
        bufs["exp_avg"] = torch.zeros(b.numel, device=b.device, dtype=b.dtype)
        bufs["exp_avg_sq"] = torch.zeros(b.numel, device=b.device, dtype=b.dtype)
        return bufs

    def _kernel_step(self, b, group):
        """The step kernel's arguments (AdamW family): ``control_variate`` + ``adamw_step``."""
        beta1, beta2 = group["betas"]
        return dict(family=FAMILY_ADAMW, s1=b.buffers["exp_avg"], s2=b.buffers["exp_avg_sq"],
                    flags={}, hp=dict(lr=group["lr"], beta1=beta1, beta2=beta2,
                                      wd=group["weight_decay"], eps=group["eps"],
                                      alpha=group["alpha"]))

    def _inner_update(self, b, group, g_in, ge_in, outer, t):
        ghat = self._corrected(group, g_in, outer, b)
        beta1, beta2 = group["betas"]
        m, ea, eas = R.adamw_step(b.buffers["mean"], ghat, b.buffers["exp_avg"],
                                  b.buffers["exp_avg_sq"], step=t, lr=group["lr"], beta1=beta1,
                                  beta2=beta2, eps=group["eps"],
                                  weight_decay=group["weight_decay"])
        return {"mean": m, "exp_avg": ea, "exp_avg_sq": eas}
