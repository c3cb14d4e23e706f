"""What CUDA-graph capture and torch.compile need of the fused backends, checked on the
CPU: a steady-state iteration (samples, backward passes, accumulation, the step) and a
refresh read no device value on the host and make no tensor out of host data (on a GPU,
the host-to-device copies a capture refuses); hyperparameters given as tensors (a
scheduled ``lr``, a scheduled ``alpha``) reach the kernels on the device and give the
float run's bits; a refresh reads the device only until the correction is active.  The
capture itself, replayed against eager execution, and torch.compile of a training step
without recompilation are ``benchmarks/gpu/capture.py``'s checks, run on a GPU by
``bench_gpu.py --quick`` and on the CPU by its smoke run (``tests/repo/test_bench_run.py``)."""
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import poco_kernels as pk
from helpers import FUSED_BACKENDS, Problem, mlp
from poco_kernels.backends import fused as F
from poco_kernels.backends import fused_grads

fused = pytest.mark.parametrize("backend", FUSED_BACKENDS)


class HostTraffic(TorchDispatchMode):
    """Records the operators that move host data to the device or device data to the host:
    a tensor made from Python data (``lift_fresh``: ``torch.tensor``), a scalar read
    (``_local_scalar_dense``: ``.item()``, ``bool()``), a copy to another device.  Kernel
    launches are left out (the Triton interpreter converts its arguments on the host)."""

    WATCH = ("aten.lift_fresh", "aten._local_scalar_dense", "aten.scalar_tensor")

    def __init__(self):
        super().__init__()
        self.seen = []
        self.quiet = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if not self.quiet and name.startswith(self.WATCH):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def quiet_launches(monkeypatch):
    """A HostTraffic mode that does not look inside kernel launches."""
    mode = HostTraffic()
    from poco_kernels.kernels import triton_kernels as K

    class Launch:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            launch = self.kernel[grid]

            def call(*a, **k):
                mode.quiet += 1
                try:
                    return launch(*a, **k)
                finally:
                    mode.quiet -= 1
            return call

    if "triton" in FUSED_BACKENDS:
        for name, obj in list(vars(K).items()):
            if name.endswith("_kernel") and hasattr(obj, "arg_names"):
                monkeypatch.setattr(K, name, Launch(obj))
    return mode


def _no_host_reads(monkeypatch):
    """Any read of a tensor value on the host raises; tensor hyperparameters are treated
    as living on a GPU (not read to check their range, as there)."""
    from poco_kernels import _validation

    def boom(*a, **k):
        raise AssertionError("a tensor value read on the host")
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    monkeypatch.setattr(_validation, "readable", lambda t: False)


def _iteration(opt, model, prob, idx):
    """One inner iteration of the sampling protocol: what a captured graph would hold."""
    with opt.sampled("inner"):
        prob.loss(model, idx).backward()
    if opt.correction_active():
        with opt.sampled("outer"):
            prob.loss(model, idx).backward()
    opt.step()


def _refresh(opt, model, prob):
    with opt.sampled("refresh", accumulate=False):
        for c in prob.chunks(2):
            prob.loss(model, c).backward()
            opt.accumulate()
    opt.refresh()


def _tensor_opt(backend, model, **kw):
    """IVON-PoCoMo with ``lr`` and ``alpha`` as float64 tensors (the Python floats'
    precision: a schedule moves them as it would move floats)."""
    f64 = dict(dtype=torch.float64)
    return pk.IVONPoCoMo(model.parameters(), lr=torch.tensor(0.05, **f64), ess=200.0,
                         alpha=torch.tensor(0.6, **f64), backend=backend, seed=3,
                         check_finite=False, **kw)


@fused
def test_a_steady_state_iteration_and_refresh_make_no_host_traffic(backend, quiet_launches,
                                                                   monkeypatch):
    model, prob = mlp(), Problem()
    opt = _tensor_opt(backend, model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1.0 + 0.1 * t))
    batches = prob.batches(6)
    for t in range(3):                   # past the first refresh: the steady state
        if t == 1:
            _refresh(opt, model, prob)
        _iteration(opt, model, prob, batches[t])
        sched.step()
    with monkeypatch.context() as m:
        _no_host_reads(m)
        # as inside a capture (Triton then gathers autograd's gradients instead of reading
        # them through a table of their addresses, which would be copied in when they move)
        m.setattr(fused_grads, "_capturing", lambda: True)
        with quiet_launches:
            _iteration(opt, model, prob, batches[3])
            _refresh(opt, model, prob)
            _iteration(opt, model, prob, batches[4])
    assert quiet_launches.seen == []
    sched.step()                         # (the scheduler's fill_ happens outside a graph)
    assert opt.step_count == 5 and opt.refresh_count == 2


