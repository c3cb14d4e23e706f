"""The sampling protocol of the diagonal family (:class:`PosteriorOptimizer`):
``sample(kind)`` writes ``theta = centre + sigma * eps`` into the parameters,
``accumulate()`` folds ``.grad`` into the running estimate of that sample, ``restore()`` puts
the posterior mean back; ``step(closure)`` and ``refresh(closures)`` drive it.  The updates
themselves are the backend's."""
from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Iterable, Optional, Set

import torch
from torch import Tensor

from . import _sweeps
from . import noise as _noise
from ._groups import _from_lightning, as_closures
from ._optimizer import BucketedOptimizer
from ._protocol import KIND_INNER, KIND_NAMES, KIND_OUTER, KIND_REFRESH, Pending, mean_loss
from ._step_plan import StepPlanMixin
from ._transaction import (TransactionMixin, outside_dynamo, parking, step_hooks,
                           without_grad_mode)
from ._validation import check


class PosteriorOptimizer(StepPlanMixin, TransactionMixin, BucketedOptimizer):
    """The sampling protocol (``sample``/``accumulate``/``restore``, ``sampled``) and the
    closure-driven ``step``/``refresh`` of the diagonal family.

    What a subclass's algorithm does (samples, updates, kernel records) is its rule's
    (:mod:`poco_kernels.rules`); the backends run it.
    """

    def _check_pending(self, pend: Pending, awaiting: Set[int]) -> None:
        """Every noisy kind's sums carry their ``gradient * eps`` sum (the state dict has
        the torch backend's layout), where the family estimates Hessians."""
        if not self.rule.uses_hessian:
            return
        for (k, bi, n) in list(pend.sums):
            if n != "g":
                continue
            b = self._buckets[bi]
            if k == KIND_OUTER and b.group_index in awaiting:
                continue
            noisy = self.rule.sample_spec(b, self._groups[b.group_index], k, 0).noise
            check(noisy is None or (k, bi, "ge") in pend.sums,
                  f"state dict's pending gradients: sample kind {k}, bucket {bi} has a "
                  "gradient sum but not its gradient * eps sum")

    # ------------------------------------------------------------------ low-level API
    # torch.compile: the protocol's bookkeeping (``self._active``, the counters) runs
    # outside Dynamo (``outside_dynamo``, torch's ``_disable_dynamo`` where Dynamo is on:
    # a graph break around sample, restore, step and refresh).  Dynamo does not write
    # back attributes assigned on a torch.optim.Optimizer while it traces (it wraps the
    # optimizer without tracking its mutations), so a traced sample() would leave no
    # active sample behind it.
    @outside_dynamo
    @parking
    def sample(self, kind: str = "inner") -> None:
        """Write a posterior sample into the parameters.

        ``kind``: ``"inner"`` (the current posterior, once per Monte-Carlo sample of a
        step), ``"outer"`` (the outer posterior of the correction, same mini-batch) or
        ``"refresh"`` (the current posterior, ONE sample for the whole mega-batch).
        Follow with any number of backward passes, then :meth:`accumulate` (once per
        chunk) and :meth:`restore`.
        """
        self._sample(kind, trainable_checked=False)

    def _sample(self, kind: str, trainable_checked: bool) -> None:
        """:meth:`sample` (``trainable_checked``: step/refresh followed ``requires_grad``
        already, the closures cannot change it unnoticed: accumulate sees their grads)."""
        if kind not in KIND_NAMES:            # (the message is built only when it is raised)
            check(False, f"kind must be one of {tuple(KIND_NAMES)}, got {kind!r}")
        k = KIND_NAMES[kind]
        draw = self._sample_admitted(k, trainable_checked)
        try:
            self._runner.sample(k, draw)
        except BaseException:
            self._runner.restore()
            raise
        self._active = (k, draw)
        self._pending.draws[k] = draw + 1

    def _sample_admitted(self, k: int, trainable_checked: bool) -> int:
        """The checks of a sample of kind ``k`` (nothing changes if one fails); its draw."""
        if self._active is not None:
            raise RuntimeError("a sample is already in the parameters: call restore() first")
        if k == KIND_REFRESH and not self.rule.has_correction:
            raise RuntimeError(f"{type(self).__name__} has no outer loop: no refresh sample")
        self._check_no_mix(k)
        if not trainable_checked:
            self._check_trainable()
        if k == KIND_OUTER and not self.correction_active():
            raise RuntimeError("no outer sample: the correction is not active "
                               "(no refresh yet, or alpha == 0 in every group)")
        draw = self._pending.draws[k]
        if draw >= _noise.MAX_DRAWS:
            check(False, f"at most {_noise.MAX_DRAWS} samples of one kind per step: call "
                         "step() or refresh()")
        return draw

    def _check_no_mix(self, k: int) -> None:
        """Gradients for a step and for a refresh are not collected at the same time (each
        update consumes its own; a non-finite one must not refuse the other)."""
        cnt = self._pending.count
        if k == KIND_REFRESH and (cnt[KIND_INNER] or cnt[KIND_OUTER]):
            raise RuntimeError("gradients for a step are pending: call step() before "
                               "collecting refresh gradients")
        if k != KIND_REFRESH and cnt[KIND_REFRESH]:
            raise RuntimeError("refresh gradients are pending: call refresh() before "
                               "collecting gradients for a step")

    def accumulate(self, clear_grads: bool = True) -> None:
        """Fold the parameters' ``.grad`` into the estimate of the active sample and clear
        ``.grad`` (so the next sample starts from zero).  Call once per sample (Monte Carlo)
        or once per chunk of a mega-batch."""
        self._accumulate(clear_grads, keep_views=False)

    def _accumulate(self, clear_grads: bool, keep_views: bool) -> None:
        """:meth:`accumulate`; ``keep_views`` (``step(closure)``, where nothing runs
        before the next sample or the update): the ``.grad`` that are views of a fused
        backend's gradient buffers are not cleared (the next sample hands out zeroed
        ones, the update leaves them): two sweeps over the parameters less per sample."""
        if self._active is None:
            raise RuntimeError("accumulate() needs an active sample: call sample() first")
        k, draw = self._active
        unwritten = self._runner.unwritten()
        views = self._runner.accumulate(k, draw, lend=clear_grads)
        self._accumulated(k, views, unwritten, clear_grads, keep_views)

    def _accumulated(self, k: int, views, unwritten, clear_grads: bool, keep_views: bool):
        """What :meth:`_accumulate` notes once the backend has folded the gradients in
        (``views``: the buckets whose ``.grad`` were the views it handed out)."""
        present = views | self._runner.complete()       # (buckets with no None .grad)
        if len(present) == len(self._buckets):  # (every bucket's .grad there: the usual case)
            missing = frozenset(unwritten)
        else:
            missing = frozenset({(b.index, i) for b in self._buckets if b.index not in present
                                 for i, p in enumerate(b.params) if p.grad is None} | unwritten)
        self._pending.note_grads(k, missing)
        self._pending.count[k] += 1
        if not clear_grads:
            return
        kept = frozenset()
        if keep_views and views:
            sets = [self._buckets[i].ids() for i in views]
            kept = sets[0] if len(sets) == 1 else frozenset().union(*sets)
        if not kept and not torch.compiler.is_compiling():
            for group in self._groups:
                _sweeps.set_grads(group["params"], None)     # (in C)
        elif len(kept) != sum([len(dict.__getitem__(g, "params")) for g in self._groups]):
            for group in self._groups:
                for p in group["params"]:
                    if id(p) not in kept:
                        p.grad = None

    @outside_dynamo
    @parking
    def restore(self) -> None:
        """Put the posterior mean back into the parameters (ends the active sample)."""
        eng = self._runner
        if not eng.keeps_sample():            # (else parked on the way out: nothing moves)
            eng.restore()
        self._active = None

    @contextlib.contextmanager
    def sampled(self, kind: str = "inner", accumulate: bool = True):
        """``with opt.sampled(kind): loss.backward()`` = sample, (backward), accumulate,
        restore.  A block that accumulated itself (a chunk at a time) and left no
        ``.grad`` after its last ``accumulate()`` adds nothing more (not a chunk of zeros).
        On an exception the mean is restored and, unless the block accumulated itself,
        the sample is forgotten, and with it the gradients the block left in ``.grad``:
        the next draws and gradients are those of an optimizer that never entered the
        block."""
        self.sample(kind)
        k, draw = self._active
        count = self._pending.count[k]
        grads = self._grads_now()
        ok = False
        try:
            yield self
            if accumulate and not (self._pending.count[k] > count and not any(
                    _sweeps.grads(g["params"], None)[0] for g in self._groups)):
                self.accumulate()
            ok = True
        finally:
            self.restore()
            if not ok:                        # (a sample the step left is drawn again: the
                self._runner.ahead = None     # block may have written it through .data)
            if not ok and self._pending.count[k] == count:
                self._pending.draws[k] = draw
                self._put_back_grads(grads)

    # ------------------------------------------------------------------ step
    @step_hooks
    @outside_dynamo           # (see sample(); the closure runs eagerly too)
    @parking
    @without_grad_mode
    def step(self, closure: Optional[Callable] = None, *, grad_scale: Optional[Tensor] = None,
             found_inf: Optional[Tensor] = None):
        """One inner step.

        With a ``closure`` (zeroes grads, forward, backward, returns the loss): evaluate it
        at ``mc_samples`` inner samples and, once the correction is active, at as many
        outer samples on the same mini-batch; returns the mean loss at the inner samples.

        Without: use what :meth:`sample`/:meth:`accumulate` collected.  AMP: gradients are
        divided by ``grad_scale``; a nonzero ``found_inf`` skips the step, leaving the
        state as it was.

        A step refused before the update (call order, hyperparameters) keeps the collected
        gradients; an update that runs (taken, skipped, or refused for non-finite
        gradients) consumes them.
        """
        if self._active is not None:
            raise RuntimeError("step() while a sample is in the parameters: call restore() first")
        self._check_groups()
        grad_scale, found_inf = self._scaler_arguments(grad_scale, found_inf)
        self._check_amp(grad_scale, found_inf)
        pend = self._pending
        self._check_no_mix(KIND_INNER)
        self._check_trainable()
        corr = self._corrected_buckets()
        loss = None
        #: the parameters held the next sample: a failure puts it back, not the mean
        self._was_ahead = self._runner.ahead is not None
        if closure is not None:
            if self.rule.has_correction and self._refreshes == 0 and not self._warned_lightning \
                    and _from_lightning(closure):
                self._warned_lightning = True
                warnings.warn(f"{type(self).__name__} under Lightning's automatic optimization "
                              "takes IVON's steps: nothing here calls refresh(), so the "
                              "correction never starts. Use poco_kernels.integrations."
                              "lightning.PoCoLightningModule (docs/integrations.md)",
                              stacklevel=2)
            if pend.count[KIND_INNER] or pend.count[KIND_OUTER]:
                raise RuntimeError("step(closure) with gradients already accumulated by "
                                   "sample()/accumulate(): call step() without a closure, or "
                                   "use one protocol per step")
            self._update_memo = None          # (the other protocol's: no reference kept)
            if grad_scale is None and found_inf is None:
                plan = self._planned(corr)
                if plan is not None:
                    return self._replay(plan, corr, closure)
                return self._recorded(corr, closure)
            self._step_plan = None            # (no reference kept to what it was made from)
            loss = self._closure_loss(corr, closure)
        else:
            self._step_plan = None
            if pend.count[KIND_INNER] == 0 and self.rule.noisy:
                raise RuntimeError(
                    f"{type(self).__name__}.step() needs gradients at a posterior sample: pass a "
                    "closure, or run the backward pass inside `with optimizer.sampled():` "
                    "(see the README, 'Training loops without closures'). A training loop "
                    "that owns step(), such as the Hugging Face Trainer's, needs "
                    "poco_kernels.integrations (docs/integrations.md): "
                    "poco_kernels.integrations.hf.PoCoTrainer in place of Trainer")
            if (corr and pend.count[KIND_OUTER] == 0
                    and not self._runner.skipped_on_host(found_inf)):
                raise RuntimeError(
                    "the posterior correction is active but no gradient at the outer sample "
                    "was given: pass a closure to step(), or also run `with "
                    "optimizer.sampled('outer'):` on the same mini-batch, then step()")
            if pend.count[KIND_INNER] == 0:
                # noiseless optimizer, torch-style use: the gradients in .grad are at the mean
                self._sync_mean()
                self._active = (KIND_INNER, 0)
                self._runner.at_mean()
                try:
                    self.accumulate(clear_grads=False)
                finally:
                    self._active = None
        memo = (self._memo_update(corr) if closure is None and grad_scale is None
                and found_inf is None else None)
        self._update(corr, grad_scale, found_inf, memo)
        return loss

    def _closure_loss(self, corr, closure):
        """step(closure)'s evaluations: ``mc_samples`` at inner samples and, under the
        correction, as many at outer samples; the mean loss at the inner ones."""
        try:
            losses = [self._run_closure(closure, "inner")
                      for _ in range(self._closure_samples())]
            if corr:
                for _ in range(self._closure_samples()):
                    self._run_closure(closure, "outer")
            return mean_loss(losses)
        except BaseException:
            self._drop_pending((KIND_INNER, KIND_OUTER))
            raise

    def _update(self, corr, grad_scale, found_inf, replay=None) -> None:
        """The inner update from the pending sums (``replay``: a step plan's, which returns
        whether it was taken, or ``NotImplemented`` for the backend's own step)."""
        pend = self._pending
        skip = self._without_grad((KIND_INNER, KIND_OUTER))
        saved = self._save_params(skip) if skip else None
        had = [set(b.buffers) for b in self._buckets]
        rec = self._recording
        if rec is not None:
            rec.mark("update", (self._runner.plan_state(), tuple(sorted(pend.sums.items())),
                                tuple(sorted(pend.count.items()))))
        try:
            taken = NotImplemented if replay is None else replay()
            if taken is NotImplemented:
                taken = self._runner.step(corr, grad_scale, found_inf)
        except BaseException:
            self._drop_new_buffers(had)
            self._drop_pending((KIND_INNER, KIND_OUTER))
            raise
        finally:
            pend.clear((KIND_INNER, KIND_OUTER))
            self._eps_cache.clear()
            if saved:
                self._put_back(saved)
            self._runner.after_update()
        if taken:
            self._step += 1
        elif taken is False:
            self._drop_new_buffers(had)
        if self._runner.ahead_family() and (saved or self._runner.ahead is None):
            # the torch backend, or parameters put back without a gradient: the next
            # sample by a sample pass (the fused kernels wrote it in the step's pass)
            self._runner.restore()
            self._runner.prefetch()

    # ------------------------------------------------------------------ refresh
    @outside_dynamo
    @parking
    @without_grad_mode
    def refresh(self, closures: Optional[Iterable[Callable]] = None, *,
                grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None):
        """Form the outer estimate from a mega-batch (or the full batch).

        ``closures``: one closure, or one per chunk of the mega-batch (each zeroes grads, runs
        forward and backward on its chunk, returns its mean loss); the outer gradient is
        the mean over the chunks, at ONE posterior sample for the whole mega-batch (or at
        each of ``refresh_samples`` samples, where the optimizer has that option).  Chunks
        should be of equal size (or their losses weighted accordingly).  Without closures,
        use what ``sample("refresh")`` / ``accumulate()`` collected.  Returns the mean loss
        (None when the refresh was skipped: AMP overflow, or non-finite gradients on a
        fused backend with ``check_finite=False``).

        Whether a refresh was taken decides whether the correction is active, so the
        fused backends read that one flag from the device here (one synchronisation per
        refresh; steps have none).
        """
        if not self.rule.has_correction:
            raise RuntimeError(f"{type(self).__name__} has no outer loop to refresh")
        if self._active is not None:
            raise RuntimeError("refresh() while a sample is in the parameters: call restore() first")
        self._check_groups()
        self._check_amp(grad_scale, found_inf)
        pend = self._pending
        self._check_no_mix(KIND_REFRESH)
        self._check_trainable()
        losses, loss = [], None
        if closures is not None:
            if pend.count[KIND_REFRESH]:
                raise RuntimeError("refresh(closures) with refresh gradients already "
                                   "accumulated: call refresh() without closures")
            closures = as_closures(closures)
            check(len(closures) > 0, "refresh() needs at least one chunk of the mega-batch "
                                     "(closures is empty)")
            try:
                for _ in range(self._closure_samples("refresh_samples")):
                    self._sample("refresh", trainable_checked=True)
                    try:
                        for c in closures:
                            with torch.enable_grad():
                                losses.append(c())
                            self.accumulate()
                    finally:
                        self.restore()
                loss = mean_loss(losses)
            except BaseException:
                self._drop_pending((KIND_REFRESH,))
                raise
        elif pend.count[KIND_REFRESH] == 0:
            raise ValueError("refresh() needs at least one chunk of the mega-batch: pass "
                             "closures, or accumulate inside `with optimizer.sampled("
                             "'refresh'):` first")
        self._without_grad((KIND_REFRESH,))
        try:
            taken = self._runner.refresh(grad_scale, found_inf)
        except BaseException:
            self._drop_pending((KIND_REFRESH,))
            raise
        finally:
            pend.clear((KIND_REFRESH,))
            self._eps_cache.clear()
            self._runner.after_update()
        if self._runner.wants_ahead():
            # (parking: the next inner sample now, so that every step finds it in place
            # and an iteration after a refresh does an iteration's device work)
            self._runner.prefetch()
        if not taken:
            return None
        self._refresh_taken()
        return loss
