"""``sample_ahead`` (IVON, IVON-PoCo(Mo)): the step leaves the next step's inner sample in
the parameters, written in the update's own pass on the fused backends; the optimizer's
state and every step are those without it, bit for bit
(docs/design.md, 'The sampling protocol')."""
import copy

import pytest
import torch

import poco_kernels as pk
from helpers import FUSED_BACKENDS, Problem, mlp, params_of

pytestmark = pytest.mark.usefixtures("one_thread")

BACKENDS = ["torch"] + FUSED_BACKENDS
STATE = ("mean", "momentum", "h", "g_out", "h_out", "m_out", "sigma_out")


def _train(backend, ahead, steps=7, cls=pk.IVONPoCoMo, dtype=torch.float32, protocol="closure",
           **kw):
    prob = Problem()
    m = mlp(dtype=dtype)
    kw = dict(dict(lr=0.05, ess=200.0, seed=5, backend=backend, sample_ahead=ahead), **kw)
    opt = cls(m.parameters(), **kw)
    for t in range(steps):
        if cls is not pk.IVON and t in (1, 4):
            opt.refresh([prob.closure(opt, m, t % 3), prob.closure(opt, m, (t + 1) % 3)])
        if protocol == "closure":
            opt.step(prob.closure(opt, m, t % 3))
        else:
            for kind in ("inner", "outer") if opt.correction_active() else ("inner",):
                with opt.sampled(kind):
                    prob.loss(m, t % 3).backward()
            opt.step()
    return m, opt


def _state(opt):
    return {k: [t.clone() for t in opt.flat_state(k)] for k in STATE
            if k in opt._buckets[0].buffers}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls,kw", [(pk.IVONPoCoMo, {}), (pk.IVON, dict(mc_samples=2))])
def test_the_same_steps_as_without_it(backend, cls, kw):
    """State after every step bit-identical to sample_ahead=False; the parameters hold the
    sample a sample pass would write, and restore() gives the mean."""
    m0, o0 = _train(backend, False, cls=cls, **kw)
    m1, o1 = _train(backend, True, cls=cls, **kw)
    s0, s1 = _state(o0), _state(o1)
    for k in s0:
        assert all(torch.equal(a, b) for a, b in zip(s0[k], s1[k])), k
    ahead = [p.detach().clone() for p in params_of(m1)]
    assert not all(torch.equal(a, b) for a, b in zip(ahead, params_of(m0)))
    o0.sample("inner")                              # the sample pass of the plain run
    assert all(torch.equal(a, b) for a, b in zip(ahead, params_of(m0)))
    o1.restore()
    o0.restore()
    assert all(torch.equal(a, b) for a, b in zip(params_of(m1), params_of(m0)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,protocol", [(torch.bfloat16, "closure"),
                                            (torch.float32, "sampled")])
def test_the_same_steps_in_bf16_and_with_the_sampled_protocol(backend, dtype, protocol):
    m0, o0 = _train(backend, False, dtype=dtype, protocol=protocol)
    m1, o1 = _train(backend, True, dtype=dtype, protocol=protocol)
    s0, s1 = _state(o0), _state(o1)
    for k in s0:
        assert all(torch.equal(a, b) for a, b in zip(s0[k], s1[k])), k


