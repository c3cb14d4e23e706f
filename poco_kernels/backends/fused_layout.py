"""The fused engine's layout: flat parameter buffers and the launches over them.

The parameters of an unsharded bucket are views of one flat buffer of their dtype
(:meth:`LayoutMixin.flatten`), re-linked where they were taken off it
(:meth:`LayoutMixin.check_layout`).  A sharded bucket (FSDP2) keeps FSDP2's local shards:
an operation runs over each shard and its slice of the bucket's flat buffers
(:meth:`LayoutMixin._pieces`, :meth:`LayoutMixin._cutter`), in one launch for all of them
where the kernels take a table of the shards (Triton: :meth:`LayoutMixin._tiles`), else
one launch per shard; copies between the
parameters and a flat buffer go shard by shard (:meth:`LayoutMixin._params_to`,
:meth:`LayoutMixin._params_from`).
"""
from __future__ import annotations

import array
from typing import Optional

import torch
from torch import Tensor

from .. import _sweeps
from .._layout import alloc_flat
from .base import take_changed
from .fused_grad_buffer import GradBuffer
from .fused_grads import _capturing

_data_ptr = Tensor.data_ptr


class LayoutMixin:
    """The flat buffers of :class:`~poco_kernels.backends.fused.FusedBackend`: flatten the
    buckets, re-link parameters taken off them, and cut an operation into launches."""

    # ------------------------------------------------------------------ layout
    def flatten(self) -> None:
        """Make every bucket's parameters views of one flat buffer (and give it a flat
        gradient buffer).  Idempotent: buckets already flat keep their storage."""
        for b in self.view.buckets:
            flat = getattr(b, "flat_param", None)
            if b.segments is not None:        # FSDP2 owns the shards: launched per shard
                b.flat_param, b.grad_bufs, b.handed = None, [], None
                b.grad_flat, b.grad_views = None, None
                self._check_shards(b)
            elif flat is None or not self._is_flat(b):
                flat = alloc_flat(b.numel, b.device, b.param_dtype)
                with torch.no_grad():
                    for p, off in zip(b.params, b.offsets):
                        flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
                    for p, off in zip(b.params, b.offsets):
                        p.data = flat[off:off + p.numel()].view_as(p)
                b.flat_param = flat
                b.grad_bufs = [GradBuffer(b)]
                b.handed = None
                b.grad_flat, b.grad_views = b.grad_bufs[0].flat, b.grad_bufs[0].views
            if b.device not in self.ctl:      # a new device starts from the counters
                src = next(iter(self.ctl.values()), None)
                self.ctl[b.device] = (src.to(b.device, copy=True) if src is not None else
                                      self._counters_tensor(self.view.steps,
                                                            self.view.refreshes, 0, b.device))
        self._parks = self._spares = None     # (parking is worked out for the new layout)

    # ------------------------------------------------------------------ sharded buckets
    @staticmethod
    def _pieces(b):
        """The launches of an operation on bucket ``b``: ``(lo, n, offset, param)`` per
        launch, the elements ``lo .. lo + n - 1`` of the bucket's flat buffers, the noise
        (and rounding) offset of element ``lo``, and the parameter tensor written.  One
        launch over the flat parameter buffer at offset 0, or per non-empty local shard of
        a sharded bucket its slice, its place in the unsharded bucket and the shard itself
        (FSDP2's storage, flattened: a view)."""
        if b.segments is None:
            return ((0, b.numel, 0, b.flat_param),)
        return tuple((lo, n, start, b.local(i).view(-1))
                     for i, (lo, n, start) in enumerate(b.segments) if n > 0)

    def _tiles(self, b, tensors=None, params: bool = False):
        """One launch over all of sharded bucket ``b``'s local shards, where the kernels
        take one (Triton, eager: ``triton_ops.Tiles``), else None (one launch per shard,
        :meth:`_pieces`).  ``tensors``: per piece, the tensor the kernel reads or writes
        in the shard (a gradient; None: that piece is left out; ``params``: the
        parameters' local shards), or None for an operation on the flat buffers alone; they must share a
        dtype (else None).  Made once per layout and set of addresses (the gradients'
        change every backward).  (An unsharded bucket's gradients read in place have
        theirs: :meth:`~.fused_grads.GradsMixin._direct_grads`.)"""
        if b.segments is None or not self.tiled or torch.compiler.is_compiling():
            return None
        pieces = self._pieces(b)
        if params:
            tensors = [prm for _, _, _, prm in pieces]
        if tensors is not None and len({t.dtype for t in tensors if t is not None}) > 1:
            return None
        if tensors is None:
            key = tuple((lo, n, off - lo, 0) for lo, n, off, _ in pieces)
        else:
            key = tuple((lo, n, off - lo, _data_ptr(t))
                        for (lo, n, off, _), t in zip(pieces, tensors) if t is not None)
        cache = self._tile_cache.setdefault(b.index, {})
        tiles = cache.get(key)
        if tiles is None:
            if _capturing():                  # (a new table's copy would be captured)
                return None
            if len(cache) >= 8:                 # (gradients: new addresses each backward)
                cache.clear()
            tiles = cache[key] = self.ops.Tiles(key, b.device)
        return tiles

    @staticmethod
    def _cutter(b, lo: int, n: int):
        """The slice ``lo .. lo + n - 1`` of a flat buffer of ``b`` (None stays None; an
        unsharded bucket's one launch takes the buffers themselves: their padding counts)."""
        if b.segments is None:
            return lambda t: t
        return lambda t: None if t is None else t[lo:lo + n]

    def _params_to(self, b, dst: Tensor) -> None:
        """``dst`` (a flat buffer of ``b``) takes the parameters' values."""
        if b.segments is None:
            dst.copy_(b.flat_param)
            return
        pieces = self._pieces(b)
        if pieces:
            torch._foreach_copy_([dst[lo:lo + n] for lo, n, _, _ in pieces],
                                 [prm for _, _, _, prm in pieces])

    def _params_from(self, b, src: Tensor) -> None:
        """The parameters take the values of ``src`` (a flat buffer of ``b``)."""
        if b.segments is None:
            b.flat_param.copy_(src)
            return
        pieces = self._pieces(b)
        if pieces:
            torch._foreach_copy_([prm for _, _, _, prm in pieces],
                                 [src[lo:lo + n] for lo, n, _, _ in pieces])

    def _check_shards(self, b) -> None:
        """The local shards of a sharded bucket are still contiguous tensors of the
        bucket's dtype, device and sizes (FSDP2 may replace their storage, e.g. when a
        state dict is loaded into the model: the launches follow it)."""
        for i, (lo, n, _) in enumerate(b.segments):
            loc = b.local(i)
            if (loc.numel() != n or loc.dtype != b.param_dtype or loc.device != b.device
                    or not loc.is_contiguous()):
                group = self.view.param_groups[b.group_index]["params"]
                j = next(j for j, q in enumerate(group) if q is b.params[i])
                raise RuntimeError(
                    f"parameter {j} of param group {b.group_index}: its local shard changed "
                    f"since the optimizer was built (now {tuple(loc.shape)} {loc.dtype} on "
                    f"{loc.device}, contiguous={loc.is_contiguous()}; expected {n} elements "
                    f"of {b.param_dtype} on {b.device}): build the optimizer after sharding, "
                    "moving or converting the model (a state dict carries its state over)")

    @staticmethod
    def cached_addresses(b):
        """The views' addresses :meth:`_is_flat` cached for ``b``, if they are still those
        of its flat buffer (else None)."""
        ptrs, flat = b.flat_ptrs, b.flat_param
        return ptrs if ptrs is not None and flat is not None and ptrs[0] == flat.data_ptr() \
            else None

    @staticmethod
    def _is_flat(b) -> bool:
        """The bucket's parameters are (still) the views of its flat buffer made by
        :meth:`flatten` or a re-link: their addresses are those of the views (one list
        comparison; a parameter re-pointed elsewhere has another address)."""
        ptrs = LayoutMixin.cached_addresses(b)
        if ptrs is None:
            base, size = b.flat_param.data_ptr(), b.flat_param.element_size()
            b.flat_ptrs = ptrs = array.array("Q", [base + off * size for off in b.offsets])
        return _sweeps.same_addresses(b.params, ptrs)

    def check_layout(self) -> None:
        """Re-link parameters taken off the flat buffers (by another optimizer built over
        them, a deepcopy, or ``p.data = t``) that kept their shape, dtype and device:
        their current values are copied in and ``p.data`` is re-pointed (the parameters
        are the truth, as in ``torch.optim``).  A changed shape, dtype or device raises,
        with nothing changed."""
        self._relink(strict=True)

    def _relink(self, strict: bool) -> None:
        """:meth:`check_layout`; ``strict=False`` leaves a bucket that cannot be re-linked
        as it is instead of raising (restore: the error is the next sample's or step's)."""
        if torch.compiler.is_compiling():     # storage pointers are not traceable
            return
        loose = []
        for b in self.view.buckets:           # all checked before any is re-linked
            if b.segments is not None:
                if strict:
                    self._check_shards(b)
                continue
            if self._is_flat(b):
                continue
            why = self._changed(b)
            if why is None:
                loose.append(b)
            elif strict:
                raise RuntimeError(
                    f"{why} since the optimizer was built (e.g. by model.to(...) or "
                    f"`p.data = ...`): with backend={self.name!r} the parameters are views "
                    "of the optimizer's flat buffers of their dtype and device; build the "
                    "optimizer after moving or converting the model (a state dict carries "
                    "the optimizer's state over)")
        with torch.no_grad():
            for b in loose:
                base = b.flat_param.data_ptr()
                size = b.flat_param.element_size()
                for p, (off, shape) in zip(b.params, b.grad_bufs[0].places):
                    if p.data_ptr() == base + off * size and p.is_contiguous():
                        continue
                    flat = b.flat_param[off:off + p.numel()]
                    new = p.detach().reshape(-1)
                    if not self.params_hold_mean and not torch.equal(flat, new):
                        # the parameters hold a sample and this one was given another
                        # value: that value is its mean now (the parameters are the truth)
                        b.buffers["mean"][off:off + p.numel()].copy_(new)
                        self.ahead = None
                    flat.copy_(new)
                    p.data = flat.view(shape)
                if b.param_dtype != b.dtype and self.params_hold_mean:
                    # low precision: the float32 master copy keeps what the parameters
                    # still round to, and takes the values changed elsewhere
                    take_changed(b.buffers["mean"], b.flat_param, b.param_dtype)

    def _changed(self, b) -> Optional[str]:
        """What keeps a bucket's parameters from being re-linked (None: nothing)."""
        for p, (_, shape) in zip(b.params, b.grad_bufs[0].places):
            for what, now, was in (("dtype", p.dtype, b.param_dtype),
                                   ("device", p.device, b.device),
                                   ("shape", tuple(p.shape), tuple(shape))):
                if now != was:
                    group = self.view.param_groups[b.group_index]["params"]
                    i = next(i for i, q in enumerate(group) if q is p)
                    return (f"parameter {i} of param group {b.group_index}: its storage was "
                            f"replaced by one of another {what} ({was} -> {now})")
        return None
