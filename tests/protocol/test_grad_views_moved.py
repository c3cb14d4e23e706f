"""A ``.grad`` view re-pointed by the user (``p.grad.data = t``: what ``module.to()``,
``.double()`` and ``.float()`` do to every ``.grad``) keeps its tensor but not its memory:
the engine hands out new views over its buffers, and reads a gradient written into the
re-pointed tensor as any other (docs/design.md,
'Gradients straight into the flat buffers').  The steps are a never-touched twin's."""
import pytest
import torch

import poco_kernels as pk
from helpers import FUSED_BACKENDS, Problem, mlp, params_of

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not FUSED_BACKENDS, reason="no fused backend here")]

KW = {pk.IVON: dict(lr=0.05, ess=200.0, seed=5), pk.IVONPoCoMo: dict(lr=0.05, ess=200.0, seed=5),
      pk.SVRG: dict(lr=0.05, momentum=0.9)}


def _repoint(model, how):
    if how == "round_trip":                   # module._apply: p.data and p.grad.data
        model.double()
        model.float()
    else:                                     # the .grad alone
        for p in model.parameters():
            if p.grad is not None:
                p.grad.data = p.grad.data.clone()


def _train(fused, cls, how, loop):
    prob = Problem()
    m = mlp()
    opt = cls(m.parameters(), backend=fused, **KW[cls])
    for t in range(6):
        if t == 2 and how is not None:
            _repoint(m, how)
        if cls is pk.IVONPoCoMo and t == 1:
            opt.refresh([prob.closure(opt, m, c) for c in prob.chunks()])
        if loop == "plain":                   # torch.optim's loop (a noiseless rule)
            opt.zero_grad()
            prob.loss(m, torch.arange(8 * t, 8 * t + 8)).backward()
            opt.step()
        else:
            opt.step(prob.closure(opt, m, torch.arange(8 * t, 8 * t + 8)))
    return m, opt


@pytest.mark.parametrize("fused", FUSED_BACKENDS)
@pytest.mark.parametrize("cls,loop", [(pk.IVON, "closure"), (pk.IVONPoCoMo, "closure"),
                                      (pk.SVRG, "closure"), (pk.SVRG, "plain")])
@pytest.mark.parametrize("how", ["round_trip", "grad_data"])
def test_repointed_grad_views_take_the_twins_steps(fused, cls, loop, how):
    twin_m, twin = _train(fused, cls, None, loop)
    m, opt = _train(fused, cls, how, loop)
    assert all(torch.equal(a, b) for a, b in zip(params_of(m), params_of(twin_m)))
    sd, sd_twin = opt.state_dict(), twin.state_dict()
    for i, st in sd_twin["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(sd["state"][i][k], v), (i, k)
    # and they still trained: the re-pointing did not freeze the parameters
    assert not all(torch.equal(a, b) for a, b in zip(params_of(m), params_of(mlp())))
