"""Every public call on an optimizer is a transaction: it completes, or it raises a clear
error and leaves everything exactly as before -- parameter values, ``opt.state``,
``param_groups``, the counters, the pending protocol state (counts, draws, sums), the seed
-- so that the optimizer goes on bit for bit like a *twin* that never made the call.

The generic runner (:func:`run_case`) builds an optimizer and its twin identically, runs a
short shared history on both (with a refresh for the correction optimizers, so that the
correction is active), snapshots everything, makes the bad call on the optimizer only,
checks the snapshot, then runs a few more steps with a refresh on both and checks that
they stay bit-identical (``torch.equal``) after every call.  (The twin's run is the same
for many cases, so its snapshots are memoised: :func:`twin_trajectory`.)

Exceptions to "exactly as before", from the spec:

* an update that reads the gradients and finds them non-finite (raised with
  ``check_finite=True``, or skipped) consumes the pending sums (they are empty after);
* a skipped update may count itself in ``skipped_updates`` (never compared here).

Histories and continuations are written as short op strings, see :meth:`Rig.do`.
"""
import copy
import math
import re

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

import poco_kernels as pk
from helpers import available_backends
from optim_db import configs, names as optimizers
from tolerances import PARAM, TRAJECTORY, assert_close

BACKENDS = available_backends()
FUSED = [b for b in BACKENDS if b != "torch"]

# the optimizers by property (tests/optim_db.py)
GRAD = optimizers(grad_closure=True)                         # the .grad protocol
GRAD_CORR = optimizers(grad_closure=True, has_refresh=True)  # ... with a correction
NOISY_GRAD = optimizers(grad_closure=True, noisy=True)       # need a sample per step
ALL = optimizers()                                           # VONPoCo: torch backend only
CORR = optimizers(has_refresh=True)
NAN, INF = float("nan"), float("inf")
SEED = 7

#: deterministic, and no shrinking: a failing example is reported as generated (shrinking
#: would re-run the case dozens of times), and the first one stops the search
HYP = dict(deadline=None, derandomize=True, database=None, report_multiple_bugs=False,
           phases=[Phase.explicit, Phase.generate],
           suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def names(key, group=None):
    """A loose pattern for an error message naming hyperparameter ``key`` (and the parameter
    group ``group``: "group 1", "param group 1", "param_groups[1]", ...), in any order."""
    k = re.escape(key)
    if group is None:
        return k
    g = rf"group\w*\W{{0,3}}{group}\b"
    return rf"(?s)({k}.*{g}|{g}.*{k})"


#: tiny tensors: one thread is faster (and VONPoCo's small LAPACK calls much faster)
pytestmark = pytest.mark.usefixtures("one_thread")


# ============================================================================ the world
_g = torch.Generator().manual_seed(11)
X = torch.randn(24, 5, generator=_g)
Y = torch.randint(0, 2, (24,), generator=_g)
BATCHES = [torch.randint(0, 24, (8,), generator=_g) for _ in range(10)]
CHUNKS = [[torch.arange(0, 12), torch.arange(12, 24)],                       # refresh r: r % 2
          [torch.arange(0, 8), torch.arange(8, 16), torch.arange(16, 24)]]


def make_model():
    """Linear(5, 3) - Tanh - Linear(3, 2); the last bias is the *spare* parameter, not in
    the optimizer until a test adds it."""
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


#: group 1 (the second Linear's weight) differs from group 0 in some hyperparameter
GROUP1 = {"IVON": dict(lr=0.03), "IVONPoCo": dict(lr=0.03, alpha=0.8), "SVRG": dict(lr=0.02),
          "SVRGAdamW": dict(lr=5e-3), "VSGDPoCo": dict(lr=0.02), "VONPoCo": dict(lr=0.05)}
#: the optimizer database's transactional configuration of each optimizer
DEFAULTS = {c.optimizer: c.kwargs for c in configs("transactional")}


def build(name, groups, backend, check_finite=True, **kw):
    """``check_finite=True`` (VONPoCo: None, it always checks) unless given otherwise."""
    if name == "VONPoCo" and check_finite is True:
        check_finite = None
    args = dict(DEFAULTS[name], seed=SEED, backend=backend, check_finite=check_finite)
    args.update(kw)
    return getattr(pk, name)(groups, **args)


class Boom(Exception):
    """The user's own exception, raised inside a closure or a ``sampled()`` block."""


class _Poke(torch.autograd.Function):
    """Adds nothing to the loss and ``value`` (nan, inf, -inf) to the gradient of its input:
    a non-finite gradient for both closure conventions (``.grad`` and VONPoCo's)."""

    @staticmethod
    def forward(ctx, x, value):
        ctx.value = value
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, g):
        return g * ctx.value, None


class Rig:
    """An optimizer over a tiny model (two groups; the spare bias outside), the closures,
    and the op language of histories and continuations."""

    def __init__(self, name, backend, check_finite=True, **kw):
        self.name, self.backend = name, backend
        self.model = make_model()
        self.spare = self.model[2].bias
        groups = [{"params": list(self.model[0].parameters())},
                  {"params": [self.model[2].weight], **GROUP1[name]}]
        self.opt = build(name, groups, backend, check_finite, **kw)
        self.von = name == "VONPoCo"
        self.calls = 0          # loss evaluations since the last arm()
        self.poke = None        # (value, evaluation, parameter index, element)
        self.boom_at = None     # the evaluation that raises Boom

    # ------------------------------------------------------------------ faults
    def arm(self, poke=None, boom_at=None):
        self.calls, self.poke, self.boom_at = 0, poke, boom_at
        return self

    def disarm(self):
        self.poke = self.boom_at = None

    # ------------------------------------------------------------------ losses, closures
    def loss(self, idx):
        self.calls += 1
        if self.boom_at == self.calls:
            raise Boom(f"evaluation {self.calls}")
        out = torch.nn.functional.cross_entropy(self.model(X[idx]), Y[idx])
        if self.poke is not None and self.poke[1] == self.calls:
            value, _, pi, e = self.poke
            p = list(self.model.parameters())[pi]
            out = out + _Poke.apply(p.reshape(-1)[e % p.numel()], value)
        return out

    def closure_on(self, idx):
        if self.von:
            return lambda: self.loss(idx)

        def c():
            self.opt.zero_grad()
            loss = self.loss(idx)
            loss.backward()
            return loss
        return c

    def closure(self, t):
        return self.closure_on(BATCHES[t])

    def chunks(self, r):
        return [self.closure_on(c) for c in CHUNKS[r % 2]]

    def backward(self, idx):
        self.opt.zero_grad()
        self.loss(idx).backward()

    def block(self, kind, idx):
        """``with opt.sampled(kind): loss.backward()``."""
        self.opt.zero_grad()
        with self.opt.sampled(kind):
            self.loss(idx).backward()

    # ------------------------------------------------------------------ ops
    def do(self, op):
        """One op of a history: a letter and an optional batch/chunk number.

        ``sN`` step(closure N)       ``rN`` refresh(chunks N)
        ``iN`` sampled inner (+ sampled outer when the correction is active) on batch N
        ``IN`` sampled inner only    ``ON`` sampled outer (nothing if correction inactive)
        ``fN`` sample('refresh'), every chunk of N accumulated, restore
        ``FN`` sampled refresh on chunk N of the 3-chunk split
        ``S`` step()  ``R`` refresh()  ``+`` sample('inner')
        ``AN`` backward at the active sample on batch N, accumulate, restore
        ``bN`` zero_grad and a plain backward at the mean   ``z`` zero_grad()
        """
        letter, num = op[0], int(op[1:]) if len(op) > 1 else None
        opt = self.opt
        if letter == "s":
            opt.step(self.closure(num))
        elif letter == "r":
            opt.refresh(self.chunks(num))
        elif letter == "i":
            self.block("inner", BATCHES[num])
            if opt.correction_active():
                self.block("outer", BATCHES[num])
        elif letter == "I":
            self.block("inner", BATCHES[num])
        elif letter == "O":
            if opt.correction_active():
                self.block("outer", BATCHES[num])
        elif letter == "f":
            opt.zero_grad()
            opt.sample("refresh")
            for c in CHUNKS[num % 2]:
                self.loss(c).backward()
                opt.accumulate()
            opt.restore()
        elif letter == "F":
            self.block("refresh", CHUNKS[1][num])
        elif letter == "S":
            opt.step()
        elif letter == "R":
            opt.refresh()
        elif letter == "+":
            opt.zero_grad()
            opt.sample("inner")
        elif letter == "A":
            self.loss(BATCHES[num]).backward()
            opt.accumulate()
            opt.restore()
        elif letter == "b":
            self.backward(BATCHES[num])
        elif letter == "z":
            opt.zero_grad()
        else:
            raise AssertionError(op)

    def run(self, ops):
        for op in ops.split():
            self.do(op)

    def warm(self):
        """The shared history: two steps, with a refresh between them where there is one
        (the correction is then active)."""
        return "s0 r0 s1" if self.opt.rule.has_correction else "s0 s1"

    def tail(self):
        """Three more steps, with a refresh after the first where there is one."""
        return "s5 r1 s6 s7" if self.opt.rule.has_correction else "s5 s6 s7"

    def finish_pending(self):
        c = self.opt._pending.count
        return "S " if c[0] else "R " if c[2] else ""


