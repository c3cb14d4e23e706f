"""The conventions every ``torch.optim`` optimizer follows, as PyTorch's own optimizer suite
checks them (``test/test_optim.py``'s generic tests over ``optim_db``, the error inputs of
``torch/testing/_internal/common_optimizers.py``, the lr schedulers of
``torch.optim.lr_scheduler``): one parametrized module over every optimizer of the tests'
optimizer database (tests/optim_db.py, its ``conventions`` configurations) and every
backend that runs on the CPU.

Adapted to the package: IVON-family and VSGD-PoCo steps take a closure (zero grads,
forward, backward, return the loss); VON-PoCo closures return the loss WITHOUT calling
backward; the kinds with an outer loop also refresh.  Design differences that are NOT
checked for torch's behaviour: state is allocated at construction (not lazily), duplicate
parameters are refused (ValueError, torch warns), and a step in which no trainable
parameter received a gradient is an error (torch: a no-op).

The Triton backend runs through its CPU interpreter (slow): it takes the round trips
(state dict, deepcopy, pickle, hooks) and missing gradients, for every fused optimizer
(the other checks are the engine's, which the backends share).  Whole-trajectory resumes at many cut points are
tests/state/test_state_dict.py's; invalid input leaving the optimizer unchanged is
tests/state/test_transactional.py's; the package's own habits (frozen parameters
unfrozen, IVON -> IVON-PoCo(Mo), ...) are tests/conventions/test_habits.py's.
"""
import copy
import io
import pickle
import warnings

import pytest
import torch
from torch.nn import Parameter
from torch.optim import lr_scheduler as LS
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

import poco_kernels as pk
from helpers import available_backends
from optim_db import configs
from tolerances import STATE, TRAJECTORY, assert_close

#: tiny tensors: torch's thread pool only costs here (conftest's fixture)
pytestmark = pytest.mark.usefixtures("one_thread")

# ----------------------------------------------------------------------------- the table
#: the optimizer database's conventions configurations (tests/optim_db.py), by class name.
#: Their lr values are powers of two: a float lr and the same lr as a float32 tensor are
#: then the same number whatever the implementation rounds through.
KINDS = {c.optimizer: c for c in configs("conventions")}
#: the optimizers whose closures call backward (.grad-based)
CLOSURE_KINDS = [k for k, c in KINDS.items() if c.info.grad_closure]

BACKENDS = available_backends()
CPU_BACKENDS = [b for b in BACKENDS if b != "triton"]


def _cases(kinds, backends):
    """``kinds`` on ``backends`` (those of them that their class runs)."""
    return [pytest.param(k, b, id=f"{k}-{b}") for k in kinds for b in backends
            if b in KINDS[k].info.backends]


def _own_cases(backends):
    """Every optimizer on the backends of ``backends`` that its configuration runs."""
    return [pytest.param(k, b, id=f"{k}-{b}") for k, c in KINDS.items()
            for b in c.runs_on() if b in backends]


#: every optimizer on the torch backend and the C++ kernels
CASES = _own_cases(CPU_BACKENDS)
#: ... and the Triton kernels (the round trips and missing gradients)
CASES_RT = CASES + _own_cases(["triton"])
OMIT = object()


def lr_of(kind):
    return KINDS[kind].kwargs["lr"]


def make(kind, params, backend, seed=5, **over):
    """The table's optimizer ``kind``; ``seed=OMIT`` passes no seed."""
    if seed is not OMIT:
        over["seed"] = seed
    return KINDS[kind].make(params, backend, **over)


# ----------------------------------------------------------------------------- the problem
_G = torch.Generator().manual_seed(1234)
X = torch.randn(24, 5, generator=_G)
Y = torch.randn(24, 3, generator=_G)
T = torch.randn(7, generator=_G)
BATCHES = [torch.randint(0, 24, (6,), generator=_G) for _ in range(12)]
CHUNKS = list(torch.arange(24).chunk(2))
FULL = torch.arange(24)


