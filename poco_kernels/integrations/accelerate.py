"""Hugging Face ``accelerate`` with this package's optimizers (docs/integrations.md).

``accelerator.prepare`` wraps an optimizer in ``AcceleratedOptimizer``, which forwards
``step(closure)``, ``zero_grad``, ``state_dict`` and ``param_groups`` but not this
package's sampling protocol (``sampled``, ``refresh``, ``accumulate``,
``correction_active``), and whose ``step`` returns None instead of the closure's loss.
:func:`prepare` is ``accelerator.prepare`` that also makes the models' state dicts safe
for safetensors (:func:`~poco_kernels.integrations.keep_state_dicts_separate`: the
default ``save_state`` would otherwise drop parameters of the fused backends), and
:func:`unwrap` returns the package's optimizer inside the wrapper.  :func:`train_step`
and :func:`refresh` run one IVON / IVON-PoCoMo step and one refresh with gradient
accumulation over micro-batches under DDP (``no_sync`` on all but the last)."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Sequence

import torch

from ._wrap import is_protocol_optimizer
from .state import keep_state_dicts_separate

__all__ = ["prepare", "unwrap", "train_step", "refresh"]


def unwrap(optimizer):
    """The package optimizer inside ``optimizer`` (an ``AcceleratedOptimizer``, or the
    optimizer itself)."""
    inner = optimizer
    while not is_protocol_optimizer(inner) and hasattr(inner, "optimizer"):
        inner = inner.optimizer
    if not is_protocol_optimizer(inner):
        raise TypeError(f"{type(optimizer).__name__} holds no poco_kernels optimizer with "
                        f"the sampling protocol")
    return inner


def prepare(accelerator, *objects):
    """``accelerator.prepare(*objects)``; every ``torch.nn.Module`` among ``objects``
    first gets :func:`~poco_kernels.integrations.keep_state_dicts_separate`, so that
    ``accelerator.save_state`` (safetensors by default) saves every parameter."""
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            keep_state_dicts_separate(obj)
    return accelerator.prepare(*objects)


def _passes(accelerator, model, micro_batches: Sequence[Any],
            loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]) -> torch.Tensor:
    """Forward and backward of every micro-batch (the loss divided by their number;
    DDP's all-reduce at the last only); returns the mean loss (detached)."""
    total = None
    n = len(micro_batches)
    for i, mb in enumerate(micro_batches):
        last = i == n - 1
        ctx = contextlib.nullcontext() if last or accelerator.num_processes == 1 \
            else accelerator.no_sync(model)
        with ctx:
            loss = loss_fn(model, mb)
            accelerator.backward(loss / n)
        part = loss.detach().float()             # stays on the device: no host sync
        total = part if total is None else total + part
    return total / n


def train_step(accelerator, model, optimizer, micro_batches: Sequence[Any],
               loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
               max_grad_norm: float = 0.0) -> torch.Tensor:
    """One optimizer step of IVON or IVON-PoCoMo over ``micro_batches`` (one mini-batch,
    accumulated): the micro-batches at ONE inner posterior sample, and once the
    correction is active again at the outer sample, then the update.  ``loss_fn(model,
    micro_batch)`` returns the mean loss; ``max_grad_norm`` > 0 clips each sample's
    gradient (inside the sample, as the protocol asks).  Returns the mean inner loss.

    The update is ``optimizer.step()``, the wrapper's (which calls the package's
    ``step()``): an lr scheduler built over the prepared optimizer counts the steps of
    that object, and would otherwise warn that its ``step()`` came first."""
    opt = unwrap(optimizer)
    kinds = ["inner"] + (["outer"] if opt.correction_active() else [])
    loss = None
    for kind in kinds:
        with opt.sampled(kind):
            mean = _passes(accelerator, model, micro_batches, loss_fn)
            if max_grad_norm > 0:
                accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
        loss = mean if loss is None else loss
    optimizer.step()
    return loss


def refresh(accelerator, model, optimizer, chunks: Iterable[Sequence[Any]],
            loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]) -> None:
    """An IVON-PoCoMo refresh: every chunk of the mega-batch (each a list of
    micro-batches) at ONE posterior sample, the estimate their mean."""
    opt = unwrap(optimizer)
    with opt.sampled("refresh", accumulate=False):
        for chunk in chunks:
            _passes(accelerator, model, list(chunk), loss_fn)
            opt.accumulate()
    opt.refresh()
