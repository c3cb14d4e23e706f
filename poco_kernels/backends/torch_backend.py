"""The torch backend: the reference maths of :mod:`poco_kernels.reference`, op for op, on
any device and float dtype.

A step or a refresh computes every new buffer out of place through the optimizer's rule
(``rule.inner_update`` / ``rule.refresh_update``), checks the gradients and the
results for non-finite values, and only then commits: bad input raises and leaves the
optimizer as it was.
"""
from __future__ import annotations

from typing import Dict, FrozenSet, Optional, Tuple

import torch
from torch import Tensor

from .._layout import any_rank, shard_groups
from .._protocol import COUNTER_REFRESHES, COUNTER_STEPS, KIND_INNER, KIND_OUTER, KIND_REFRESH
from ..reference import perturb, stochastic_round
from .base import Backend


class TorchBackend(Backend):
    name = "torch"
    lazy_restore = False

    def __init__(self, view):
        super().__init__(view)
        #: the standard normal of the sample in the parameters, per bucket (None: none)
        self.active_eps: Dict[int, Optional[Tensor]] = {}

    # ------------------------------------------------------------------ sampling
    def sync_mean(self) -> None:
        if not self.params_hold_mean:
            return
        with torch.no_grad():
            for b in self.view.buckets:
                if b.param_dtype == b.dtype:
                    b.flat_params(out=b.buffers["mean"])

    def sample(self, kind: int, draw: int) -> None:
        if self.takes_ahead(kind, draw):      # the step left it there (its eps kept)
            self.params_hold_mean = False
            return
        self.ahead = None
        view = self.view
        self.sync_mean()
        self.active_eps = {}
        with torch.no_grad():
            for b in view.buckets:
                spec = view.spec(b, kind, draw)
                sigma, eps = None, None
                if spec.noise is not None:
                    nk, nd, slot, sign = spec.noise
                    sigma = spec.sigma_tensor()
                    eps = view.eps(b, nk, nd, view.counter(slot))
                    if sign < 0:
                        eps = -eps             # antithetic draw: the mirror image
                self.active_eps[b.index] = eps
                b.write_params(perturb(spec.centre, sigma, eps))
        self.params_hold_mean = False

    def at_mean(self) -> None:
        self.active_eps = {}
        self.ahead = None

    def accumulate(self, kind: int, draw: int, lend: bool = True) -> FrozenSet[int]:
        view = self.view
        sums = view.pending.sums
        with torch.no_grad():
            # every bucket first: a refused gradient (sparse) raises before a sum changes
            flats = [b.flat_grads() for b in view.buckets]
            for b, g in zip(view.buckets, flats):
                key = (kind, b.index, "g")
                sums[key] = sums[key] + g if key in sums else g
                eps = self.active_eps.get(b.index)
                if view.rule.uses_hessian and eps is not None:
                    key = (kind, b.index, "ge")
                    ge = g * eps
                    sums[key] = sums[key] + ge if key in sums else ge
        return frozenset()

    def restore(self) -> None:
        with torch.no_grad():
            for b in self.view.buckets:
                b.write_params(b.buffers["mean"])
        self.active_eps = {}
        self.params_hold_mean = True
        self.ahead = None

    # ------------------------------------------------------------------ updates
    def estimate(self, kind: int, b, grad_scale: Optional[Tensor]
                 ) -> Tuple[Tensor, Optional[Tensor]]:
        """(mean gradient, mean gradient * eps) over the collected samples of ``kind``."""
        pend = self.view.pending
        n = pend.count[kind]
        g = pend.sums[(kind, b.index, "g")] / n
        ge = pend.sums.get((kind, b.index, "ge"))
        ge = None if ge is None else ge / n
        if grad_scale is not None:
            inv = 1.0 / grad_scale.to(device=b.device, dtype=b.dtype)
            g = g * inv
            ge = None if ge is None else ge * inv
        return g, ge

    def _on_any_rank(self, bad: bool) -> bool:
        """``bad`` on this rank or on any rank the parameters are sharded over (the
        unsharded run sees every element: every rank must refuse alike)."""
        groups = shard_groups(self.view.buckets)
        if not groups:
            return bad
        flag = torch.tensor([int(bad)], device=self.view.buckets[0].device)
        return bool(any_rank(flag, groups).item())

    def check_gradients(self, *ts) -> None:
        bad = any(t is not None and not bool(torch.isfinite(t).all()) for t in ts)
        if self._on_any_rank(bad):
            raise ValueError("non-finite gradient (inf or nan): the update was not taken and the "
                             "optimizer state is unchanged (with AMP, pass found_inf to skip)")

    def check_new(self, new: Dict[int, Dict[str, Tensor]], slot: int = COUNTER_STEPS) -> None:
        """Refuse an update that produced non-finite state (nothing committed).  A
        low-precision buffer's new value (``state_dtype``) is rounded here, so what is
        checked is what ``commit`` stores."""
        view = self.view
        bad = None
        for b in view.buckets:
            bufs = new.get(b.index, {})
            for name, t in list(bufs.items()):
                have = b.buffers.get(name)
                if have is not None and have.dtype == torch.bfloat16 != t.dtype:
                    bufs[name] = t = stochastic_round(
                        t, view.rounding_bits(b, name, view.counter(slot)))
                if bad is None and not bool(torch.isfinite(t).all()):
                    bad = name
        if self._on_any_rank(bad is not None):
            where = repr(bad) if bad is not None else "another rank's shards"
            raise FloatingPointError(
                f"the update produced non-finite values in {where}: the update was not taken "
                f"and the optimizer state is unchanged. {self.view.rule.divergence_hint}")

    def commit(self, new: Dict[int, Dict[str, Tensor]]) -> None:
        """Copy the new buffers in (creating those made at their first use; low-precision
        ones come rounded from ``check_new``) and write the mean into the parameters."""
        for b in self.view.buckets:
            added = False
            for name, t in new.get(b.index, {}).items():
                if name in b.buffers:
                    b.buffers[name].copy_(t)
                else:
                    b.buffers[name] = t.clone()
                    added = True
            if added:
                self.view.expose(b)
            b.write_params(b.buffers["mean"])
        self.params_hold_mean = True

    def host_readable(self, t: Tensor) -> bool:
        return True

    def loaded(self) -> None:
        self.active_eps = {}
        self.params_hold_mean = True
        self.ahead = None

    def relayout(self) -> None:
        self.active_eps = {}
        self.ahead = None

    def rebuilt(self, old_buckets) -> None:
        self.active_eps = {}
        self.ahead = None

    def skipped_on_host(self, found_inf: Optional[Tensor]) -> bool:
        return found_inf is not None and bool(found_inf.detach().float().sum() != 0)

    def step(self, corr, grad_scale, found_inf) -> bool:
        self.ahead = None                 # (the optimizer draws the next sample after it)
        if self.skipped_on_host(found_inf):
            return False               # AMP overflow: skip, state untouched
        view = self.view
        new = {}
        for b in view.buckets:
            group = view.group(b)
            g_in, ge_in = self.estimate(KIND_INNER, b, grad_scale)
            outer = self.estimate(KIND_OUTER, b, grad_scale) if b.index in corr else None
            self.check_gradients(g_in, ge_in, *(outer or ()))
            new[b.index] = view.rule.inner_update(b, group, g_in, ge_in, outer, view.steps + 1,
                                                  view)
        self.check_new(new, COUNTER_STEPS)
        self.commit(new)
        return True

    def refresh(self, grad_scale, found_inf) -> bool:
        self.ahead = None
        if self.skipped_on_host(found_inf):
            return False
        view = self.view
        new = {}
        for b in view.buckets:
            group = view.group(b)
            gM, geM = self.estimate(KIND_REFRESH, b, grad_scale)
            self.check_gradients(gM, geM)
            new[b.index] = view.rule.refresh_update(b, group, gM, geM, view.first_refresh(b), view)
        self.check_new(new, COUNTER_REFRESHES)
        self.commit(new)
        return True
