"""The public API: torch.optim conventions, mixed dtypes, None gradients, the low-level
sampling protocol, the double-loop driver."""
import pytest
import torch

import poco_kernels as pk
from poco_kernels.ivon import ivon_inner_update
from poco_kernels.driver import Constant, DoubleLoop, Linear, WarmupConstant
from helpers import Problem, available_backends, mlp, params_of, run


def test_parameters_hold_the_mean_outside_step_and_refresh(backend):
    prob = Problem()
    m = mlp()
    o = pk.IVONPoCo(m.parameters(), lr=0.05, ess=50.0, alpha=0.5, backend=backend)
    seen = []

    def closure():
        seen.append(params_of(m)[0])
        o.zero_grad()
        loss = prob.loss(m, prob.batches(1)[0])
        loss.backward()
        return loss

    o.refresh([closure])
    o.step(closure)
    o.step(closure)
    mean = o.flat_state("mean")[0]
    flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    assert torch.equal(flat, mean)
    # inside the closures the parameters held samples: refresh, (inner, outer) x 2
    assert len(seen) == 5
    assert not torch.equal(seen[0], mean[:seen[0].numel()].view_as(seen[0]))
    # right after a refresh, with shared noise, the outer sample IS the inner one
    # (m_out = m, sigma_out = sigma); one step later they differ
    assert torch.equal(seen[1], seen[2])
    assert not torch.equal(seen[3], seen[4])


def test_mixed_dtypes_and_none_gradients():
    torch.manual_seed(0)
    a = torch.nn.Linear(5, 4)                         # float32
    b = torch.nn.Linear(4, 3).to(torch.bfloat16)      # bf16
    c = torch.nn.Linear(3, 2).double()                # float64
    unused = torch.nn.Parameter(torch.ones(7))        # never gets a gradient
    params = list(a.parameters()) + list(b.parameters()) + list(c.parameters()) + [unused]
    o = pk.IVON(params, lr=0.1, ess=100.0, weight_decay=0.0)
    assert len(o._buckets) == 3
    assert {bk.dtype for bk in o._buckets} == {torch.float32, torch.float64}
    x = torch.randn(6, 5)

    def closure():
        o.zero_grad()
        loss = c(b(a(x).bfloat16()).double()).square().mean()
        loss.backward()
        return loss

    for _ in range(3):
        o.step(closure)
    assert torch.equal(unused.detach(), torch.ones(7))     # zero gradient, no weight decay
    bf = next(bk for bk in o._buckets if bk.param_dtype == torch.bfloat16)
    assert bf.buffers["mean"].dtype == torch.float32          # float32 master copy
    flat = torch.cat([p.detach().reshape(-1) for p in bf.params])
    assert torch.equal(flat, bf.buffers["mean"].to(torch.bfloat16))
    assert not torch.equal(bf.buffers["mean"], bf.buffers["mean"].bfloat16().float())