@fused
def test_the_traffic_check_can_fail(backend, quiet_launches, monkeypatch):
    """The checks see a read of a device value (``check_finite=True`` reads the bad flag
    after each update) and a tensor made from host data (an AMP ``found_inf`` made in the
    loop)."""
    model, prob = mlp(), Problem()
    opt = pk.IVON(model.parameters(), lr=0.05, ess=200.0, backend=backend, check_finite=True)
    _iteration(opt, model, prob, prob.batches(1)[0])
    with monkeypatch.context() as m:
        _no_host_reads(m)
        with pytest.raises(AssertionError, match="read on the host"):
            _iteration(opt, model, prob, prob.batches(1)[0])
    opt.check_finite = False
    with quiet_launches:
        with opt.sampled("inner"):
            prob.loss(model, prob.batches(1)[0]).backward()
        opt.step(found_inf=torch.tensor(0.0))
    assert "aten.lift_fresh.default" in quiet_launches.seen


@fused
def test_tensor_hyperparameters_on_a_schedule_give_the_float_run(backend):
    """``lr`` and ``alpha`` as (float64) tensors, moved in place by an lr scheduler and by
    DoubleLoop's alpha schedule, reach the kernels on the device: bit for bit the run whose
    floats the schedules set."""
    from poco_kernels.driver import DoubleLoop, Linear
    prob = Problem()
    runs = []
    for as_tensor in (False, True):
        model = mlp()
        if as_tensor:
            opt = _tensor_opt(backend, model)
        else:
            opt = pk.IVONPoCoMo(model.parameters(), lr=0.05, ess=200.0, alpha=0.6,
                                backend=backend, seed=3, check_finite=False)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1.0 + 0.1 * t))
        loop = DoubleLoop(opt, refresh_every=3, warmup_steps=2,
                          alpha=Linear(0.2, 0.8, total_steps=8))
        for t, idx in enumerate(prob.batches(8)):
            if loop.refresh_due():
                loop.refresh([prob.closure(opt, model, c) for c in prob.chunks(2)], 96)
            loop.step(prob.closure(opt, model, idx), 8)
            sched.step()
        runs.append([p.detach().clone() for p in model.parameters()]
                    + [s.clone() for s in opt.flat_state("h")])
        if as_tensor:
            assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
            assert float(opt.param_groups[0]["alpha"]) == pytest.approx(Linear(0.2, 0.8, 8)(7))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@fused
def test_a_refresh_reads_the_device_only_until_the_correction_is_active(backend, monkeypatch):
    reads = []
    real = F.FusedBackend.counters
    monkeypatch.setattr(F.FusedBackend, "counters",
                        lambda self: (reads.append(1), real(self))[1])
    model, prob = mlp(), Problem()
    opt = pk.IVONPoCoMo(model.parameters(), lr=0.05, ess=200.0, alpha=0.6, backend=backend)
    for k in range(3):
        _refresh(opt, model, prob)
        _iteration(opt, model, prob, prob.batches(1)[0])
        assert len(reads) == 1, k          # the first refresh only
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(5))]})
    _refresh(opt, model, prob)             # a new group joins: whether it was taken matters
    assert len(reads) == 2


@fused
def test_while_capturing_an_unwritten_gradient_counts_as_written(backend, monkeypatch):
    """During a CUDA graph capture the engine does not read whether a handed-out
    ``.grad`` view still holds zeros (a read would break the capture): the parameter's
    zero gradient is accumulated instead of leaving it out of the step."""
    model, prob = mlp(), Problem()
    opt = pk.IVON(model.parameters(), lr=0.05, ess=200.0, backend=backend, grad_views=True)
    _iteration(opt, model, prob, prob.batches(1)[0])
    w = next(model.parameters())
    eng = opt._runner
    with opt.sampled("inner"):
        prob.loss(model, prob.batches(1)[0]).backward()
        assert opt._buckets[0].params[0] is w
        opt._buckets[0].presence.mem[0] = 0   # as if autograd had not reached it...
        w.grad.zero_()                        # ... and it held zeros
        assert (0, 0) in eng.unwritten()
        monkeypatch.setattr(fused_grads, "_capturing", lambda: True)
        assert eng.unwritten() == set()


def _held_storages(owners) -> set:
    """The addresses of the storages of every tensor reachable from ``owners`` (their
    attributes, containers and closures, and each leaf tensor's ``.grad``), not looking
    into classes, modules or functions' globals."""
    import gc
    import types
    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
            types.MethodWrapperType, weakref.ReferenceType)
    seen, out, stack = set(), set(), list(owners)
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, skip):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            out.add(_storage(o))
            if o.is_leaf and o.grad is not None:
                stack.append(o.grad)
            continue
        if isinstance(o, types.MethodType):
            stack.append(o.__self__)
            continue
        stack.extend(gc.get_referents(o))
    out.discard(None)
    return out


