"""What a call that fails puts back: gradients a failed ``sampled()`` block left, pending
sums, buffers a skipped update made, parameters a step skips; the closure run and the AMP
arguments' checks (the transactional half of the sampling protocol); how the public
calls are entered (torch.optim's step hooks, grad mode)."""
from __future__ import annotations

import functools
import sys
from typing import Callable, Dict, FrozenSet, List, Optional, Tuple

import torch
import torch.autograd.profiler as _profiler
import torch.optim.optimizer as _torch_optimizer
from torch import Tensor

from . import _sweeps
from ._protocol import KIND_INNER
from ._validation import check



def step_hooks(step: Callable) -> Callable:
    """``step`` as ``torch.optim`` wraps it (its pre and post hooks, global and per
    optimizer; its profiler range ``Optimizer.step#<class>.step``), by ``torch.optim``'s own
    wrapper whenever a pre hook is registered or a profiler runs (started from Python or
    not); otherwise straight to ``step``, then the post hooks registered by then (torch's
    wrapper reads them after the step too): the profiler range alone costs a dispatcher
    call on entry and exit, about 7 us per step on this project's CPUs.  Marked ``hooked``
    so that ``torch.optim`` does not wrap it again; a subclass's own ``step``, which
    ``torch.optim`` does wrap, reaches this one through ``super().step()`` and runs the
    hooks once, in its wrapper."""
    wrapped = torch.optim.Optimizer.profile_hook_step(step)
    pre = getattr(_torch_optimizer, "_global_optimizer_pre_hooks", None)
    post = getattr(_torch_optimizer, "_global_optimizer_post_hooks", None)
    known = isinstance(pre, dict) and isinstance(post, dict)   # (else torch's wrapper always)
    profiling = torch._C._autograd._profiler_enabled

    @functools.wraps(step)
    def hooked(self, *args, **kwargs):
        if type(self).step is not hooked:     # (a subclass's step, in torch's wrapper)
            return step(self, *args, **kwargs)
        if (not known or pre or self._optimizer_step_pre_hooks
                or _profiler._is_profiler_enabled or profiling()):
            return wrapped(self, *args, **kwargs)
        out = step(self, *args, **kwargs)
        self._optimizer_step_code()
        if post or self._optimizer_step_post_hooks:
            for hook in (*self._optimizer_step_post_hooks.values(), *post.values()):
                hook(self, args, kwargs)
        return out
    hooked.hooked = True
    return hooked


def outside_dynamo(fn: Callable) -> Callable:
    """``fn`` as ``torch._disable_dynamo`` makes it (Dynamo never traces it: a graph break
    where a compiled function calls it, and the frames it runs are not compiled), straight
    to ``fn`` while no Dynamo callback is set (eager code, nothing compiling or exporting,
    the default stance): there torch's wrapper would set the callback it finds, None,
    around the call (two ``set_eval_frame`` calls, about 0.5 us per public call; while
    exporting, it also annotates the graph).  The wrapper's own frame is one Dynamo skips
    (as it skips torch's); a torch without that switch gets torch's wrapper alone."""
    disabled = torch._disable_dynamo(fn)
    try:
        from torch._C._dynamo.eval_frame import (_FrameAction, _FrameExecStrategy,
                                                 get_eval_frame_callback,
                                                 set_code_exec_strategy)
    except ImportError:                       # (private switches: absent, no shortcut)
        return disabled
    modules = sys.modules
    exporting = torch.compiler.is_exporting

    @functools.wraps(fn)
    def inner(*args, **kwargs):
        if get_eval_frame_callback() is None and not exporting():
            frames = modules.get("torch._dynamo.eval_frame")    # (a stance needs it loaded)
            if frames is None or frames._stance.stance == "default":
                return fn(*args, **kwargs)
        return disabled(*args, **kwargs)
    inner._torchdynamo_disable = True         # (not inlined where a compiled function calls it)
    set_code_exec_strategy(inner.__code__,    # (and its frame not compiled when it runs)
                           _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT))
    return inner


def parking(fn: Callable) -> Callable:
    """A public call of an optimizer whose engine may park (``backends/fused_park.py``):
    the engine unparked before ``fn`` runs (inside, it holds ``sample_ahead``'s state) and
    parked after it where it may (no sample active, the next sample in the parameters):
    between public calls the parameters hold the mean.  A call made inside another (a
    failure's ``restore()``) leaves it to the outer one."""
    @functools.wraps(fn)
    def inner(self, *args, **kwargs):
        d = self.__dict__
        if d.get("_in_call"):
            return fn(self, *args, **kwargs)
        eng = d.get("_runner")
        if eng is not None:
            if eng.parked:
                eng.unpark()
            eng.adopt_edits()                 # (parameters written between calls)
        d["_in_call"] = True
        try:
            return fn(self, *args, **kwargs)
        finally:
            d["_in_call"] = False
            eng = d.get("_runner")            # (a constructor's, or a copy's, made inside)
            if eng is not None:
                if d.get("_active") is None and eng.may_park():
                    eng.park()
                eng.note_versions()
    return inner


