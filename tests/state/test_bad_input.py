"""Bad input gets a clear error and changes nothing: parameters back at the mean, every
buffer and counter as before.  Every test that runs an optimizer runs on every backend."""
import copy
import re
import math

import pytest
import torch

import poco_kernels as pk
from helpers import Problem, available_backends, mlp, params_of, run

BACKENDS = available_backends()


def snapshot(opt, model):
    return (params_of(model), {b.index: {k: v.clone() for k, v in b.buffers.items()}
                               for b in opt._buckets},
            opt.step_count, opt.refresh_count, copy.deepcopy(opt.param_groups[0]))


def assert_unchanged(before, opt, model, pending=0):
    params, bufs, step, refreshes, _ = before
    for a, b in zip(params, params_of(model)):
        assert torch.equal(a, b)
    for b in opt._buckets:
        for k, v in bufs[b.index].items():
            assert torch.equal(v, b.buffers[k]), k
    assert (opt.step_count, opt.refresh_count) == (step, refreshes)
    assert opt._active is None
    assert sum(opt._pending.count.values()) == pending


def _ivon_poco(model, backend="torch", **kw):
    """(check_finite: the Triton backend's default is to skip bad gradients on the device,
    tests/protocol/test_backends.py; here every backend raises.)"""
    kw.setdefault("seed", 0)
    return pk.IVONPoCo(model.parameters(), lr=0.05, ess=300.0, beta2=0.999, alpha=0.5,
                       backend=backend, check_finite=True, **kw)


def _warm_ivon_poco(backend):
    """An IVON-PoCo three steps in, correction active; with its snapshot."""
    prob, m = Problem(), mlp()
    o = _ivon_poco(m, backend)
    run(o, m, prob, 3, refresh_every=2)
    return prob, m, o, snapshot(o, m)


@pytest.mark.parametrize("cls,kw,match", [
    (pk.IVON, dict(lr=-1.0, ess=1.0), "lr"),
    (pk.IVON, dict(lr=0.1, ess=0.0), "ess"),
    (pk.IVON, dict(lr=0.1, ess=1.0, beta2=1.0), "beta2"),
    (pk.IVON, dict(lr=0.1, ess=1.0, hess_init=0.0), "hess_init"),
    (pk.IVON, dict(lr=0.1, ess=1.0, mc_samples=0), "mc_samples"),
    (pk.IVON, dict(lr=0.1, ess=1.0, clip_radius=0.0), "clip_radius"),
    (pk.IVON, dict(lr=0.1, ess=math.nan), "ess"),
    (pk.IVONPoCo, dict(lr=0.1, ess=1.0, alpha=1.5), "alpha"),
    (pk.IVONPoCo, dict(lr=0.1, ess=1.0, rho1=1.0), "rho1.*OLD"),
    (pk.IVONPoCo, dict(lr=0.1, ess=1.0, outer_noise="same"), "outer_noise"),
    (pk.SVRG, dict(lr=0.1, momentum=-0.1), "momentum"),
    (pk.SVRG, dict(lr=0.1, nesterov=True), "Nesterov"),
    (pk.SVRGAdamW, dict(betas=(0.9, 1.0)), "betas"),
    (pk.VSGDPoCo, dict(sigma=-1.0), "sigma"),
    (pk.IVON, dict(lr=0.1, ess=1.0, seed=-3), "seed"),
    (pk.SVRG, dict(lr=0.1, seed=True), "seed"),
    # an int beyond torch's int64 scalars, a float beyond float32 (the kernels' constants)
    (pk.IVON, dict(lr=0.1, ess=10 ** 30), "ess"),
    (pk.SVRG, dict(lr=0.1, weight_decay=1e39), "weight_decay"),
    (pk.IVON, dict(lr=0.1, ess=1.0, backend="cuda"), "backend"),
])
def test_invalid_hyperparameters_at_construction(cls, kw, match):
    with pytest.raises(ValueError, match=match):
        cls(mlp().parameters(), **kw)


