"""Backends: one protocol (:class:`~poco_kernels.backends.base.Backend`), one registry.

=========  =================================================  ==========================
name       what runs                                          module
=========  =================================================  ==========================
``torch``  the reference maths (:mod:`poco_kernels.reference`)  :mod:`.torch_backend`
           op for op, on any device and float dtype
``triton`` fused Triton kernels over flat buffers (CUDA; the   :mod:`.fused` +
           CPU under ``TRITON_INTERPRET=1``)                   :mod:`..kernels.triton_ops`
``cpp``    the same fused operations in C++ (CPU)              :mod:`.fused` +
                                                               :mod:`..kernels.cpp_ops`
=========  =================================================  ==========================

``auto`` picks Triton when every parameter is on a CUDA device, C++ when every parameter
is on the CPU (and the extension is built), the torch backend otherwise.
"""
from __future__ import annotations

from typing import List

import torch

from ..kernels import cpp_status, ops_for, triton_status
from .base import Backend
from .fused import bucket_reasons

__all__ = ["NAMES", "Backend", "resolve", "create", "fused_reasons", "bucket_reasons"]

NAMES = ("auto", "torch", "triton", "cpp")
_FUSED_LABEL = {"triton": "Triton", "cpp": "C++"}


def fused_reasons(view, backend: str) -> List[str]:
    """Why the fused ``backend`` ('triton' or 'cpp') cannot run the parameters of the
    optimizer seen through ``view`` (:class:`poco_kernels._view.OptimizerView`; empty: it
    can)."""
    reasons = []
    if not view.rule.kernel_capable:
        reasons.append(f"{view.name} has no {_FUSED_LABEL[backend]} kernels")
    return list(dict.fromkeys(reasons + bucket_reasons(backend, view.buckets)))


def resolve(name: str, view) -> str:
    """The backend that runs the optimizer of ``view``: ``name``, or for 'auto' the best
    that can; a fused backend that cannot run is a RuntimeError saying why."""
    if name == "torch":
        return "torch"
    if name in _FUSED_LABEL:
        reasons = fused_reasons(view, name)
        if reasons:
            raise RuntimeError(f"backend={name!r} cannot run here: " + "; ".join(reasons)
                               + ". Use backend='torch' (the reference maths) or 'auto'.")
        return name
    devices = {b.device.type for b in view.buckets}
    if devices == {"cuda"} and not fused_reasons(view, "triton"):
        return "triton"
    if devices == {"cpu"} and not fused_reasons(view, "cpp"):
        return "cpp"
    return "torch"


def create(name: str, view) -> Backend:
    """The backend object of a resolved ``name`` for the optimizer of ``view``."""
    if name == "torch":
        from .torch_backend import TorchBackend
        return TorchBackend(view)
    if name in _FUSED_LABEL:
        from .fused import FusedBackend
        return FusedBackend(view, name, ops_for(name))
    raise ValueError(f"unknown backend {name!r} (expected one of {NAMES})")
