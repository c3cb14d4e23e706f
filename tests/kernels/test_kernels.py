"""Every kernel, Triton (under TRITON_INTERPRET=1) and C++, against the reference
functions.

One runner for both kernel sets (the ``ops`` fixture: their wrapper modules have the
same functions).  Fresh random inputs of odd sizes (not multiples of Triton's block of
1024 or of the C++ tile of 128), float32 / bfloat16 / float16 parameters and gradients,
float32 state; tolerances from ``tolerances.py``.
"""
import math

import pytest
import torch

from helpers import FUSED_BACKENDS
from poco_kernels import noise
from poco_kernels import reference as R
from poco_kernels.ivon import ivon_inner_update, ivon_refresh_update
from poco_kernels.kernels import interface as K
from poco_kernels.kernels import ops_for
from tolerances import LOW_STATE_EQUAL, NOISE, PARAM, STATE, assert_close

pytestmark = pytest.mark.skipif(not FUSED_BACKENDS, reason="no kernels to test here")

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


# --------------------------------------------------------------------------- sample
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("pdtype, sync", [(d, False) for d in PDTYPES] + [(torch.float32, True)])
@pytest.mark.parametrize("mode", ["none", "h", "buffer", "const"])
def test_sample_kernel(n, pdtype, mode, sync, ops):
    """(SYNC is for float32 parameters, which hold the mean between steps.)"""
    r = _gen(n, hash((n, str(pdtype), mode, sync)) % 2 ** 31)
    centre = r()
    h = r().abs() + 0.1
    sigma_buf = r().abs() * 0.1
    ess, wd, const, sign, counter, stream = 37.0, 3e-3, 0.25, -1.0, 5, noise.stream_id(3, 1, 2)
    param = (centre if sync else r()).to(pdtype).clone()
    mean = torch.full((n,), float("nan"))
    ctl = _ctl(steps=counter)
    mode_id = {"none": K.SIGMA_NONE, "h": K.SIGMA_IVON, "buffer": K.SIGMA_BUFFER,
               "const": K.SIGMA_CONST}[mode]
    ops.sample(param, param if sync else centre, mean, h, sigma_buf, ctl, SEED, NV, stream, 0,
               K.SampleHyper(ess, wd, const), sign, mode_id, sync)
    sigma = {"none": None, "h": R.ivon_sigma(h, ess, wd), "buffer": sigma_buf,
             "const": const}[mode]
    eps = None if mode == "none" else _eps(n, counter, stream, sign)
    expect = R.perturb(centre, sigma, eps).to(pdtype)
    assert_close(param, expect, PARAM[pdtype], "theta")
    if sync:
        assert torch.equal(mean, centre)
    else:
        assert torch.isnan(mean).all(), "without SYNC the mean buffer is not written"


