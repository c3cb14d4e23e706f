"""``.grad`` as views of the fused backends' flat gradient buffers (``grad_views``, the
default; docs/design.md, 'Gradients straight into the flat buffers'): what autograd
writes is what the kernels read, and every other way of producing gradients still gives
the same steps, bit for bit."""
import pytest
import torch

import poco_kernels as pk
from helpers import FUSED_BACKENDS, Problem, mlp, params_of

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not FUSED_BACKENDS, reason="no fused backend here")]

fused = pytest.mark.parametrize("fused", FUSED_BACKENDS)


def _opt(model, fused, cls=pk.IVONPoCoMo, **kw):
    kw = dict(dict(lr=0.05, ess=200.0, seed=5, backend=fused, grad_views=True), **kw)
    return cls(model.parameters(), **kw)


def _closure(opt, model, prob, idx, zero):
    def c():
        if zero == "opt":
            opt.zero_grad()
        elif zero == "model":
            model.zero_grad()                      # set_to_none: autograd's own tensors
        elif zero == "assign":
            for p in model.parameters():
                p.grad = None
        loss = prob.loss(model, idx)
        if zero == "assign":                       # .grad replaced by new tensors
            gs = torch.autograd.grad(loss, list(model.parameters()))
            for p, g in zip(model.parameters(), gs):
                p.grad = g.clone()
        else:
            loss.backward()
        return loss
    return c


def _train(fused, zero, grad_views=True, steps=7, cls=pk.IVONPoCoMo, **kw):
    prob = Problem()
    m = mlp()
    opt = _opt(m, fused, cls, grad_views=grad_views, **kw)
    for t in range(steps):
        if cls is not pk.IVON and t in (1, 4):
            opt.refresh([_closure(opt, m, prob, t % 3, zero),
                         _closure(opt, m, prob, (t + 1) % 3, zero)])
        opt.step(_closure(opt, m, prob, t % 3, zero))
    return m, opt


@pytest.mark.parametrize("fused,zero", [(f, z) for f in FUSED_BACKENDS
                                         for z in ("opt", "model", "assign", "none")])
def test_every_way_of_producing_gradients_takes_the_same_steps(fused, zero):
    """Views zeroed by the optimizer's zero_grad, autograd's own tensors after
    model.zero_grad(), .grad replaced by new tensors, a closure that zeroes nothing (the
    optimizer clears between samples), and grad_views=False: bit-identical parameters
    and state."""
    ref_m, ref_o = _train(fused, "opt", grad_views=False)
    m, o = _train(fused, zero)
    for a, b in zip(params_of(m), params_of(ref_m)):
        assert torch.equal(a, b)
    for name in ("mean", "momentum", "h", "g_out", "h_out"):
        for a, b in zip(o.flat_state(name), ref_o.flat_state(name)):
            assert torch.equal(a, b), name


@fused
def test_backward_writes_into_the_buffers_the_kernels_read(fused, monkeypatch):
    """With the optimizer's zero_grad in the closure, a steady-state IVON-PoCoMo iteration
    copies no gradient (no foreach copy) and keeps two gradient buffers per bucket (one
    for the inner gradient, one for the outer); IVON keeps one."""
    for cls, n_bufs in ((pk.IVONPoCoMo, 2), (pk.IVON, 1)):
        prob = Problem()
        m = mlp()
        opt = _opt(m, fused, cls)
        if cls is pk.IVONPoCoMo:
            opt.step(_closure(opt, m, prob, 0, "opt"))
            opt.refresh(_closure(opt, m, prob, 1, "opt"))
        opt.step(_closure(opt, m, prob, 2, "opt"))
        copies = []
        real = torch._foreach_copy_
        monkeypatch.setattr(torch, "_foreach_copy_", lambda *a, **k: (copies.append(1),
                                                                       real(*a, **k)))
        for t in range(3):
            opt.step(_closure(opt, m, prob, t, "opt"))
        monkeypatch.setattr(torch, "_foreach_copy_", real)
        assert copies == [], cls.__name__
        for b in opt._buckets:
            assert len(b.grad_bufs) == n_bufs, cls.__name__
            gb = b.grad_bufs[b.handed]
            # between steps: the views, holding the last sample's gradient (as torch.optim
            # leaves the last backward's); the next sample's hand-out zeroes them
            assert bool(gb.flat.any())
            for p, v in zip(b.params, gb.views):
                assert p.grad is v
                assert p.grad.untyped_storage().data_ptr() == gb.flat.untyped_storage().data_ptr()
            opt.sample()
            assert all(p.grad is v for p, v in zip(b.params, gb.views)) or cls is pk.IVONPoCoMo
            assert not any(bool(p.grad.any()) for p in b.params)
            opt.restore()


