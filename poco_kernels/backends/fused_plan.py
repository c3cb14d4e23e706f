"""The fused engine's part of a step plan: ``step(closure)``'s steady state recorded once
and replayed (the optimizer's part, the protocol around it, is
:mod:`poco_kernels._step_plan`).

A training loop calls ``step(closure)`` with the same hyperparameters and the same
parameters iteration after iteration, and the engine derives the same kernel arguments
every time: the records from the groups, the hyperparameter rows, the noise streams,
the buffers.  That derivation is most of an iteration's host time at GPT-2's tensor
count.  Here an iteration is recorded (every call into the kernels' wrapper module, with
its arguments); two consecutive recordings that agree call for call, from the same
state to the same state, make a plan, which later iterations replay: the same calls
with the same arguments, and the few assignments of state the slow path makes between
them.  What the slow path checks on every call and a user can change between or inside
iterations (the layout, the ``.grad`` handed out, which parameters a backward reached,
the hooks) is still checked, by the same methods; what the arguments were derived from
is compared by identity (:meth:`PlanMixin.plan_state`), and any difference sends that
part of the iteration down the slow path, from the same state.

Only the one-draw pattern of the IVON family is planned: float32 parameters in
unsharded buckets, ``grad_views``, one sample of each kind per step, no AMP arguments.
The iteration starts from the mean in the parameters, or from the next inner sample a
step left there (``sample_ahead``, and the parked default: then the inner sample makes no
launch).  Everything else runs as before.
"""
from __future__ import annotations

import operator
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .. import _sweeps
from .._protocol import COUNTER_STEPS
from . import fused_grads


class Recording:
    """Stands in for the engine's kernel wrapper module during one iteration: every call
    is recorded (name, positional arguments) and passed on; ``mark`` notes where the
    protocol was (a closure about to run, the update about to start)."""

    def __init__(self, ops, start):
        self._ops = ops
        self.start = start
        self.calls: List[Tuple[str, tuple]] = []
        self.marks: List[Tuple[int, str, Any]] = []
        self.broken = False

    def __getattr__(self, name):
        fn = getattr(self._ops, name)
        if not callable(fn) or name.startswith("_"):
            return fn

        def call(*args, **kwargs):
            if kwargs:
                self.broken = True
            self.calls.append((name, args))
            return fn(*args, **kwargs)
        return call

    def mark(self, what: str, snapshot) -> None:
        self.marks.append((len(self.calls), what, snapshot))


def same(a, b) -> bool:
    """Two recorded values agree: tensors (and other objects) by identity, numbers,
    strings, None and tuples of them by value (item by item by identity first: C speed
    when nothing changed)."""
    if a is b:
        return True
    if type(a) is tuple and type(b) is tuple and len(a) == len(b) \
            and all(map(operator.is_, a, b)):
        return True
    if isinstance(a, Tensor) or isinstance(b, Tensor) or type(a) is not type(b):
        return False
    if isinstance(a, tuple):
        return len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, (int, float, str, bool)):
        return a == b
    return False