def test_groups_differ_in_every_hyperparameter():
    """On the torch backend, against the functional form (the fused backends are
    compared with the torch backend on the same two groups in tests/protocol/test_backends.py)."""
    prob = Problem()
    m = mlp()
    ps = list(m.parameters())
    g0 = dict(lr=0.05, ess=300.0, hess_init=0.5, beta1=0.9, beta2=0.999, weight_decay=1e-4,
              clip_radius=1.0, alpha=0.5, rho1=0.2, rho2=0.1, hess_corr_scale=1.0)
    g1 = dict(lr=0.01, ess=900.0, hess_init=0.2, beta1=0.8, beta2=0.9999, weight_decay=1e-3,
              clip_radius=0.5, alpha=0.9, rho1=0.0, rho2=0.5, hess_corr_scale=0.01,
              debias=False, rescale_lr=False, outer_noise="independent")
    o = pk.IVONPoCo([{"params": ps[:2], **g0}, {"params": ps[2:], **g1}], lr=1.0, ess=1.0,
                    backend="torch")
    run(o, m, prob, 12, refresh_every=4)
    # one more step through the low-level API; then each bucket's new state must be the
    # functional update with ITS group's hyperparameters (and differ from the other's)
    b = prob.batches(1)[0]
    for kind in ("inner", "outer"):
        with o.sampled(kind):
            prob.loss(m, b).backward()
    est = {bk.index: (o._runner.estimate(0, bk, None), o._runner.estimate(1, bk, None)) for bk in o._buckets}
    old = {bk.index: {k: v.clone() for k, v in bk.buffers.items()} for bk in o._buckets}
    o.step()
    for bk in o._buckets:
        (g_in, ge_in), (g_at_out, ge_at_out) = est[bk.index]
        B = old[bk.index]
        outer = {"g_at_out": g_at_out, "ge_at_out": ge_at_out,
                 **{k: B[k] for k in ("g_out", "h_out", "m_out", "sigma_out")}}
        results = []
        for group in o.param_groups:
            results.append(ivon_inner_update(mean=B["mean"], h=B["h"], g=B["momentum"], g_in=g_in,
                                             ge_in=ge_in, outer=outer, group=group, step=13))
        mine, other = results[bk.group_index], results[1 - bk.group_index]
        for k in ("mean", "h", "momentum"):
            assert torch.equal(bk.buffers[k], mine[k]), k
            assert not torch.equal(bk.buffers[k], other[k]), k
    assert o.param_groups[1]["outer_noise"] == "independent"


def test_functional_form_reads_the_old_outer_keys_with_a_warning():
    """``ivon_inner_update(outer=...)`` took ``g_o``/``ge_o`` before they were named apart
    from the outer estimate ``g_out``: the old keys give the same update, with a
    ``DeprecationWarning``; a missing key is still a ``KeyError``."""
    gen = torch.Generator().manual_seed(3)
    r = lambda lo=-1.0: torch.rand(37, generator=gen) * (1 - lo) + lo   # noqa: E731
    state = dict(mean=r(), h=r(0.1), g=r(), g_in=r(), ge_in=r())
    outer = dict(g_at_out=r(), ge_at_out=r(), g_out=r(), h_out=r(0.1), m_out=r(),
                 sigma_out=r(0.1))
    group = dict(pk.IVONPoCo([torch.zeros(1)], lr=0.1, ess=50.0).defaults, alpha=0.7)
    new = ivon_inner_update(**state, outer=outer, group=group, step=3)
    old_keys = {{"g_at_out": "g_o", "ge_at_out": "ge_o"}.get(k, k): v for k, v in outer.items()}
    with pytest.warns(DeprecationWarning, match="g_at_out"):
        old = ivon_inner_update(**state, outer=old_keys, group=group, step=3)
    for k in new:
        assert torch.equal(new[k], old[k]), k
    with pytest.raises(KeyError, match="ge_at_out"):
        ivon_inner_update(**state, outer={k: v for k, v in outer.items() if k != "ge_at_out"},
                          group=group, step=3)


@pytest.mark.parametrize("block_accumulates", [False, True])
def test_low_level_protocol_equals_closure(backend, block_accumulates):
    """sample / backward / accumulate / restore / step gives the closure's trajectory;
    a ``sampled()`` block left to accumulate (the default) after accumulating its chunks
    itself adds no chunk of zeros."""
    prob = Problem()
    kw = dict(lr=0.05, ess=300.0, beta2=0.999, alpha=0.6, mc_samples=2, seed=0)
    m1, m2 = mlp(), mlp()
    o1 = pk.IVONPoCo(m1.parameters(), backend=backend, **kw)
    o2 = pk.IVONPoCo(m2.parameters(), backend=backend, **kw)
    batches, chunks = prob.batches(10), prob.chunks(3)
    run(o1, m1, prob, 10, refresh_every=4, batches=batches, chunks=chunks)
    for t in range(10):
        if t % 4 == 0:
            with o2.sampled("refresh", accumulate=block_accumulates):
                for c in chunks:                       # one sample, one backward per chunk
                    prob.loss(m2, c).backward()
                    o2.accumulate()
            o2.refresh()
        for _ in range(2):
            with o2.sampled("inner"):
                prob.loss(m2, batches[t]).backward()
        if o2.correction_active():
            for _ in range(2):
                with o2.sampled("outer"):
                    prob.loss(m2, batches[t]).backward()
        o2.step()
    for a, b in zip(params_of(m1), params_of(m2)):
        assert torch.equal(a, b)


