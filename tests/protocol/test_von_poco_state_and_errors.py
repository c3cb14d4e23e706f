"""VON-PoCo's state and its refusals: the state dict (a mid-inner-loop save resumes bit
for bit, a bad precision is refused), invalid hyperparameters, parameters and protocol
calls, and transactions (a refused group change or a failing closure changes nothing).

VON-PoCo closures RETURN the loss and do not call backward()."""
import copy
import io

import pytest
import torch

from poco_kernels.von_poco import VONPoCo
from von_poco_problems import random_logreg


#: tiny LAPACK calls (31 x 31 eigh) are ~100x slower with several busy threads
pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------- helpers
def snapshot(opt):
    bufs = {(b.index, k): v.clone() for b in opt._buckets for k, v in b.buffers.items()}
    params = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    return bufs, params, opt.step_count, opt.refresh_count


def assert_same_snapshot(a, b):
    assert a[2:] == b[2:]
    assert a[0].keys() == b[0].keys()
    for k in a[0]:
        assert torch.equal(a[0][k], b[0][k]), k
    for x, y in zip(a[1], b[1]):
        assert torch.equal(x, y)


# ---------------------------------------------------------------------------- state dict
def test_state_dict_mid_inner_loop_reproduces_trajectory_bit_for_bit():
    batches = [torch.randint(0, 40, (6,), generator=torch.Generator().manual_seed(100 + t))
               for t in range(14)]
    kw = dict(ess=40.0, lr=0.4, beta=0.3, alpha=0.8, rho1=0.5, rho2=0.3, prior_precision=0.5,
              min_eig=1e-2, noise_scale=1.0, seed=5)

    def run(opt, prob, start, stop):
        out = []
        for t in range(start, stop):
            if t % 5 == 0:
                opt.refresh(prob.chunks(2))
            opt.step(prob.closure(batches[t]))
            out.append(prob.w.detach().clone())
        return out

    prob = random_logreg()
    opt = VONPoCo([prob.w], **kw)
    run(opt, prob, 0, 7)                # refreshes at 0 and 5, mid inner loop at 7
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    saved = {k: v.clone() for k, v in zip(("S", "H"), (opt.flat_state("precision")[0],
                                                       opt.flat_state("H_out")[0]))}
    ref = run(opt, prob, 7, 14)         # crosses the refresh at 10

    prob2 = random_logreg(seed=9)       # other data would differ: same data, other init
    prob2.X, prob2.y = prob.X, prob.y
    with torch.no_grad():
        prob2.w.normal_()
    opt2 = VONPoCo([prob2.w], **{**kw, "seed": 999, "lr": 0.01})
    buf.seek(0)
    opt2.load_state_dict(torch.load(buf))
    assert torch.equal(opt2.flat_state("precision")[0], saved["S"])
    assert torch.equal(opt2.flat_state("H_out")[0], saved["H"])
    assert opt2.seed == 5 and opt2.param_groups[0]["lr"] == 0.4
    assert (opt2.step_count, opt2.refresh_count) == (7, 2)
    again = run(opt2, prob2, 7, 14)
    for a, b in zip(ref, again):
        assert torch.equal(a, b)


def test_load_state_dict_refuses_bad_precision_and_changes_nothing():
    prob = random_logreg()
    opt = VONPoCo([prob.w], ess=40.0, noise_scale=0.5)
    opt.refresh(prob.chunks(2))
    opt.step(prob.closure(torch.arange(8)))
    sd = copy.deepcopy(opt.state_dict())
    opt.step(prob.closure(torch.arange(8, 16)))
    before = snapshot(opt)
    for bad in (-torch.eye(6, dtype=torch.float64), torch.zeros(6, 6, dtype=torch.float64),
                torch.eye(6, dtype=torch.float64) + torch.triu(torch.ones(6, 6), 1).double(),
                torch.eye(3, dtype=torch.float64)):
        sd_bad = copy.deepcopy(sd)
        sd_bad["poco"]["bucket_buffers"]["0/precision"] = bad
        with pytest.raises(ValueError):
            opt.load_state_dict(sd_bad)
        assert_same_snapshot(before, snapshot(opt))


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("bad", [
    dict(lr=-0.1), dict(lr=float("nan")), dict(beta=0.0), dict(beta=1.5), dict(ess=0.0),
    dict(ess=-3.0), dict(alpha=1.2), dict(alpha=-0.1), dict(prior_precision=0.0),
    dict(min_eig=0.0), dict(min_eig=-1.0), dict(min_eig=2.0, prior_precision=1.0),
    dict(noise_scale=-1.0), dict(noise_scale=float("inf")), dict(rho1=1.0), dict(rho2=-0.2),
    dict(precision_update="eig"), dict(beta=True), dict(seed=-1), dict(backend="cuda"),
])
def test_invalid_hyperparameters_raise(bad):
    prob = random_logreg()
    kw = {"ess": 40.0, **bad}
    with pytest.raises(ValueError):
        VONPoCo([prob.w], **kw)


