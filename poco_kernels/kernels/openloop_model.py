"""The bound models of :mod:`poco_kernels.kernels.openloop`: each kernel operation written
with :class:`~poco_kernels.kernels.bounds.Tracked` values, operation for operation as
the C++ kernels (``csrc/kernels_*.h``, and their Triton twins) compute it, with their
float32 constants made in double from the same hyperparameters as ``csrc/ops_update.cpp``
makes them.

Every model's values are the reference maths (``tests/kernels/test_openloop.py`` checks them
against :mod:`poco_kernels.reference` in float64); its bounds are those of the kernel's
float32 operations.  The normals are inputs (the kernel set's own, exact).
"""
from __future__ import annotations

import math
from typing import Dict

import torch
from torch import Tensor

from . import interface as iface
from .bounds import Tracked as T


def _x(t: Tensor) -> T:
    return T.exact(t.float() if t.dtype != torch.float32 else t)


def _pow(b: float, e: int) -> float:
    """``b ** e`` by squaring, in double (``pow_steps`` of csrc/ops_common.h)."""
    r = 1.0
    while e > 0:
        if e & 1:
            r = r * b
        b = b * b
        e >>= 1
    return r


def _inv_scale(x) -> T:
    """``1.0f / grad_scale`` (1 without AMP)."""
    if x["grad_scale"] is None:
        return T.const(1.0)
    return T.const(1.0) / T.exact(x["grad_scale"].reshape(()))


def _sigma(h: T, ess: T, wd: T) -> T:
    """``1.0f / sqrtf(ess * (h + wd))``."""
    return T.const(1.0) / (ess * (h + wd)).sqrt()


def model(c: dict, x: dict, noise: Dict[str, Tensor]) -> Dict[str, T]:
    """The outputs of the case ``c`` (an entry of ``openloop.CASES``; the names of
    :func:`~poco_kernels.kernels.openloop.run`) as exact values and bounds, from the inputs
    ``x`` and the kernel set's normals ``noise``."""
    op = c["op"]
    if op == "sample":
        return _sample(c, x, noise)
    if op == "accumulate":
        acc_g = _x(x["grad"]) if c.get("first") else _x(x["acc_g"]) + _x(x["grad"])
        out = dict(acc_g=acc_g)
        if c.get("ge"):
            eps = noise["eps"] * c.get("sign", 1.0)
            out["acc_ge"] = _x(x["acc_ge"]) + _x(x["grad"]) * _x(eps)
        return out
    if op == "fold_ge":
        return dict(acc_ge=_x(x["acc_g"]) * _x(-noise["eps"]))
    if op == "refresh":
        return _refresh(c, x, noise)
    fam = c["family"]
    if fam == iface.FAMILY_IVON:
        return _step_ivon(c, x, noise)
    if fam == iface.FAMILY_SGD:
        return _step_sgd(c, x)
    return _step_adamw(c, x)


def _sample(c, x, noise) -> Dict[str, T]:
    hp, mode = x["hp"], c["mode"]
    centre = _x(x["param"] if c.get("sync") else x["centre"])
    if mode == iface.SIGMA_NONE:
        theta = centre
    else:
        if mode == iface.SIGMA_IVON:
            sigma = _sigma(_x(x["h"]), T.const(hp["ess"]), T.const(hp["wd"]))
        elif mode == iface.SIGMA_BUFFER:
            sigma = _x(x["sigma_buf"])
        else:
            sigma = T.const(hp["sigma"])
        theta = centre + sigma * _x(noise["eps"] * c.get("sign", 1.0))
    return dict(param=theta.stored_as(x["pdtype"]))


def _step_ivon(c, x, noise) -> Dict[str, T]:
    hp, corr, mc = x["hp"], c.get("corr", False), x["mc"]
    alpha = hp["alpha"] if corr and x["refreshes"] > 0 else 0.0
    beta1, beta2, wd, ess = hp["beta1"], hp["beta2"], hp["wd"], hp["ess"]
    lr = hp["lr"] * (hp["hess_init"] + wd)
    t = x["steps"] + 1
    inv_bias1 = 1.0 / (1.0 - _pow(beta1, t)) if c.get("debias", True) else 1.0
    clip = hp["clip"] if c.get("clip", True) else math.inf
    inv_gs = _inv_scale(x)
    scale_in = T.const(1.0 / mc) * inv_gs
    scale_at_out = T.const(1.0 / mc) * inv_gs
    m, g, h = _x(x["mean"]), _x(x["momentum"]), _x(x["h"])
    cwd, cess = T.const(wd), T.const(ess)
    g_in = _x(x["g_in"]) * scale_in
    ge_in = (_x(x["ge_in"]) * scale_in if x["ge_in"] is not None
             else g_in * _x(noise["eps"]))
    inv_sigma = (cess * (h + cwd)).sqrt()
    ghat, hhat = g_in, ge_in * inv_sigma
    extra = None
    if corr:
        ca = T.const(alpha)
        g_at_out = _x(x["g_at_out"]) * scale_at_out
        ghat = g_in - ca * (g_at_out - _x(x["g_out"]))
        if x["ge_at_out"] is not None:
            ge_at_out = _x(x["ge_at_out"]) * scale_at_out
        else:
            eps_at_out = noise["eps_at_out"] if c.get("independent") else noise["eps"]
            sign_at_out = -1.0 if c.get("independent") else 1.0
            ge_at_out = g_at_out * _x(eps_at_out * sign_at_out)
        h_at_out = ge_at_out / _x(x["sigma_out"])
        hhat = hhat - ca * (h_at_out - _x(x["h_out"]))
        hhat = T.maximum(hhat, T.const(-hp["floor"]) * (h + cwd))
        extra = (T.const(hp["hess_corr"] * alpha) * (_x(x["h_out"]) - h_at_out)
                 * (m - _x(x["m_out"])))
    g_new = T.const(beta1) * g + T.const(1.0 - beta1) * ghat
    d = h - hhat
    h_new = ((T.const(beta2) * h + T.const(1.0 - beta2) * hhat)
             + (T.const(0.5 * (1.0 - beta2) * (1.0 - beta2)) * (d * d)) / (h + cwd))
    num = g_new * T.const(inv_bias1) + cwd * m
    if extra is not None:
        num = num + extra
    u = num / (h_new + cwd)
    if math.isfinite(clip):
        u = T.clamp(u, T.const(-clip), T.const(clip))
    m_new = m - T.const(lr) * u
    if c.get("skip"):                          # nothing changes; the parameters get the mean
        m_new, g_new, h_new = m, g, h
    out = dict(mean=m_new, s2=h_new, s1=g_new.stochastically_rounded() if c.get("low")
               else g_new)
    param = m_new
    if c.get("next"):
        eps_next = noise["eps"] if c.get("skip") else noise["eps_next"]
        param = m_new + _sigma(h_new, cess, cwd) * _x(eps_next)
    out["param"] = param.stored_as(x["pdtype"])
    return out


