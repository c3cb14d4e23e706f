"""Hand-written kernels: Triton (GPU, and the CPU interpreter in tests) and C++ (CPU).

:func:`triton_status` and :func:`cpp_status` say whether each path can run;
:func:`ops_for` gives the wrapper module of a backend.  Importing
:mod:`poco_kernels.kernels.triton_ops` imports triton; importing
:mod:`poco_kernels.kernels.cpp_ops` loads the C++ extension.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

INSTALL_HINT = ("build it by reinstalling poco_kernels from source with a C++ compiler: "
                "`pip install ninja && pip install --no-build-isolation .` (add -e in a "
                "checkout; the README's set-up commands do this)")


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


def cpp_status(device: Optional[torch.device] = None) -> Optional[str]:
    """None when the C++ kernels can run (on ``device``, if given); else the reason.
    ``POCO_KERNELS_NO_EXTENSION=1`` makes the package behave as if the extension were not
    built (it is also what skips building it)."""
    if device is not None and device.type != "cpu":
        return f"the C++ kernels run on the CPU, not on {device}"
    if os.environ.get("POCO_KERNELS_NO_EXTENSION") == "1":
        return ("the C++ extension is disabled (POCO_KERNELS_NO_EXTENSION=1): unset it to use "
                f"it; if it is not built, {INSTALL_HINT}")
    try:
        import poco_kernels._C  # noqa: F401
    except ImportError as exc:
        return f"the C++ extension poco_kernels._C is not built ({exc}); {INSTALL_HINT}"
    return None


def ops_for(backend: str):
    """The kernel wrapper module of a fused backend ('triton' or 'cpp')."""
    if backend == "triton":
        from . import triton_ops
        return triton_ops
    if backend == "cpp":
        from . import cpp_ops
        return cpp_ops
    raise ValueError(f"no kernels for backend {backend!r}")


def device_randn(numel: int, seed: int, counter: int, stream: int, *, device,
                 dtype: torch.dtype, version: int, offset: int = 0,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The noise stream :func:`poco_kernels.noise.randn` where the torch backend draws it:
    on a GPU the Triton kernels' generator in one launch (``triton_ops.randn``: the same
    Philox words and uniforms, the kernels' branch-free transform, within an ulp of the
    torch ops' log, cos and sin), elsewhere the torch ops themselves (the CPU's numbers
    are those of ``noise.randn``, bit for bit).  ``out``: a contiguous 1-D tensor of
    ``numel`` elements to write (returned)."""
    from .. import noise as _noise
    device = torch.device(device)
    if device.type == "cuda" and not triton_interpreting() and triton_status(device) is None:
        from . import triton_ops
        f32 = out if (out is not None and out.dtype == torch.float32) else \
            torch.empty(numel, device=device, dtype=torch.float32)
        with torch.cuda.device(device):          # (Triton launches on the current device)
            triton_ops.randn(f32, seed, counter, stream, offset, version)
        if out is None:
            return f32 if dtype == torch.float32 else f32.to(dtype)
        if f32 is not out:
            out.copy_(f32)
        return out
    return _noise.randn(numel, seed, counter, stream, offset=offset, device=device,
                        dtype=dtype, out=out, version=version)