class Tiny(torch.nn.Module):
    """Trainable ``w`` (3, 5) and ``v`` (7,); ``extra`` names more trainable tensors (4,),
    ``frozen`` tensors (4,) with requires_grad=False that the loss also reads."""

    def __init__(self, seed=3, extra=(), frozen=()):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = Parameter(torch.randn(3, 5, generator=g))
        self.v = Parameter(torch.randn(7, generator=g))
        for n in extra:
            setattr(self, n, Parameter(torch.randn(4, generator=g)))
        for n in frozen:
            setattr(self, n, Parameter(torch.randn(4, generator=g), requires_grad=False))
        self.extra, self.frozen = tuple(extra), tuple(frozen)

    def loss(self, idx, skip=()):
        out = ((X[idx] @ self.w.T - Y[idx]) ** 2).mean() + ((self.v - T) ** 2).mean()
        for n in self.extra:
            if n not in skip:
                out = out + ((getattr(self, n) - 0.5) ** 2).mean()
        for n in self.frozen:
            out = out + 0.1 * (getattr(self, n) * self.v[:4]).sum()
        return out


def has_outer(opt):
    return not isinstance(opt, pk.IVON) or isinstance(opt, pk.IVONPoCo)


def closure(opt, model, idx, skip=(), backward=True):
    if isinstance(opt, pk.VONPoCo):
        return lambda: model.loss(idx, skip)

    def c():
        opt.zero_grad()
        loss = model.loss(idx, skip)
        if backward:
            loss.backward()
        return loss
    return c


def refresh(opt, model):
    return opt.refresh([closure(opt, model, c) for c in CHUNKS])


def drive(opt, model, start, stop):
    """Steps ``start..stop-1``; the kinds with an outer loop refresh before every odd step
    (the correction is on from step 1)."""
    losses = []
    for t in range(start, stop):
        if has_outer(opt) and t % 2 == 1:
            refresh(opt, model)
        losses.append(opt.step(closure(opt, model, BATCHES[t])).detach().reshape(()))
    return torch.stack(losses)


def snap(model):
    return [p.detach().clone() for p in model.parameters()]


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def full_loss(model):
    with torch.no_grad():
        return float(model.loss(FULL))


