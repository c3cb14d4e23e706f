"""Which handed-out ``.grad`` views a backward reached (``backends/fused_presence.py``): a
hook per parameter sets its byte, in C++ with the extension and in Python without it,
beside the user's own post-accumulate-grad hooks; a view it marks counts as a gradient
even when it holds zeros, as autograd's own tensor would."""
import pytest
import torch

import poco_kernels as pk
from helpers import FUSED_BACKENDS
from poco_kernels.backends import fused_presence
from poco_kernels.backends.fused_presence import Presence, Watcher
from poco_kernels.kernels import cpp_status

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not FUSED_BACKENDS, reason="no fused backend here")]

HOOKS = ["cpp", "python"] if cpp_status() is None else ["python"]


@pytest.fixture(params=HOOKS)
def hooks(request, monkeypatch):
    """The C++ hooks, or the Python ones the package falls back to without the extension."""
    if request.param == "python":
        monkeypatch.setattr(fused_presence, "_cpp_watch", lambda: None)
    return request.param


def _params(n):
    return [torch.nn.Parameter(torch.randn(3)) for _ in range(n)]


def _backward(ps):
    sum(p.sum() for p in ps).backward()


def test_the_bytes_name_the_parameters_a_backward_reached(hooks):
    ps = _params(4)
    w = Watcher()
    assert (w._op is not None) == (hooks == "cpp")
    pr = Presence(4)
    w.watch(ps, pr)
    assert list(pr.mem) == [0, 0, 0, 0] and not pr.all()
    _backward([ps[1], ps[3]])
    assert list(pr.mem) == [0, 1, 0, 1] and not pr.all()
    _backward(ps)
    assert pr.all()
    pr.clear()
    assert list(pr.mem) == [0, 0, 0, 0]
    # a new layout of the same owner: the hooks follow (not stacked on the old ones)
    new = Presence(3)
    w.watch([ps[3], ps[2], ps[0]], new)
    _backward([ps[0], ps[1]])
    assert list(new.mem) == [0, 0, 1]
    # (one left out of the new layout marks the old bytes, which go with the old buckets)
    assert list(pr.mem) == [0, 1, 0, 0]


def test_owners_keep_their_own_bytes_and_the_users_hooks_still_run(hooks):
    ps = _params(2)
    ran = []
    ps[0].register_post_accumulate_grad_hook(lambda p: ran.append(0))    # before ours
    a, b = Watcher(), Watcher()
    pa, pb = Presence(2), Presence(2)
    a.watch(ps, pa)
    b.watch(ps[::-1], pb)
    ps[1].register_post_accumulate_grad_hook(lambda p: ran.append(1))    # after ours
    _backward(ps[:1])
    assert ran == [0] and list(pa.mem) == [1, 0] and list(pb.mem) == [0, 1]
    _backward(ps[1:])
    # (torch's first Python hook on a tensor takes the slot's object: the C++ hooks miss
    # that one backward, until the next watch puts them back around it)
    missed = 0 if hooks == "cpp" else 1
    assert ran == [0, 1] and pa.mem[1] == pb.mem[0] == missed
    a.watch(ps, pa)                  # (a hook a new Python one displaced is put back)
    b.watch(ps[::-1], pb)
    pa.clear()
    pb.clear()
    _backward(ps)
    assert sorted(ran) == [0, 0, 1, 1] and pa.all() and pb.all()
    # an owner gone: its hooks do nothing, and a new owner re-uses them
    del a, pa
    c, pc = Watcher(), Presence(2)
    c.watch(ps, pc)
    _backward(ps)
    assert pc.all() and pb.all()


class _ThreeHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(4, 2)
        self.zero = torch.nn.Linear(4, 2)       # reached, with a gradient of zeros
        self.unused = torch.nn.Linear(4, 2)     # never reached

    def forward(self, x):
        return self.used(x).pow(2).mean() + 0.0 * self.zero(x).sum()


def _tensors(opt, model):
    out = [p.detach().clone() for p in model.parameters()]
    for _, st in sorted(opt.state_dict()["state"].items()):
        out += [v.clone() for _, v in sorted(st.items()) if isinstance(v, torch.Tensor)]
    return out


def _run_three_heads(gv, between=None, inside=None, steps=3, backward=None):
    """IVON's ``step(closure)`` on _ThreeHeads, with views or not (``gv``);
    ``between(m, i)`` runs before iteration i, ``inside(m, i)`` inside its closure before
    the backward, ``backward(loss)`` in place of ``loss.backward()``."""
    torch.manual_seed(0)
    X = torch.randn(16, 4)
    m = _ThreeHeads()
    opt = pk.IVON(m.parameters(), lr=0.1, ess=100.0, seed=1, backend="cpp", grad_views=gv)
    for i in range(steps):
        if between is not None:
            between(m, i)

        def closure():
            opt.zero_grad()
            if inside is not None:
                inside(m, i)
            loss = m(X)
            if backward is None:
                loss.backward()
            else:
                backward(loss)
            return loss
        opt.step(closure)
    return _tensors(opt, m)


def _same(a, b):
    assert len(a) == len(b) > 6
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.skipif("cpp" not in FUSED_BACKENDS, reason="no C++ backend")
def test_a_zero_gradient_autograd_reached_is_a_gradient_without_views_too(hooks):
    """The steps with views equal those without, bit for bit: the zero gradient is
    accumulated (it moves the zero head through the Hessian estimate), the unreached
    head is left out; also after the buckets are laid out again (a parameter frozen)."""
    def freeze(m, i):
        if i == 2:
            m.used.bias.requires_grad_(False)
    with_views = _run_three_heads(True, between=freeze)
    _same(_run_three_heads(False, between=freeze), with_views)
    torch.manual_seed(0)
    torch.randn(16, 4)
    start = [p.detach() for p in _ThreeHeads().parameters()]
    moved = [not torch.equal(a, b) for a, b in zip(start, with_views)]
    assert moved[2:6] == [True, True, False, False]     # (zero head, unreached head)


