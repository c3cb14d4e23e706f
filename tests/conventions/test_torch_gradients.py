"""torch.optim's gradient conventions for every optimizer (the table:
tests/conventions/torch_conventions.py): parameters without requires_grad, frozen
parameters, a step with no gradient at all (an error here, by design: torch's is a no-op),
a parameter skipped by a step without its gradient, ``zero_grad``.  The Triton kernels take
the missing gradients.  The package's own habits (a gradient missing at some samples only,
frozen parameters unfrozen, ...) are tests/conventions/test_habits.py's.
"""
import pytest
import torch

from tolerances import TRAJECTORY, assert_close
from torch_conventions import (BACKENDS, BATCHES, CASES, CASES_RT, CHUNKS, CLOSURE_KINDS,
                               KINDS, Tiny, _cases, closure, drive, has_outer, make, refresh,
                               same, snap)

#: tiny tensors: torch's thread pool only costs here (conftest's fixture)
pytestmark = pytest.mark.usefixtures("one_thread")


# ============================================================================ gradients
@pytest.mark.parametrize("kind,backend", CASES)
def test_step_is_noop_when_params_have_no_grad(kind, backend):
    """torch's test: no parameter requires grad; a step is a no-op (and they have no
    state)."""
    params = [torch.randn(2, 3), torch.randn(5)]
    old = [p.clone() for p in params]
    o = make(kind, params, backend)
    o.step(lambda: torch.tensor([1.0]))
    assert same(params, old)
    assert all(len(o.state.get(p, {})) == 0 for p in params)


@pytest.mark.parametrize("kind,backend", CASES)
def test_frozen_params_are_never_sampled_updated_or_stateful(kind, backend):
    m = Tiny(frozen=("f",))
    f0 = m.f.detach().clone()
    o = make(kind, m.parameters(), backend)
    inside = []
    orig_loss = m.loss

    def recording_loss(idx, skip=()):
        inside.append(m.f.detach().clone())
        return orig_loss(idx, skip)

    m.loss = recording_loss
    start = snap(m)
    drive(o, m, 0, 4)
    assert len(inside) >= 4 and all(torch.equal(x, f0) for x in inside)
    assert torch.equal(m.f, f0)
    assert not torch.equal(m.w, start[0]) and not torch.equal(m.v, start[1])
    assert len(o.state.get(m.f, {})) == 0
    sd = o.state_dict()
    f_index = [n for n, _ in m.named_parameters()].index("f")
    assert not sd["state"].get(f_index) and {0, 1} <= set(sd["state"])
    m.loss = orig_loss
    m2 = Tiny(frozen=("f",))
    o2 = make(kind, m2.parameters(), backend, seed=1)
    m2.load_state_dict(m.state_dict())
    o2.load_state_dict(sd)
    l1, l2 = drive(o, m, 4, 5), drive(o2, m2, 4, 5)
    assert torch.equal(l1, l2) and same(snap(m), snap(m2))


#: the .grad family on the torch backend and the C++ kernels, and the Triton kernels where
#: the configuration runs them
CLOSURE_CASES = [c for c in CASES_RT if c.values[0] in CLOSURE_KINDS]


@pytest.mark.parametrize("kind,backend", CLOSURE_CASES)
def test_step_without_any_gradient_is_an_error(kind, backend):
    """A closure that forgets backward (trainable parameters, no gradient at all) is an
    error naming backward, in a step or a refresh, before and after the correction is on,
    and changes nothing: the run goes on bit for bit as a twin's that never made the call.
    A documented difference from torch, where it is a no-op."""
    m, m_twin = Tiny(), Tiny()
    o, twin = make(kind, m.parameters(), backend), make(kind, m_twin.parameters(), backend)
    for t in range(3):
        if t >= 1 and has_outer(o):
            if t == 2:
                with pytest.raises(RuntimeError, match="backward"):
                    o.refresh([closure(o, m, c, backward=False) for c in CHUNKS])
            refresh(o, m)
            refresh(twin, m_twin)
        before = snap(m)
        with pytest.raises(RuntimeError, match="backward"):
            o.step(closure(o, m, BATCHES[t], backward=False))
        assert same(snap(m), before)
        l1 = o.step(closure(o, m, BATCHES[t]))          # the next proper step works
        l2 = twin.step(closure(twin, m_twin, BATCHES[t]))
        assert not same(snap(m), before)
        assert torch.equal(l1, l2) and same(snap(m), snap(m_twin)), t
    assert o.step_count == twin.step_count == 3
    if not KINDS[kind].info.noisy:                      # torch style: zero_grad(); step()
        m2 = Tiny()
        o2 = make(kind, m2.parameters(), backend)
        o2.zero_grad()
        with pytest.raises(RuntimeError, match="backward"):
            o2.step()


def _skipped_param_run(kind, backend):
    m = Tiny(extra=("u",))
    # weight decay: a skipped parameter must not decay; noisy ones draw two samples, the
    # gradient None at both
    over = dict(weight_decay=0.1, **(dict(mc_samples=2) if KINDS[kind].info.noisy else {}))
    o = make(kind, m.parameters(), backend, **over)
    o.step(closure(o, m, BATCHES[0]))
    if has_outer(o):
        refresh(o, m)
    u0 = m.u.detach().clone()
    state0 = {k: v.clone() for k, v in o.state[m.u].items()}
    others = snap(m)[:2]
    o.step(closure(o, m, BATCHES[1], skip=("u",)))
    assert torch.equal(m.u, u0)
    assert set(o.state[m.u]) == set(state0)
    for k, v in state0.items():
        assert torch.equal(o.state[m.u][k], v), k
    assert not same(snap(m)[:2], others)
    o.step(closure(o, m, BATCHES[2]))
    assert not torch.equal(m.u, u0)
    return snap(m)


@pytest.mark.parametrize("kind,backend", CLOSURE_CASES + _cases(
    ["SVRGAdamW"], [b for b in BACKENDS if b == "triton"]))
def test_param_without_grad_is_skipped_by_that_step(kind, backend):
    """A parameter whose .grad is None at every sample of a step keeps its value and its
    state through that step (weight decay and momentum included), as torch.optim skips
    it; it moves again once it has a gradient; a fused backend's run is the torch
    backend's (the others follow the reference maths)."""
    out = _skipped_param_run(kind, backend)
    if backend != "torch":
        for a, b in zip(_skipped_param_run(kind, "torch"), out):
            assert_close(b, a, TRAJECTORY[torch.float32], "trajectory")


@pytest.mark.parametrize("kind,backend", CASES)
def test_zero_grad(kind, backend):
    m = Tiny()
    o = make(kind, m.parameters(), backend)
    grads = []
    for p in m.parameters():
        p.grad = torch.ones_like(p)
        grads.append(p.grad)
    o.zero_grad(set_to_none=False)
    for p, g in zip(m.parameters(), grads):
        assert p.grad is g and not p.grad.any()
    o.zero_grad()
    assert all(p.grad is None for p in m.parameters())