def assert_equal_dicts(a, b, where="state dict"):
    """Equal nested containers, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {set(a) ^ set(b)}"
        for k in a:
            assert_equal_dicts(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal_dicts(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _other_lr(kind):
    return lr_of(kind) / 2


# ============================================================================ construction
def _error_inputs():
    """torch's ``get_error_inputs_for_all_optims`` and the base class's argument checks,
    (description, params(p, q), kwargs, error, regex)."""
    return [
        ("invalid param type", lambda p, q: p, {}, TypeError,
         "params argument given to the optimizer should be an iterable of Tensors or dicts"),
        # torch warns (UserWarning) about duplicates in a group; refused here, by design
        ("duplicate params in a group", lambda p, q: [p, p], {}, ValueError,
         "(?i)duplicate|more than one"),
        ("duplicate params across groups", lambda p, q: [{"params": p}, {"params": p}], {},
         ValueError, "some parameters appear in more than one parameter group"),
        ("tensor lr must be 1-element", lambda p, q: [p], {"lr": torch.tensor([0.01, 0.01])},
         ValueError, "lr"),
        ("params with and without names", lambda p, q: [("weight", p), q], {}, ValueError,
         "all optimizer params should be with/without names"),
        ("groups with and without names",
         lambda p, q: [{"params": [p], "lr": 1e-2}, {"params": [("weight", q)]}], {},
         ValueError, "all optimizer param groups should be with/without names"),
        ("empty parameter list", lambda p, q: [], {}, ValueError, "empty parameter list"),
        ("negative lr", lambda p, q: [p], {"lr": -0.1}, ValueError, "lr"),
        ("non-leaf tensor", lambda p, q: [p * 2], {}, ValueError, "non-leaf"),
        ("not a tensor", lambda p, q: [p, 1.0], {}, TypeError, "can only optimize Tensors"),
        ("a set of params", lambda p, q: [{"params": {p}}], {}, TypeError,
         "ordered collections"),
    ] + [(f"{flag}=", lambda p, q: [p], {flag: value}, TypeError, flag)
         for flag, value in (("maximize", True), ("foreach", False), ("fused", False),
                             ("capturable", False), ("differentiable", False))] + [
        # the package's seed: None or an int in [0, 2**63)
        (f"seed={bad!r}", lambda p, q: [p], {"seed": bad}, ValueError, "seed")
        for bad in (-1, 2 ** 63, True, 1.0)]


TORCH_FLAGS = ["maximize", "foreach", "fused", "capturable", "differentiable"]


@pytest.mark.parametrize("kind,backend", CASES)
@pytest.mark.parametrize("case", _error_inputs(), ids=lambda c: c[0])
@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate")
def test_errors(kind, backend, case):
    desc, params_of, over, error, regex = case
    p, q = Parameter(torch.randn(3, 5)), Parameter(torch.randn(7))
    with pytest.raises(error, match=regex):
        make(kind, params_of(p, q), backend, **over)


@pytest.mark.parametrize("kind,backend", CASES)
@pytest.mark.parametrize("flag", TORCH_FLAGS)
def test_torch_flags_are_refused_in_a_new_group(kind, backend, flag):
    """torch's implementation flags (refused at construction: :func:`test_errors`) are
    refused in a group added later too, and the group is not added."""
    m = Tiny(extra=("u",))
    o = make(kind, [m.w, m.v], backend)
    with pytest.raises(TypeError, match=f"'{flag}'"):
        o.add_param_group({"params": [m.u], flag: False})
    assert len(o.param_groups) == 1


@pytest.mark.parametrize("kind,backend", CASES)
def test_optimizer_can_be_printed(kind, backend):
    m = Tiny()
    o = make(kind, [{"params": [m.w]}, {"params": [m.v], "lr": _other_lr(kind)}], backend)
    text = repr(o)
    assert text.startswith(type(o).__name__)
    assert "Parameter Group 0" in text and "Parameter Group 1" in text
    assert f"lr: {_other_lr(kind)}" in text


# ============================================================================ state dict
@pytest.mark.parametrize("kind,backend", CASES_RT)
def test_state_dict_deterministic(kind, backend):
    """A state dict saved with torch.save and read back with weights_only=True (torch's
    default) loads into an optimizer over equal but not identical parameters, which then
    runs step for step with the original; loading does not modify the dict; both
    optimizers' state dicts are then equal."""
    m1 = Tiny()
    o1 = make(kind, m1.parameters(), backend)
    drive(o1, m1, 0, 2)
    sd = o1.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert_equal_dicts(loaded, sd)
    kept = copy.deepcopy(loaded)

    m2 = Tiny(seed=7)
    with torch.no_grad():
        for a, b in zip(m2.parameters(), m1.parameters()):
            a.copy_(b)
    o2 = make(kind, m2.parameters(), backend, seed=99)
    o2.load_state_dict(loaded)
    assert_equal_dicts(loaded, kept, "the loaded dict")          # not modified by loading

    for t in range(2, 4):
        l1, l2 = drive(o1, m1, t, t + 1), drive(o2, m2, t, t + 1)
        assert torch.equal(l1, l2), t
        assert same(snap(m1), snap(m2)), t
    assert_equal_dicts(o1.state_dict(), o2.state_dict())


@pytest.mark.parametrize("kind,backend", CASES_RT)
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copy_continues_bit_identically(kind, backend, how):
    """``copy.deepcopy((model, opt))`` and a pickle round trip give an optimizer over the
    copied parameters (with every public attribute of the original) that continues
    exactly as the original, independently of it."""
    m1 = Tiny()
    o1 = make(kind, m1.parameters(), backend)
    drive(o1, m1, 0, 2)
    if how == "deepcopy":
        m2, o2 = copy.deepcopy((m1, o1))
    else:
        m2, o2 = pickle.loads(pickle.dumps((m1, o1)))
    public = lambda o: {k for k in o.__dict__ if not k.startswith("_")}  # noqa: E731
    assert public(o2) == public(o1)
    assert type(o2) is type(o1)
    assert [id(p) for g in o2.param_groups for p in g["params"]] == \
        [id(p) for p in m2.parameters()]
    before = snap(m1)
    l2 = drive(o2, m2, 2, 3)                  # the copy alone: the original is untouched
    assert same(snap(m1), before)
    l1 = drive(o1, m1, 2, 3)
    assert torch.equal(l1, l2) and same(snap(m1), snap(m2))
    assert not same(snap(m1), before)
    l1, l2 = drive(o1, m1, 3, 4), drive(o2, m2, 3, 4)
    assert torch.equal(l1, l2) and same(snap(m1), snap(m2))


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