def _step_sgd(c, x) -> Dict[str, T]:
    hp, corr = x["hp"], c.get("corr", False)
    m = _x(x["mean"])
    g_in = _x(x["g_in"]) * T.const(1.0)
    ghat = g_in
    if corr:
        ghat = g_in - T.const(hp["alpha"]) * (_x(x["g_at_out"]) * T.const(1.0) - _x(x["g_out"]))
    d_p = ghat + T.const(hp["wd"]) * m
    out = {}
    if c.get("momentum"):
        mom = T.const(hp["momentum"])
        if c.get("mom_first"):
            buf = d_p
        else:
            buf = mom * _x(x["buf"]) + T.const(1.0 - hp["dampening"]) * d_p
        out["s1"] = buf
        d_p = d_p + mom * buf if c.get("nesterov") else buf
    m_new = m - T.const(hp["lr"]) * d_p
    out.update(mean=m_new, param=m_new.stored_as(x["pdtype"]))
    return out


def _step_adamw(c, x) -> Dict[str, T]:
    hp, corr = x["hp"], c.get("corr", False)
    beta1, beta2, lr, wd = hp["beta1"], 0.999, hp["lr"], hp["wd"]
    t = x["steps"] + 1
    bc1, bc2 = 1.0 - _pow(beta1, t), 1.0 - _pow(beta2, t)
    m = _x(x["mean"])
    ghat = _x(x["g_in"]) * T.const(1.0)
    if corr:
        ghat = ghat - T.const(hp["alpha"]) * (_x(x["g_at_out"]) * T.const(1.0) - _x(x["g_out"]))
    m_dec = m * T.const(1.0 - lr * wd)
    ea0, omb1 = _x(x["exp_avg"]), 1.0 - beta1
    if float(torch.tensor(omb1, dtype=torch.float32)) < 0.5:
        ea = ea0 + T.const(omb1) * (ghat - ea0)
    else:
        ea = ghat - (ghat - ea0) * (T.const(1.0) - T.const(omb1))
    eas = _x(x["exp_avg_sq"]) * T.const(beta2) + T.const(1.0 - beta2) * ghat * ghat
    denom = eas.sqrt() / T.const(math.sqrt(bc2)) + T.const(hp["eps"])
    m_new = m_dec - T.const(lr / bc1) * (ea / denom)
    return dict(mean=m_new, s1=ea, s2=eas, param=m_new.stored_as(x["pdtype"]))


def _refresh(c, x, noise) -> Dict[str, T]:
    hp, k = x["hp"], 3
    scale = T.const(1.0 / k) * T.const(1.0)
    m = _x(x["mean"])
    gM = _x(x["acc_g"]) * scale
    if c["family"] != iface.FAMILY_IVON:
        return dict(g_out=gM, m_out=m + T.const(hp["sigma"]) * _x(noise["eps"]))
    sigma = _sigma(_x(x["h"]), T.const(hp["ess"]), T.const(hp["wd"]))
    geM = _x(x["acc_ge"]) * scale if c.get("ge") else gM * _x(noise["eps"])
    hM = geM / sigma
    first = x["refreshes"] == 0
    rho1, rho2 = hp["rho1"], hp["rho2"]
    g_new = gM if first else T.const(rho1) * _x(x["g_out"]) + T.const(1.0 - rho1) * gM
    h_new = hM if first else T.const(rho2) * _x(x["h_out"]) + T.const(1.0 - rho2) * hM
    out = dict(g_out=g_new, h_out=h_new, m_out=m, sigma_out=sigma)
    if c.get("low"):
        out = {k: v.stochastically_rounded() for k, v in out.items()}
    return out
