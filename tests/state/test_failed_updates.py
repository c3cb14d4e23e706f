"""Updates that fail midway are transactions too (see ``test_transactional.py``): a
nan/inf/-inf in any gradient element of any evaluation of a step or a refresh, after any
history (with ``check_finite`` a ValueError, without it on the fused backends a skipped
update); SVRG's skipped first step, which must not start the SGD momentum; an exception
inside ``with opt.sampled(kind):``, which must restore the mean and the draws and leave no
gradient behind.  Each time the optimizer goes on bit for bit as the twin that never made
the call; most cases are hypothesis searches.
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from transaction_rig import (BACKENDS, BATCHES, CORR, GRAD, HYP, INF, NAN, TRITON_PICK, Boom,
                             Rig, _hyp_params, _raise_inside)
from transaction_twins import _ones, _outcome, assert_twins, run_case


#: tiny tensors: one thread is faster (and VONPoCo's small LAPACK calls much faster)
pytestmark = pytest.mark.usefixtures("one_thread")


_HISTORIES = ["s0", "s0 s1", "s0 r0", "s0 r0 s1", "s0 s1 r0 s2"]


@pytest.mark.parametrize("name, backend, n", _hyp_params({"torch": 10, "cpp": 20, "triton": 2},
                                                      triton=("IVONPoCo", "SVRG")))
def test_non_finite_gradient_anywhere(name, backend, n):
    """A nan/inf/-inf in any gradient element of any evaluation of a step or a refresh,
    after any history (first refresh included): with check_finite a ValueError, without
    (fused backends) a skipped update; nothing changes either way, and the optimizer goes
    on as the twin that never made the call."""
    corr = name in CORR

    @settings(max_examples=n, **HYP)
    @given(value=st.sampled_from([NAN, INF, -INF]),
           history=st.sampled_from(_HISTORIES if corr else ["s0", "s0 s1"]),
           call=st.sampled_from(["step", "refresh"] if corr else ["step"]),
           evaluation=st.sampled_from([1, 2]), param=st.integers(0, 2),
           elem=st.integers(0, 14), check_finite=st.booleans())
    def check(value, history, call, evaluation, param, elem, check_finite):
        skip = backend != "torch" and not check_finite and name != "VONPoCo"
        rig = Rig(name, backend)
        rig.run(history)
        if call == "step" and not rig.opt.correction_active():
            evaluation = 1                # one evaluation only
        poke = (value, evaluation, param, elem)
        if call == "step":
            bad = lambda r: r.arm(poke=poke).opt.step(r.closure(2))     # noqa: E731
        else:
            bad = lambda r: r.arm(poke=poke).opt.refresh(r.chunks(0))   # noqa: E731
        run_case(name, backend, history=history, check_finite=check_finite,
                 raises=None if skip else ValueError, match=None if skip else "non-finite",
                 bad=bad)
    check()


def _first_skip_params():
    out = []
    for backend in BACKENDS:
        for how in ("nonfinite", "found_inf"):
            for check_finite in ([True] if backend == "torch" else [True, False]):
                out.append(pytest.param(backend, how, check_finite,
                                        id=f"{backend}-{how}-check{int(check_finite)}"))
    return out


@pytest.mark.parametrize("backend, how, check_finite", _first_skip_params())
def test_skipped_first_step_does_not_start_the_sgd_momentum(backend, how, check_finite):
    """SVRG with momentum and dampening whose FIRST step is not taken (a non-finite
    gradient: refused, or skipped without ``check_finite``; AMP's ``found_inf``): no
    momentum buffer is left behind, so the next step starts it as ``torch.optim.SGD``
    does (``buf = d_p``, undampened), as the twin's first step does, bit for bit."""
    skip = how == "found_inf" or (backend != "torch" and not check_finite)
    if how == "nonfinite":
        bad = lambda r: r.arm(poke=(NAN, 1, 0, 3)).opt.step(r.closure(2))   # noqa: E731
    else:
        bad = lambda r: r.opt.step(r.closure(2), found_inf=_ones())          # noqa: E731
    kw = dict(momentum=0.9, dampening=0.5)
    run_case("SVRG", backend, history="", check_finite=check_finite, kw=kw, bad=bad,
             raises=None if skip else ValueError, match=None if skip else "non-finite")
    # the same with no read of the counters in between (run_case's snapshots read them):
    # without check_finite only the device knows that the first step was skipped
    a, b = Rig("SVRG", backend, check_finite, **kw), Rig("SVRG", backend, check_finite, **kw)
    assert _outcome(bad, a, None if skip else ValueError, None) is None
    for op in "s5 s6 s7".split():
        a.do(op)
        b.do(op)
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters())), \
        "the steps after the skipped one differ from the twin's"
    assert_twins(a, b, "after three more steps")


