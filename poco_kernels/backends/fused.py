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
  storage of the local shards (it all-gathers from it), so they are not re-pointed: each
  operation runs one launch per local shard, over that shard itself and its slice of the
  bucket's flat state, with the shard's place in the unsharded bucket as the noise offset
  (so every element draws the noise it draws unsharded).  Gradients are FSDP2's
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

import weakref
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .. import noise as _noise
from .._layout import alloc_flat, any_rank, is_padded, local, shard_groups
from .._protocol import (COUNTER_REFRESHES, COUNTER_STEPS, KIND_INNER, KIND_OUTER,
                         KIND_REFRESH)
from ..kernels import cpp_status, triton_status
from ..kernels import interface as K
from .base import Backend
from .hyper import HyperRows


def _capturing() -> bool:
    """A CUDA graph is being captured on the current stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


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


def _refuse_sparse(g: Tensor) -> None:
    """A sparse gradient is refused (before any sum changes)."""
    if g.is_sparse:
        raise RuntimeError("poco_kernels optimizers do not support sparse gradients "
                           "(e.g. nn.Embedding(sparse=True)): nothing was accumulated")


class GradBuffer:
    """A flat gradient buffer of a bucket (the parameter dtype) and, per parameter, a
    tensor over its part of the storage that is handed to the parameter as its ``.grad``.

    Those tensors alias the buffer without being autograd views of it, so each keeps its
    own version counter: every in-place write to one (autograd accumulating a gradient
    into ``.grad``, ``zero_()``, a copy) moves that parameter's counter only.  ``clean``:
    the counters at which the buffer was last known to hold zeros (None: not known), so
    the engine knows without reading the buffer whether it is still zero and which
    parameters received a gradient since."""

    __slots__ = ("flat", "views", "clean")

    def __init__(self, b):
        self.flat = alloc_flat(b.numel, b.device, b.param_dtype)     # (zero padding)
        st = self.flat.untyped_storage()
        self.views = [torch.empty(0, device=b.device, dtype=b.param_dtype).set_(
                          st, off, p.shape)            # (contiguous strides)
                      for p, off in zip(b.params, b.offsets)]
        self.clean = self._versions()

    def _versions(self) -> List[int]:
        return [v._version for v in self.views]

    def is_clean(self) -> bool:
        return self.clean is not None and self.clean == self._versions()

    def zero(self) -> None:
        """Make it hold zeros (one memset, skipped when it is known to)."""
        if not self.is_clean():
            self.flat.zero_()
            self.clean = self._versions()


class FusedBackend(Backend):
    """Owns the flat parameter/gradient buffers, the gradient sums and the control
    tensors of one optimizer.  ``ops``: the kernels' wrapper module (``triton_ops`` or
    ``cpp_ops``)."""

    lazy_restore = True

    def __init__(self, opt, name: str, ops):
        super().__init__(opt)
        self.name = name
        self.ops = ops
        self.check_finite_default = name != "triton"   # a host read per update on a GPU
        self.ctl: Dict[torch.device, Tensor] = {}
        self.pool: Dict[Tuple[int, int], List[Optional[Tensor]]] = {}
        self.active_noise: Dict[int, Optional[Tuple[int, int, float]]] = {}
        #: the hyperparameter rows the kernels read (per bucket and record)
        self.rows = HyperRows()
        #: ids of the parameters autograd accumulated a gradient into since the last
        #: hand-out (a post-accumulate-grad hook on each parameter given a view)
        self.reached: set = set()
        #: per bucket index, a momentum buffer (SGD family) made by a step that only the
        #: device knows whether it took (no ``check_finite``): (the steps-taken counter
        #: before that step, on the device; the buffer).  Until a step is taken the buffer
        #: has not started (:meth:`_momentum_first`); :meth:`counters` settles it
        self.mom_start: Dict[int, Tuple[Tensor, Tensor]] = {}
        self._watched: set = set()
        self.flatten()

    # ------------------------------------------------------------------ layout
    def flatten(self) -> None:
        """Make every bucket's parameters views of one flat buffer (and give it a flat
        gradient buffer).  Idempotent: buckets already flat keep their storage."""
        for b in self.opt._buckets:
            flat = getattr(b, "flat_param", None)
            if b.segments is not None:        # FSDP2 owns the shards: launched per shard
                b.flat_param, b.grad_bufs, b.handed = None, [], None
                b.grad_flat, b.grad_views = None, None
                self._check_shards(b)
            elif flat is None or not self._is_flat(b):
                flat = alloc_flat(b.numel, b.device, b.param_dtype)
                with torch.no_grad():
                    for p, off in zip(b.params, b.offsets):
                        flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
                    for p, off in zip(b.params, b.offsets):
                        p.data = flat[off:off + p.numel()].view_as(p)
                b.flat_param = flat
                b.grad_bufs = [GradBuffer(b)]
                b.handed = None
                b.grad_flat, b.grad_views = b.grad_bufs[0].flat, b.grad_bufs[0].views
            if b.device not in self.ctl:      # a new device starts from the counters
                src = next(iter(self.ctl.values()), None)
                self.ctl[b.device] = (src.to(b.device, copy=True) if src is not None else
                                      self._counters_tensor(self.opt._step,
                                                            self.opt._refreshes, 0, b.device))

    @staticmethod
    def _counters_tensor(steps: int, refreshes: int, skipped: int, device) -> Tensor:
        c = torch.zeros(K.CTL_SIZE, dtype=torch.int64)
        c[K.CTL_STEPS], c[K.CTL_REFRESHES], c[K.CTL_SKIPPED] = steps, refreshes, skipped
        return c.to(device)

    # ------------------------------------------------------------------ sharded buckets
    @staticmethod
    def _pieces(b):
        """The launches of an operation on bucket ``b``: ``(lo, n, offset, param)`` per
        launch, the elements ``lo .. lo + n - 1`` of the bucket's flat buffers, the noise
        (and rounding) offset of element ``lo``, and the parameter tensor written.  One
        launch over the flat parameter buffer at offset 0, or per non-empty local shard of
        a sharded bucket its slice, its place in the unsharded bucket and the shard itself
        (FSDP2's storage, flattened: a view)."""
        if b.segments is None:
            return ((0, b.numel, 0, b.flat_param),)
        return tuple((lo, n, start, b.local(i).view(-1))
                     for i, (lo, n, start) in enumerate(b.segments) if n > 0)

    @staticmethod
    def _cutter(b, lo: int, n: int):
        """The slice ``lo .. lo + n - 1`` of a flat buffer of ``b`` (None stays None; an
        unsharded bucket's one launch takes the buffers themselves: their padding counts)."""
        if b.segments is None:
            return lambda t: t
        return lambda t: None if t is None else t[lo:lo + n]

    def _params_to(self, b, dst: Tensor) -> None:
        """``dst`` (a flat buffer of ``b``) takes the parameters' values."""
        if b.segments is None:
            dst.copy_(b.flat_param)
            return
        pieces = self._pieces(b)
        if pieces:
            torch._foreach_copy_([dst[lo:lo + n] for lo, n, _, _ in pieces],
                                 [prm for _, _, _, prm in pieces])

    def _params_from(self, b, src: Tensor) -> None:
        """The parameters take the values of ``src`` (a flat buffer of ``b``)."""
        if b.segments is None:
            b.flat_param.copy_(src)
            return
        pieces = self._pieces(b)
        if pieces:
            torch._foreach_copy_([prm for _, _, _, prm in pieces],
                                 [src[lo:lo + n] for lo, n, _, _ in pieces])

    def _check_shards(self, b) -> None:
        """The local shards of a sharded bucket are still contiguous tensors of the
        bucket's dtype, device and sizes (FSDP2 may replace their storage, e.g. when a
        state dict is loaded into the model: the launches follow it)."""
        for i, (lo, n, _) in enumerate(b.segments):
            loc = b.local(i)
            if (loc.numel() != n or loc.dtype != b.param_dtype or loc.device != b.device
                    or not loc.is_contiguous()):
                group = self.opt.param_groups[b.group_index]["params"]
                j = next(j for j, q in enumerate(group) if q is b.params[i])
                raise RuntimeError(
                    f"parameter {j} of param group {b.group_index}: its local shard changed "
                    f"since the optimizer was built (now {tuple(loc.shape)} {loc.dtype} on "
                    f"{loc.device}, contiguous={loc.is_contiguous()}; expected {n} elements "
                    f"of {b.param_dtype} on {b.device}): build the optimizer after sharding, "
                    "moving or converting the model (a state dict carries its state over)")

    @staticmethod
    def _is_flat(b) -> bool:
        """The bucket's parameters are (still) the views of its flat buffer made by
        :meth:`flatten` or a re-link: their addresses are those of the views (one list
        comparison; a parameter re-pointed elsewhere has another address)."""
        ptrs = getattr(b, "flat_ptrs", None)
        if ptrs is None or ptrs[0] != b.flat_param.data_ptr():
            base, size = b.flat_param.data_ptr(), b.flat_param.element_size()
            b.flat_ptrs = ptrs = [base + off * size for off in b.offsets]
        return [p.data_ptr() for p in b.params] == ptrs

    def check_layout(self) -> None:
        """Re-link parameters taken off the flat buffers (by another optimizer built over
        them, a deepcopy, or ``p.data = t``) that kept their shape, dtype and device:
        their current values are copied in and ``p.data`` is re-pointed (the parameters
        are the truth, as in ``torch.optim``).  A changed shape, dtype or device raises,
        with nothing changed."""
        self._relink(strict=True)

    def _relink(self, strict: bool) -> None:
        """:meth:`check_layout`; ``strict=False`` leaves a bucket that cannot be re-linked
        as it is instead of raising (restore: the error is the next sample's or step's)."""
        if torch.compiler.is_compiling():     # storage pointers are not traceable
            return
        loose = []
        for b in self.opt._buckets:           # all checked before any is re-linked
            if b.segments is not None:
                if strict:
                    self._check_shards(b)
                continue
            if self._is_flat(b):
                continue
            why = self._changed(b)
            if why is None:
                loose.append(b)
            elif strict:
                raise RuntimeError(
                    f"{why} since the optimizer was built (e.g. by model.to(...) or "
                    f"`p.data = ...`): with backend={self.name!r} the parameters are views "
                    "of the optimizer's flat buffers of their dtype and device; build the "
                    "optimizer after moving or converting the model (a state dict carries "
                    "the optimizer's state over)")
        with torch.no_grad():
            for b in loose:
                base = b.flat_param.data_ptr()
                size = b.flat_param.element_size()
                for p, off, view in zip(b.params, b.offsets, b.grad_views):
                    if p.data_ptr() == base + off * size and p.is_contiguous():
                        continue
                    flat = b.flat_param[off:off + p.numel()]
                    new = p.detach().reshape(-1)
                    if not self.params_hold_mean and not torch.equal(flat, new):
                        # the parameters hold a sample and this one was given another
                        # value: that value is its mean now (the parameters are the truth)
                        b.buffers["mean"][off:off + p.numel()].copy_(new)
                        self.ahead = None
                    flat.copy_(new)
                    p.data = flat.view_as(view)
                if b.param_dtype != b.dtype and self.params_hold_mean:
                    # low precision: the float32 master copy keeps what the parameters
                    # still round to, and takes the values changed elsewhere
                    mean = b.buffers["mean"]
                    moved = mean.to(b.param_dtype) != b.flat_param
                    mean.copy_(torch.where(moved, b.flat_param.to(mean.dtype), mean))

    def _changed(self, b) -> Optional[str]:
        """What keeps a bucket's parameters from being re-linked (None: nothing)."""
        for p, view in zip(b.params, b.grad_views):
            for what, now, was in (("dtype", p.dtype, b.param_dtype),
                                   ("device", p.device, b.device),
                                   ("shape", tuple(p.shape), tuple(view.shape))):
                if now != was:
                    group = self.opt.param_groups[b.group_index]["params"]
                    i = next(i for i, q in enumerate(group) if q is p)
                    return (f"parameter {i} of param group {b.group_index}: its storage was "
                            f"replaced by one of another {what} ({was} -> {now})")
        return None

    def set_counters(self, steps: int, refreshes: int) -> None:
        """Set the steps and refreshes taken (a state dict was loaded); the count of
        skipped updates is kept."""
        for dev, c in self.ctl.items():
            c.copy_(self._counters_tensor(steps, refreshes, int(c[K.CTL_SKIPPED]), dev))

    def counters(self) -> Tuple[int, int, int]:
        """(steps taken, refreshes taken, updates skipped) -- reads the device.  A
        momentum buffer made by a step the device skipped is dropped here, as the host
        drops it after a step it knows was skipped (:meth:`_settle_momentum`)."""
        if not self.ctl:
            return self.opt._step, self.opt._refreshes, 0
        c = next(iter(self.ctl.values())).tolist()
        self._settle_momentum(int(c[K.CTL_STEPS]))
        return int(c[K.CTL_STEPS]), int(c[K.CTL_REFRESHES]), int(c[K.CTL_SKIPPED])

    def _settle_momentum(self, steps: int) -> None:
        """The counters were read (``steps`` taken): a momentum buffer of
        :attr:`mom_start` made by a step that was skipped (no step taken since) is
        dropped, so the next step makes it anew, as the first; one that a step has used
        since is started."""
        for bi, (start, buf) in list(self.mom_start.items()):
            del self.mom_start[bi]
            if steps != int(start):
                continue
            b = self.opt._buckets[bi]
            for name in [n for n, v in b.buffers.items() if v is buf]:
                del b.buffers[name]
                self.opt._expose(b)

    def _momentum_first(self, b, t):
        """The step record ``t`` of bucket ``b``, with SGD's ``mom_first`` read on the
        device while only the device knows whether the step that made the momentum
        buffer was taken: 1 until a step is taken (the steps-taken counter unchanged),
        then 0, as ``torch.optim.SGD`` starts its buffer at the first step it takes."""
        entry = self.mom_start.get(b.index)
        if entry is None or t.s1 is not entry[1] or isinstance(t.hp.mom_first, Tensor) \
                or t.hp.mom_first != 0.0:
            return t
        first = (self._ctl(b)[K.CTL_STEPS] == entry[0]).to(torch.float64)
        return t._replace(hp=t.hp._replace(mom_first=first))

    def _ctl(self, b) -> Tensor:
        return self.ctl[b.device]

    # ------------------------------------------------------------------ sampling
    def sync_mean(self) -> None:
        """float32 parameters are the truth for the mean while they hold it."""
        self.check_layout()
        if not self.params_hold_mean:
            return
        for b in self.opt._buckets:
            if b.param_dtype == b.dtype:
                self._params_to(b, b.buffers["mean"])

    def at_mean(self) -> None:
        self.check_layout()
        self.active_noise.clear()
        self.ahead = None

    def discard(self) -> None:
        for c in self.ctl.values():
            c[K.CTL_BAD].zero_()

    @torch.no_grad()
    def sample(self, kind: int, draw: int) -> None:
        self.check_layout()
        self.hand_out()
        opt = self.opt
        if self.takes_ahead(kind, draw):      # the step wrote it: nothing moves
            for b in opt._buckets:
                self.active_noise[b.index] = self.noise_of(kind, b, draw)
            self.params_hold_mean = False
            return
        self.ahead = None
        for b in opt._buckets:
            spec = opt._spec(b, kind, draw)
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
            nk, nd, slot, sign = spec.noise
            stream = _noise.stream_id(b.index, nk, nd)
            self.active_noise[b.index] = (stream, slot, float(sign))
            if spec.h is not None:
                mode, h, sig, const = K.SIGMA_IVON, spec.h, None, 0.0
            elif isinstance(spec.sigma, Tensor):
                mode, h, sig, const = K.SIGMA_BUFFER, None, spec.sigma, 0.0
            else:
                mode, h, sig, const = K.SIGMA_CONST, None, None, spec.sigma
            row = self.rows.row(b, f"sample{kind}", K.SampleHyper(
                *(K.hyper_value(v) for v in (spec.ess, spec.wd, const))))
            for lo, n, off, prm in self._pieces(b):
                cut = self._cutter(b, lo, n)
                self.ops.sample(prm, prm if sync else cut(spec.centre), cut(b.buffers["mean"]),
                                cut(h), cut(sig), self._ctl(b), opt.seed, opt.noise_version,
                                stream, slot, row, float(sign), mode, sync, off)
        self.params_hold_mean = False

    @torch.no_grad()
    def restore(self) -> None:
        self._relink(strict=False)            # the mean goes where the parameters are
        for b in self.opt._buckets:
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
        sums = self.opt._pending.sums
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

    # ------------------------------------------------------------------ gradient buffers
    def _lent(self) -> set:
        """ids of the tensors the pending sums are (a gradient buffer adopted as a sum is
        lent until the update that consumes it)."""
        return {id(t) for t in self.opt._pending.sums.values()}

    def _free_buffer(self, b, lent: set, prefer: Optional[int] = None) -> int:
        """The index of a gradient buffer of ``b`` not lent to a pending sum (``prefer``
        if it is free); a new one when all are lent."""
        if prefer is not None and id(b.grad_bufs[prefer].flat) not in lent:
            return prefer
        for i, gb in enumerate(b.grad_bufs):
            if id(gb.flat) not in lent:
                return i
        b.grad_bufs.append(GradBuffer(b))
        return len(b.grad_bufs) - 1

    def hand_out(self, cleared_only: bool = False) -> None:
        """Give every trainable parameter a ``.grad`` that is a view of a zeroed, free
        flat gradient buffer of its bucket, so that the coming backward pass accumulates
        straight into the buffer the kernels read (before a sample's backward, and after
        an update for the buckets whose ``.grad`` were cleared by ``accumulate``:
        ``cleared_only``)."""
        if not self.opt.grad_views or torch.compiler.is_compiling():
            return
        lent = self._lent()
        for b in self.opt._buckets:
            if b.segments is not None:        # FSDP2 hands out the sharded gradients
                continue
            if cleared_only and any(p.grad is not None for p in b.params):
                continue
            i = self._free_buffer(b, lent, b.handed)
            gb = b.grad_bufs[i]
            gb.zero()
            for p, v in zip(b.params, gb.views):
                if p.grad is not v:
                    p.grad = v
                self.reached.discard(id(p))
                if id(p) not in self._watched:
                    self._watch(p)
            b.handed = i

    def _watch(self, p) -> None:
        """Note in :attr:`reached` every gradient autograd accumulates into ``p``."""
        ref = weakref.ref(self)

        def hook(param, ref=ref):
            eng = ref()
            if eng is not None:
                eng.reached.add(id(param))
        p.register_post_accumulate_grad_hook(hook)
        self._watched.add(id(p))

    def zero_grads(self) -> set:
        """``zero_grad()`` for the parameters whose ``.grad`` is a view handed out by
        :meth:`hand_out`: zero the buffer in place (nothing to do when it is known to be
        zero), keeping the views.  Returns the ids of the parameters handled."""
        done = set()
        if torch.compiler.is_compiling():
            return done
        lent = self._lent()
        for b in self.opt._buckets:
            if b.handed is None:
                continue
            gb = b.grad_bufs[b.handed]
            if id(gb.flat) in lent:
                continue
            ours = [p.grad is v for p, v in zip(b.params, gb.views)]
            if any(ours):
                gb.zero()
                done.update(id(p) for p, o in zip(b.params, ours) if o)
        return done

    def unwritten(self) -> set:
        """``(bucket, index)`` of the parameters whose ``.grad`` is a view handed out by
        :meth:`hand_out` that received no gradient: autograd accumulated nothing into it
        since (:attr:`reached`) and it still holds zeros (a gradient written another way,
        e.g. a collective into ``p.grad.data``, counts; clipping a zero one does not).
        They are skipped, as a ``.grad`` of None is with ``torch.optim``.  Reads the
        data of those parameters only (usually none), in one device read; none while a
        CUDA graph is captured (a read would break the capture, and a replay could not
        repeat it): there every handed-out gradient counts as written."""
        out = set()
        if torch.compiler.is_compiling() or _capturing():
            return out
        cand = []
        for b in self.opt._buckets:
            if b.handed is None:
                continue
            gb = b.grad_bufs[b.handed]
            for i, (p, v) in enumerate(zip(b.params, gb.views)):
                if p.grad is v and id(p) not in self.reached:
                    cand.append(((b.index, i), v))
        if cand:
            nonzero = torch.stack([v.ne(0).any() for _, v in cand]).tolist()
            out = {key for (key, _), nz in zip(cand, nonzero) if not nz}
        return out

    def _gather_grads(self, b, lent: set) -> GradBuffer:
        """The bucket's gradients in one free flat buffer of the parameter dtype: free
        when the ``.grad`` are the views handed out, one foreach copy for those that are
        not (replaced, or made by autograd after ``zero_grad(set_to_none=True)``), zeros
        for those that are None."""
        compiling = torch.compiler.is_compiling()
        i = self._free_buffer(b, lent, b.handed)
        gb = b.grad_bufs[i]
        srcs, dsts, zero = [], [], []
        for p, view in zip(b.params, gb.views):
            g = p.grad
            if g is None:
                zero.append(view)
                continue
            _refuse_sparse(g)
            if compiling or g is not view:
                srcs.append(g.detach())
                dsts.append(view)
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        if zero:
            torch._foreach_zero_(zero)
        return gb

    def _shard_grads(self, b) -> List[Optional[Tensor]]:
        """The local gradients of a sharded bucket, one per launch of :meth:`_pieces`
        (FSDP2's reduce-scattered shards, read in place; None: no gradient, a zero one)."""
        out = []
        for i, (lo, n, _) in enumerate(b.segments):
            if n == 0:
                continue
            g = b.params[i].grad
            if g is None:
                out.append(None)
                continue
            _refuse_sparse(g)
            g = local(g.detach())
            if g.numel() != n:
                raise RuntimeError(f"a sharded gradient has {g.numel()} elements where its "
                                   f"parameter's local shard has {n}: nothing was accumulated")
            if g.dtype not in (torch.float32, torch.bfloat16, torch.float16) \
                    or g.device != b.device:
                g = g.to(device=b.device, dtype=b.param_dtype)
            out.append(g.reshape(-1).contiguous())
        return out

    def _fold_ge(self, b, acc_g: Tensor, acc_ge: Tensor, stream: int, slot: int,
                 sign: float) -> None:
        """``acc_ge = acc_g * eps`` of the given draw (per shard for a sharded bucket)."""
        for lo, n, off, _ in self._pieces(b):
            cut = self._cutter(b, lo, n)
            self.ops.fold_ge(cut(acc_g), cut(acc_ge), self._ctl(b), self.opt.seed,
                             self.opt.noise_version, stream, slot, sign, off)

    def noise_of(self, kind: int, b, draw: int = 0) -> Optional[Tuple[int, int, float]]:
        """(stream, counter slot, sign) of draw ``draw`` of a kind, or None (no noise)."""
        spec = self.opt._spec(b, kind, draw)
        if spec.noise is None:
            return None
        nk, nd, slot, sign = spec.noise
        return _noise.stream_id(b.index, nk, nd), slot, float(sign)

    @torch.no_grad()
    def accumulate(self, kind: int, draw: int, lend: bool = True) -> None:
        opt = self.opt
        sums = opt._pending.sums
        lent = self._lent()
        # gather every bucket first: a refused gradient (sparse) raises before a sum changes
        bufs = [self._shard_grads(b) if b.segments is not None else self._gather_grads(b, lent)
                for b in opt._buckets]
        compiling = torch.compiler.is_compiling()
        for b, gb in zip(opt._buckets, bufs):
            first = (kind, b.index, "g") not in sums
            noise = self.active_noise.get(b.index)
            want_ge = opt.uses_hessian and noise is not None
            ge_live = (kind, b.index, "ge") in sums
            needs_ge = want_ge and (draw >= 1 or ge_live)
            sharded = b.segments is not None
            if not sharded:
                grad = gb.flat
                gb.clean = None                # it holds a gradient now
            if (first and not needs_ge and b.param_dtype == b.dtype and lend and not compiling
                    and not sharded):
                # the sum of one gradient is the gradient: the buffer itself becomes the
                # pending sum (lent until the update), checked for non-finite values
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
            if not sharded:
                self.ops.accumulate(grad, acc_g, acc_ge, self._ctl(b), opt.seed,
                                    opt.noise_version, stream, slot, sign, first,
                                    acc_ge is not None)
            else:
                for (lo, n, off, _), g in zip(self._pieces(b), gb):
                    cut = self._cutter(b, lo, n)
                    if g is not None:
                        self.ops.accumulate(g, cut(acc_g), cut(acc_ge), self._ctl(b), opt.seed,
                                            opt.noise_version, stream, slot, sign, first,
                                            acc_ge is not None, off)
                    elif first:                # no gradient: a zero one
                        acc_g[lo:lo + n].zero_()
            sums[(kind, b.index, "g")] = acc_g

    @torch.no_grad()
    def prepare_state_dict(self) -> None:
        """Give every pending noisy sum its ``g * eps`` sum (for the state dict, which
        has the torch backend's layout)."""
        opt = self.opt
        if not opt.uses_hessian:
            return
        for kind, count in opt._pending.count.items():
            if count == 0:
                continue
            for b in opt._buckets:
                if (kind, b.index, "ge") in opt._pending.sums:
                    continue
                noise = self.noise_of(kind, b, 0)
                if noise is None:
                    continue
                acc_g = self._acc(kind, b, "g")
                acc_ge = self._acc(kind, b, "ge")
                self._fold_ge(b, acc_g, acc_ge, *noise)
                opt._pending.sums[(kind, b.index, "ge")] = acc_ge

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
        bad = any(c[K.CTL_BAD].item() != 0 for c in self.ctl.values())  # no allocation
        if bad:
            for c in self.ctl.values():
                self.ops.finish(c, found_inf, slot)
            raise ValueError("non-finite gradient (inf or nan): the update was not taken and "
                             "the optimizer state is unchanged (with AMP, pass found_inf to skip)")
        return True

    def _finish(self, slot: int, found_inf: Optional[Tensor]) -> None:
        for dev, c in self.ctl.items():
            fi = None if found_inf is None else found_inf.to(dev, non_blocking=True)
            self.ops.finish(c, fi, slot)

    def _agree(self) -> None:
        """Sharded buckets: a non-finite gradient in any rank's shards skips (or refuses)
        the update on every rank, as it does unsharded: the bad flag is the maximum over
        the shards' process groups (an all-reduce on the device, before the kernels read
        it)."""
        groups = shard_groups(self.opt._buckets)
        if groups and not torch.compiler.is_compiling():
            for c in self.ctl.values():
                any_rank(c[K.CTL_BAD:K.CTL_BAD + 1], groups)

    def step(self, corr, grad_scale, found_inf) -> Optional[bool]:
        self.check_layout()                   # the step writes the new mean into them
        self._agree()
        opt = self.opt
        pend = opt._pending
        sums = pend.sums
        n_in = pend.count[KIND_INNER]
        self.ahead = None
        nxt = self.ahead_family()   # the kernel writes the next step's inner sample
        made = {}                   # momentum buffers this step makes: (counter, buffer)
        for b in opt._buckets:
            t = self._momentum_first(b, opt._kernel_step(b, opt._group(b, keep_tensors=True)))
            if t.s1 is not None and t.path.momentum and not isinstance(t.hp.mom_first, Tensor) \
                    and t.hp.mom_first != 0.0:
                made[b.index] = (self._ctl(b)[K.CTL_STEPS].clone(), t.s1)
            c = b.index in corr
            n_o = pend.count[KIND_OUTER] if c else 0
            g_in = self._acc(KIND_INNER, b, "g")
            ge_in = self._acc(KIND_INNER, b, "ge") if (KIND_INNER, b.index, "ge") in sums else None
            noise_in = self.noise_of(KIND_INNER, b, 0) if opt.uses_hessian else None
            g_o = ge_o = noise_o = None
            if c:
                g_o = self._acc(KIND_OUTER, b, "g")
                if (KIND_OUTER, b.index, "ge") in sums:
                    ge_o = self._acc(KIND_OUTER, b, "ge")
                noise_o = self.noise_of(KIND_OUTER, b, 0) if opt.uses_hessian else None
            shared = (noise_in is not None and noise_o is not None and noise_in == noise_o
                      and ge_in is None and ge_o is None)
            flags = K.StepFlags.of(t.family, t.path, corr=c, ge_in=ge_in is not None,
                                   ge_o=ge_o is not None, shared_noise=shared,
                                   next_sample=nxt)
            hyper = self.rows.row(b, "step", K.StepHyper.of(
                t.hp, sign_o=noise_o[2] if noise_o else 1.0, inv_n_in=1.0 / n_in,
                inv_n_o=1.0 / n_o if n_o else 0.0))
            streams = K.StepStreams(opt.seed, noise_in[0] if noise_in else 0,
                                    noise_o[0] if noise_o else 0, opt.noise_version)
            fi, gs = self._amp(b, found_inf, grad_scale)
            outs = [b.buffers.get(k) if c else None for k in ("g_out", "h_out", "m_out",
                                                               "sigma_out")]
            for lo, n, off, prm in self._pieces(b):
                cut = self._cutter(b, lo, n)
                self.ops.step(cut(b.buffers["mean"]), prm, cut(t.s1), cut(t.s2), cut(g_in),
                              cut(ge_in), cut(g_o), cut(ge_o), *(cut(o) for o in outs),
                              self._ctl(b), fi, gs, streams, hyper, flags, off)
        self.params_hold_mean = not nxt
        if nxt:
            self.ahead = self._ahead_key()
        taken = self._raise_if_bad(COUNTER_STEPS, found_inf) if opt.check_finite else None
        self._finish(COUNTER_STEPS, found_inf)
        if taken:
            self.mom_start.clear()      # every momentum buffer has started
        elif taken is None:
            self.mom_start.update(made)
        return taken

    def after_update(self) -> None:
        """The pending sums of an update are gone (consumed or dropped): the gradient
        buffers lent to them are free, and parameters whose ``.grad`` ``accumulate``
        cleared get views of a zeroed one again."""
        self.hand_out(cleared_only=True)

    def refresh(self, grad_scale, found_inf) -> bool:
        self.ahead = None
        self._agree()
        opt = self.opt
        pend = opt._pending
        n = pend.count[KIND_REFRESH]
        for b in opt._buckets:
            r = opt._kernel_refresh(b, opt._group(b, keep_tensors=True))
            acc_g = self._acc(KIND_REFRESH, b, "g")
            acc_ge = (self._acc(KIND_REFRESH, b, "ge")
                      if (KIND_REFRESH, b.index, "ge") in pend.sums else None)
            noise = self.noise_of(KIND_REFRESH, b, 0)
            fi, gs = self._amp(b, found_inf, grad_scale)
            hp = self.rows.row(b, "refresh", K.RefreshHyper.of(r.hp, inv_n=1.0 / n))
            flags = K.RefreshFlags(r.family, acc_ge is not None, noise is not None)
            for lo, m, off, _ in self._pieces(b):
                cut = self._cutter(b, lo, m)
                self.ops.refresh(cut(b.buffers["mean"]), cut(r.h), cut(acc_g), cut(acc_ge),
                                 cut(r.g_out), cut(r.h_out), cut(r.m_out), cut(r.sigma_out),
                                 self._ctl(b), fi, gs, opt.seed, opt.noise_version,
                                 noise[0] if noise else 0, hp, flags, off)
        if opt.check_finite:
            self._raise_if_bad(COUNTER_REFRESHES, found_inf)
        self._finish(COUNTER_REFRESHES, found_inf)
        if opt._correction_settled():
            # steady state: the correction is active whether or not the device took this
            # refresh (AMP overflow, non-finite gradients), so that is not read: no
            # synchronisation (refresh_count reads the device)
            return True
        # the first refresh (or the first with a new group): whether the device took it
        # decides whether the correction is active, one read
        return self.counters()[1] > opt._refreshes

    def check_buckets(self, buckets) -> None:
        reasons = bucket_reasons(self.name, buckets)
        if reasons:
            raise ValueError(f"backend={self.name!r} cannot run the new group: "
                             + "; ".join(reasons))

    # ------------------------------------------------------------------ bookkeeping
    def loaded(self) -> None:
        self.params_hold_mean = True
        self.ahead = None
        self.mom_start.clear()          # (the state dict says which buffers exist)
        self.set_counters(self.opt._step, self.opt._refreshes)

    def relayout(self) -> None:
        self.ahead = None
        self.rows.clear()
        self.pool.clear()
        self.active_noise.clear()
        self.flatten()

    def set_skipped(self, skipped: int) -> None:
        for c in self.ctl.values():
            c[K.CTL_SKIPPED].fill_(skipped)

    def rebuilt(self, old_buckets) -> None:
        self.ahead = None
        for b_new, b_old in zip(self.opt._buckets, old_buckets):
            for attr in ("flat_param", "grad_flat", "grad_views", "grad_bufs", "handed"):
                if hasattr(b_old, attr):
                    setattr(b_new, attr, getattr(b_old, attr))
        self.flatten()