def test_same_seed_same_samples_different_seed_different(backend):
    """Ranks sharing the seed draw the same posterior sample with no communication."""
    def sample_of(seed):
        m = mlp()
        o = pk.IVON(m.parameters(), lr=0.1, ess=10.0, seed=seed, backend=backend)
        o.sample()
        s = params_of(m)
        o.restore()
        return s
    a, b, c = sample_of(4), sample_of(4), sample_of(5)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0])


def test_sample_noise_has_the_posterior_scale(backend):
    m = torch.nn.Linear(300, 300)
    o = pk.IVON(m.parameters(), lr=0.1, ess=400.0, hess_init=0.25, weight_decay=0.0,
                backend=backend)
    w0 = m.weight.detach().clone()
    o.sample()
    d = m.weight.detach() - w0
    o.restore()
    sigma = 1.0 / (400.0 * 0.25) ** 0.5
    assert abs(d.std().item() / sigma - 1) < 0.02
    assert abs(d.mean().item()) < 5 * sigma / 300
    assert torch.equal(m.weight.detach(), w0)


def test_sample_protocol_misuse_is_reported(backend):
    m = mlp()
    o = pk.IVONPoCo(m.parameters(), lr=0.1, ess=10.0, backend=backend)
    with pytest.raises(RuntimeError, match="correction is not active"):
        o.sample("outer")
    with pytest.raises(RuntimeError, match="active sample"):
        o.accumulate()
    o.sample()
    with pytest.raises(RuntimeError, match="already"):
        o.sample()
    with pytest.raises(RuntimeError, match="restore"):
        o.step()
    with pytest.raises(RuntimeError, match="restore"):
        o.state_dict()
    o.restore()
    with pytest.raises(ValueError, match="kind"):
        o.sample("middle")
    with pytest.raises(RuntimeError, match="no outer loop"):
        pk.IVON(m.parameters(), lr=0.1, ess=1.0).refresh([])


def test_alpha_schedules():
    assert Constant(0.3)(10) == 0.3
    lin = Linear(0.2, 0.8, total_steps=100)
    assert lin(0) == pytest.approx(0.2) and lin(50) == pytest.approx(0.5) and lin(500) == pytest.approx(0.8)
    dec = Linear(0.8, 0.2, total_steps=10)
    assert dec(10) == pytest.approx(0.2)
    w = WarmupConstant(0.5, warmup=3)
    assert [w(t) for t in range(5)] == [0, 0, 0, 0.5, 0.5]


def test_double_loop_driver_counts_gradient_evaluations():
    """The paper's count: 2 n N + floor(n N / m) |M| (one epoch of inner steps here)."""
    prob = Problem(n=96)
    m = mlp()
    o = pk.SVRG(m.parameters(), lr=0.05)
    loop = DoubleLoop(o, refresh_every=6, warmup_steps=6, alpha=Linear(0.2, 0.8, 24))
    B, M = 4, 96
    for t in range(24):                  # 24 steps x 4 = 96 = one epoch
        if loop.refresh_due():
            loop.refresh([prob.closure(o, m, c) for c in prob.chunks(4)], examples=M)
        loop.step(prob.closure(o, m, prob.batches(24, size=B)[t]), examples=B)
    assert loop.refresh_steps == [6, 12, 18]
    # 6 warm-up steps at 1 gradient, 18 corrected steps at 2, 3 refreshes of 96
    assert loop.grad_evals == 6 * B + 18 * 2 * B + 3 * M
    assert o.param_groups[0]["alpha"] == pytest.approx(0.2 + 0.6 * 23 / 24)


