"""The twin runner of the transactional tests: snapshots, their diffs, and :func:`run_case`.

The generic runner (:func:`run_case`) builds an optimizer and its twin identically, runs a
short shared history on both (with a refresh for the correction optimizers, so that the
correction is active), snapshots everything, makes the bad call on the optimizer only,
checks the snapshot, then runs a few more steps with a refresh on both and checks that
they stay bit-identical (``torch.equal``) after every call.  (The twin's run is the same
for many cases, so its snapshots are memoised: :func:`twin_trajectory`.)
"""
import copy
import math
import re

import torch

from transaction_rig import Rig


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
