"""IVON and IVON-PoCo(Mo): variational online Newton with a diagonal Gaussian posterior,
and its posterior-corrected (variance-reduced) form, Alg. 3 of the paper.

``IVON`` has ivon-opt 0.1.3's hyperparameter names and defaults.  ``IVONPoCo`` adds
``alpha`` (correction weight), ``rho1``/``rho2`` (outer momentum; with nonzero ones it is
IVON-PoCoMo), ``hess_corr_scale`` (the scale ``c`` of the Hessian-correction term of the
mean update) and ``outer_noise`` (shared or independent noise for the outer sample).
With ``alpha = 0``, or before the first :meth:`~IVONPoCo.refresh`, IVON-PoCo is IVON.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch import Tensor

from ._groups import ParamGroup
from ._posterior import PosteriorOptimizer
from ._validation import check, check_range
from .rules.ivon import IVONPoCoRule, IVONRule, ivon_inner_update, ivon_refresh_update

__all__ = ["IVON", "IVONPoCo", "IVONPoCoMo", "ivon_inner_update", "ivon_refresh_update"]


def _ivon_group(lr, ess, hess_init, beta1, beta2, weight_decay, mc_samples, clip_radius,
                debias, rescale_lr) -> Dict[str, Any]:
    """IVON's per-group hyperparameters (the defaults of a parameter group)."""
    return dict(lr=lr, ess=ess, hess_init=hess_init, beta1=beta1, beta2=beta2,
                weight_decay=weight_decay, mc_samples=mc_samples, clip_radius=clip_radius,
                debias=debias, rescale_lr=rescale_lr)


class IVONGroup(ParamGroup):
    """IVON's parameter group: ``group["betas"]`` reads and sets ``(beta1, beta2)``, the
    name torch.optim's schedulers cycle (``OneCycleLR``, ``CyclicLR``)."""

    aliases = {"betas": ("beta1", "beta2")}


class IVON(PosteriorOptimizer):
    """Improved Variational Online Newton (Shen et al., 2024), ivon-opt 0.1.3 semantics.

    Per step: ``theta = m + sigma eps`` with ``sigma = 1/sqrt(ess (h + wd))``; the mean of
    the gradients at ``mc_samples`` samples and their Price Hessian estimate update the
    momentum ``g`` and the Hessian ``h``; the mean moves by
    ``lr (hess_init + wd) clip((g / (1 - beta1^t) + wd m) / (h + wd), xi)``.

    Unlike ivon-opt: ``None`` gradients count as zero, ``step()`` without a sample is a
    clear error, the step counter is in the state dict, parameters may have several
    dtypes and devices (state is float32, with a float32 master mean for bf16/fp16
    parameters), and ``debias``/``rescale_lr`` are per group.

    Arguments (all but the last three per parameter group):

    * ``lr``: learning rate (``>= 0``).  Not AdamW's scale: with ``rescale_lr`` the step
      is ``lr (hess_init + wd) clip(u)``, so IVON's usual lr is 0.1-1 (the paper's GPT-2:
      0.3); without it, ``lr * clip_radius`` bounds a step.
    * ``ess``: effective sample size ``lambda`` (``> 0``), about the number of training
      examples; ``sigma = 1/sqrt(ess (h + wd))``, so a larger ``ess`` is less noise (the
      paper's GPT-2: 1e10).
    * ``hess_init``: initial Hessian estimate ``h`` (``> 0``, default 1.0; the paper's
      GPT-2: 1e-3).  It sets the initial noise and, with ``rescale_lr``, the lr scale.
    * ``beta1``: momentum of the gradient ``g``, in ``[0, 1)`` (default 0.9).
    * ``beta2``: momentum of the Hessian ``h``, in ``[0, 1)`` (default 0.99999; below it
      the Price estimator's noise shows, see docs/logreg-study.md).
    * ``weight_decay``: ``wd``, the prior precision per example (``>= 0``, default 1e-4).
    * ``mc_samples``: posterior samples per step, 1-4096 (default 1); ``step(closure)``
      evaluates the closure at each and averages.
    * ``clip_radius``: clip of the update direction ``u`` per coordinate (``> 0``, default
      ``inf``: none; the paper's GPT-2: 1e-3).
    * ``debias``: divide ``g`` by ``1 - beta1^t`` (default True).
    * ``rescale_lr``: multiply lr by ``hess_init + wd``, as ivon-opt (default True).
    * ``sample_ahead``: the step leaves the NEXT step's inner posterior sample in the
      parameters (computed in the same pass as the update, so no separate sample pass
      and no restore between iterations; default False).  Between steps the parameters
      then hold that sample, not the mean: call :meth:`restore` before evaluating at the
      mean or saving ``model.state_dict()`` (the optimizer's state dict always has the
      mean).  False: the step writes the mean into the parameters.
    {common_arguments}
    """

    rule = IVONRule()
    _group_type = IVONGroup

    def __init__(self, params, lr: float, ess: float, hess_init: float = 1.0, beta1: float = 0.9,
                 beta2: float = 0.99999, weight_decay: float = 1e-4, mc_samples: int = 1,
                 clip_radius: float = float("inf"), debias: bool = True, rescale_lr: bool = True,
                 *, seed: Optional[int] = None, backend: str = "auto",
                 check_finite: Optional[bool] = None, grad_views: bool = True,
                 sample_ahead: bool = False, state_dtype: Optional[torch.dtype] = None):
        super().__init__(params, _ivon_group(lr, ess, hess_init, beta1, beta2, weight_decay,
                                             mc_samples, clip_radius, debias, rescale_lr),
                         seed=seed, backend=backend, check_finite=check_finite, grad_views=grad_views,
                         sample_ahead=sample_ahead, state_dtype=state_dtype)

    def _validate_group(self, group):
        check_range(group, "lr", lo=0.0, tensor=True)
        check_range(group, "ess", lo=0.0, lo_open=True)
        check_range(group, "hess_init", lo=0.0, lo_open=True)
        check_range(group, "beta1", lo=0.0, hi=1.0, hi_open=True)
        check_range(group, "beta2", lo=0.0, hi=1.0, hi_open=True)
        check_range(group, "weight_decay", lo=0.0)
        check_range(group, "mc_samples", lo=1, hi=4096, kind=int)
        check_range(group, "clip_radius", lo=0.0, lo_open=True, allow_inf=True)
        for k in ("debias", "rescale_lr"):
            check(isinstance(group[k], bool), f"invalid {k}: {group[k]!r} (expected a bool)")


