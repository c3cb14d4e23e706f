"""Every optimizer x fused backend (C++, Triton) against the torch backend on the same
trajectory (one runner), and the fused backends' contract: AMP, non-finite gradients,
state dicts across backends, no host synchronisation (Triton), torch.compile, parameter
layout.  (Behaviour shared with the torch backend -- resume, protocol, bad input -- is
tested on every backend by the other test files.)"""
import copy
import itertools

import pytest
import torch

import poco_kernels as pk
from helpers import FUSED_BACKENDS, Problem, mlp, run
from optim_db import configs
from tolerances import PARAM, TRAJECTORY, assert_close

pytestmark = pytest.mark.skipif(not FUSED_BACKENDS, reason="no fused backend here")
fused = pytest.mark.parametrize("fused", FUSED_BACKENDS)

#: the optimizer database's trajectory configurations (tests/optim_db.py), by id
CONFIGS = {c.id: c for c in configs("trajectory")}
#: two refreshes in every configuration (warm-up <= 4, every 8) and corrected steps after
#: the second: the outer momentum's fold is compared too
STEPS = 16


def _build(name, backend, dtype, model=None):
    c = CONFIGS[name]
    m = model if model is not None else mlp(dtype=dtype)
    ps = list(m.parameters())
    groups = [{"params": ps[:2]}, {"params": ps[2:], "lr": c.kwargs["lr"] * 0.5}]
    return m, c.make(groups, backend, seed=11), c.refresh_every, c.warmup


def _trajectory(name, backend, dtype, steps=STEPS):
    prob = Problem()
    m, opt, every, warm = _build(name, backend, dtype)
    losses = run(opt, m, prob, steps, refresh_every=every, warmup=warm)
    return m, opt, losses


def _trajectory_cases():
    """Every trajectory configuration x fused backend x dtype."""
    return [pytest.param(c.id, dtype, fused, id=f"{c.id}-{str(dtype)[6:]}-{fused}")
            for c in CONFIGS.values() for fused in FUSED_BACKENDS if fused in c.runs_on()
            for dtype in c.dtypes]


@pytest.mark.parametrize("name,dtype,fused", _trajectory_cases())
def test_backends_agree_on_whole_trajectories(name, dtype, fused):
    """Tens of steps, refreshes included, two parameter groups: a fused backend against
    the torch backend, state buffer by buffer, within the configuration's tolerances."""
    m_ref, ref, l_ref = _trajectory(name, "torch", dtype)
    m_tri, tri, l_tri = _trajectory(name, fused, dtype)
    assert tri.backend == fused and ref.backend == "torch"
    assert tri.step_count == ref.step_count == STEPS
    assert tri.refresh_count == ref.refresh_count
    tol = CONFIGS[name].tol(dtype)
    for bname in ref._buckets[0].buffers:
        for a, b in zip(ref.flat_state(bname), tri.flat_state(bname)):
            assert_close(b, a, tol, f"{name}/{bname}")
    for a, b in zip(m_ref.parameters(), m_tri.parameters()):
        assert a.dtype == b.dtype == dtype
        assert_close(b, a, tol, f"{name}/param")


@fused
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_trajectory_comparison_can_fail(dtype, fused):
    """Guard: the tolerances of the runner above tell apart trajectories that differ only
    in the noise seed."""
    c = CONFIGS["IVONPoCo-clip"]
    m_ref, ref, _ = _trajectory(c.id, "torch", dtype, steps=10)
    m_o, other, _, _ = _build(c.id, fused, dtype)
    other.seed = 12
    run(other, m_o, Problem(), 10, refresh_every=c.refresh_every, warmup=c.warmup)
    with pytest.raises(AssertionError):
        assert_close(other.flat_state("mean")[0], ref.flat_state("mean")[0], c.tol(dtype))