# ============================================================================ snapshots
def snapshot(rig):
    """Everything a call may change, keyed by position (so a twin's snapshot compares)."""
    opt = rig.opt
    order = [p for g in opt.param_groups for p in g["params"]]
    pend = opt._pending
    return {                                        # (the order diffs are listed in)
        "step_count": opt.step_count,
        "refresh_count": opt.refresh_count,
        "correction_active": opt.correction_active(),
        "active": opt._active,
        "seed": opt.seed,
        "param_groups": [dict({k: copy.deepcopy(v) for k, v in g.items() if k != "params"},
                              n_params=len(g["params"]),
                              shapes=[tuple(p.shape) for p in g["params"]])
                         for g in opt.param_groups],
        "pending": {"count": dict(pend.count), "draws": dict(pend.draws),
                    "sums": {k: v.detach().clone() for k, v in pend.sums.items()}},
        "params": [p.detach().clone() for p in rig.model.parameters()],
        "state": [{k: v.detach().clone() for k, v in opt.state[p].items()}
                  if p in opt.state else None for p in order],
        "buckets": [dict(group=b.group_index, n_params=len(b.params),
                         buffers={k: v.detach().clone() for k, v in b.buffers.items()})
                    for b in opt._buckets],
        # (the storage each parameter is a view of, and where: not its memory, which a
        # parked engine trades, backends/fused_park.py; not compared between twins)
        "storage": [(p.untyped_storage()._cdata, p.storage_offset()) for p in order],
    }


