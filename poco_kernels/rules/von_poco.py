"""VON-PoCo's rule (Alg. 4 of the paper, Thm. 3): a full-Gaussian posterior with a dense
``d x d`` precision per bucket.  Its update, :func:`poco_kernels.reference.von_poco_step`,
needs per-example Hessians that ``.grad`` does not carry, so
:class:`~poco_kernels.von_poco.VONPoCo` runs it itself, on the torch backend; the rule
states its buffers and flags."""
from __future__ import annotations

import torch

from .._validation import check
from .base import Rule

__all__ = ["VONPoCoRule", "MAX_DIM"]

#: the largest bucket (parameters per group, device and dtype): a dense precision
MAX_DIM = 8192


class VONPoCoRule(Rule):
    """VON-PoCo: the precision ``S`` (dense), the outer point ``m_out``/``theta_out`` and
    the outer gradient and Hessian ``g_out``/``H_out``; no fused kernels."""

    noisy = True
    uses_hessian = True
    has_correction = True
    kernel_capable = False     # dense d x d matrices: the torch backend only
    divergence_hint = ("Huge gradients against a small precision: lower lr, raise min_eig, "
                       "or refresh more often.")

    def init_buffers(self, b, group):
        check(b.param_dtype in (torch.float32, torch.float64),
              f"VONPoCo supports float32 and float64 parameters only, got {b.param_dtype} "
              "(Hessians in half precision are not meaningful)")
        check(b.numel <= MAX_DIM,
              f"VONPoCo keeps a dense {b.numel} x {b.numel} precision per bucket; at most "
              f"{MAX_DIM} parameters per (group, device, dtype) are supported")
        d, kw = b.numel, dict(device=b.device, dtype=b.dtype)
        s0 = float(group["ess"]) * float(group["prior_precision"])
        return {"precision": s0 * torch.eye(d, **kw),
                "m_out": torch.zeros(d, **kw),
                "theta_out": torch.zeros(d, **kw),
                "g_out": torch.zeros(d, **kw),
                "H_out": torch.zeros(d, d, **kw)}
