"""The methods of the logistic-regression study: each one's optimizer (the package's, or
``torch.optim.SGD``) with the study's settings, whether it has an outer loop (refreshes),
and its schedule of steps, warm-up and refresh interval."""
from __future__ import annotations

from typing import Tuple

import torch

from .logreg_config import METHODS, Config

__all__ = ["ivon_kwargs", "make_optimizer", "has_outer_loop", "method_schedule"]


def ivon_kwargs(cfg: Config, n: int) -> dict:
    """IVON's settings for ``n`` training examples (IVON-PoCo's too; VON-PoCo takes its lr
    and ess)."""
    return dict(lr=cfg.lr if cfg.ivon_lr is None else cfg.ivon_lr,
                ess=cfg.ess_per_example * n if cfg.ess is None else cfg.ess,
                hess_init=cfg.hess_init, beta1=cfg.beta1, beta2=cfg.beta2,
                weight_decay=cfg.l2, mc_samples=cfg.mc_samples, clip_radius=cfg.clip_radius,
                seed=cfg.seed)


def make_optimizer(method: str, w: torch.Tensor, cfg: Config, n: int):
    """``method``'s optimizer over the weights ``w``; ``n``: training examples."""
    import poco_kernels as pk
    lam = cfg.l2
    if method == "sgd":
        return torch.optim.SGD([w], lr=cfg.lr, weight_decay=lam)
    if method == "svrg":
        return pk.SVRG([w], lr=cfg.lr, alpha=cfg.alpha, weight_decay=lam, seed=cfg.seed)
    if method in ("vsgd", "vsgd-poco"):
        return pk.VSGDPoCo([w], lr=cfg.lr, sigma=cfg.vsgd_sigma,
                           alpha=cfg.alpha if method == "vsgd-poco" else 0.0,
                           weight_decay=lam, mc_samples=cfg.mc_samples, seed=cfg.seed)
    ivon_kw = ivon_kwargs(cfg, n)
    if method == "ivon":
        return pk.IVON([w], **ivon_kw)
    if method in ("ivon-poco", "ivon-poco-pair"):
        pair = method == "ivon-poco-pair"     # the stability recipe: a mirrored refresh pair
        return pk.IVONPoCo([w], alpha=cfg.alpha, rho1=cfg.rho1, rho2=cfg.rho2,
                           hess_corr_scale=cfg.hess_corr_scale, outer_noise=cfg.outer_noise,
                           refresh_samples=2 if pair else cfg.refresh_samples,
                           refresh_antithetic=pair or cfg.refresh_antithetic,
                           hess_floor=cfg.hess_floor, **ivon_kw)
    if method == "von-poco":
        lr = ivon_kw["lr"]
        return pk.VONPoCo([w], ess=ivon_kw["ess"], lr=lr if cfg.von_lr is None else cfg.von_lr,
                          beta=lr if cfg.von_beta is None else cfg.von_beta, alpha=cfg.alpha,
                          prior_precision=lam, min_eig=lam, rho1=cfg.rho1, rho2=cfg.rho2,
                          seed=cfg.seed)
    raise ValueError(f"unknown method {method!r} (expected one of {METHODS})")


def has_outer_loop(method: str) -> bool:
    """Whether ``method`` refreshes (a mega-batch gradient at an outer point)."""
    return method in ("svrg", "vsgd-poco", "ivon-poco", "ivon-poco-pair", "von-poco")


def method_schedule(method: str, cfg: Config) -> Tuple[int, int, int]:
    """(steps, warm-up, refresh interval) of a method: VON-PoCo's scaled by von_schedule."""
    if method != "von-poco":
        return cfg.steps, cfg.warmup, cfg.refresh_every
    s = cfg.von_schedule
    return (max(1, round(cfg.steps * s)), max(0, round(cfg.warmup * s)),
            max(1, round(cfg.refresh_every * s)))

