"""The twin runs of the parking tests (tests/protocol/test_parking*.py): an optimizer and
its model, the state compared bit for bit, one training iteration by either protocol."""
import torch

import poco_kernels as pk
from helpers import mlp

STATE = ("mean", "momentum", "h", "g_out", "h_out", "m_out", "sigma_out")


def make(backend, ahead, cls=pk.IVONPoCoMo, model=None, **kw):
    m = model if model is not None else mlp()
    kw = dict(dict(lr=0.05, ess=200.0, seed=5, backend=backend, sample_ahead=ahead), **kw)
    return m, cls(m.parameters(), **kw)


def state_of(opt):
    return {k: [t.clone() for t in opt.flat_state(k)] for k in STATE
            if k in opt._buckets[0].buffers}


def equal(xs, ys):
    return len(xs) == len(ys) and all(torch.equal(a, b) for a, b in zip(xs, ys))


def assert_twins(a, b):
    """Two runs' ``(parameters, state)`` bit for bit."""
    assert equal(a[0], b[0])
    assert all(equal(a[1][k], b[1][k]) for k in a[1]), [k for k in a[1]
                                                         if not equal(a[1][k], b[1][k])]


def warm(backend, ahead, prob, cls=pk.IVONPoCoMo, steps=3):
    """A model and optimizer after ``steps`` iterations of ``step(closure)``."""
    m, opt = make(backend, ahead, cls)
    for t in range(steps):
        iteration(opt, m, prob, t, "closure")
    return m, opt


def iteration(opt, m, prob, t, protocol):
    if type(opt) is not pk.IVON:
        if t in (1, 4):
            opt.refresh([prob.closure(opt, m, t % 3), prob.closure(opt, m, (t + 1) % 3)])
    if protocol == "closure":
        opt.step(prob.closure(opt, m, t % 3))
        return
    for kind in ("inner", "outer") if opt.correction_active() else ("inner",):
        with opt.sampled(kind):
            prob.loss(m, t % 3).backward()
    opt.step()
