"""The default ``sample_ahead=None`` on the fused backends: the step writes the next inner
sample beside the mean and, between public calls, the parameters' storage reads the mean
buffer's memory (parked, ``poco_kernels/backends/fused_park.py``).  The contract is the
copy protocol's (``sample_ahead=False``): the parameters hold the mean between calls,
every step the same bit for bit; the bytes are ``sample_ahead``'s (no sample pass)
(docs/design.md, 'The sampling protocol')."""
import copy
import pickle

import pytest
import torch

import poco_kernels as pk
from helpers import FUSED_BACKENDS, Problem, mlp, params_of
from parking_twins import assert_twins, equal, iteration, make, state_of, warm

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
@pytest.mark.parametrize("cls", [pk.IVON, pk.IVONPoCoMo])
@pytest.mark.parametrize("protocol", ["closure", "sampled"])
def test_parked_steps_equal_the_copy_protocol(backend, cls, protocol):
    """After every iteration (and refresh) the parameters hold the mean, bit for bit the
    copy protocol's, and so does the state; the engine is parked between calls."""
    prob = Problem()
    m0, o0 = make(backend, False, cls)
    m1, o1 = make(backend, None, cls)
    assert o0.sample_ahead is False and o1.sample_ahead is None
    for t in range(7):
        for opt, m in ((o0, m0), (o1, m1)):
            iteration(opt, m, prob, t, protocol)
        assert o1._runner.parked and not o0._runner.parked, t
        assert equal(params_of(m1), params_of(m0)), t
        s0, s1 = state_of(o0), state_of(o1)
        assert all(equal(s0[k], s1[k]) for k in s0), t
        # (the optimizer's per-parameter state reads the mean too)
        assert all(torch.equal(o1.state[p]["mean"], p) for p in m1.parameters())


@pytest.mark.parametrize("cls,launches", [(pk.IVON, 0), (pk.IVONPoCoMo, 1)])
def test_a_parked_iteration_makes_no_sample_pass(cls, launches, monkeypatch):
    """Steady state on the C++ backend: IVON's iteration launches no sample kernel and
    IVON-PoCoMo's one (the outer sample), as with ``sample_ahead=True``; with
    ``sample_ahead=False`` one more each.  Also the iteration after a refresh (the refresh
    draws the next sample at its end)."""
    from poco_kernels.kernels import cpp_ops
    counts = {}
    for ahead in (None, False):
        prob = Problem()
        m, opt = make("cpp", ahead, cls)
        opt.step_plans = False                # (a plan's launches bypass the wrapper)
        for t in range(3):
            iteration(opt, m, prob, t, "closure")
        calls = []
        real = cpp_ops.sample
        monkeypatch.setattr(cpp_ops, "sample", lambda *a: (calls.append(1), real(*a)))
        for t in range(4, 6):                 # (IVON-PoCoMo refreshes before 4)
            n = len(calls)
            iteration(opt, m, prob, t, "closure")
            if t == 4 and cls is pk.IVONPoCoMo:
                n += 2 if ahead is None else 1   # (the refresh's sample; parked: the next)
            counts.setdefault(ahead, []).append(len(calls) - n)
        monkeypatch.setattr(cpp_ops, "sample", real)
    assert counts[None] == [launches] * 2
    assert counts[False] == [launches + 1] * 2