@fused
def test_groups_differ_in_every_hyperparameter(fused):
    """Two groups that differ in every hyperparameter (tests/protocol/test_api.py checks the
    reference against the functional form on the same groups)."""
    g0 = dict(lr=0.05, ess=300.0, hess_init=0.5, beta1=0.9, beta2=0.999, weight_decay=1e-4,
              clip_radius=1.0, alpha=0.5, rho1=0.2, rho2=0.1, hess_corr_scale=1.0)
    g1 = dict(lr=0.01, ess=900.0, hess_init=0.2, beta1=0.8, beta2=0.9999, weight_decay=1e-3,
              clip_radius=0.5, alpha=0.9, rho1=0.0, rho2=0.5, hess_corr_scale=0.01,
              debias=False, rescale_lr=False, outer_noise="independent", hess_floor=0.3)
    res = []
    for backend in ("torch", fused):
        m = mlp()
        ps = list(m.parameters())
        o = pk.IVONPoCo([{"params": ps[:2], **g0}, {"params": ps[2:], **g1}], lr=1.0, ess=1.0,
                        backend=backend, seed=4)
        run(o, m, Problem(), 16, refresh_every=4, warmup=2)
        res.append(o)
    for k in ("mean", "h", "momentum", "g_out", "h_out", "sigma_out"):
        for a, b in zip(res[0].flat_state(k), res[1].flat_state(k)):
            assert_close(b, a, TRAJECTORY[torch.float32], k)


def _ivonpoco(backend, dtype=torch.float32, **kw):
    m = mlp(dtype=dtype)
    args = dict(lr=0.05, ess=200.0, beta2=0.999, alpha=0.8)
    args.update(kw)
    return m, pk.IVONPoCo(m.parameters(), seed=3, backend=backend, **args)


def _snapshot(opt, model):
    return ({k: [t.clone() for t in opt.flat_state(k)] for k in opt._buckets[0].buffers},
            [p.detach().clone() for p in model.parameters()])


def _assert_same(opt, model, snap):
    bufs, params = snap
    for k, ts in bufs.items():
        for a, b in zip(ts, opt.flat_state(k)):
            assert torch.equal(a, b), k
    for a, b in zip(params, model.parameters()):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- AMP
@fused
def test_found_inf_skips_the_step_and_keeps_the_state(fused):
    prob = Problem()
    m, opt = _ivonpoco(fused)
    run(opt, m, prob, 6, refresh_every=4, warmup=1)
    snap, steps = _snapshot(opt, m), opt.step_count
    opt.step(prob.closure(opt, m, prob.batches(1)[0]), found_inf=torch.ones(1))
    _assert_same(opt, m, snap)
    assert opt.step_count == steps and opt.skipped_updates == 1
    opt.refresh([prob.closure(opt, m, c) for c in prob.chunks()], found_inf=torch.ones(()))
    _assert_same(opt, m, snap)
    assert opt.refresh_count == 2 and opt.skipped_updates == 2
    # then it goes on as if the skipped updates never happened: same as the torch backend
    m_ref, ref = _ivonpoco("torch")
    run(ref, m_ref, prob, 6, refresh_every=4, warmup=1)
    for o in (opt, ref):
        o.step(prob.closure(o, m if o is opt else m_ref, prob.batches(1)[0]),
               found_inf=torch.zeros(1))
    assert_close(opt.flat_state("mean")[0], ref.flat_state("mean")[0], TRAJECTORY[torch.float32])


@fused
def test_grad_scale_divides_gradients_like_the_reference(fused):
    prob = Problem()
    res = []
    for backend in ("torch", fused):
        m, opt = _ivonpoco(backend)
        run(opt, m, prob, 5, refresh_every=3, warmup=1)
        scale = torch.tensor(512.0)
        idx = prob.batches(1, seed=5)[0]

        def closure():
            opt.zero_grad()
            (prob.loss(m, idx) * scale).backward()
        opt.step(closure, grad_scale=scale)
        res.append(opt.flat_state("mean")[0].clone())
    assert_close(res[1], res[0], TRAJECTORY[torch.float32], "grad_scale")


# --------------------------------------------------------------------------- non-finite
def _nan_closure(opt, m, prob):
    def c():
        opt.zero_grad()
        loss = prob.loss(m, prob.batches(1)[0])
        loss.backward()
        next(iter(m.parameters())).grad[0, 0] = float("nan")
        return loss
    return c


def test_check_finite_defaults():
    """Raise on non-finite gradients where reading the flag is free (reference, C++);
    skip on the device where it would cost a synchronisation (Triton)."""
    for backend in ["torch"] + FUSED_BACKENDS:
        _, opt = _ivonpoco(backend)
        assert opt.check_finite is (backend != "triton"), backend


@fused
def test_nonfinite_gradients_skip_without_check_finite(fused):
    prob = Problem()
    m, opt = _ivonpoco(fused, check_finite=False)
    run(opt, m, prob, 6, refresh_every=4, warmup=1)
    snap = _snapshot(opt, m)
    opt.step(_nan_closure(opt, m, prob))
    _assert_same(opt, m, snap)
    assert opt.skipped_updates == 1 and opt.step_count == 6