def _storage(t):
    """The address of a tensor's storage (None for a tensor without data: fake, meta)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


class DeviceWork(TorchDispatchMode):
    """The device work of a call as a CUDA graph would record it: every operator and
    kernel with the storages it touches (those alive before the call by address, the
    call's own temporaries as ``tmp``) and its host arguments.  Two calls whose records
    are equal replay the same graph: a graph captured at one of them stands for the
    other."""

    def __init__(self, opt):
        super().__init__()
        self.log, self.before = [], set()
        runner = opt._runner
        ops, mode = runner.ops, self

        class Ops:                       # the kernel launches, with their host arguments
            def __getattr__(self, name):
                fn = getattr(ops, name)
                if not callable(fn):
                    return fn

                def call(*a, **k):
                    mode.log.append(("kernel." + name, mode.key(a)))
                    return fn(*a, **k)
                return call
        runner.ops = Ops()

    def key(self, a):
        if isinstance(a, torch.Tensor):
            ptr = a.untyped_storage().data_ptr()
            return ("tensor", ptr if ptr in self.before else "tmp", a.storage_offset(),
                    tuple(a.shape), a.dtype)
        if isinstance(a, (tuple, list)):
            return tuple(self.key(x) for x in a)
        if isinstance(a, (int, float, bool, str, type(None), torch.dtype)):
            return a
        return type(a).__name__

    def record(self, fn, *owners):
        """The device work of ``fn()``; ``owners`` (the optimizer, the model, the data)
        hold the storages that outlive the call, known by address (a temporary of the
        call may reuse the address of something freed meanwhile: it stays ``tmp``)."""
        self.before = _held_storages(owners)
        self.log = []
        with self:
            fn()
        return self.log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if not name.startswith(("aten.detach", "aten.alias", "aten._to_copy")):
            self.log.append((name, self.key((args, tuple((kwargs or {}).items())))))
        return func(*args, **(kwargs or {}))


def _replays(backend, views=True):
    """The device work of steady-state iterations and refreshes, in the order a training
    loop with captured graphs replays them: an iteration after iterations, after a refresh,
    a refresh after an iteration, after a refresh (``views``: ``grad_views``)."""
    model, prob = mlp(), Problem()
    opt = _tensor_opt(backend, model, grad_views=views)
    batches = prob.batches(5)
    for t in range(4):                   # past the first refresh: the steady state
        if t == 1:
            _refresh(opt, model, prob)
        _iteration(opt, model, prob, batches[t])
    rec = DeviceWork(opt)
    seq = ["it", "it", "it", "rf", "it", "it", "rf", "rf", "it"]
    out = []
    for t, what in enumerate(seq):
        # (one mini-batch: a graph's static input, whatever data is copied into it)
        work = (lambda: _iteration(opt, model, prob, batches[4])) if what == "it" \
            else (lambda: _refresh(opt, model, prob))
        out.append((what, rec.record(work, opt, model, prob)))
    return out


@pytest.mark.parametrize("backend,views", [(b, v) for b in FUSED_BACKENDS for v in (True, False)])
def test_every_steady_state_iteration_and_refresh_does_the_same_device_work(backend, views,
                                                                           monkeypatch):
    """A captured CUDA graph replays the device work of the call it captured: every
    steady-state iteration must touch the same buffers with the same arguments (the
    gradient buffers in the same roles, a buffer zeroed in the same place), whatever came
    before it, or the replays drift from eager execution (they did on an H100 when the
    gradient buffers alternated between iterations).  Without views, as inside a capture
    (autograd's gradients gathered, not read through a table of their addresses)."""
    monkeypatch.setattr(fused_grads, "_capturing", lambda: True)
    runs = _replays(backend, views)
    first = {}
    for what, log in runs:
        assert log, what
        ref = first.setdefault(what, log)
        assert log == ref, f"a {what!r} differs from the first: " + next(
            f"at {i}: {x} != {y}" for i, (x, y) in enumerate(zip(log + [None], ref + [None]))
            if x != y)


@fused
def test_the_device_work_check_can_fail(backend, monkeypatch):
    """Gradient buffers handed out in turn (the last one handed out first, as before the
    fix) make two consecutive iterations differ."""
    real = fused_grads.GradsMixin._free_buffer
    monkeypatch.setattr(fused_grads.GradsMixin, "_free_buffer",
                        lambda self, b, lent, prefer=None, make=True:
                        real(self, b, lent, b.handed, make))
    runs = _replays(backend)
    its = [log for what, log in runs if what == "it"]
    assert its[0] != its[1]