# ============================================================================ gradients
@pytest.mark.parametrize("kind,backend", CASES)
def test_step_is_noop_when_params_have_no_grad(kind, backend):
    """torch's test: no parameter requires grad; a step is a no-op (and they have no
    state)."""
    params = [torch.randn(2, 3), torch.randn(5)]
    old = [p.clone() for p in params]
    o = make(kind, params, backend)
    o.step(lambda: torch.tensor([1.0]))
    assert same(params, old)
    assert all(len(o.state.get(p, {})) == 0 for p in params)


@pytest.mark.parametrize("kind,backend", CASES)
def test_frozen_params_are_never_sampled_updated_or_stateful(kind, backend):
    m = Tiny(frozen=("f",))
    f0 = m.f.detach().clone()
    o = make(kind, m.parameters(), backend)
    inside = []
    orig_loss = m.loss

    def recording_loss(idx, skip=()):
        inside.append(m.f.detach().clone())
        return orig_loss(idx, skip)

    m.loss = recording_loss
    start = snap(m)
    drive(o, m, 0, 4)
    assert len(inside) >= 4 and all(torch.equal(x, f0) for x in inside)
    assert torch.equal(m.f, f0)
    assert not torch.equal(m.w, start[0]) and not torch.equal(m.v, start[1])
    assert len(o.state.get(m.f, {})) == 0
    sd = o.state_dict()
    f_index = [n for n, _ in m.named_parameters()].index("f")
    assert not sd["state"].get(f_index) and {0, 1} <= set(sd["state"])
    m.loss = orig_loss
    m2 = Tiny(frozen=("f",))
    o2 = make(kind, m2.parameters(), backend, seed=1)
    m2.load_state_dict(m.state_dict())
    o2.load_state_dict(sd)
    l1, l2 = drive(o, m, 4, 5), drive(o2, m2, 4, 5)
    assert torch.equal(l1, l2) and same(snap(m), snap(m2))


#: the .grad family on the torch backend and the C++ kernels, and the Triton kernels where
#: the configuration runs them
CLOSURE_CASES = [c for c in CASES_RT if c.values[0] in CLOSURE_KINDS]


@pytest.mark.parametrize("kind,backend", CLOSURE_CASES)
def test_step_without_any_gradient_is_an_error(kind, backend):
    """A closure that forgets backward (trainable parameters, no gradient at all) is an
    error naming backward, in a step or a refresh, before and after the correction is on,
    and changes nothing: the run goes on bit for bit as a twin's that never made the call.
    A documented difference from torch, where it is a no-op."""
    m, m_twin = Tiny(), Tiny()
    o, twin = make(kind, m.parameters(), backend), make(kind, m_twin.parameters(), backend)
    for t in range(3):
        if t >= 1 and has_outer(o):
            if t == 2:
                with pytest.raises(RuntimeError, match="backward"):
                    o.refresh([closure(o, m, c, backward=False) for c in CHUNKS])
            refresh(o, m)
            refresh(twin, m_twin)
        before = snap(m)
        with pytest.raises(RuntimeError, match="backward"):
            o.step(closure(o, m, BATCHES[t], backward=False))
        assert same(snap(m), before)
        l1 = o.step(closure(o, m, BATCHES[t]))          # the next proper step works
        l2 = twin.step(closure(twin, m_twin, BATCHES[t]))
        assert not same(snap(m), before)
        assert torch.equal(l1, l2) and same(snap(m), snap(m_twin)), t
    assert o.step_count == twin.step_count == 3
    if not KINDS[kind].info.noisy:                      # torch style: zero_grad(); step()
        m2 = Tiny()
        o2 = make(kind, m2.parameters(), backend)
        o2.zero_grad()
        with pytest.raises(RuntimeError, match="backward"):
            o2.step()


