"""Hand-written kernels: Triton (GPU, and the CPU interpreter in tests).

Import :mod:`poco_kernels.kernels.triton_ops` only where Triton is wanted: importing it
imports triton.  :func:`triton_status` says whether the Triton path can run here.
"""
from __future__ import annotations

import os
from typing import Optional

import torch


def triton_interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_status(device: torch.device) -> Optional[str]:
    """None when the Triton kernels can run on ``device``; else the reason they cannot."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the machine
        return f"triton cannot be imported ({type(exc).__name__}: {exc})"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and triton_interpreting():
        return None
    return (f"Triton kernels run on CUDA devices (or on the CPU under TRITON_INTERPRET=1), "
            f"not on {device}")