@pytest.mark.parametrize("backend, name", [("triton", "Triton"), ("cpp", "C++")])
@pytest.mark.parametrize("make, match", [
    (lambda be: pk.IVON(mlp(dtype=torch.float64).parameters(), lr=0.1, ess=1.0, backend=be),
     "float64"),
    (lambda be: pk.VONPoCo(torch.nn.Linear(3, 1).parameters(), lr=0.1, ess=1.0, backend=be),
     "no {name} kernels"),
])
def test_fused_backends_refuse_what_they_cannot_run(make, match, backend, name):
    if backend not in BACKENDS:
        pytest.skip(f"{backend} not available")
    with pytest.raises(RuntimeError, match=re.escape(match.format(name=name))):
        make(backend)


@pytest.mark.skipif("cpp" not in BACKENDS, reason="the C++ extension is not built")
def test_cpp_backend_refuses_a_cuda_or_meta_device():
    with pytest.raises(RuntimeError, match="run on the CPU, not on meta"):
        pk.IVON(torch.nn.Linear(3, 1, device="meta").parameters(), lr=0.1, ess=1.0,
                backend="cpp")


def test_invalid_hyperparameter_set_later_is_caught_at_step(backend):
    prob, m, o, before = _warm_ivon_poco(backend)
    o.param_groups[0]["beta1"] = 1.5
    with pytest.raises(ValueError, match="beta1"):
        o.step(prob.closure(o, m, prob.batches(1)[0]))
    assert_unchanged(before, o, m)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
@pytest.mark.parametrize("where", ["inner", "outer", "refresh"])
def test_non_finite_gradient(bad, where, backend):
    prob, m, o, before = _warm_ivon_poco(backend)
    calls = {"n": 0}
    idx = prob.batches(1)[0]

    def closure():
        calls["n"] += 1
        o.zero_grad()
        loss = prob.loss(m, idx)
        target = {"inner": 1, "outer": 2, "refresh": 1}[where]
        if calls["n"] == target:
            loss = loss * bad
        loss.backward()
        return loss

    with pytest.raises(ValueError, match="non-finite gradient"):
        if where == "refresh":
            o.refresh([closure])
        else:
            o.step(closure)
    assert_unchanged(before, o, m)


def test_found_inf_skips_the_step_like_torch_amp(backend):
    prob, m, o, before = _warm_ivon_poco(backend)
    idx = prob.batches(1)[0]

    def closure():
        o.zero_grad()
        loss = prob.loss(m, idx) * math.inf
        loss.backward()
        return loss

    o.step(closure, found_inf=torch.tensor([1.0]))
    assert_unchanged(before, o, m)
    # grad_scale unscales: a step on scaled grads equals the step on unscaled ones
    m1, m2 = mlp(), mlp()
    o1, o2 = _ivon_poco(m1, backend), _ivon_poco(m2, backend)

    def scaled(opt, model, s):
        def c():
            opt.zero_grad()
            loss = prob.loss(model, idx)
            (loss * s).backward()
            return loss
        return c
    o1.step(scaled(o1, m1, 1.0))
    o2.step(scaled(o2, m2, 1024.0), grad_scale=torch.tensor(1024.0), found_inf=torch.tensor([0.0]))
    for a, b in zip(params_of(m1), params_of(m2)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


def test_closure_raising_restores_the_mean(backend):
    prob, m, o, before = _warm_ivon_poco(backend)

    def closure():
        o.zero_grad()
        prob.loss(m, prob.batches(1)[0]).backward()
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        o.step(closure)
    assert_unchanged(before, o, m)


def test_step_without_outer_gradient_when_correction_active(backend):
    prob, m, o, before = _warm_ivon_poco(backend)
    with o.sampled("inner"):
        prob.loss(m, prob.batches(1)[0]).backward()
    with pytest.raises(RuntimeError, match="outer sample"):
        o.step()
    # refused before the update: the inner gradient is kept, and the step can be completed
    assert_unchanged(before, o, m, pending=1)
    with o.sampled("outer"):
        prob.loss(m, prob.batches(1)[0]).backward()
    o.step()
    assert o.step_count == before[2] + 1


def test_noisy_step_without_any_sample_is_a_clear_error(backend):
    """ivon-opt crashes here (gradient accumulation without sampled_params)."""
    prob = Problem()
    m = mlp()
    o = pk.IVON(m.parameters(), lr=0.05, ess=300.0, backend=backend)
    before = snapshot(o, m)
    prob.loss(m, prob.batches(1)[0]).backward()
    with pytest.raises(RuntimeError, match="posterior sample"):
        o.step()
    assert_unchanged(before, o, m)


def test_svrg_step_with_correction_but_no_closure(backend):
    prob = Problem()
    m = mlp()
    o = pk.SVRG(m.parameters(), lr=0.1, backend=backend)
    run(o, m, prob, 2, refresh_every=1)
    before = snapshot(o, m)
    prob.loss(m, prob.batches(1)[0]).backward()
    with pytest.raises(RuntimeError, match="outer sample"):
        o.step()
    assert_unchanged(before, o, m)


def test_sparse_and_complex_parameters_are_refused():
    with pytest.raises(ValueError, match="complex"):
        pk.IVON([torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))], lr=0.1, ess=1.0)
    with pytest.raises(ValueError, match="sparse"):
        pk.SVRG([torch.zeros(3, 3).to_sparse().requires_grad_()], lr=0.1)