def _skipped_param_run(kind, backend):
    m = Tiny(extra=("u",))
    # weight decay: a skipped parameter must not decay; noisy ones draw two samples, the
    # gradient None at both
    over = dict(weight_decay=0.1, **(dict(mc_samples=2) if KINDS[kind].info.noisy else {}))
    o = make(kind, m.parameters(), backend, **over)
    o.step(closure(o, m, BATCHES[0]))
    if has_outer(o):
        refresh(o, m)
    u0 = m.u.detach().clone()
    state0 = {k: v.clone() for k, v in o.state[m.u].items()}
    others = snap(m)[:2]
    o.step(closure(o, m, BATCHES[1], skip=("u",)))
    assert torch.equal(m.u, u0)
    assert set(o.state[m.u]) == set(state0)
    for k, v in state0.items():
        assert torch.equal(o.state[m.u][k], v), k
    assert not same(snap(m)[:2], others)
    o.step(closure(o, m, BATCHES[2]))
    assert not torch.equal(m.u, u0)
    return snap(m)


@pytest.mark.parametrize("kind,backend", CLOSURE_CASES + _cases(
    ["SVRGAdamW"], [b for b in BACKENDS if b == "triton"]))
def test_param_without_grad_is_skipped_by_that_step(kind, backend):
    """A parameter whose .grad is None at every sample of a step keeps its value and its
    state through that step (weight decay and momentum included), as torch.optim skips
    it; it moves again once it has a gradient; a fused backend's run is the torch
    backend's (the others follow the reference maths)."""
    out = _skipped_param_run(kind, backend)
    if backend != "torch":
        for a, b in zip(_skipped_param_run(kind, "torch"), out):
            assert_close(b, a, TRAJECTORY[torch.float32], "trajectory")


@pytest.mark.parametrize("kind,backend", CASES)
def test_zero_grad(kind, backend):
    m = Tiny()
    o = make(kind, m.parameters(), backend)
    grads = []
    for p in m.parameters():
        p.grad = torch.ones_like(p)
        grads.append(p.grad)
    o.zero_grad(set_to_none=False)
    for p, g in zip(m.parameters(), grads):
        assert p.grad is g and not p.grad.any()
    o.zero_grad()
    assert all(p.grad is None for p in m.parameters())


# ============================================================================ groups
@pytest.mark.parametrize("kind,backend", CASES)
def test_param_groups_lr_and_add_param_group(kind, backend):
    """torch's test_param_groups_lr (a group with lr 0 does not move) and add_param_group
    (defaults filled in, the new group steps, a parameter already there is refused)."""
    m = Tiny(extra=("u", "z"))
    o = make(kind, [{"params": [m.w, m.v]}, {"params": [m.u], "lr": 0.0}], backend)
    assert set(o.param_groups[1]) == set(o.param_groups[0])
    start = snap(m)
    drive(o, m, 0, 2)
    assert torch.equal(m.u, start[2])
    assert not torch.equal(m.w, start[0]) and not torch.equal(m.v, start[1])
    assert torch.equal(m.z, start[3])                 # in no group yet

    with pytest.raises(ValueError, match="more than one parameter group"):
        o.add_param_group({"params": [m.w]})
    o.add_param_group({"params": [m.z]})
    assert set(o.param_groups[2]) == set(o.param_groups[0])
    assert o.param_groups[2]["lr"] == lr_of(kind)
    drive(o, m, 2, 4)
    assert not torch.equal(m.z, start[3])
    assert torch.equal(m.u, start[2])


@pytest.mark.parametrize("kind,backend", CASES)
def test_two_optimizers_over_the_same_params(kind, backend):
    """IVON steps, a second optimizer over the same parameters steps, IVON steps again: the
    parameters are the source of truth (an optimizer with lr 0 leaves them as the other
    left them)."""
    m = Tiny()
    o1 = make("IVON", m.parameters(), backend)
    o1.step(closure(o1, m, BATCHES[0]))
    o2 = make(kind, m.parameters(), backend, seed=6)
    o2.step(closure(o2, m, BATCHES[1]))
    after2 = snap(m)
    o1.param_groups[0]["lr"] = 0.0
    o1.step(closure(o1, m, BATCHES[2]))
    assert same(snap(m), after2)
    o1.param_groups[0]["lr"] = lr_of("IVON")
    o1.step(closure(o1, m, BATCHES[3]))
    after1 = snap(m)
    assert not same(after1, after2) and all(torch.isfinite(p).all() for p in after1)
    o2.param_groups[0]["lr"] = 0.0
    o2.step(closure(o2, m, BATCHES[4]))
    assert same(snap(m), after1)