@pytest.mark.parametrize("name, backend, n",
                         [p for p in _hyp_params({"torch": 6, "cpp": 4, "triton": 2})
                          if p.values[0] != "VONPoCo"])
def test_exception_inside_sampled_restores_mean_and_draws(name, backend, n):
    """An exception inside ``with opt.sampled(kind):`` (before or after the backward, with
    0 or 1 earlier blocks of that kind): the mean back in the parameters, the draw counter
    and the pending sums as before, so that later noise equals the twin's."""
    kinds = ["inner"] + (["outer", "refresh"] if name in CORR else [])

    @settings(max_examples=n, **HYP)
    @given(kind=st.sampled_from(kinds), prior=st.integers(0, 1), backward=st.booleans())
    def check(kind, prior, backward):
        probe = Rig(name, backend)
        first = {"inner": "I2", "outer": "O2", "refresh": "F0"}[kind]
        more = {"inner": "I3 O3 S", "outer": "I3 O3 S", "refresh": "F1 R"}[kind]
        history = probe.warm() + (" " + first if prior else "")
        if kind == "outer" and not prior:
            more = "I3 O3 S"
        run_case(name, backend, history=history, raises=Boom,
                 bad=lambda r: _raise_inside(r, kind, backward), cont=more + " " + probe.tail())
    check()


def _block_keeping_grads(rig, kind, idx, boom=False):
    """``with opt.sampled(kind): loss.backward()`` with no ``zero_grad()`` around it: the
    loop that relies on ``accumulate()`` leaving no gradient behind (``boom``: the block
    raises after its backward)."""
    with rig.opt.sampled(kind):
        rig.loss(idx).backward()
        if boom:
            raise Boom("inside sampled(), after the backward")


def _no_zero_grad_params():
    out = [pytest.param(name, backend, gv, id=f"{name}-{backend}-views{int(gv)}")
           for name in GRAD for backend in BACKENDS if backend != "triton"
           for gv in ([True, False] if backend != "torch" else [True])]
    out += [pytest.param(TRITON_PICK["sampled-raises-inside"], "triton", gv,
                         id=f"{TRITON_PICK['sampled-raises-inside']}-triton-views{int(gv)}")
            for gv in (True, False) if "triton" in BACKENDS]
    return out


@pytest.mark.parametrize("name, backend, grad_views", _no_zero_grad_params())
def test_exception_inside_sampled_leaves_no_gradient_behind(name, backend, grad_views):
    """An exception inside ``with opt.sampled("inner"):`` after the backward: the gradient
    that block left in ``.grad`` is dropped with its sample, so a loop that never calls
    ``zero_grad()`` (``accumulate()`` clears ``.grad``) takes the steps of the twin that
    never entered the block, bit for bit, whether ``.grad`` is autograd's tensor or a view
    of the fused backends' gradient buffer (``grad_views``)."""
    a, b = Rig(name, backend, grad_views=grad_views), Rig(name, backend, grad_views=grad_views)
    for r in (a, b):
        r.run(r.warm())
    with pytest.raises(Boom):
        _block_keeping_grads(a, "inner", BATCHES[2], boom=True)
    assert_twins(a, b, "right after the exception")
    for t in (3, 4):
        for r in (a, b):
            _block_keeping_grads(r, "inner", BATCHES[t])
            if r.opt.correction_active():
                _block_keeping_grads(r, "outer", BATCHES[t])
            r.opt.step()
        assert_twins(a, b, f"after the step on batch {t}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, call", [("IVON", "step"), ("IVONPoCo", "step"),
                                        ("IVONPoCo", "refresh")])
@pytest.mark.parametrize("ret", ["tuple", "dict", "vector"])
def test_a_loss_without_a_mean_refuses_the_call(backend, name, call, ret):
    """With several evaluations in one call (``mc_samples=2``, a refresh over chunks) the
    call returns the mean of their losses: a closure returning ``(loss, 1.0)``, a dict or
    a vector has none, so the call is refused with a TypeError before its update (not
    after it, nor averaged element by element), and nothing changes."""
    def returning(c):
        def closure():
            loss = c()
            return {"tuple": (loss, 1.0), "dict": {"loss": loss},
                    "vector": loss.reshape(1).repeat(2)}[ret]
        return closure
    if call == "step":
        bad = lambda r: r.opt.step(returning(r.closure(2)))                # noqa: E731
    else:
        bad = lambda r: r.opt.refresh([returning(c) for c in r.chunks(0)])  # noqa: E731
    run_case(name, backend, kw=dict(mc_samples=2) if call == "step" else None, bad=bad,
             raises=TypeError, match="mean of their losses")