@pytest.mark.parametrize("backend", [b for b in ("cpp", "torch") if b in available_backends()])
def test_double_loop_reads_no_device_counter_in_steady_state(backend, monkeypatch):
    """The driver's schedule runs on a host count: an inner step (with its alpha update
    and the refresh check) reads the optimizer's counters (a host synchronisation on a
    GPU) never; a refresh reads them once on the fused backends (whether the device took
    it), once per m steps.  The schedule is the one the counters give."""
    prob = Problem(n=96)
    m = mlp()
    o = pk.IVONPoCo(m.parameters(), lr=0.05, ess=300.0, seed=3, backend=backend)
    loop = DoubleLoop(o, refresh_every=4, warmup_steps=3, alpha=Linear(0.2, 0.8, 12))
    reads = []
    real = o._runner.counters
    monkeypatch.setattr(o._runner, "counters", lambda: reads.append(1) or real())
    refresh_reads = []
    for t in range(12):
        if loop.refresh_due():
            n = len(reads)
            loop.refresh([prob.closure(o, m, c) for c in prob.chunks(2)], examples=96)
            refresh_reads.append(len(reads) - n)
        loop.step(prob.closure(o, m, prob.batches(12, size=8)[t]), examples=8)
    assert len(reads) == sum(refresh_reads) and max(refresh_reads) <= 1, (reads, refresh_reads)
    reads.clear()
    assert loop.refresh_steps == [3, 7, 11] and loop.iterations == 12
    assert loop.steps == 12 == loop.iterations and len(reads) == 1    # (asked: one read)
    d = loop.state_dict()
    loop2 = DoubleLoop(o, refresh_every=4, warmup_steps=3)
    loop2.load_state_dict({k: v for k, v in d.items() if k != "iterations"})   # older dict
    assert loop2.iterations == 12


@pytest.mark.parametrize("order", ["optimizer only", "loop then optimizer",
                                   "optimizer then loop"])
def test_double_loop_resumes_whatever_the_order_of_loading(order):
    """Model, optimizer and loop built first, then the checkpoint loaded: the schedule
    (refreshes, alpha) continues where it stopped, whether the loop's own state dict is
    loaded too (before or after the optimizer's) or not at all; a bad loop dict is
    refused and changes nothing."""
    prob = Problem(n=96)
    batches = prob.batches(16, size=8)

    def make():
        m = mlp()
        o = pk.SVRG(m.parameters(), lr=0.05, backend="torch")
        return m, o, DoubleLoop(o, refresh_every=4, warmup_steps=2, alpha=Linear(0.2, 0.8, 16))

    def drive(m, o, loop, ts, log):
        for t in ts:
            if loop.refresh_due():
                loop.refresh([prob.closure(o, m, c) for c in prob.chunks(4)], examples=96)
                log.append(("refresh", t))
            loop.step(prob.closure(o, m, batches[t]), examples=8)
            log.append(("alpha", t, o.param_groups[0]["alpha"]))

    m, o, loop = make()
    ref = []
    drive(m, o, loop, range(16), ref)
    m1, o1, l1 = make()
    got = []
    drive(m1, o1, l1, range(9), got)
    msd, osd, lsd = m1.state_dict(), o1.state_dict(), l1.state_dict()
    m2, o2, l2 = make()
    m2.load_state_dict(msd)
    if order == "loop then optimizer":
        l2.load_state_dict(lsd)
    o2.load_state_dict(osd)
    if order == "optimizer then loop":
        for bad in ({"grad_evals": 1}, {"grad_evals": -1, "refresh_steps": []},
                    {"grad_evals": 0, "refresh_steps": [2.5]}, dict(lsd, iterations="9")):
            with pytest.raises(ValueError):
                l2.load_state_dict(bad)
        assert l2.grad_evals == 0 and l2.refresh_steps == []
        l2.load_state_dict(lsd)
    drive(m2, o2, l2, range(9, 16), got)
    assert got == ref
    assert l2.iterations == 16 == loop.iterations
    if order != "optimizer only":
        assert l2.grad_evals == loop.grad_evals and l2.refresh_steps == loop.refresh_steps
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)
