"""The paper's double-loop schedule, alpha schedules, and the gradient-evaluation count.

>>> loop = DoubleLoop(opt, refresh_every=10_000, warmup_steps=20_000,
...                   alpha=Linear(0.2, 0.8, total_steps=100_000))
>>> for batch in batches:
...     if loop.refresh_due():
...         loop.refresh(megabatch_closures, examples=50_000)
...     loss = loop.step(closure, examples=len(batch))
>>> loop.grad_evals / N        # gradient evaluations per example: the paper's x-axis

Counting follows Sec. 4.3 of the paper: an inner step costs ``mc_samples`` gradients on
its mini-batch, twice once the correction is active; a refresh costs one gradient per
mega-batch example.  Over ``n`` epochs with inner steps on all ``N`` examples this gives
``2 n N + floor(n N / m) |M|``.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Iterable, Union

from torch import Tensor

__all__ = ["Constant", "Linear", "WarmupConstant", "DoubleLoop"]


@dataclass(frozen=True)
class Constant:
    """alpha(t) = value."""
    value: float

    def __call__(self, step: int) -> float:
        return self.value


@dataclass(frozen=True)
class Linear:
    """alpha goes linearly from ``start`` (at step ``begin``) to ``end`` (at
    ``total_steps``) and stays there: increasing (the paper's advocated 0.2 -> 0.8) or
    decreasing (alpha-SVRG's 0.8 -> 0.2)."""
    start: float
    end: float
    total_steps: int
    begin: int = 0

    def __post_init__(self):
        if self.total_steps <= self.begin:
            raise ValueError("Linear: total_steps must exceed begin")

    def __call__(self, step: int) -> float:
        f = min(max((step - self.begin) / (self.total_steps - self.begin), 0.0), 1.0)
        return self.start + (self.end - self.start) * f


@dataclass(frozen=True)
class WarmupConstant:
    """alpha = 0 for the first ``warmup`` steps, then ``value``."""
    value: float
    warmup: int

    def __call__(self, step: int) -> float:
        return 0.0 if step < self.warmup else self.value


class DoubleLoop:
    """Drives an optimizer with an outer loop (``SVRG``, ``VSGDPoCo``, ``IVONPoCo`` ...).

    ``refresh_every`` (m): inner steps between refreshes; ``warmup_steps``: inner steps
    before the first refresh (no correction until then); ``alpha``: a number or a
    schedule ``step -> alpha`` written into every parameter group before each step (into
    a tensor ``alpha`` in place, as ``torch.optim.lr_scheduler`` writes a tensor ``lr``).

    The schedule counts the loop's own calls of :meth:`step` (``iterations``, a host
    integer), so a steady-state iteration never reads the optimizer's device counters (a
    host synchronisation on a GPU).  An update the optimizer skipped (AMP overflow, a
    non-finite gradient) still counts as an iteration, as it does for an lr scheduler;
    ``steps`` is the optimizer's count of updates taken (a device read on the fused
    backends).

    Resuming: the loop starts from the optimizer's step count, and follows it again
    whenever the optimizer loads a state dict (one read, at the next schedule decision),
    so building model, optimizer and loop first and loading the optimizer's checkpoint
    after continues the schedule.  Loading the loop's own :meth:`state_dict` after the
    optimizer's restores its exact count (with skipped updates) and ``grad_evals``.
    """

    def __init__(self, optimizer, *, refresh_every: int, warmup_steps: int = 0,
                 alpha: Union[None, float, Callable[[int], float]] = None):
        if not (isinstance(refresh_every, int) and refresh_every >= 1):
            raise ValueError(f"refresh_every must be a positive int, got {refresh_every!r}")
        if not (isinstance(warmup_steps, int) and warmup_steps >= 0):
            raise ValueError(f"warmup_steps must be a non-negative int, got {warmup_steps!r}")
        if not hasattr(optimizer, "refresh"):
            raise TypeError(f"{type(optimizer).__name__} has no outer loop to drive")
        self.optimizer = optimizer
        self.refresh_every = refresh_every
        self.warmup_steps = warmup_steps
        self.alpha = Constant(float(alpha)) if isinstance(alpha, (int, float)) else alpha
        self.grad_evals = 0
        self.refresh_steps = []      # iterations at which a refresh happened
        self._iterations = optimizer.step_count   # (it may have stepped before: one read)
        self._follow = False         # True: take the optimizer's count at the next decision
        if hasattr(optimizer, "register_load_state_dict_post_hook"):
            me = weakref.ref(self)

            def loaded(opt):
                loop = me()
                if loop is not None:
                    loop._follow = True
            self._hook = optimizer.register_load_state_dict_post_hook(loaded)

    @property
    def iterations(self) -> int:
        """Calls of :meth:`step` so far, counted on the host; the optimizer's step count
        (a device read) when the loop takes over an optimizer, or after that optimizer
        loaded a state dict."""
        if self._follow:
            self._iterations = self.optimizer.step_count
            self._follow = False
        return self._iterations

    @iterations.setter
    def iterations(self, value: int) -> None:
        self._iterations = int(value)
        self._follow = False

    @property
    def steps(self) -> int:
        """Updates the optimizer has taken (on the fused backends a device read)."""
        return self.optimizer.step_count

    def refresh_due(self) -> bool:
        t = self.iterations
        return t >= self.warmup_steps and (t - self.warmup_steps) % self.refresh_every == 0 \
            and (not self.refresh_steps or self.refresh_steps[-1] != t)

    def refresh(self, closures: Iterable[Callable], examples: int):
        """Refresh on a mega-batch of ``examples`` examples given as chunk closures."""
        loss = self.optimizer.refresh(closures)
        k = max(int(g.get("refresh_samples", 1)) for g in self.optimizer.param_groups)
        self.grad_evals += k * examples
        self.refresh_steps.append(self.iterations)
        return loss

    def step(self, closure: Callable, examples: int):
        """One inner step on a mini-batch of ``examples`` examples."""
        opt = self.optimizer
        if self.alpha is not None:
            a = float(self.alpha(self.iterations))
            for g in opt.param_groups:
                if isinstance(g.get("alpha"), Tensor):
                    g["alpha"].fill_(a)     # (in place, on its device: a captured graph reads it)
                else:
                    g["alpha"] = a
        samples = max(int(g.get("mc_samples", 1)) for g in opt.param_groups)
        evals = samples * examples * (2 if opt.correction_active() else 1)
        loss = opt.step(closure)
        self.grad_evals += evals
        self.iterations = self.iterations + 1
        return loss

    def state_dict(self):
        return {"grad_evals": self.grad_evals, "refresh_steps": list(self.refresh_steps),
                "iterations": self.iterations}

    def load_state_dict(self, d):
        """Restore :meth:`state_dict`'s counts (validated first: a bad dict changes
        nothing).  A dict from before ``iterations`` was recorded takes the optimizer's
        step count (load the optimizer's state first)."""
        def count(v, name):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"DoubleLoop state: {name} must be a non-negative int, "
                                 f"got {v!r}")
            return v
        if not isinstance(d, dict) or not {"grad_evals", "refresh_steps"} <= set(d):
            raise ValueError("not a DoubleLoop state dict (needs 'grad_evals' and "
                             "'refresh_steps')")
        grad_evals = count(d["grad_evals"], "grad_evals")
        refresh_steps = [count(t, "refresh_steps[i]") for t in d["refresh_steps"]]
        iterations = (count(d["iterations"], "iterations") if "iterations" in d
                      else self.optimizer.step_count)
        self.grad_evals, self.refresh_steps = grad_evals, refresh_steps
        self.iterations = iterations
