"""The update of ``step()`` without a closure replayed from its derived launches
(``StepPlanMixin._memo_update``): every step, replayed or derived, leaves the parameters,
the state, the counters and the pending sums exactly as the backend's own step does,
through the events a training loop with ``sampled()`` meets between steps."""
import pytest
import torch

import poco_kernels as pk
from poco_kernels import reference as R
from poco_kernels.kernels.interface import StepHyper
from helpers import FUSED_BACKENDS, Problem
from plan_twins import between_iterations, make_twins, same_run

pytestmark = pytest.mark.usefixtures("one_thread")

CPP = [b for b in FUSED_BACKENDS if b == "cpp"]

#: the events, 4 or more steps apart (the memo is derived again in between)
EVENTS = {6: "lr", 10: "freeze", 14: "unfreeze", 18: "data", 22: "set_to_none",
          26: "load_state_dict", 30: "unreached", 34: "nan", 38: "two_samples",
          42: "amp", 46: "tensor_lr", 50: "float_lr", 54: "noise_version",
          58: "correction", 62: "check_finite", 66: "add_group", 70: "outer_first"}
#: the steps that must replay the memo (the step before each event derived it, and the
#: event changes nothing it was derived from)
REPLAYED = {9, 13, 17, 21, 22, 25, 29, 33, 37, 45, 53, 57, 61, 69, 73}


def _iteration(t, m, opt, prob):
    """Iteration ``t`` of a loop without a closure, with its event; the outcome."""
    ps = list(m.parameters())
    idx = t % 5
    ev = EVENTS.get(t)
    g = opt.param_groups[0]
    if between_iterations(ev, opt, ps):
        pass
    elif ev == "tensor_lr":                  # (a value that can change in place: no memo)
        g["lr"] = torch.tensor(0.02)
    elif ev == "float_lr":
        g["lr"] = 0.025
    elif ev == "noise_version":
        opt.noise_version = 1
    elif ev == "correction" and "alpha" in g:
        g["alpha"] = 0.3
        g["outer_noise"] = "independent"
    elif ev == "check_finite":
        opt.check_finite = False
    outer_first = ev == "outer_first" and opt.correction_active()
    if outer_first:                         # (the two sums in each other's buffers)
        with opt.sampled("outer"):
            prob.loss(m, idx).backward()
    for _ in range(2 if ev == "two_samples" else 1):
        with opt.sampled("inner"):
            loss = prob.loss(m, idx)
            if ev == "unreached":           # a parameter the backward does not reach
                loss.backward(inputs=ps[:2])
            else:
                loss.backward()
            if ev == "nan":                 # a non-finite gradient: refused, nothing changes
                ps[2].grad[0] = float("nan")
    if opt.correction_active() and not outer_first:
        with opt.sampled("outer"):
            prob.loss(m, idx).backward()
    amp = {}
    if ev == "amp":
        amp = dict(grad_scale=torch.tensor(2.0), found_inf=torch.tensor(0.0))
    try:
        opt.step(**amp)
    except ValueError as e:
        return type(e).__name__
    return "ok"


@pytest.mark.parametrize("backend", CPP)
@pytest.mark.parametrize("cls", [pk.IVON, pk.IVONPoCoMo])
def test_replayed_updates_equal_the_backends_step(cls, backend, monkeypatch):
    twins = make_twins(cls, backend)
    prob = Problem()
    replays = []
    memo_cls = type(twins[0][1])
    real = memo_cls._memo_update

    def counted(self, corr):
        out = real(self, corr)
        if out is not None and out.__name__ == "<lambda>":     # (the memo's replay)
            replays.append((self, t))
        return out
    monkeypatch.setattr(memo_cls, "_memo_update", counted)
    for t in range(76):
        outcomes = []
        for m, opt in twins:
            if cls is not pk.IVON and t % 4 == 3:
                opt.refresh([prob.closure(opt, m, 3)])
            outcomes.append(_iteration(t, m, opt, prob))
        assert outcomes[0] == outcomes[1], t
        assert outcomes[0] == ("ValueError" if EVENTS.get(t) == "nan" else "ok"), t
        same_run(*twins)
    assert not [o for o, _ in replays if o is twins[1][1]]
    replayed = {t for o, t in replays if o is twins[0][1]}
    assert REPLAYED <= replayed, sorted(REPLAYED - replayed)
    # (what a memo must not serve: AMP arguments, a tensor lr)
    assert not {42, 46, 47, 48, 49} & replayed


@pytest.mark.parametrize("backend", CPP)
def test_a_memo_is_derived_again_when_a_value_it_read_changes(backend):
    """A step after a changed learning rate derives its launches again (the rows take
    the new value), and the one after replays them: three optimizers stepping the same
    gradients, one changing lr before its third step, one built with that lr, end where
    the backend's own step puts them."""
    twins = make_twins(pk.IVON, backend)
    prob = Problem()
    for t in range(6):
        for m, opt in twins:
            if t == 3:
                opt.param_groups[0]["lr"] = 0.2
            with opt.sampled():
                prob.loss(m, t).backward()
            opt.step()
        same_run(*twins)
    memo = twins[0][1]._update_memo
    assert memo is not None and twins[1][1]._update_memo is None
    g = twins[0][1].param_groups[0]
    lr = R.ivon_lr(0.2, g["hess_init"], g["weight_decay"], g["rescale_lr"])
    steps = [v for v in memo.values if len(v) == len(StepHyper._fields)]
    assert steps and all(v[StepHyper._fields.index("lr")] == lr for v in steps)


@pytest.mark.parametrize("backend", CPP)
@pytest.mark.parametrize("cls", [pk.IVON, pk.IVONPoCoMo])
def test_a_schedule_derives_again_and_prepares_nothing_new(cls, backend, monkeypatch):
    """A learning rate moved before every step (a schedule): each step derives its
    launches again (the rows take the new values) and, the launches being the same
    objects, replays the prepared ones; the twins stay equal."""
    twins = make_twins(cls, backend)
    prob = Problem()
    eng = twins[0][1]._runner
    prepared = []
    real = type(eng).prepare

    def counted(self, calls):
        if self is eng:
            prepared.append(t)
        return real(self, calls)
    monkeypatch.setattr(type(eng), "prepare", counted)
    for t in range(16):
        for m, opt in twins:
            if cls is not pk.IVON and t % 4 == 3:
                opt.refresh([prob.closure(opt, m, 3)])
            opt.param_groups[0]["lr"] = 0.05 * (1.0 - t / 32)
            with opt.sampled():
                prob.loss(m, t % 5).backward()
            if opt.correction_active():
                with opt.sampled("outer"):
                    prob.loss(m, t % 5).backward()
            opt.step()
        same_run(*twins)
    # (prepared again only where what the launches read changed: the first steps, a new
    # sum or row, the correction starting)
    assert not [t for t in prepared if t >= 10], prepared