@pytest.mark.parametrize("cls,launches", [(pk.IVON, 0), (pk.IVONPoCoMo, 1)])
def test_a_parked_sampled_iteration_copies_nothing(cls, launches, monkeypatch):
    """The protocol of ``sampled()`` blocks (the integrations'): each block's exit parks
    instead of copying the mean back, so a steady-state iteration makes no restore and
    only IVON-PoCoMo's outer sample launch; the copy protocol restores after each block."""
    from poco_kernels.kernels import cpp_ops
    seen = {}
    for ahead in (None, False):
        prob = Problem()
        m, opt = make("cpp", ahead, cls)
        opt.step_plans = False
        for t in range(3):
            iteration(opt, m, prob, t, "sampled")
        eng = opt._runner
        calls = {"sample": 0, "restore": 0}
        real_sample, real_restore = cpp_ops.sample, eng.restore

        def sample(*a):
            calls["sample"] += 1
            return real_sample(*a)

        def restore():
            calls["restore"] += 1
            return real_restore()
        monkeypatch.setattr(cpp_ops, "sample", sample)
        monkeypatch.setattr(eng, "restore", restore)
        for t in range(5, 7):                 # (no refresh among them)
            iteration(opt, m, prob, t, "sampled")
        monkeypatch.undo()
        seen[ahead] = dict(calls)
    assert seen[None] == {"sample": 2 * launches, "restore": 0}
    blocks = 1 if cls is pk.IVON else 2
    assert seen[False] == {"sample": 2 * (launches + 1), "restore": 2 * blocks}


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_views_and_state_dicts_read_the_mean(backend):
    """A view of a parameter made after the optimizer (``p.t()``, a slice) and a state
    dict taken between steps (torch.optim's: views of the state) read the mean while
    parked, the same memory the parameter reads."""
    prob = Problem()
    m, opt = make(backend, None)
    w = next(m.parameters())
    view = w[:, 2:5]
    for t in range(3):
        iteration(opt, m, prob, t, "closure")
    assert opt._runner.parked
    assert torch.equal(view, w[:, 2:5]) and view.data_ptr() == w[:, 2:5].data_ptr()
    sd = opt.state_dict()
    assert torch.equal(sd["state"][0]["mean"], w)
    saved = copy.deepcopy(sd)
    m2, o2 = make(backend, False, model=copy.deepcopy(m))
    o2.load_state_dict(saved)
    for t in range(3, 6):
        iteration(opt, m, prob, t, "closure")
        iteration(o2, m2, prob, t, "closure")
    assert equal(params_of(m), params_of(m2))


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_a_backward_through_a_graph_saved_before_a_step_fails(backend):
    """Parking moves the parameters' version counters: a graph that saved a parameter
    before a step cannot be differentiated after it (it would read other values)."""
    prob = Problem()
    m, opt = make(backend, None, pk.IVON)
    iteration(opt, m, prob, 0, "closure")
    loss = prob.loss(m, 1)
    iteration(opt, m, prob, 1, "closure")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
@pytest.mark.parametrize("edit", ["in_place", "load_state_dict", "replaced"])
def test_a_parameter_written_while_parked_is_the_new_mean(backend, edit):
    """Written between steps in place (``torch.no_grad()``, ``model.load_state_dict``) or
    with its storage replaced (``p.data = t``): the same steps as the copy protocol given
    the same edit (the sample the step left is drawn again from the new mean)."""
    prob = Problem()
    runs = []
    for ahead in (False, None):
        m, opt = warm(backend, ahead, prob)
        p = list(m.parameters())[2]
        if edit == "in_place":
            with torch.no_grad():
                p.mul_(0.5)
        elif edit == "load_state_dict":
            sd = {k: v * 0.5 for k, v in m.state_dict().items()}
            m.load_state_dict(sd)
        else:
            p.data = p.detach() * 0.5
        for t in range(3, 6):
            iteration(opt, m, prob, t, "closure")
        runs.append((params_of(m), state_of(opt)))
    assert_twins(*runs)


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_a_write_through_data_reaches_the_mean(backend):
    """A write through ``p.data`` moves no version counter: it goes into the mean at once
    (the state and the parameters read it); the sample already drawn does not see it."""
    prob = Problem()
    m, opt = make(backend, None, pk.IVON)
    for t in range(2):
        iteration(opt, m, prob, t, "closure")
    p = next(m.parameters())
    p.data.mul_(0.5)
    want = p.detach().clone()
    assert torch.equal(opt.state_dict()["state"][0]["mean"], want)
    assert torch.equal(p, want)


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_copies_continue_the_same(backend):
    """A deepcopy and a pickle of a parked optimizer (with its model) hold the mean and
    continue bit for bit; the copy parks too."""
    prob = Problem()
    m, opt = make(backend, None)
    for t in range(3):
        iteration(opt, m, prob, t, "closure")
    twins = [copy.deepcopy((m, opt)), pickle.loads(pickle.dumps((m, opt)))]
    for tm, _ in twins:
        assert equal(params_of(tm), params_of(m))
    for t in range(3, 6):
        iteration(opt, m, prob, t, "closure")
        for tm, to in twins:
            iteration(to, tm, prob, t, "closure")
    for tm, to in twins:
        assert to._runner.parked
        assert equal(params_of(tm), params_of(m))


