"""The engine's sweeps over parameters (``poco_kernels/_sweeps.py``): the C++ functions
(``csrc/sweeps.cpp``) give what their Python twins give, on every kind of input the
engine passes them and on what it must refuse."""
import array

import pytest
import torch

from poco_kernels import _sweeps
from poco_kernels.kernels import cpp_status

needs_cpp = pytest.mark.skipif(cpp_status() is not None, reason="no C++ extension")


def _case(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 40, (1,), generator=g))
    ps = [torch.nn.Parameter(torch.randn(int(torch.randint(1, 5, (1,), generator=g)),
                                         generator=g)) for _ in range(n)]
    views = [torch.zeros_like(p) for p in ps]
    for p, v in zip(ps, views):
        r = int(torch.randint(0, 3, (1,), generator=g))
        p.grad = v if r == 0 else (torch.zeros_like(p) if r == 1 else None)
        if int(torch.randint(0, 4, (1,), generator=g)) == 0:
            p.requires_grad_(False)
        for _ in range(int(torch.randint(0, 3, (1,), generator=g))):
            v.add_(1.0)                      # (version counters that differ)
    return ps, views


@needs_cpp
def test_the_implementation_in_use_is_the_extensions():
    assert _sweeps.IMPLEMENTATION == "cpp"


