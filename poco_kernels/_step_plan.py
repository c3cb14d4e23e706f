"""Step plans: ``step(closure)``'s steady state on the fused backends, recorded and
replayed (:mod:`poco_kernels.backends.fused_plan` has the engine's part and why).

The optimizer records an iteration when it starts where a plan could (no sample, no
pending gradients, no AMP arguments, groups whose values were all validated as
immutable); two consecutive recordings that agree make a :class:`StepPlan`.  A planned
iteration makes the same state changes as the slow path, in the same order: the sample
of each kind (the protocol's ``_active``, draws and counts), the closure, the gradients
lent as the pending sums, the update (shared with the slow path:
``PosteriorOptimizer._update``).  Each part first checks what it was planned from (the
groups' values by identity, the engine's buffers and rows, the gradients handed out);
a part that finds a difference runs the slow path from the state the planned parts
left, which is the slow path's own.
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch

from ._groups import group_items
from ._protocol import KIND_INNER, KIND_OUTER, mean_loss
from .backends.fused_plan import same as _same

_KIND_NAME = {KIND_INNER: "inner", KIND_OUTER: "outer"}

#: the calls of each part of a planned iteration, in order (per bucket; per device for
#: ``finish``)
_SAMPLE, _CHECK, _STEP, _FINISH = "sample", "check", "step", "finish"


def plan_buckets(opt) -> frozenset:
    """Every bucket's index (a planned accumulation found each one's ``.grad`` views)."""
    return frozenset(range(len(opt._buckets)))


def group_stamp(opt) -> Optional[tuple]:
    """The groups as ``_check_groups`` last validated them (one entry per group, replaced
    when a value changes), or None where a group holds a value that can change in place
    (a tensor ``lr``: it is read at every update, not planned)."""
    return opt.__dict__.get("_group_stamp")


def groups_unchanged(opt, stamp) -> bool:
    """No group's key or value was replaced since ``stamp`` (a closure may set ``lr``)."""
    groups = opt._groups
    if len(groups) != len(stamp):
        return False
    for g, (g0, items0) in zip(groups, stamp):
        if g is not g0:
            return False
        items = group_items(g)
        if len(items) != len(items0) or not all(map(operator.is_, items, items0)):
            return False
    return True


class StepPlan:
    """One recorded iteration of ``step(closure)``: per closure evaluation the sample kind,
    its launches and noise records, the gradient checks that lend each bucket's buffer;
    the update's launches.  Each launch is kept as recorded (to compare with one derived
    again) and prepared (to replay)."""

    def __init__(self, key, stamp, state, values, samples, update, finish, update_state,
                 eng):
        self.key = key                # the correction's buckets and the groups waiting
        #: what the next sample the update writes was drawn with (the engine's
        #: ``_ahead_key`` after it; None: it writes none), while the groups are the stamp's
        self.ahead = eng.ahead
        self.stamp = stamp            # the groups' values the launches were derived from
        self.state = state            # the engine's side (FusedBackend.plan_state)
        self.values = values          # the rows' values then (FusedBackend.row_values)
        #: per closure: (kind, sample launches as recorded, prepared, noise records,
        #: checks, prepared checks)
        self.samples = [(kind, tuple(calls), eng.prepare(calls), noise, checks,
                         eng.prepare([("check", c) for c in checks]))
                        for kind, calls, noise, checks in samples]
        self.update_calls = tuple(update)   # the step launches as recorded
        self.update = eng.prepare(update)
        self.finish = eng.prepare(finish)   # the counters' advance after the update
        #: the engine's side when the update starts, and the pending sums and counts then
        self.update_state, sums, self.counts = update_state
        self.sums = dict(sums)
        self._sum_keys, self._sum_values = tuple(self.sums), tuple(self.sums.values())
        self._count = dict(self.counts)

    def pending_as_planned(self, pend) -> bool:
        """The update would read what it was planned to: the same sums, counts, no
        parameter without a gradient."""
        sums = pend.sums
        return (len(sums) == len(self.sums)
                and all(map(operator.is_, map(sums.get, self._sum_keys), self._sum_values))
                and pend.count == self._count and not any(pend.no_grad.values()))