def test_sparse_gradient_is_refused_and_changes_nothing(backend):
    emb = torch.nn.Embedding(10, 3, sparse=True)
    # (with grad_views, the fused backends' default, a sparse gradient accumulates into
    # the dense .grad view like any other: test_sparse_gradient_into_a_grad_view)
    kw = {} if backend == "torch" else {"grad_views": False}
    o = pk.SVRG(emb.parameters(), lr=0.1, backend=backend, **kw)
    before = snapshot(o, emb)

    def closure():
        o.zero_grad()
        loss = emb(torch.tensor([1, 2])).sum()
        loss.backward()
        return loss
    with pytest.raises(RuntimeError, match="sparse"):
        o.step(closure)
    assert_unchanged(before, o, emb)


@pytest.mark.parametrize("fused", ["cpp", "triton"])
def test_sparse_gradient_into_a_grad_view(fused):
    """A ``.grad`` that is a view of the flat gradient buffer is dense: autograd adds a
    sparse gradient into it, and the step is that of the dense gradient."""
    outs = []
    for sparse, kw in ((True, {}), (False, {"backend": "torch"})):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 3, sparse=sparse)
        o = pk.SVRG(emb.parameters(), lr=0.1, momentum=0.9,
                    **({"backend": fused, "grad_views": True} if sparse else kw))

        def closure():
            o.zero_grad()
            loss = (emb(torch.tensor([1, 2, 2])) ** 2).sum()
            loss.backward()
            return loss
        for _ in range(3):
            o.step(closure)
        outs.append(emb.weight.detach().clone())
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("corrupt", ["groups", "shape", "class", "missing", "count"])
def test_mismatched_state_dict(corrupt, backend):
    prob = Problem()
    m = mlp()
    o = _ivon_poco(m, backend)
    run(o, m, prob, 3, refresh_every=2)
    sd = copy.deepcopy(o.state_dict())
    m2 = mlp()
    o2 = _ivon_poco(m2, backend)
    run(o2, m2, prob, 1)
    before = snapshot(o2, m2)
    if corrupt == "groups":
        sd["param_groups"].append(copy.deepcopy(sd["param_groups"][0]))
    elif corrupt == "shape":
        sd["state"][0]["h"] = torch.zeros(2, 2)
    elif corrupt == "class":
        sd["poco"]["optimizer"] = "SVRG"
    elif corrupt == "missing":
        del sd["state"][2]["g_out"]
    elif corrupt == "count":
        sd["param_groups"][0]["params"] = sd["param_groups"][0]["params"][:-1]
    with pytest.raises(ValueError):
        o2.load_state_dict(sd)
    assert_unchanged(before, o2, m2)


def test_state_dict_with_bad_hyperparameter_is_refused(backend):
    m = mlp()
    o = _ivon_poco(m, backend)
    sd = copy.deepcopy(o.state_dict())
    sd["param_groups"][0]["ess"] = -1.0
    before = snapshot(o, m)
    with pytest.raises(ValueError, match="ess"):
        o.load_state_dict(sd)
    assert_unchanged(before, o, m)
