"""torch.optim's hooks for every optimizer, the Triton kernels included (the table:
tests/conventions/torch_conventions.py): global and per-optimizer step pre/post hooks, the
step's profiler range, hooks as torch's step wrapper runs them, and the state_dict /
load_state_dict pre and post hooks.
"""
import copy

import pytest
import torch
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

import poco_kernels as pk
from torch_conventions import BATCHES, CASES_RT, Tiny, closure, lr_of, make

#: tiny tensors: torch's thread pool only costs here (conftest's fixture)
pytestmark = pytest.mark.usefixtures("one_thread")


# ============================================================================ hooks
@pytest.mark.parametrize("kind,backend", CASES_RT)
def test_step_all_hooks(kind, backend):
    """Global and per-optimizer step pre/post hooks run in torch's order, see the step's
    arguments, can replace them, and stop when removed."""
    m = Tiny()
    o = make(kind, m.parameters(), backend)
    m_other = Tiny()
    o_other = make(kind, m_other.parameters(), backend)
    data, seen_args = [], []

    def local_pre(opt, args, kwargs):
        data.append(1)
        seen_args.append(args)

    handles = [register_optimizer_step_pre_hook(lambda opt, a, k: data.append(0)),
               register_optimizer_step_post_hook(lambda opt, a, k: data.append(5))]
    try:
        handles += [o.register_step_pre_hook(local_pre),
                    o.register_step_post_hook(lambda opt, a, k: data.append(2))]
        c = closure(o, m, BATCHES[0])
        o.step(c)
        assert data == [0, 1, 2, 5]
        assert len(seen_args) == 1 and seen_args[0][0] is o and seen_args[0][1:] == (c,)
        o_other.step(closure(o_other, m_other, BATCHES[0]))
        assert data == [0, 1, 2, 5, 0, 5]
    finally:
        for h in handles:
            h.remove()
    o.step(closure(o, m, BATCHES[1]))
    o_other.step(closure(o_other, m_other, BATCHES[1]))
    assert data == [0, 1, 2, 5, 0, 5]

    # a pre hook that returns (args, kwargs) replaces them
    called = []
    inner = closure(o, m, BATCHES[2])

    def swapped():
        called.append(1)
        return inner()

    h = o.register_step_pre_hook(lambda opt, args, kwargs: ((opt, swapped), kwargs))
    o.step(closure(o, m, BATCHES[2], backward=False))   # would be refused if it ran
    h.remove()
    assert called


def test_step_profiler_range():
    """Under torch's profiler a step is the range torch.optim names
    ``Optimizer.step#<class>.step``, as torch's own optimizers' (the step skips the range
    only while no profiler runs); a closure runs in grad mode and a refused step leaves
    grad mode as it was."""
    m = Tiny()
    o = make("IVON", m.parameters(), "cpp")
    o.step(closure(o, m, BATCHES[0]))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        o.step(closure(o, m, BATCHES[1]))            # (no hook registered)
    assert f"Optimizer.step#{type(o).__name__}.step" in [e.name for e in prof.events()]
    seen = []

    def inside():
        seen.append(torch.is_grad_enabled())
        return closure(o, m, BATCHES[2], backward=False)()
    o.register_step_post_hook(lambda opt, a, k: seen.append(torch.is_grad_enabled()))
    with pytest.raises(RuntimeError):
        o.step(inside)                    # (no backward: refused; the closure saw grad mode)
    assert seen == [True] and torch.is_grad_enabled()


