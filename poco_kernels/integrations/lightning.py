"""PyTorch Lightning with IVON and IVON-PoCoMo (docs/integrations.md).

:class:`PoCoLightningModule` is a ``LightningModule`` base class that runs the package's
sampling protocol with Lightning's manual optimization.  A subclass states its loss and,
for IVON-PoCoMo, its mega-batches; Lightning keeps the rest (the loop, logging, the lr
scheduler, checkpoints and resume, DDP through ``manual_backward``)::

    class Model(PoCoLightningModule):
        poco_start, refresh_every = 1000, 10

        def poco_loss(self, batch):                  # the mean loss of a (micro-)batch
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def poco_mega_batch(self, index):            # refresh ``index``: chunks of batches
            return [[next_batch()] for _ in range(10)]

        def configure_optimizers(self):
            return poco_kernels.IVONPoCoMo(self.parameters(), lr=0.3, ess=1e7)

Per training step ``t`` (``self.global_step``): when due, a refresh on
``poco_mega_batch(refresh_count)`` at ONE posterior sample; the batch's micro-batches
(``poco_micro_batches``) at ONE inner sample, and once the correction is active at the
outer sample; the update; the lr scheduler's step (if any, per step).

Lightning passes every optimizer a closure, which would make the package's ``step``
evaluate it as a closure at fresh samples; ``on_fit_start`` therefore hands Lightning an
optimizer whose ``step`` runs Lightning's (empty) closure and then steps on the gradients
the protocol collected.
"""
from __future__ import annotations

from typing import Any, List, Sequence

import torch

try:
    import lightning.pytorch as pl
except ImportError:                          # the standalone package name
    import pytorch_lightning as pl

from ._wrap import Forwarding, is_protocol_optimizer as _protocol_optimizer
from .accelerate import unwrap

__all__ = ["PoCoLightningModule"]


class _AfterTheProtocol(Forwarding):
    """What Lightning holds: ``step(closure)`` runs the closure (Lightning's bookkeeping;
    in manual optimization it computes nothing) and then the package's ``step()`` on what
    the protocol collected."""

    def step(self, closure=None):
        if closure is not None:
            closure()
        return self.optimizer.step()


class PoCoLightningModule(pl.LightningModule):
    """A ``LightningModule`` whose training step is the package's sampling protocol (see
    the module's docstring).  Subclasses implement :meth:`poco_loss` and, for
    IVON-PoCoMo, :meth:`poco_mega_batch`; ``configure_optimizers`` returns the package's
    optimizer (and a scheduler, stepped every step).  Class attributes: ``poco_start``
    (steps of plain IVON before the first refresh), ``refresh_every``."""

    poco_start: int = 0
    refresh_every: int = 10

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False

    # ------------------------------------------------------------------ the subclass's
    def poco_loss(self, batch) -> torch.Tensor:
        """The mean loss of ``batch`` (a micro-batch): to be implemented."""
        raise NotImplementedError(f"{type(self).__name__} must implement poco_loss(batch)")

    def poco_micro_batches(self, batch) -> Sequence[Any]:
        """``batch`` split into micro-batches accumulated at one sample (default: whole)."""
        return [batch]

    def poco_mega_batch(self, index: int) -> Sequence[Sequence[Any]]:
        """Refresh ``index``'s mega-batch: a list of chunks, each a list of micro-batches
        (the estimate is the mean over chunks).  IVON-PoCoMo needs it."""
        raise NotImplementedError(f"{type(self).__name__} must implement "
                                  f"poco_mega_batch(index) for IVON-PoCoMo's refreshes")

    # ------------------------------------------------------------------ Lightning's
    def on_fit_start(self) -> None:
        strategy = self.trainer.strategy
        opts = list(strategy.optimizers)
        if not any(_protocol_optimizer(o) or isinstance(o, _AfterTheProtocol) for o in opts):
            raise TypeError("PoCoLightningModule trains a poco_kernels optimizer: "
                            "configure_optimizers returned none")
        strategy.optimizers = [_AfterTheProtocol(o) if _protocol_optimizer(o) else o
                               for o in opts]

    def _passes(self, micro_batches: List[Any]) -> torch.Tensor:
        n = len(micro_batches)
        total = 0.0
        for mb in micro_batches:
            loss = self.poco_loss(mb)
            self.manual_backward(loss / n)
            total = total + loss.detach()
        return total / n

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        inner = unwrap(opt)
        t = self.global_step
        if getattr(getattr(inner, "rule", None), "has_correction", False) and t >= self.poco_start \
                and (t - self.poco_start) % self.refresh_every == 0:
            with inner.sampled("refresh", accumulate=False):
                for chunk in self.poco_mega_batch(inner.refresh_count):
                    self._passes(list(chunk))
                    inner.accumulate()
            inner.refresh()
        micro = list(self.poco_micro_batches(batch))
        with inner.sampled("inner"):
            loss = self._passes(micro)
        if inner.correction_active():
            with inner.sampled("outer"):
                self._passes(micro)
        opt.step()
        sch = self.lr_schedulers()
        if sch is not None:
            sch.step()
        self.log("train_loss", loss, prog_bar=True)
        return loss
