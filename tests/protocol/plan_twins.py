"""Twin optimizers for the step-plan tests: one with plans, one without, to compare."""
import torch

import poco_kernels as pk
from helpers import mlp


def make_twins(cls, backend, **kw):
    out = []
    for plans in (True, False):
        m = mlp()
        kw2 = dict(dict(lr=0.05, ess=200.0, seed=5, backend=backend), **kw)
        if cls is not pk.IVON:
            kw2.setdefault("alpha", 0.5)
        opt = cls(list(m.parameters())[:3], **kw2)     # (the last one joins later)
        opt.step_plans = plans
        out.append((m, opt))
    return out


def same_run(a, b):
    (ma, oa), (mb, ob) = a, b
    for p, q in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(p, q)
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, equal_nan=True)
    sa, sb = oa.state_dict(), ob.state_dict()
    for k in sa["state"]:
        for n, v in sa["state"][k].items():
            w = sb["state"][k][n]
            assert (torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w), (k, n)
    assert oa._step == ob._step and oa._refreshes == ob._refreshes
    assert oa._active == ob._active and oa._pending.count == ob._pending.count
    assert oa._pending.draws == ob._pending.draws
    assert set(oa._pending.sums) == set(ob._pending.sums)


#: the events a training loop meets between iterations, which both the step-plan and the
#: update-memo tests throw at their twins (:func:`between_iterations`)
LOOP_EVENTS = ("lr", "freeze", "unfreeze", "data", "set_to_none", "load_state_dict",
               "add_group")


def between_iterations(ev, opt, ps) -> bool:
    """Apply the loop event ``ev`` (one of :data:`LOOP_EVENTS`) to ``opt`` and its model's
    parameters ``ps``; False for any other event (the caller's own)."""
    if ev == "lr":
        opt.param_groups[0]["lr"] = 0.03
    elif ev in ("freeze", "unfreeze"):
        ps[0].requires_grad_(ev == "unfreeze")
    elif ev == "data":
        ps[1].data = ps[1].detach().clone() * 0.5
    elif ev == "set_to_none":
        opt.zero_grad(set_to_none=True)
    elif ev == "load_state_dict":
        opt.load_state_dict(opt.state_dict())
    elif ev == "add_group":
        opt.add_param_group({"params": [ps[3]]})
    else:
        return False
    return True
