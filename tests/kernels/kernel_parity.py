"""Shared inputs and runners of the kernel parity tests (``test_kernels_*.py``): every
kernel, Triton (under TRITON_INTERPRET=1) and C++, against the reference functions.

One runner for both kernel sets (the ``ops`` fixture: their wrapper modules have the
same functions).  Fresh random inputs of odd sizes (not multiples of Triton's block of
1024 or of the C++ tile of 128), float32 / bfloat16 / float16 parameters and gradients,
float32 state; tolerances from ``tolerances.py``.  Also the IVON-family step's inputs,
launch and expected result, which the step and the low-precision state tests share.
"""
import math

import pytest
import torch

from helpers import FUSED_BACKENDS
from poco_kernels import noise
from poco_kernels import reference as R
from poco_kernels.ivon import ivon_inner_update
from poco_kernels.kernels import interface as K
from poco_kernels.kernels import ops_for

SIZES = [1, 1023, 2125]        # below, around and above a block / across tiles
PDTYPES = [torch.float32, torch.bfloat16, torch.float16]
SEED = 987654321123
NV = noise.STREAM_VERSION      # the noise stream definition the kernels are tested with


@pytest.fixture(params=FUSED_BACKENDS)
def ops(request):
    """The kernels' wrapper module: ``triton_ops`` or ``cpp_ops``."""
    return ops_for(request.param)


def _gen(n, seed):
    g = torch.Generator().manual_seed(seed)
    return lambda scale=1.0, shift=0.0: torch.randn(n, generator=g) * scale + shift


def _ctl(steps=0, refreshes=0, bad=0):
    return torch.tensor([steps, refreshes, bad, 0], dtype=torch.int64)


def _eps(n, counter, stream, sign=1.0):
    return noise.randn(n, SEED, counter, stream) * sign


# --------------------------------------------------------------------------- IVON step
def _ivon_group(**kw):
    g = dict(lr=0.07, ess=50.0, hess_init=0.3, beta1=0.9, beta2=0.995, weight_decay=2e-3,
             clip_radius=0.4, debias=True, rescale_lr=True, alpha=0.7, hess_corr_scale=0.5,
             hess_floor=None)
    g.update(kw)
    return g


IVON_CASES = {
    "ivon": dict(corr=False),
    "ivon-noclip-nodebias": dict(corr=False, clip_radius=math.inf, debias=False),
    "poco-shared": dict(corr=True),
    "poco-independent": dict(corr=True, independent=True),
    "poco-floor": dict(corr=True, hess_floor=0.5),
    "poco-no-hess-corr": dict(corr=True, hess_corr_scale=0.0),
    "poco-mc2": dict(corr=True, mc=2),
    "poco-before-first-refresh": dict(corr=True, refreshes=0),
}


def _step_args(case, group, n, pdtype, seed):
    r = _gen(n, seed)
    c = dict(case)
    corr, mc, steps = c.pop("corr"), c.pop("mc", 1), 6
    independent, refreshes = c.pop("independent", False), c.pop("refreshes", 3)
    group = dict(group, **c)
    wd = group["weight_decay"]
    st = dict(mean=r(), h=r(0.3).abs() + 0.05, momentum=r(0.1))
    st["param"] = r().to(pdtype)            # holds the sample: overwritten with the new mean
    s_in = noise.stream_id(2, 0, 0)
    s_o = noise.stream_id(2, 1 if independent else 0, 0)
    g_in = sum(r() for _ in range(mc))
    ge_in = sum(r() for _ in range(mc)) if mc > 1 else None
    outer = None
    if corr:
        outer = dict(g_at_out=sum(r() for _ in range(mc)),
                     ge_at_out=sum(r() for _ in range(mc)) if mc > 1 else None,
                     g_out=r(), h_out=r(0.5), m_out=st["mean"] + r(0.05),
                     sigma_out=R.ivon_sigma(st["h"] + r(0.01).abs(), group["ess"], wd))
    return dict(st=st, g_in=g_in, ge_in=ge_in, outer=outer, mc=mc, steps=steps,
                refreshes=refreshes, s_in=s_in, s_o=s_o, independent=independent, group=group)


def _run_ivon_step(ops, a, found_inf=None, bad=0, next_sample=False):
    st, grp, outer = a["st"], a["group"], a["outer"]
    wd = grp["weight_decay"]
    corr = outer is not None
    path = K.StepFlags.ivon(hess_corr=grp["hess_corr_scale"] != 0,
                           floor=grp["hess_floor"] is not None,
                           clip=math.isfinite(grp["clip_radius"]), debias=grp["debias"])
    flags = path.routed(corr=corr, ge_in=a["ge_in"] is not None,
                           ge_at_out=corr and outer["ge_at_out"] is not None,
                           shared_noise=corr and not a["independent"] and a["mc"] == 1,
                           next_sample=next_sample)
    ctl = _ctl(steps=a["steps"], refreshes=a["refreshes"], bad=bad)
    o = outer or {}
    hp = K.StepHyper.ivon(lr=R.ivon_lr(grp["lr"], grp["hess_init"], wd, grp["rescale_lr"]),
                       beta1=grp["beta1"], beta2=grp["beta2"], wd=wd, ess=grp["ess"],
                       alpha=grp["alpha"], hess_corr=grp["hess_corr_scale"],
                       floor=grp["hess_floor"] or 0.0,
                       clip=grp["clip_radius"] if math.isfinite(grp["clip_radius"]) else 0.0)
    hyper = hp.counted(sign_at_out=1.0, inv_n_in=1.0 / a["mc"], inv_n_at_out=1.0 / a["mc"])
    ops.step(st["mean"], st["param"], st["momentum"], st["h"], a["g_in"], a["ge_in"],
             o.get("g_at_out"), o.get("ge_at_out"), o.get("g_out"), o.get("h_out"), o.get("m_out"),
             o.get("sigma_out"), ctl, found_inf, None, K.StepStreams(SEED, a["s_in"], a["s_o"]),
             hyper, flags)
    return ctl


def _ivon_expected(a):
    st, grp, outer, n = a["st"], a["group"], a["outer"], a["mean_n"]
    mc = a["mc"]
    g_in = a["g_in"] / mc
    ge_in = (a["ge_in"] / mc if a["ge_in"] is not None
             else g_in * _eps(n, a["steps"], a["s_in"]))
    o = None
    if outer is not None and a["refreshes"] > 0:
        g_at_out = outer["g_at_out"] / mc
        ge_at_out = (outer["ge_at_out"] / mc if outer["ge_at_out"] is not None
                else g_at_out * _eps(n, a["steps"], a["s_o"]))
        o = dict(g_at_out=g_at_out, ge_at_out=ge_at_out,
                 **{k: outer[k] for k in ("g_out", "h_out", "m_out", "sigma_out")})
    return ivon_inner_update(mean=st["mean"], h=st["h"], g=st["momentum"], g_in=g_in,
                             ge_in=ge_in, outer=o, group=grp, step=a["steps"] + 1)


def _assert_same_bits(got, expected):
    """Bit for bit, except that any NaN matches any NaN."""
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(got), nan)
    bits = torch.int16 if expected.element_size() == 2 else torch.int32
    assert torch.equal(got[~nan].view(bits), expected[~nan].view(bits))