def test_step_hooks_as_torchs_wrapper_runs_them():
    """What torch.optim's wrapper does, the step does without it: a post hook registered
    during the step (inside the closure) runs after it, a pre hook so registered waits for
    the next step; a subclass whose own ``step`` calls ``super().step()`` runs each hook
    once; a profiler started without Python's flag (torch's C++ entry points) still sees
    the step's range."""
    m = Tiny()
    o = make("IVON", m.parameters(), "cpp")
    calls = []

    def inside():
        if not calls:
            o.register_step_pre_hook(lambda *a: calls.append("pre"))
            o.register_step_post_hook(lambda *a: calls.append("post"))
            calls.append("registered")
        return closure(o, m, BATCHES[0])()
    o.step(inside)
    assert calls == ["registered", "post"]
    o.step(inside)
    assert calls == ["registered", "post", "pre", "post"]

    class Mine(pk.IVON):
        def step(self, closure=None, **kw):
            return super().step(closure, **kw)
    m2 = Tiny()
    o2 = Mine(m2.parameters(), lr=0.01, ess=100.0, seed=5, backend="cpp")
    seen = []
    o2.register_step_pre_hook(lambda *a: seen.append("pre"))
    o2.register_step_post_hook(lambda *a: seen.append("post"))
    o2.step(closure(o2, m2, BATCHES[0]))
    assert seen == ["pre", "post"]

    from torch._C._profiler import _ExperimentalConfig
    from torch.autograd import (ProfilerActivity, ProfilerConfig, ProfilerState,
                                _disable_profiler, _enable_profiler, _prepare_profiler)
    o3 = make("IVON", m.parameters(), "cpp")
    o3.step(closure(o3, m, BATCHES[1]))
    cfg = ProfilerConfig(ProfilerState.KINETO, False, False, False, False, False,
                         _ExperimentalConfig())
    _prepare_profiler(cfg, {ProfilerActivity.CPU})
    _enable_profiler(cfg, {ProfilerActivity.CPU})
    try:
        o3.step(closure(o3, m, BATCHES[2]))
    finally:
        events = _disable_profiler().events()
    assert any(e.name().startswith("Optimizer.step#IVON.step") for e in events)


@pytest.mark.parametrize("kind,backend", CASES_RT)
def test_state_dict_pre_and_post_hooks(kind, backend):
    """torch's state_dict hooks: the pre hook runs before the dict is built, the post
    hook sees the whole dict (the package's "poco" entry included) and may edit or
    replace it."""
    m = Tiny()
    o = make(kind, m.parameters(), backend)
    seen = {}

    def pre(opt):
        opt.state["test"] = 1

    def post(opt, sd):
        seen["keys"] = set(sd)
        seen["test"] = sd["state"].pop("test", None)
        opt.state.pop("test", None)
        sd["ran_post"] = True
        return sd

    o.register_state_dict_pre_hook(pre)
    o.register_state_dict_post_hook(post)
    sd = o.state_dict()
    assert seen["test"] == 1                       # the pre hook ran first
    assert "poco" in seen["keys"] and {"state", "param_groups"} <= seen["keys"]
    assert sd["ran_post"] is True and "test" not in sd["state"] and "poco" in sd

    o2 = make(kind, Tiny().parameters(), backend)
    o2.register_state_dict_post_hook(lambda opt, sd: {"replaced": True})
    assert o2.state_dict() == {"replaced": True}


@pytest.mark.parametrize("kind,backend", CASES_RT)
def test_load_state_dict_pre_and_post_hooks(kind, backend):
    """torch's load_state_dict hooks: pre hooks run in order (prepend=True first), edit the
    dict in place or return a new one (here: a new lr), post hooks run after the load."""
    m = Tiny()
    o = make(kind, m.parameters(), backend)
    lr = lr_of(kind)
    sd = o.state_dict()
    post_seen = []

    def set_lr_in_place(opt, state_dict):
        state_dict["param_groups"][0]["lr"] = lr / 4

    def return_new(opt, state_dict):
        new = copy.deepcopy(state_dict)
        new["param_groups"][0]["lr"] = lr / 8
        return new

    o.register_load_state_dict_post_hook(
        lambda opt: post_seen.append(opt.param_groups[0]["lr"]))
    h = o.register_load_state_dict_pre_hook(return_new)
    o.load_state_dict(sd)
    assert o.param_groups[0]["lr"] == lr / 8 and post_seen == [lr / 8]
    assert sd["param_groups"][0]["lr"] == lr            # the hook returned a copy
    h.remove()

    o.register_load_state_dict_pre_hook(set_lr_in_place)
    o.load_state_dict(sd)
    assert o.param_groups[0]["lr"] == lr / 4 and post_seen == [lr / 8, lr / 4]
    # prepended, return_new runs first: set_lr_in_place then edits the returned dict
    o.register_load_state_dict_pre_hook(return_new, prepend=True)
    o.load_state_dict(o.state_dict())
    assert o.param_groups[0]["lr"] == lr / 4 and post_seen == [lr / 8, lr / 4, lr / 4]