def _same_scalar(a, b):
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def diff(a, b, path="snapshot", la="a", lb="b"):
    """Where ``a`` and ``b`` differ, as readable lines (empty: bit-identical)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{path}: {la} {type(a).__name__}, {lb} {type(b).__name__}"]
        if a.shape != b.shape or a.dtype != b.dtype:
            return [f"{path}: {la} {tuple(a.shape)}/{a.dtype}, {lb} {tuple(b.shape)}/{b.dtype}"]
        if torch.equal(a, b):
            return []
        nan = f" (NaN: {la} {int(a.isnan().sum())}, {lb} {int(b.isnan().sum())})" \
            if a.is_floating_point() and (a.isnan().any() or b.isnan().any()) else ""
        ne = a != b
        d = (a.double() - b.double()).abs()[ne & ~(a.isnan() | b.isnan())] \
            if a.is_floating_point() else torch.zeros(0)
        big = f", max |diff| {float(d.max()):.3g}" if d.numel() else ""
        return [f"{path}: {int(ne.sum())} of {a.numel()} elements differ{big}{nan}"]
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        if set(a) != set(b):
            out.append(f"{path}: {la} keys {sorted(map(str, a))}, {lb} {sorted(map(str, b))}")
        for k in a:
            if k in b:
                out += diff(a[k], b[k], f"{path}[{k!r}]", la, lb)
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: {la} length {len(a)}, {lb} {len(b)}"]
        return [x for i, (u, v) in enumerate(zip(a, b))
                for x in diff(u, v, f"{path}[{i}]", la, lb)]
    return [] if _same_scalar(a, b) else [f"{path}: {la} {a!r}, {lb} {b!r}"]


def assert_same(a, b, what, skip=(), labels=("before", "after")):
    __tracebackhide__ = True
    a = {k: v for k, v in a.items() if k not in skip}
    b = {k: v for k, v in b.items() if k not in skip}
    lines = diff(a, b, "", *labels)
    if lines:
        raise AssertionError(what + ":\n  " + "\n  ".join(lines[:16])
                             + (f"\n  ... ({len(lines) - 16} more)" if len(lines) > 16 else ""))


def assert_finite(rig, what):
    __tracebackhide__ = True
    s = snapshot(rig)
    bad = [f"params[{i}]" for i, p in enumerate(s["params"]) if not torch.isfinite(p).all()]
    bad += [f"bucket {i} {k!r}" for i, b in enumerate(s["buckets"])
            for k, v in b["buffers"].items() if not torch.isfinite(v).all()]
    assert not bad, f"{what}: non-finite values in " + ", ".join(bad)


def assert_pending_empty(rig, what):
    __tracebackhide__ = True
    pend = rig.opt._pending
    assert (all(v == 0 for v in pend.count.values()) and all(v == 0 for v in pend.draws.values())
            and not pend.sums), (f"{what}: pending not consumed: count {pend.count}, draws "
                                 f"{pend.draws}, sums {sorted(pend.sums)}")


def assert_twins(a, b, what):
    __tracebackhide__ = True
    assert_finite(a, what)
    assert_same(snapshot(a), snapshot(b), f"{what}: optimizer and twin differ",
                skip=("storage",), labels=("optimizer", "twin"))


# ============================================================================ the runner
def _outcome(bad, rig, raises, match):
    """Make the call; what is wrong with how it ended (None: as expected)."""
    want = raises if isinstance(raises, tuple) else (raises,) if raises else ()
    names = " or ".join(t.__name__ for t in want)
    try:
        bad(rig)
    except BaseException as e:              # noqa: B902 - the user's own exceptions too
        if not want:
            return f"raised {type(e).__name__}: {e} (expected it to complete)"
        if not isinstance(e, want):
            return f"raised {type(e).__name__}: {e} (expected {names})"
        if match and not re.search(match, str(e)):
            return f"message {str(e)!r} does not match {match!r}"
        return None
    finally:
        if rig is not None:
            rig.disarm()
    return f"did not raise {names}" if want else None


_TWINS = {}


def twin_trajectory(name, backend, check_finite, kw, history, cont):
    """The twin's snapshots: after ``history``, then after every op of ``cont`` (default:
    the pending update, then :meth:`Rig.tail`).  Memoised: every case with the same
    optimizer, backend and ops shares one twin run (deterministic, bit for bit)."""
    key = (name, backend, check_finite, tuple(sorted(kw.items())), history, cont)
    if key not in _TWINS:
        b = Rig(name, backend, check_finite, **kw)
        b.run(history)
        snaps = [snapshot(b)]
        ops = (b.finish_pending() + b.tail()) if cont is None else cont
        for op in ops.split():
            b.do(op)
            snaps.append(snapshot(b))
        _TWINS[key] = (ops.split(), snaps)
    return _TWINS[key]


def assert_twin_snapshot(a, snap, what):
    __tracebackhide__ = True
    assert_finite(a, what)
    assert_same(snapshot(a), snap, f"{what}: optimizer and twin differ", skip=("storage",),
                labels=("optimizer", "twin"))


def run_case(name, backend, *, bad, raises=None, match=None, history=None, solo="",
             arm=None, pending="kept", check_finite=True, cont=None, kw=None):
    """Optimizer ``a`` and twin ``b``: shared ``history``; ``a`` alone runs ``solo`` (armed
    with ``arm``: a non-finite gradient in it) and ``bad(a)``, which must raise ``raises``
    with a message matching ``match`` (or complete when ``raises`` is None); ``a`` must then
    be as before (``pending="consumed"``: except for the pending sums, which must be empty)
    and equal to ``b``; then ``cont`` (default: the pending update, then three steps with a
    refresh) on both, bit-identical after every op.  How the call ended is checked last,
    so that a failure shows what changed first (and the wrong exception or message too).
    """
    kw = kw or {}
    a = Rig(name, backend, check_finite, **kw)
    history = a.warm() if history is None else history
    ops, twin = twin_trajectory(name, backend, check_finite, kw, history, cont)
    a.run(history)
    assert_twin_snapshot(a, twin[0], "after the shared history (test bug)")
    if arm:
        a.arm(**arm)
    a.run(solo)
    a.disarm()
    before = snapshot(a)
    problem = _outcome(bad, a, raises, match)
    try:
        after = snapshot(a)
        if pending == "consumed":
            assert_same(before, after, "the call changed the optimizer", skip=("pending",))
            assert_pending_empty(a, "after the update that read non-finite gradients")
        else:
            assert_same(before, after, "the call changed the optimizer")
        assert_twin_snapshot(a, twin[0], "right after the call")
        for op, snap in zip(ops, twin[1:]):
            a.do(op)
            assert_twin_snapshot(a, snap, f"after continuation op {op!r}")
    except AssertionError as e:
        if problem:
            raise AssertionError(f"{e}\n  (and the call {problem})") from None
        raise
    assert problem is None, f"the call {problem}"
    return a


def _group_edit(key, value, gi, call):
    """A ``bad`` that edits ``param_groups[gi][key]``, makes ``call``, and undoes the edit
    (the refused call itself must leave the groups as they were)."""
    def bad(rig):
        g = rig.opt.param_groups[gi]
        old = g[key]
        g[key] = value
        try:
            call(rig)
        finally:
            g[key] = old
    return bad


def _ones():
    return torch.ones(())


# ============================================================================ cases
def _c(kind, opts, **spec):
    return kind, opts, spec


def _lazy(f):
    """A spec value computed per optimizer name."""
    f._per_name = True
    return f


#: (kind, optimizers, run_case arguments); a value marked _lazy is called with the name
KINDS = [
    # ---------------------------------------------------------------- step
    _c("step-nonfinite-inner", ALL, raises=ValueError, match="non-finite",
       bad=lambda r: r.arm(poke=(NAN, 1, 0, 3)).opt.step(r.closure(2))),
    _c("step-nonfinite-outer", CORR, raises=ValueError, match="non-finite",
       bad=lambda r: r.arm(poke=(INF, 2, 2, 1)).opt.step(r.closure(2))),
    _c("step-skip-nonfinite-inner", GRAD, fused=True, check_finite=False,
       bad=lambda r: r.arm(poke=(NAN, 1, 1, 0)).opt.step(r.closure(2))),
    _c("step-skip-nonfinite-outer", GRAD_CORR, fused=True, check_finite=False,
       bad=lambda r: r.arm(poke=(-INF, 2, 0, 7)).opt.step(r.closure(2))),
    _c("step-found-inf", GRAD,
       bad=lambda r: r.opt.step(r.closure(2), found_inf=_ones())),
    _c("step-found-inf-low-level", GRAD, solo="i2", pending="consumed",
       bad=lambda r: r.opt.step(found_inf=_ones())),
    _c("step-low-level-nonfinite", GRAD, solo="i2", pending="consumed", raises=ValueError,
       match="non-finite", arm=dict(poke=(NAN, 1, 2, 4)), bad=lambda r: r.opt.step()),
    _c("step-low-level-skip-nonfinite", GRAD, fused=True, check_finite=False, solo="i2",
       pending="consumed", arm=dict(poke=(INF, 1, 0, 0)), bad=lambda r: r.opt.step()),
    _c("step-closure-raises-inner", ALL, raises=Boom,
       bad=lambda r: r.arm(boom_at=1).opt.step(r.closure(2))),
    _c("step-closure-raises-outer", CORR, raises=Boom,
       bad=lambda r: r.arm(boom_at=2).opt.step(r.closure(2))),
    _c("step-without-sample", NOISY_GRAD, solo="b2", raises=RuntimeError, match="sample",
       bad=lambda r: r.opt.step()),
    _c("step-without-closure-von", ["VONPoCo"], raises=RuntimeError, match="closure",
       bad=lambda r: r.opt.step()),
    _c("step-without-outer-sample", GRAD_CORR, history="s0 r0 s1 I2", raises=RuntimeError,
       match="outer", cont="O2 S s5 r1 s6 s7", bad=lambda r: r.opt.step()),
    _c("step-closure-with-pending", GRAD, history=_lazy(lambda r: r.warm() + " i2"),
       raises=RuntimeError, match="sample|accumulate|protocol",
       bad=lambda r: r.opt.step(r.closure(3))),
    _c("step-inside-sampled", GRAD, raises=RuntimeError, match="restore",
       bad=lambda r: _step_inside_sampled(r)),
    # ---------------------------------------------------------------- refresh
    _c("refresh-nonfinite", CORR, raises=ValueError, match="non-finite",
       bad=lambda r: r.arm(poke=(NAN, 2, 0, 2)).opt.refresh(r.chunks(1))),
    _c("refresh-skip-nonfinite", GRAD_CORR, fused=True, check_finite=False,
       bad=lambda r: r.arm(poke=(NAN, 1, 2, 5)).opt.refresh(r.chunks(1))),
    _c("first-refresh-skip-nonfinite", GRAD_CORR, fused=True, check_finite=False,
       history="s0 s1", bad=lambda r: r.arm(poke=(INF, 2, 0, 1)).opt.refresh(r.chunks(0))),
    _c("refresh-found-inf", GRAD_CORR,
       bad=lambda r: r.opt.refresh(r.chunks(1), found_inf=_ones())),
    _c("first-refresh-found-inf", GRAD_CORR, history="s0 s1",
       bad=lambda r: r.opt.refresh(r.chunks(0), found_inf=_ones())),
    _c("refresh-low-level-nonfinite", GRAD_CORR, solo="f1", pending="consumed",
       raises=ValueError, match="non-finite", arm=dict(poke=(NAN, 2, 1, 1)),
       bad=lambda r: r.opt.refresh()),
    _c("refresh-closure-raises", CORR, raises=Boom,
       bad=lambda r: r.arm(boom_at=2).opt.refresh(r.chunks(1))),
    # a non-finite gradient collected, then the closure raises: the fused backends' flag
    # of it must go with the dropped sums (the next update is not skipped)
    _c("step-closure-nonfinite-then-raises", GRAD_CORR, check_finite=False, raises=Boom,
       bad=lambda r: r.arm(poke=(NAN, 1, 0, 0), boom_at=2).opt.step(r.closure(2))),
    _c("refresh-closure-nonfinite-then-raises", GRAD_CORR, check_finite=False, raises=Boom,
       bad=lambda r: r.arm(poke=(NAN, 1, 0, 0), boom_at=2).opt.refresh(r.chunks(1))),
    # step and refresh gradients are not collected at the same time
    _c("refresh-sample-while-step-pending", GRAD_CORR, history="s0 r0 s1 I2",
       raises=RuntimeError, match="call step", cont="O2 S s5 r1 s6 s7", bad=lambda r: r.opt.sample("refresh")),
    _c("inner-sample-while-refresh-pending", GRAD_CORR, history="s0 r0 s1 f1",
       raises=RuntimeError,
       match="call refresh", bad=lambda r: r.opt.sample("inner")),
    _c("step-while-refresh-pending", GRAD_CORR, history="s0 r0 s1 f1", raises=RuntimeError,
       match="call refresh", bad=lambda r: r.opt.step(r.closure(2))),
    _c("sample-refresh-no-outer-loop", ["IVON"], raises=RuntimeError, match="outer loop",
       bad=lambda r: r.opt.sample("refresh")),
    # AMP arguments
    _c("step-grad-scale-zero", GRAD, raises=ValueError, match="grad_scale",
       bad=lambda r: r.opt.step(r.closure(2), grad_scale=torch.zeros(()))),
    _c("step-grad-scale-nan", GRAD_CORR, raises=ValueError, match="grad_scale",
       bad=lambda r: r.opt.step(r.closure(2), grad_scale=torch.full((), NAN))),
    _c("refresh-grad-scale-negative", GRAD_CORR, raises=ValueError, match="grad_scale",
       bad=lambda r: r.opt.refresh(r.chunks(1), grad_scale=-torch.ones(()))),
    _c("step-grad-scale-2d", GRAD_CORR, raises=ValueError, match="grad_scale",
       bad=lambda r: r.opt.step(r.closure(2), grad_scale=torch.ones(1, 1))),
    _c("step-found-inf-meta", GRAD_CORR, raises=ValueError, match="found_inf",
       bad=lambda r: r.opt.step(r.closure(2), found_inf=torch.ones((), device="meta"))),
    _c("refresh-no-chunks", CORR, raises=ValueError, match="chunk",
       bad=lambda r: r.opt.refresh([])),
    # (step gradients pending: refresh() says to step first; nothing pending: no chunks)
    _c("refresh-nothing-pending", GRAD_CORR, history=_lazy(lambda r: r.warm() + " i2"),
       raises=RuntimeError, match="call step", bad=lambda r: r.opt.refresh()),
    _c("refresh-nothing-collected", GRAD_CORR, raises=ValueError, match="chunk",
       bad=lambda r: r.opt.refresh()),
    _c("refresh-closures-with-pending", GRAD_CORR, history="s0 r0 s1 f2",
       raises=RuntimeError, match="refresh", bad=lambda r: r.opt.refresh(r.chunks(1))),
    _c("refresh-without-outer-loop", ["IVON"], raises=RuntimeError, match="refresh|outer",
       bad=lambda r: r.opt.refresh(r.chunks(0))),
    _c("refresh-inside-sampled", GRAD_CORR, raises=RuntimeError, match="restore",
       bad=lambda r: _refresh_inside_sampled(r)),
    # ---------------------------------------------------------------- sample / accumulate
    _c("sample-bad-kind", GRAD, history=_lazy(lambda r: r.warm() + " i2"), raises=ValueError,
       match="kind", bad=lambda r: r.opt.sample("outter")),
    _c("sample-outer-inactive", GRAD, history="s0 s1", raises=RuntimeError,
       match="refresh|correction", bad=lambda r: r.opt.sample("outer")),
    _c("sample-while-active", GRAD, history=_lazy(lambda r: r.warm() + " +"),
       raises=RuntimeError, match="restore", bad=lambda r: r.opt.sample("inner"),
       cont=_lazy(lambda r: "A2 O2 S " + r.tail())),
    _c("accumulate-without-sample", GRAD, history=_lazy(lambda r: r.warm() + " i2"),
       raises=RuntimeError, match=r"sample\(\)", bad=lambda r: r.opt.accumulate()),
    _c("restore-without-sample", GRAD, history=_lazy(lambda r: r.warm() + " i2"),
       bad=lambda r: r.opt.restore()),
    _c("low-level-api-refused-von", ["VONPoCo"], raises=RuntimeError, match="closure",
       bad=lambda r: r.opt.sample("inner")),
    _c("sampled-refused-von", ["VONPoCo"], raises=RuntimeError, match="closure",
       bad=lambda r: _enter(r, "inner")),
    # ---------------------------------------------------------------- sampled()
    _c("sampled-raises-inside", GRAD, history=_lazy(lambda r: r.warm() + " I2"), raises=Boom,
       bad=lambda r: _raise_inside(r, "inner", backward=True),
       cont=_lazy(lambda r: "I3 O3 S " + r.tail())),
    _c("sampled-nested", GRAD, raises=RuntimeError, match="restore|already",
       bad=lambda r: _nested(r)),
    _c("sampled-outer-inactive", GRAD, history="s0 s1", raises=RuntimeError,
       match="refresh|correction", bad=lambda r: _enter(r, "outer")),
    _c("sampled-bad-kind", GRAD, raises=ValueError, match="kind",
       bad=lambda r: _enter(r, "bogus")),
    # ---------------------------------------------------------------- add_param_group
    _c("add-group-bad-lr", ALL, raises=ValueError, match="lr",
       bad=lambda r: r.opt.add_param_group({"params": [r.spare], "lr": -1.0})),
    _c("add-group-complex", ALL, raises=ValueError, match="complex",
       bad=lambda r: r.opt.add_param_group(
           {"params": [torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))]})),
    _c("add-group-duplicate", ALL, raises=ValueError, match="more than one|already",
       bad=lambda r: r.opt.add_param_group({"params": [r.model[0].weight]})),
    _c("add-group-misspelled-key", ALL, raises=(ValueError, TypeError),
       match=_lazy(lambda name: MISSPELLED[name][1]),
       bad=lambda r: r.opt.add_param_group({"params": [r.spare], MISSPELLED[r.name][0]: 0.1})),
    _c("add-group-float64", GRAD, fused=True, raises=(RuntimeError, ValueError),
       match="float64",
       bad=lambda r: r.opt.add_param_group(
           {"params": [torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))]})),
    # ---------------------------------------------------------------- param_groups edited
    _c("edited-group1-step", ALL, raises=ValueError, match=names("lr", 1),
       bad=_group_edit("lr", -1.0, 1, lambda r: r.opt.step(r.closure(2)))),
    _c("edited-group1-step-pending", GRAD, history=_lazy(lambda r: r.warm() + " i2"),
       raises=ValueError, match=names("lr", 1),
       bad=_group_edit("lr", NAN, 1, lambda r: r.opt.step())),
    _c("edited-group1-refresh", CORR, raises=ValueError,
       match=names("alpha", 1),
       bad=_group_edit("alpha", 1.5, 1, lambda r: r.opt.refresh(r.chunks(1)))),
    # ---------------------------------------------------------------- zero_grad
    _c("zero-grad-with-pending", GRAD, history=_lazy(lambda r: r.warm() + " i2"),
       bad=lambda r: (r.opt.zero_grad(), r.opt.zero_grad(set_to_none=False))),
    _c("zero-grad-von", ["VONPoCo"], bad=lambda r: r.opt.zero_grad()),
]

MISSPELLED = {"IVON": ("weight_decy", "weight_decay"), "IVONPoCo": ("weight_decy", "weight_decay"),
              "SVRG": ("weight_decy", "weight_decay"), "SVRGAdamW": ("weight_decy", "weight_decay"),
              "VSGDPoCo": ("weight_decy", "weight_decay"), "VONPoCo": ("min_eigs", "min_eig")}


def _enter(rig, kind):
    with rig.opt.sampled(kind):
        rig.loss(BATCHES[2]).backward()


def _raise_inside(rig, kind, backward):
    rig.opt.zero_grad()
    with rig.opt.sampled(kind):
        if backward:
            rig.loss(BATCHES[2]).backward()
        raise Boom("inside sampled()")


def _nested(rig):
    rig.opt.zero_grad()
    with rig.opt.sampled("inner"):
        with rig.opt.sampled("inner"):
            rig.loss(BATCHES[2]).backward()


def _step_inside_sampled(rig):
    rig.opt.zero_grad()
    with rig.opt.sampled("inner"):
        rig.loss(BATCHES[2]).backward()
        rig.opt.step()


def _refresh_inside_sampled(rig):
    rig.opt.zero_grad()
    with rig.opt.sampled("refresh"):
        rig.loss(CHUNKS[0][0]).backward()
        rig.opt.refresh()


#: the optimizer each kind runs on the Triton interpreter (the kinds :func:`_kernel_kind`
#: selects; the cheap SVRG family unless the kind is about the maths)
TRITON_PICK = {
    "step-skip-nonfinite-inner": "IVONPoCo", "step-skip-nonfinite-outer": "SVRGAdamW",
    "step-found-inf": "SVRG", "step-found-inf-low-level": "SVRGAdamW",
    "step-low-level-skip-nonfinite": "VSGDPoCo",
    "refresh-skip-nonfinite": "IVONPoCo", "first-refresh-skip-nonfinite": "SVRG",
    "refresh-found-inf": "SVRGAdamW", "first-refresh-found-inf": "VSGDPoCo",
    "step-closure-nonfinite-then-raises": "SVRG", "refresh-closure-nonfinite-then-raises": "SVRG",
    "sampled-raises-inside": "VSGDPoCo", "add-group-float64": "SVRG",
}

#: kinds that only exercise the protocol (the same code for every optimizer of the .grad
#: family): on torch and C++ with IVON-PoCo and SVRG (IVON, VONPoCo where they apply), not
#: with all five
PROTOCOL_ONLY = {"step-closure-with-pending", "step-inside-sampled",
                 "refresh-closures-with-pending", "refresh-inside-sampled",
                 "refresh-nothing-pending", "sample-bad-kind",
                 "sample-outer-inactive", "sample-while-active", "accumulate-without-sample",
                 "restore-without-sample", "sampled-nested", "sampled-outer-inactive",
                 "sampled-bad-kind", "add-group-duplicate", "zero-grad-with-pending",
                 "refresh-no-chunks", "add-group-complex", "refresh-nothing-collected",
                 "refresh-sample-while-step-pending", "inner-sample-while-refresh-pending",
                 "step-while-refresh-pending", "step-grad-scale-2d", "step-found-inf-meta",
                 "refresh-grad-scale-negative", "step-grad-scale-nan"}
PROTOCOL_NAMES = {"IVONPoCo", "SVRG", "VONPoCo", "IVON"}


def _kernel_kind(kind):
    """Kinds where the Triton kernels decide something (skipping an update, the first
    refresh, a group they cannot run, noise after a forgotten draw; a non-finite gradient
    that raises is read by the host code shared with C++).  The rest is host
    code that Triton shares with the C++ backend (``backends/fused.py``), run there."""
    return (any(w in kind for w in ("skip-nonfinite", "found-inf", "first-refresh",
                                    "float64", "sampled-raises", "nonfinite-then-raises"))
            and "meta" not in kind)


def _params():
    out = []
    for kind, opts, spec in KINDS:
        for name in opts:
            for backend in (["torch"] if name == "VONPoCo" else BACKENDS):
                if spec.get("fused") and backend == "torch":
                    continue
                if backend == "triton" and (TRITON_PICK.get(kind) != name
                                            or not _kernel_kind(kind)):
                    continue
                if backend != "triton" and kind in PROTOCOL_ONLY and name not in PROTOCOL_NAMES:
                    continue
                out.append(pytest.param(kind, name, backend, id=f"{kind}-{name}-{backend}"))
    return out


SPECS = {kind: spec for kind, _, spec in KINDS}


@pytest.mark.parametrize("kind, name, backend", _params())
def test_call_is_transactional(kind, name, backend):
    """One (call, bad input) kind of :data:`KINDS` on one optimizer and backend."""
    spec = dict(SPECS[kind])
    spec.pop("fused", None)
    probe = None                          # lazy values need a rig (its warm()/tail())
    for k, v in list(spec.items()):
        if getattr(v, "_per_name", False):
            if k != "match" and probe is None:
                probe = Rig(name, backend)
            spec[k] = v(name) if k == "match" else v(probe)
    run_case(name, backend, **spec)


#: the kinds that run on IVON-PoCo, again with the copy protocol on the C++ backend
#: (``sample_ahead=False``: a sample pass each step, nothing parked; the default runs
#: parked, ``backends/fused_park.py``)
COPY_PROTOCOL = [kind for kind, opts, spec in KINDS
                 if "IVONPoCo" in opts and not spec.get("kw")]


@pytest.mark.parametrize("kind", COPY_PROTOCOL)
def test_the_copy_protocol_is_transactional(kind):
    """One (call, bad input) kind on IVON-PoCo with ``sample_ahead=False``."""
    if "cpp" not in BACKENDS:
        pytest.skip("the C++ backend is not built")
    spec = dict(SPECS[kind])
    spec.pop("fused", None)
    probe = None
    for k, v in list(spec.items()):
        if getattr(v, "_per_name", False):
            if k != "match" and probe is None:
                probe = Rig("IVONPoCo", "cpp", sample_ahead=False)
            spec[k] = v("IVONPoCo") if k == "match" else v(probe)
    run_case("IVONPoCo", "cpp", kw={"sample_ahead": False}, **spec)


def test_the_checks_see_one_element_one_draw_and_one_missed_step():
    """The runner's checks can fail: one float32 ulp in one state element, one draw
    counter, one step the twin did not take."""
    def ulp(r):
        buf = r.opt._buckets[0].buffers["momentum_buffer"].view(-1)
        buf[3] = torch.nextafter(buf[3], torch.tensor(INF))
    with pytest.raises(AssertionError, match=r"momentum_buffer.*1 of 15 elements differ"):
        run_case("SVRG", "torch", bad=ulp)
    with pytest.raises(AssertionError, match=r"draws'\]\[0\]: before 0, after 1"):
        run_case("SVRG", "torch", bad=lambda r: r.opt._pending.draws.__setitem__(0, 1))
    with pytest.raises(AssertionError, match=r"step_count'\]: before 2, after 3"):  # a step taken
        run_case("SVRG", "torch", bad=lambda r: r.opt.step(r.closure(2)))
    a, b = Rig("IVONPoCo", "torch"), Rig("IVONPoCo", "torch")     # the twins' continuation:
    for r in (a, b):                                                # same counters, one
        r.run(r.warm())                                             # mini-batch differs
    a.do("s5")
    b.do("s6")
    with pytest.raises(AssertionError, match=r"optimizer and twin differ:\n  \['params'\]"):
        assert_twins(a, b, "after one step on another batch")


# ============================================================================ hypothesis
#: invalid values of every hyperparameter, per optimizer
_COMMON_BAD = [("lr", -1.0), ("lr", NAN), ("lr", INF), ("lr", "0.1"), ("lr", None)]
_IVON_BAD = _COMMON_BAD + [
    ("ess", 0.0), ("ess", -3.0), ("ess", NAN), ("hess_init", 0.0), ("beta1", 1.0),
    ("beta1", -0.1), ("beta2", 1.0), ("beta2", 1.5), ("weight_decay", -1e-4),
    ("mc_samples", 0), ("mc_samples", 1.5), ("mc_samples", 5000), ("clip_radius", 0.0),
    ("debias", "yes"), ("rescale_lr", 1)]
_SVRG_BAD = _COMMON_BAD + [("alpha", 1.5), ("alpha", -0.1), ("momentum", -0.1),
                           ("dampening", -1.0), ("weight_decay", -1.0), ("nesterov", "no")]
BAD_HP = {
    "IVON": _IVON_BAD,
    "IVONPoCo": _IVON_BAD + [("alpha", 1.5), ("alpha", -0.1), ("rho1", 1.0), ("rho2", -0.5),
                             ("hess_corr_scale", -1.0), ("outer_noise", "same"),
                             ("refresh_samples", 0), ("hess_floor", -1.0)],
    "SVRG": _SVRG_BAD,
    "SVRGAdamW": _COMMON_BAD + [("betas", (0.9, 1.0)), ("betas", (1.0, 0.9)), ("betas", 0.9),
                                ("eps", -1e-8), ("weight_decay", -0.1), ("alpha", 2.0)],
    "VSGDPoCo": _SVRG_BAD + [("sigma", -1.0), ("sigma", NAN), ("mc_samples", 0)],
    "VONPoCo": _COMMON_BAD + [("beta", 0.0), ("beta", 1.5), ("ess", 0.0), ("alpha", 1.5),
                              ("prior_precision", 0.0), ("min_eig", 0.0), ("min_eig", 2.0),
                              ("noise_scale", -1.0), ("rho1", 1.0), ("precision_update", "exact")],
}


def _hyp_params(examples, triton=("SVRG",)):
    """(name, backend, examples): every optimizer on torch and C++, ``triton`` on Triton."""
    out = []
    for name in ALL:
        for backend in (["torch"] if name == "VONPoCo" else BACKENDS):
            if backend == "triton" and name not in triton:
                continue
            out.append(pytest.param(name, backend, examples[backend], id=f"{name}-{backend}"))
    return out


_CALLS = {
    "step": (lambda r: r.opt.step(r.closure(2)), "", False),
    "step-pending": (lambda r: r.opt.step(), " i2", False),
    "refresh": (lambda r: r.opt.refresh(r.chunks(1)), "", True),
    "refresh-pending": (lambda r: r.opt.refresh(), " f2", True),
}


@pytest.mark.parametrize("name, backend, n", _hyp_params({"torch": 8, "cpp": 4, "triton": 2}))
def test_invalid_group_value_is_refused_before_anything_changes(name, backend, n):
    """param_groups edited to an invalid value (any hyperparameter, either group) before
    step/refresh (closures or pending low-level gradients): a ValueError naming the
    hyperparameter (and 'group 1' when the second group is at fault), nothing changed,
    pending sums kept."""
    calls = [c for c, (_, _, needs_corr) in _CALLS.items()
             if (not needs_corr or name in CORR) and (name != "VONPoCo" or "pending" not in c)]

    @settings(max_examples=n, **HYP)
    @given(bad=st.sampled_from(BAD_HP[name]), gi=st.sampled_from([0, 1]),
           call=st.sampled_from(calls))
    def check(bad, gi, call):
        key, value = bad
        f, extra, _ = _CALLS[call]
        probe = Rig(name, backend)
        match = names(key, 1 if gi == 1 else None)
        run_case(name, backend, history=probe.warm() + extra, raises=ValueError, match=match,
                 bad=_group_edit(key, value, gi, f))
    check()


_HISTORIES = ["s0", "s0 s1", "s0 r0", "s0 r0 s1", "s0 s1 r0 s2"]


@pytest.mark.parametrize("name, backend, n", _hyp_params({"torch": 10, "cpp": 20, "triton": 2},
                                                      triton=("IVONPoCo", "SVRG")))
def test_non_finite_gradient_anywhere(name, backend, n):
    """A nan/inf/-inf in any gradient element of any evaluation of a step or a refresh,
    after any history (first refresh included): with check_finite a ValueError, without
    (fused backends) a skipped update; nothing changes either way, and the optimizer goes
    on as the twin that never made the call."""
    corr = name in CORR

    @settings(max_examples=n, **HYP)
    @given(value=st.sampled_from([NAN, INF, -INF]),
           history=st.sampled_from(_HISTORIES if corr else ["s0", "s0 s1"]),
           call=st.sampled_from(["step", "refresh"] if corr else ["step"]),
           evaluation=st.sampled_from([1, 2]), param=st.integers(0, 2),
           elem=st.integers(0, 14), check_finite=st.booleans())
    def check(value, history, call, evaluation, param, elem, check_finite):
        skip = backend != "torch" and not check_finite and name != "VONPoCo"
        rig = Rig(name, backend)
        rig.run(history)
        if call == "step" and not rig.opt.correction_active():
            evaluation = 1                # one evaluation only
        poke = (value, evaluation, param, elem)
        if call == "step":
            bad = lambda r: r.arm(poke=poke).opt.step(r.closure(2))     # noqa: E731
        else:
            bad = lambda r: r.arm(poke=poke).opt.refresh(r.chunks(0))   # noqa: E731
        run_case(name, backend, history=history, check_finite=check_finite,
                 raises=None if skip else ValueError, match=None if skip else "non-finite",
                 bad=bad)
    check()


def _first_skip_params():
    out = []
    for backend in BACKENDS:
        for how in ("nonfinite", "found_inf"):
            for check_finite in ([True] if backend == "torch" else [True, False]):
                out.append(pytest.param(backend, how, check_finite,
                                        id=f"{backend}-{how}-check{int(check_finite)}"))
    return out


@pytest.mark.parametrize("backend, how, check_finite", _first_skip_params())
def test_skipped_first_step_does_not_start_the_sgd_momentum(backend, how, check_finite):
    """SVRG with momentum and dampening whose FIRST step is not taken (a non-finite
    gradient: refused, or skipped without ``check_finite``; AMP's ``found_inf``): no
    momentum buffer is left behind, so the next step starts it as ``torch.optim.SGD``
    does (``buf = d_p``, undampened), as the twin's first step does, bit for bit."""
    skip = how == "found_inf" or (backend != "torch" and not check_finite)
    if how == "nonfinite":
        bad = lambda r: r.arm(poke=(NAN, 1, 0, 3)).opt.step(r.closure(2))   # noqa: E731
    else:
        bad = lambda r: r.opt.step(r.closure(2), found_inf=_ones())          # noqa: E731
    kw = dict(momentum=0.9, dampening=0.5)
    run_case("SVRG", backend, history="", check_finite=check_finite, kw=kw, bad=bad,
             raises=None if skip else ValueError, match=None if skip else "non-finite")
    # the same with no read of the counters in between (run_case's snapshots read them):
    # without check_finite only the device knows that the first step was skipped
    a, b = Rig("SVRG", backend, check_finite, **kw), Rig("SVRG", backend, check_finite, **kw)
    assert _outcome(bad, a, None if skip else ValueError, None) is None
    for op in "s5 s6 s7".split():
        a.do(op)
        b.do(op)
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters())), \
        "the steps after the skipped one differ from the twin's"
    assert_twins(a, b, "after three more steps")


