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

from typing import Tuple

from ._arguments import hyperparameter
from ._posterior import PosteriorOptimizer
from ._validation import check, check_range
from .rules.svrg import (AdamWRule, SGDRule, VSGDRule, svrg_adamw_inner_update,
                         svrg_inner_update, svrg_refresh_update)

__all__ = ["SVRG", "SVRGAdamW", "VSGDPoCo", "svrg_inner_update", "svrg_adamw_inner_update",
           "svrg_refresh_update"]


#: the documentation of SGD's hyperparameters, shared by SVRG and VSGD-PoCo (whose signature
#: puts ``sigma`` second, so it cannot inherit SVRG's; tests check the two agree)
def _pair(value):
    """A list or tuple as a tuple; anything else as it is, for the group's check to refuse
    by name (``betas=0.9`` is "invalid betas", not "'float' object is not iterable")."""
    return tuple(value) if isinstance(value, (tuple, list)) else value


_SGD_DOC = dict(
    lr="learning rate (``>= 0``).",
    alpha="correction weight in ``[0, 1]`` (1: SVRG; below 1: alpha-SVRG; 0: SGD).",
    momentum="heavy-ball momentum (``>= 0``).",
    dampening="dampening of the momentum (``>= 0``).",
    weight_decay="L2 penalty added to the gradient (``>= 0``).",
    nesterov="Nesterov momentum (needs momentum > 0 and zero dampening).")


class _SVRGBase(PosteriorOptimizer):
    """Outer loop shared by the first-order family: ``g_out`` (mean mega-batch gradient)
    and ``theta_out`` (the point it was taken at)."""

    def _validate_group(self, group):
        check_range(group, "lr", lo=0.0, tensor=True)
        check_range(group, "alpha", lo=0.0, hi=1.0, tensor=True)
        check_range(group, "weight_decay", lo=0.0)


class _SGDUpdate(_SVRGBase):
    """``torch.optim.SGD``'s update of the corrected gradient: its hyperparameters'
    checks."""

    def _validate_group(self, group):
        super()._validate_group(group)
        check_range(group, "momentum", lo=0.0)
        check_range(group, "dampening", lo=0.0)
        check(isinstance(group["nesterov"], bool), "invalid nesterov: expected a bool")
        if group["nesterov"]:
            check(group["momentum"] > 0 and group["dampening"] == 0,
                   "Nesterov momentum requires a momentum and zero dampening")


class SVRG(_SGDUpdate):
    """SVRG and alpha-SVRG over SGD (Alg. 1): ``torch.optim.SGD``'s update of the corrected
    gradient ``g_B(m) - alpha (g_B(theta_out) - g_out)``.  Hyperparameters as
    ``torch.optim.SGD``'s, plus ``alpha``.

    {arguments}
    """

    rule = SGDRule()

    lr: float = hyperparameter(default=1e-3, doc=_SGD_DOC["lr"])
    alpha: float = hyperparameter(default=1.0, doc=_SGD_DOC["alpha"])
    momentum: float = hyperparameter(default=0.0, doc=_SGD_DOC["momentum"])
    dampening: float = hyperparameter(default=0.0, doc=_SGD_DOC["dampening"])
    weight_decay: float = hyperparameter(default=0.0, doc=_SGD_DOC["weight_decay"])
    nesterov: bool = hyperparameter(default=False, doc=_SGD_DOC["nesterov"])


class VSGDPoCo(_SGDUpdate):
    """Variational SGD with posterior correction (Alg. 2): SVRG on the mean of an isotropic
    Gaussian ``N(m, sigma^2 I)``.  ``sigma = 0`` is SVRG exactly (Thm. 2).

    {arguments}
    """

    rule = VSGDRule()

    lr: float = hyperparameter(default=1e-3, doc=_SGD_DOC["lr"])
    sigma: float = hyperparameter(default=1e-3, doc="""\
        standard deviation of the posterior (``>= 0``).  The inner sample
        ``m + sigma eps`` is drawn at every step, the refresh sample once per refresh.""")
    alpha: float = hyperparameter(default=1.0, doc=_SGD_DOC["alpha"])
    momentum: float = hyperparameter(default=0.0, doc=_SGD_DOC["momentum"])
    dampening: float = hyperparameter(default=0.0, doc=_SGD_DOC["dampening"])
    weight_decay: float = hyperparameter(default=0.0, doc=_SGD_DOC["weight_decay"])
    nesterov: bool = hyperparameter(default=False, doc=_SGD_DOC["nesterov"])
    mc_samples: int = hyperparameter(default=1, doc="inner samples per step, 1-4096.")

    def _validate_group(self, group):
        super()._validate_group(group)
        check_range(group, "sigma", lo=0.0)
        check_range(group, "mc_samples", lo=1, hi=4096, kind=int)


class SVRGAdamW(_SVRGBase):
    """alpha-SVRG over AdamW: the corrected gradient fed to ``torch.optim.AdamW``'s update,
    op for op (hyperparameters and defaults as ``torch.optim.AdamW``).

    {arguments}
    """

    rule = AdamWRule()

    lr: float = hyperparameter(default=1e-3, doc=_SGD_DOC["lr"])
    betas: Tuple[float, float] = hyperparameter(default=(0.9, 0.999), convert=_pair, doc="""\
        AdamW's ``(beta1, beta2)``, each in ``[0, 1)``.""")
    eps: float = hyperparameter(default=1e-8, doc="added to the denominator (``>= 0``).")
    weight_decay: float = hyperparameter(default=1e-2, doc="""\
        decoupled weight decay (``>= 0``).""")
    alpha: float = hyperparameter(default=1.0, doc="""\
        correction weight in ``[0, 1]`` (0 is AdamW).""")

    def _validate_group(self, group):
        super()._validate_group(group)
        check_range(group, "eps", lo=0.0)
        betas = group["betas"]
        check(isinstance(betas, (tuple, list)) and len(betas) == 2,
               f"invalid betas: {betas!r} (expected a pair)")
        for i, v in enumerate(betas):
            check_range({f"betas[{i}]": v}, f"betas[{i}]", lo=0.0, hi=1.0, hi_open=True)