@pytest.mark.skipif("cpp" not in FUSED_BACKENDS, reason="no C++ backend")
def test_a_parameter_frozen_inside_the_closure_is_left_out_as_without_views(hooks):
    def freeze(m, i):
        if i == 1:
            m.used.bias.requires_grad_(False)
    _same(_run_three_heads(False, inside=freeze), _run_three_heads(True, inside=freeze))


@pytest.mark.skipif("cpp" not in FUSED_BACKENDS, reason="no C++ backend")
def test_a_user_hook_registered_between_steps_leaves_zero_gradients_counted(hooks):
    """A first Python post-accumulate-grad hook on the zero-gradient head, registered
    between iterations, takes the C++ hook's slot; the next hand-out puts it back around
    it: the steps equal those without views, and the user's hook runs every backward."""
    ran = []

    def register(m, i):
        if i == 1:
            for p in m.zero.parameters():
                p.register_post_accumulate_grad_hook(lambda p: ran.append(1))
    _same(_run_three_heads(False, between=register), _run_three_heads(True, between=register))
    assert len(ran) == 2 * 2 * 2          # (two runs, two parameters, two iterations)


@pytest.mark.long
@pytest.mark.skipif("cpp" not in FUSED_BACKENDS, reason="no C++ backend")
def test_under_compiled_autograd_zero_gradients_count_as_without_views():
    """With ``torch._dynamo.config.compiled_autograd`` set, the engine's hooks are Python
    ones, which compiled autograd runs."""
    import torch._dynamo
    from torch._dynamo import compiled_autograd
    torch._dynamo.reset()

    def backward(loss):
        with compiled_autograd._enable(torch.compile(backend="eager")):
            loss.backward()
    with torch._dynamo.config.patch(compiled_autograd=True):
        runs = [_run_three_heads(gv, steps=2, backward=backward) for gv in (False, True)]
    _same(*runs)


@pytest.mark.skipif(cpp_status() is not None, reason="no C++ extension")
def test_the_python_hooks_of_compiled_autograd_go_once_it_is_off():
    import torch._dynamo
    ps = _params(2)
    w, pr = Watcher(), Presence(2)
    with torch._dynamo.config.patch(compiled_autograd=True):
        w.watch(ps, pr)
    assert all(len(p._post_accumulate_grad_hooks) == 1 for p in ps)
    _backward(ps)
    assert pr.all()
    pr.clear()
    w.watch(ps, pr)
    assert all(len(p._post_accumulate_grad_hooks) == 0 for p in ps)
    _backward(ps[1:])
    assert list(pr.mem) == [0, 1]           # (the C++ hooks mark)


@pytest.mark.skipif(cpp_status() is not None, reason="no C++ extension")
def test_a_refused_watch_installs_nothing():
    from poco_kernels import _C
    ps, pr = _params(2), Presence(2)
    with pytest.raises(TypeError):
        _C.watch([ps[0], 5.0], pr.flags, 1)
    with pytest.raises(ValueError):
        _C.watch(ps, torch.zeros(1, dtype=torch.uint8), 1)
    _backward(ps)
    assert list(pr.mem) == [0, 0]
    _C.watch(ps, pr.flags, 1)
    _backward(ps)
    assert list(pr.mem) == [1, 1]


def test_the_compiled_autograd_flag_reads_what_torch_reads(monkeypatch):
    """``_compiled_autograd`` reads the config entry's own fields while nothing set it (a
    config module's ``getattr`` costs about 2 us a hand-out) and ``getattr`` otherwise:
    the same value either way, whatever sets it and however it is put back."""
    import torch._dynamo
    cfg = torch._dynamo.config
    for _ in range(2):
        assert fused_presence._compiled_autograd() == bool(cfg.compiled_autograd)
        with cfg.patch(compiled_autograd=True):
            assert fused_presence._compiled_autograd() is True
        assert fused_presence._compiled_autograd() == bool(cfg.compiled_autograd)

    from torch.utils._config_module import _UNSET_SENTINEL as unset

    class Override:                           # (torch's context-local override)
        value = unset

        def get(self):
            return self.value

    class Entry:
        default, alias, justknob, hide = False, None, None, False
        env_value_force = env_value_default = unset
        user_override = Override()

    class Config:                             # (a config module: its entry, and getattr)
        _config = {"compiled_autograd": Entry()}

        def __getattr__(self, name):
            v = Entry.user_override.value
            return Entry.default if v is unset else v

    fake = Config()
    monkeypatch.setattr(torch._dynamo, "config", fake)
    monkeypatch.setattr(fused_presence, "_ENTRY", [None, None, None])
    assert fused_presence._compiled_autograd() is False
    assert fused_presence._ENTRY[1] is fake._config["compiled_autograd"]     # (the fast path)
    Entry.user_override.value = True
    assert fused_presence._compiled_autograd() is True
    Entry.user_override.value = False
    assert fused_presence._compiled_autograd() is False
    Entry.user_override.value = unset
    Entry.default = True                      # (a default read from the entry itself)
    assert fused_presence._compiled_autograd() is True

    class Other:                              # (no entry of that form: getattr alone)
        compiled_autograd = True
    monkeypatch.setattr(torch._dynamo, "config", Other())
    assert fused_presence._compiled_autograd() is True
    assert fused_presence._ENTRY[1] is None