@needs_cpp
@pytest.mark.parametrize("seed", range(8))
def test_cpp_and_python_sweeps_agree(seed):
    from poco_kernels import _C
    ps, views = _case(seed)
    addrs = [p.data_ptr() for p in ps]
    for seq in (ps, tuple(ps)):
        assert _C.grads(seq, views) == _sweeps.py_grads(seq, views)
        assert _C.grads(seq, None) == _sweeps.py_grads(seq, None)
        assert _C.trainable(seq) == _sweeps.py_trainable(seq)
        now, twin = _C.grads_now(seq), _sweeps.py_grads_now(seq)
        assert [(id(p), id(g), v) for p, g, v in now] == [(id(p), id(g), v) for p, g, v in twin]
        assert [v for _, g, v in now if g is not None] and all(
            g is p.grad for p, g, _ in now)
        assert _C.versions(seq) == _sweeps.py_versions(seq)
        assert _C.same_addresses(seq, addrs) is _sweeps.py_same_addresses(seq, addrs) is True
    assert any(v for _, g, v in _C.grads_now(ps) if g is not None) or not any(
        p.grad is not None and p.grad._version for p in ps)    # (versions, not all 0)
    # a torch function mode sees each `.grad` read and may answer for it: read through
    # Python, as the twin reads
    from torch.overrides import TorchFunctionMode
    marker = torch.zeros(1)

    class Answers(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func == torch.Tensor.grad.__get__:
                return marker
            return func(*args, **(kwargs or {}))
    with Answers():
        now, twin = _C.grads_now(ps), _sweeps.py_grads_now(ps)
    assert [id(g) for _, g, _ in now] == [id(g) for _, g, _ in twin] == [id(marker)] * len(ps)
    moved = list(addrs)
    moved[-1] += 4
    for other in (moved, addrs[:-1], addrs + [0]):
        assert _C.same_addresses(ps, other) is _sweeps.py_same_addresses(ps, other) is False
    assert _C.versions(views) == _sweeps.py_versions(views)
    _same_readable_grads(_C, ps)


@needs_cpp
@pytest.mark.parametrize("seed", range(8))
def test_scan_gives_what_the_separate_sweeps_give(seed):
    """``scan``: the addresses, the ``.grad`` against the views, the views' versions against
    ``clean`` (True, or the versions themselves) in one pass, as the Python twin gives
    them (which reports no hooks)."""
    from poco_kernels import _C
    ps, views = _case(seed)
    addrs = [p.data_ptr() for p in ps]
    clean = _sweeps.py_versions(views)
    moved = list(addrs)
    moved[len(moved) // 2] += 4
    stale = list(clean)
    stale[-1] += 1
    for a in (addrs, moved, addrs[:-1], None, array.array("Q", addrs),
              array.array("Q", moved)):
        for v in (views, None):
            for c in (clean, stale, None, False):
                got = _C.scan(ps, a, v, c, None, 0)
                assert got == _sweeps.py_scan(ps, a, v, c, None, 0)
                assert got[0] is (a is None or list(a) == addrs)
                assert got[1:3] == _sweeps.py_grads(ps, v)
                # (clean False: the versions are not wanted, whatever they are)
                assert got[3] == (False if v is None or c is False
                                  else True if c is clean else clean)
                assert got[4] is False
    with pytest.raises(ValueError):
        _C.scan(ps, None, views[:-1], None, None, 0)
    for scan in (_C.scan, _sweeps.py_scan):
        with pytest.raises(ValueError):
            scan(ps, None, views, clean[:-1], None, 0)
    with pytest.raises(TypeError):
        _C.scan(ps, None, views, None, 5, 0)
    with pytest.raises(TypeError, match="uint64"):
        _C.same_addresses(ps, array.array("d", [0.0] * len(ps)))
    with pytest.raises(TypeError, match="uint64"):
        _C.scan(ps, array.array("i", [0] * len(ps)), None, None, None, 0)
    assert _C.same_addresses(ps, array.array("Q", addrs)) is True


@needs_cpp
def test_scan_sees_the_presence_hooks_that_watch_puts_in():
    """``watched`` is True exactly when ``watch`` would change nothing: every trainable
    leaf has the hook of this owner for this byte array at its index."""
    from poco_kernels import _C
    ps = [torch.nn.Parameter(torch.randn(3)) for _ in range(4)]
    ps[2].requires_grad_(False)              # (skipped by both)
    flags, other = torch.zeros(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)
    assert _C.scan(ps, None, None, None, flags, 7)[4] is False
    _C.watch(ps, flags, 7)
    assert _C.scan(ps, None, None, None, flags, 7)[4] is True
    assert _C.scan(ps, None, None, None, other, 7)[4] is False      # another array
    assert _C.scan(ps, None, None, None, flags, 8)[4] is False      # another owner
    assert _C.scan(ps[1:], None, None, None, flags, 7)[4] is False  # other indices
    assert _C.scan(ps, None, None, None, None, 7)[4] is False
    ps[3].register_post_accumulate_grad_hook(lambda p: None)      # (takes the slot)
    assert _C.scan(ps, None, None, None, flags, 7)[4] is False
    _C.watch(ps, flags, 7)
    assert _C.scan(ps, None, None, None, flags, 7)[4] is True
    ps[3].sum().backward()
    assert flags.tolist() == [0, 0, 0, 1]


def _same_readable_grads(c, ps):
    (ga, ka), (gb, kb) = c.readable_grads(ps), _sweeps.py_readable_grads(ps)
    assert ka == kb and (ga is None) == (gb is None) == (ka is not None)
    if ga is not None:                     # (the gradients listed only when not readable)
        assert list(map(id, ga)) == list(map(id, gb)) == [id(p.grad) for p in ps]
    return ka


@needs_cpp
def test_readable_grads_gives_addresses_only_when_every_gradient_is_readable_in_place():
    from poco_kernels import _C
    ps = [torch.nn.Parameter(torch.randn(3, 2)) for _ in range(3)]
    for p in ps:
        p.grad = torch.randn(3, 2)
    assert _same_readable_grads(_C, ps) == tuple(p.grad.data_ptr() for p in ps)
    ps[1].grad = torch.randn(2, 3).t()                   # strided
    assert _same_readable_grads(_C, ps) is None
    ps[1].grad = torch.randn(3, 2).to_sparse()           # sparse
    assert _same_readable_grads(_C, ps) is None
    ps[1].grad = torch._neg_view(torch.randn(3, 2))       # the negative bit
    assert ps[1].grad.is_neg() and _same_readable_grads(_C, ps) is None
    ps[1].grad = None
    assert _same_readable_grads(_C, ps) is None
    assert _same_readable_grads(_C, []) == ()
    if hasattr(ps[1], "grad_dtype"):                     # another dtype than the parameter's
        ps[1].grad_dtype = torch.float64
        ps[1].grad = torch.randn(3, 2, dtype=torch.float64)
        assert _same_readable_grads(_C, ps) is None
        ps[1].grad = None
        ps[1].grad_dtype = torch.float32
        ps[1].grad = torch.randn(3, 2)
        assert _same_readable_grads(_C, ps) == tuple(p.grad.data_ptr() for p in ps)


@needs_cpp
def test_cpp_sweeps_refuse_what_python_refuses():
    from poco_kernels import _C
    ps, views = _case(0)
    for fn, args in ((_C.grads, ([1.0], None)), (_C.versions, ([ps[0], "x"],)),
                     (_C.trainable, ([None],)), (_C.same_addresses, ([2], [0]))):
        with pytest.raises(TypeError):
            fn(*args)
    with pytest.raises(TypeError):
        _C.versions(5)                       # (not a sequence)
    with pytest.raises(ValueError):
        _C.grads(ps, views[:-1])
    with pytest.raises(ValueError):
        _sweeps.py_grads(ps, views[:-1])


class _Logged(torch.nn.Parameter):
    """A parameter subclass whose ``.grad`` assignments go through Python (counted)."""
    sets = 0

    def __setattr__(self, name, value):
        if name == "grad":
            type(self).sets += 1
        super().__setattr__(name, value)


@needs_cpp
@pytest.mark.parametrize("fn", ["cpp", "python"])
def test_set_grads_sets_what_setattr_sets_and_refuses_what_it_refuses(fn):
    from poco_kernels import _C
    set_grads = _C.set_grads if fn == "cpp" else _sweeps.py_set_grads
    ps = [torch.nn.Parameter(torch.randn(2, 3)), torch.randn(4, requires_grad=True),
          _Logged(torch.randn(3))]
    gs = [torch.randn(2, 3), torch.randn(4), torch.randn(3)]
    before = _Logged.sets
    set_grads(ps, gs)
    assert all(p.grad is g for p, g in zip(ps, gs)) and _Logged.sets == before + 1
    set_grads(ps, None)
    assert all(p.grad is None for p in ps) and _Logged.sets == before + 2
    for bad, err in (([torch.randn(2, 3), torch.randn(4).double(), torch.randn(3)], "dtype"),
                     ([torch.randn(2, 3), torch.randn(5), torch.randn(3)], "size"),
                     ([torch.randn(2, 3), ps[1], torch.randn(3)], "own grad")):
        with pytest.raises(RuntimeError, match=err):
            set_grads(ps, bad)
    with pytest.raises(ValueError):
        set_grads(ps, gs[:2])


def _train(monkeypatch, impl):
    """A few IVON-PoCoMo iterations that take every sweep's branches: views kept and
    replaced, a .grad set to None, a parameter re-pointed (``p.data = ...``), one frozen."""
    if impl == "python":
        for name in ("same_addresses", "versions", "grads", "readable_grads", "set_grads",
                     "trainable", "scan", "grads_now"):
            monkeypatch.setattr(_sweeps, name, getattr(_sweeps, "py_" + name))
    import poco_kernels as pk
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    X, y = torch.randn(32, 5), torch.randn(32, 1)
    opt = pk.IVONPoCoMo(m.parameters(), lr=0.05, ess=100.0, seed=3, alpha=0.5, backend="cpp")

    def closure():
        opt.zero_grad()
        loss = (m(X) - y).pow(2).mean()
        loss.backward()
        return loss
    opt.refresh([closure])
    for i in range(6):
        if i == 1:
            m[0].bias.grad = None
        if i == 2:
            with torch.no_grad():
                m[2].weight.data = m[2].weight.data.clone()
        if i == 3:
            m[0].bias.requires_grad_(False)
        if i == 4:
            with opt.sampled("inner"):
                m.zero_grad(set_to_none=True)           # autograd's own tensors
                (m(X) - y).pow(2).mean().backward()
            with opt.sampled("outer"):
                (m(X) - y).pow(2).mean().backward()
            opt.step()
            continue
        opt.step(closure)
    out = [p.detach().clone() for p in m.parameters()]
    for _, st in sorted(opt.state_dict()["state"].items()):
        out += [v.clone() for _, v in sorted(st.items()) if isinstance(v, torch.Tensor)]
    return out


@needs_cpp
def test_the_engine_takes_the_same_steps_on_either_sweeps(monkeypatch):
    a = _train(monkeypatch, "cpp")
    b = _train(monkeypatch, "python")
    assert len(a) == len(b) > 4
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@needs_cpp
@pytest.mark.parametrize("fn", ["cpp", "python"])
def test_set_grads_follows_grad_dtype_and_modes_and_survives_a_list_emptied(fn):
    from torch.overrides import TorchFunctionMode

    from poco_kernels import _C
    set_grads = _C.set_grads if fn == "cpp" else _sweeps.py_set_grads
    q = torch.nn.Parameter(torch.randn(3, dtype=torch.bfloat16))
    if hasattr(q, "grad_dtype"):                  # (torch versions that have it)
        q.grad_dtype = torch.float32
        with pytest.raises(RuntimeError, match="grad_dtype"):
            set_grads([q], [torch.zeros(3, dtype=torch.bfloat16)])
    seen = []

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))
    p, g = torch.nn.Parameter(torch.randn(3)), torch.randn(3)
    with Mode():
        set_grads([p], [g])
    assert p.grad is g and "__set__" in seen

    class Emptying(torch.nn.Parameter):
        def __setattr__(self, name, value):
            held.clear()                          # (the list given to set_grads)
            super().__setattr__(name, value)
    held = [Emptying(torch.randn(3)), torch.nn.Parameter(torch.randn(3))]
    ps, gs = list(held), [torch.randn(3), torch.randn(3)]
    set_grads(held, gs)
    assert ps[0].grad is gs[0]


