"""Save / reload at any point (mid inner loop, between refreshes, with gradients already
accumulated through the low-level API) continues on exactly the same trajectory."""
import copy
import io

import pytest
import torch

import poco_kernels as pk
from helpers import Problem, mlp, params_of, run
from optim_db import configs

#: the optimizer database's resume configurations (tests/optim_db.py), by class name
OPTIMIZERS = {c.optimizer: c for c in configs("resume")}


def _make(name):
    c = OPTIMIZERS[name]
    return lambda p, be: c.make(p, be, seed=5)


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _resume_cases():
    """Every resume configuration x backend x cut."""
    return [pytest.param(c.optimizer, cut, b, id=f"{c.id}-{b}-{cut}")
            for c in OPTIMIZERS.values() for b in c.runs_on()
            for cut in (7, 13)]                 # 13: mid inner loop, after 2 refreshes


@pytest.mark.parametrize("name,cut,backend", _resume_cases())
def test_resume_is_bit_identical(name, cut, backend):
    prob = Problem()
    make = _make(name)
    refresh = 5 if OPTIMIZERS[name].info.has_refresh else None
    steps, batches = 24, prob.batches(24)

    m_ref = mlp()
    o_ref = make(m_ref.parameters(), backend)
    l_ref = run(o_ref, m_ref, prob, steps, refresh_every=refresh, warmup=2, batches=batches)

    m1 = mlp()
    o1 = make(m1.parameters(), backend)
    l_a = run(o1, m1, prob, cut, refresh_every=refresh, warmup=2, batches=batches)
    model_sd, opt_sd = _roundtrip(copy.deepcopy(m1.state_dict())), _roundtrip(o1.state_dict())
    del m1, o1

    m2 = mlp(seed=99)                      # different init: everything must come from the dicts
    o2 = make(m2.parameters(), backend)
    m2.load_state_dict(model_sd)
    o2.load_state_dict(opt_sd)
    l_b = run(o2, m2, prob, steps, refresh_every=refresh, warmup=2, batches=batches, start=cut)

    assert l_a + l_b == l_ref
    for a, b in zip(params_of(m2), params_of(m_ref)):
        assert torch.equal(a, b)
    for name in o_ref._buckets[0].buffers:
        assert torch.equal(o2._buckets[0].buffers[name], o_ref._buckets[0].buffers[name]), name


def test_noise_version_is_kept_across_resume_and_switched_by_a_newer_dict(backend):
    """A state dict records the noise stream it was drawn under.  A run resumed from a
    version-1 dict (written before version 2) keeps drawing version 1, bit for bit; the same
    optimizer then loading a version-2 dict continues that run bit for bit; an unknown
    version is refused and changes nothing."""
    prob = Problem()
    make = _make("IVONPoCo")
    steps, cut, batches = 12, 6, prob.batches(12)
    kw = dict(refresh_every=5, warmup=2, batches=batches)

    def run_from_start(version):
        m = mlp()
        o = make(m.parameters(), backend)
        assert o.noise_version == 2                  # new optimizers draw version 2
        o.noise_version = version
        return m, o, run(o, m, prob, steps, **kw)

    m_v1, _, l_v1 = run_from_start(1)
    m_v2, o_v2, l_v2 = run_from_start(2)
    assert l_v1 != l_v2                              # the versions are other noise

    m1 = mlp()
    o1 = make(m1.parameters(), backend)
    o1.noise_version = 1
    l_a = run(o1, m1, prob, cut, **kw)
    sd_v1, model_v1 = _roundtrip(o1.state_dict()), copy.deepcopy(m1.state_dict())
    assert sd_v1["poco"]["noise"] == 1
    m2 = mlp(seed=99)
    o2 = make(m2.parameters(), backend)
    m2.load_state_dict(model_v1)
    o2.load_state_dict(sd_v1)
    assert o2.noise_version == 1
    assert l_a + run(o2, m2, prob, steps, start=cut, **kw) == l_v1
    for a, b in zip(params_of(m2), params_of(m_v1)):
        assert torch.equal(a, b)

    # the other direction: the version-1 optimizer loads a version-2 dict of step `cut`
    m3 = mlp()
    o3 = make(m3.parameters(), backend)
    l_c = run(o3, m3, prob, cut, **kw)
    sd_v2, model_v2 = _roundtrip(o3.state_dict()), copy.deepcopy(m3.state_dict())
    m2.load_state_dict(model_v2)
    o2.load_state_dict(sd_v2)
    assert o2.noise_version == 2
    assert l_c + run(o2, m2, prob, steps, start=cut, **kw) == l_v2
    for a, b in zip(params_of(m2), params_of(m_v2)):
        assert torch.equal(a, b)

    # an unknown version: refused, nothing changed (the optimizer still equals o_v2)
    bad = o2.state_dict()
    bad["poco"]["noise"] = 3
    before = {k: v.clone() for k, v in o2._buckets[0].buffers.items()}
    with pytest.raises(ValueError, match="noise stream version 3"):
        o2.load_state_dict(bad)
    assert o2.noise_version == 2
    for k, v in o2._buckets[0].buffers.items():
        assert torch.equal(v, before[k]), k


