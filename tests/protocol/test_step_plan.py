"""Step plans (``poco_kernels._step_plan``): ``step(closure)``'s steady state on the fused
backends is recorded and replayed; every iteration, replayed or not, leaves the
parameters, the state, the counters and the pending sums exactly as the slow path does,
through the events a training loop meets between and inside iterations."""
import pytest
import torch

import poco_kernels as pk
from poco_kernels._step_plan import StepPlan
from helpers import FUSED_BACKENDS, Problem, mlp
from plan_twins import between_iterations, make_twins, same_run

pytestmark = pytest.mark.usefixtures("one_thread")

CPP = [b for b in FUSED_BACKENDS if b == "cpp"]


def _outcome(opt, closure):
    """``opt.step(closure)``'s loss, or the name of the error the events make it raise."""
    try:
        loss = opt.step(closure)
    except (KeyError, ValueError) as e:
        return type(e).__name__, None
    return "ok", None if loss is None else float(loss.detach())


#: the events, 5 or more iterations apart (a plan is made again in between); those marked
#: replayed meet a plan that still fits when the iteration starts
EVENTS = {9: "lr", 14: "freeze", 19: "unfreeze", 28: "data", 33: "set_to_none",
          38: "load_state_dict", 43: "unreached", 48: "lr_inside", 53: "raises",
          58: "nan", 63: "grad_replaced", 68: "data_inside", 73: "two_samples",
          78: "after_two_samples", 83: "add_group"}
REPLAYED = {28, 33, 43, 48, 53, 58, 63, 68, 78}


def _events(t, m, opt, prob):
    """What happens before iteration ``t``, and the closure it runs."""
    ps = list(m.parameters())
    idx = t % 5
    ev = EVENTS.get(t)
    if between_iterations(ev, opt, ps):
        pass
    elif ev == "two_samples":                # the other protocol: the rows get 1/2
        for _ in range(2):
            with opt.sampled("inner"):
                prob.loss(m, idx).backward()
        if opt.correction_active():
            with opt.sampled("outer"):
                prob.loss(m, idx).backward()

    if ev == "two_samples":
        return None

    def closure():
        opt.zero_grad()
        loss = prob.loss(m, idx)
        if ev == "unreached":               # a parameter the backward does not reach
            loss.backward(inputs=ps[:3])
            return loss
        if ev == "lr_inside":               # (and the outer sample's noise, IVON-PoCoMo)
            opt.param_groups[0]["lr"] = 0.02
            if "outer_noise" in opt.param_groups[0]:
                opt.param_groups[0]["outer_noise"] = "independent"
        if ev == "raises":
            raise KeyError("closure failed")
        loss.backward()
        if ev == "nan":                     # a non-finite gradient: refused, nothing changes
            ps[2].grad[0] = float("nan")
        if ev == "grad_replaced":
            ps[0].grad = ps[0].grad.clone()
        if ev == "data_inside":             # a parameter's storage replaced, sample in it
            with torch.no_grad():
                ps[1].data = ps[1].detach().clone() + 0.01
        return loss
    return closure


@pytest.mark.parametrize("backend", CPP)
@pytest.mark.parametrize("cls", [pk.IVON, pk.IVONPoCoMo])
def test_replayed_iterations_equal_the_slow_path(cls, backend, monkeypatch):
    twins = make_twins(cls, backend)
    prob = Problem()
    replays = []
    real = type(twins[0][1])._replay

    def counted(self, *a):
        replays.append((self, t))
        return real(self, *a)
    monkeypatch.setattr(type(twins[0][1]), "_replay", counted)
    for t in range(88):
        outcomes = []
        for m, opt in twins:
            if cls is not pk.IVON and t % 4 == 3:
                opt.refresh([prob.closure(opt, m, 3)])
            closure = _events(t, m, opt, prob)
            outcomes.append(_outcome(opt, closure))
        assert outcomes[0] == outcomes[1], t
        same_run(*twins)
    assert not [o for o, _ in replays if o is twins[1][1]]
    replayed = {t for o, t in replays if o is twins[0][1]}
    assert REPLAYED <= replayed, sorted(REPLAYED - replayed)