@needs_cpp
@pytest.mark.parametrize("fn", ["cpp", "python"])
def test_set_grads_accepts_and_refuses_what_torchs_setter_does(fn):
    """The sweep's own checks (dtype, layout, device, sizes) let through exactly what
    ``p.grad = g`` accepts: another dtype, shape or device is torch's error, a sparse
    gradient of a dense parameter is accepted as torch accepts it."""
    from poco_kernels import _C
    set_grads = _C.set_grads if fn == "cpp" else _sweeps.py_set_grads
    p = torch.nn.Parameter(torch.randn(4, 3))
    for bad in (torch.zeros(4, 3, dtype=torch.float64), torch.zeros(3, 4),
                torch.zeros(4, 3, device="meta")):
        with pytest.raises(RuntimeError):
            set_grads([p], [bad])
        assert p.grad is None
    sparse = torch.zeros(4, 3).to_sparse()
    set_grads([p], [sparse])
    assert p.grad is sparse
    dense = torch.zeros(4, 3)
    set_grads([p], [dense])
    assert p.grad is dense


GC_BOMB = r'''
import gc, sys, torch
from poco_kernels import _C
L = [torch.zeros(1) for _ in range(64)]


class Bomb:                      # a cycle: freed by the collector, whose finalizer empties L
    def __init__(self):
        self.me = self

    def __del__(self):
        L.clear()                                      # (the tensors' last references)
        L.extend(object() for _ in range(10000))       # (L's item array moved)


def armed(call):
    """call() with the collector due at its first allocation of a Python object."""
    Bomb()
    keep = [[] for _ in range(200)]                    # (the free list of lists used up)
    gc.set_threshold(1)
    try:
        return call()
    except TypeError as e:
        return "TypeError"
    finally:
        gc.set_threshold(700)
        L[:] = [torch.zeros(1) for _ in range(64)]


print(len(armed(lambda: _C.versions(L))))
A = [t.data_ptr() for t in L]            # (a list: the sweep makes a tuple of it)
print(armed(lambda: _C.same_addresses(L, A)))
A = [t.data_ptr() for t in L]
print(armed(lambda: _C.scan(L, A, None, False, None, 0)[0]))
'''


@needs_cpp
def test_a_finalizer_run_by_the_collector_inside_a_sweep_frees_nothing_it_reads(tmp_path):
    """The sweeps read their lists in place; a Python object they make (their result, a
    tuple of addresses) may run the collector and so a finalizer that empties the list.
    They make every such object before they read the list (a segfault before: the
    tensors freed under the sweep).  Run in a process of its own."""
    import subprocess
    import sys
    script = tmp_path / "bomb.py"
    script.write_text(GC_BOMB)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    versions, same, scan = r.stdout.split()
    assert versions == "64"                  # (read before the collector ran)
    assert same in ("True", "False", "TypeError") and scan in ("True", "False", "TypeError")