class PlanMixin:
    """Recording and replaying the engine's part of ``step(closure)``."""

    def plan_state(self) -> tuple:
        """What a planned call's arguments were derived from, for comparison by
        :func:`same`, besides the groups' values and the rows' (:meth:`row_values`): the
        buckets, their parameter, gradient and state buffers, the control tensors and the
        rows of the samples and steps, the view's settings the derivation reads."""
        out: List[Any] = [*self.plan_settings(), self.params_hold_mean, self.ahead is None,
                          not self.mom_start]
        for b in self.view.buckets:
            buffers = b.buffers
            out += (b, b.flat_param, b.handed, *(b.swapped or (None, None)), b.presence,
                    *buffers, *buffers.values(), *[gb.flat for gb in b.grad_bufs])
        out += self.ctl.values()
        out += [x for (_, name), r in self.rows.rows.items() if name != "refresh"
                for x in (r, r.row)]          # (a step's launches read the others)
        return tuple(out)

    def plan_settings(self) -> tuple:
        """The view's settings a sample's launches read (a closure may set them)."""
        v = self.view
        return (v.check_finite, v.grad_views, v.sample_ahead, v.noise_version, v.seed)

    def row_values(self) -> tuple:
        """The values last written to the rows of the samples and steps."""
        return tuple(r.floats for (_, name), r in self.rows.rows.items() if name != "refresh")

    def derive_sample(self, kind: int):
        """The noise records and launches a sample of ``kind`` (draw 0) makes from here
        (its rows written), or None where it is not a planned one (no noise, or the
        parameters moved to the mean buffer first)."""
        view = self.view
        noise, out = {}, []
        if self.takes_ahead(kind, 0):         # (the step wrote it: nothing moves)
            return {b.index: self.noise_of(kind, b, 0) for b in view.buckets}, out
        for b in view.buckets:
            spec = view.spec(b, kind, 0)
            is_mean = spec.centre is b.buffers["mean"]
            if spec.noise is None or (self.params_hold_mean and not is_mean):
                return None
            sync = self.params_hold_mean and is_mean and b.param_dtype == b.dtype
            noise[b.index], launches = self._sample_launches(b, spec, kind, sync)
            out += launches
        return noise, out

    def derive_step(self, corr) -> Optional[list]:
        """The launches the step makes from here (its rows written), or None where it makes
        a momentum buffer."""
        out = []
        nxt = self.ahead_family()
        for b in self.view.buckets:
            made, launches = self._step_launches(b, corr, nxt, None, None)
            if made is not None:
                return None
            out += launches
        return out

    def finish_calls(self) -> list:
        """The counters' advance after a step (``_finish``'s launches, no AMP)."""
        return [("finish", (c, None, COUNTER_STEPS)) for c in self.ctl.values()]

    def memo_ready(self) -> bool:
        """A step's update may be replayed from its derived launches (the optimizer's
        :meth:`~poco_kernels._step_plan.StepPlanMixin._memo_update`): eagerly, over
        unsharded buckets (no all-reduce of the bad flag first), no momentum buffer waiting
        for its first step."""
        return (self.plan_usable() and bool(self.view.buckets) and not self.mom_start
                and all(b.segments is None for b in self.view.buckets))

    def plan_usable(self) -> bool:
        """Plans are recorded and replayed eagerly only: not while torch.compile traces or a
        CUDA graph is captured (a capture holds the slow path's launches, as before)."""
        return not (torch.compiler.is_compiling() or fused_grads._capturing())

    def plan_ready(self) -> bool:
        """The engine is where a planned iteration starts: the mean in the parameters and
        nothing ahead, or the next inner sample there (a step left it); every trainable
        parameter's ``.grad`` the view handed out."""
        if (not self.view.grad_views or (self.ahead is None) != self.params_hold_mean
                or self.mom_start or not self.plan_usable()):
            return False
        for b in self.view.buckets:
            if (b.segments is not None or b.param_dtype != b.dtype or b.handed is None
                    or b.swapped or b.presence is None
                    or _sweeps.grads(b.params, b.grad_bufs[b.handed].views)[1]
                    != len(b.params)):
                return False
        return bool(self.view.buckets)

    def record(self) -> Optional[Recording]:
        """Record the calls into the kernels from here (None: the engine is not where a
        plan starts)."""
        if isinstance(self.ops, Recording) or not self.plan_ready():
            return None
        rec = Recording(self.ops, self.plan_state())
        self.ops = rec
        return rec

    def stop_recording(self, rec: Recording) -> None:
        if self.ops is rec:
            self.ops = rec._ops

    # ------------------------------------------------------------------ replay
    def prepare(self, calls) -> list:
        """Recorded calls ``(name, args)`` as ``(function, arguments)`` the wrapper module
        prepared once (its records converted)."""
        return [self.ops.prepare(name, args) for name, args in calls]

    def replay_sample(self, kind: int, calls, noise: Dict[int, Any]) -> bool:
        """:meth:`~.fused_samples.SamplesMixin.sample` of a planned kind: the checks and
        the hand-out as always, then the recorded launches (none: the sample the step
        left in the parameters).  False: the checks found that sample gone (a parameter
        re-linked with another value), and the slow path's sample ran instead."""
        self.check_and_hand_out()
        if not calls and self.ahead is None:
            self.sample(kind, 0)
            return False
        if calls:
            self.ahead = None
        for fn, args in calls:
            fn(*args)
        self.active_noise.update(noise)
        self.params_hold_mean = False
        return True

    def replay_accumulate(self, kind: int, checks, check_calls) -> int:
        """:meth:`~.fused_samples.SamplesMixin.accumulate` of a planned kind, when every
        bucket's ``.grad`` are still the views handed out, each reached by the backward,
        and the buffer handed out is the recorded one (``checks``: per bucket the buffer
        and its control tensor; ``check_calls``: their prepared finiteness checks): the
        buffer becomes the pending sum.  0 (nothing done): the slow path's turn; 1: done;
        2: done, and every parameter is still the view of its flat buffer (the same
        sweep: :meth:`replay_step` need not check the layout again)."""
        buckets = self.view.buckets
        sums = self.view.pending.sums
        lent = {id(t) for t in sums.values()}
        flat = True
        for b, (grad, _) in zip(buckets, checks):
            gb = b.grad_bufs[b.handed] if b.handed is not None else None
            if (gb is None or gb.flat is not grad or id(grad) in lent
                    or (kind, b.index, "g") in sums or not b.presence.all()):
                return 0
            ptrs = self.cached_addresses(b)   # (None: the layout is checked by the update)
            same, _, matching, _, _ = _sweeps.scan(b.params, ptrs, gb.views, False, None, 0)
            if matching != len(b.params):
                return 0
            flat = flat and ptrs is not None and same
        for b, (grad, _), (fn, args) in zip(buckets, checks, check_calls):
            b.grad_bufs[b.handed].clean = None        # (it holds a gradient now)
            fn(*args)
            sums[(kind, b.index, "g")] = grad
        self._complete = frozenset()
        return 2 if flat else 1

    def replay_step(self, calls, finish, checked: bool = False,
                    ahead: Optional[dict] = None) -> Optional[bool]:
        """:meth:`~.fused.FusedBackend.step` with the recorded launches and counter
        advances (``finish``: ``_finish``'s; ``checked``: the last closure's
        :meth:`replay_accumulate` returned 2, and nothing since moved a parameter or a
        ``.grad``: no layout to check, no views to hand out after; ``ahead``: the key of
        the next sample the launches write, as a plan recorded it where the groups are
        the same objects, else None: worked out)."""
        if not checked:
            self.check_layout()
        self._views_kept = checked
        self.ahead = None
        nxt = self.ahead_family()             # (the launches write the next sample)
        for fn, args in calls:
            fn(*args)
        self.params_hold_mean = not nxt
        if nxt:
            self.ahead = ahead if ahead is not None else self._ahead_key()
        taken = self._raise_if_bad(COUNTER_STEPS, None) if self.view.check_finite else None
        for fn, args in finish:
            fn(*args)
        if taken:
            self.mom_start.clear()
        return taken
