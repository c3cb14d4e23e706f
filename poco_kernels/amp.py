"""float16 autocast with dynamic loss scaling for the sampling protocol.

``torch.amp.GradScaler`` checks ``.grad`` for infs when ``scaler.step(opt)`` runs; with
``sampled()`` blocks the gradients are in the optimizer's sums by then, so it sees none.
:class:`GradScaler` is torch's, with the optimizer's own check instead: the non-finite
flag its accumulations set on the device (or, on the torch backend, a check of the sums),
passed to the update as ``found_inf`` with the scale as ``grad_scale``, and recorded for
``scaler.update()``, which backs the scale off after an overflow and grows it as torch's
does.  For any other optimizer, and for these in torch.optim's own loop (``backward();
scaler.step(opt)`` with nothing collected by ``sampled()``), it is torch's GradScaler::

    scaler = poco_kernels.amp.GradScaler("cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        with opt.sampled():
            scaler.scale(loss_fn(model(x), y)).backward()
    scaler.step(opt)                 # and scaler.refresh(opt) after sampled("refresh")
    scaler.update()

Tested on the CPU (the torch backend, the C++ kernels, the Triton kernels under the
interpreter: tests/protocol/test_amp_scaler.py); not yet run on a GPU.
"""
from __future__ import annotations

import torch
from torch.amp.grad_scaler import OptState

from ._posterior import PosteriorOptimizer
from ._protocol import KIND_INNER, KIND_OUTER, KIND_REFRESH

__all__ = ["GradScaler"]

_STEP = (KIND_INNER, KIND_OUTER)


def _collected(opt, kinds) -> bool:
    """Gradients of ``kinds`` are in the optimizer's sums (``sampled()``/``accumulate()``)."""
    return isinstance(opt, PosteriorOptimizer) and any(opt._pending.count[k] for k in kinds)


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for the sampling protocol of these optimizers (module
    docstring).  ``unscale_`` is refused while gradients are in the optimizer's sums
    (clip the scaled ``.grad`` inside the ``sampled()`` block instead, with the bound
    times ``get_scale()``); ``step`` with a closure is refused, as torch refuses it."""

    def step(self, optimizer, *args, **kwargs):
        if not self._enabled or not _collected(optimizer, _STEP):
            return super().step(optimizer, *args, **kwargs)
        if args or "closure" in kwargs:
            raise RuntimeError("GradScaler.step(opt) after sampled() blocks takes no closure "
                               "(the gradients are collected already)")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        out = self._update(optimizer, optimizer.step, _STEP, kwargs)
        state["stage"] = OptState.STEPPED
        return out

    def refresh(self, optimizer, **kwargs):
        """``optimizer.refresh(**kwargs)`` with the scale and the optimizer's own inf check
        (after ``sampled("refresh")`` blocks whose losses were scaled); an overflow skips
        the refresh and backs the scale off at ``update()``."""
        if not self._enabled:
            return optimizer.refresh(**kwargs)
        if not _collected(optimizer, (KIND_REFRESH,)):
            raise RuntimeError("GradScaler.refresh(opt) needs the refresh's gradients "
                               "collected first: sampled('refresh') blocks")
        return self._update(optimizer, optimizer.refresh, (KIND_REFRESH,), kwargs)

    def unscale_(self, optimizer):
        if self._enabled and _collected(optimizer, _STEP + (KIND_REFRESH,)):
            raise RuntimeError(
                "unscale_() after sampled() blocks: the gradients are in the optimizer's "
                "sums, which the update unscales; clip the scaled .grad inside the block "
                "(the bound times scaler.get_scale())")
        return super().unscale_(optimizer)

    def _update(self, optimizer, call, kinds, kwargs):
        self._check_scale_growth_tracker("step")
        scale = self._get_scale_async()
        found = optimizer._found_inf(kinds)
        out = call(grad_scale=scale, found_inf=found, **kwargs)
        per_device = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        key = found.device
        per_device[key] = found if key not in per_device else per_device[key] + found
        return out
