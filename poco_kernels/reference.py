"""The maths of the optimizer family, stated once.

One function per equation group of the paper ("SVRG and Beyond via Posterior Correction",
ICML 2026; the notation of docs/design.md, Glossary).  Every backend is tested against these
functions; the ``torch`` backend calls them directly.  They are pure: they take tensors
and return new tensors, never modifying their arguments, so a caller can validate the
result before committing it (bad input loses nothing).

Equation map (Alg. = algorithm number in the paper):

=====================================  ==========================  ======================
quantity                               function                    paper
=====================================  ==========================  ======================
sigma = 1/sqrt(ess (h + wd))           :func:`ivon_sigma`          Alg. 3 lines 1, 17
theta = centre + sigma * eps           :func:`perturb`             Alg. 2 l. 3, 8; Alg. 3 l. 3, 7
hhat = E[g eps] / sigma  (Price)       :func:`price_hessian`       Alg. 3 lines 4, 8, 9
x_out <- rho x_out + (1 - rho) x_M     :func:`outer_fold`          Alg. 3 line 4
x_in - alpha (x_at_out - x_out)        :func:`control_variate`     Alg. 1 l. 7; Alg. 3 l. 10
hhat >= -c (h + wd)  (optional)        :func:`hessian_floor`       (stabiliser, docs/)
g <- beta1 g + (1 - beta1) ghat        :func:`ivon_momentum`       Alg. 3 line 11
h <- beta2 h + ... (positivity)        :func:`ivon_hessian`        Alg. 3 line 12
u = (gbar + wd m + c a dh dm)/(h + wd) :func:`ivon_direction`      Alg. 3 lines 13-14
m <- m - lr clip(u, xi)                :func:`ivon_mean`           Alg. 3 line 15
SGD / AdamW step on a corrected grad   :func:`sgd_step`,           Alg. 1 l. 8; alpha-SVRG
                                       :func:`adamw_step`
VON-PoCo precision and mean            :func:`von_poco_step`,      Alg. 4, Thm. 3
                                       :func:`blr_precision_term`
low-precision state, stored            :func:`stochastic_round`    (``state_dtype``)
=====================================  ==========================  ======================
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

__all__ = [
    "ivon_sigma", "perturb", "price_hessian", "outer_fold", "control_variate",
    "hessian_floor", "ivon_momentum", "ivon_hessian", "ivon_direction",
    "ivon_hessian_correction",
    "ivon_mean", "ivon_lr",
    "sgd_step", "adamw_step", "von_poco_step", "make_spd", "blr_precision_term",
    "stochastic_round",
]


# --------------------------------------------------------------------------- posterior
def ivon_sigma(h: Tensor, ess: float, weight_decay: float) -> Tensor:
    """Posterior standard deviation of the diagonal Gaussian: ``1 / sqrt(ess (h + wd))``."""
    return torch.rsqrt(ess * (h + weight_decay))


def perturb(centre: Tensor, sigma, eps: Optional[Tensor]) -> Tensor:
    """A posterior sample ``centre + sigma * eps``; ``eps=None`` (no noise) gives ``centre``."""
    if eps is None:
        return centre.clone()
    return centre + sigma * eps


def price_hessian(g_eps: Tensor, sigma: Tensor) -> Tensor:
    """Price/Bonnet Hessian estimate ``hhat = g * eps / sigma`` from the (mean) product
    ``g_eps`` of gradient and standard-normal noise of the same sample."""
    return g_eps / sigma


# --------------------------------------------------------------------------- correction
def outer_fold(old: Tensor, new: Tensor, rho: float, first: bool) -> Tensor:
    """Outer estimate with outer momentum (Alg. 3 line 4): ``rho old + (1 - rho) new``.

    ``rho`` weights the OLD estimate, as in Alg. 3's equations (``rho = 0``: no outer
    momentum).  At the first refresh there is no old estimate: the new one is taken as
    it is (``first=True``), instead of being biased toward the zero initialisation.
    """
    if first or rho == 0.0:
        return new.clone()
    return rho * old + (1.0 - rho) * new


def control_variate(x_in: Tensor, x_at_out: Tensor, x_out: Tensor, alpha: float) -> Tensor:
    """SVRG / PoCo correction ``x_in - alpha (x_at_out - x_out)`` (Alg. 1 line 7, Alg. 3 line 10):
    ``x_in`` and ``x_at_out`` are estimates on the same mini-batch at the inner and the outer
    posterior, ``x_out`` the mega-batch (or full-batch) estimate."""
    return x_in - alpha * (x_at_out - x_out)


# --------------------------------------------------------------------------- IVON
def hessian_floor(hhat: Tensor, h: Tensor, weight_decay: float, c: Optional[float]) -> Tensor:
    """Optional floor on the corrected Hessian estimate, ``max(hhat, -c (h + wd))``
    (``c=None``: none).  Not in the paper: a stabiliser for IVON-PoCo with beta2 below
    0.99999, where the one-sample outer estimate drives ``h + wd`` toward 0
    (docs/logreg-study.md, 'Stability of IVON-PoCo')."""
    if c is None:
        return hhat
    return torch.maximum(hhat, -c * (h + weight_decay))


def ivon_momentum(g: Tensor, ghat: Tensor, beta1: float) -> Tensor:
    """Gradient momentum ``beta1 g + (1 - beta1) ghat`` (Alg. 3 line 11)."""
    return beta1 * g + (1.0 - beta1) * ghat


def ivon_hessian(h: Tensor, hhat: Tensor, beta2: float, weight_decay: float) -> Tensor:
    """IVON's Hessian update (Alg. 3 line 12)::

        h <- beta2 h + (1 - beta2) hhat + 0.5 (1 - beta2)^2 (h - hhat)^2 / (h + wd)

    With ``x = h + wd > 0`` and ``z = (1 - beta2)(hhat - h) / x`` the new ``h + wd`` is
    ``x (1 + z + z^2 / 2) >= x / 2``: positivity of ``h + wd`` is kept for ANY ``hhat``, but
    ``h + wd`` can halve at every step when ``hhat`` is very negative.
    """
    return (beta2 * h + (1.0 - beta2) * hhat
            + (0.5 * (1.0 - beta2) ** 2) * (h - hhat).square() / (h + weight_decay))


def ivon_direction(g: Tensor, m: Tensor, h: Tensor, *, weight_decay: float, beta1: float,
                   step: int, debias: bool, hess_corr: Optional[Tensor] = None) -> Tensor:
    """Preconditioned direction (Alg. 3 lines 13-14)::

        u = (g / (1 - beta1^t) + wd m [+ hess_corr]) / (h + wd)

    ``hess_corr`` is PoCo's Hessian-correction term ``c alpha (h_out - h_at_out)(m - m_out)``
    (see :func:`ivon_hessian_correction`); ``t`` is the 1-based step number.
    """
    gbar = g / (1.0 - beta1 ** step) if debias else g
    num = gbar + weight_decay * m
    if hess_corr is not None:
        num = num + hess_corr
    return num / (h + weight_decay)


def ivon_hessian_correction(h_out: Tensor, h_at_out: Tensor, m: Tensor, m_out: Tensor,
                            alpha: float, scale: float) -> Tensor:
    """PoCo's Hessian-correction term of the mean update,
    ``scale alpha (h_out - h_at_out)(m - m_out)`` (Alg. 3 line 14, red part; ``scale`` is the
    paper's down-weighting, 0.01 in Sec. 5.1)."""
    return (scale * alpha) * (h_out - h_at_out) * (m - m_out)


def ivon_lr(lr: float, hess_init: float, weight_decay: float, rescale_lr: bool) -> float:
    """IVON's effective learning rate: ``lr (hess_init + wd)`` when ``rescale_lr``."""
    return lr * (hess_init + weight_decay) if rescale_lr else lr


def ivon_mean(m: Tensor, u: Tensor, lr: float, clip_radius: float) -> Tensor:
    """Mean update ``m - lr clip(u, -xi, xi)`` (Alg. 3 line 15)."""
    if math.isfinite(clip_radius):
        u = u.clamp(-clip_radius, clip_radius)
    return m - lr * u


# --------------------------------------------------------------------------- first order
def sgd_step(m: Tensor, grad: Tensor, buf: Optional[Tensor], *, lr: float, momentum: float,
             dampening: float, weight_decay: float, nesterov: bool
             ) -> Tuple[Tensor, Optional[Tensor]]:
    """``torch.optim.SGD``'s update, op for op (so it matches it bit for bit), on a
    (possibly corrected) gradient.  ``buf=None`` starts the momentum buffer."""
    d_p = grad
    if weight_decay != 0:
        d_p = d_p.add(m, alpha=weight_decay)
    new_buf = None
    if momentum != 0:
        if buf is None:
            new_buf = torch.clone(d_p).detach()
        else:
            new_buf = buf.mul(momentum).add_(d_p, alpha=1 - dampening)
        d_p = d_p.add(new_buf, alpha=momentum) if nesterov else new_buf
    return m.add(d_p, alpha=-lr), new_buf


def adamw_step(m: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *, step: int,
               lr: float, beta1: float, beta2: float, eps: float, weight_decay: float
               ) -> Tuple[Tensor, Tensor, Tensor]:
    """``torch.optim.AdamW``'s update, op for op, on a (possibly corrected) gradient
    (alpha-SVRG over AdamW).  ``step`` is 1-based.  Returns (m, exp_avg, exp_avg_sq)."""
    m = m.mul(1 - lr * weight_decay)
    exp_avg = exp_avg.lerp(grad, 1 - beta1)
    exp_avg_sq = exp_avg_sq.mul(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2 ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    return m.addcdiv(exp_avg, denom, value=-step_size), exp_avg, exp_avg_sq


# --------------------------------------------------------------------------- VON-PoCo
def make_spd(S: Tensor, min_eig: float) -> Tensor:
    """Symmetric positive-definite repair: symmetrise and raise every eigenvalue to at
    least ``min_eig`` (eigen-decomposition; VON-PoCo is for small ``d``)."""
    S = 0.5 * (S + S.T)
    evals, evecs = torch.linalg.eigh(S)
    if bool((evals >= min_eig).all()):
        return S
    S = (evecs * evals.clamp_min(min_eig)) @ evecs.T
    return 0.5 * (S + S.T)


def blr_precision_term(S: Tensor, G: Tensor, beta: float, L: Optional[Tensor] = None) -> Tensor:
    """Second-order term ``0.5 beta^2 (G - S) S^-1 (G - S)`` of the positivity-preserving
    Bayesian-learning-rule update of a Gaussian precision (Lin, Schmidt & Khan, ICML 2020)::

        S_new = (1 - beta) S + beta G + 0.5 beta^2 (G - S) S^-1 (G - S)

    the matrix form of IVON's h update (:func:`poco_kernels.reference.ivon_hessian`).  With
    ``Z = beta (S^-1/2 G S^-1/2 - I)``, ``S^-1/2 S_new S^-1/2 = I + Z + Z^2 / 2 >= I / 2``:
    ``S_new`` is positive definite for ANY symmetric ``G`` (indefinite ``G = N H_in``
    included) and at most halves per step.  ``L``: Cholesky factor of ``S`` if known.
    """
    if L is None:
        L = torch.linalg.cholesky(S)
    X = torch.linalg.solve_triangular(L, G - S, upper=False)      # L^-1 (G - S)
    return (0.5 * beta * beta) * (X.mT @ X)


def von_poco_step(m: Tensor, S: Tensor, m_out: Tensor, g_i_in: Tensor, g_i_at_out: Tensor,
                  g_out: Tensor, H_i_in: Tensor, H_i_at_out: Tensor, H_out: Tensor, *, lr: float,
                  beta: float, ess: float, alpha: float, min_eig: float,
                  precision_update: str = "paper", L: Optional[Tensor] = None
                  ) -> Tuple[Tensor, Tensor]:
    """One inner step of VON-PoCo (Alg. 4, Thm. 3; mean-loss form, ``ess`` = N), in the
    paper's order (S before m)::

        g_in  = g_i(theta_in) - alpha (g_i(theta_out) - g_out)
        H_oi  = alpha (H_out - H_i(theta_out))
        H_in  = H_i(theta_in) + H_oi
        S     = (1 - beta) S + beta N H_in          (then made SPD, eigenvalues >= min_eig)
        m     = m - lr N S^-1 (g_in + H_oi (m - m_out))

    ``g_out``, ``H_out`` are the (mean) full- or mega-batch gradient and Hessian at the
    refresh sample; ``alpha = 1`` is the paper's exact correction, ``alpha = 0`` is VON.
    ``H_in`` can be indefinite even for convex losses, so ``S`` is projected back onto
    ``{S : eig(S) >= min_eig}`` after the update (:func:`make_spd`).

    ``precision_update="blr"`` adds the positivity-preserving second-order term
    :func:`blr_precision_term` to the S update (``L``: Cholesky factor of ``S``, if known),
    so S stays positive definite for any ``H_in`` before the same projection.
    """
    g_in = control_variate(g_i_in, g_i_at_out, g_out, alpha)
    H_oi = alpha * (H_out - H_i_at_out)
    H_in = H_i_in + H_oi
    S_new = (1.0 - beta) * S + (beta * ess) * H_in
    if precision_update == "blr":
        S_new = S_new + blr_precision_term(S, ess * H_in, beta, L)
    elif precision_update != "paper":
        raise ValueError(f"precision_update must be 'paper' or 'blr', got {precision_update!r}")
    S_new = make_spd(S_new, min_eig)
    rhs = g_in + H_oi @ (m - m_out)
    m_new = m - (lr * ess) * torch.linalg.solve(S_new, rhs)
    return m_new, S_new


# --------------------------------------------------------------------------- storage
def stochastic_round(x: Tensor, bits: Tensor) -> Tensor:
    """float32 ``x`` rounded to bfloat16 stochastically: up (away from zero) with
    probability equal to the dropped fraction of a bfloat16 ulp, so the stored value is
    unbiased, ``E[round(x)] = x``.  ``bits``: 16 uniform random bits per element
    (int64 in ``[0, 2**16)``, :func:`poco_kernels.noise.rounding_bits`); the rounding
    adds them to the 16 bits that bfloat16 drops and truncates.  inf stays inf, NaN
    stays a (quiet) NaN; a value within an ulp of the largest bfloat16 may round to inf."""
    u = x.to(torch.float32).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    finite = (u & 0x7F800000) != 0x7F800000
    nan = ~finite & ((u & 0x007FFFFF) != 0)
    hi = torch.where(finite, (u + bits) >> 16, (u >> 16) | torch.where(nan, 0x0040, 0))
    hi = torch.where(hi >= 0x8000, hi - 0x10000, hi)      # (int16 holds the bit pattern)
    return hi.to(torch.int16).view(torch.bfloat16)
