"""The protocol every backend implements.

A backend owns how the optimizer's buckets are sampled, how gradients are collected and
how the two updates run (the optimizer's rule, :mod:`poco_kernels.rules`); the optimizer
owns the protocol (which sample, when, what is pending, validation, the state dict).
Dependencies point one way: optimizers -> backends -> kernels.  A backend never holds its
optimizer: it is given an :class:`~poco_kernels._view.OptimizerView`, whose members are
all it can use.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from array import array
from typing import FrozenSet, List, Optional, Tuple

import torch
from torch import Tensor

from .. import _sweeps
from .._layout import any_rank, shard_groups


@torch.no_grad()
def take_changed(mean: Tensor, params: Tensor, param_dtype: torch.dtype) -> None:
    """The mean takes the elements of ``params`` (the parameters as one flat buffer, in
    ``param_dtype`` or widened exactly) that it no longer rounds to: a float32 master copy
    of bf16/fp16 parameters keeps its extra bits where they still agree."""
    moved = mean.to(param_dtype) != params.to(param_dtype)
    mean.copy_(torch.where(moved, params.to(mean.dtype), mean))


class Backend(ABC):
    """One way of running an optimizer: ``torch`` (the reference maths, op for op),
    ``triton`` or ``cpp`` (fused kernels over flat buffers).

    ``kind`` is a sample kind and ``draw`` the index of the draw of that kind since the
    last update (:mod:`poco_kernels._protocol`).
    """

    #: registry name
    name: str = ""
    #: the update rewrites the parameters, so a closure's sample need not be restored
    lazy_restore: bool = False
    #: ``check_finite`` when the user leaves it None: True where reading the non-finite
    #: flag costs nothing (torch, C++), False where it is a device-to-host read (Triton)
    check_finite_default: bool = True
    #: ``grad_views`` when the user leaves it None (fused backends: whether the ``.grad``
    #: are views of the flat gradient buffers)
    grad_views_default: bool = True

    def __init__(self, view):
        #: the optimizer as this backend sees it (:class:`poco_kernels._view.OptimizerView`)
        self.view = view
        #: the parameters hold the posterior mean (no sample in them)
        self.params_hold_mean = True
        #: the parameters hold the next step's inner sample (draw 0), left by the step
        #: (``sample_ahead``): per bucket the (ess, wd) it was drawn with; None: they do not
        self.ahead = None

    def prefetch(self) -> None:
        """Write the next step's inner sample (draw 0) into the parameters, as a step with
        ``sample_ahead`` leaves it (the parameters hold the mean)."""
        self.sample(0, 0)
        self.ahead = self._ahead_key()

    def ahead_family(self) -> bool:
        """The step leaves the next inner sample in the parameters: ``sample_ahead`` (True,
        or None where the engine parks: :meth:`parks`), and every bucket's inner sample
        is IVON's (from ``h``)."""
        view = self.view
        ahead = view.sample_ahead
        if ahead is None:
            ahead = self.parks()
        buckets = view.buckets
        if not ahead or not buckets:
            return False
        known = self._family
        if known is None or known[0] is not buckets:     # (per layout: the rule decides)
            known = self._family = (buckets, all(view.spec(b, 0, 0).h is not None
                                                 for b in buckets))
        return known[1]

    #: (the buckets, whether every inner sample is IVON's), :meth:`ahead_family`'s
    _family = None

    #: between public calls the parameters read the mean and the next sample waits
    #: beside it (``backends/fused_park.py``); never on this base
    parked = False

    def parks(self) -> bool:
        """``sample_ahead=None`` keeps the next sample beside the mean between public calls
        (the fused backends where ``backends/fused_park.py`` applies); False: it is the
        copy protocol."""
        return False

    def may_park(self) -> bool:
        """The engine is where :meth:`park` may be called."""
        return False

    def wants_ahead(self) -> bool:
        """No next sample waits where one could (a refresh's end, where the engine parks:
        the next sample is drawn there)."""
        return False

    def reads_parked(self) -> bool:
        """Parked, with the layout as the engine made it (a read-only call may run so)."""
        return False

    def keeps_sample(self) -> bool:
        """``restore()`` may leave the parameters as they are, to be parked."""
        return False

    def park(self) -> None:
        """The parameters read the mean until :meth:`unpark` (the end of a public call)."""

    def unpark(self) -> None:
        """The state before :meth:`park` (the start of a public call)."""

    def found_inf(self, kinds: FrozenSet[int]) -> Tensor:
        """1.0 (a float32 scalar on the first bucket's device) where a pending sum of a
        kind in ``kinds`` holds a non-finite value, on this rank or, sharded, on any;
        else 0.0.  Computed on the device (no synchronisation)."""
        sums = [t for (k, _, _), t in self.view.pending.sums.items() if k in kinds]
        dev = self.view.buckets[0].device
        flag = torch.zeros((), dtype=torch.float32, device=dev)
        for t in sums:
            flag = torch.maximum(flag, (~torch.isfinite(t)).any().to(dev, torch.float32))
        groups = shard_groups(self.view.buckets)
        if groups:
            flag = any_rank(flag.reshape(1), groups).reshape(()).to(torch.float32)
        return flag

    # ------------------------------------------------------------------ edits between calls
    #: (the buckets, whether float32 ones have a mean buffer of their own, the buckets
    #: whose mean is its own buffer), :meth:`_own_mean_buckets`'s
    _own_mean = None
    #: per such bucket, its parameters' version counters and addresses when a public call
    #: last ended with the mean in them (None: not seen yet)
    _seen_params = None

    def _own_mean_buckets(self) -> list:
        """The unsharded buckets whose mean is a buffer of its own between public calls:
        parameters stored in a lower precision than the mean (its float32 master copy is
        in the state), and float32 ones unless the engine parks (then the parameters read
        the mean buffer itself)."""
        buckets = self.view.buckets
        own = not (self.view.sample_ahead is None and self.parks())
        known = self._own_mean
        if known is None or known[0] is not buckets or known[1] != own:
            known = self._own_mean = (buckets, own, [
                b for b in buckets if b.segments is None and (own or b.param_dtype != b.dtype)])
        return known[2]

    def adopt_edits(self) -> None:
        """At the start of a public call: parameters written in place since the last one
        (a weight load, an initialisation, a mask, an edit between ``sampled()`` and
        ``step()``: their version counters moved) or given other memory (``p.data = t``)
        give the elements they changed to the mean buffer; a float32 master copy of
        low-precision ones keeps the others, as a re-link does.  Only where the parameters
        hold the mean (not ``sample_ahead=True``'s next sample).  A write through
        ``p.data``, which moves no counter, is not seen.  A call refused after this keeps
        the adopted edit: it is the user's, which a twin adopts at its next call too."""
        owns = self._own_mean_buckets()
        if not owns or not self.params_hold_mean or self.ahead is not None:
            return
        seen = self._seen_params or {}
        for b in owns:
            was = seen.get(b.index)
            if (was is not None and was[0] == _sweeps.versions(b.params)
                    and _sweeps.same_addresses(b.params, was[1])):
                continue
            take_changed(b.buffers["mean"], b.flat_params(), b.param_dtype)

    def note_versions(self) -> None:
        """At the end of a public call that leaves the mean in the parameters: what
        :meth:`adopt_edits` compares with."""
        owns = self._own_mean_buckets()
        if owns and self.params_hold_mean and self.ahead is None:
            self._seen_params = {b.index: (_sweeps.versions(b.params),
                                           array("Q", map(Tensor.data_ptr, b.params)))
                                 for b in owns}
        elif owns:
            self._seen_params = None

    def _ahead_key(self):
        """What the inner sample of each bucket depends on besides the state and counters
        (a changed ``ess``, ``weight_decay``, noise version or seed means the sample left
        by the step is stale)."""
        specs = {b.index: self.view.spec(b, 0, 0) for b in self.view.buckets}
        version, seed = self.view.noise_version, self.view.seed
        return {i: (float(s.ess), float(s.wd), version, seed) for i, s in specs.items()}

    def takes_ahead(self, kind: int, draw: int) -> bool:
        """The sample asked for is the one the step left in the parameters."""
        return kind == 0 and draw == 0 and self.ahead is not None \
            and self.ahead == self._ahead_key()

    @abstractmethod
    def sample(self, kind: int, draw: int) -> None:
        """Write draw ``draw`` of a ``kind`` sample into the parameters."""

    @abstractmethod
    def accumulate(self, kind: int, draw: int, lend: bool = True) -> FrozenSet[int]:
        """Fold the parameters' ``.grad`` into the pending sums of the active sample.
        ``lend``: the ``.grad`` are cleared after it (a gradient buffer may become the
        sum); False: they stay, so they must not.  Returns the indices of the buckets
        whose ``.grad`` were all views the backend handed out (none is None; the next
        sample hands out zeroed ones, so inside ``step(closure)`` they may stay)."""

    def complete(self) -> FrozenSet[int]:
        """The indices of the buckets whose every ``.grad`` the last :meth:`accumulate`
        found present (none None), beyond those it returned: the caller need not look."""
        return frozenset()

    @abstractmethod
    def at_mean(self) -> None:
        """The next :meth:`accumulate` folds gradients taken at the mean, not at a sample
        (a noiseless optimizer driven like torch.optim: ``backward(); step()``)."""

    @abstractmethod
    def restore(self) -> None:
        """Put the posterior mean back into the parameters."""

    @abstractmethod
    def sync_mean(self) -> None:
        """Parameters of the state dtype are the truth for the mean while they hold it:
        copy them to the mean buffer."""

    @abstractmethod
    def step(self, corr: FrozenSet[int], grad_scale: Optional[Tensor],
             found_inf: Optional[Tensor]) -> Optional[bool]:
        """The inner update from the pending inner sums and, for the buckets in ``corr``
        (those under the correction), the outer sums.  Either it is taken, or it changes
        nothing (skipped, or refused with an exception).  Returns True (taken), False
        (skipped), or None where only the device knows (the fused backends without
        ``check_finite``: the device counts it, and the host reads the count when asked)."""

    @abstractmethod
    def refresh(self, grad_scale: Optional[Tensor], found_inf: Optional[Tensor]) -> bool:
        """The outer refresh from the pending refresh sums; taken (True) or changes
        nothing (False, or an exception).  Always known on the host: the correction's
        state depends on it."""

    def check_buckets(self, buckets: List) -> None:
        """Raise ValueError if this backend cannot run these (new) buckets."""

    def host_readable(self, t: Tensor) -> bool:
        """Reading ``t`` on the host costs no synchronisation a step would not make
        anyway (a CPU tensor; any tensor on the torch backend, which reads its gradients)."""
        return t.device.type == "cpu"

    def check_layout(self) -> None:
        """Bring back parameters that are no longer where the backend keeps them (the
        fused backends' flat buffers), or raise where that cannot be done."""

    def zero_grads(self) -> frozenset:
        """``zero_grad()`` for the ``.grad`` the backend handed out (views of its buffers):
        zeroed in place; returns the ids of the parameters handled (none here)."""
        return frozenset()

    def unwritten(self) -> set:
        """``(bucket, index)`` of parameters whose ``.grad`` the backend handed out and no
        backward wrote: they count as without a gradient (none here)."""
        return set()

    def after_update(self) -> None:
        """An update consumed (or a failure dropped) the pending sums of its kinds."""

    def discard(self) -> None:
        """Pending sums were dropped without an update (a closure raised): forget what
        accumulating them noted (the fused backends' non-finite flag)."""

    def skipped_on_host(self, found_inf: Optional[Tensor]) -> bool:
        """True when the host reads an AMP ``found_inf`` as set (the update will be
        skipped before any other check).  The fused backends never read it on the host."""
        return False

    def counters(self) -> Tuple[int, int, int]:
        """(steps taken, refreshes taken, updates skipped on the device)."""
        return self.view.steps, self.view.refreshes, 0

    def prepare_state_dict(self) -> None:
        """Bring the pending sums into the state dict's layout (the torch backend's)."""

    def loaded(self) -> None:
        """A state dict was loaded: the parameters hold the mean, the counters are the
        optimizer's."""

    def relayout(self) -> None:
        """The buckets were laid out again (parameters frozen or unfrozen): new bucket
        objects, buffers and parameter sets."""

    def set_skipped(self, skipped: int) -> None:
        """Set the count of updates skipped on the device (a copy of an optimizer)."""

    def rebuilt(self, old_buckets) -> None:
        """A parameter group was added: the optimizer's buckets were rebuilt, the old
        ones first and with the same buffers."""
