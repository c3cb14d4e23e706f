"""The IVON family's rules: IVON (:class:`IVONRule`) and IVON-PoCo(Mo)
(:class:`IVONPoCoRule`), Alg. 3 of the paper, and their functional forms
(:func:`ivon_inner_update`, :func:`ivon_refresh_update`: the reference maths composed, what
the torch backend runs and the step and refresh kernels fuse)."""
from __future__ import annotations

import math
import warnings
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor

from .. import reference as R
from .._layout import Bucket
from .._protocol import (COUNTER_REFRESHES, COUNTER_STEPS, KIND_INNER, KIND_OUTER, KIND_REFRESH,
                         KernelRefresh, KernelStep, SampleSpec)
from .._validation import check
from ..kernels.interface import FAMILY_IVON, RefreshHyper, StepFlags, StepHyper
from .base import Rule

__all__ = ["ivon_inner_update", "ivon_refresh_update", "IVONRule", "IVONPoCoRule"]


#: the keys of ``ivon_inner_update``'s ``outer`` before their rename (read with a warning)
_OLD_OUTER_KEYS = {"g_o": "g_at_out", "ge_o": "ge_at_out"}


def _renamed_outer(outer: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """``outer`` with the keys of earlier releases (``g_o``, ``ge_o``) renamed, with a
    ``DeprecationWarning``; a missing key stays missing (a ``KeyError`` names it)."""
    old = [k for k in _OLD_OUTER_KEYS if k in outer]
    if old:
        warnings.warn(f"ivon_inner_update(outer=...): the keys {old} are now "
                      f"{[_OLD_OUTER_KEYS[k] for k in old]} (the gradient at the outer sample, "
                      "named apart from the outer estimate g_out)", DeprecationWarning,
                      stacklevel=3)
    return {_OLD_OUTER_KEYS.get(k, k): v for k, v in outer.items()}


def ivon_inner_update(*, mean: Tensor, h: Tensor, g: Tensor, g_in: Tensor, ge_in: Tensor,
                      outer: Optional[Dict[str, Tensor]], group: Dict[str, Any], step: int
                      ) -> Dict[str, Tensor]:
    """The IVON / IVON-PoCo inner step on flat buffers (functional form, Alg. 3 l. 8-17).

    ``g_in``/``ge_in``: mean gradient and mean gradient*eps at the inner samples.
    ``outer`` (None: no correction): ``g_at_out``, ``ge_at_out``, the same at the outer
    samples (this step's mini-batch), and the outer estimates and posterior ``g_out``,
    ``h_out``, ``m_out``, ``sigma_out`` (state).  Returns the new mean, h, g.
    """
    if outer is not None and not {"g_at_out", "ge_at_out"} <= set(outer):
        outer = _renamed_outer(outer)
    wd, ess = group["weight_decay"], group["ess"]
    sigma = R.ivon_sigma(h, ess, wd)
    ghat, hhat = g_in, R.price_hessian(ge_in, sigma)
    hess_corr = None
    if outer is not None:
        alpha = group["alpha"]
        h_at_out = R.price_hessian(outer["ge_at_out"], outer["sigma_out"])
        ghat = R.control_variate(ghat, outer["g_at_out"], outer["g_out"], alpha)
        hhat = R.control_variate(hhat, h_at_out, outer["h_out"], alpha)
        hhat = R.hessian_floor(hhat, h, wd, group["hess_floor"])
        if group["hess_corr_scale"] != 0.0:
            hess_corr = R.ivon_hessian_correction(outer["h_out"], h_at_out, mean, outer["m_out"],
                                                  alpha, group["hess_corr_scale"])
    g_new = R.ivon_momentum(g, ghat, group["beta1"])
    h_new = R.ivon_hessian(h, hhat, group["beta2"], wd)
    u = R.ivon_direction(g_new, mean, h_new, weight_decay=wd, beta1=group["beta1"], step=step,
                         debias=group["debias"], hess_corr=hess_corr)
    lr = R.ivon_lr(group["lr"], group["hess_init"], wd, group["rescale_lr"])
    return {"mean": R.ivon_mean(mean, u, lr, group["clip_radius"]), "h": h_new, "momentum": g_new}


def ivon_refresh_update(*, mean: Tensor, h: Tensor, gM: Tensor, geM: Tensor, g_out: Tensor,
                        h_out: Tensor, group: Dict[str, Any], first: bool) -> Dict[str, Tensor]:
    """The outer refresh of IVON-PoCo(Mo) (Alg. 3 lines 3-5): fold the mega-batch gradient
    and Price Hessian into the outer estimates, snapshot the outer posterior."""
    sigma = R.ivon_sigma(h, group["ess"], group["weight_decay"])
    hM = R.price_hessian(geM, sigma)
    return {"g_out": R.outer_fold(g_out, gM, group["rho1"], first),
            "h_out": R.outer_fold(h_out, hM, group["rho2"], first),
            "m_out": mean.clone(), "sigma_out": sigma}


class IVONRule(Rule):
    """IVON (ivon-opt 0.1.3 semantics): a momentum ``g`` and a Hessian ``h`` per
    coordinate, the inner sample from ``h``; no outer loop."""

    noisy = True
    uses_hessian = True
    has_correction = False
    step_plans = True
    low_state_buffers = ("momentum",)

    def init_buffers(self, b: Bucket, group: Dict[str, Any]) -> Dict[str, Tensor]:
        z = lambda: torch.zeros(b.numel, device=b.device, dtype=b.dtype)  # noqa: E731
        return {"h": torch.full((b.numel,), float(group["hess_init"]), device=b.device,
                                dtype=b.dtype),
                "momentum": z()}

    def check_state_value(self, name, t, group, what):
        # sigma = 1 / sqrt(ess (h + wd)) must exist; sigma_out is a standard deviation
        if name == "h":
            check(bool((t + float(group["weight_decay"]) > 0).all()),
                  f"{what}: h + weight_decay must be > 0 (the posterior precision / ess)")
        elif name == "sigma_out":
            check(bool((t >= 0).all()), f"{what}: a standard deviation must be >= 0")

    def sample_spec(self, b, group, kind, draw):
        h = dict(h=b.buffers["h"], ess=group["ess"], wd=group["weight_decay"])
        if kind == KIND_INNER:
            return SampleSpec(b.buffers["mean"], (KIND_INNER, draw, COUNTER_STEPS, 1.0), **h)
        if kind == KIND_REFRESH:
            if group.get("refresh_antithetic", False):     # draws 2j, 2j+1: +eps_j, -eps_j
                noise = (KIND_REFRESH, draw // 2, COUNTER_REFRESHES, -1.0 if draw % 2 else 1.0)
            else:
                noise = (KIND_REFRESH, draw, COUNTER_REFRESHES, 1.0)
            return SampleSpec(b.buffers["mean"], noise, **h)
        raise AssertionError(kind)

    def inner_update(self, b, group, g_in, ge_in, outer, t, view):
        return ivon_inner_update(mean=b.buffers["mean"], h=b.buffers["h"],
                                 g=b.f32("momentum"), g_in=g_in, ge_in=ge_in,
                                 outer=self._outer(b, outer), group=group, step=t)

    def _outer(self, b: Bucket, outer) -> Optional[Dict[str, Tensor]]:
        """``ivon_inner_update``'s ``outer``: none for IVON."""
        return None

    def _correction(self, group) -> Tuple[Any, float, Optional[float]]:
        """``(alpha, hess_corr_scale, hess_floor)`` of the step: none for IVON."""
        return 0.0, 0.0, None

    def kernel_step(self, b, group, view) -> KernelStep:
        """The step kernel's records: the same maths as :func:`ivon_inner_update`."""
        wd, clip = group["weight_decay"], group["clip_radius"]
        alpha, hess_corr, floor = self._correction(group)
        return KernelStep(
            s1=b.buffers["momentum"], s2=b.buffers["h"],
            hp=StepHyper.ivon(lr=R.ivon_lr(group["lr"], group["hess_init"], wd,
                                           group["rescale_lr"]),
                              beta1=group["beta1"], beta2=group["beta2"], wd=wd,
                              ess=group["ess"], alpha=alpha, hess_corr=hess_corr,
                              floor=floor or 0.0, clip=clip if math.isfinite(clip) else 0.0),
            flags=StepFlags.ivon(hess_corr=hess_corr != 0.0, floor=floor is not None,
                                 clip=math.isfinite(clip), debias=group["debias"]))


class IVONPoCoRule(IVONRule):
    """IVON-PoCo(Mo): IVON's rule plus the outer state ``g_out``, ``h_out``, ``m_out``,
    ``sigma_out``, the outer sample around ``m_out``, the corrected step and the refresh."""

    has_correction = True
    low_state_buffers = ("momentum", "g_out", "h_out", "m_out", "sigma_out")
    outer_estimate_buffers = ("g_out", "h_out")
    divergence_hint = ("See docs/logreg-study.md, 'Stability of IVON-PoCo', for the settings "
                       "that keep IVON-PoCo stable (antithetic refresh pair, hess_floor, "
                       "beta2, hess_corr_scale).")

    def init_buffers(self, b, group):
        bufs = super().init_buffers(b, group)
        for name in ("g_out", "h_out", "m_out", "sigma_out"):
            bufs[name] = torch.zeros(b.numel, device=b.device, dtype=b.dtype)
        return bufs

    def sample_spec(self, b, group, kind, draw):
        if kind == KIND_OUTER:
            noise_kind = KIND_INNER if group["outer_noise"] == "shared" else KIND_OUTER
            return SampleSpec(b.buffers["m_out"], (noise_kind, draw, COUNTER_STEPS, 1.0),
                              sigma=b.buffers["sigma_out"])
        return super().sample_spec(b, group, kind, draw)

    def _outer(self, b, outer):
        if outer is None:
            return None
        g_at_out, ge_at_out = outer
        return {"g_at_out": g_at_out, "ge_at_out": ge_at_out, **{k: b.f32(k) for k in
                                             ("g_out", "h_out", "m_out", "sigma_out")}}

    def _correction(self, group):
        return group["alpha"], group["hess_corr_scale"], group["hess_floor"]

    def refresh_update(self, b, group, gM, geM, first, view):
        return ivon_refresh_update(mean=b.buffers["mean"], h=b.buffers["h"], gM=gM, geM=geM,
                                   g_out=b.f32("g_out"), h_out=b.f32("h_out"),
                                   group=group, first=first)

    def kernel_refresh(self, b, group, view) -> KernelRefresh:
        """The refresh kernel's records: :func:`ivon_refresh_update`."""
        # a joining group's first refresh sets the estimates (its g_out, h_out are zero)
        joining = view.joining(b)
        return KernelRefresh(FAMILY_IVON, h=b.buffers["h"], g_out=b.buffers["g_out"],
                             h_out=b.buffers["h_out"], m_out=b.buffers["m_out"],
                             sigma_out=b.buffers["sigma_out"],
                             hp=RefreshHyper.ivon(ess=group["ess"], wd=group["weight_decay"],
                                                  rho1=0.0 if joining else group["rho1"],
                                                  rho2=0.0 if joining else group["rho2"]))
