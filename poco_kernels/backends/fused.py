"""The fused backends, ``"triton"`` (GPU) and ``"cpp"`` (CPU): one host engine for both.

It owns the flat buffers and the control tensors and calls the kernels through a wrapper
module with one function per operation, :mod:`poco_kernels.kernels.triton_ops` or
:mod:`poco_kernels.kernels.cpp_ops` (same signatures, the typed records of
:mod:`poco_kernels.kernels.interface`).  What changes against the torch backend:

* **Flat parameters.**  The parameters of a bucket become views of one flat buffer of
  their dtype (``p.data`` is re-pointed at construction, and again where parameters
  were taken off it: :meth:`FusedBackend.check_layout`), so a sample, a restore
  and a step each write all of a bucket's parameters in one launch.
* **Gradient sums in place.**  Per (sample kind, bucket) one float32 buffer holds the sum
  of the gradients; a second, the sum of ``gradient * eps``, only once a kind has more
  than one draw (Monte-Carlo samples, antithetic refreshes).  With one draw, the update
  regenerates ``eps`` instead of reading it.  Buffers are allocated at first use and
  reused: no allocation per step in steady state.
* **Counters in a tensor.**  Steps and refreshes taken live in a control tensor on the
  buckets' device (``ctl``): kernels read the noise counter and the debiasing step from
  it, and a skipped update (AMP ``found_inf``, or a non-finite gradient seen while
  accumulating) leaves it and the state as they were, without the host looking.  The
  host reads the step count when asked (``step_count``, ``state_dict``), and after each
  refresh whether it was taken: that decides whether the correction is active.
* **Sharded parameters** (FSDP2's ``DTensor``, ``Bucket.segments``): FSDP2 owns the
  storage of the local shards (it all-gathers from it), so they are not re-pointed: an
  operation runs over each shard itself and its slice of the bucket's flat state, with
  the shard's place in the unsharded bucket as the noise offset (so every element draws
  the noise it draws unsharded): one launch per bucket on Triton (a table of the
  shards, ``triton_ops.Tiles``), one per shard on the C++ backend.  Gradients are FSDP2's
  reduce-scattered ``.grad`` (no views handed out), read in place by ``accumulate``.
* **No host synchronisation inside a step or a refresh** on a GPU, unless
  ``check_finite=True`` asks for the torch backend's error on non-finite gradients (one
  device-to-host read per update; free on the CPU, where it is the default); the first
  refresh reads one flag (whether it was taken decides whether the correction starts).
* **Hyperparameters on the device** (:mod:`poco_kernels.backends.hyper`): the kernels read
  them from float64 rows rewritten only when a value changes; a tensor ``lr`` or
  ``alpha`` is copied in on the device.  With the counters, the grad scale and
  ``found_inf`` on the device too, a step captured in a CUDA graph replays with the
  values of the moment: see ``docs/design.md``, "CUDA graphs and torch.compile".
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .._layout import any_rank, shard_groups
from .._protocol import (COUNTER_REFRESHES, COUNTER_STEPS, KIND_INNER, KIND_OUTER,
                         KIND_REFRESH)
from ..kernels import cpp_status, triton_status
from ..kernels import interface as iface
from .base import Backend
from .fused_grad_buffer import GradBuffer
from .fused_grads import GradsMixin
from .fused_presence import Watcher
from .fused_layout import LayoutMixin
from .fused_park import ParkMixin
from .fused_plan import PlanMixin
from .fused_samples import SamplesMixin
from .fused_state import StateMixin
from .hyper import HyperRows

__all__ = ["FusedBackend", "GradBuffer", "bucket_reasons"]


def bucket_reasons(backend: str, buckets) -> List[str]:
    """Why the fused ``backend`` cannot run these buckets (empty: it can)."""
    label = {"triton": "Triton", "cpp": "C++"}[backend]
    reasons = []
    for b in buckets:
        if b.param_dtype == torch.float64:
            reasons.append(f"float64 parameters are not supported by the {label} kernels "
                           "(float32, bfloat16, float16)")
        why = triton_status(b.device) if backend == "triton" else cpp_status(b.device)
        if why is not None:
            reasons.append(why)
    return list(dict.fromkeys(reasons))


class FusedBackend(LayoutMixin, GradsMixin, SamplesMixin, StateMixin, PlanMixin, ParkMixin,
                   Backend):
    """Owns the flat parameter/gradient buffers, the gradient sums and the control
    tensors of one optimizer.  ``ops``: the kernels' wrapper module (``triton_ops`` or
    ``cpp_ops``).

    Composed by job: :class:`~.fused_layout.LayoutMixin` (flat buffers, re-linking,
    launches per shard), :class:`~.fused_grads.GradsMixin` (the ``.grad`` views),
    :class:`~.fused_samples.SamplesMixin` (samples, gradient sums),
    :class:`~.fused_state.StateMixin` (counters, state dict, bookkeeping),
    :class:`~.fused_park.ParkMixin` (the mean in the parameters between public calls,
    nothing copied); the updates are here."""

    lazy_restore = True

    def __init__(self, view, name: str, ops):
        super().__init__(view)
        self.name = name
        self.ops = ops
        self.check_finite_default = name != "triton"   # a host read per update on a GPU
        #: Triton on a GPU reads autograd's own gradients in place (``_direct_grads``):
        #: the backward then hands its tensors over instead of adding each into a view, a
        #: kernel launch each.  Elsewhere (C++; Triton interpreted on the CPU, where a
        #: launch costs no more than the Python around it) the views
        self.grad_views_default = not (hasattr(ops, "Tiles") and view.buckets and all(
            b.device.type == "cuda" for b in view.buckets))
        self.ctl: Dict[torch.device, Tensor] = {}
        self.pool: Dict[Tuple[int, int], List[Optional[Tensor]]] = {}
        self.active_noise: Dict[int, Optional[Tuple[int, int, float]]] = {}
        #: the hyperparameter rows the kernels read (per bucket and record)
        self.rows = HyperRows()
        #: per bucket index, a momentum buffer (SGD family) made by a step that only the
        #: device knows whether it took (no ``check_finite``): (the steps-taken counter
        #: before that step, on the device; the buffer).  Until a step is taken the buffer
        #: has not started (:meth:`_momentum_first`); :meth:`counters` settles it
        self.mom_start: Dict[int, Tuple[Tensor, Tensor]] = {}
        #: the hooks that mark, per bucket, the parameters autograd reached since the
        #: views were handed out (``Bucket.presence``)
        self._watcher = Watcher()
        #: sharded buckets: one launch over all the local shards (Triton), not one per
        #: shard (:meth:`~.fused_layout.LayoutMixin._tiles`; False: per shard)
        self.tiled = hasattr(ops, "Tiles")
        self._tile_cache: Dict[int, dict] = {}
        #: per unsharded bucket whose gradients are read in place: (the bucket, the
        #: tables the kernels read them through by their addresses, the parameters' sizes)
        self._direct_tables: Dict[int, tuple] = {}
        #: the buckets whose every gradient the last ``accumulate`` read in place
        self._complete: frozenset = frozenset()
        self.flatten()

    # ------------------------------------------------------------------ updates
    def _amp(self, b, found_inf: Optional[Tensor], grad_scale: Optional[Tensor]):
        fi = None if found_inf is None else found_inf.to(b.device, non_blocking=True)
        gs = None if grad_scale is None else grad_scale.to(b.device, non_blocking=True)
        return fi, gs

    def _raise_if_bad(self, slot: int, found_inf) -> Optional[bool]:
        """``check_finite``: raise (state untouched) if a gradient was non-finite, unless
        an AMP ``found_inf`` says to skip, which the kernels have done.  Returns whether
        the update was taken (None while torch.compile traces: there the kernels skip such
        an update and ``skipped_updates`` counts it, as without ``check_finite``)."""
        if torch.compiler.is_compiling():
            return None
        if found_inf is not None and bool(found_inf.detach().float().sum() != 0):
            return False
        bad = any([c.tolist()[iface.CTL_BAD] != 0 for c in self.ctl.values()])  # (one read each)
        if bad:
            for c in self.ctl.values():
                self.ops.finish(c, found_inf, slot)
            raise ValueError("non-finite gradient (inf or nan): the update was not taken and "
                             "the optimizer state is unchanged (with AMP, pass found_inf to skip)")
        return True

    def found_inf(self, kinds) -> Tensor:
        """The kernels' own non-finite flag, which every accumulation's check sets (a step's
        and a refresh's sums never mix), agreed over the shards' ranks: no pass."""
        self._agree()
        dev = self.view.buckets[0].device
        flag = torch.zeros((), dtype=torch.float32, device=dev)
        for c in self.ctl.values():
            flag = torch.maximum(flag, (c[iface.CTL_BAD] != 0).to(dev, torch.float32))
        return flag

    def _finish(self, slot: int, found_inf: Optional[Tensor]) -> None:
        for dev, c in self.ctl.items():
            fi = None if found_inf is None else found_inf.to(dev, non_blocking=True)
            self.ops.finish(c, fi, slot)

    def _agree(self) -> None:
        """Sharded buckets: a non-finite gradient in any rank's shards skips (or refuses)
        the update on every rank, as it does unsharded: the bad flag is the maximum over
        the shards' process groups (an all-reduce on the device, before the kernels read
        it)."""
        groups = shard_groups(self.view.buckets)
        if groups and not torch.compiler.is_compiling():
            for c in self.ctl.values():
                any_rank(c[iface.CTL_BAD:iface.CTL_BAD + 1], groups)

    def step(self, corr, grad_scale, found_inf) -> Optional[bool]:
        self.check_layout()                   # the step writes the new mean into them
        self._agree()
        self.ahead = None
        nxt = self.ahead_family()   # the kernel writes the next step's inner sample
        made = {}                   # momentum buffers this step makes: (counter, buffer)
        for b in self.view.buckets:
            new, launches = self._step_launches(b, corr, nxt, grad_scale, found_inf)
            if new is not None:
                made[b.index] = new
            for name, args in launches:
                getattr(self.ops, name)(*args)
        self.params_hold_mean = not nxt
        if nxt:
            self.ahead = self._ahead_key()
        taken = self._raise_if_bad(COUNTER_STEPS, found_inf) if self.view.check_finite else None
        self._finish(COUNTER_STEPS, found_inf)
        if taken:
            self.mom_start.clear()      # every momentum buffer has started
        elif taken is None:
            self.mom_start.update(made)
        return taken

    def _step_launches(self, b, corr, nxt: bool, grad_scale, found_inf):
        """Bucket ``b``'s step: the momentum buffer it makes, ``(the steps counter, the
        buffer)`` or None, and its launches ``[(name, args)]`` (its row written here)."""
        view = self.view
        pend = view.pending
        sums = pend.sums
        n_in = pend.count[KIND_INNER]
        group = view.group(b, keep_tensors=True)
        t = self._momentum_first(b, view.rule.kernel_step(b, group, view))
        made = None
        if t.s1 is not None and t.flags.momentum and not isinstance(t.hp.mom_first, Tensor) \
                and t.hp.mom_first != 0.0:
            made = (self._ctl(b)[iface.CTL_STEPS].clone(), t.s1)
        c = b.index in corr
        n_at_out = pend.count[KIND_OUTER] if c else 0
        g_in = self._acc(KIND_INNER, b, "g")
        ge_in = self._acc(KIND_INNER, b, "ge") if (KIND_INNER, b.index, "ge") in sums else None
        noise_in = self.noise_of(KIND_INNER, b, 0) if view.rule.uses_hessian else None
        g_at_out = ge_at_out = noise_at_out = None
        if c:
            g_at_out = self._acc(KIND_OUTER, b, "g")
            if (KIND_OUTER, b.index, "ge") in sums:
                ge_at_out = self._acc(KIND_OUTER, b, "ge")
            noise_at_out = self.noise_of(KIND_OUTER, b, 0) if view.rule.uses_hessian else None
        shared = (noise_in is not None and noise_at_out is not None and noise_in == noise_at_out
                  and ge_in is None and ge_at_out is None)
        flags = t.flags.routed(corr=c, ge_in=ge_in is not None, ge_at_out=ge_at_out is not None,
                               shared_noise=shared, next_sample=nxt)
        hyper = self.rows.row(b, "step", t.hp.counted(
            sign_at_out=noise_at_out[2] if noise_at_out else 1.0, inv_n_in=1.0 / n_in,
            inv_n_at_out=1.0 / n_at_out if n_at_out else 0.0))
        streams = iface.StepStreams(view.seed, noise_in[0] if noise_in else 0,
                                    noise_at_out[0] if noise_at_out else 0, view.noise_version)
        fi, gs = self._amp(b, found_inf, grad_scale)
        outs = [b.buffers.get(k) if c else None for k in ("g_out", "h_out", "m_out", "sigma_out")]
        tiles = self._tiles(b, params=True)
        if tiles is not None:
            return made, [("step_shards", (tiles, b.buffers["mean"], b.local(0), t.s1, t.s2, g_in,
                                           ge_in, g_at_out, ge_at_out, *outs, self._ctl(b), fi,
                                           gs, streams, hyper, flags))]
        out = []
        for lo, n, off, prm in self._pieces(b):
            cut = self._cutter(b, lo, n)
            out.append(("step", (cut(b.buffers["mean"]), prm, cut(t.s1), cut(t.s2), cut(g_in),
                                 cut(ge_in), cut(g_at_out), cut(ge_at_out),
                                 *(cut(o) for o in outs), self._ctl(b), fi, gs, streams, hyper,
                                 flags, off)))
        return made, out

    def refresh(self, grad_scale, found_inf) -> bool:
        self.ahead = None
        self._agree()
        view = self.view
        pend = view.pending
        n = pend.count[KIND_REFRESH]
        for b in view.buckets:
            r = view.rule.kernel_refresh(b, view.group(b, keep_tensors=True), view)
            acc_g = self._acc(KIND_REFRESH, b, "g")
            acc_ge = (self._acc(KIND_REFRESH, b, "ge")
                      if (KIND_REFRESH, b.index, "ge") in pend.sums else None)
            noise = self.noise_of(KIND_REFRESH, b, 0)
            fi, gs = self._amp(b, found_inf, grad_scale)
            hp = self.rows.row(b, "refresh", r.hp.counted(inv_n=1.0 / n))
            flags = iface.RefreshFlags(r.family, acc_ge is not None, noise is not None)
            tiles = self._tiles(b)
            if tiles is not None:
                self.ops.refresh_shards(tiles, b.buffers["mean"], r.h, acc_g, acc_ge, r.g_out,
                                        r.h_out, r.m_out, r.sigma_out, self._ctl(b), fi, gs,
                                        view.seed, view.noise_version,
                                        noise[0] if noise else 0, hp, flags)
                continue
            for lo, m, off, _ in self._pieces(b):
                cut = self._cutter(b, lo, m)
                self.ops.refresh(cut(b.buffers["mean"]), cut(r.h), cut(acc_g), cut(acc_ge),
                                 cut(r.g_out), cut(r.h_out), cut(r.m_out), cut(r.sigma_out),
                                 self._ctl(b), fi, gs, view.seed, view.noise_version,
                                 noise[0] if noise else 0, hp, flags, off)
        if view.check_finite:
            self._raise_if_bad(COUNTER_REFRESHES, found_inf)
        self._finish(COUNTER_REFRESHES, found_inf)
        if view.correction_settled():
            # steady state: the correction is active whether or not the device took this
            # refresh (AMP overflow, non-finite gradients), so that is not read: no
            # synchronisation (refresh_count reads the device)
            return True
        # the first refresh (or the first with a new group): whether the device took it
        # decides whether the correction is active, one read
        return self.counters()[1] > view.refreshes

    def check_buckets(self, buckets) -> None:
        reasons = bucket_reasons(self.name, buckets)
        if reasons:
            raise ValueError(f"backend={self.name!r} cannot run the new group: "
                             + "; ".join(reasons))