@pytest.mark.parametrize("name, backend, n",
                         [p for p in _hyp_params({"torch": 6, "cpp": 4, "triton": 2})
                          if p.values[0] != "VONPoCo"])
def test_exception_inside_sampled_restores_mean_and_draws(name, backend, n):
    """An exception inside ``with opt.sampled(kind):`` (before or after the backward, with
    0 or 1 earlier blocks of that kind): the mean back in the parameters, the draw counter
    and the pending sums as before, so that later noise equals the twin's."""
    kinds = ["inner"] + (["outer", "refresh"] if name in CORR else [])

    @settings(max_examples=n, **HYP)
    @given(kind=st.sampled_from(kinds), prior=st.integers(0, 1), backward=st.booleans())
    def check(kind, prior, backward):
        probe = Rig(name, backend)
        first = {"inner": "I2", "outer": "O2", "refresh": "F0"}[kind]
        more = {"inner": "I3 O3 S", "outer": "I3 O3 S", "refresh": "F1 R"}[kind]
        history = probe.warm() + (" " + first if prior else "")
        if kind == "outer" and not prior:
            more = "I3 O3 S"
        run_case(name, backend, history=history, raises=Boom,
                 bad=lambda r: _raise_inside(r, kind, backward), cont=more + " " + probe.tail())
    check()


