"""The fused engine's flat gradient buffers (:class:`GradBuffer`: a bucket's buffer and
the ``.grad`` views over it that :mod:`.fused_grads` hands out) and the gradients an
``accumulate`` reads in place (:class:`DirectGrads`)."""
from __future__ import annotations

from array import array
from typing import List

import torch
from torch import Tensor

from .. import _sweeps
from .._layout import alloc_flat


class GradBuffer:
    """A flat gradient buffer of a bucket (the parameter dtype) and, per parameter, a
    tensor over its part of the storage that is handed to the parameter as its ``.grad``.

    Those tensors alias the buffer without being autograd views of it, so each keeps its
    own version counter: every in-place write to one (autograd accumulating a gradient
    into ``.grad``, ``zero_()``, a copy) moves that parameter's counter only.  ``clean``:
    the counters at which the buffer was last known to hold zeros (None: not known), so
    the engine knows without reading the buffer whether it is still zero and which
    parameters received a gradient since."""

    __slots__ = ("flat", "views", "clean", "places", "_rel", "_addresses")

    def __init__(self, b):
        self.flat = alloc_flat(b.numel, b.device, b.param_dtype)     # (zero padding)
        self.places = [(off, p.shape) for p, off in zip(b.params, b.offsets)]
        self.views = self._new_views()
        base = self.flat.data_ptr()
        # each view's address less the buffer's (-1: no elements, whose address is 0)
        self._rel = [v.data_ptr() - base if v.numel() else -1 for v in self.views]
        self._addresses = {}                  # (per address of the buffer: the views')
        self.clean = self._versions()

    def _new_views(self) -> List[Tensor]:
        st = self.flat.untyped_storage()
        return [torch.empty(0, device=self.flat.device, dtype=self.flat.dtype).set_(
                    st, off, shape)                    # (contiguous strides)
                for off, shape in self.places]

    def intact(self) -> bool:
        """Every view is still over its part of the buffer: none was re-pointed by
        ``p.grad.data = t`` (what ``module.to()``, ``.double()`` and ``.float()`` do to
        each ``.grad``), which keeps the tensor but not its memory."""
        base = self.flat.data_ptr()           # (moves with a swap of the storages' memory)
        addresses = self._addresses.get(base)
        if addresses is None:                 # (two memories alternate: IVON-PoCoMo's swap)
            if len(self._addresses) >= 4:
                self._addresses.clear()
            addresses = self._addresses[base] = array(
                "Q", [base + r if r >= 0 else 0 for r in self._rel])
        return _sweeps.same_addresses(self.views, addresses)

    def renew(self) -> bool:
        """If a view was re-pointed (:meth:`intact`), new views replace all of them in
        the same list (it is aliased), so the next hand-out gives every parameter one
        over the buffer; the re-pointed tensors are no longer the engine's (a ``.grad``
        that is one is read as any other tensor).  Returns whether it did."""
        if self.intact():
            return False
        self.views[:] = self._new_views()
        self.clean = None
        return True

    def _versions(self) -> List[int]:
        return _sweeps.versions(self.views)

    def is_clean(self) -> bool:
        return self.clean is not None and self.clean == self._versions()

    def zero(self, clean=None) -> None:
        """Make it hold zeros (one memset, skipped when it is known to; ``clean``: what a
        :func:`~poco_kernels._sweeps.scan` of the views found, True or their versions)."""
        if clean is None:
            clean = self.is_clean() or None
        if clean is not True:
            self.flat.zero_()                 # (the views' counters are their own: unmoved)
            self.clean = clean if isinstance(clean, list) else self._versions()


class DirectGrads(list):
    """A bucket's gradients read in place (:meth:`GradsMixin._direct_grads`): ``tiles``,
    the table of their addresses; ``whole``: every parameter has one (the list is then
    empty: the parameters' ``.grad`` hold them); else the list has one per parameter
    (None: no gradient)."""

    __slots__ = ("tiles", "whole")

    def __init__(self, grads, tiles, whole: bool):
        super().__init__(grads)
        self.tiles = tiles
        self.whole = whole                    # (none None)
