"""The rule of an algorithm: the questions every optimizer of the family answers.

A rule is stateless: every method takes the bucket (its buffers), the bucket's parameter
group (its hyperparameters) and, where the answer depends on where the run is, the
optimizer's view (:class:`poco_kernels._view.OptimizerView`: counters, noise, whether a
group is joining the correction).  One instance per class serves every optimizer of it.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from torch import Tensor

from .._layout import Bucket
from .._protocol import KernelRefresh, KernelStep, SampleSpec


class Rule:
    """What an algorithm needs, stated once; subclasses answer for one algorithm."""

    #: the optimizer perturbs parameters (needs a sample before each gradient)
    noisy: bool = True
    #: the update needs Price Hessian estimates (accumulate ``grad * eps``)
    uses_hessian: bool = True
    #: the optimizer has an outer loop (refresh) and a correction
    has_correction: bool = True
    #: the fused backends (Triton and C++) run it: :meth:`kernel_step` and
    #: :meth:`kernel_refresh` are defined
    kernel_capable: bool = True
    #: ``step(closure)`` may be replayed from a plan (``poco_kernels._step_plan``): its
    #: step pattern is tested against the slow path (IVON, IVON-PoCo(Mo))
    step_plans: bool = False
    #: per-parameter buffers created at their first use (not present before)
    lazy_buffers: Tuple[str, ...] = ()
    #: the buffers that ``state_dtype`` stores in low precision (stochastic rounding)
    low_state_buffers: Tuple[str, ...] = ()
    #: the buffers that ``outer_dtype`` stores in its dtype (the outer estimates)
    outer_estimate_buffers: Tuple[str, ...] = ()
    #: appended to the error raised when an update would produce non-finite state
    divergence_hint: str = "Lower the learning rate."

    def init_buffers(self, b: Bucket, group: Dict[str, Any]) -> Dict[str, Tensor]:
        """The bucket's state buffers at the start (besides the mean)."""
        raise NotImplementedError

    def check_state_value(self, name: str, t: Tensor, group: Dict[str, Any],
                          what: str) -> None:
        """Refuse a loaded state buffer whose values the algorithm cannot take."""

    def sample_spec(self, b: Bucket, group: Dict[str, Any], kind: int,
                    draw: int) -> SampleSpec:
        """Where a sample of ``kind`` (draw ``draw``) is centred, how wide it is, and which
        noise it uses: the one statement that every backend follows."""
        raise NotImplementedError

    def inner_update(self, b: Bucket, group: Dict[str, Any], g_in: Tensor,
                     ge_in: Optional[Tensor], outer, t: int, view) -> Dict[str, Tensor]:
        """The new buffers of an inner step (reference maths, out of place).  ``outer``:
        the mean gradient and gradient * eps at the outer samples, or None (no
        correction)."""
        raise NotImplementedError

    def refresh_update(self, b: Bucket, group: Dict[str, Any], gM: Tensor,
                       geM: Optional[Tensor], first: bool, view) -> Dict[str, Tensor]:
        """The new buffers of a refresh (reference maths, out of place)."""
        raise NotImplementedError

    def kernel_step(self, b: Bucket, group: Dict[str, Any], view) -> KernelStep:
        """The step kernel's buffers and records for a bucket (the maths of
        :meth:`inner_update`)."""
        raise NotImplementedError

    def kernel_refresh(self, b: Bucket, group: Dict[str, Any], view) -> KernelRefresh:
        """The refresh kernel's buffers and records for a bucket (:meth:`refresh_update`)."""
        raise NotImplementedError
