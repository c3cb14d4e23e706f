"""Exact reductions: each member of the family with its correction off is its base method.

Within the family (IVON-PoCo -> IVON, VSGD-PoCo -> SVRG) the reductions are exact on every
backend.  The reductions to ``torch.optim`` are exact on the torch backend, which
follows torch's ops one by one; the fused backends agree with the torch backend to the
tolerances of ``tests/protocol/test_backends.py``."""
import pytest
import torch

import poco_kernels as pk
from helpers import Problem, mlp, params_of, run


def _assert_same(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x, y), (x - y).abs().max()


@pytest.mark.parametrize("kw", [
    dict(lr=0.1),
    dict(lr=0.05, momentum=0.9, weight_decay=1e-2),
    dict(lr=0.05, momentum=0.9, dampening=0.3),
    dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=1e-3),
])
def test_svrg_without_refresh_is_sgd_exactly(kw):
    prob = Problem()
    m1, m2 = mlp(), mlp()
    o1 = pk.SVRG(m1.parameters(), backend="torch", **kw)
    o2 = torch.optim.SGD(m2.parameters(), foreach=False, **kw)
    l1 = run(o1, m1, prob, 40)
    l2 = run_torch(o2, m2, prob, 40)
    assert l1 == l2
    _assert_same(params_of(m1), params_of(m2))


def run_torch(opt, model, prob, steps):
    return [float(opt.step(prob.closure(opt, model, b)).detach()) for b in prob.batches(steps)]


def test_svrg_torch_style_loop_is_sgd_exactly():
    """loss.backward(); opt.step() without a closure works for noiseless optimizers."""
    prob = Problem()
    m1, m2 = mlp(), mlp()
    o1 = pk.SVRG(m1.parameters(), lr=0.1, momentum=0.9, backend="torch")
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9, foreach=False)
    for b in prob.batches(25):
        for o, m in ((o1, m1), (o2, m2)):
            o.zero_grad()
            prob.loss(m, b).backward()
            o.step()
    _assert_same(params_of(m1), params_of(m2))


def test_svrg_adamw_without_refresh_is_adamw_exactly():
    prob = Problem()
    m1, m2 = mlp(), mlp()
    kw = dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.05)
    o1 = pk.SVRGAdamW(m1.parameters(), backend="torch", **kw)
    o2 = torch.optim.AdamW(m2.parameters(), foreach=False, **kw)
    run(o1, m1, prob, 40)
    run_torch(o2, m2, prob, 40)
    _assert_same(params_of(m1), params_of(m2))


@pytest.mark.parametrize("mode", ["no_refresh", "alpha0"])
def test_ivon_poco_is_ivon(mode, backend):
    """IVON-PoCo with no refresh, or with refreshes and alpha = 0, is IVON bit for bit:
    refreshes must not disturb the inner noise stream or the state IVON uses."""
    prob = Problem()
    kw = dict(lr=0.05, ess=300.0, hess_init=0.5, beta2=0.999, mc_samples=2, clip_radius=0.1)
    m1, m2 = mlp(), mlp()
    o1 = pk.IVON(m1.parameters(), seed=7, backend=backend, **kw)
    o2 = pk.IVONPoCo(m2.parameters(), seed=7, alpha=0.0 if mode == "alpha0" else 0.7,
                     rho1=0.5, rho2=0.2, backend=backend, **kw)
    steps = 30
    run(o1, m1, prob, steps)
    run(o2, m2, prob, steps, refresh_every=5 if mode == "alpha0" else None, warmup=5)
    if mode == "alpha0":
        assert o2.refresh_count == (steps - 5 + 4) // 5
    _assert_same(params_of(m1), params_of(m2))
    _assert_same(o1.flat_state("h"), o2.flat_state("h"))


def test_ivon_poco_with_alpha_differs_from_ivon(backend):
    """Guard for the test above: with alpha > 0 and refreshes, the trajectories differ."""
    prob = Problem()
    kw = dict(lr=0.05, ess=300.0, hess_init=0.5, beta2=0.999, backend=backend)
    m1, m2 = mlp(), mlp()
    run(pk.IVON(m1.parameters(), seed=7, **kw), m1, prob, 20)
    run(pk.IVONPoCo(m2.parameters(), seed=7, alpha=0.5, **kw), m2, prob, 20, refresh_every=10)
    assert not torch.equal(params_of(m1)[0], params_of(m2)[0])


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_vsgd_poco_sigma0_is_svrg_exactly(momentum, backend):
    """Thm. 2: VSGD-PoCo with the noise switched off is SVRG, refreshes included."""
    prob = Problem()
    m1, m2 = mlp(), mlp()
    o1 = pk.SVRG(m1.parameters(), lr=0.05, alpha=0.8, momentum=momentum, backend=backend)
    o2 = pk.VSGDPoCo(m2.parameters(), lr=0.05, sigma=0.0, alpha=0.8, momentum=momentum, seed=3,
                     backend=backend)
    l1 = run(o1, m1, prob, 35, refresh_every=10, warmup=5)
    l2 = run(o2, m2, prob, 35, refresh_every=10, warmup=5)
    assert l1 == l2
    _assert_same(params_of(m1), params_of(m2))
    # the correction was really active: SVRG differs from SGD here
    m3 = mlp()
    run(pk.SVRG(m3.parameters(), lr=0.05, momentum=momentum, backend=backend), m3, prob, 35)
    assert not torch.equal(params_of(m1)[0], params_of(m3)[0])


def test_vsgd_poco_noise_is_used(backend):
    prob = Problem()
    m1, m2 = mlp(), mlp()
    run(pk.SVRG(m1.parameters(), lr=0.05, backend=backend), m1, prob, 10)
    run(pk.VSGDPoCo(m2.parameters(), lr=0.05, sigma=0.05, backend=backend), m2, prob, 10)
    assert not torch.equal(params_of(m1)[0], params_of(m2)[0])
