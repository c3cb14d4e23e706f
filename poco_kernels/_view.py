"""What a backend sees of its optimizer: :class:`OptimizerView`, declared member by member.

A backend runs an optimizer's rule (:mod:`poco_kernels.rules`) over its buckets; it
reads the layout and the protocol's state, asks where samples lie and draws their noise,
and nothing else.  The optimizer hands each backend this view, not itself, so what a
backend may use is this class's members, and adding one is a visible change here.
"""
from __future__ import annotations

from typing import Any, Dict, List

from torch import Tensor

from ._layout import Bucket
from ._protocol import Pending, SampleSpec

__all__ = ["OptimizerView"]


class OptimizerView:
    """An optimizer as its backend sees it (read-only, live: every member reads the
    optimizer's current value)."""

    __slots__ = ("_opt",)

    def __init__(self, opt):
        self._opt = opt

    # ------------------------------------------------------------------ what it is
    @property
    def name(self) -> str:
        """The optimizer's class name (for messages)."""
        return type(self._opt).__name__

    @property
    def rule(self):
        """The algorithm: :class:`poco_kernels.rules.Rule`."""
        return self._opt.rule

    # ------------------------------------------------------------------ configuration
    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self._opt._groups

    @property
    def seed(self) -> int:
        return self._opt.seed

    @property
    def backend(self) -> str:
        """The backend's name (``"auto"`` resolved)."""
        return self._opt.backend

    @property
    def check_finite(self) -> bool:
        return self._opt.check_finite

    @property
    def grad_views(self) -> bool:
        return self._opt.grad_views

    @property
    def sample_ahead(self) -> Optional[bool]:
        return self._opt.sample_ahead

    @property
    def noise_version(self) -> int:
        return self._opt.noise_version

    # ------------------------------------------------------------------ layout and state
    @property
    def buckets(self) -> List[Bucket]:
        return self._opt._buckets

    @property
    def pending(self) -> Pending:
        """The gradient sums collected since the last update."""
        return self._opt._pending

    @property
    def steps(self) -> int:
        """Inner steps taken (as the host knows them)."""
        return self._opt._step

    @property
    def refreshes(self) -> int:
        """Refreshes taken."""
        return self._opt._refreshes

    def group(self, b: Bucket, keep_tensors: bool = False) -> Dict[str, Any]:
        """Bucket ``b``'s hyperparameters (tensor values read as floats unless
        ``keep_tensors``)."""
        return self._opt._group(b, keep_tensors)

    def spec(self, b: Bucket, kind: int, draw: int) -> SampleSpec:
        """Where a sample of ``kind`` lies for bucket ``b``."""
        return self._opt._spec(b, kind, draw)

    def first_refresh(self, b: Bucket) -> bool:
        """The next refresh is the first for ``b`` (its estimates are set, not folded)."""
        return self._opt._first_refresh(b)

    def joining(self, b: Bucket) -> bool:
        """``b``'s group was added after a refresh and has not been taken in by one."""
        return self._opt._joining(b)

    def correction_settled(self) -> bool:
        """A refresh has been taken and no group waits for its first: which buckets the
        correction covers no longer depends on whether the next refresh is taken."""
        return self._opt._correction_settled()

    # ------------------------------------------------------------------ noise and views
    def eps(self, b: Bucket, kind: int, draw: int, counter: int) -> Tensor:
        """The standard normal of (bucket, kind, draw, counter)."""
        return self._opt._eps(b, kind, draw, counter)

    def rounding_bits(self, b: Bucket, name: str, counter: int) -> Tensor:
        """The stochastic-rounding bits of buffer ``name`` at ``counter``."""
        return self._opt._rounding_bits(b, name, counter)

    def counter(self, slot: int) -> int:
        """The noise counter of ``slot`` (steps or refreshes)."""
        return self._opt._counter(slot)

    def expose(self, b: Bucket) -> None:
        """Publish ``b``'s buffers as per-parameter state views (a buffer was added)."""
        self._opt._expose(b)