# --------------------------------------------------------------------------- accumulate
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("pdtype", PDTYPES)
def test_accumulate_and_fold_kernels(n, pdtype, ops):
    """Three draws of two chunks each: acc_g is the sum of all gradients, acc_ge the sum
    of gradient * eps of its draw (draw 0 folded in when draw 1 starts)."""
    r = _gen(n, n + 17)
    ctl = _ctl(refreshes=4)
    acc_g, acc_ge = torch.full((n,), float("nan")), torch.full((n,), float("nan"))
    exp_g, exp_ge = torch.zeros(n), torch.zeros(n)
    first = True
    for draw in range(3):
        stream, sign = noise.stream_id(1, 2, draw // 2), (-1.0 if draw % 2 else 1.0)
        if draw == 1:
            s0 = noise.stream_id(1, 2, 0)
            ops.fold_ge(acc_g, acc_ge, ctl, SEED, NV, s0, 1, 1.0)
            assert_close(acc_ge, exp_ge, STATE[torch.float32], "fold")
        for _ in range(2):
            g = r().to(pdtype)
            ops.accumulate(g, acc_g, acc_ge, ctl, SEED, NV, stream, 1, sign, first, draw >= 1)
            first = False
            exp_g += g.float()
            exp_ge += g.float() * _eps(n, 4, stream, sign)
        assert_close(acc_g, exp_g, STATE[torch.float32], f"acc_g draw {draw}")
    assert_close(acc_ge, exp_ge, STATE[torch.float32], "acc_ge")
    assert int(ctl[K.CTL_BAD]) == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_accumulate_flags_nonfinite_gradients(bad, ops):
    n = 3001
    g = torch.randn(n)
    g[2345] = bad
    ctl = _ctl()
    acc = torch.zeros(n)
    ops.accumulate(g, acc, None, ctl, SEED, NV, 0, 0, 1.0, True, False)
    assert int(ctl[K.CTL_BAD]) == 1
    ok = _ctl()
    ops.accumulate(torch.randn(n), acc, None, ok, SEED, NV, 0, 0, 1.0, True, False)
    assert int(ok[K.CTL_BAD]) == 0


@pytest.mark.parametrize("pdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), None])
def test_check_flags_nonfinite_gradients_and_reads_only(bad, pdtype, ops):
    """The check of a gradient buffer adopted as its own sum: the flag set exactly when an
    element (here one near the end of an odd size) is inf or NaN, the buffer untouched."""
    n = 3001
    g = torch.randn(n).to(pdtype)
    g[-2] = 3.0e38 if bad is None else bad       # (the largest finite values pass)
    before = g.clone()
    ctl = _ctl()
    ops.check(g, ctl)
    assert bool(torch.isfinite(g).all()) == (bad is None)
    assert int(ctl[K.CTL_BAD]) == (0 if bad is None else 1)
    assert torch.equal(g.view(torch.uint8), before.view(torch.uint8))   # bits (NaN != NaN)


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


@pytest.mark.parametrize("n", SIZES[1:])
@pytest.mark.parametrize("pdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(IVON_CASES))
def test_step_kernel_ivon_family(n, pdtype, case, ops):
    a = _step_args(IVON_CASES[case], _ivon_group(), n, pdtype, seed=n * 7 + len(case))
    a["mean_n"] = n
    before = {k: v.clone() for k, v in a["st"].items()}
    a["st"] = {k: v.clone() for k, v in before.items()}
    exp = _ivon_expected(dict(a, st=before))
    ctl = _run_ivon_step(ops, a)
    for k in ("mean", "h", "momentum"):
        assert_close(a["st"][k], exp[k], STATE[torch.float32], f"{case}: {k}")
    assert_close(a["st"]["param"], exp["mean"].to(pdtype), PARAM[pdtype], f"{case}: param")
    assert int(ctl[0]) == a["steps"], "the step kernel does not advance the counter (finish does)"


def _next_sample(mean, h, a, counter, pdtype):
    """The inner sample (draw 0) at ``counter`` of the state (mean, h): what
    ``sample_ahead`` leaves in the parameters."""
    grp = a["group"]
    sigma = R.ivon_sigma(h, grp["ess"], grp["weight_decay"])
    return R.perturb(mean, sigma, _eps(mean.numel(), counter, a["s_in"])).to(pdtype)


@pytest.mark.parametrize("n", SIZES[1:])
@pytest.mark.parametrize("pdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["ivon", "poco-shared", "poco-mc2"])
def test_step_kernel_writes_the_next_sample(n, pdtype, case, ops):
    """``next_sample``: the state as without it, and in the parameters the next step's
    inner sample of the new state (counter + 1) instead of the mean."""
    a = _step_args(IVON_CASES[case], _ivon_group(), n, pdtype, seed=n * 5 + len(case))
    a["mean_n"] = n
    before = {k: v.clone() for k, v in a["st"].items()}
    plain = dict(a, st={k: v.clone() for k, v in before.items()})
    _run_ivon_step(ops, plain)
    a["st"] = {k: v.clone() for k, v in before.items()}
    _run_ivon_step(ops, a, next_sample=True)
    for k in ("mean", "h", "momentum"):
        assert torch.equal(a["st"][k], plain["st"][k]), k
    exp = _next_sample(a["st"]["mean"], a["st"]["h"], a, a["steps"] + 1, pdtype)
    assert_close(a["st"]["param"], exp, PARAM[pdtype], f"{case}: next sample")
    # guard: not the mean, and not the sample of this step's counter
    assert not torch.equal(a["st"]["param"], plain["st"]["param"])
    this = _next_sample(a["st"]["mean"], a["st"]["h"], a, a["steps"], pdtype)
    assert (a["st"]["param"].float() - this.float()).abs().max() > 0.1


@pytest.mark.parametrize("why", ["found_inf", "bad_gradient"])
def test_step_kernel_skipped_with_next_sample_leaves_this_steps_sample(why, ops):
    n = 2049
    a = _step_args(IVON_CASES["poco-shared"], _ivon_group(), n, torch.float32, seed=6)
    before = {k: v.clone() for k, v in a["st"].items()}
    found_inf = torch.ones(1) if why == "found_inf" else torch.zeros(1)
    _run_ivon_step(ops, a, found_inf=found_inf, bad=int(why == "bad_gradient"),
                   next_sample=True)
    for k in ("mean", "h", "momentum"):
        assert torch.equal(a["st"][k], before[k]), k
    exp = _next_sample(before["mean"], before["h"], a, a["steps"], torch.float32)
    assert_close(a["st"]["param"], exp, PARAM[torch.float32], "this step's inner sample")


@pytest.mark.parametrize("why", ["found_inf", "bad_gradient"])
def test_step_kernel_skips_and_puts_the_mean_back(why, ops):
    n = 2049
    a = _step_args(IVON_CASES["poco-shared"], _ivon_group(), n, torch.bfloat16, seed=5)
    before = {k: v.clone() for k, v in a["st"].items()}
    found_inf = torch.ones(1) if why == "found_inf" else torch.zeros(1)
    _run_ivon_step(ops, a, found_inf=found_inf, bad=int(why == "bad_gradient"))
    for k in ("mean", "h", "momentum"):
        assert torch.equal(a["st"][k], before[k]), k
    assert_close(a["st"]["param"], before["mean"].to(torch.bfloat16), PARAM[torch.bfloat16],
                 "param = old mean")
    # guard: the same call without the skip changes the state
    a["st"] = {k: v.clone() for k, v in before.items()}
    _run_ivon_step(ops, a, found_inf=torch.zeros(1))
    assert not torch.equal(a["st"]["mean"], before["mean"])


def test_step_kernel_grad_scale_divides_the_gradients(ops):
    n = 1500
    a = _step_args(IVON_CASES["poco-shared"], _ivon_group(), n, torch.float32, seed=9)
    a["mean_n"] = n
    before = {k: v.clone() for k, v in a["st"].items()}
    exp = _ivon_expected(dict(a, st={k: v.clone() for k, v in before.items()}))
    scale = 1024.0
    scaled = dict(a, g_in=a["g_in"] * scale,
                  outer=dict(a["outer"], g_at_out=a["outer"]["g_at_out"] * scale))
    st = {k: v.clone() for k, v in before.items()}
    o = scaled["outer"]
    grp = a["group"]
    flags = K.StepFlags.ivon(hess_corr=True, floor=False, clip=True,
            debias=True).routed(corr=True, ge_in=False, ge_at_out=False, shared_noise=True,
            next_sample=False)
    hp = K.StepHyper.ivon(lr=R.ivon_lr(grp["lr"], grp["hess_init"], grp["weight_decay"], True),
                       beta1=grp["beta1"], beta2=grp["beta2"], wd=grp["weight_decay"],
                       ess=grp["ess"], alpha=grp["alpha"], hess_corr=grp["hess_corr_scale"],
                       floor=0.0, clip=grp["clip_radius"])
    ops.step(st["mean"], st["param"], st["momentum"], st["h"], scaled["g_in"], None, o["g_at_out"],
             None, o["g_out"], o["h_out"], o["m_out"], o["sigma_out"],
             _ctl(a["steps"], 3), None, torch.tensor([scale]),
             K.StepStreams(SEED, a["s_in"], a["s_o"]),
             hp.counted(sign_at_out=1.0, inv_n_in=1.0, inv_n_at_out=1.0), flags)
    for k in ("mean", "h", "momentum"):
        assert_close(st[k], exp[k], STATE[torch.float32], k)


# --------------------------------------------------------------------------- SGD / AdamW
SGD_CASES = {
    "plain": dict(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0, first=False),
    "momentum-first": dict(momentum=0.9, dampening=0.1, nesterov=False, weight_decay=1e-2,
                           first=True),
    "momentum": dict(momentum=0.9, dampening=0.1, nesterov=False, weight_decay=1e-2,
                     first=False),
    "nesterov": dict(momentum=0.8, dampening=0.0, nesterov=True, weight_decay=3e-3,
                     first=False),
}


@pytest.mark.parametrize("n", SIZES[1:])
@pytest.mark.parametrize("pdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(SGD_CASES))
@pytest.mark.parametrize("corr", [False, True])
def test_step_kernel_sgd_family(n, pdtype, case, corr, ops):
    c = SGD_CASES[case]
    r = _gen(n, n + len(case) + corr)
    lr, alpha = 0.05, 0.6
    mean, buf, g_in, g_at_out, g_out = r(), r(), r(), r(), r()
    param = r().to(pdtype)
    m0, b0 = mean.clone(), buf.clone()
    flags = K.StepFlags.sgd(momentum=c["momentum"] != 0,
            nesterov=c["nesterov"]).routed(corr=corr, ge_in=False, ge_at_out=False,
            shared_noise=False, next_sample=False)
    hp = K.StepHyper.sgd(lr=lr, wd=c["weight_decay"], alpha=alpha, momentum=c["momentum"],
                      dampening=c["dampening"], mom_first=float(c["first"]))
    ops.step(mean, param, buf, None, g_in, None, g_at_out if corr else None, None,
             g_out if corr else None, None, None, None, _ctl(4, 1), None, None,
             K.StepStreams(SEED, 0, 0), hp.counted(sign_at_out=1.0, inv_n_in=1.0, inv_n_at_out=1.0),
             flags)
    ghat = R.control_variate(g_in, g_at_out, g_out, alpha) if corr else g_in
    exp_m, exp_b = R.sgd_step(m0, ghat, None if c["first"] else b0, lr=lr,
                              momentum=c["momentum"], dampening=c["dampening"],
                              weight_decay=c["weight_decay"], nesterov=c["nesterov"])
    assert_close(mean, exp_m, STATE[torch.float32], "mean")
    assert_close(param, exp_m.to(pdtype), PARAM[pdtype], "param")
    if exp_b is not None:
        assert_close(buf, exp_b, STATE[torch.float32], "momentum_buffer")


@pytest.mark.parametrize("n", SIZES[1:])
@pytest.mark.parametrize("pdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("corr", [False, True])
def test_step_kernel_adamw_family(n, pdtype, corr, ops):
    r = _gen(n, 3 * n + corr)
    lr, alpha, b1, b2, eps, wd, steps = 3e-3, 0.5, 0.9, 0.99, 1e-8, 0.05, 11
    mean, g_in, g_at_out, g_out = r(), r(), r(), r()
    ea, eas = r(0.1), r(0.01).square()
    param = r().to(pdtype)
    m0, ea0, eas0 = mean.clone(), ea.clone(), eas.clone()
    hp = K.StepHyper.adamw(lr=lr, beta1=b1, beta2=b2, wd=wd, eps=eps, alpha=alpha)
    flags = K.StepFlags.adamw().routed(corr=corr, ge_in=False,
                           ge_at_out=False, shared_noise=False, next_sample=False)
    ops.step(mean, param, ea, eas, g_in, None, g_at_out if corr else None, None,
             g_out if corr else None, None, None, None, _ctl(steps, 2), None, None,
             K.StepStreams(SEED, 0, 0), hp.counted(sign_at_out=1.0, inv_n_in=1.0, inv_n_at_out=1.0),
             flags)
    ghat = R.control_variate(g_in, g_at_out, g_out, alpha) if corr else g_in
    exp = R.adamw_step(m0, ghat, ea0, eas0, step=steps + 1, lr=lr, beta1=b1, beta2=b2,
                       eps=eps, weight_decay=wd)
    for got, e, name in zip((mean, ea, eas), exp, ("mean", "exp_avg", "exp_avg_sq")):
        assert_close(got, e, STATE[torch.float32], name)
    assert_close(param, exp[0].to(pdtype), PARAM[pdtype], "param")


# --------------------------------------------------------------------------- refresh
@pytest.mark.parametrize("n", SIZES[1:])
@pytest.mark.parametrize("refreshes", [0, 3])
@pytest.mark.parametrize("ge", [False, True])
def test_refresh_kernel_ivon_family(n, refreshes, ge, ops):
    r = _gen(n, n + 10 * refreshes + ge)
    grp = dict(ess=80.0, weight_decay=1e-3, rho1=0.6, rho2=0.1)
    mean, h = r(), r(0.3).abs() + 0.05
    g_out, h_out = r(), r()
    m_out, sigma_out = torch.full((n,), float("nan")), torch.full((n,), float("nan"))
    k = 3
    acc_g, acc_ge = r() * k, r() * k
    stream = noise.stream_id(4, 2, 0)
    before = dict(g_out=g_out.clone(), h_out=h_out.clone())
    ops.refresh(mean, h, acc_g, acc_ge if ge else None, g_out, h_out, m_out, sigma_out, _ctl(9,
            refreshes), None, None, SEED, NV, stream, K.RefreshHyper.ivon(ess=grp["ess"],
            wd=grp["weight_decay"], rho1=grp["rho1"], rho2=grp["rho2"]).counted(inv_n=1.0 / k),
            K.RefreshFlags(K.FAMILY_IVON, ge=ge, noisy=True))
    gM = acc_g / k
    geM = acc_ge / k if ge else gM * _eps(n, refreshes, stream)
    exp = ivon_refresh_update(mean=mean, h=h, gM=gM, geM=geM, g_out=before["g_out"],
                              h_out=before["h_out"], group=grp, first=refreshes == 0)
    for name, got in (("g_out", g_out), ("h_out", h_out), ("m_out", m_out),
                      ("sigma_out", sigma_out)):
        assert_close(got, exp[name], STATE[torch.float32], name)


# --------------------------------------------------------------------------- low-precision state
def _assert_low_state(got, exact, bits, what):
    """``got`` (bfloat16, a kernel's) against the reference's stochastic rounding of the
    float32 ``exact`` with ``bits``: within STATE[bf16], and bit-equal almost everywhere
    (other rounding bits would disagree on about half the elements)."""
    assert got.dtype == torch.bfloat16, what
    exp = R.stochastic_round(exact, bits)
    assert_close(got, exp, STATE[torch.bfloat16], what)
    same = (got.view(torch.int16) == exp.view(torch.int16)).float().mean().item()
    assert same >= LOW_STATE_EQUAL, f"{what}: only {same:.3f} of the elements bit-equal"
    # guard: not round-to-nearest (the rounding is stochastic)
    assert not torch.equal(got, exact.to(torch.bfloat16)), what


#: the buffers each way of keeping state in bfloat16 stores so: ``state_dtype`` and
#: ``outer_dtype`` (the outer estimates alone, the rest float32)
LOW_BUFFERS = {"state": ("momentum", "g_out", "h_out", "m_out", "sigma_out"),
               "outer": ("g_out", "h_out")}


@pytest.mark.parametrize("pdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case,low", [("ivon", "state"), ("poco-shared", "state"),
                                      ("poco-shared", "outer")])
def test_step_kernel_low_precision_state(pdtype, case, low, ops):
    """state_dtype=bfloat16: momentum and outer buffers read as bfloat16, the new momentum
    stored with the reference's stochastic rounding (bits of the step counter, the
    bucket in the inner stream, tag 0); mean and h as with float32 state.  outer_dtype:
    g_out and h_out read as bfloat16, the rest float32."""
    n = 2125
    a = _step_args(IVON_CASES[case], _ivon_group(), n, pdtype, seed=n * 11 + len(case))
    a["mean_n"] = n
    lows = LOW_BUFFERS[low]
    if "momentum" in lows:
        a["st"]["momentum"] = a["st"]["momentum"].to(torch.bfloat16)
    if a["outer"] is not None:
        for k in (k for k in lows if k != "momentum"):
            a["outer"][k] = a["outer"][k].to(torch.bfloat16)
    wide = dict(a, st={k: (v.float() if k == "momentum" else v.clone())
                       for k, v in a["st"].items()},
                outer=None if a["outer"] is None else {
                    k: (v.float() if v is not None else None) for k, v in a["outer"].items()})
    exp = _ivon_expected(wide)
    _run_ivon_step(ops, a)
    for k in ("mean", "h") + (() if "momentum" in lows else ("momentum",)):
        assert a["st"][k].dtype == torch.float32, k
        assert_close(a["st"][k], exp[k], STATE[torch.float32], f"{case}: {k}")
    if "momentum" in lows:
        bits = noise.rounding_bits(SEED, a["steps"], 2, noise.ROUND_TAGS["momentum"], n)
        _assert_low_state(a["st"]["momentum"], exp["momentum"], bits, f"{case}: momentum")
    assert_close(a["st"]["param"], exp["mean"].to(pdtype), PARAM[pdtype], f"{case}: param")


@pytest.mark.parametrize("low", ["state", "outer"])
def test_refresh_and_outer_sample_kernels_low_precision_state(low, ops):
    """The refresh writes its bfloat16 buffers (g_out, h_out, m_out, sigma_out with
    state_dtype; g_out, h_out with outer_dtype) with stochastic rounding (tags 1-4, the
    refresh counter), the others as float32; the outer sample reads the centre and sigma
    as they are stored."""
    n, refreshes = 2125, 3
    r = _gen(n, 4242)
    grp = dict(ess=80.0, weight_decay=1e-3, rho1=0.6, rho2=0.1)
    mean, h = r(), r(0.3).abs() + 0.05
    dt = {k: torch.bfloat16 if k in LOW_BUFFERS[low] else torch.float32
          for k in ("g_out", "h_out", "m_out", "sigma_out")}
    outs = {"g_out": r().to(dt["g_out"]), "h_out": r().to(dt["h_out"]),
            "m_out": torch.zeros(n, dtype=dt["m_out"]),
            "sigma_out": torch.zeros(n, dtype=dt["sigma_out"])}
    acc_g = r()
    stream = noise.stream_id(4, 2, 0)
    before = {k: v.float() for k, v in outs.items()}
    ops.refresh(mean, h, acc_g, None, outs["g_out"], outs["h_out"], outs["m_out"],
                outs["sigma_out"], _ctl(9, refreshes), None, None, SEED, NV, stream,
                K.RefreshHyper.ivon(ess=grp["ess"], wd=grp["weight_decay"],
                                                   rho1=grp["rho1"],
                                                           rho2=grp["rho2"]).counted(inv_n=1.0),
                K.RefreshFlags(K.FAMILY_IVON, ge=False, noisy=True))
    exp = ivon_refresh_update(mean=mean, h=h, gM=acc_g, geM=acc_g * _eps(n, refreshes, stream),
                              g_out=before["g_out"], h_out=before["h_out"], group=grp,
                              first=False)
    for name, t in outs.items():
        if t.dtype == torch.float32:
            assert_close(t, exp[name], STATE[torch.float32], name)
            continue
        bits = noise.rounding_bits(SEED, refreshes, 4, noise.ROUND_TAGS[name], n)
        _assert_low_state(t, exp[name], bits, name)
    param, counter, s_o = torch.empty(n), 7, noise.stream_id(4, 0, 0)
    ops.sample(param, outs["m_out"], torch.empty(n), None, outs["sigma_out"], _ctl(counter),
               SEED, NV, s_o, 0, K.SampleHyper(1.0, 0.0, 0.0), 1.0, K.SIGMA_BUFFER, False)
    expect = R.perturb(outs["m_out"].float(), outs["sigma_out"].float(), _eps(n, counter, s_o))
    assert_close(param, expect, PARAM[torch.float32], "outer sample")


@pytest.mark.parametrize("noisy", [False, True])
def test_refresh_kernel_sgd_family(noisy, ops):
    n, k, sigma = 3001, 2, 0.05
    r = _gen(n, 77 + noisy)
    mean, acc_g = r(), r()
    g_out, theta_out = torch.full((n,), float("nan")), torch.full((n,), float("nan"))
    stream = noise.stream_id(0, 2, 0)
    ops.refresh(mean, None, acc_g, None, g_out, None, theta_out, None, _ctl(5, 2), None,
                None, SEED, NV, stream, K.RefreshHyper.sgd(sigma=sigma).counted(inv_n=1.0 / k),
                K.RefreshFlags(K.FAMILY_SGD, ge=False, noisy=noisy))
    assert_close(g_out, acc_g / k, STATE[torch.float32], "g_out")
    exp = R.perturb(mean, sigma, _eps(n, 2, stream)) if noisy else mean
    assert_close(theta_out, exp, STATE[torch.float32], "theta_out")


@pytest.mark.parametrize("found_inf, bad, expect", [
    (None, 0, [8, 3, 0, 1]), (0.0, 0, [8, 3, 0, 1]), (1.0, 0, [7, 3, 0, 2]),
    (None, 1, [7, 3, 0, 2])])
def test_finish_kernel(found_inf, bad, expect, ops):
    ctl = torch.tensor([7, 3, bad, 1], dtype=torch.int64)
    fi = None if found_inf is None else torch.tensor([found_inf])
    ops.finish(ctl, fi, 0)
    assert ctl.tolist() == expect


# --------------------------------------------------------------------------- noise, indices
if "triton" in FUSED_BACKENDS:
    import triton
    import triton.language as tl
    from poco_kernels.kernels import triton_noise as TK

    @triton.jit
    def _triton_noise_probe(out_ptr, pid0, seed, counter, stream, NOISE: tl.constexpr,
                            BLOCK: tl.constexpr):
        """The Triton kernels' ``noise`` of the blocks ``pid0 + program_id`` (element
        indices int64, as in the kernels), written from ``out[0]`` on."""
        pid = tl.program_id(0).to(tl.int64)
        idx = (pid0 + pid) * BLOCK + tl.arange(0, BLOCK)
        x = TK.noise(seed, idx, pid0 + pid, 0, counter, stream, NOISE, 0, BLOCK)
        tl.store(out_ptr + pid * BLOCK + tl.arange(0, BLOCK), x)


def _kernel_noise(ops, n, base, counter, stream, version=NV, branch_free=True):
    """The kernels' normals of element indices base .. base + n - 1 (Triton: with the
    compiled kernels' branch-free transform, or the interpreter's numpy one,
    ``triton_kernels.BRANCH_FREE``)."""
    if ops.__name__.endswith("cpp_ops"):
        return ops.randn(torch.empty(n), SEED, counter, stream, base, version)
    block = 256
    pid0, lead = divmod(base, block)
    nblocks = triton.cdiv(lead + n, block)
    out = torch.empty(nblocks * block)
    saved = TK.BRANCH_FREE
    TK.BRANCH_FREE = tl.constexpr(branch_free)
    try:
        _triton_noise_probe[(nblocks,)](out, pid0, SEED, counter, stream, NOISE=version,
                                        BLOCK=block)
    finally:
        TK.BRANCH_FREE = saved
    return out[lead:lead + n]


@pytest.mark.parametrize("version", noise.STREAM_VERSIONS)
@pytest.mark.parametrize("base", [0, 2 ** 31 - 5, 2 ** 32 - 1500, 3 * 2 ** 32 + 11])
def test_noise_of_element_indices_past_2_to_32(base, version, ops):
    """Element indices are int64 in every kernel: element i gets its stream value for i far
    past 2**31 and 2**32, also where the low word of the index (version 1) or of the
    Philox call (version 2: from 4 * 2**32 - 1502) wraps inside a block or a tile (a buffer that
    large does not fit this machine, so the noise code is driven with a large base
    index).  The C++ operator also starts at offsets that are not multiples of 4."""
    n = 3001
    if version == 2 and base == 2 ** 32 - 1500:
        base = 4 * 2 ** 32 - 1502        # (the call index is what wraps in version 2)
    out = _kernel_noise(ops, n, base, 7, 12345, version)
    exp = noise.randn(n, SEED, 7, 12345, offset=base, version=version)
    assert_close(out, exp, NOISE, f"base {base}")
    if version == 2 and not ops.__name__.endswith("cpp_ops"):   # the interpreter's transform
        assert_close(_kernel_noise(ops, n, base, 7, 12345, 2, branch_free=False), exp, NOISE,
                     f"base {base}, numpy transform")
    # guard: the tolerance tells neighbouring elements, counters and versions apart
    assert not torch.allclose(out[1:], exp[:-1], **NOISE)
    assert not torch.allclose(_kernel_noise(ops, n, base, 8, 12345, version), exp, **NOISE)
    other = noise.randn(n, SEED, 7, 12345, offset=base, version=3 - version)
    assert not torch.allclose(out, other, **NOISE)


@pytest.mark.parametrize("version", noise.STREAM_VERSIONS)
def test_a_shard_offset_moves_the_noise_and_the_rounding(version, ops):
    """The operators' ``offset`` (an FSDP2 shard's place in its bucket): a launch over a
    slice at ``offset`` draws the stream's elements ``offset ..`` (the Triton kernels: 0, a
    multiple of 4 and any other offset are their ``SHARD`` 0, 1 and 2), and the stochastic
    rounding of bfloat16 state uses the same indices: the slice of a whole launch."""
    n, ctl = 1001, torch.zeros(4, dtype=torch.int64)
    g = torch.randn(n + 40, generator=torch.Generator().manual_seed(3))
    whole = torch.empty(n + 40)
    ops.fold_ge(g, whole, ctl, SEED, version, 9, 0, -1.0)
    for off in (0, 4, 7, 2 ** 31, 2 ** 32 - 4, 2 ** 32 + 3):
        out = torch.empty(n)
        ops.fold_ge(g[:n].clone(), out, ctl, SEED, version, 9, 0, -1.0, off)
        exp = g[:n] * -noise.randn(n, SEED, 0, 9, offset=off, version=version)
        assert_close(out, exp, NOISE, f"offset {off}")
        if off < 40:                # the slice of the whole launch, bit for bit
            part = torch.empty(n)
            ops.fold_ge(g[off:off + n].clone(), part, ctl, SEED, version, 9, 0, -1.0, off)
            assert torch.equal(part, whole[off:off + n]), off
    # rounding: a refresh into bfloat16 outer state over a slice at 7 = the whole's slice
    m, acc = (torch.randn(n + 40, generator=torch.Generator().manual_seed(s)) for s in (4, 5))
    h = torch.rand(n + 40, generator=torch.Generator().manual_seed(6)) + 0.5
    hp = K.RefreshHyper(1.0, 100.0, 1e-3, 0.5, 0.5, 0.0)
    flags = K.RefreshFlags(K.FAMILY_IVON, False, True)

    def refresh(lo, k, off):
        outs = [torch.zeros(k, dtype=torch.bfloat16) for _ in range(4)]
        ops.refresh(m[lo:lo + k].clone(), h[lo:lo + k].clone(), acc[lo:lo + k].clone(), None,
                    *outs, torch.zeros(4, dtype=torch.int64), None, None, SEED, version,
                    (3 << 16) | 2, hp, flags, off)
        return outs
    whole_outs, part_outs = refresh(0, n + 40, 0), refresh(7, n, 7)
    for w, q in zip(whole_outs, part_outs):
        _assert_same_bits(q, w[7:7 + n])
    shifted = refresh(7, n, 0)                  # (the offset matters to the rounding)
    assert not torch.equal(shifted[0], part_outs[0])


def _assert_same_bits(got, expected):
    """Bit for bit, except that any NaN matches any NaN."""
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(got), nan)
    bits = torch.int16 if expected.element_size() == 2 else torch.int32
    assert torch.equal(got[~nan].view(bits), expected[~nan].view(bits))


def test_bfloat16_parameters_round_to_nearest_even_and_keep_nan(ops):
    """The kernels' float32 -> bfloat16 store equals torch's cast bit for bit, specials
    (every NaN payload, infinities, overflow to inf, subnormals) included."""
    n = 4099
    x = torch.randn(n) * torch.logspace(-40, 38, n)
    specials = torch.tensor([0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0x7FC00000, 0x7F800000,
                             0xFF800000, 0x7F7FFFFF, 0x00000001, 0x80000000, 0x3F808000,
                             0x3F818000], dtype=torch.int64).to(torch.int32)
    x[:len(specials)] = specials.view(torch.float32)
    p = torch.empty(n, dtype=torch.bfloat16)
    ops.sample(p, x, x, None, None, _ctl(), SEED, NV, 0, 0, K.SampleHyper(1.0, 0.0, 0.0), 1.0,
               K.SIGMA_NONE, False)
    _assert_same_bits(p, x.to(torch.bfloat16))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # numpy, on purpose
def test_float16_parameters_and_gradients_convert_like_torch(ops):
    """float32 -> float16 stores (round to nearest even, overflow to inf, subnormals, NaN
    stays NaN) and float16 -> float32 loads (all 65536 encodings) equal torch's casts."""
    n = 70001
    x = torch.randn(n) * torch.logspace(-12, 6, n)
    ties = torch.tensor([65504.0, 65519.0, 65520.0, 2.0 ** -24, 3 * 2.0 ** -25, 2.0 ** -25,
                         2.0 ** -14 - 2.0 ** -25, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11,
                         float("inf"), -float("inf"), float("nan"), -0.0, 1e-30])
    x[:len(ties)] = ties
    p = torch.empty(n, dtype=torch.float16)
    ops.sample(p, x, x, None, None, _ctl(), SEED, NV, 0, 0, K.SampleHyper(1.0, 0.0, 0.0), 1.0,
               K.SIGMA_NONE, False)
    _assert_same_bits(p, x.to(torch.float16))
    # loads: every float16 encoding through accumulate (acc_g = g as float32)
    g = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    acc = torch.empty(g.numel())
    ctl = _ctl()
    ops.accumulate(g, acc, None, ctl, SEED, NV, 0, 0, 1.0, True, False)
    _assert_same_bits(acc, g.float())
    assert int(ctl[K.CTL_BAD]) == 1        # the encodings include inf and NaN


# --------------------------------------------------------------------------- as operators
def test_operators_pass_opcheck(ops):
    """Each kernel is a torch operator whose schema declares exactly what it mutates and
    whose fake kernel works: what torch.compile and export rely on (torch.library.opcheck:
    schema, fake tensors, autograd registration, AOT dispatch)."""
    ns = torch.ops.poco_kernels_cpp if ops.__name__.endswith("cpp_ops") else torch.ops.poco_kernels
    n = 1000
    g = torch.Generator().manual_seed(1)
    r = lambda: torch.randn(n, generator=g)  # noqa: E731
    ctl = _ctl(3, 1)
    flags = K.StepFlags.ivon(hess_corr=True, floor=False,
                                                          clip=False,
                                                                  debias=True).routed(corr=True,
                                                                  ge_in=False, ge_at_out=False,
                                                                  shared_noise=True,
                                                                  next_sample=False)
    hp = K.StepHyper.ivon(lr=0.01, beta1=0.9, beta2=0.999, wd=1e-4, ess=50.0,
                                      alpha=0.7, hess_corr=0.01, floor=0.0,
                                              clip=0.0).counted(sign_at_out=1.0, inv_n_in=1.0,
                                              inv_n_at_out=1.0)
    rflags = K.RefreshFlags(K.FAMILY_IVON, ge=False, noisy=True)
    # the operators' own schemas: the C++ ones take the streams and flags as numbers, the
    # Triton custom ops as lists; both take the hyperparameters as their float64 row
    cpp = ns is torch.ops.poco_kernels_cpp
    streams = (SEED, NV, 5, 5) if cpp else ([SEED, 5, 5, NV],)
    row = K.hyper_row(hp, K.StepHyper)
    step_tail = (row, flags.family, flags.bits()) if cpp else (row, [int(v) for v in flags])
    refresh_tail = ((rflags.family, rflags.bits()) if cpp else ([int(v) for v in rflags],))
    cases = {
        "sample": (r().bfloat16(), r(), r(), r().abs() + 0.1, None, ctl, SEED, NV, 5, 0,
                   K.hyper_row(K.SampleHyper(50.0, 1e-4, 0.0), K.SampleHyper), 1.0,
                   K.SIGMA_IVON, False),
        "accumulate": (r(), r(), r(), ctl.clone(), SEED, NV, 5, 0, 1.0, False, True),
        "check": (r(), ctl.clone()),
        "fold_ge": (r(), r(), ctl, SEED, NV, 5, 0, 1.0),
        "step": (r(), r().bfloat16(), r(), r().abs() + 0.5, r(), None, r(), None, r(), r(),
                 r(), r().abs() + 0.1, ctl, None, None, *streams, *step_tail),
        "refresh": (r(), r().abs() + 0.5, r(), None, r(), r(), r(), r(), ctl, None, None, SEED, NV,
                    5, K.hyper_row(K.RefreshHyper(1.0, 50.0, 1e-4, 0.5, 0.1, 0.0), K.RefreshHyper),
                    *refresh_tail),
        "finish": (ctl.clone(), None, 0),
    }
    for name, args in cases.items():
        torch.library.opcheck(getattr(ns, name), args)


@pytest.mark.skipif(set(FUSED_BACKENDS) != {"cpp", "triton"}, reason="needs both kernel sets")
@pytest.mark.parametrize("version", noise.STREAM_VERSIONS)
@pytest.mark.parametrize("base", [0, 3 * 2 ** 32 + 1024])
def test_the_noise_is_the_same_bits_in_both_kernel_sets(base, version):
    """Both stream versions' transform is the same branch-free code in C++ and Triton (log,
    sine, cosine by polynomials, correctly rounded division and square root, no fused
    multiply-adds): the normals agree bit for bit, through the kernels' ``randn`` and
    inside a kernel (a compiled Triton kernel gives the interpreter's bits: the GPU check)."""
    from poco_kernels.kernels import cpp_ops, triton_ops
    n = 5000
    a = _kernel_noise(triton_ops, n, base, 7, 12345, version)
    b = _kernel_noise(cpp_ops, n, base, 7, 12345, version)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    saved = TK.BRANCH_FREE
    TK.BRANCH_FREE = tl.constexpr(True)
    try:
        c = triton_ops.randn(torch.empty(n), SEED, 7, 12345, base, version)
    finally:
        TK.BRANCH_FREE = saved
    assert torch.equal(c.view(torch.int32), b.view(torch.int32))
