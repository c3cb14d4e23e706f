"""The step kernel of each family, Triton (under TRITON_INTERPRET=1) and C++, against the
reference functions: IVON and IVON-PoCo (corrections, several draws, floors, clipping),
the next sample written in place of the mean, skipped steps (found_inf, a bad gradient),
the GradScaler's scale; SGD (momentum, Nesterov) and AdamW, with and without the
correction."""
import pytest
import torch

from helpers import FUSED_BACKENDS
from kernel_parity import (IVON_CASES, SEED, SIZES, _ctl, _eps, _gen, _ivon_expected,
                           _ivon_group, _run_ivon_step, _step_args)
from kernel_parity import ops  # noqa: F401
from poco_kernels import reference as R
from poco_kernels.kernels import interface as K
from tolerances import PARAM, STATE, assert_close

pytestmark = pytest.mark.skipif(not FUSED_BACKENDS, reason="no kernels to test here")


# --------------------------------------------------------------------------- IVON step
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
