"""torch.optim's argument conventions for every optimizer (the table:
tests/conventions/torch_conventions.py): torch's error inputs and the base class's argument
checks at construction (duplicate parameters refused: ValueError, where torch warns), torch's
implementation flags refused in a group added later too, the printed optimizer, the seed
(default drawn from torch's global generator) and ``refresh``'s closure arguments.  Invalid
input leaving the optimizer unchanged is tests/state/test_transactional.py's (a refused
constructor: tests/state/test_invalid_hyperparameters.py's).
"""
import pytest
import torch
from torch.nn import Parameter

from torch_conventions import (BATCHES, CASES, CHUNKS, CPU_BACKENDS, FULL, KINDS, OMIT, Tiny,
                               _cases, _other_lr, closure, drive, make, same, snap)

#: tiny tensors: torch's thread pool only costs here (conftest's fixture)
pytestmark = pytest.mark.usefixtures("one_thread")


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
        ("an expanded parameter", lambda p, q: [p, Parameter(torch.randn(5).expand(3, 5))],
         {}, ValueError, "expanded view"),
        ("parameters tied by storage", lambda p, q: [p, _tied(p)], {}, ValueError,
         "share memory"),
    ] + [(f"{flag}=", lambda p, q: [p], {flag: value}, TypeError, flag)
         for flag, value in (("maximize", True), ("foreach", False), ("fused", False),
                             ("capturable", False), ("differentiable", False))] + [
        # the package's seed: None or an int in [0, 2**63)
        (f"seed={bad!r}", lambda p, q: [p], {"seed": bad}, ValueError, "seed")
        for bad in (-1, 2 ** 63, True, 1.0)]


def _tied(p):
    """Another parameter over ``p``'s memory (``dec.weight.data = enc.weight.data``)."""
    q = Parameter(torch.empty(0))
    q.data = p.data
    return q


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
@pytest.mark.parametrize("flag", ["maximize", "differentiable"])
@pytest.mark.parametrize("where", ["live group", "loaded state dict"])
def test_a_flag_that_changes_the_update_is_refused_later_too(kind, backend, flag, where):
    """``maximize=True`` or ``differentiable=True`` put into a live group, or found in a
    loaded state dict, is refused (TypeError) by the next step or by the load, with nothing
    changed, not ignored; torch's own values of its flags (a torch.optim state dict's,
    ``maximize=False``) are kept."""
    m = Tiny()
    o = make(kind, m.parameters(), backend)
    drive(o, m, 0, 1)
    before, sd = snap(m), o.state_dict()
    if where == "live group":
        o.param_groups[0][flag] = False
        drive(o, m, 1, 2)                     # (torch's default value: kept)
        before, sd = snap(m), o.state_dict()
        o.param_groups[0][flag] = True
        with pytest.raises(TypeError, match=f"'{flag}'"):
            drive(o, m, 2, 3)
    else:
        sd["param_groups"][0][flag] = True
        with pytest.raises(TypeError, match=f"'{flag}'"):
            o.load_state_dict(sd)
        assert o.param_groups[0].get(flag) is None
    assert same(snap(m), before)


@pytest.mark.parametrize("kind,backend", CASES)
def test_optimizer_can_be_printed(kind, backend):
    m = Tiny()
    o = make(kind, [{"params": [m.w]}, {"params": [m.v], "lr": _other_lr(kind)}], backend)
    text = repr(o)
    assert text.startswith(type(o).__name__)
    assert "Parameter Group 0" in text and "Parameter Group 1" in text
    assert f"lr: {_other_lr(kind)}" in text


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