class IVONPoCo(IVON):
    """IVON with posterior correction (IVON-PoCo), and outer momentum (IVON-PoCoMo): Alg. 3.

    Outer loop, :meth:`refresh` on a mega-batch at ONE sample ``theta = m + sigma eps``::

        g_out <- rho1 g_out + (1 - rho1) gM,   h_out <- rho2 h_out + (1 - rho2) gM eps / sigma
        m_out <- m,  sigma_out <- sigma

    Inner step, gradients at ``theta_in ~ q`` and ``theta_out ~ q_out`` on the SAME
    mini-batch: ``ghat = g_in - alpha (g_o - g_out)``, ``hhat = h_in - alpha (h_o - h_out)``,
    IVON's momentum and Hessian updates, and the mean update with the extra term
    ``hess_corr_scale * alpha (h_out - h_o)(m - m_out)``.

    ``rho1``, ``rho2`` follow Alg. 3's equations: rho weights the OLD estimate, ``rho = 0``
    is no outer momentum (what the paper's Sec. 5.1 calls ``rho = 1``); 1 is refused since it
    would freeze the estimate.  At the first refresh the estimates are set to the mega-batch
    estimate (no bias toward the zero initialisation).

    ``outer_noise``: ``"shared"`` draws the outer sample with the inner sample's standard
    normal (common random numbers: the two gradients are strongly correlated, which is what
    a control variate needs; still unbiased), ``"independent"`` with its own.

    ``hess_corr_scale`` defaults to 0.01, the paper's Sec. 5.1 down-weighting: with 1 (Alg. 3
    as written) every logistic-regression configuration we tried diverged.

    Stabilisers (docs/logreg-study.md, 'Stability of IVON-PoCo'; off by default, so the defaults are
    Alg. 3): ``refresh_samples`` posterior samples per refresh (every chunk closure is run
    at each); ``refresh_antithetic=True`` makes them mirrored pairs ``+eps, -eps``, which
    cancels the data-gradient noise of the Price estimate ``hM`` exactly and cuts the error
    of ``g_out`` from O(sigma) to O(sigma^2); ``hess_floor=c`` clamps the corrected Hessian
    estimate at ``-c (h + wd)`` (c = 0 for beta2 below 0.99999).

    Arguments: IVON's (``lr``, ``ess``, ``hess_init``, ``beta1``, ``beta2``,
    ``weight_decay``, ``mc_samples``, ``clip_radius``, ``debias``, ``rescale_lr``: see
    :class:`IVON`), and per group:

    * ``alpha``: correction weight in ``[0, 1]`` (default 1.0; 0 is IVON; the paper's
      continual runs: 0.7, and its ablation favours a schedule rising from 0.2 to 0.8).
    * ``rho1``, ``rho2``: outer momentum of ``g_out`` and ``h_out`` in ``[0, 1)``
      (default 0: IVON-PoCo; nonzero: IVON-PoCoMo, the paper's GPT-2: 0.6 and 0.1).
    * ``hess_corr_scale``: ``c``, scale of the Hessian-correction term (``>= 0``, default
      0.01, the paper's Sec. 5.1 down-weighting).
    * ``outer_noise``: ``"shared"`` (default) or ``"independent"``, above.
    * ``refresh_samples``: posterior samples per refresh, 1-4096 (default 1).
    * ``refresh_antithetic``: draw the refresh samples as mirrored pairs (default False;
      needs an even ``refresh_samples``).
    * ``hess_floor``: ``None`` (default, no floor) or ``c >= 0``.
    * ``sample_ahead``: as :class:`IVON` (default False).
    {common_arguments}
    """

    rule = IVONPoCoRule()
    _loads_from = ("IVONPoCoMo",)
    _continues_from = ("IVON",)

    def __init__(self, params, lr: float, ess: float, hess_init: float = 1.0, beta1: float = 0.9,
                 beta2: float = 0.99999, weight_decay: float = 1e-4, mc_samples: int = 1,
                 clip_radius: float = float("inf"), debias: bool = True, rescale_lr: bool = True,
                 alpha: float = 1.0, rho1: float = 0.0, rho2: float = 0.0,
                 hess_corr_scale: float = 0.01, outer_noise: str = "shared",
                 refresh_samples: int = 1, refresh_antithetic: bool = False,
                 hess_floor: Optional[float] = None,
                 *, seed: Optional[int] = None, backend: str = "auto",
                 check_finite: Optional[bool] = None, grad_views: bool = True,
                 sample_ahead: bool = False, state_dtype: Optional[torch.dtype] = None):
        defaults = dict(_ivon_group(lr, ess, hess_init, beta1, beta2, weight_decay, mc_samples,
                                    clip_radius, debias, rescale_lr),
                        alpha=alpha, rho1=rho1, rho2=rho2, hess_corr_scale=hess_corr_scale,
                        outer_noise=outer_noise, refresh_samples=refresh_samples,
                        refresh_antithetic=refresh_antithetic, hess_floor=hess_floor)
        PosteriorOptimizer.__init__(self, params, defaults, seed=seed, backend=backend,
                                    check_finite=check_finite, grad_views=grad_views,
                                    sample_ahead=sample_ahead, state_dtype=state_dtype)

    #: the keywords :meth:`from_ivon` takes (IVON's hyperparameters come from the IVON run)
    _POCO_KEYS = ("alpha", "rho1", "rho2", "hess_corr_scale", "outer_noise", "refresh_samples",
                  "refresh_antithetic", "hess_floor", "seed", "backend", "check_finite",
                  "grad_views", "sample_ahead", "state_dtype")

    @classmethod
    def from_ivon(cls, ivon: IVON, **kwargs) -> "IVONPoCo":
        """Continue an IVON run with posterior correction, as the paper's GPT-2 runs do
        (IVON warm-up, then IVON-PoCoMo): a new optimizer over ``ivon``'s parameter
        groups, with its hyperparameters (and the groups' other keys: names, a
        scheduler's ``initial_lr``), its state (mean, ``h``, momentum, step count,
        pending gradients) and, unless given, its ``seed``, ``backend`` and
        ``check_finite``.  ``kwargs``: the correction's hyperparameters (``alpha``,
        ``rho1``, ...), for every group.  Until the first :meth:`refresh` the new optimizer
        takes exactly the steps ``ivon`` would have taken.  ``ivon`` is left as it was
        (it stays usable, but its state no longer follows the parameters: go on with one
        of the two).

        Loading an IVON state dict into an ``IVONPoCo`` does the same for an existing
        optimizer (its correction hyperparameters are kept)."""
        if not isinstance(ivon, IVON):
            raise TypeError(f"from_ivon() takes an IVON optimizer, got {type(ivon).__name__}")
        bad = [k for k in kwargs if k not in cls._POCO_KEYS]
        if bad:
            raise TypeError(f"from_ivon() got {', '.join(map(repr, bad))}: IVON's "
                            "hyperparameters come from the IVON optimizer (change "
                            "param_groups afterwards); it takes "
                            f"{', '.join(cls._POCO_KEYS)}")
        kwargs.setdefault("seed", ivon.seed)
        kwargs.setdefault("backend", ivon._requested[0])
        kwargs.setdefault("check_finite", ivon.check_finite)
        kwargs.setdefault("grad_views", ivon.grad_views)
        kwargs.setdefault("sample_ahead", ivon.sample_ahead)
        kwargs.setdefault("state_dtype", ivon.state_dtype)
        sd = ivon.state_dict()           # (refused while a sample is in the parameters)
        if ivon._active is None and not ivon._runner.params_hold_mean:
            ivon.restore()   # sample_ahead: its parameters held its next sample: the mean
        # (a tensor lr is copied: a scheduler of the new optimizer leaves ivon's alone)
        groups = [{k: (v.detach().clone() if isinstance(v, Tensor) else v)
                   for k, v in g.items()} for g in ivon.param_groups]
        d = ivon.defaults
        opt = cls(groups, d["lr"], d["ess"], d["hess_init"], d["beta1"], d["beta2"],
                  d["weight_decay"], d["mc_samples"], d["clip_radius"], d["debias"],
                  d["rescale_lr"], **kwargs)
        opt.load_state_dict(sd)
        for g in opt.param_groups:          # (an IVONPoCo's own values give way to kwargs)
            g.update({k: v for k, v in kwargs.items() if k in opt.defaults})
        opt._check_groups()
        return opt

    def _validate_group(self, group):
        super()._validate_group(group)
        check_range(group, "alpha", lo=0.0, hi=1.0, tensor=True)
        for k in ("rho1", "rho2"):
            v = group[k]
            if isinstance(v, (int, float)) and v == 1:
                raise ValueError(
                    f"invalid {k}: 1 would freeze the outer estimate. poco_kernels follows Alg. 3's "
                    f"equations, where {k} weights the OLD estimate: use {k}=0 for no outer "
                    "momentum (the paper's text calls that setting 'rho = 1')")
            check_range(group, k, lo=0.0, hi=1.0, hi_open=True)
        check_range(group, "hess_corr_scale", lo=0.0)
        check(group["outer_noise"] in ("shared", "independent"),
               f"invalid outer_noise: {group['outer_noise']!r} (expected 'shared' or 'independent')")
        check_range(group, "refresh_samples", lo=1, hi=4096, kind=int)
        check(isinstance(group["refresh_antithetic"], bool),
               f"invalid refresh_antithetic: {group['refresh_antithetic']!r} (expected a bool)")
        if group["refresh_antithetic"]:
            check(group["refresh_samples"] % 2 == 0,
                   "refresh_antithetic pairs each draw with its mirror image: refresh_samples "
                   f"must be even, got {group['refresh_samples']}")
        if group["hess_floor"] is not None:
            check_range(group, "hess_floor", lo=0.0)