# ============================================================================ lr
@pytest.mark.parametrize("kind,backend", CASES)
@pytest.mark.parametrize("num_dim", [0, 1, 2])
def test_tensor_lr(kind, backend, num_dim):
    """lr as a one-element tensor of 0, 1 or 2 dimensions: the float lr's trajectory."""
    lr = lr_of(kind)
    m1, m2 = Tiny(), Tiny()
    o1 = make(kind, m1.parameters(), backend)
    o2 = make(kind, m2.parameters(), backend, lr=torch.tensor(lr).reshape([1] * num_dim))
    for t in range(3):
        drive(o1, m1, t, t + 1)
        drive(o2, m2, t, t + 1)
        for a, b in zip(snap(m1), snap(m2)):
            assert_close(b, a, STATE[torch.float32], f"step {t}")


@pytest.mark.parametrize("kind,backend", CASES_RT + _cases(
    ["SVRGAdamW"], [b for b in BACKENDS if b == "triton"]))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_tensor_lr_takes_the_float_lrs_steps_bit_for_bit(kind, backend, dtype):
    """A tensor lr that holds the float lr's value takes the float lr's steps bit for bit
    (5 steps, refreshes between them): nothing derived from lr (AdamW's weight-decay
    factor and bias-corrected step size, IVON's rescaled lr) is computed otherwise, or
    kept, for a tensor.  float64: a value float32 cannot hold (0.8 lr); float32: the
    table's power of two.  (``torch.tensor(0.01)`` is float32: it holds another number
    than the float 0.01, and AdamW's lr-dependent factors can then round apart in the
    last place, as docs/design.md says.)"""
    lr = lr_of(kind) * (0.8 if dtype == torch.float64 else 1.0)
    m1, m2 = Tiny(), Tiny()
    o1 = make(kind, m1.parameters(), backend, lr=lr)
    o2 = make(kind, m2.parameters(), backend, lr=torch.tensor(lr, dtype=dtype))
    for t in range(5):
        drive(o1, m1, t, t + 1)
        drive(o2, m2, t, t + 1)
        assert same(snap(m1), snap(m2)), f"step {t}"


@pytest.mark.parametrize("kind,backend", CASES)
@pytest.mark.parametrize("sched", ["StepLR", "ReduceLROnPlateau"])
def test_param_group_with_lrscheduler_goes_right_direction(kind, backend, sched):
    m = Tiny()
    o = make(kind, [{"params": [m.w]}, {"params": [m.v], "lr": _other_lr(kind)}], backend)
    s = (LS.StepLR(o, step_size=3, gamma=0.9) if sched == "StepLR"
         else LS.ReduceLROnPlateau(o))
    initial = full_loss(m)
    for t in range(8):
        loss = drive(o, m, t, t + 1)[0]
        if sched == "ReduceLROnPlateau":
            s.step(loss)
        else:
            s.step()
    assert full_loss(m) < initial


SCHEDULERS = {
    "LambdaLR": lambda o: LS.LambdaLR(o, lambda e: 0.5 ** e),
    "MultiplicativeLR": lambda o: LS.MultiplicativeLR(o, lambda e: 0.5),
    "StepLR": lambda o: LS.StepLR(o, step_size=2, gamma=0.5),
    "MultiStepLR": lambda o: LS.MultiStepLR(o, milestones=[1, 3], gamma=0.5),
    "ConstantLR": lambda o: LS.ConstantLR(o, factor=0.5, total_iters=2),
    "LinearLR": lambda o: LS.LinearLR(o, start_factor=0.25, total_iters=3),
    "ExponentialLR": lambda o: LS.ExponentialLR(o, gamma=0.5),
    "PolynomialLR": lambda o: LS.PolynomialLR(o, total_iters=4, power=2.0),
    "CosineAnnealingLR": lambda o: LS.CosineAnnealingLR(o, T_max=3),
    "CosineAnnealingWarmRestarts": lambda o: LS.CosineAnnealingWarmRestarts(o, T_0=2),
    "CyclicLR": lambda o, **kw: LS.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=2, **kw),
    "OneCycleLR": lambda o, **kw: LS.OneCycleLR(o, max_lr=0.1, total_steps=8, **kw),
    "ReduceLROnPlateau": lambda o: LS.ReduceLROnPlateau(o, factor=0.5, patience=0),
    "SequentialLR": lambda o: LS.SequentialLR(
        o, [LS.ConstantLR(o, factor=0.5, total_iters=2), LS.ExponentialLR(o, gamma=0.5)],
        milestones=[2]),
    "ChainedScheduler": lambda o: LS.ChainedScheduler(
        [LS.ConstantLR(o, factor=0.5, total_iters=2), LS.ExponentialLR(o, gamma=0.5)]),
}
CYCLING = ("CyclicLR", "OneCycleLR")