def test_resume_with_pending_low_level_gradients(backend):
    """A checkpoint taken between accumulate() and step() keeps the collected gradients."""
    prob = Problem()
    b = prob.batches(1)[0]

    def grads_then_step(opt, model, save=False):
        with opt.sampled("inner"):
            prob.loss(model, b).backward()
        if save:
            return _roundtrip(opt.state_dict())
        opt.step()

    m1, m2 = mlp(), mlp()
    o1 = pk.IVON(m1.parameters(), lr=0.05, ess=300.0, seed=2, backend=backend)
    o2 = pk.IVON(m2.parameters(), lr=0.05, ess=300.0, seed=2, backend=backend)
    grads_then_step(o1, m1)
    sd = grads_then_step(o2, m2, save=True)
    m3 = mlp()
    o3 = pk.IVON(m3.parameters(), lr=0.05, ess=300.0, seed=0, backend=backend)
    o3.load_state_dict(sd)                 # seed comes from the state dict too
    o3.step()
    for a, c in zip(params_of(m1), params_of(m3)):
        assert torch.equal(a, c)


def test_state_dict_has_torch_layout_and_counters(backend):
    prob = Problem()
    m = mlp()
    o = pk.IVONPoCo(m.parameters(), lr=0.05, ess=300.0, seed=11, backend=backend)
    run(o, m, prob, 6, refresh_every=3)
    sd = o.state_dict()
    assert set(sd) >= {"state", "param_groups", "poco"}
    assert sd["poco"]["step"] == 6 and sd["poco"]["refreshes"] == 2 and sd["poco"]["seed"] == 11
    p0 = next(m.parameters())
    assert set(sd["state"][0]) == {"mean", "h", "momentum", "g_out", "h_out", "m_out", "sigma_out"}
    assert sd["state"][0]["h"].shape == p0.shape
    assert sd["param_groups"][0]["params"] == [0, 1, 2, 3]


def test_lr_scheduler_works_and_round_trips(backend):
    prob = Problem()
    m = mlp()
    o = pk.IVON(m.parameters(), lr=0.1, ess=300.0, backend=backend)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10)
    lrs = []
    for b in prob.batches(5):
        o.step(prob.closure(o, m, b))
        sched.step()
        lrs.append(o.param_groups[0]["lr"])
    assert lrs[0] < 0.1 and lrs == sorted(lrs, reverse=True)
    o2 = pk.IVON(mlp().parameters(), lr=0.1, ess=300.0, backend=backend)
    o2.load_state_dict(o.state_dict())
    assert o2.param_groups[0]["lr"] == lrs[-1]
