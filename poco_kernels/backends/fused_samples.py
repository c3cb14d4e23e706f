"""The fused engine's samples and gradient sums.

A sample writes its draw into the parameters in one launch per bucket (or shard), from
the mean and the noise counters, and ``restore`` puts the mean back.  ``accumulate``
folds a sample's gradients into the pending sums: the sum of the gradients per (sample
kind, bucket), and the sum of ``gradient * eps`` once a kind has more than one draw; with
one draw a gradient buffer itself becomes the pending sum, lent until the update.  Sums
live in pool buffers allocated at first use and reused (:meth:`SamplesMixin._acc`).
"""
from __future__ import annotations

from typing import FrozenSet, List, Optional, Tuple

import torch
from torch import Tensor

from .. import noise as _noise
from .._layout import is_padded
from .._protocol import KIND_INNER, KIND_REFRESH
from ..kernels import interface as iface


class SamplesMixin:
    """The samples and the gradient sums of
    :class:`~poco_kernels.backends.fused.FusedBackend`: sample, restore, accumulate, and
    the pool buffers the sums live in."""

    # ------------------------------------------------------------------ sampling
    def sync_mean(self) -> None:
        """float32 parameters are the truth for the mean while they hold it."""
        self.check_layout()
        if not self.params_hold_mean:
            return
        for b in self.view.buckets:
            if b.param_dtype == b.dtype:
                self._params_to(b, b.buffers["mean"])

    def at_mean(self) -> None:
        self.check_layout()
        self.active_noise.clear()
        self.ahead = None

    def discard(self) -> None:
        for c in self.ctl.values():
            c[iface.CTL_BAD].zero_()
        self._swap_back()

    @torch.no_grad()
    def sample(self, kind: int, draw: int) -> None:
        self.check_and_hand_out()
        view = self.view
        if self.takes_ahead(kind, draw):      # the step wrote it: nothing moves
            for b in view.buckets:
                self.active_noise[b.index] = self.noise_of(kind, b, draw)
            self.params_hold_mean = False
            return
        self.ahead = None
        for b in view.buckets:
            spec = view.spec(b, kind, draw)
            is_mean = spec.centre is b.buffers["mean"]
            sync = self.params_hold_mean and is_mean and b.param_dtype == b.dtype
            if spec.noise is None:
                self.active_noise[b.index] = None
                if is_mean:
                    if sync:
                        self._params_to(b, b.buffers["mean"])
                    elif not self.params_hold_mean or b.param_dtype != b.dtype:
                        self._params_from(b, spec.centre)
                else:
                    if self.params_hold_mean and b.param_dtype == b.dtype:
                        self._params_to(b, b.buffers["mean"])
                    self._params_from(b, spec.centre)
                continue
            if self.params_hold_mean and not is_mean and b.param_dtype == b.dtype:
                self._params_to(b, b.buffers["mean"])
            noise, launches = self._sample_launches(b, spec, kind, sync)
            self.active_noise[b.index] = noise
            for name, args in launches:
                getattr(self.ops, name)(*args)
        self.params_hold_mean = False

    def _sample_launches(self, b, spec, kind: int, sync: bool):
        """Bucket ``b``'s noisy sample ``spec``: its noise record ``(stream, counter slot,
        sign)`` and its launches ``[(name, args)]`` (one over the flat buffers, one over a
        sharded bucket's shards, or one per shard); its row is written here."""
        view = self.view
        nk, nd, slot, sign = spec.noise
        stream = _noise.stream_id(b.index, nk, nd)
        if spec.h is not None:
            mode, h, sig, const = iface.SIGMA_IVON, spec.h, None, 0.0
        elif isinstance(spec.sigma, Tensor):
            mode, h, sig, const = iface.SIGMA_BUFFER, None, spec.sigma, 0.0
        else:
            mode, h, sig, const = iface.SIGMA_CONST, None, None, spec.sigma
        row = self.rows.row(b, f"sample{kind}", iface.SampleHyper(
            *(iface.hyper_value(v) for v in (spec.ess, spec.wd, const))))
        mean, ctl, sign = b.buffers["mean"], self._ctl(b), float(sign)
        tiles = self._tiles(b, params=True)
        if tiles is not None:
            return (stream, slot, sign), [("sample_shards", (
                tiles, b.local(0), mean if sync else spec.centre, mean, h, sig, ctl, view.seed,
                view.noise_version, stream, slot, row, sign, mode, sync))]
        out = []
        for lo, n, off, prm in self._pieces(b):
            cut = self._cutter(b, lo, n)
            out.append(("sample", (prm, prm if sync else cut(spec.centre), cut(mean), cut(h),
                                   cut(sig), ctl, view.seed, view.noise_version, stream, slot,
                                   row, sign, mode, sync, off)))
        return (stream, slot, sign), out

    @torch.no_grad()
    def restore(self) -> None:
        self._relink(strict=False)            # the mean goes where the parameters are
        for b in self.view.buckets:
            self._params_from(b, b.buffers["mean"])
        self.params_hold_mean = True
        self.ahead = None

    # ------------------------------------------------------------------ accumulation
    def _buffers(self, kind: int, b) -> List[Optional[Tensor]]:
        # (refresh sums and step sums are never pending together, _check_no_mix: the
        # refresh borrows the inner kind's pool buffers)
        key = (KIND_INNER if kind == KIND_REFRESH else kind, b.index)
        if key not in self.pool:
            self.pool[key] = [b.new_buffer(), None]
        return self.pool[key]

    def _acc(self, kind: int, b, name: str) -> Tensor:
        """The buffer of a pending sum, holding the pending value: the sum itself when it
        is a padded flat buffer of ours (a gradient buffer adopted by :meth:`accumulate`,
        a pool buffer), else a pool buffer, allocated at first use and reused, into which
        the sum (the float vector a loaded state dict put there) is copied once."""
        sums = self.view.pending.sums
        cur = sums.get((kind, b.index, name))
        if (cur is not None and cur.dtype == b.dtype and cur.device == b.device
                and cur.is_contiguous() and cur.numel() == b.numel
                and (torch.compiler.is_compiling() or is_padded(cur))):
            return cur
        bufs = self._buffers(kind, b)
        i = 0 if name == "g" else 1
        if bufs[i] is None:
            bufs[i] = b.new_buffer()
        if cur is not None:
            bufs[i].copy_(cur)
            sums[(kind, b.index, name)] = bufs[i]
        return bufs[i]

    def _fold_ge(self, b, acc_g: Tensor, acc_ge: Tensor, stream: int, slot: int,
                 sign: float) -> None:
        """``acc_ge = acc_g * eps`` of the given draw (per shard for a sharded bucket)."""
        tiles = self._tiles(b)
        if tiles is not None:
            self.ops.fold_ge_shards(tiles, acc_g, acc_ge, self._ctl(b), self.view.seed,
                                    self.view.noise_version, stream, slot, sign)
            return
        for lo, n, off, _ in self._pieces(b):
            cut = self._cutter(b, lo, n)
            self.ops.fold_ge(cut(acc_g), cut(acc_ge), self._ctl(b), self.view.seed,
                             self.view.noise_version, stream, slot, sign, off)

    def noise_of(self, kind: int, b, draw: int = 0) -> Optional[Tuple[int, int, float]]:
        """(stream, counter slot, sign) of draw ``draw`` of a kind, or None (no noise)."""
        spec = self.view.spec(b, kind, draw)
        if spec.noise is None:
            return None
        nk, nd, slot, sign = spec.noise
        return _noise.stream_id(b.index, nk, nd), slot, float(sign)

    def _accumulate_direct(self, b, grads, acc_g: Tensor, acc_ge: Optional[Tensor],
                           stream: int, slot: int, sign: float, first: bool) -> None:
        """Accumulate unsharded bucket ``b``'s gradients read in place (``grads``,
        :meth:`~.fused_grads.GradsMixin._direct_grads`) in one launch; a parameter without
        one adds zero (its slice of the first sum is zeroed)."""
        tiles = grads.tiles
        # (a tensor of the gradients' dtype, which the launch takes for their type)
        g0 = b.params[0] if grads.whole else next(g for g in grads if g is not None)
        if tiles.count:
            self.ops.accumulate_shards(tiles, g0, acc_g, acc_ge, self._ctl(b), self.view.seed,
                                       self.view.noise_version, stream, slot, sign, first,
                                       acc_ge is not None)
        if first and not grads.whole:
            torch._foreach_zero_([acc_g[off:off + p.numel()] for p, off, g
                                  in zip(b.params, b.offsets, grads) if g is None])

    @torch.no_grad()
    def accumulate(self, kind: int, draw: int, lend: bool = True) -> FrozenSet[int]:
        view = self.view
        sums = view.pending.sums
        lent = self._lent()
        # gather every bucket first: a refused gradient (sparse) raises before a sum changes
        bufs, in_place, whole = [], [], []
        self._complete = frozenset()
        for b in view.buckets:
            if b.segments is not None:
                bufs.append(self._shard_grads(b))
                continue
            direct = self._direct_grads(b)
            if direct is not None:
                bufs.append(direct)
                if direct.whole:
                    whole.append(b.index)
                continue
            gb, views = self._gather_grads(b, lent)
            bufs.append(gb)
            if views:
                in_place.append(b.index)
        compiling = torch.compiler.is_compiling()
        for b, gb in zip(view.buckets, bufs):
            first = (kind, b.index, "g") not in sums
            noise = self.active_noise.get(b.index)
            want_ge = view.rule.uses_hessian and noise is not None
            ge_live = (kind, b.index, "ge") in sums
            needs_ge = want_ge and (draw >= 1 or ge_live)
            sharded = b.segments is not None
            listed = isinstance(gb, list)      # (one gradient tensor per piece)
            if not listed:
                grad = gb.flat
                gb.clean = None                # it holds a gradient now
            if (first and not needs_ge and b.param_dtype == b.dtype and lend and not compiling
                    and not sharded):
                # the sum of one gradient is the gradient: the buffer itself becomes the
                # pending sum (lent until the update), checked for non-finite values;
                # gradients read in place are copied into a free buffer by that check
                if listed:
                    free = b.grad_bufs[self._free_buffer(b, lent, b.handed)]
                    free.clean = None
                    grad = free.flat
                    self._accumulate_direct(b, gb, grad, None, 0, 0, 1.0, True)
                else:
                    self.ops.check(grad, self._ctl(b))
                sums[(kind, b.index, "g")] = grad
                continue
            acc_g = self._acc(kind, b, "g")
            acc_ge = None
            if needs_ge:
                acc_ge = self._acc(kind, b, "ge")
                if not ge_live:
                    if first:
                        acc_ge.zero_()
                    else:              # sums so far are all of draw 0: materialise g * eps_0
                        self._fold_ge(b, acc_g, acc_ge, *self.noise_of(kind, b, 0))
                    sums[(kind, b.index, "ge")] = acc_ge
            stream, slot, sign = noise if noise is not None else (0, 0, 1.0)
            if listed and not sharded:
                self._accumulate_direct(b, gb, acc_g, acc_ge, stream, slot, sign, first)
            elif not sharded:
                self.ops.accumulate(grad, acc_g, acc_ge, self._ctl(b), view.seed,
                                    view.noise_version, stream, slot, sign, first,
                                    acc_ge is not None)
            else:
                tiles = self._tiles(b, gb)
                if tiles is not None and tiles.count:
                    g0 = next(g for g in gb if g is not None)
                    self.ops.accumulate_shards(tiles, g0, acc_g, acc_ge, self._ctl(b), view.seed,
                                               view.noise_version, stream, slot, sign, first,
                                               acc_ge is not None)
                for (lo, n, off, _), g in zip(self._pieces(b), gb):
                    cut = self._cutter(b, lo, n)
                    if tiles is not None:
                        if g is None and first:    # no gradient: a zero one
                            acc_g[lo:lo + n].zero_()
                        continue
                    if g is not None:
                        self.ops.accumulate(g, cut(acc_g), cut(acc_ge), self._ctl(b), view.seed,
                                            view.noise_version, stream, slot, sign, first,
                                            acc_ge is not None, off)
                    elif first:                # no gradient: a zero one
                        acc_g[lo:lo + n].zero_()
            sums[(kind, b.index, "g")] = acc_g
        self._complete = frozenset(whole)
        return frozenset(in_place)

    def complete(self) -> FrozenSet[int]:
        return self._complete