@fused
def test_nonfinite_gradients_raise_with_check_finite(fused):
    prob = Problem()
    m, opt = _ivonpoco(fused, check_finite=True)
    run(opt, m, prob, 6, refresh_every=4, warmup=1)
    snap = _snapshot(opt, m)
    with pytest.raises(ValueError, match="non-finite gradient"):
        opt.step(_nan_closure(opt, m, prob))
    _assert_same(opt, m, snap)
    assert opt.step_count == 6
    run(opt, m, prob, 8, start=6, refresh_every=4, warmup=1)     # and it goes on
    assert opt.step_count == 8


# --------------------------------------------------------------------------- state dicts
# every pair of backends
PAIRS = sorted({tuple(sorted(p)) for p in itertools.combinations(["torch"] + FUSED_BACKENDS, 2)})


@pytest.mark.parametrize("pair", PAIRS, ids=["-".join(p) for p in PAIRS])
@pytest.mark.parametrize("pending", [False, True])
def test_state_dict_moves_between_backends(pending, pair):
    """A -> B and B -> A mid-run (optionally with gradients collected but not yet
    stepped) continue the uninterrupted trajectory."""
    prob = Problem()
    batches = prob.batches(14)
    m_full, full = _ivonpoco("torch", mc_samples=2)
    run(full, m_full, prob, 14, refresh_every=5, warmup=2, batches=batches)
    for first, second in (pair, pair[::-1]):
        m1, o1 = _ivonpoco(first, mc_samples=2)
        run(o1, m1, prob, 9, refresh_every=5, warmup=2, batches=batches)
        if pending:
            with o1.sampled("inner"):
                prob.loss(m1, batches[9]).backward()
        sd = copy.deepcopy(o1.state_dict())
        m2, o2 = _ivonpoco(second, mc_samples=2)
        m2.load_state_dict(m1.state_dict())
        o2.load_state_dict(sd)
        assert o2.step_count == 9 and o2.refresh_count == 2
        if pending:
            with o2.sampled("inner"):
                prob.loss(m2, batches[9]).backward()
            for _ in range(2):
                with o2.sampled("outer"):
                    prob.loss(m2, batches[9]).backward()
            o2.step()
            run(o2, m2, prob, 14, start=10, refresh_every=5, warmup=2, batches=batches)
        else:
            run(o2, m2, prob, 14, start=9, refresh_every=5, warmup=2, batches=batches)
        for k in ("mean", "h", "momentum", "g_out", "h_out"):
            assert_close(o2.flat_state(k)[0], full.flat_state(k)[0], TRAJECTORY[torch.float32],
                         f"{first}->{second} {k}")


# --------------------------------------------------------------------------- no host sync
@pytest.mark.skipif("triton" not in FUSED_BACKENDS, reason="triton not available")
def test_triton_updates_never_read_the_device_from_the_host(monkeypatch):
    """A step or a refresh on the Triton backend reads no tensor value on the host (the
    CPU stand-in for `torch.cuda.set_sync_debug_mode('error')`, which the GPU benchmark
    script uses)."""
    prob = Problem()
    m, opt = _ivonpoco("triton")
    run(opt, m, prob, 5, refresh_every=3, warmup=1)
    batch = prob.batches(1)[0]
    # gradients collected before the check (the loss and backward are the user's)
    for kind in ("inner", "outer"):
        with opt.sampled(kind):
            prob.loss(m, batch).backward()

    def boom(*a, **k):
        raise AssertionError("host read of a tensor value inside an update")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    opt.step()
    opt.sample("refresh")
    opt.restore()
    opt.sample("inner")
    opt.restore()
    monkeypatch.undo()
    assert opt.step_count == 6


# --------------------------------------------------------------------------- compile
@fused
def test_torch_compile_of_a_training_step_keeps_the_kernels(fused):
    """A compiled function that runs the optimizer's kernels (sample, accumulate, step)
    traces without graph breaks (fullgraph) and matches eager."""
    prob = Problem()
    outs = []
    for compiled in (False, True):
        m, opt = _ivonpoco(fused, mc_samples=1)
        run(opt, m, prob, 3)
        eng = opt._runner
        ops = eng.ops
        b = opt._buckets[0]
        grads = torch.randn(b.numel)

        def inner_step(grads):
            eng.sample(0, 0)
            b.grad_flat.copy_(grads)
            ops.accumulate(b.grad_flat, eng._acc(0, b, "g"), None, eng._ctl(b), opt.seed,
                           opt.noise_version, eng.active_noise[0][0], 0, 1.0, True, False)
            opt._pending.count[0] = 1
            eng.step(frozenset(), None, None)

        f = torch.compile(inner_step, fullgraph=True, backend="aot_eager") if compiled \
            else inner_step
        f(grads)
        outs.append(opt.flat_state("mean")[0].clone())
    assert_close(outs[1], outs[0], PARAM[torch.float32], "compiled vs eager")