def from_recordings(a, b, eng) -> Optional[StepPlan]:
    """A plan from two consecutive recordings (``(key, Recording, end state)``) that agree
    call for call and start and end in the same state; None otherwise."""
    (key_a, rec_a, end_a), (key_b, rec_b, end_b) = a, b
    # (the groups' values may differ, a schedule: the plan is b's, whose rows b wrote)
    if rec_a.broken or rec_b.broken or not _same(key_a[1:], key_b[1:]):
        return None
    if not (_same(rec_a.start, rec_b.start) and _same(rec_b.start, end_b)
            and _same(end_a, end_b)):
        return None
    if len(rec_a.calls) != len(rec_b.calls) or len(rec_a.marks) != len(rec_b.marks):
        return None
    for (na, aa), (nb, ab) in zip(rec_a.calls, rec_b.calls):
        if na != nb or not _same(aa, ab):
            return None
    for (ia, wa, sa), (ib, wb, sb) in zip(rec_a.marks, rec_b.marks):
        if ia != ib or wa != wb or not _same(sa, sb):
            return None
    return _parse(key_b, rec_b, eng)


def _parse(key, rec, eng) -> Optional[StepPlan]:
    """The plan of a recording of the planned pattern: per closure, the sample launches
    (one per bucket; none for an inner sample a step left in the parameters) before it
    and the finiteness checks after it (one per bucket: the buffer lent); then the step
    launches and the counters' ``finish``."""
    marks, calls = rec.marks, rec.calls
    if len(marks) < 2 or marks[-1][1] != "update" \
            or any(what != "closure" for _, what, _ in marks[:-1]):
        return None
    pos = [i for i, _, _ in marks]
    nb = 0                                    # (buckets: one step launch each)
    while pos[-1] + nb < len(calls) and calls[pos[-1] + nb][0] == _STEP:
        nb += 1
    if nb == 0 or pos[0] not in (0, nb) or any(n != _SAMPLE for n, _ in calls[:pos[0]]) \
            or (pos[0] == 0 and marks[0][2][0] != KIND_INNER):
        return None
    launches = [calls[:pos[0]]]
    checks = []
    for j in range(len(marks) - 1):
        seg = calls[pos[j]:pos[j + 1]]
        last = j == len(marks) - 2
        if len(seg) != (nb if last else 2 * nb) \
                or any(n != _CHECK for n, _ in seg[:nb]) \
                or any(n != _SAMPLE for n, _ in seg[nb:]):
            return None
        checks.append([args for _, args in seg[:nb]])
        if not last:
            launches.append(seg[nb:])
    samples = []
    for (_, _, snap), sample_calls, chk in zip(marks, launches, checks):
        kind, draw, noise = snap
        if draw != 0 or kind not in (KIND_INNER, KIND_OUTER) or any(len(a) != 2 for a in chk):
            return None
        samples.append((kind, sample_calls, dict(noise), chk))
    tail = calls[pos[-1]:]
    if [n for n, _ in tail[:nb]] != [_STEP] * nb or any(n != _FINISH for n, _ in tail[nb:]):
        return None
    return StepPlan(key[1:], key[0], rec.start, eng.row_values(), samples, tail[:nb],
                    tail[nb:], marks[-1][2], eng)




class UpdateMemo:
    """The update of ``step()`` without a closure as last derived: what it was derived
    from (the groups' stamp, the correction's buckets, the groups waiting, the pending
    sums and counts, the engine's state), the rows' values after, its launches as derived
    and prepared, the counters' advance prepared."""

    __slots__ = ("key", "values", "calls", "update", "finish")

    def __init__(self, key, values, calls, update, finish):
        self.key, self.values, self.calls = key, values, calls
        self.update, self.finish = update, finish


