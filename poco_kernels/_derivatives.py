"""Gradients and Hessian blocks of a loss by autograd, per bucket: what VON-PoCo
(:mod:`poco_kernels.von_poco`) needs from each closure evaluation (its closures return the
loss; ``.grad`` is neither read nor written)."""
from __future__ import annotations

from typing import List, Tuple

import torch
from torch import Tensor

from ._layout import Bucket

__all__ = ["bucket_hessian", "grads_and_hessians"]


def bucket_hessian(flat_g: Tensor, b: Bucket, batched: bool = True) -> Tensor:
    """The Hessian block of one bucket from its flat gradient (a graph attached): all rows
    in one batched (vmap) backward, or (``batched`` False, or an op without a batching
    rule) a row at a time; symmetrised."""
    d = b.numel
    if not flat_g.requires_grad:            # gradient constant: zero Hessian
        return torch.zeros(d, d, device=b.device, dtype=b.dtype)
    rows = None
    if batched:
        eye = torch.eye(d, device=flat_g.device, dtype=flat_g.dtype)
        try:
            rows = torch.autograd.grad(flat_g, b.params, grad_outputs=eye,
                                       retain_graph=True, allow_unused=True,
                                       is_grads_batched=True)
            rows = [torch.zeros(d, p.numel(), device=b.device, dtype=p.dtype)
                    if r is None else r.reshape(d, -1) for r, p in zip(rows, b.params)]
        except RuntimeError:                 # an op without a batching rule
            rows = None
    if rows is None:
        out = []
        for k in range(d):
            e = torch.zeros_like(flat_g)
            e[k] = 1.0
            r = torch.autograd.grad(flat_g, b.params, grad_outputs=e, retain_graph=True,
                                    allow_unused=True)
            out.append(torch.cat([torch.zeros(p.numel(), device=b.device, dtype=p.dtype)
                                  if x is None else x.reshape(-1)
                                  for x, p in zip(r, b.params)]))
        H = torch.stack(out)
    else:
        H = torch.cat(rows, dim=1)
    H = H.detach().to(b.dtype)
    return 0.5 * (H + H.mT)                 # the Hessian is symmetric; remove round-off


def grads_and_hessians(loss, buckets: List[Bucket], batched: bool = True
                       ) -> List[Tuple[Tensor, Tensor]]:
    """(flat gradient, Hessian block) of ``loss`` for every bucket; a clear error for a
    loss that is not a scalar, not finite, or not differentiable (the graph freed by a
    ``backward()`` in the closure, or built under ``no_grad``), and for a non-finite
    gradient or Hessian."""
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise TypeError("a VONPoCo closure must return the loss as a scalar tensor "
                        f"(got {type(loss).__name__})")
    if not bool(torch.isfinite(loss.detach()).all()):
        raise ValueError("non-finite loss (inf or nan): the step was not taken and the "
                         "optimizer state is unchanged")
    if not buckets:           # no trainable parameter: nothing to differentiate
        return []
    if not loss.requires_grad:
        raise ValueError(
            "the closure's loss does not depend on the parameters through autograd: a "
            "VONPoCo closure must return the loss WITHOUT calling backward() and not "
            "under torch.no_grad()")
    params = [p for b in buckets for p in b.params]
    try:
        grads = torch.autograd.grad(loss.reshape(()), params, create_graph=True,
                                    allow_unused=True)
    except RuntimeError as e:
        if "second time" in str(e) or "freed" in str(e):
            raise RuntimeError(
                "the loss graph was already freed: a VONPoCo closure must return the loss "
                "WITHOUT calling backward() (the optimizer computes gradient and Hessian)"
            ) from e
        raise
    out, i = [], 0
    for b in buckets:
        gs = grads[i:i + len(b.params)]
        i += len(b.params)
        flat = torch.cat([torch.zeros(p.numel(), device=b.device, dtype=p.dtype)
                          if g is None else g.reshape(-1) for g, p in zip(gs, b.params)])
        g = flat.detach().to(b.dtype)
        if not bool(torch.isfinite(g).all()):
            raise ValueError("non-finite gradient (inf or nan): the step was not taken and "
                             "the optimizer state is unchanged")
        H = bucket_hessian(flat, b, batched)
        if not bool(torch.isfinite(H).all()):
            raise ValueError("non-finite Hessian (inf or nan): the step was not taken and "
                             "the optimizer state is unchanged")
        out.append((g, H))
    return out