@pytest.mark.parametrize("backend", CPP)
@pytest.mark.parametrize("cls", [pk.IVON, pk.IVONPoCoMo])
def test_the_one_sweep_hand_out_equals_the_layout_check_and_the_hand_out(cls, backend):
    """The engine's ``check_and_hand_out`` (one ``scan`` per bucket where nothing moved)
    against a twin that runs ``check_layout`` and ``hand_out`` themselves, through the
    events above and each of the hand-out's own: a user hook taking a parameter's hook
    slot, a ``.grad`` replaced by another tensor between iterations, closures that leave
    the zeroing to the hand-out, and the sweeps of every replayed update skipped
    (``replay_accumulate`` saw the layout)."""
    twins = make_twins(cls, backend)
    prob = Problem()
    slow = twins[1][1]._runner
    slow.check_and_hand_out = lambda: (slow.check_layout(), slow.hand_out())
    ps = [list(m.parameters()) for m, _ in twins]
    for t in range(60):
        outcomes = []
        for k, (m, opt) in enumerate(twins):
            if cls is not pk.IVON and t % 4 == 3:
                opt.refresh([prob.closure(opt, m, 3)])
            if t == 21:
                ps[k][2].register_post_accumulate_grad_hook(lambda p: None)
            if t == 26:
                ps[k][1].grad = torch.zeros_like(ps[k][1])
            closure = _events(t, m, opt, prob)
            if 30 <= t < 40 and closure is not None:      # (no zero_grad: the hand-out's)
                closure = (lambda m, i: lambda: prob.loss(m, i).backward())(m, t % 5)
            outcomes.append(_outcome(opt, closure))
        assert outcomes[0] == outcomes[1], t
        same_run(*twins)
        views = [[i for i, p in enumerate(m.parameters()) for b in opt._buckets
                  for gb in b.grad_bufs if any(p.grad is v for v in gb.views)]
                 for m, opt in twins]
        assert views[0] == views[1], t
        assert [b.presence.flags.tolist() if b.presence is not None else None
                for b in twins[0][1]._buckets] == \
            [b.presence.flags.tolist() if b.presence is not None else None
             for b in twins[1][1]._buckets], t


@pytest.mark.parametrize("backend", CPP)
def test_a_sample_refused_by_the_layout_check_makes_no_gradient_buffer(backend):
    """The one-sweep hand-out decides before changing anything: a sample whose layout
    check raises (a parameter converted after ``accumulate`` lent the only buffer) leaves
    the buckets' gradient buffers as they were."""
    (m, opt), _ = make_twins(pk.IVON, backend)
    prob = Problem()
    opt.step(prob.closure(opt, m, 0))
    with opt.sampled():
        prob.loss(m, 1).backward()             # (the buffer lent to the pending sum)
    before = [len(b.grad_bufs) for b in opt._buckets]
    p = list(m.parameters())[0]
    p.data = p.data.double()
    with pytest.raises(RuntimeError, match="since the optimizer was built"):
        with opt.sampled():
            pass
    assert [len(b.grad_bufs) for b in opt._buckets] == before


