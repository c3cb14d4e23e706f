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

from typing import Optional

from ._posterior import PosteriorOptimizer
from ._validation import check, check_range
from .rules.svrg import (AdamWRule, SGDRule, VSGDRule, svrg_adamw_inner_update,
                         svrg_inner_update, svrg_refresh_update)

__all__ = ["SVRG", "SVRGAdamW", "VSGDPoCo", "svrg_inner_update", "svrg_adamw_inner_update",
           "svrg_refresh_update"]


class _SVRGBase(PosteriorOptimizer):
    """Outer loop shared by the first-order family: ``g_out`` (mean mega-batch gradient)
    and ``theta_out`` (the point it was taken at)."""


    def _validate_group(self, group):
        check_range(group, "lr", lo=0.0, tensor=True)
        check_range(group, "alpha", lo=0.0, hi=1.0, tensor=True)
        check_range(group, "weight_decay", lo=0.0)


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

    rule = SGDRule()

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

    rule = VSGDRule()

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

    rule = AdamWRule()

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

