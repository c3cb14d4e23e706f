"""The fused engine's parking: the mean in the parameters between public calls, the next
sample beside it, and nothing copied.

With ``sample_ahead=None`` (the default) the step of the IVON family writes the next
step's inner sample into the parameters' flat buffer in the update's own pass, and the
new mean into the mean buffer, as ``sample_ahead=True`` does.  At the end of the public
call the flat buffer's storage is parked (:func:`poco_kernels._sweeps.park`): it reads
the mean buffer's memory, and its own memory, with the sample, waits in a spare storage.
The parameters and every view of their storage read the mean; the mean buffer, the
optimizer's ``state`` and a state dict taken are untouched.  The next public call
unparks before it runs, so everything inside the engine sees ``sample_ahead``'s state
and the next ``step(closure)`` finds its inner sample in place.  No byte moves: the
iteration costs ``sample_ahead``'s bytes, under the copy protocol's contract.

Each buffer's memory keeps its role (the flat buffer's own allocation receives the
samples, the mean buffer's the mean), so the device work of an iteration, and a CUDA
graph captured of it, reads and writes the same addresses every time (checked offline,
``tests/protocol/test_capture.py``; not yet run on a GPU).  The parameters'
storage holds a reference to the mean's memory and to its own (reference-counted blocks,
``csrc/park.cpp``): a raw pointer taken while parked or inside a call (numpy, DLPack) and
the parameters of a dropped optimizer stay valid.  A storage given other memory while
parked (``share_memory_()``) keeps it, holding the mean, and the optimizer parks no more;
a mean buffer given other memory while parked takes what the parameters hold at the next
call.  Parking takes only the device allocator's own memory: a flat buffer or mean in
shared memory ends it (:meth:`ParkMixin.park`), so torch still sees that memory shared.
``state_dict()`` reads the optimizer parked (``_transaction.reading``).

Parking and unparking bump the parameters' version counters: a backward through a graph
that saved a parameter before fails, as after any in-place write.  A parameter written in
place while parked (under ``torch.no_grad()``, ``model.load_state_dict``) moves its
version: the write went into the mean, and the sample is drawn again from it.  A write
through ``p.data`` moves no version counter: it reaches the mean, but the next sample,
drawn before it, does not see it (the step after does).  A parameter whose storage was
replaced takes its new value as its mean (the re-link, as with ``sample_ahead``).

Where it applies (:meth:`ParkMixin.parks`): every bucket unsharded, its parameters of
the mean's dtype (float32), its flat buffer and mean each at the start of a storage of
one size (the padding included), and the
C++ extension built (the park itself is C++).  Elsewhere ``sample_ahead=None`` is the
copy protocol.
"""
from __future__ import annotations

import array
from typing import Dict, Optional

import torch
from torch import Tensor

from .. import _sweeps