# --------------------------------------------------------------------------- layout
@fused
def test_parameters_become_views_of_one_flat_buffer(fused):
    m, opt = _ivonpoco(fused, dtype=torch.bfloat16)
    b = opt._buckets[0]
    for p, off in zip(b.params, b.offsets):
        assert p.data_ptr() == b.flat_param.data_ptr() + off * p.element_size()
    before = [p.detach().clone() for p in m.parameters()]
    with torch.no_grad():
        next(iter(m.parameters())).mul_(1.0)     # in-place use is fine
    m.float()                                     # replaces the storage
    prob = Problem()
    with pytest.raises(RuntimeError, match="storage was replaced"):
        opt.step(prob.closure(opt, m, prob.batches(1)[0]))
    assert all(torch.equal(a, b.to(a.dtype)) for a, b in zip(before, m.parameters()))


@fused
def test_add_param_group_on_a_fused_backend(fused):
    m = mlp()
    ps = list(m.parameters())
    opt = pk.IVON(ps[:2], lr=0.05, ess=100.0, backend=fused, seed=1)
    prob = Problem()
    run(opt, m, prob, 2)
    opt.add_param_group({"params": ps[2:], "lr": 0.01})
    run(opt, m, prob, 4, start=2)
    assert opt.step_count == 4
    for b in opt._buckets:
        for p, off in zip(b.params, b.offsets):
            assert p.data_ptr() == b.flat_param.data_ptr() + off * p.element_size()


#: configurations whose padded and exact Triton launches are compared: the summed-noise
#: paths (two draws, antithetic refresh), the outer sample with bfloat16 parameters, the
#: AdamW family
_PAD_CASES = [("IVONPoCo-antithetic-floor-mc2", torch.float32),
              ("IVONPoCoMo-independent", torch.bfloat16), ("SVRGAdamW-wd", torch.float32)]


@pytest.mark.skipif("triton" not in FUSED_BACKENDS, reason="triton not available")
@pytest.mark.parametrize("name,dtype", _PAD_CASES, ids=[f"{n}-{d}" for n, d in _PAD_CASES])
def test_padded_launches_equal_exact_ones_bit_for_bit(name, dtype, monkeypatch):
    """Buckets of 130 and 42 elements: every Triton launch runs over the padded length (a
    multiple of 16: the vectorised path), and the whole trajectory (11 steps), refreshes included,
    equals the one whose launches run over the exact lengths (the scalar path), bit for
    bit; the padding is not part of anything a user sees."""
    from poco_kernels._layout import PAD, is_padded, launch_numel
    from poco_kernels.kernels import triton_ops
    lengths = []

    def spy(n, *tensors):
        out = launch_numel(n, *tensors)
        lengths.append((n, out))
        return out
    monkeypatch.setattr(triton_ops, "launch_numel", spy)
    m_pad, pad, _ = _trajectory(name, "triton", dtype, steps=11)
    assert lengths and all(out % PAD == 0 and out - n < PAD for n, out in lengths), lengths
    assert {n for n, _ in lengths} == {b.numel for b in pad._buckets} == {130, 42}
    monkeypatch.setattr(triton_ops, "launch_numel", lambda n, *tensors: n)
    m_ex, ex, _ = _trajectory(name, "triton", dtype, steps=11)
    for b_pad, b_ex in zip(pad._buckets, ex._buckets):
        assert set(b_pad.buffers) == set(b_ex.buffers)
        for k in b_pad.buffers:
            assert b_pad.buffers[k].numel() == b_pad.numel and is_padded(b_pad.buffers[k])
            assert torch.equal(b_pad.buffers[k], b_ex.buffers[k]), k
    for a, b in zip(m_pad.parameters(), m_ex.parameters()):
        assert a.dtype == dtype and torch.equal(a, b)
    sd = pad.state_dict()
    assert all(v.numel() == p.numel() for p, st in zip(m_pad.parameters(), sd["state"].values())
               for v in st.values() if isinstance(v, torch.Tensor) and v.dim())