@fused
def test_both_samples_of_an_iteration_write_the_same_views_into_fixed_memory(fused):
    """Inside step(closure) IVON-PoCoMo's inner and outer samples hand out the same
    ``.grad`` tensors (the outer one swaps the free buffer's memory under them: no
    ``.grad`` assignment per parameter), and every iteration's inner and outer gradients
    land in the same memory (the roles a captured CUDA graph replays)."""
    from poco_kernels.backends import fused_grads
    prob = Problem()
    m = mlp()
    opt = _opt(m, fused)
    opt.step(_closure(opt, m, prob, 0, "opt"))
    opt.refresh(_closure(opt, m, prob, 1, "opt"))
    seen = []

    def c():
        opt.zero_grad()
        loss = prob.loss(m, 0)
        loss.backward()
        p = next(m.parameters())
        seen.append((p.grad, p.grad.data_ptr()))
        return loss
    for _ in range(3):
        opt.step(c)
    ptrs = [a for _, a in seen]
    assert ptrs[0::2] == [ptrs[0]] * 3 and ptrs[1::2] == [ptrs[1]] * 3 and ptrs[0] != ptrs[1]
    if fused_grads._SWAP:
        assert all(g is seen[0][0] for g, _ in seen)


@fused
def test_zero_grad_keeps_the_views_and_skips_a_buffer_known_to_be_zero(fused):
    prob = Problem()
    m = mlp()
    opt = _opt(m, fused, pk.IVON)
    opt.step(_closure(opt, m, prob, 0, "opt"))
    b = opt._buckets[0]
    gb = b.grad_bufs[b.handed]
    v0 = gb.flat._version
    assert bool(gb.flat.any())                      # the last sample's gradient
    opt.zero_grad()                                 # one memset
    assert gb.flat._version == v0 + 1
    opt.zero_grad()                                 # known zero: no memset
    assert gb.flat._version == v0 + 1
    prob.loss(m, 1).backward()                      # a backward outside the protocol
    opt.zero_grad()
    assert gb.flat._version == v0 + 2               # one memset
    assert all(p.grad is v and not bool(v.any()) for p, v in zip(b.params, gb.views))
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in m.parameters())


@fused
def test_a_parameter_the_backward_does_not_reach_is_skipped_as_with_none(fused):
    """A view no backward wrote counts as a None gradient (torch.optim's skip), not as a
    zero gradient: the same steps as with grad_views=False and .grad left None."""
    outs = []
    for gv in (True, False):
        prob = Problem()
        m = mlp()
        frozen_in_loss = list(m.parameters())[-1]
        opt = _opt(m, fused, pk.IVON, grad_views=gv, weight_decay=0.1)

        def c():
            opt.zero_grad()
            loss = prob.loss(m, 0) + 0.0 * frozen_in_loss.detach().sum()
            params = [p for p in m.parameters() if p is not frozen_in_loss]
            gs = torch.autograd.grad(loss, params)
            for p, g in zip(params, gs):
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.add_(g)
            return loss
        before = frozen_in_loss.detach().clone()
        for _ in range(3):
            opt.step(c)
        assert torch.equal(frozen_in_loss.detach(), before)
        outs.append([p.detach().clone() for p in m.parameters()])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@fused
