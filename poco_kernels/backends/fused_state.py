"""The fused engine's bookkeeping: its counters on the device and the state dict's view.

Steps, refreshes and skipped updates taken live in a control tensor per device
(``ctl``), read on the host only when asked (:meth:`StateMixin.counters`), where a
momentum buffer made by a step the device skipped is dropped
(:meth:`StateMixin._settle_momentum`).  Also: the pending sums brought into the state
dict's layout, and what a loaded state dict, a new layout, a copy's skipped count or a
rebuild of the buckets changes.
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from ..kernels import interface as iface


class StateMixin:
    """The counters and bookkeeping of :class:`~poco_kernels.backends.fused.FusedBackend`:
    the control tensors, SGD's momentum start, the state dict's pending sums, and the
    protocol's notices (loaded, relayout, set_skipped, rebuilt)."""

    # ------------------------------------------------------------------ counters
    @staticmethod
    def _counters_tensor(steps: int, refreshes: int, skipped: int, device) -> Tensor:
        c = torch.zeros(iface.CTL_SIZE, dtype=torch.int64)
        c[iface.CTL_STEPS], c[iface.CTL_REFRESHES], c[iface.CTL_SKIPPED] = steps, refreshes, skipped
        return c.to(device)

    def set_counters(self, steps: int, refreshes: int) -> None:
        """Set the steps and refreshes taken (a state dict was loaded); the count of
        skipped updates is kept."""
        for dev, c in self.ctl.items():
            c.copy_(self._counters_tensor(steps, refreshes, int(c[iface.CTL_SKIPPED]), dev))

    def counters(self) -> Tuple[int, int, int]:
        """(steps taken, refreshes taken, updates skipped) -- reads the device.  A
        momentum buffer made by a step the device skipped is dropped here, as the host
        drops it after a step it knows was skipped (:meth:`_settle_momentum`)."""
        if not self.ctl:
            return self.view.steps, self.view.refreshes, 0
        c = next(iter(self.ctl.values())).tolist()
        self._settle_momentum(int(c[iface.CTL_STEPS]))
        return int(c[iface.CTL_STEPS]), int(c[iface.CTL_REFRESHES]), int(c[iface.CTL_SKIPPED])

    def _settle_momentum(self, steps: int) -> None:
        """The counters were read (``steps`` taken): a momentum buffer of
        :attr:`mom_start` made by a step that was skipped (no step taken since) is
        dropped, so the next step makes it anew, as the first; one that a step has used
        since is started."""
        for bi, (start, buf) in list(self.mom_start.items()):
            del self.mom_start[bi]
            if steps != int(start):
                continue
            b = self.view.buckets[bi]
            for name in [n for n, v in b.buffers.items() if v is buf]:
                del b.buffers[name]
                self.view.expose(b)

    def _momentum_first(self, b, t):
        """The step record ``t`` of bucket ``b``, with SGD's ``mom_first`` read on the
        device while only the device knows whether the step that made the momentum
        buffer was taken: 1 until a step is taken (the steps-taken counter unchanged),
        then 0, as ``torch.optim.SGD`` starts its buffer at the first step it takes."""
        entry = self.mom_start.get(b.index)
        if entry is None or t.s1 is not entry[1] or isinstance(t.hp.mom_first, Tensor) \
                or t.hp.mom_first != 0.0:
            return t
        first = (self._ctl(b)[iface.CTL_STEPS] == entry[0]).to(torch.float64)
        return t._replace(hp=t.hp._replace(mom_first=first))

    def _ctl(self, b) -> Tensor:
        return self.ctl[b.device]

    # ------------------------------------------------------------------ state dict
    @torch.no_grad()
    def prepare_state_dict(self) -> None:
        """Give every pending noisy sum its ``g * eps`` sum (for the state dict, which
        has the torch backend's layout)."""
        view = self.view
        if not view.rule.uses_hessian:
            return
        for kind, count in view.pending.count.items():
            if count == 0:
                continue
            for b in view.buckets:
                if (kind, b.index, "ge") in view.pending.sums:
                    continue
                noise = self.noise_of(kind, b, 0)
                if noise is None:
                    continue
                acc_g = self._acc(kind, b, "g")
                acc_ge = self._acc(kind, b, "ge")
                self._fold_ge(b, acc_g, acc_ge, *noise)
                view.pending.sums[(kind, b.index, "ge")] = acc_ge

    # ------------------------------------------------------------------ bookkeeping
    def loaded(self) -> None:
        self._parks = None              # (the state dict may bring other buffers)
        self.params_hold_mean = True
        self.ahead = None
        self.mom_start.clear()          # (the state dict says which buffers exist)
        self.set_counters(self.view.steps, self.view.refreshes)

    def relayout(self) -> None:
        self.ahead = None
        self.rows.clear()
        self.pool.clear()
        self.active_noise.clear()
        self._forget_tables()
        self.flatten()

    def _forget_tables(self) -> None:
        """The launch tables name the buckets' tensors: none survives a new layout."""
        self._tile_cache.clear()
        self._direct_tables.clear()

    def set_skipped(self, skipped: int) -> None:
        for c in self.ctl.values():
            c[iface.CTL_SKIPPED].fill_(skipped)

    def rebuilt(self, old_buckets) -> None:
        self.ahead = None
        self._forget_tables()
        for b_new, b_old in zip(self.view.buckets, old_buckets):
            for attr in ("flat_param", "grad_flat", "grad_views", "grad_bufs", "handed",
                         "presence"):
                if hasattr(b_old, attr):
                    setattr(b_new, attr, getattr(b_old, attr))
        self.flatten()