def reading(fn: Callable) -> Callable:
    """A public call that reads the optimizer and writes nothing (``state_dict``): run as
    the engine is, parked or not, where nothing in it needs the engine's own state (every
    parameter still the view the engine made, the trainable set as laid out); else as
    :func:`parking`.  No version counter moves, so a graph that saved a parameter before
    it can still be differentiated, as under the copy protocol."""
    unparking = parking(fn)

    @functools.wraps(fn)
    def inner(self, *args, **kwargs):
        d = self.__dict__
        eng = d.get("_runner")
        if (eng is None or not eng.parked or d.get("_in_call") or not eng.reads_parked()
                or self._trainable_changed()):
            return unparking(self, *args, **kwargs)
        d["_in_call"] = True
        try:
            return fn(self, *args, **kwargs)
        finally:
            d["_in_call"] = False
    return inner


def without_grad_mode(fn: Callable) -> Callable:
    """``fn`` under ``torch.no_grad()``, entered by hand (torch's decorator makes two
    context-manager objects per call: about 1.5 us more)."""
    set_enabled = torch._C._set_grad_enabled

    @functools.wraps(fn)
    def inner(*args, **kwargs):
        prev = torch.is_grad_enabled()
        set_enabled(False)
        try:
            return fn(*args, **kwargs)
        finally:
            set_enabled(prev)
    return inner


