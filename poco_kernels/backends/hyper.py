"""Hyperparameter rows of the fused backends: the float64 tensors the kernels read their
scalars from (:func:`poco_kernels.kernels.interface.hyper_row`), one per bucket and kernel
record, kept on the bucket's device and rewritten only when a value changes.

A field is a Python float or a one-element tensor (a ``torch.optim``-style tensor
``lr``, an alpha a schedule ``fill_``\\ s):

* **floats** are compared on the host with the values last written; when one changed,
  the row's float fields are written in one copy (from pinned memory, without waiting,
  on a GPU).  A steady state of constant floats costs no device work at all;
* **tensors** are copied into their fields on the device at every update (one
  ``_foreach_copy_`` for the row), so a captured CUDA graph reads the values they hold
  at replay time.

Nothing here reads a device value on the host: no synchronisation, and inside a CUDA
graph capture nothing but device copies: a float that changes during a capture is an
error that says to give it as a tensor (its value would be fixed in the graph); floats
set before the capture are constants of the graph, as in any captured optimizer.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from ..kernels.interface import PLAIN_NUMBERS


class HyperRow:
    """The float64 row of one kernel record (``cls``: ``StepHyper``, ``RefreshHyper`` or
    ``SampleHyper``) on ``device``."""

    __slots__ = ("cls", "row", "floats")

    def __init__(self, cls, device: torch.device):
        self.cls = cls
        self.row = torch.zeros(len(cls._fields), dtype=torch.float64, device=device)
        #: the float fields last written (None where the field is a tensor); None: never
        self.floats: Optional[Tuple[Optional[float], ...]] = None

    def update(self, values) -> Tensor:
        """Write the record ``values`` (a ``cls``) into the row where it changed; the row."""
        if not isinstance(values, self.cls):
            raise TypeError(f"expected a {self.cls.__name__}, got {type(values).__name__}")
        if set(map(type, values)) <= PLAIN_NUMBERS:          # (no tensor: the usual case)
            floats = tuple(map(float, values))
            if floats != self.floats:
                self._write_floats(floats)
                self.floats = floats
            return self.row
        floats = tuple(None if isinstance(v, Tensor) else float(v) for v in values)
        if floats != self.floats:
            self._write_floats(floats)
            self.floats = floats
        tensors = [(i, v) for i, v in enumerate(values) if isinstance(v, Tensor)]
        if tensors:
            dst = [self.row[i] for i, _ in tensors]
            src = [v.detach().reshape(()).to(device=self.row.device, dtype=torch.float64,
                                              non_blocking=True) for _, v in tensors]
            torch._foreach_copy_(dst, src)
        return self.row

    def _write_floats(self, floats) -> None:
        """The whole row from the host (a tensor field gets 0 here and its value right
        after, on the device, in stream order)."""
        vals = [0.0 if v is None else v for v in floats]
        if self.row.device.type == "cpu":
            self.row.numpy()[:] = vals             # (in place: no allocation)
            return
        host = torch.tensor(vals, dtype=torch.float64)
        if torch.cuda.is_current_stream_capturing():
            now = ", ".join(f"{k}={v}" for k, v in zip(self.cls._fields, floats)
                            if v is not None)
            raise RuntimeError(
                f"a float hyperparameter of {self.cls.__name__} changed while a CUDA graph is "
                f"being captured ({now}): its value would be fixed in the graph. Give a "
                "hyperparameter that changes "
                "between replays as a one-element tensor (lr=torch.tensor(...), as "
                "torch.optim's capturable optimizers take it), or set it before capturing")
        # a GPU: one copy from pinned memory, not waited for (the caching host allocator
        # keeps the block until the copy has run)
        self.row.copy_(host.pin_memory(), non_blocking=True)


class HyperRows:
    """The rows of a backend: per (bucket index, name), made at first use (a name per
    record and use: ``"step"``, ``"refresh"``, and one per sample kind, whose values
    differ)."""

    def __init__(self):
        self.rows: Dict[Tuple[int, str], HyperRow] = {}

    def row(self, b, name: str, values) -> Tensor:
        """Bucket ``b``'s row ``name`` holding ``values`` (a kernel record)."""
        key = (b.index, name)
        r = self.rows.get(key)
        if r is None or r.row.device != b.device or r.cls is not type(values):
            r = self.rows[key] = HyperRow(type(values), b.device)
        return r.update(values)

    def clear(self) -> None:
        self.rows.clear()