def test_a_closure_without_backward_is_still_an_error_that_changes_nothing(fused):
    prob = Problem()
    m = mlp()
    opt = _opt(m, fused, pk.IVON)
    opt.step(_closure(opt, m, prob, 0, "opt"))
    before = [p.detach().clone() for p in m.parameters()]

    def forgot():
        opt.zero_grad()
        return prob.loss(m, 1)
    with pytest.raises(RuntimeError, match="backward"):
        opt.step(forgot)
    assert all(torch.equal(p.detach(), q) for p, q in zip(m.parameters(), before))


@pytest.mark.parametrize("fused,views", [(f, v) for f in FUSED_BACKENDS for v in (True, False)])
def test_a_non_finite_gradient_in_a_view_is_refused_with_nothing_changed(fused, views):
    """(Also autograd's own tensors, ``grad_views=False``: Triton reads them in place.)"""
    prob = Problem()
    m = mlp()
    opt = _opt(m, fused, pk.IVONPoCoMo, check_finite=True, grad_views=views)
    opt.step(_closure(opt, m, prob, 0, "opt"))
    opt.refresh(_closure(opt, m, prob, 1, "opt"))
    opt.step(_closure(opt, m, prob, 2, "opt"))
    before = ([p.detach().clone() for p in m.parameters()],
              {k: [t.clone() for t in opt.flat_state(k)] for k in ("mean", "momentum", "h")})
    calls = []

    def bad():
        opt.zero_grad()
        loss = prob.loss(m, 0) * (float("inf") if len(calls) == 1 else 1.0)
        calls.append(1)
        loss.backward()
        return loss
    with pytest.raises(ValueError, match="non-finite"):
        opt.step(bad)                               # the outer gradient is inf
    assert all(torch.equal(p.detach(), q) for p, q in zip(m.parameters(), before[0]))
    for k, ts in before[1].items():
        assert all(torch.equal(a, b) for a, b in zip(opt.flat_state(k), ts)), k
    opt.step(_closure(opt, m, prob, 1, "opt"))      # and it goes on


@fused
def test_grad_views_survives_copies_and_from_ivon(fused):
    import copy
    m = mlp()
    opt = _opt(m, fused, pk.IVON, grad_views=False)
    assert copy.deepcopy(opt).grad_views is False
    assert pk.IVONPoCoMo.from_ivon(opt).grad_views is False
    with pytest.raises(ValueError, match="grad_views"):
        _opt(mlp(), fused, pk.IVON, grad_views=1)


