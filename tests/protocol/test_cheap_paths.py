"""The host's shortcuts give what the general code gives: the public calls' entry outside
Dynamo, the kernel records built from plain numbers, a group's hyperparameters, and a
C++ operator called once through the extension's binding."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from poco_kernels import IVON
from poco_kernels._transaction import outside_dynamo
from poco_kernels._validation import hyperparameters
from poco_kernels.backends.hyper import HyperRow
from poco_kernels.kernels import cpp_status
from poco_kernels.kernels import interface as iface

needs_cpp = pytest.mark.skipif(cpp_status() is not None, reason="no C++ extension")


@pytest.mark.parametrize("switches", [True, False])
def test_outside_dynamo_runs_eagerly_and_is_skipped_by_dynamo(switches, monkeypatch):
    """Called eagerly, the function runs with no Dynamo callback set; called from a
    compiled function, Dynamo neither inlines it (one graph break) nor compiles its
    wrapper's frame (no warning about what it calls), and it still runs with no callback
    set, so the frames it runs are not compiled (the shortcut must not skip torch's
    wrapper there).  Without Dynamo's frame switches (``switches=False``): torch's
    wrapper alone, the same behaviour."""
    import warnings

    import torch._C._dynamo.eval_frame as frames
    from torch._C._dynamo.eval_frame import get_eval_frame_callback
    if not switches:
        monkeypatch.delattr(frames, "_FrameExecStrategy")
    seen = []

    @outside_dynamo
    def probe(x):
        seen.append(get_eval_frame_callback())
        return x + 1

    assert getattr(probe, "_torchdynamo_disable", False) is switches
    assert probe(1) == 2 and seen == [None]
    torch._dynamo.reset()

    def twice(x):
        return probe(x * 2) * 3

    x = torch.ones(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explained = torch._dynamo.explain(twice)(x)
        compiled = torch.compile(twice, backend="eager")
        assert torch.equal(compiled(x), (x * 2 + 1) * 3)
        assert torch.equal(compiled(x), (x * 2 + 1) * 3)
    assert explained.graph_break_count == 1
    assert not [w for w in caught if "Dynamo" in str(w.message)]
    assert seen[1:] == [None, None, None]    # (explain's run, then two calls: in Python)
    torch._dynamo.reset()


@pytest.mark.parametrize("values", [
    (0.5, 1, True, 2.0, 0.0, -3.5),                   # plain numbers: the fast path
    (0.5, np.float64(1.5), True, 2.0, 0.0, -3.5),     # a numpy number: the general path
    (0.5, torch.tensor(0.25, dtype=torch.float64), True, 2.0, 0.0, -3.5),   # a tensor
])
def test_records_from_numbers_as_the_general_code_gives_them(values):
    """``hyper_values`` and ``HyperRow.update``: each plain number a float, a tensor kept
    (and copied into its field on the device), whichever path runs."""
    got = iface.hyper_values(values)
    want = tuple(iface.hyper_value(v) for v in values)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g is w if isinstance(w, torch.Tensor) else (type(g) is float and g == w)
    hp = iface.RefreshHyper(*values)
    row = HyperRow(iface.RefreshHyper, torch.device("cpu"))
    out = row.update(hp)
    assert out.tolist() == [float(v) for v in values]
    assert row.update(hp) is out and out.tolist() == [float(v) for v in values]
    moved = hp._replace(inv_n=4.0)
    assert row.update(moved).tolist()[0] == 4.0
    counted = hp.counted(inv_n=2)
    assert counted == iface.RefreshHyper(2.0, *want[1:])
    assert type(counted.inv_n) is float


def test_step_records_equal_their_field_by_field_definitions():
    """``StepHyper.ivon`` (positional), ``StepFlags.routed`` and ``bits`` against the
    records built by name, every switch combination."""
    kw = dict(lr=1.0, beta1=2.0, beta2=3.0, wd=4.0, ess=5.0, alpha=6.0, hess_corr=7.0,
              floor=8.0, clip=9.0)
    assert iface.StepHyper.ivon(**kw) == iface.StepHyper(
        sign_at_out=1.0, inv_n_in=1.0, inv_n_at_out=0.0, momentum=0.0, dampening=0.0,
        eps=0.0, mom_first=0.0, **kw)
    for bits in itertools.product([False, True], repeat=11):
        f = iface.StepFlags(iface.FAMILY_IVON, *bits)
        assert f.bits() == sum(1 << i for i, v in enumerate(bits) if v)
        for sw in itertools.product([0, 1], repeat=5):
            r = f.routed(corr=sw[0], ge_in=sw[1], ge_at_out=sw[2], shared_noise=sw[3],
                         next_sample=sw[4])
            assert r == f._replace(**dict(zip(iface.StepFlags._fields[1:6], map(bool, sw))))
            assert all(type(v) is bool for v in r[1:6])
    for bits in itertools.product([False, True], repeat=2):
        rf = iface.RefreshFlags(iface.FAMILY_IVON, *bits)
        assert rf.bits() == sum(1 << i for i, v in enumerate(bits) if v)


def test_hyperparameters_of_a_group_are_its_stored_values():
    """A group's hyperparameters: every key but ``params``, in order, an alias (IVON's
    ``betas``) not among them, a tensor ``lr`` read as a float or kept."""
    p = torch.nn.Parameter(torch.zeros(3))
    opt = IVON([p], lr=torch.tensor(0.5), ess=10.0, backend="torch")
    g = opt.param_groups[0]
    plain = hyperparameters(g)
    assert list(plain) == [k for k in dict.keys(g) if k != "params"]
    assert "betas" not in plain and type(plain["lr"]) is float and plain["lr"] == 0.5
    kept = hyperparameters(g, keep_tensors=True)
    assert kept["lr"] is dict.__getitem__(g, "lr")
    assert {k: v for k, v in kept.items() if k != "lr"} == \
        {k: v for k, v in plain.items() if k != "lr"}
    assert "params" in g                      # (the group itself untouched)


@needs_cpp
def test_a_cpp_operator_called_once_is_the_torch_ops_call():
    """``cpp_ops``' one-shot call (bound by the extension) writes what the ``torch.ops``
    call writes, and a torch function mode sees it as ``torch.ops``' overload."""
    from torch.overrides import TorchFunctionMode

    from poco_kernels.kernels import cpp_ops
    n = 37
    args = dict(ctl=torch.zeros(iface.CTL_SIZE, dtype=torch.int64), seed=5, noise=2,
                stream=3, counter_slot=iface.CTL_STEPS,
                hp=iface.SampleHyper(ess=10.0, wd=1e-3, sigma=0.0), sign=1.0,
                sigma_mode=iface.SIGMA_IVON, sync=False)
    mean, h = torch.randn(n), torch.rand(n)
    outs = []
    for direct in (True, False):
        out = torch.zeros(n)
        if direct:
            cpp_ops.sample(out, mean, mean, h, None, **args)
        else:
            torch.ops.poco_kernels_cpp.sample(*cpp_ops._sample_args(
                out, mean, mean, h, None, *args.values()))
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], mean)
    seen = []

    class Seen(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))
    out = torch.zeros(n)
    with Seen():
        cpp_ops.sample(out, mean, mean, h, None, **args)
    assert str(torch.ops.poco_kernels_cpp.sample) in seen     # (the packet, as torch.ops')
    assert torch.equal(out, outs[0])

    class Sub(torch.Tensor):                  # (an argument whose type has its own say)
        calls = []

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            cls.calls.append(str(func))
            return super().__torch_function__(func, types, args, kwargs)
    out = torch.zeros(n)
    cpp_ops.sample(out, mean, mean, h.as_subclass(Sub), None, **args)
    assert Sub.calls == [str(torch.ops.poco_kernels_cpp.sample)]
    assert torch.equal(out, outs[0])
    with pytest.raises(RuntimeError, match="argument 'seed'"):   # (torch.ops' own error)
        cpp_ops.sample(out, mean, mean, h, None, **dict(args, seed=2 ** 64))