def _block_keeping_grads(rig, kind, idx, boom=False):
    """``with opt.sampled(kind): loss.backward()`` with no ``zero_grad()`` around it: the
    loop that relies on ``accumulate()`` leaving no gradient behind (``boom``: the block
    raises after its backward)."""
    with rig.opt.sampled(kind):
        rig.loss(idx).backward()
        if boom:
            raise Boom("inside sampled(), after the backward")


def _no_zero_grad_params():
    out = [pytest.param(name, backend, gv, id=f"{name}-{backend}-views{int(gv)}")
           for name in GRAD for backend in BACKENDS if backend != "triton"
           for gv in ([True, False] if backend != "torch" else [True])]
    out += [pytest.param(TRITON_PICK["sampled-raises-inside"], "triton", gv,
                         id=f"{TRITON_PICK['sampled-raises-inside']}-triton-views{int(gv)}")
            for gv in (True, False) if "triton" in BACKENDS]
    return out


@pytest.mark.parametrize("name, backend, grad_views", _no_zero_grad_params())
def test_exception_inside_sampled_leaves_no_gradient_behind(name, backend, grad_views):
    """An exception inside ``with opt.sampled("inner"):`` after the backward: the gradient
    that block left in ``.grad`` is dropped with its sample, so a loop that never calls
    ``zero_grad()`` (``accumulate()`` clears ``.grad``) takes the steps of the twin that
    never entered the block, bit for bit, whether ``.grad`` is autograd's tensor or a view
    of the fused backends' gradient buffer (``grad_views``)."""
    a, b = Rig(name, backend, grad_views=grad_views), Rig(name, backend, grad_views=grad_views)
    for r in (a, b):
        r.run(r.warm())
    with pytest.raises(Boom):
        _block_keeping_grads(a, "inner", BATCHES[2], boom=True)
    assert_twins(a, b, "right after the exception")
    for t in (3, 4):
        for r in (a, b):
            _block_keeping_grads(r, "inner", BATCHES[t])
            if r.opt.correction_active():
                _block_keeping_grads(r, "outer", BATCHES[t])
            r.opt.step()
        assert_twins(a, b, f"after the step on batch {t}")


