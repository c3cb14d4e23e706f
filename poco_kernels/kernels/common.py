"""What the Triton kernels and the C++ kernels share: the code-path constants, the layout
of the control tensor and the packing of the step's flags.  No triton and no extension
import here: the host engine (``poco_kernels/_fused_backend.py``) uses it for both."""
from __future__ import annotations

# ``sigma`` of a sample (``sample``)
SIGMA_NONE, SIGMA_IVON, SIGMA_BUFFER, SIGMA_CONST = 0, 1, 2, 3
# update family of ``step`` / ``refresh``
FAMILY_IVON, FAMILY_SGD, FAMILY_ADAMW = 0, 1, 2
# slots of the control tensor (int64, one per device): steps taken, refreshes taken,
# bad-gradient flag, skipped updates
CTL_STEPS, CTL_REFRESHES, CTL_BAD, CTL_SKIPPED = 0, 1, 2, 3
CTL_SIZE = 4

# bit layout of the ``flags`` of ``step`` (family in bits 0-1, then these); the C++
# side decodes the same layout (csrc/ops.cpp, StepBit)
STEP_BITS = ("CORR", "GE_IN", "GE_O", "SHARED_NOISE", "HESS_CORR", "FLOOR", "CLIP", "DEBIAS",
             "MOMENTUM", "NESTEROV")


def step_flags(family: int, **bits: bool) -> int:
    """Pack the code-path switches of ``step`` into one int (family in bits 0-1)."""
    unknown = set(bits) - set(STEP_BITS)
    if unknown:
        raise ValueError(f"unknown step flags {sorted(unknown)}")
    f = int(family)
    for i, name in enumerate(STEP_BITS):
        if bits.get(name, False):
            f |= 1 << (i + 2)
    return f


def unpack_step_flags(flags: int) -> dict:
    return {"FAMILY": flags & 3,
            **{name: bool(flags >> (i + 2) & 1) for i, name in enumerate(STEP_BITS)}}