class _TwoHeads(torch.nn.Module):
    """A model with a layer the loss never uses (its gradient never comes from autograd)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.used = torch.nn.Linear(4, 2)
        self.unused = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.used(x)


@pytest.mark.skipif("cpp" not in FUSED_BACKENDS, reason="no C++ backend")
@pytest.mark.parametrize("inside", ["clip", "zero_grad_false", "data_write"])
def test_what_counts_as_a_gradient_is_what_it_is_without_views(inside):
    """A view autograd never reached is a None gradient even after clipping or zeroing
    in place (skipped, as with grad_views=False); a gradient written another way (a
    collective into p.grad.data) is one."""
    X = torch.randn(16, 4)
    moved = []
    for gv in (False, True):
        m = _TwoHeads()
        w0 = m.unused.weight.detach().clone()
        opt = pk.IVON(m.parameters(), lr=0.1, ess=100.0, seed=1, backend="cpp", grad_views=gv)
        with opt.sampled():
            if inside == "zero_grad_false":
                m.zero_grad(set_to_none=False)
            m(X).pow(2).mean().backward()
            if inside == "clip":
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)
            if inside == "data_write":
                for p in m.unused.parameters():
                    if p.grad is None:
                        p.grad = torch.ones_like(p)
                    else:
                        p.grad.data.copy_(torch.ones_like(p))
        opt.step()
        moved.append(not torch.equal(m.unused.weight.detach(), w0))
    assert moved[0] == moved[1] == (inside == "data_write")


@pytest.mark.skipif("cpp" not in FUSED_BACKENDS, reason="no C++ backend")
def test_accumulate_keeping_grads_lends_no_buffer():
    """accumulate(clear_grads=False) leaves .grad in place: the sum is not that buffer, so
    zeroing .grad before the next chunk does not change it."""
    outs = []
    for gv in (False, True):
        torch.manual_seed(0)
        m = torch.nn.Linear(3, 2)
        X = torch.randn(8, 3)
        opt = pk.IVONPoCoMo(m.parameters(), lr=0.1, ess=100.0, seed=1, backend="cpp",
                            grad_views=gv)
        with opt.sampled("refresh", accumulate=False):
            for chunk in X.chunk(2):
                opt.zero_grad(set_to_none=False)
                m(chunk).pow(2).mean().backward()
                opt.accumulate(clear_grads=False)
        opt.refresh()
        outs.append(torch.cat(opt.flat_state("g_out")))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.skipif("triton" not in FUSED_BACKENDS, reason="no Triton backend")
@pytest.mark.parametrize("cls,kw,dtype", [(pk.IVON, dict(mc_samples=2), torch.float32),
                                          (pk.IVONPoCoMo, {}, torch.float32),
                                          (pk.IVONPoCoMo, {}, torch.bfloat16)],
                         ids=["ivon-mc2", "pocomo", "pocomo-bf16"])
def test_gradients_read_in_place_take_the_steps_of_a_gather(cls, kw, dtype, monkeypatch):
    """Triton reads autograd's own gradients (``grad_views=False``) in place, one launch
    over a table of their addresses: the same steps, bit for bit, as gathering them into
    a flat buffer first, with a parameter the backward reaches once and then never (None:
    a zero gradient), several draws (the noise-weighted sums), bfloat16 parameters, and gradients at
    new addresses every backward (the table's addresses rewritten)."""
    from poco_kernels.backends import fused as fused_mod
    from poco_kernels.kernels import triton_ops

    def run(direct):
        prob = Problem()
        m = mlp(dtype=dtype)
        unused = torch.nn.Parameter(torch.randn(7, dtype=dtype))
        opt = cls(list(m.parameters()) + [unused], lr=0.05, ess=200.0, seed=5,
                  backend="triton", grad_views=False, **kw)
        launches, moved, held = [], [], []
        with monkeypatch.context() as mp:
            if not direct:
                mp.setattr(fused_mod.FusedBackend, "_direct_grads", lambda self, b: None)
            real = triton_ops.accumulate_shards
            mp.setattr(triton_ops, "accumulate_shards",
                       lambda *a, **k: (launches.append(1), real(*a, **k)))
            readdress = triton_ops.Tiles.readdress
            mp.setattr(triton_ops.Tiles, "readdress",
                       lambda self, a: (moved.append(1), readdress(self, a)))
            def closure(t):
                def c():
                    m.zero_grad()
                    unused.grad = None
                    loss = prob.loss(m, t % 3)
                    if t in (0, 4):      # (a gradient, none (a stale one shows), one again)
                        loss = loss + unused.float().square().sum()
                    loss.backward()
                    held.append([p.grad for p in m.parameters()])   # (new addresses next)
                    return loss
                return c
            for t in range(5):
                if cls is not pk.IVON and t in (1, 3):
                    opt.refresh(closure(t + 1))
                opt.step(closure(t))
        assert bool(launches) == direct
        assert bool(moved) == direct                # (a table's addresses rewritten)
        return [p.detach() for p in list(m.parameters()) + [unused]], opt

    ps, o = run(True)
    ref_ps, ref_o = run(False)
    for a, b in zip(ps, ref_ps):
        assert torch.equal(a, b)
    names = ("mean", "h") + (("momentum", "g_out", "h_out") if cls is not pk.IVON else ())
    for name in names:
        for a, b in zip(o.flat_state(name), ref_o.flat_state(name)):
            assert torch.equal(a, b), name