@pytest.mark.parametrize("backend", CPP)
def test_a_torch_function_mode_sees_a_replayed_iterations_kernels(backend):
    """A replayed iteration's operator calls are bound once (``_C.call``); while a torch
    function mode is active they go through ``torch.ops``, which the mode sees, as in a
    recorded iteration."""
    from torch.overrides import TorchFunctionMode
    (m, opt), _ = make_twins(pk.IVON, backend)
    prob = Problem()
    for t in range(4):
        opt.step(prob.closure(opt, m, t))
    plan = opt._step_plan
    assert isinstance(plan, StepPlan)
    class Seen(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls.append(str(func))
            return func(*args, **(kwargs or {}))
    mode = Seen()
    with mode:
        opt.step(prob.closure(opt, m, 4))
    seen = mode.calls
    assert opt._step_plan is plan
    ops = ("step", "check", "finish")     # (the packets, as the slow path's calls)
    assert {str(getattr(torch.ops.poco_kernels_cpp, n)) for n in ops} <= set(seen)
    # (no sample pass: the last step wrote the inner sample, the parameters parked)
    assert str(torch.ops.poco_kernels_cpp.sample) not in seen
    opt.step_plans = False
    mode = Seen()
    with mode:
        opt.step(prob.closure(opt, m, 5))
    seen_slow = mode.calls
    ours = {s for s in seen if s.startswith("poco_kernels_cpp")}
    assert ours == {s for s in seen_slow if s.startswith("poco_kernels_cpp")}


#: calls and values a closure (or the loop before it) may throw at a planned iteration
PROTOCOL_EVENTS = ["sample_restore_before", "mc_samples_before", "mc_samples_inside",
                   "alpha_zero_inside", "restore_inside", "accumulate_inside",
                   "accumulate_keep_inside", "frozen_grad_inside", "lr_back_and_forth",
                   "seed_inside", "lr_none_inside"]


def _protocol_event(ev, m, opt, prob, t):
    ps = list(m.parameters())
    g = opt.param_groups[0]
    if t == 5 and ev == "sample_restore_before":
        opt.sample("inner")
        opt.restore()
    if t == 5 and ev == "mc_samples_before":
        g["mc_samples"] = 2
    if t == 6 and ev.startswith("mc_samples"):
        g["mc_samples"] = 1
    if t == 5 and ev == "lr_back_and_forth":
        g["lr"] = 0.03
    if t == 6 and ev == "lr_back_and_forth":
        g["lr"] = opt.__dict__["_lr_kept"]        # (the very object set at t == 5)
    if t == 6 and ev == "lr_none_inside":
        g["lr"] = 0.05

    def closure():
        opt.zero_grad()
        loss = prob.loss(m, t % 5)
        loss.backward()
        if t != 5:
            return loss
        inner = opt._active is not None and opt._active[0] == 0
        if ev == "mc_samples_inside" and inner:
            g["mc_samples"] = 2
        elif ev == "alpha_zero_inside" and inner and "alpha" in g:
            g["alpha"] = 0.0
        elif ev == "restore_inside":
            opt.restore()
        elif ev == "accumulate_inside":
            opt.accumulate()
        elif ev == "accumulate_keep_inside" and inner:
            opt.accumulate(clear_grads=False)
        elif ev == "frozen_grad_inside":
            ps[3].grad = torch.ones_like(ps[3])
        elif ev == "lr_back_and_forth":
            opt.__dict__["_lr_kept"] = g["lr"]
            g["lr"] = 0.02
        elif ev == "seed_inside" and inner:
            opt.seed = 77
        elif ev == "lr_none_inside":
            g["lr"] = None
        return loss
    return closure


@pytest.mark.parametrize("backend", CPP)
@pytest.mark.parametrize("cls", [pk.IVON, pk.IVONPoCoMo])
@pytest.mark.parametrize("ev", PROTOCOL_EVENTS)
def test_a_planned_iteration_meets_the_protocol_as_the_slow_path_does(ev, cls, backend):
    """Each event at an iteration that starts with a plan: the same outcome (the same
    error where the slow path raises), and the same everything after it and after the
    next iterations."""
    twins = []
    for plans in (True, False):
        m = mlp()
        kw = dict(lr=0.05, ess=200.0, seed=5, backend=backend)
        if cls is not pk.IVON:
            kw["alpha"] = 0.5
        opt = cls(m.parameters(), **kw)
        opt.step_plans = plans
        if ev == "frozen_grad_inside":
            list(m.parameters())[3].requires_grad_(False)
        twins.append((m, opt))
    prob = Problem()
    for t in range(9):
        outcomes = []
        for m, opt in twins:
            if cls is not pk.IVON and t == 0:
                opt.refresh([prob.closure(opt, m, 3)])
            if t == 5 and opt.step_plans:
                assert isinstance(opt._step_plan, StepPlan)
            closure = _protocol_event(ev, m, opt, prob, t)
            try:
                opt.step(closure)
                outcomes.append("ok")
            except (RuntimeError, TypeError, ValueError) as e:
                outcomes.append(f"{type(e).__name__}: {e}")
        assert outcomes[0] == outcomes[1], (t, outcomes)
        same_run(*twins)