def test_unsupported_parameters_and_protocols_raise():
    with pytest.raises(ValueError, match="float32 and float64"):
        VONPoCo([torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))], ess=1.0)
    frozen = torch.zeros(3)                 # requires_grad=False: no state, never moved
    assert len(VONPoCo([frozen, torch.nn.Parameter(torch.zeros(2))], ess=1.0).state) == 1
    prob = random_logreg()
    opt = VONPoCo([prob.w], ess=40.0)
    for call in (lambda: opt.sample(), lambda: opt.accumulate(), lambda: opt.step(),
                 lambda: opt.refresh()):
        with pytest.raises(RuntimeError):
            call()


def test_invalid_group_change_is_refused_before_anything_changes():
    prob = random_logreg()
    opt = VONPoCo([prob.w], ess=40.0, noise_scale=0.5)
    opt.refresh(prob.chunks(2))
    opt.step(prob.closure(torch.arange(8)))
    before = snapshot(opt)
    for key, value in (("beta", 0.0), ("min_eig", -1.0), ("alpha", 2.0)):
        old = opt.param_groups[0][key]
        opt.param_groups[0][key] = value
        for call in (lambda: opt.step(prob.closure(torch.arange(8))),
                     lambda: opt.refresh(prob.chunks(2))):
            with pytest.raises(ValueError):
                call()
            assert_same_snapshot(before, snapshot(opt))
        opt.param_groups[0][key] = old


def test_bad_closures_raise_and_leave_state_unchanged():
    prob = random_logreg()
    opt = VONPoCo([prob.w], ess=40.0, lr=1.0, prior_precision=1e-2, min_eig=1e-3,
                  noise_scale=0.5)
    opt.step(prob.closure(torch.arange(8)))
    opt.refresh(prob.chunks(2))
    opt.step(prob.closure(torch.arange(8)))
    before = snapshot(opt)
    good = prob.closure(torch.arange(8))
    w = prob.w

    def nan_loss():
        return good() * float("nan")

    def nan_grad():                     # finite loss (0 added), nan gradient
        return good() + torch.sqrt((w[0] - w[0].detach()) ** 2)

    def inf_hessian():                  # finite loss (+1) and gradient (+1e200), inf Hessian
        return good() + torch.exp(1e200 * (w[1] - w[1].detach()))

    calls = []

    def fails_at_outer():               # the second evaluation (theta_out) raises
        calls.append(1)
        if len(calls) == 2:
            raise KeyError("boom")
        return good()

    def calls_backward():
        loss = good()
        loss.backward()
        return loss

    def detached():
        return good().detach()

    cases = [(nan_loss, ValueError), (nan_grad, ValueError), (inf_hessian, ValueError),
             (fails_at_outer, KeyError), (calls_backward, RuntimeError),
             (detached, ValueError), (lambda: 3.0, TypeError)]
    for closure, err in cases:
        calls.clear()
        with pytest.raises(err):
            opt.step(closure)
        assert_same_snapshot(before, snapshot(opt))
        calls.clear()
        calls.append(1)                 # in a refresh, fails_at_outer fails at its first call
        with pytest.raises(err):
            opt.refresh([prob.closure(torch.arange(4)), closure])
        assert_same_snapshot(before, snapshot(opt))
    n_huge = []

    def huge_grad():                    # finite inputs (huge gradient at theta_in only, so
        n_huge.append(1)                # the correction does not cancel it): m overflows
        return good() + (1e308 * (w - w.detach()).sum() if len(n_huge) == 1 else 0.0)

    with pytest.raises(FloatingPointError):
        opt.step(huge_grad)
    assert_same_snapshot(before, snapshot(opt))
    with pytest.raises(ValueError, match="at least one"):
        opt.refresh([])
    assert_same_snapshot(before, snapshot(opt))
    opt.step(good)                      # still usable
    assert opt.step_count == before[2] + 1
