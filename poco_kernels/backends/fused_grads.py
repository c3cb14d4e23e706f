"""The fused engine's gradient buffers: the ``.grad`` views it hands out and collects.

Each unsharded bucket has flat gradient buffers of the parameter dtype
(:class:`GradBuffer`); before a sample's backward every trainable parameter gets a
``.grad`` that is a view of a zeroed, free one (:meth:`GradsMixin.hand_out`), so autograd
accumulates straight into the buffer the kernels read.  ``zero_grad()`` zeroes those
buffers in place, and a handed-out view no backward wrote counts as no gradient
(:meth:`GradsMixin.unwritten`).  ``accumulate`` collects a bucket's gradients from them
(:meth:`GradsMixin._gather_grads`), or, for a sharded bucket, reads FSDP2's
reduce-scattered shards in place (:meth:`GradsMixin._shard_grads`).  A buffer adopted as
a pending sum is lent until the update that consumes it.
"""
from __future__ import annotations

import operator
import weakref
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .. import _sweeps
from .._layout import local
from .fused_grad_buffer import DirectGrads, GradBuffer
from .fused_presence import Presence


#: ``p.grad`` and ``t.dtype`` as functions (``map`` runs the loop in C; the sweeps of every
#: call of an iteration are in ``poco_kernels/_sweeps.py``)
_grad = operator.attrgetter("grad")
_dtype = operator.attrgetter("dtype")
#: address tables kept per bucket whose gradients are read in place (every one present)
_TABLES = 4
#: the storages' memory can be swapped (torch's ``UntypedStorage._swap_data_ptr_``; else
#: the views of another buffer are handed out, a ``.grad`` assignment per parameter)
_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def _capturing() -> bool:
    """A CUDA graph is being captured on the current stream."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _refuse_sparse(g: Tensor) -> None:
    """A sparse gradient is refused (before any sum changes)."""
    if g.is_sparse:
        raise RuntimeError("poco_kernels optimizers do not support sparse gradients "
                           "(e.g. nn.Embedding(sparse=True)), except unsharded ones with "
                           "grad_views=True (autograd adds them into dense views): nothing "
                           "was accumulated")


class GradsMixin:
    """The gradient buffers of :class:`~poco_kernels.backends.fused.FusedBackend`: hand
    out ``.grad`` views, zero them, note which received a gradient, and gather them for
    ``accumulate``."""

    # ------------------------------------------------------------------ gradient buffers
    def _lent(self) -> set:
        """ids of the tensors the pending sums are (a gradient buffer adopted as a sum is
        lent until the update that consumes it)."""
        return {id(t) for t in self.view.pending.sums.values()}

    def _free_buffer(self, b, lent: set, prefer: Optional[int] = None,
                     make: bool = True) -> Optional[int]:
        """The index of a gradient buffer of ``b`` not lent to a pending sum (``prefer``
        if it is free); a new one when all are lent (``make=False``: None)."""
        if prefer is not None and id(b.grad_bufs[prefer].flat) not in lent:
            return prefer
        for i, gb in enumerate(b.grad_bufs):
            if id(gb.flat) not in lent:
                return i
        if not make:
            return None
        b.grad_bufs.append(GradBuffer(b))
        return len(b.grad_bufs) - 1

    def hand_out(self, cleared_only: bool = False) -> None:
        """Give every trainable parameter a ``.grad`` that is a view of a zeroed, free
        flat gradient buffer of its bucket, so that the coming backward pass accumulates
        straight into the buffer the kernels read (before a sample's backward, and after
        an update for the buckets whose ``.grad`` were cleared by ``accumulate``:
        ``cleared_only``)."""
        if not self.view.grad_views or torch.compiler.is_compiling():
            return
        lent = self._lent()
        for b in self.view.buckets:
            if b.segments is not None:        # FSDP2 hands out the sharded gradients
                continue
            if cleared_only and _sweeps.grads(b.params, None)[0]:
                continue
            # the first free buffer, not the one handed last: each iteration then uses
            # the same buffers in the same roles (inner sample, outer sample), which a
            # captured CUDA graph replays (alternating buffers would leave the graph
            # relying on a zeroing that only the next, uncaptured, iteration did)
            i = self._free_buffer(b, lent)
            if (not cleared_only and b.handed is not None and i != b.handed and _SWAP
                    and not b.swapped
                    and _sweeps.grads(b.params, b.grad_bufs[b.handed].views)[1] == len(b.params)):
                i = self._swap_in(b, i)
            gb = b.grad_bufs[i]
            gb.renew()
            pres = b.presence
            _, _, matching, clean, watched = _sweeps.scan(
                b.params, None, gb.views, gb.clean, None if pres is None else pres.flags,
                self._watcher.owner)
            gb.zero(clean)
            if matching != len(b.params):
                _sweeps.set_grads(b.params, gb.views)
            if pres is None:
                b.presence = pres = Presence(len(b.params))
            self._watcher.watch(b.params, pres, watched)
            pres.clear()
            b.handed = i

    def check_and_hand_out(self) -> None:
        """``check_layout()`` then :meth:`hand_out` before a sample, by one
        :func:`~poco_kernels._sweeps.scan` per bucket where every parameter is still its
        flat buffer's view and the buffer handed out last is the first free one (or, its
        views every ``.grad``, swapped with it); else those two calls (nothing changed)."""
        if not self.view.grad_views or torch.compiler.is_compiling():
            self.check_layout()
            self.hand_out()
            return
        lent = self._lent()
        seen = []
        for b in self.view.buckets:
            i, pres, ptrs = b.handed, b.presence, self.cached_addresses(b)
            if b.segments is not None or i is None or b.swapped or pres is None or ptrs is None:
                break
            free = self._free_buffer(b, lent, make=False)     # (nothing changed yet)
            if free is None or (free != i and not _SWAP):
                break
            gb = b.grad_bufs[i]
            gb.renew()
            scanned = _sweeps.scan(b.params, ptrs, gb.views, gb.clean if free == i else None,
                                   pres.flags, self._watcher.owner)
            if not scanned[0] or (free != i and scanned[2] != len(b.params)):
                break
            seen.append((b, free, gb, scanned))
        else:
            for b, free, gb, (_, _, matching, clean, watched) in seen:
                if free != b.handed:          # (hand_out's swap: the views keep their memory)
                    self._swap_in(b, free)
                    clean = True if gb.clean is not None else clean    # (clean: the versions)
                gb.zero(clean)
                if matching != len(b.params):
                    _sweeps.set_grads(b.params, gb.views)
                self._watcher.watch(b.params, b.presence, watched)
                b.presence.clear()
            return
        self.check_layout()
        self.hand_out()

    def _swap_in(self, b, i: int) -> int:
        """The ``.grad`` are the views of buffer ``b.handed``, which a pending sum holds
        (``step(closure)`` keeps them through ``accumulate``): instead of handing out
        the views of the free buffer ``i`` (a ``.grad`` assignment per parameter), swap
        the two buffers' memory (one call), so the views handed out hold the free memory
        and buffer ``i``'s tensor the sum.  :meth:`_swap_back` undoes it once the sums
        are gone, so that every iteration uses the same memory in the same roles (what
        a captured CUDA graph replays).  Returns ``b.handed``."""
        h = b.handed
        held, free = b.grad_bufs[h], b.grad_bufs[i]
        zero = free.is_clean()
        held.flat.untyped_storage()._swap_data_ptr_(free.flat.untyped_storage())
        sums = self.view.pending.sums
        for key, t in list(sums.items()):
            if t is held.flat:
                sums[key] = free.flat
        held.clean = held._versions() if zero else None
        free.clean = None                     # (the sum)
        b.swapped = (h, i)
        return h

    def _swap_back(self) -> None:
        """Undo :meth:`_swap_in` (the sums are gone): each buffer's tensors hold its own
        memory again, neither known to be zero."""
        for b in self.view.buckets:
            if b.swapped:
                h, i = b.swapped
                held, free = b.grad_bufs[h], b.grad_bufs[i]
                held.flat.untyped_storage()._swap_data_ptr_(free.flat.untyped_storage())
                held.clean = free.clean = None
                b.swapped = None

    def zero_grads(self) -> frozenset:
        """``zero_grad()`` for the parameters whose ``.grad`` is a view handed out by
        :meth:`hand_out`: zero the buffer in place (nothing to do when it is known to be
        zero), keeping the views.  Returns the ids of the parameters handled."""
        if torch.compiler.is_compiling():
            return frozenset()
        lent = self._lent()
        done = []
        for b in self.view.buckets:
            if b.handed is None:
                continue
            gb = b.grad_bufs[b.handed]
            if id(gb.flat) in lent:
                continue
            if self.params_hold_mean:         # (in a sample, its hand-out just checked)
                gb.renew()                    # (re-pointed views are not zeroed here)
            _, _, k, clean, _ = _sweeps.scan(b.params, None, gb.views, gb.clean, None, 0)
            if k:
                gb.zero(clean)
                done.append(b.ids() if k == len(b.params)     # (the usual case: all)
                            else frozenset(id(p) for p, v in zip(b.params, gb.views)
                                           if p.grad is v))
        return done[0] if len(done) == 1 else frozenset().union(*done)

    def unwritten(self) -> set:
        """``(bucket, index)`` of the parameters whose ``.grad`` is a view handed out by
        :meth:`hand_out` that received no gradient: autograd accumulated nothing into it
        since (the bucket's :class:`~.fused_presence.Presence`) and it still holds zeros
        (a gradient written another way, e.g. a collective into ``p.grad.data``, counts;
        clipping a zero one does not).
        They are skipped, as a ``.grad`` of None is with ``torch.optim``.  Reads the
        data of those parameters only (usually none), in one device read; none while a
        CUDA graph is captured (a read would break the capture, and a replay could not
        repeat it): there every handed-out gradient counts as written."""
        out = set()
        if torch.compiler.is_compiling() or _capturing():
            return out
        cand = []
        for b in self.view.buckets:
            pres = b.presence
            if b.handed is None or pres is None or pres.all():    # (every one reached)
                continue
            gb = b.grad_bufs[b.handed]
            for i, (p, v) in enumerate(zip(b.params, gb.views)):
                if p.grad is v and not pres.reached(i):
                    cand.append(((b.index, i), v))
        if cand:
            nonzero = torch.stack([v.ne(0).any() for _, v in cand]).tolist()
            out = {key for (key, _), nz in zip(cand, nonzero) if not nz}
        return out

    def _gather_grads(self, b, lent: set) -> Tuple[GradBuffer, bool]:
        """The bucket's gradients in one free flat buffer of the parameter dtype: free
        when the ``.grad`` are the views handed out, one foreach copy for those that are
        not (replaced, or made by autograd after ``zero_grad(set_to_none=True)``), zeros
        for those that are None.  Also: whether every ``.grad`` was the view handed out
        (nothing copied)."""
        compiling = torch.compiler.is_compiling()
        i = self._free_buffer(b, lent, b.handed)
        gb = b.grad_bufs[i]
        if not compiling:
            gb.renew()                        # (a re-pointed one is copied as any other)
        if not compiling and _sweeps.grads(b.params, gb.views)[1] == len(b.params):
            return gb, i == b.handed          # (the usual case: every one the view)
        grads = list(map(_grad, b.params))
        srcs, dsts, zero = [], [], []
        for g, gview in zip(grads, gb.views):
            if g is None:
                zero.append(gview)
                continue
            _refuse_sparse(g)
            if compiling or g is not gview:
                srcs.append(g.detach())
                dsts.append(gview)
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        if zero:
            torch._foreach_zero_(zero)
        return gb, False

    def _direct_grads(self, b) -> Optional["DirectGrads"]:
        """The gradients of unsharded bucket ``b``, one per parameter (None: no gradient),
        with the table of their addresses that the kernels read them through in place
        (one launch; ``_tiles``), instead of a gather copy: Triton, eager and not capturing
        a CUDA graph (a table is copied to the device when the addresses change), no
        ``.grad`` a view handed out, every one dense, contiguous, of its parameter's dtype
        and size.  Else None (:meth:`_gather_grads`).  When every parameter has one,
        per call only C-speed sweeps run (the addresses with those checks, the layout);
        else the present ones are checked in Python."""
        if not self.tiled or torch.compiler.is_compiling() or _capturing():
            return None
        if b.handed is not None and _sweeps.grads(b.params, b.grad_bufs[b.handed].views)[1]:
            return None
        grads, key = _sweeps.readable_grads(b.params)
        whole = key is not None               # (every one there and readable: no list)
        if not whole:                         # (a None; a sparse, strided or other one)
            present = [g for g in grads if g is not None]
            if not present:
                return None
            for g in present:
                _refuse_sparse(g)
            try:
                key = tuple(None if g is None else g.data_ptr() for g in grads)
            except RuntimeError:              # (no storage of its own: gathered instead)
                return None
            if not all(map(Tensor.is_contiguous, present)):
                return None
            if (set(map(_dtype, present)) != {b.param_dtype} or any(map(Tensor.is_neg, present))
                    or any(g is not None and g.numel() != p.numel()
                           for p, g in zip(b.params, grads))):
                return None
        # a few tables per bucket, the least recently used one re-addressed (one copy)
        # when every gradient is present and the addresses are new; the inner and outer
        # samples' gradients of IVON-PoCo(Mo) usually keep two sets of addresses
        # (entries name their bucket: a rebuilt bucket of the same index is another)
        entry = self._direct_tables.get(b.index)
        if entry is None or entry[0]() is not b:
            entry = self._direct_tables[b.index] = (weakref.ref(b), {})
        tables = entry[1]
        tiles = tables.pop(key, None)
        if tiles is None:
            old = (next((k for k in tables if None not in k), None)
                   if whole and len(tables) >= _TABLES else None)
            if old is not None:
                tiles = tables.pop(old)
                tiles.readdress(key)
            else:
                tiles = self.ops.Tiles([(off, p.numel(), 0, a) for off, p, a
                                        in zip(b.offsets, b.params, key) if a is not None],
                                       b.device)
                if len(tables) >= 2 * _TABLES:
                    del tables[next(iter(tables))]
        tables[key] = tiles                   # (the most recently used last)
        return DirectGrads(() if whole else grads, tiles, whole)

    def _shard_grads(self, b) -> List[Optional[Tensor]]:
        """The local gradients of a sharded bucket, one per launch of :meth:`_pieces`
        (FSDP2's reduce-scattered shards, read in place; None: no gradient, a zero one)."""
        out = []
        for i, (lo, n, _) in enumerate(b.segments):
            if n == 0:
                continue
            g = b.params[i].grad
            if g is None:
                out.append(None)
                continue
            _refuse_sparse(g)
            g = local(g.detach())
            if g.numel() != n:
                raise RuntimeError(f"a sharded gradient has {g.numel()} elements where its "
                                   f"parameter's local shard has {n}: nothing was accumulated")
            if g.dtype not in (torch.float32, torch.bfloat16, torch.float16) \
                    or g.device != b.device:
                g = g.to(device=b.device, dtype=b.param_dtype)
            out.append(g.reshape(-1).contiguous())
        return out

    #: the update just made was a step plan's whose every ``.grad`` was seen to be the
    #: view handed out after the last closure (none was cleared: no views to hand out)
    _views_kept = False

    def after_update(self) -> None:
        """The pending sums of an update are gone (consumed or dropped): the gradient
        buffers lent to them are free (swapped memory goes back), and parameters whose
        ``.grad`` ``accumulate`` cleared get views of a zeroed one again."""
        self._swap_back()
        kept, self._views_kept = self._views_kept, False
        if not kept:
            self.hand_out(cleared_only=True)
