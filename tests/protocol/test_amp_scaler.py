"""Dynamic loss scaling with the sampling protocol (docs/design.md, 'AMP'):
``poco_kernels.amp.GradScaler`` gives torch's GradScaler the optimizer's own inf check.
With power-of-two scales the unscaled sums are exact, so a scaled run takes the steps of
a run without scaling bit for bit; an overflow skips its update (and backs the scale
off), so the run equals a twin that never saw that iteration.  torch's own GradScaler is
refused where its check cannot see the gradients, with nothing changed."""
import pytest
import torch

import poco_kernels as pk
from poco_kernels.amp import GradScaler
from helpers import Problem, available_backends, mlp, params_of

pytestmark = pytest.mark.usefixtures("one_thread")

BACKENDS = available_backends()
BAD = 3                                       # the iteration whose loss overflows


def _make(kind, model, backend):
    kw = dict(lr=0.05, ess=200.0, seed=5, backend=backend)
    return pk.IVONPoCoMo(model.parameters(), alpha=0.7, **kw) if kind == "pocomo" \
        else pk.IVON(model.parameters(), **kw)


def _iteration(opt, m, prob, t, scale):
    """One iteration of the protocol with the losses multiplied by ``scale`` (a callable
    of the loss; None: not scaled)."""
    idx = torch.arange(8 * t, 8 * t + 8) % prob.n
    for kind in ("inner", "outer") if opt.correction_active() else ("inner",):
        with opt.sampled(kind):
            loss = prob.loss(m, idx)
            (loss if scale is None else scale(loss)).backward()


def _refresh(opt, m, prob, scale):
    with opt.sampled("refresh", accumulate=False):
        for c in prob.chunks(3):
            loss = prob.loss(m, c)
            (loss if scale is None else scale(loss)).backward()
            opt.accumulate()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["ivon", "pocomo"])
def test_scaled_run_takes_the_unscaled_steps_and_skips_an_overflow(backend, kind):
    prob = Problem()
    m, twin_m = mlp(), mlp()
    opt, twin = _make(kind, m, backend), _make(kind, twin_m, backend)
    scaler = GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    for t in range(6):
        if kind == "pocomo" and t == 1:
            _refresh(opt, m, prob, scaler.scale)
            scaler.refresh(opt)
            _refresh(twin, twin_m, prob, None)
            twin.refresh()
        bad = (lambda loss: scaler.scale(loss) * float("inf")) if t == BAD else scaler.scale
        _iteration(opt, m, prob, t, bad)
        scaler.step(opt)
        scaler.update()
        if t == BAD:                          # skipped: nothing changed, the scale halved
            assert scaler.get_scale() == 2.0 ** 9
            continue
        _iteration(twin, twin_m, prob, t, None)
        twin.step()
        assert all(torch.equal(a, b) for a, b in zip(params_of(m), params_of(twin_m))), t
    assert opt.step_count == twin.step_count == 5
    assert opt.skipped_updates == (0 if backend == "torch" else 1)   # (fused: counted)


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_gradscaler_after_sampled_blocks_is_refused_with_nothing_changed(backend):
    prob = Problem()
    m, twin_m = mlp(), mlp()
    opt, twin = _make("ivon", m, backend), _make("ivon", twin_m, backend)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    _iteration(opt, m, prob, 0, scaler.scale)
    with pytest.raises(RuntimeError, match="poco_kernels.amp.GradScaler"):
        scaler.step(opt)
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")   # (none stale)
    opt.step(grad_scale=scaler.get_scale() * torch.ones(()))   # the sums were kept
    _iteration(twin, twin_m, prob, 0, None)
    twin.step()
    assert all(torch.equal(a, b) for a, b in zip(params_of(m), params_of(twin_m)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scaler_cls", [torch.amp.GradScaler, GradScaler])
def test_torch_optims_own_loop_works_with_either_scaler(backend, scaler_cls):
    """SVRG in ``backward(); scaler.step(opt); scaler.update()``: the steps of the loop
    without scaling, bit for bit, and an overflow skipped."""
    prob = Problem()
    m, twin_m = mlp(), mlp()
    opt = pk.SVRG(m.parameters(), lr=0.05, momentum=0.9, backend=backend)
    twin = pk.SVRG(twin_m.parameters(), lr=0.05, momentum=0.9, backend=backend)
    scaler = scaler_cls("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    for t in range(5):
        idx = torch.arange(8 * t, 8 * t + 8)
        opt.zero_grad()
        loss = scaler.scale(prob.loss(m, idx))
        (loss * float("inf") if t == BAD else loss).backward()
        scaler.step(opt)
        scaler.update()
        if t == BAD:
            continue
        twin.zero_grad()
        prob.loss(twin_m, idx).backward()
        twin.step()
        assert all(torch.equal(a, b) for a, b in zip(params_of(m), params_of(twin_m))), t