@pytest.mark.skipif("cpp" not in FUSED_BACKENDS, reason="no C++ backend")
def test_the_fused_step_writes_it_and_the_next_step_samples_nothing(monkeypatch):
    """Steady state on the C++ backend: IVON's iteration launches no sample kernel,
    IVON-PoCoMo's one (the outer sample)."""
    from poco_kernels.kernels import cpp_ops
    for cls, launches in ((pk.IVON, 0), (pk.IVONPoCoMo, 1)):
        prob = Problem()
        m, opt = _train("cpp", True, steps=3, cls=cls)
        opt.step_plans = False                # (a plan's launches bypass the wrapper)
        calls = []
        real = cpp_ops.sample
        monkeypatch.setattr(cpp_ops, "sample", lambda *a: (calls.append(1), real(*a)))
        opt.step(prob.closure(opt, m, 0))
        monkeypatch.setattr(cpp_ops, "sample", real)
        assert len(calls) == launches, cls.__name__


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_changed_ess_draws_the_sample_again(backend):
    """The sample left by the step was drawn with the step's ess: a new ess before the next
    step makes the next sample a sample pass (the same steps as without sample_ahead)."""
    outs = []
    for ahead in (False, True):
        prob = Problem()
        m, opt = _train(backend, ahead, steps=3, cls=pk.IVON)
        opt.param_groups[0]["ess"] = 50.0
        opt.step(prob.closure(opt, m, 1))
        outs.append(_state(opt))
    for k in outs[0]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0][k], outs[1][k])), k


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_refused_step_leaves_the_sample_a_twin_holds(backend):
    """A step refused for a non-finite gradient: parameters (the next sample), state and
    the following steps as those of a twin that never saw the call."""
    prob = Problem()
    m, opt = _train(backend, True, steps=3, check_finite=True)
    twin_m, twin = copy.deepcopy((m, opt))
    assert all(torch.equal(a, b) for a, b in zip(params_of(m), params_of(twin_m)))

    def bad():
        opt.zero_grad()
        loss = prob.loss(m, 0) * float("inf")
        loss.backward()
        return loss
    with pytest.raises(ValueError, match="non-finite"):
        opt.step(bad)
    assert all(torch.equal(a, b) for a, b in zip(params_of(m), params_of(twin_m)))
    for t in range(2):
        opt.step(prob.closure(opt, m, t))
        twin.step(prob.closure(twin, twin_m, t))
    assert all(torch.equal(a, b) for a, b in zip(params_of(m), params_of(twin_m)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_copies_state_dicts_and_from_ivon(backend):
    """A deepcopy holds the same sample and continues the same; a state dict has the mean
    (a fresh optimizer loading it continues the same steps); from_ivon puts the mean
    back into the parameters before taking them."""
    prob = Problem()
    m, opt = _train(backend, True, steps=3)
    m2, opt2 = copy.deepcopy((m, opt))
    assert all(torch.equal(a, b) for a, b in zip(params_of(m), params_of(m2)))
    sd = opt.state_dict()
    for i, p in enumerate(m.parameters()):   # the mean, while the parameters hold a sample
        assert torch.equal(sd["state"][i]["mean"], opt.state[p]["mean"])
        assert not torch.equal(sd["state"][i]["mean"], p.detach())
    m3 = copy.deepcopy(m)
    opt3 = pk.IVONPoCoMo(m3.parameters(), lr=0.05, ess=200.0, seed=5, backend=backend,
                         sample_ahead=True)
    opt3.load_state_dict(sd)
    for t in range(2):
        for mm, oo in ((m, opt), (m2, opt2), (m3, opt3)):
            oo.step(prob.closure(oo, mm, t))
    for mm in (m2, m3):
        assert all(torch.equal(a, b) for a, b in zip(params_of(m), params_of(mm)))
    mi, ivon = _train(backend, True, steps=2, cls=pk.IVON)
    mean = [t.clone() for t in ivon.flat_state("mean")]
    poco = pk.IVONPoCoMo.from_ivon(ivon)
    assert poco.sample_ahead
    flat = torch.cat([p.detach().reshape(-1).float() for p in mi.parameters()])
    assert torch.equal(flat, torch.cat(mean))


def test_sample_ahead_is_validated():
    with pytest.raises(ValueError, match="sample_ahead"):
        pk.IVON(mlp().parameters(), lr=0.1, ess=10.0, sample_ahead=1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("event", ["freeze", "load", "add_group_then_copy", "relink"])
def test_layout_changes_between_steps(backend, event):
    """Freezing a layer, loading a state dict, adding a group (then copying), re-pointing
    a parameter's storage: with the next sample in the parameters, the same steps as
    without sample_ahead."""
    outs = []
    for ahead in (False, True):
        prob = Problem()
        m = mlp()
        ps = list(m.parameters())
        first = ps if event != "add_group_then_copy" else ps[:2]
        opt = pk.IVON(first, lr=0.05, ess=200.0, seed=5, backend=backend, sample_ahead=ahead)
        for t in range(4):
            if t == 2:
                if event == "freeze":
                    ps[0].requires_grad_(False)
                elif event == "load":
                    opt.load_state_dict(opt.state_dict())
                elif event == "add_group_then_copy":
                    opt.add_param_group({"params": ps[2:]})
                    m, opt = copy.deepcopy((m, opt))
                elif event == "relink":
                    ps[1].data = ps[1].data.clone()
            opt.step(prob.closure(opt, m, t % 3))
        opt.restore()
        outs.append([p.detach().clone() for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*outs))


#: the settings a run may change between steps that its noise depends on: (the value the
#: optimizers below are built with, another, values refused)
NOISE_SETTINGS = {"noise_version": (2, 1, (0, 3, True, 2.0, "1")),
                  "seed": (5, 77, (-1, 2 ** 63, True, 5.0, "5", None))}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("setting", NOISE_SETTINGS)
def test_a_new_noise_setting_redraws_the_sample_left_ahead(backend, setting):
    """Setting ``noise_version`` (as after loading an old checkpoint) or ``seed`` mid-run:
    the sample the step left in the parameters was drawn under the old value, so it is
    drawn again, and the run equals the one without sample_ahead bit for bit."""
    _, new_value, _ = NOISE_SETTINGS[setting]
    runs = []
    for ahead in (False, True):
        prob = Problem()
        m = mlp()
        opt = pk.IVON(m.parameters(), lr=0.05, ess=200.0, seed=5, backend=backend,
                      sample_ahead=ahead)
        for t in range(6):
            if t == 3:
                setattr(opt, setting, new_value)
            opt.step(prob.closure(opt, m, t % 3))
        opt.restore()
        runs.append(([p.detach().clone() for p in params_of(m)], _state(opt)))
    (p0, s0), (p1, s1) = runs
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    for k in s0:
        assert all(torch.equal(a, b) for a, b in zip(s0[k], s1[k])), k


@pytest.mark.parametrize("setting", NOISE_SETTINGS)
def test_a_noise_setting_is_validated_and_refused_inside_a_sample(setting):
    built, new_value, bad_values = NOISE_SETTINGS[setting]
    m = mlp()
    opt = pk.IVON(m.parameters(), lr=0.05, ess=200.0, seed=5, backend="torch")
    for bad in bad_values:
        with pytest.raises(ValueError, match=f"{setting} must be"):
            setattr(opt, setting, bad)
        assert getattr(opt, setting) == built
    with opt.sampled("inner"):
        with pytest.raises(RuntimeError, match="restore"):
            setattr(opt, setting, new_value)
        assert getattr(opt, setting) == built


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pending", ["inner", "refresh"])
@pytest.mark.parametrize("setting", NOISE_SETTINGS)
def test_a_noise_setting_is_refused_with_gradients_pending_and_changes_nothing(backend, pending,
                                                                              setting):
    """Between a sample's gradient and the step (or refresh) that uses it, the fused kernels
    draw the sample's noise again: a new version or seed there would pair the gradient
    with other noise.  The change is refused, and the run equals that of a twin that never
    saw it; setting the value it already has is a no-op."""
    built, new_value, _ = NOISE_SETTINGS[setting]
    runs = []
    for poke in (False, True):
        prob = Problem()
        m = mlp()
        opt = pk.IVONPoCoMo(m.parameters(), lr=0.05, ess=200.0, seed=5, backend=backend)
        for t in range(4):
            kinds = ["inner", "outer"] if opt.correction_active() else ["inner"]
            if pending == "refresh" and t == 2:
                kinds = ["refresh"]
            for kind in kinds:
                with opt.sampled(kind):
                    prob.loss(m, t % 3).backward()
            if poke and t == 2:
                with pytest.raises(RuntimeError, match="gradients pending"):
                    setattr(opt, setting, new_value)
                assert getattr(opt, setting) == built
                setattr(opt, setting, built)            # unchanged: accepted
            if kinds == ["refresh"]:
                opt.refresh()
            else:
                opt.step()
        opt.restore()
        runs.append(([p.detach().clone() for p in params_of(m)], _state(opt),
                      opt.state_dict()["poco"]["noise"], opt.state_dict()["poco"]["seed"]))
    (p0, s0, v0, e0), (p1, s1, v1, e1) = runs
    assert v0 == v1 == 2 and e0 == e1 == 5
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    for k in s0:
        assert all(torch.equal(a, b) for a, b in zip(s0[k], s1[k])), k
