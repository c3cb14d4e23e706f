"""IVON here against ivon-opt 0.1.3, step for step, fed the same standard-normal draws
(on every backend: the fused kernels regenerate the stream that ivon-opt is fed here,
to float rounding of the normal transform)."""
import pytest
import torch

import poco_kernels as pk
from poco_kernels import noise

ivon = pytest.importorskip("ivon")


def _model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(9, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3))


def _groups(model, **g1):
    ps = list(model.parameters())
    return [{"params": ps[:2]}, {"params": ps[2:], **g1}]


def test_ivon_matches_ivon_opt_step_for_step(backend):
    # Triton runs through its interpreter here (~0.2 s a step): 40 steps cover the
    # debiasing transient and the clip; its agreement with the torch backend over whole
    # trajectories is tests/protocol/test_backends.py's, the compiled kernels' bench_gpu.py's
    steps, mc = (40 if backend == "triton" else 120), 2
    kw = dict(lr=0.05, ess=500.0, hess_init=0.7, beta1=0.9, beta2=0.999, weight_decay=1e-3,
              mc_samples=mc, clip_radius=0.05)
    g1 = dict(lr=0.02, weight_decay=3e-3)       # second group differs
    X, Y = torch.randn(64, 9), torch.randint(0, 3, (64,))
    seed = 1234

    ours_model, ref_model = _model(), _model()
    ours = pk.IVON(_groups(ours_model, **g1), seed=seed, backend=backend, **kw)
    ref = ivon.IVON(_groups(ref_model, **g1), **kw)
    sizes = [sum(p.numel() for p in g["params"]) for g in ref.param_groups]

    # ivon-opt draws torch.randn(group_numel) per group per sample, in group order: feed it
    # our counter-based draws (bucket b = group b here, kind inner, draw j, counter = step).
    calls = {"n": 0}
    real_randn = torch.randn

    def fed_randn(n, *a, **k):
        c = calls["n"]
        calls["n"] += 1
        b, j, t = c % 2, (c // 2) % mc, c // (2 * mc)
        assert n == sizes[b]
        return noise.randn(n, seed, t, noise.stream_id(b, 0, j))

    def loss_of(model, idx):
        return torch.nn.functional.cross_entropy(model(X[idx]), Y[idx])

    gen = torch.Generator().manual_seed(0)
    for t in range(steps):
        idx = torch.randint(0, 64, (8,), generator=gen)

        def c_ours():
            ours.zero_grad()
            loss = loss_of(ours_model, idx)
            loss.backward()
            return loss

        def c_ref():
            ref.zero_grad()
            with ref.sampled_params(train=True):
                loss = loss_of(ref_model, idx)
                loss.backward()
            return loss

        torch.randn = fed_randn
        try:
            l_ref = ref.step(c_ref)
        finally:
            torch.randn = real_randn
        l_ours = ours.step(c_ours)
        assert abs(float(l_ours) - float(l_ref)) <= 1e-5 * (1 + abs(float(l_ref)))
    assert calls["n"] == steps * mc * 2

    # float32 rounding over 120 steps (the two codes order their operations differently;
    # measured: at most ~2e-6 relative, 3e-8 absolute)
    for po, pr in zip(ours_model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(po, pr, rtol=1e-5, atol=1e-7)
    flat_ref_h = torch.cat([g["hess"] for g in ref.param_groups])
    flat_ours_h = torch.cat(ours.flat_state("h"))
    torch.testing.assert_close(flat_ours_h, flat_ref_h, rtol=1e-5, atol=1e-7)
    flat_ref_m = torch.cat([g["momentum"] for g in ref.param_groups])
    torch.testing.assert_close(torch.cat(ours.flat_state("momentum")), flat_ref_m,
                               rtol=2e-5, atol=1e-7)
    # and the run really moved (the comparison is not between two unchanged models)
    assert not torch.allclose(ours_model[0].weight, _model()[0].weight, atol=1e-3)
    # the Hessian really changed from its initialisation in both
    assert (flat_ref_h - 0.7).abs().max() > 1e-3


def test_parity_would_detect_a_wrong_beta2():
    """Guard: the same comparison with a different beta2 on one side must fail."""
    X, Y = torch.randn(64, 9), torch.randint(0, 3, (64,))
    a_model, b_model = _model(), _model()
    a = pk.IVON(a_model.parameters(), lr=0.05, ess=500.0, beta2=0.999, seed=1)
    b = pk.IVON(b_model.parameters(), lr=0.05, ess=500.0, beta2=0.99, seed=1)
    for _ in range(20):
        for opt, m in ((a, a_model), (b, b_model)):
            def c():
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(m(X), Y)
                loss.backward()
                return loss
            opt.step(c)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(torch.cat(a.flat_state("h")), torch.cat(b.flat_state("h")),
                                   rtol=2e-5, atol=1e-6)