@pytest.mark.parametrize("backend", ["torch"] + FUSED_BACKENDS)
def test_where_parking_does_not_apply(backend):
    """The torch backend, bfloat16 parameters (the mean is a float32 master copy),
    ``sample_ahead=False`` and ``True``: no parking (``True``: the parameters hold the
    sample between steps, as documented)."""
    prob = Problem()
    cases = [(None, torch.float32, backend != "torch"), (None, torch.bfloat16, False),
             (False, torch.float32, False), (True, torch.float32, False)]
    for ahead, dtype, parks in cases:
        m, opt = make(backend, ahead, pk.IVON, model=mlp(dtype=dtype))
        for t in range(2):
            iteration(opt, m, prob, t, "closure")
        assert opt._runner.parked is parks, (ahead, dtype)


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
@pytest.mark.parametrize("protocol", ["closure", "sampled"])
def test_a_sample_written_through_data_in_a_failed_call_is_drawn_again(backend, protocol):
    """A closure or ``sampled()`` block that writes the sample through ``p.data`` (which
    no version counter sees) and raises: the next step draws its sample again, as the
    copy protocol does."""
    prob = Problem()
    runs = []
    for ahead in (False, None):
        m, opt = make(backend, ahead, pk.IVON)
        iteration(opt, m, prob, 0, "closure")
        w = next(m.parameters())

        def bad():
            w.data.mul_(2.0)
            raise KeyError("failed")
        with pytest.raises(KeyError):
            if protocol == "closure":
                opt.step(bad)
            else:
                with opt.sampled():
                    bad()
        iteration(opt, m, prob, 1, "closure")
        runs.append((params_of(m), state_of(opt)))
    assert_twins(*runs)


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_a_state_dict_keeps_a_graph_at_the_mean_differentiable(backend):
    """``state_dict()`` (and so a copy or a pickle) reads the optimizer parked: no
    version counter moves, and a graph made at the mean before it still differentiates,
    as under the copy protocol."""
    prob = Problem()
    m, opt = make(backend, None, pk.IVON)
    iteration(opt, m, prob, 0, "closure")
    loss = prob.loss(m, 1)
    versions = [p._version for p in m.parameters()]
    sd = opt.state_dict()
    copy.deepcopy(opt)
    assert [p._version for p in m.parameters()] == versions and opt._runner.parked
    loss.backward()
    assert torch.equal(sd["state"][0]["mean"], next(m.parameters()))


def test_a_replayed_step_leaves_the_key_of_its_sample(monkeypatch):
    """A step plan's update sets what its next sample was drawn with from the recording
    (no derivation per iteration); under a schedule of ``lr`` and a changed ``ess`` it is
    still what the slow path would work out, after every step."""
    from poco_kernels._step_plan import StepPlanMixin
    replays = []
    real = StepPlanMixin._replay
    monkeypatch.setattr(StepPlanMixin, "_replay",
                        lambda self, *a: (replays.append(1), real(self, *a))[1])
    prob = Problem()
    m, opt = make("cpp", None, pk.IVON)
    eng = opt._runner
    for t in range(14):
        if 4 <= t <= 6:                       # (a schedule, then constant)
            opt.param_groups[0]["lr"] = 0.05 / t
        if t == 7:
            opt.param_groups[0]["ess"] = 300.0
        opt.step(prob.closure(opt, m, t % 3))
        assert eng.parked and eng.ahead == eng._ahead_key(), t
    assert len(replays) >= 6
