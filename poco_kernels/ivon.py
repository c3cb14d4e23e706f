"""IVON and IVON-PoCo(Mo): variational online Newton with a diagonal Gaussian posterior,
and its posterior-corrected (variance-reduced) form, Alg. 3 of the paper.

``IVON`` has ivon-opt 0.1.3's hyperparameter names and defaults.  ``IVONPoCo`` adds
``alpha`` (correction weight), ``rho1``/``rho2`` (outer momentum; with nonzero ones it is
IVON-PoCoMo), ``hess_corr_scale`` (the scale ``c`` of the Hessian-correction term of the
mean update) and ``outer_noise`` (shared or independent noise for the outer sample).
With ``alpha = 0``, or before the first :meth:`~IVONPoCo.refresh`, IVON-PoCo is IVON.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ._arguments import hyperparameter, option
from ._groups import ParamGroup
from ._posterior import PosteriorOptimizer
from ._validation import check, check_range
from .rules.ivon import IVONPoCoRule, IVONRule, ivon_inner_update, ivon_refresh_update

__all__ = ["IVON", "IVONPoCo", "IVONPoCoMo", "ivon_inner_update", "ivon_refresh_update"]


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

    {arguments}
    """

    rule = IVONRule()
    _group_type = IVONGroup

    lr: float = hyperparameter(doc="""\
        learning rate (``>= 0``).  Not AdamW's scale: with ``rescale_lr`` the step is
        ``lr (hess_init + wd) clip(u)``, so IVON's usual lr is 0.1-1 (the paper's GPT-2:
        0.3); without it, ``lr * clip_radius`` bounds a step.""")
    ess: float = hyperparameter(doc="""\
        effective sample size ``lambda`` (``> 0``), about the number of training examples;
        ``sigma = 1/sqrt(ess (h + wd))``, so a larger ``ess`` is less noise (the paper's
        GPT-2: 1e10).""")
    hess_init: float = hyperparameter(default=1.0, doc="""\
        initial Hessian estimate ``h`` (``> 0``; the paper's GPT-2: 1e-3).  It sets the
        initial noise and, with ``rescale_lr``, the lr scale.""")
    beta1: float = hyperparameter(default=0.9, doc="""\
        momentum of the gradient ``g``, in ``[0, 1)``.""")
    beta2: float = hyperparameter(default=0.99999, doc="""\
        momentum of the Hessian ``h``, in ``[0, 1)`` (below the default the Price
        estimator's noise shows, see docs/logreg-study.md).""")
    weight_decay: float = hyperparameter(default=1e-4, doc="""\
        ``wd``, the prior precision per example (``>= 0``).""")
    mc_samples: int = hyperparameter(default=1, doc="""\
        posterior samples per step, 1-4096; ``step(closure)`` evaluates the closure at
        each and averages.""")
    clip_radius: float = hyperparameter(default=float("inf"), doc="""\
        clip of the update direction ``u`` per coordinate (``> 0``; ``inf``: none; the
        paper's GPT-2: 1e-3).""")
    debias: bool = hyperparameter(default=True, doc="divide ``g`` by ``1 - beta1^t``.")
    rescale_lr: bool = hyperparameter(default=True, doc="""\
        multiply lr by ``hess_init + wd``, as ivon-opt.""")
    sample_ahead: Optional[bool] = option(default=None, doc="""\
        where the NEXT step's inner posterior sample goes, which the step computes in the
        update's own pass (no separate sample pass, no restore between iterations).
        ``None``: beside the mean; between public calls the parameters hold the mean,
        their storage reading the mean buffer's memory, and nothing is copied
        (docs/design.md, 'The sampling protocol'; on the fused backends with float32
        parameters in unsharded buckets, else as ``False``).  ``True``: into the
        parameters, which hold that sample between steps, not the mean: call
        :meth:`restore` before evaluating at the mean or saving ``model.state_dict()``
        (the optimizer's state dict always has the mean).  ``False``: no sample ahead; the
        step writes the mean into the parameters, and each step draws its sample in a pass
        of its own.""")
    state_dtype: Optional[torch.dtype] = option(default=None, doc="""\
        ``None`` (float32 state; float64 for float64 parameters) or ``torch.bfloat16``:
        the optimizer's low-precision buffers (IVON: the momentum; IVON-PoCo(Mo): also
        ``g_out``, ``h_out``, ``m_out``, ``sigma_out``) are kept in bfloat16 and written
        with stochastic rounding (unbiased; bits from a counter-based hash, the same on
        every backend); the mean and ``h`` stay float32.  See docs/design.md,
        'Low-precision state'.""")

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
    mini-batch: ``ghat = g_in - alpha (g_at_out - g_out)``,
    ``hhat = h_in - alpha (h_at_out - h_out)``, IVON's momentum and Hessian updates, and the
    mean update with the extra term
    ``hess_corr_scale * alpha (h_out - h_at_out)(m - m_out)``.

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

    {arguments}
    """

    rule = IVONPoCoRule()
    _loads_from = ("IVONPoCoMo",)
    _continues_from = ("IVON",)

    alpha: float = hyperparameter(default=1.0, doc="""\
        correction weight in ``[0, 1]`` (0 is IVON; the paper's continual runs: 0.7, and
        its ablation favours a schedule rising from 0.2 to 0.8).""")
    rho1: float = hyperparameter(default=0.0, doc="""\
        outer momentum of ``g_out``, in ``[0, 1)``, weighting the old estimate (0: no
        outer momentum, IVON-PoCo; nonzero: IVON-PoCoMo, the paper's GPT-2: 0.6).""")
    rho2: float = hyperparameter(default=0.0, doc="""\
        outer momentum of ``h_out``, in ``[0, 1)``, as ``rho1`` (the paper's GPT-2:
        0.1).""")
    hess_corr_scale: float = hyperparameter(default=0.01, doc="""\
        ``c``, scale of the Hessian-correction term (``>= 0``; the default is the paper's
        Sec. 5.1 down-weighting).""")
    outer_noise: str = hyperparameter(default="shared", doc="""\
        ``"shared"`` or ``"independent"``, above.""")
    refresh_samples: int = hyperparameter(default=1, doc="""\
        posterior samples per refresh, 1-4096.""")
    refresh_antithetic: bool = hyperparameter(default=False, doc="""\
        draw the refresh samples as mirrored pairs (needs an even ``refresh_samples``).""")
    hess_floor: Optional[float] = hyperparameter(default=None, doc="""\
        ``None`` (no floor) or ``c >= 0``, above.""")
    outer_dtype: Optional[torch.dtype] = option(default=None, doc="""\
        ``None`` (as ``state_dtype``) or ``torch.bfloat16``: the outer estimates
        ``g_out`` and ``h_out`` are kept in bfloat16 with stochastic rounding while the
        rest of the state keeps ``state_dtype``; with float32 state that is 28 bytes of
        state per parameter instead of 32.  See docs/design.md,
        'Low-precision state'.""")

    @classmethod
    def _continuation_keywords(cls) -> Tuple[str, ...]:
        """The keywords :meth:`from_ivon` takes (IVON's hyperparameters come from the IVON
        run): this class's own hyperparameters and the options."""
        return tuple(k for k, a in cls._arguments.items()
                     if a.kind == "option" or k not in IVON._arguments)

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
        valid = cls._continuation_keywords()
        bad = [k for k in kwargs if k not in valid]
        if bad:
            raise TypeError(f"from_ivon() got {', '.join(map(repr, bad))}: IVON's "
                            "hyperparameters come from the IVON optimizer (change "
                            f"param_groups afterwards); it takes {', '.join(valid)}")
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
        opt = cls(groups, **{k: d[k] for k, a in IVON._arguments.items()
                             if a.kind == "hyperparameter"}, **kwargs)
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

    {arguments}
    """

    _loads_from = ("IVONPoCo",)

    rho1: float = 0.6
    rho2: float = 0.1