# ============================================================================ constructor
def _ctor_cases():
    out = []
    for name in ALL:
        wrong, right = MISSPELLED[name]
        backends = ["torch"] if name == "VONPoCo" else BACKENDS
        for backend in backends:
            out.append(pytest.param(name, backend, {wrong: 0.5}, None, TypeError, right,
                                    id=f"misspelled-kw-{name}-{backend}"))
            out.append(pytest.param(name, backend, {}, {wrong: 0.5}, (ValueError, TypeError),
                                    right, id=f"misspelled-group-key-{name}-{backend}"))
            out.append(pytest.param(name, backend, {"lr": -1.0}, None, ValueError, "lr",
                                    id=f"bad-lr-{name}-{backend}"))
            out.append(pytest.param(name, backend, {}, {"lr": -1.0}, ValueError,
                                    names("lr", 1),
                                    id=f"bad-lr-group1-{name}-{backend}"))
            out.append(pytest.param(name, backend, {"seed": -1}, None, ValueError, "seed",
                                    id=f"bad-seed-{name}-{backend}"))
            out.append(pytest.param(name, backend, {"seed": 2 ** 70}, None, ValueError, "seed",
                                    id=f"huge-seed-{name}-{backend}"))
            out.append(pytest.param(name, backend, {"check_finite": "yes"}, None, ValueError,
                                    "check_finite", id=f"bad-check-finite-{name}-{backend}"))
        if name != "VONPoCo":
            for backend in FUSED:
                out.append(pytest.param(name, backend, {}, "float64", (RuntimeError, ValueError),
                                        "float64", id=f"float64-{name}-{backend}"))
        out.append(pytest.param(name, "torch", {}, "complex", ValueError, "complex",
                                id=f"complex-{name}-torch"))
        out.append(pytest.param(name, "torch", {}, "duplicate", ValueError,
                                "more than one|already", id=f"duplicate-{name}-torch"))
    return out