class ParkMixin:
    """Parking of :class:`~poco_kernels.backends.fused.FusedBackend` (module doc)."""

    #: the flat parameter buffers read the mean's memory (the next sample waits aside)
    parked: bool = False
    #: the sum of the parameters' versions when parked (a moved one: a write while parked)
    _park_versions: int = 0
    #: the sum when last unparked (a moved one: the sample was written since)
    _unpark_versions: Optional[int] = None
    #: cache of :meth:`parks` (None: not worked out for this layout)
    _parks: Optional[bool] = None
    #: per bucket index, the empty storage that holds the flat buffer's memory while parked
    _spares: Optional[Dict[int, Tensor]] = None
    #: parking was given up (a parked storage was given other memory)
    _park_off: bool = False

    def parks(self) -> bool:
        """Parking applies to this optimizer's layout (module doc)."""
        if self._parks is None:
            self._parks = self._parkable()
        return self._parks

    def _parkable(self) -> bool:
        buckets = self.view.buckets
        if _sweeps.park is None or not buckets or self._park_off:
            return False
        for b in buckets:
            flat, mean = getattr(b, "flat_param", None), b.buffers.get("mean")
            if b.segments is not None or flat is None or mean is None:
                return False
            if flat.dtype != mean.dtype or flat.device != mean.device \
                    or flat.numel() != mean.numel() \
                    or flat.untyped_storage().nbytes() != mean.untyped_storage().nbytes():
                return False
            if flat.storage_offset() or mean.storage_offset() or not mean.is_contiguous():
                return False
        return True

    def may_park(self) -> bool:
        """The mean is in its buffer, not in the parameters (they hold the next sample a
        step left, or a sample the next write replaces), under ``sample_ahead=None``, where
        parking applies."""
        return (not self.parked and not self.params_hold_mean
                and self.view.sample_ahead is None and self.parks())

    def wants_ahead(self) -> bool:
        """Parking applies and no next sample waits (a refresh's end)."""
        return (self.ahead is None and self.view.sample_ahead is None and self.parks()
                and self.ahead_family())

    def park(self) -> None:
        """The parameters read the mean until :meth:`unpark` (where :meth:`may_park`).  A
        flat buffer or mean whose memory parking does not take (shared memory, another
        library's: ``_C.park`` says None) ends parking: the parameters take the mean by
        copy, the copy protocol from then on."""
        spares = self._spares
        if spares is None or len(spares) != len(self.view.buckets):
            spares = self._spares = {b.index: torch.empty(0, dtype=b.flat_param.dtype,
                                                           device=b.device)
                                     for b in self.view.buckets}
        total, done = 0, []
        try:
            for b in self.view.buckets:
                out = _sweeps.park(b.flat_param, b.buffers["mean"], spares[b.index], b.params)
                if out is None:
                    break
                total += out[1]
                done.append(b)
        except BaseException:                 # (all or none: the parked ones back)
            self._unpark_each(done)
            raise
        if len(done) < len(self.view.buckets):
            self._unpark_each(done)
            self._give_up(self.view.buckets)
            return
        self._park_versions = total
        self.parked = True

    def _unpark_each(self, buckets) -> None:
        for b in buckets:
            _sweeps.unpark(b.flat_param, b.buffers["mean"], self._spares[b.index], b.params)

    def _give_up(self, buckets) -> None:
        """Parking ends: ``buckets``' parameters take the mean (the others hold it)."""
        for b in buckets:
            self._params_from(b, b.buffers["mean"])
        self.params_hold_mean, self.ahead = True, None
        self._unpark_versions = None
        self._park_off, self._parks = True, False

    def unpark(self) -> None:
        """The parameters hold the next sample again, the engine's state.  A parameter
        written in place meanwhile made it stale: drawn again at the next sample.  A
        storage given other memory while parked (``share_memory_()``, a resize) keeps it,
        holding the mean: the other buckets take the mean back too, and this optimizer
        parks no more (its parameters' storage is the user's to share).  A bucket that
        cannot unpark (its mean buffer resized to another size) raises with every bucket
        still parked."""
        spares = self._spares
        done = []
        try:
            for b in self.view.buckets:
                done.append((b, _sweeps.unpark(b.flat_param, b.buffers["mean"],
                                               spares[b.index], b.params)))
        except BaseException:                 # (all or none: the unparked ones parked again)
            for b, out in done:
                if out is not None:
                    _sweeps.park(b.flat_param, b.buffers["mean"], spares[b.index], b.params)
            raise
        kept = [b for b, out in done if out is not None]
        total = sum(out[0] for _, out in done if out is not None)
        after = sum(out[1] for _, out in done if out is not None)
        self.parked = False
        self._unpark_versions = after
        if len(kept) < len(self.view.buckets):
            self._give_up(kept)
        elif total != self._park_versions:
            self.ahead = None                 # (the mean was written: drawn again)

    def reads_parked(self) -> bool:
        """Parked, every parameter still the view of its flat buffer the engine made (a
        call that only reads may run parked)."""
        if not self.parked:
            return False
        for b in self.view.buckets:
            base, size = b.flat_param.data_ptr(), b.flat_param.element_size()
            if not _sweeps.same_addresses(
                    b.params, array.array("Q", [base + off * size for off in b.offsets])):
                return False
        return True

    def keeps_sample(self) -> bool:
        """A public ``restore()`` may leave the parameters as they are, to be parked, the
        mean in its buffer: they are where the engine put them (else the restore re-links
        them) and hold the untouched next sample (the inner sample just taken, not written
        since the engine was unparked), or no sample ahead waits (whatever they hold, the
        next sample or step overwrites before reading)."""
        if not self.may_park():
            return False
        buckets = self.view.buckets
        if not all(self._is_flat(b) for b in buckets):
            return False
        if self.ahead is None:
            return True
        versions = _sweeps.versions
        return (self._unpark_versions is not None
                and sum(sum(versions(b.params)) for b in buckets) == self._unpark_versions)