def _momentum(kind, group):
    name = KINDS[kind].info.momentum_key
    return group["betas"][0] if name == "betas" else group[name]


@pytest.mark.parametrize("kind,backend", CASES)
@pytest.mark.parametrize("sched", list(SCHEDULERS))
def test_every_lr_scheduler(kind, backend, sched):
    """Every scheduler of torch.optim.lr_scheduler drives the lr (and, CyclicLR and
    OneCycleLR, the momentum: IVON's beta1, SGD's momentum, AdamW's beta1) exactly as on
    torch's SGD / AdamW, between steps, without warnings; VON-PoCo has no momentum to
    cycle (torch's ValueError)."""
    m = Tiny()
    o = make(kind, m.parameters(), backend)
    dummy = Parameter(torch.zeros(1))
    lr = lr_of(kind)
    momentum = KINDS[kind].info.momentum_key
    ref = (torch.optim.AdamW([dummy], lr=lr) if momentum in ("betas", "beta1")
           else torch.optim.SGD([dummy], lr=lr, momentum=0.9))
    factory = SCHEDULERS[sched]
    if sched in CYCLING and momentum is None:
        with pytest.raises(ValueError, match="momentum"):
            factory(o)
        factory = lambda opt, f=factory: f(opt, cycle_momentum=False)  # noqa: E731
    s, s_ref = factory(o), factory(ref)
    cycles = sched in CYCLING and momentum is not None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(4):
            loss = drive(o, m, t, t + 1)[0]
            dummy.grad = torch.zeros_like(dummy)
            ref.step()
            if sched == "ReduceLROnPlateau":
                s.step(1.0)
                s_ref.step(1.0)
            else:
                s.step()
                s_ref.step()
            assert o.param_groups[0]["lr"] == ref.param_groups[0]["lr"], t
            if cycles:
                ref_m = (ref.param_groups[0]["betas"][0] if isinstance(ref, torch.optim.AdamW)
                         else ref.param_groups[0]["momentum"])
                assert _momentum(kind, o.param_groups[0]) == ref_m, t
            assert torch.isfinite(loss)
    assert not [w for w in caught if "lr_scheduler" in str(w.message)]
    assert all(torch.isfinite(p).all() for p in m.parameters())


@pytest.mark.parametrize("kind,backend", CASES)
def test_scheduled_lr_reaches_the_update(kind, backend):
    """The lr a scheduler writes is the one the next step uses (lr 0: nothing moves)."""
    m = Tiny()
    o = make(kind, m.parameters(), backend)
    s = LS.LambdaLR(o, lambda e: 0.0 if e >= 1 else 1.0)
    before = snap(m)
    drive(o, m, 0, 1)
    s.step()
    assert o.param_groups[0]["lr"] == 0.0 and not same(snap(m), before)
    before = snap(m)
    drive(o, m, 1, 3)
    assert same(snap(m), before)


#: the IVON family (beta1, beta2)
IVON_FAMILY = [k for k, c in KINDS.items() if c.info.momentum_key == "beta1"]