@pytest.mark.parametrize("name, backend, kw, group1, raises, match", _ctor_cases())
def test_refused_construction_leaves_parameters_untouched(name, backend, kw, group1, raises,
                                                          match):
    """A refused constructor leaves the parameters as they were: same values AND same
    storage (the fused backends re-point ``p.data`` into flat buffers on success)."""
    model = make_model()
    extra = []
    if group1 == "float64":
        extra = [torch.nn.Parameter(torch.randn(3, dtype=torch.float64))]
    elif group1 == "complex":
        extra = [torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))]
    elif group1 == "duplicate":
        extra = [model[0].weight]
    groups = [{"params": list(model[0].parameters())},
              {"params": [model[2].weight] + extra,
               **(group1 if isinstance(group1, dict) else {})}]
    everything = list(model.parameters()) + extra
    values = [p.detach().clone() for p in everything]
    ptrs = [p.data_ptr() for p in everything]
    problem = _outcome(lambda _: build(name, groups, backend, **kw), None, raises, match)
    if problem is None or not problem.startswith("did not raise"):
        for i, (p, v, ptr) in enumerate(zip(everything, values, ptrs)):
            assert p.data_ptr() == ptr, (f"parameter {i}: storage re-pointed by a refused "
                                         f"constructor (and the call {problem})")
            assert torch.equal(p.detach(), v), (f"parameter {i}: value changed by a refused "
                                                f"constructor (and the call {problem})")
    assert problem is None, f"the constructor {problem}"
    # and a correct construction over the same parameters works (torch.optim fills the
    # defaults into the caller's group dicts: fresh ones here)
    build(name, [{"params": list(model[0].parameters())}, {"params": [model[2].weight]}],
          backend)


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=10, **HYP)
@given(data=st.data())
def test_invalid_hyperparameter_at_construction_names_it(name, data):
    """Any invalid hyperparameter, given as a default or in group 1: a ValueError naming it
    (and 'group 1' for the second group), the parameters untouched."""
    key, value = data.draw(st.sampled_from(BAD_HP[name]))
    in_group1 = data.draw(st.booleans())
    backend = data.draw(st.sampled_from(["torch"] if name == "VONPoCo" else BACKENDS))
    model = make_model()
    g1 = {"params": [model[2].weight], **({key: value} if in_group1 else {})}
    groups = [{"params": list(model[0].parameters())}, g1]
    ptrs = [p.data_ptr() for p in model.parameters()]
    values = [p.detach().clone() for p in model.parameters()]
    match = names(key, 1 if in_group1 else None)
    kw = {} if in_group1 else {key: value}
    problem = _outcome(lambda _: build(name, groups, backend, **kw), None, (ValueError, TypeError),
                       match)
    assert [p.data_ptr() for p in model.parameters()] == ptrs, f"storage re-pointed ({problem})"
    assert all(torch.equal(p.detach(), v) for p, v in zip(model.parameters(), values)), problem
    assert problem is None, f"the constructor with {key}={value!r} {problem}"


# ============================================================================ load_state_dict
def _corrupt(sd, what, name):
    poco, groups, state = sd["poco"], sd["param_groups"], sd["state"]
    if what.startswith("no-"):                       # a missing top-level key
        del sd[what[3:]]
    elif what.startswith("poco-no-"):
        del poco[what[8:]]
    elif what == "seed=-1":
        poco["seed"] = -1
    elif what == "seed=2**70":
        poco["seed"] = 2 ** 70
    elif what == "step=-5":
        poco["step"] = -5
    elif what == "refreshes=-1":
        poco["refreshes"] = -1
    elif what == "step=str":
        poco["step"] = "3"
    elif what == "step=float":
        poco["step"] = 2.5
    elif what == "group1-no-lr":
        del groups[1]["lr"]
    elif what == "group1-lr=-1":
        groups[1]["lr"] = -1.0
    elif what.startswith("state-"):
        key = "mean"
        t = state[2][key]
        state[2][key] = {
            "state-shape": lambda: torch.zeros(t.numel() + 1),
            "state-int": lambda: torch.zeros(t.shape, dtype=torch.int64),
            "state-complex": lambda: torch.zeros(t.shape, dtype=torch.complex64),
            "state-nan": lambda: t.clone().fill_(NAN),
            "state-not-tensor": lambda: t.tolist(),
        }[what]()
    elif what == "class":
        poco["optimizer"] = "IVON" if name != "IVON" else "SVRG"
    elif what == "extra-group":
        groups.append(copy.deepcopy(groups[1]))
    elif what == "missing-group":
        groups.pop()
    elif what == "param-count":
        groups[0]["params"] = groups[0]["params"][:-1]
    elif what == "pending-counts-no-sums":
        poco["pending"]["count"] = {0: 1, 1: 1, 2: 0}
        poco["pending"]["draws"] = {0: 1, 1: 1, 2: 0}
        poco["pending"]["sums"] = {}
    elif what == "pending-no-count":
        del poco["pending"]["count"]
    elif what == "not-a-dict":
        return [sd]
    elif what == "pending-nan":
        sums = poco["pending"]["sums"]
        k = sorted(sums)[0]
        sums[k] = sums[k].clone().fill_(NAN)
    elif what == "pending-g-without-ge":              # (a family that estimates Hessians)
        sums = poco["pending"]["sums"]
        for k in [k for k in sums if k.endswith("/ge")]:
            del sums[k]
    elif what == "lazy-buffer-partial":               # momentum saved for one parameter less
        del state[1]["momentum_buffer"]
    elif what == "h-negative":                        # IVON's h + weight_decay must be > 0
        state[0]["h"] = -state[0]["h"]
    elif what == "exp-avg-sq-negative":
        state[0]["exp_avg_sq"] = state[0]["exp_avg_sq"] - 1.0
    else:
        raise AssertionError(what)
    return sd