def test_an_extension_whose_scan_takes_no_clean_false_is_wrapped():
    """An extension built before ``scan(..., clean=False)`` (a TypeError for False):
    ``_sweeps`` asks it for the versions and drops them, as the Python twin does."""
    from poco_kernels import _sweeps

    def old_scan(params, addresses, views, clean, flags, owner):
        if clean is False:
            raise TypeError("scan: a sequence of versions expected")
        return _sweeps.py_scan(params, addresses, views, clean, flags, owner)
    ps = [torch.nn.Parameter(torch.randn(3)) for _ in range(4)]
    views = [torch.zeros(3) for _ in ps]
    for p, v in zip(ps[:3], views):
        p.grad = v
    wrapped = _sweeps._scan_with_versions(old_scan)
    for clean in (False, None, _sweeps.py_versions(views)):
        assert wrapped(ps, None, views, clean, None, 0) == \
            _sweeps.py_scan(ps, None, views, clean, None, 0)


def test_outside_dynamo_takes_torchs_wrapper_while_exporting(monkeypatch):
    """While torch exports (no Dynamo callback, but the export's graph annotated by
    torch's wrapper), the call goes through the wrapper."""
    wrapped = []
    real = torch._disable_dynamo

    def spy(fn):
        inner = real(fn)

        def call(*a, **k):
            wrapped.append(1)
            return inner(*a, **k)
        return call
    monkeypatch.setattr(torch, "_disable_dynamo", spy)
    probe = outside_dynamo(lambda x: x + 1)
    assert probe(1) == 2 and wrapped == []
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)
    probe = outside_dynamo(lambda x: x + 1)
    assert probe(1) == 2 and wrapped == [1]
