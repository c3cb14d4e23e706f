"""A valid ``add_param_group`` while the correction is active (the spare bias of the
transactional tests' model, see ``transaction_rig.py``): the new group steps as the base
method until the next refresh, then joins the correction, the same on every backend, and
for SVRG exactly as by hand.
"""
import pytest
import torch

from tolerances import PARAM, TRAJECTORY, assert_close
from transaction_rig import ALL, BACKENDS, BATCHES, CHUNKS, CORR, X, Y, Rig, make_model
from transaction_twins import assert_finite


#: tiny tensors: one thread is faster (and VONPoCo's small LAPACK calls much faster)
pytestmark = pytest.mark.usefixtures("one_thread")


# ============================================================================ valid add_param_group
NEW_GROUP = {"IVON": dict(lr=0.04), "IVONPoCo": dict(lr=0.04, alpha=0.9), "SVRG": dict(lr=0.1),
             "SVRGAdamW": dict(lr=2e-2), "VSGDPoCo": dict(lr=0.1), "VONPoCo": dict(lr=0.05)}


def _flat_state(rig):
    opt = rig.opt
    return {f"{gi}/{pi}/{k}": v.detach().clone()
            for gi, g in enumerate(opt.param_groups) for pi, p in enumerate(g["params"])
            for k, v in opt.state.get(p, {}).items()}


@pytest.mark.parametrize("name", ALL)
def test_group_added_while_correction_active(name):
    """A valid group added after a refresh: it steps as the base method until the next
    refresh, then joins the correction.  Every backend gives the torch backend's result
    (trajectory tolerance), and everything stays finite."""
    res = {}
    for backend in (["torch"] if name == "VONPoCo" else BACKENDS):
        r = Rig(name, backend)
        r.run(r.warm())
        assert r.opt.correction_active() == (name in CORR)
        before = r.spare.detach().clone()
        r.opt.add_param_group({"params": [r.spare], **NEW_GROUP[name]})
        r.run("s2 s3")
        assert_finite(r, f"{backend}: base-method steps of the new group")
        assert not torch.equal(r.spare.detach(), before), "the new group did not move"
        mid = ([p.detach().clone() for p in r.model.parameters()], _flat_state(r))
        r.run(r.tail())
        assert_finite(r, f"{backend}: after the next refresh")
        res[backend] = (mid, ([p.detach().clone() for p in r.model.parameters()], _flat_state(r)))
    ref = res["torch"]
    for backend, got in res.items():
        for stage, (g, e) in zip(("before the refresh", "after the refresh"), zip(got, ref)):
            for i, (a, b) in enumerate(zip(g[0], e[0])):
                assert_close(a, b, TRAJECTORY[torch.float32], f"{backend} {stage}: param {i}")
            assert sorted(g[1]) == sorted(e[1]), f"{backend} {stage}: state keys differ"
            for k in e[1]:
                assert_close(g[1][k], e[1][k], TRAJECTORY[torch.float32],
                             f"{backend} {stage}: state {k}")


def _grad_spare(rig, params, idx):
    m = make_model()
    with torch.no_grad():
        for p, q in zip(m.parameters(), params):
            p.copy_(q)
    loss = torch.nn.functional.cross_entropy(m(X[idx]), Y[idx])
    return torch.autograd.grad(loss, m[2].bias)[0]


def test_added_svrg_group_is_sgd_until_the_refresh_then_corrected(backend):
    """SVRG, a group added while the correction is active (momentum 0, alpha 1): its first
    step is SGD on the mini-batch gradient at the mean; after the next refresh its step is
    SGD on the corrected gradient ``g_B(m) - (g_B(theta_out) - g_out)`` (by hand)."""
    r = Rig("SVRG", backend)
    r.run(r.warm())
    lr = 0.1
    r.opt.add_param_group({"params": [r.spare], "lr": lr, "momentum": 0.0, "alpha": 1.0})
    P = [p.detach().clone() for p in r.model.parameters()]
    r.run("s2")
    expected = P[3] - lr * _grad_spare(r, P, BATCHES[2])
    assert_close(r.spare.detach(), expected, PARAM[torch.float32], "SGD step of the new group")
    P_r = [p.detach().clone() for p in r.model.parameters()]
    g_out = torch.stack([_grad_spare(r, P_r, c) for c in CHUNKS[1]]).mean(0)
    r.run("r1")
    P4 = [p.detach().clone() for p in r.model.parameters()]
    r.run("s3")
    ghat = _grad_spare(r, P4, BATCHES[3]) - (_grad_spare(r, P_r, BATCHES[3]) - g_out)
    assert_close(r.spare.detach(), P4[3] - lr * ghat, PARAM[torch.float32],
                 "corrected SGD step of the new group")