class IVONPoCoMo(IVONPoCo):
    """IVON-PoCoMo: :class:`IVONPoCo` with the outer momentum of the paper's GPT-2
    pretraining (``rho1 = 0.6``, ``rho2 = 0.1``, in Alg. 3's convention where ``rho``
    weights the old estimate) as defaults; everything else, and every other
    default, is :class:`IVONPoCo`'s.  Its state dicts load into ``IVONPoCo`` and back, and
    it continues an IVON run (:meth:`~IVONPoCo.from_ivon`).

    Arguments, as :class:`IVONPoCo`: ``lr``, ``ess``, ``hess_init``, ``beta1``, ``beta2``,
    ``weight_decay``, ``mc_samples``, ``clip_radius``, ``debias``, ``rescale_lr``,
    ``alpha``, ``rho1`` (default 0.6), ``rho2`` (default 0.1), ``hess_corr_scale``,
    ``outer_noise``, ``refresh_samples``, ``refresh_antithetic``, ``hess_floor``, ``seed``,
    ``backend``, ``check_finite``, ``grad_views``, ``sample_ahead``, ``state_dtype``."""

    _loads_from = ("IVONPoCo",)

    def __init__(self, params, lr: float, ess: float, hess_init: float = 1.0, beta1: float = 0.9,
                 beta2: float = 0.99999, weight_decay: float = 1e-4, mc_samples: int = 1,
                 clip_radius: float = float("inf"), debias: bool = True, rescale_lr: bool = True,
                 alpha: float = 1.0, rho1: float = 0.6, rho2: float = 0.1,
                 hess_corr_scale: float = 0.01, outer_noise: str = "shared",
                 refresh_samples: int = 1, refresh_antithetic: bool = False,
                 hess_floor: Optional[float] = None,
                 *, seed: Optional[int] = None, backend: str = "auto",
                 check_finite: Optional[bool] = None, grad_views: bool = True,
                 sample_ahead: bool = False, state_dtype: Optional[torch.dtype] = None):
        super().__init__(params, lr, ess, hess_init, beta1, beta2, weight_decay, mc_samples,
                         clip_radius, debias, rescale_lr, alpha, rho1, rho2, hess_corr_scale,
                         outer_noise, refresh_samples, refresh_antithetic, hess_floor,
                         seed=seed, backend=backend, check_finite=check_finite, grad_views=grad_views,
                         sample_ahead=sample_ahead, state_dtype=state_dtype)