CORRUPTIONS = (["no-state", "no-param_groups", "no-poco"]
               + [f"poco-no-{k}" for k in ("step", "refreshes", "seed", "pending", "optimizer")]
               + ["seed=-1", "seed=2**70", "step=-5", "refreshes=-1", "step=str", "step=float",
                  "group1-no-lr", "group1-lr=-1", "state-shape", "state-int", "state-complex",
                  "state-nan", "state-not-tensor", "class", "other-class", "extra-group",
                  "missing-group", "param-count", "pending-counts-no-sums", "pending-no-count",
                  "not-a-dict"])
_LSD_MATCH = {"group1-no-lr": names("lr", 1), "group1-lr=-1": names("lr", 1),
              "seed=-1": "seed", "seed=2**70": "seed", "step=-5": "step",
              "refreshes=-1": "refreshes", "step=str": "step", "step=float": "step",
              "poco-no-step": "step", "poco-no-refreshes": "refreshes", "poco-no-seed": "seed",
              "poco-no-pending": "pending", "poco-no-optimizer": "optimizer|class"}


def _lsd_case(name, backend, what):
    donor = Rig(name, backend)
    donor.run(donor.warm() + " s2" + ("" if donor.von else " i3"))    # elsewhere, pending
    if what == "other-class":
        # (an IVON state dict loads into IVONPoCo: IVON-PoCo continues IVON runs)
        other = {"IVON": "IVONPoCo", "IVONPoCo": "VSGDPoCo", "SVRG": "SVRGAdamW"}.get(name,
                                                                                  "SVRG")
        o = Rig(other, backend)
        o.run(o.warm())
        sd = copy.deepcopy(o.opt.state_dict())
    else:
        sd = _corrupt(copy.deepcopy(donor.opt.state_dict()), what, name)
    run_case(name, backend, raises=ValueError, match=_LSD_MATCH.get(what),
             bad=lambda r: r.opt.load_state_dict(sd))


@pytest.mark.parametrize("name, what", [
    ("IVONPoCo", "pending-nan"), ("SVRG", "pending-nan"), ("IVONPoCo", "pending-g-without-ge"),
    ("SVRG", "lazy-buffer-partial"), ("IVONPoCo", "h-negative"),
    ("SVRGAdamW", "exp-avg-sq-negative")])
@pytest.mark.parametrize("backend", BACKENDS[:2])
def test_state_dict_the_next_update_could_not_use_is_refused(name, what, backend):
    """Pending sums that are not finite or lack their ``gradient * eps`` sum, a momentum
    buffer saved for some of a group's parameters only, state outside its domain."""
    _lsd_case(name, backend, what)


@pytest.mark.parametrize("what", CORRUPTIONS)
@pytest.mark.parametrize("name", ["IVONPoCo", "SVRG"])
def test_corrupt_state_dict_is_refused_before_anything_changes(name, what):
    _lsd_case(name, "torch", what)


@pytest.mark.parametrize("name, backend, n",
                         [p for p in _hyp_params({"torch": 5, "cpp": 5, "triton": 2})
                          if p.values[:2] not in (("IVONPoCo", "torch"), ("SVRG", "torch"))])
def test_corrupt_state_dict_other_optimizers_and_backends(name, backend, n):
    @settings(max_examples=n, **HYP)
    @given(what=st.sampled_from(CORRUPTIONS))
    def check(what):
        _lsd_case(name, backend, what)
    check()


@pytest.mark.parametrize("name", ALL)
def test_valid_state_dict_continues_bit_identically(name):
    backends = ["torch"] if name == "VONPoCo" else ["torch"] + FUSED[:1]
    for backend in backends:
        a = Rig(name, backend)
        a.run(a.warm() + " s2")
        sd = copy.deepcopy(a.opt.state_dict())
        b = Rig(name, backend, seed=SEED + 1)     # everything must come from the dict
        b.opt.load_state_dict(sd)
        with torch.no_grad():
            for p, q in zip(b.model.parameters(), a.model.parameters()):
                p.copy_(q)
        assert_twins(a, b, "right after load_state_dict")
        for op in a.tail().split():
            a.do(op)
            b.do(op)
            assert_twins(a, b, f"after {op!r}")


# ============================================================================ valid add_param_group
NEW_GROUP = {"IVON": dict(lr=0.04), "IVONPoCo": dict(lr=0.04, alpha=0.9), "SVRG": dict(lr=0.1),
             "SVRGAdamW": dict(lr=2e-2), "VSGDPoCo": dict(lr=0.1), "VONPoCo": dict(lr=0.05)}


def _flat_state(rig):
    opt = rig.opt
    return {f"{gi}/{pi}/{k}": v.detach().clone()
            for gi, g in enumerate(opt.param_groups) for pi, p in enumerate(g["params"])
            for k, v in opt.state.get(p, {}).items()}


@pytest.mark.parametrize("name", ALL)
def test_group_added_while_correction_active(name):
    """A valid group added after a refresh: it steps as the base method until the next
    refresh, then joins the correction.  Every backend gives the torch backend's result
    (trajectory tolerance), and everything stays finite."""
    res = {}
    for backend in (["torch"] if name == "VONPoCo" else BACKENDS):
        r = Rig(name, backend)
        r.run(r.warm())
        assert r.opt.correction_active() == (name in CORR)
        before = r.spare.detach().clone()
        r.opt.add_param_group({"params": [r.spare], **NEW_GROUP[name]})
        r.run("s2 s3")
        assert_finite(r, f"{backend}: base-method steps of the new group")
        assert not torch.equal(r.spare.detach(), before), "the new group did not move"
        mid = ([p.detach().clone() for p in r.model.parameters()], _flat_state(r))
        r.run(r.tail())
        assert_finite(r, f"{backend}: after the next refresh")
        res[backend] = (mid, ([p.detach().clone() for p in r.model.parameters()], _flat_state(r)))
    ref = res["torch"]
    for backend, got in res.items():
        for stage, (g, e) in zip(("before the refresh", "after the refresh"), zip(got, ref)):
            for i, (a, b) in enumerate(zip(g[0], e[0])):
                assert_close(a, b, TRAJECTORY[torch.float32], f"{backend} {stage}: param {i}")
            assert sorted(g[1]) == sorted(e[1]), f"{backend} {stage}: state keys differ"
            for k in e[1]:
                assert_close(g[1][k], e[1][k], TRAJECTORY[torch.float32],
                             f"{backend} {stage}: state {k}")


def _grad_spare(rig, params, idx):
    m = make_model()
    with torch.no_grad():
        for p, q in zip(m.parameters(), params):
            p.copy_(q)
    loss = torch.nn.functional.cross_entropy(m(X[idx]), Y[idx])
    return torch.autograd.grad(loss, m[2].bias)[0]


def test_added_svrg_group_is_sgd_until_the_refresh_then_corrected(backend):
    """SVRG, a group added while the correction is active (momentum 0, alpha 1): its first
    step is SGD on the mini-batch gradient at the mean; after the next refresh its step is
    SGD on the corrected gradient ``g_B(m) - (g_B(theta_out) - g_out)`` (by hand)."""
    r = Rig("SVRG", backend)
    r.run(r.warm())
    lr = 0.1
    r.opt.add_param_group({"params": [r.spare], "lr": lr, "momentum": 0.0, "alpha": 1.0})
    P = [p.detach().clone() for p in r.model.parameters()]
    r.run("s2")
    expected = P[3] - lr * _grad_spare(r, P, BATCHES[2])
    assert_close(r.spare.detach(), expected, PARAM[torch.float32], "SGD step of the new group")
    P_r = [p.detach().clone() for p in r.model.parameters()]
    g_out = torch.stack([_grad_spare(r, P_r, c) for c in CHUNKS[1]]).mean(0)
    r.run("r1")
    P4 = [p.detach().clone() for p in r.model.parameters()]
    r.run("s3")
    ghat = _grad_spare(r, P4, BATCHES[3]) - (_grad_spare(r, P_r, BATCHES[3]) - g_out)
    assert_close(r.spare.detach(), P4[3] - lr * ghat, PARAM[torch.float32],
                 "corrected SGD step of the new group")