@pytest.mark.parametrize("kind,backend", _cases(IVON_FAMILY, CPU_BACKENDS))
def test_ivon_groups_answer_betas(kind, backend):
    """IVON groups read and write ``betas`` as ``(beta1, beta2)`` (what torch's
    schedulers cycle); it is not a key of its own: not in keys() nor the state dict."""
    m1, m2 = Tiny(), Tiny()
    o1 = make(kind, m1.parameters(), backend)
    g = o1.param_groups[0]
    assert g["betas"] == (g["beta1"], g["beta2"])
    g["betas"] = (0.5, 0.999)
    assert (g["beta1"], g["beta2"]) == (0.5, 0.999) and g["betas"] == (0.5, 0.999)
    assert "betas" not in list(g.keys())
    assert "betas" in g and "betas" in o1.defaults
    assert "betas" not in o1.state_dict()["param_groups"][0]
    with pytest.raises(ValueError, match="beta1, beta2"):
        g["betas"] = 0.5
    o2 = make(kind, m2.parameters(), backend, beta1=0.5, beta2=0.999)
    l1, l2 = drive(o1, m1, 0, 3), drive(o2, m2, 0, 3)
    assert torch.equal(l1, l2) and same(snap(m1), snap(m2))
    # a group given betas; dict updates go through the alias too
    o3 = make(kind, [{"params": [Parameter(torch.randn(3))], "betas": (0.5, 0.9)}], backend)
    g = o3.param_groups[0]
    assert (g["beta1"], g["beta2"]) == (0.5, 0.9)
    g.update({"betas": (0.5, 0.6)})
    assert (g["beta1"], g["beta2"]) == (0.5, 0.6) and "betas" not in g.keys()
    assert g.setdefault("betas", (0.1, 0.2)) == (0.5, 0.6)
    g |= {"betas": (0.7, 0.8)}
    assert g["beta1"] == 0.7


# ============================================================================ seed
@pytest.mark.parametrize("kind,backend", CASES)
def test_seed_defaults_to_torch_global_generator(kind, backend):
    """seed=None (the default) is drawn from torch's global generator at construction:
    torch.manual_seed reproduces a run, another global seed changes the noise of the
    noisy optimizers; an explicit seed wins; a state dict carries the seed."""
    def run(global_seed, stop=3, **over):
        m = Tiny()
        torch.manual_seed(global_seed)
        o = make(kind, m.parameters(), backend, **over)
        drive(o, m, 0, stop)
        return m, o

    a = snap(run(1, seed=OMIT)[0])
    assert same(a, snap(run(1, seed=OMIT)[0]))
    assert same(a, snap(run(1, seed=None)[0]))
    other = snap(run(2, seed=OMIT)[0])
    assert same(a, other) == (not KINDS[kind].info.noisy)
    assert same(snap(run(1, seed=7)[0]), snap(run(2, seed=7)[0]))

    m1, o1 = run(1, stop=2, seed=OMIT)
    sd = o1.state_dict()
    assert isinstance(sd["poco"]["seed"], int)
    m2 = Tiny()
    torch.manual_seed(2)
    o2 = make(kind, m2.parameters(), backend, seed=OMIT)
    m2.load_state_dict(m1.state_dict())
    o2.load_state_dict(sd)
    l1, l2 = drive(o1, m1, 2, 4), drive(o2, m2, 2, 4)
    assert torch.equal(l1, l2) and same(snap(m1), snap(m2))


# ============================================================================ refresh
@pytest.mark.parametrize("kind,backend", _cases(
    [k for k, c in KINDS.items() if c.info.has_refresh], CPU_BACKENDS))
def test_refresh_takes_one_closure_or_an_iterable(kind, backend):
    """refresh(closure) is refresh([closure]); a generator of closures is its list."""
    runs = []
    for arg in ("one", "list1", "generator", "list2"):
        m = Tiny()
        o = make(kind, m.parameters(), backend)
        o.step(closure(o, m, BATCHES[0]))
        full = closure(o, m, FULL)
        chunks = [closure(o, m, c) for c in CHUNKS]
        o.refresh({"one": full, "list1": [full], "generator": (c for c in chunks),
                   "list2": chunks}[arg])
        o.step(closure(o, m, BATCHES[1]))
        runs.append(snap(m))
    assert same(runs[0], runs[1]) and same(runs[2], runs[3])
    with pytest.raises(TypeError, match="closure"):
        o.refresh(3)
    with pytest.raises(TypeError, match="callable"):
        o.refresh([full, 3])