class TransactionMixin:
    """The helpers of :class:`~poco_kernels._posterior.PosteriorOptimizer` that keep a failed
    or skipped call from changing anything."""

    #: a step plan's recording of the iteration in progress (``poco_kernels._step_plan``)
    _recording = None

    @outside_dynamo
    def _grads_now(self) -> List[Tuple[Tensor, Optional[Tensor], int]]:
        """Every parameter's ``.grad`` and its version counter (no copy), for
        :meth:`_put_back_grads`."""
        out = []
        for group in self._groups:
            out += _sweeps.grads_now(dict.__getitem__(group, "params"))   # (in C)
        return out

    @outside_dynamo
    def _put_back_grads(self, saved) -> None:
        """Drop the gradients a failed ``sampled()`` block left in ``.grad``: a ``.grad``
        that was None is None again, one that was replaced is put back, and one the
        backward accumulated into in place (a zeroed ``.grad``, or a view of the fused
        backends' gradient buffer, zero when the sample handed it out) is zeroed.
        Otherwise the next block's backward would add to them (a loop that relies on
        ``accumulate()`` clearing ``.grad`` calls no ``zero_grad()``)."""
        with torch.no_grad():
            for p, g, version in saved:
                if g is not None and g._version != version:
                    if g.grad_fn is not None:
                        g.detach_()
                    g.zero_()
                if p.grad is not g:
                    p.grad = g

    def _drop_pending(self, kinds) -> None:
        """A call failed after collecting gradients of ``kinds``: drop them and what
        collecting them noted, and put back what the parameters held before the call: the
        mean, or the next sample a step left there (``sample_ahead``)."""
        self._pending.clear(kinds)
        self._runner.discard()
        was_ahead = self._was_ahead and KIND_INNER in kinds
        if not self._runner.params_hold_mean or was_ahead:
            self.restore()
            if was_ahead:                     # (drawn again: the closure may have written
                self._runner.ahead = None     # into it through .data, which nothing sees)
                self._runner.prefetch()

    def _closure_samples(self, group_key: str = "mc_samples") -> int:
        # (dict.get: the key is not one of ParamGroup's aliases, whose lookups run Python)
        return max([int(dict.get(g, group_key, 1)) for g in self._groups])

    def _run_closure(self, closure: Callable, kind: str) -> Tensor:
        """One evaluation at a ``kind`` sample.  A backend whose update rewrites the
        parameters leaves the sample there (the next sample or the update overwrites it)."""
        self._sample(kind, trainable_checked=True)
        rec = self._recording
        if rec is not None:                   # (a step plan's recording: the sample done)
            rec.mark("closure", (*self._active, tuple(sorted(self._runner.active_noise.items()))))
        ok = False
        try:
            with torch.enable_grad():
                loss = closure()
            self._accumulate(clear_grads=True, keep_views=True)
            ok = True
        finally:
            if ok and self._runner.lazy_restore:
                self._active = None
            else:
                self.restore()
        return loss

    #: torch.amp.GradScaler.step(opt) passes the scale and its inf check as the attributes
    #: ``grad_scale`` and ``found_inf``, as to torch's fused optimizers
    _step_supports_amp_scaling = True

    def _scaler_value(name: str):             # noqa: N805 - a property factory
        """An attribute GradScaler sets before ``step()`` and deletes after it: kept in the
        instance until a step takes it (so a step that raises leaves no stale one);
        absent (AttributeError) otherwise, as GradScaler's ``getattr`` default expects."""
        key = f"_scaler_{name}"

        def get(self):
            try:
                return self.__dict__[key]
            except KeyError:
                raise AttributeError(name) from None

        def put(self, value):
            self.__dict__[key] = value

        def drop(self):
            self.__dict__.pop(key, None)
        return property(get, put, drop)

    grad_scale = _scaler_value("grad_scale")
    found_inf = _scaler_value("found_inf")
    del _scaler_value

    def _scaler_arguments(self, grad_scale, found_inf):
        """``grad_scale``, ``found_inf`` of a ``step()``: the arguments, or those that
        torch.amp.GradScaler set as attributes (taken: none outlives this step).
        GradScaler reads its inf checks from ``.grad``, so with gradients already in the
        optimizer's sums (``sampled()``) its check saw none of them: refused, nothing
        changed (poco_kernels.amp.GradScaler takes the optimizer's own check)."""
        d = self.__dict__
        if "_scaler_grad_scale" not in d and "_scaler_found_inf" not in d:
            return grad_scale, found_inf
        set_scale, set_found = d.pop("_scaler_grad_scale", None), d.pop("_scaler_found_inf", None)
        if grad_scale is not None or found_inf is not None:
            return grad_scale, found_inf
        grad_scale, found_inf = set_scale, set_found
        if any(self._pending.count.values()):
            raise RuntimeError(
                "torch.amp.GradScaler.step(opt) checks .grad for infs, and the gradients of "
                "this step are already in the optimizer's sums (sampled()/accumulate()): "
                "use poco_kernels.amp.GradScaler, which takes the optimizer's own check "
                "(docs/design.md, 'AMP'); nothing was changed")
        if found_inf is not None and not isinstance(found_inf, Tensor):   # (no .grad seen)
            found_inf = torch.tensor(float(found_inf))
        return grad_scale, found_inf

    def _found_inf(self, kinds) -> Tensor:
        """A float32 scalar on the device of the first bucket, 1 where a pending sum of
        ``kinds`` (or, sharded, any rank's) holds a non-finite value, else 0: read on the
        device, no synchronisation (poco_kernels.amp.GradScaler's inf check)."""
        return self._runner.found_inf(frozenset(kinds))

    def _check_amp(self, grad_scale, found_inf) -> None:
        """AMP arguments: one-element real tensors, as torch.amp.GradScaler passes them;
        ``grad_scale`` positive and finite, checked where reading it is free (a CPU tensor,
        or the torch backend, which reads its gradients anyway)."""
        if grad_scale is None and found_inf is None:
            return                            # (the messages below are not built for nothing)
        for name, t in (("grad_scale", grad_scale), ("found_inf", found_inf)):
            check(t is None or (isinstance(t, Tensor) and t.numel() == 1 and t.dim() <= 1
                                and not t.is_complex() and t.device.type != "meta"),
                  f"{name} must be None or a one-element real tensor (torch.amp.GradScaler's)"
                  f", got {type(t).__name__}"
                  f"{'' if not isinstance(t, Tensor) else f' of shape {tuple(t.shape)}'}")
        if grad_scale is None:
            return
        check(grad_scale.is_floating_point(),
              f"grad_scale must be a float tensor, got {grad_scale.dtype}")
        if self._runner.host_readable(grad_scale):
            v = float(grad_scale.detach().reshape(()))
            check(v > 0 and v != float("inf"), f"grad_scale must be finite and > 0, got {v}")

    def _drop_new_buffers(self, had) -> None:
        """An update not taken leaves no buffer made at its first use (SGD's momentum)."""
        for b, names in zip(self._buckets, had):
            new = [n for n in b.buffers if n not in names]
            for n in new:
                del b.buffers[n]
            if new:
                self._expose(b)

    def _without_grad(self, kinds) -> FrozenSet[Tuple[int, int]]:
        """The parameters that had no gradient at any sample of ``kinds`` collected for
        this update (``(bucket, index)``).  If that is every trainable parameter, the
        update is refused (pending gradients dropped): a closure that forgot
        ``backward()`` must not train on zeros."""
        pend = self._pending
        sets = [pend.no_grad[k] for k in kinds if pend.count[k]]
        missing = frozenset.intersection(*sets) if sets else frozenset()
        if missing and len(missing) == sum([len(b.params) for b in self._buckets]):
            self._drop_pending(kinds)
            what = "step" if KIND_INNER in kinds else "refresh"
            raise RuntimeError(
                f"no parameter received a gradient for this {what} (every .grad was None, "
                "nothing was updated): did the closure call loss.backward()?  With "
                "sample()/accumulate(), call backward() inside the `with "
                "optimizer.sampled():` block.")
        return missing

    def _save_params(self, which) -> List[Tuple[Tensor, Tensor, Dict[str, Tensor]]]:
        """Copies of the value and state of parameters a step skips (no gradient)."""
        out = []
        for bi, i in sorted(which):
            b = self._buckets[bi]
            p = b.params[i]
            out.append((b.local(i), {n: v.clone() for n, v in self.state[p].items()}, p))
        return out

    def _put_back(self, saved) -> None:
        """A skipped parameter's value and state as they were before the step (a buffer
        the step created, as SGD's momentum, stays zero for it)."""
        with torch.no_grad():
            for loc, state, p in saved:
                for n, v in self.state[p].items():
                    if n in state:
                        v.copy_(state[n])
                    else:
                        v.zero_()
                loc.copy_(state["mean"])        # (the parameter may hold a sample)