class StepPlanMixin:
    """``step(closure)`` by plan where one fits, else recorded (for the next plan)."""

    #: a :class:`StepPlan`, or the last recording ``(key, Recording, end state)``
    _step_plan: Any = None
    #: the last update of ``step()`` without a closure (:meth:`_memo_update`)
    _update_memo: Optional[UpdateMemo] = None
    #: plans are made and replayed (False: every iteration by the slow path)
    step_plans: bool = True

    def _memo_update(self, corr):
        """``step()`` without a closure (the protocol of ``sample``/``sampled()``, which
        the integrations use): the update's launches derived once and replayed while what
        they were derived from is unchanged (the key of :class:`UpdateMemo`, compared by
        identity, and the rows' values), as a plan's update is.  Returns the ``replay`` of
        :meth:`_update`, or None for the backend's own step (and no memo kept: a
        recording, sharded buckets, ``sample_ahead``, a group value that can change in
        place, a rule that is not planned).  A step with AMP arguments is not passed here
        (``step`` calls it only without them) and leaves the memo as it was."""
        eng = self._runner
        pend = self._pending
        if (not self.step_plans or self._recording is not None or not self.rule.step_plans
                or not hasattr(eng, "memo_ready") or not eng.memo_ready()
                or any(pend.no_grad.values())):
            self._update_memo = None
            return None
        stamp = group_stamp(self)
        if stamp is None:
            self._update_memo = None
            return None
        sums = tuple(sorted(pend.sums.items()))
        key = (stamp, tuple(sorted(corr)), tuple(sorted(self._awaiting)), sums,
               tuple(sorted(pend.count.items())), eng.plan_state())
        memo = self._update_memo
        if memo is not None and _same(key, memo.key) and _same(eng.row_values(), memo.values):
            return lambda: eng.replay_step(memo.update, memo.finish)

        def derive():
            eng.check_layout()                # (the backend's step checks it first)
            derived = eng.derive_step(corr)
            if derived is None:               # (a momentum buffer made: the backend's step)
                self._update_memo = None
                return NotImplemented
            derived = tuple(derived)
            if memo is not None and _same(key[1:], memo.key[1:]) and _same(derived, memo.calls):
                # (a schedule: the rows' values moved, not the launches; the launches take
                # each row as its tensor, so the prepared calls read the new values)
                update, finish = memo.update, memo.finish
            else:
                update, finish = eng.prepare(derived), eng.prepare(eng.finish_calls())
            self._update_memo = (UpdateMemo(key, eng.row_values(), derived, update, finish)
                                 if _same(tuple(sorted(pend.sums.items())), sums)
                                 else None)   # (a sum copied into a pool buffer: _acc)
            return eng.replay_step(update, finish)
        return derive

    def _plan_key(self, corr) -> Optional[tuple]:
        """(the groups' stamp, the correction's buckets, the groups waiting for a refresh),
        or None where a group's value can change in place or the rule is not planned."""
        stamp = group_stamp(self) if self.rule.step_plans else None
        if stamp is None:
            return None
        return (stamp, tuple(sorted(corr)), tuple(sorted(self._awaiting)))

    def _planned(self, corr) -> Optional[StepPlan]:
        """The plan for this iteration, if one fits where the optimizer is."""
        plan = self._step_plan
        if not isinstance(plan, StepPlan) or not self.step_plans:
            return None
        if any(self._pending.draws.values()) or self._closure_samples() != 1 \
                or not self._runner.plan_usable():
            return None                       # (a sample drawn and put back; mc_samples)
        key = self._plan_key(corr)
        if key is None or not _same(key[1:], plan.key) \
                or not _same(self._runner.plan_state(), plan.state):
            return None
        return plan

    def _recorded(self, corr, closure):
        """The slow path, recorded when it starts where a plan could; two recordings in a
        row that agree become the plan."""
        eng = self._runner
        key = self._plan_key(corr) if self.step_plans else None
        rec = eng.record() if key is not None and hasattr(eng, "record") else None
        if rec is None:
            self._step_plan = None
            loss = self._closure_loss(corr, closure)
            self._update(corr, None, None)
            return loss
        self._recording = rec
        ok = False
        try:
            loss = self._closure_loss(corr, closure)
            self._update(corr, None, None)
            ok = True
        finally:
            self._recording = None
            eng.stop_recording(rec)
            if not ok:
                self._step_plan = None
        end = eng.plan_state() if eng.plan_ready() and groups_unchanged(self, key[0]) else None
        prev = self._step_plan
        this = (key, rec, end)
        plan = None
        if end is not None and isinstance(prev, tuple) and prev[2] is not None:
            plan = from_recordings(prev, this, eng)
        self._step_plan = plan if plan is not None else this
        return loss

    def _replay(self, plan: StepPlan, corr, closure):
        """One iteration by ``plan``, in ``_closure_loss``'s and ``_update``'s order and
        with their checks.  Where the groups' values or the rows' changed since the plan
        was made (a learning-rate schedule), each part derives its launches again (writing
        the rows) and replays only if they are the planned ones; a part that finds a
        difference runs the slow path's own code, from the state the parts before it
        left, and the plan is dropped."""
        eng = self._runner
        stamp = group_stamp(self)
        settings = eng.plan_settings()
        fast = ((stamp is plan.stamp or _same(stamp, plan.stamp))
                and _same(eng.row_values(), plan.values))
        agreed = [True]
        checked = [0]                         # (the last closure's replay_accumulate)
        losses = []
        try:
            outer = None                      # (how many outer samples: read after the inner)
            for j, (kind, rec, calls, noise, checks, check_calls) in enumerate(plan.samples):
                if kind == KIND_OUTER and outer is None:
                    outer = self._closure_samples()
                    if outer != 1:
                        agreed[0] = False
                        checked[0] = 0
                        for _ in range(outer):
                            self._run_closure(closure, "outer")
                        break
                if self._sample_admitted(kind, True) == 0 and self._sample_as_planned(
                        j, kind, rec, noise, fast, stamp, settings):
                    loss, checked[0] = self._replay_closure(kind, calls, noise, checks,
                                                            check_calls, closure)
                else:
                    agreed[0] = False
                    checked[0] = 0
                    loss = self._run_closure(closure, _KIND_NAME[kind])
                if kind == KIND_INNER:
                    losses.append(loss)
            loss = mean_loss(losses)
        except BaseException:
            self._drop_pending((KIND_INNER, KIND_OUTER))
            raise

        def replay():
            if not (plan.pending_as_planned(self._pending)
                    and _same(eng.plan_state(), plan.update_state)):
                agreed[0] = False
                return NotImplemented
            if not (fast and groups_unchanged(self, stamp)):
                derived = eng.derive_step(corr)
                if derived is None or not _same(tuple(derived), plan.update_calls):
                    agreed[0] = False
                    return NotImplemented
            return eng.replay_step(plan.update, plan.finish, checked[0] == 2,
                                   plan.ahead if fast and groups_unchanged(self, stamp) else None)
        self._update(corr, None, None, replay)
        if not agreed[0]:                     # (recorded again from the next iteration)
            self._step_plan = None
        elif not fast and groups_unchanged(self, stamp):
            plan.stamp, plan.values = stamp, eng.row_values()   # (the rows hold them now)
            plan.ahead = eng.ahead                              # (worked out from them)
        return loss

    def _sample_as_planned(self, j, kind, rec, noise, fast, stamp, settings) -> bool:
        """The sample ``j`` of the plan is the one the slow path would draw now: nothing
        it reads changed since the iteration began (the first: since the plan was made),
        or its launches derived again are the planned ones."""
        eng = self._runner
        if j and not _same(eng.plan_settings(), settings):
            return False
        if fast and (j == 0 or groups_unchanged(self, stamp)):
            return True
        derived = eng.derive_sample(kind)
        return (derived is not None and _same(tuple(derived[1]), rec)
                and _same(tuple(sorted(derived[0].items())), tuple(sorted(noise.items()))))

    def _replay_closure(self, kind, calls, noise, checks, check_calls, closure):
        """``_run_closure`` of a planned sample: the sample's launches, the closure, the
        buffers handed out lent as the sums (or the slow ``_accumulate``).  Returns the
        loss and what ``replay_accumulate`` returned (0: the slow path ran)."""
        eng = self._runner
        pend = self._pending
        try:
            eng.replay_sample(kind, calls, noise)   # (False: the slow sample ran; the rest holds)
        except BaseException:
            eng.restore()
            raise
        self._active = (kind, 0)
        pend.draws[kind] = 1
        ok = False
        try:
            prev = torch.is_grad_enabled()
            torch._C._set_grad_enabled(True)  # (torch.enable_grad(), without its objects)
            try:
                loss = closure()
            finally:
                torch._C._set_grad_enabled(prev)
            done = (self._active == (kind, 0) and not pend.count[kind]
                    and eng.replay_accumulate(kind, checks, check_calls))
            if done:
                self._accumulated(kind, plan_buckets(self), set(), True, True)
            else:
                self._accumulate(clear_grads=True, keep_views=True)
            ok = True
        finally:
            if ok:
                self._active = None
            else:
                self.restore()
        return loss, done
