"""Machinery shared by every optimizer of the family.

* **Flat buckets.**  The parameters of each parameter group are split by (device, dtype)
  into buckets; every piece of optimizer state is one flat float32 (float64 for float64
  parameters) buffer per bucket, and ``optimizer.state[p]`` holds views into those
  buffers, so ``torch.optim`` tooling sees the usual per-parameter state while kernels
  see one contiguous buffer per bucket.
* **Posterior samples.**  ``sample(kind)`` writes ``theta = centre + sigma * eps`` into the
  parameters, ``accumulate()`` folds ``.grad`` into the running estimate of that sample
  (sum of gradients and, for Hessian estimates, of ``gradient * eps``), ``restore()`` puts
  the posterior mean back.  ``eps`` comes from the counter-based stream of
  :mod:`poco_kernels.noise`, keyed by ``(seed, counter, bucket, kind, draw, element)``:
  nothing about noise is stored, and ranks that share the seed draw the same sample.
* **Sharded parameters** (FSDP2's ``DTensor``, sharded on dim 0): a bucket holds the
  local shards; each shard's noise is drawn at its elements' positions in the unsharded
  bucket (``Bucket.segments``), so a sharded run draws exactly the unsharded sample.
  The maths is elementwise, so nothing else needs communication.  Reference backend only.
* **Transactions.**  A step or a refresh computes every new buffer out of place, checks it,
  and only then commits, so bad input raises and leaves the optimizer as it was.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import noise as _noise
from .reference import perturb

KIND_INNER, KIND_OUTER, KIND_REFRESH = 0, 1, 2
KIND_NAMES = {"inner": KIND_INNER, "outer": KIND_OUTER, "refresh": KIND_REFRESH}
BACKENDS = ("auto", "torch", "triton", "cpp")

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _state_dtype(param_dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if param_dtype == torch.float64 else torch.float32


try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:                     # pragma: no cover - torch without distributed
    _DTensor = ()


def is_sharded(t) -> bool:
    """True for a ``torch.distributed`` ``DTensor`` (FSDP2's sharded parameters)."""
    return isinstance(t, _DTensor)


def _local(t: Tensor) -> Tensor:
    """The local shard of a ``DTensor`` (an alias: in-place writes reach the parameter),
    else the tensor itself."""
    return t.to_local() if is_sharded(t) else t


def _shard_start(p: Tensor) -> int:
    """Index, in ``p``'s unsharded flattening, of the first element of its local shard.
    Supported: a 1-D mesh with ``Shard(0)`` (FSDP2's default, ``torch.chunk`` rows) or
    ``Replicate()``."""
    from torch.distributed.tensor import Replicate, Shard
    mesh, pl = p.device_mesh, tuple(p.placements)
    if mesh.ndim != 1 or len(pl) != 1 or not isinstance(pl[0], (Shard, Replicate)) \
            or (isinstance(pl[0], Shard) and pl[0].dim != 0):
        raise ValueError(f"sharded parameters must be Shard(0) or Replicate() on a 1-D mesh "
                         f"(FSDP2's default), got {pl} on a {mesh.ndim}-D mesh")
    if isinstance(pl[0], Replicate) or p.dim() == 0:
        return 0
    rows, w, r = p.shape[0], mesh.size(), mesh.get_local_rank()
    chunk = -(-rows // w)
    start = min(r * chunk, rows)
    local_rows = _local(p).shape[0]
    if local_rows != max(0, min(chunk, rows - start)):
        raise ValueError(f"unexpected shard: {local_rows} of {rows} rows on rank {r} of {w}")
    return start * (p.numel() // max(rows, 1))


@dataclass
class Bucket:
    """Parameters of one group that share a device and a dtype, laid end to end."""
    index: int
    group_index: int
    params: List[Tensor]
    offsets: List[int]
    numel: int
    device: torch.device
    param_dtype: torch.dtype
    dtype: torch.dtype                     # state dtype
    buffers: Dict[str, Tensor] = field(default_factory=dict)
    #: sharded parameters: (local offset, length, index in the unsharded bucket) per
    #: parameter, where the noise of those elements is drawn; None: not sharded
    segments: Optional[List[Tuple[int, int, int]]] = None

    def local(self, i: int) -> Tensor:
        """Parameter ``i`` as this process holds it (its local shard when sharded)."""
        return _local(self.params[i])

    def flat_params(self) -> Tensor:
        return torch.cat([_local(p.detach()).reshape(-1) for p in self.params]).to(self.dtype)

    def flat_grads(self) -> Tensor:
        """Gradients as one flat state-dtype vector; ``None`` gradients count as zero."""
        parts = []
        for i, p in enumerate(self.params):
            if p.grad is None:
                parts.append(torch.zeros(self.local(i).numel(), device=self.device,
                                         dtype=self.dtype))
            else:
                if p.grad.is_sparse:
                    raise RuntimeError("poco_kernels optimizers do not support sparse gradients")
                parts.append(_local(p.grad.detach()).reshape(-1).to(self.dtype))
        return torch.cat(parts) if parts else torch.zeros(0, device=self.device, dtype=self.dtype)

    def write_params(self, flat: Tensor) -> None:
        with torch.no_grad():
            for i, off in enumerate(self.offsets):
                loc = self.local(i)
                loc.copy_(flat[off:off + loc.numel()].view_as(loc))


COUNTER_STEPS, COUNTER_REFRESHES = 0, 1


@dataclass
class SampleSpec:
    """A posterior sample ``centre + sigma * sign * eps`` (see ``_sample_spec``).

    ``sigma``: a constant or a per-element buffer; or ``h`` (with ``ess``, ``wd``):
    IVON's ``sigma = 1/sqrt(ess (h + wd))``.  ``noise``: ``(noise kind, draw, counter
    slot, sign)`` of the standard normal, or None for no noise (the sample is ``centre``).
    """
    centre: Tensor
    noise: Optional[Tuple[int, int, int, float]] = None
    sigma: Any = None
    h: Optional[Tensor] = None
    ess: float = 0.0
    wd: float = 0.0

    def sigma_tensor(self):
        if self.h is not None:
            from .reference import ivon_sigma
            return ivon_sigma(self.h, self.ess, self.wd)
        return self.sigma


class _Pending:
    """Gradient sums collected since the last step/refresh, per sample kind."""

    def __init__(self):
        self.count = {KIND_INNER: 0, KIND_OUTER: 0, KIND_REFRESH: 0}
        self.draws = {KIND_INNER: 0, KIND_OUTER: 0, KIND_REFRESH: 0}
        self.sums: Dict[Tuple[int, int, str], Tensor] = {}   # (kind, bucket, "g"|"ge")
        self.losses: List[Tensor] = []

    def clear(self, kinds: Iterable[int]) -> None:
        for k in kinds:
            self.count[k] = 0
            self.draws[k] = 0
        self.sums = {key: v for key, v in self.sums.items() if key[0] not in kinds}

    def to_dict(self) -> Dict[str, Any]:
        return {"count": dict(self.count), "draws": dict(self.draws),
                "sums": {f"{k}/{b}/{n}": v.clone() for (k, b, n), v in self.sums.items()}}

    def load(self, d: Dict[str, Any], buckets: Sequence[Bucket]) -> None:
        self.count = {int(k): int(v) for k, v in d["count"].items()}
        self.draws = {int(k): int(v) for k, v in d["draws"].items()}
        self.sums = {}
        for key, v in d["sums"].items():
            k, b, n = key.split("/")
            bk = buckets[int(b)]
            self.sums[(int(k), int(b), n)] = v.to(device=bk.device, dtype=bk.dtype).clone()


def _mean_loss(losses: List[Any]):
    """The closure's loss for one evaluation; the (detached) mean for several."""
    if not losses or losses[0] is None:
        return None
    if len(losses) == 1:
        return losses[0]
    return torch.stack([torch.as_tensor(l).detach().float() for l in losses]).mean()


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


class PosteriorOptimizer(torch.optim.Optimizer):
    """Base class: bucketing, sampling, accumulation, refresh/step transactions, state dict.

    Subclasses define the hyperparameters (``_validate_group``), the per-bucket buffers
    (``_init_buffers``), where samples are centred and how wide they are
    (``_sample_spec``), whether Hessian estimates are needed (``uses_hessian``) and the
    two updates ``_inner_update`` and ``_refresh_update``, written with
    :mod:`poco_kernels.reference`.
    """

    #: the optimizer perturbs parameters (needs a sample before each gradient)
    noisy: bool = True
    #: the update needs Price Hessian estimates (accumulate grad * eps)
    uses_hessian: bool = True
    #: the optimizer has an outer loop (refresh) and a correction
    _has_correction: bool = True
    #: appended to the error raised when an update would produce non-finite state
    _divergence_hint: str = "Lower the learning rate."
    #: per-parameter buffers created at their first use (not present before)
    _lazy_buffers: Tuple[str, ...] = ()

    #: the optimizer has fused kernels, Triton and C++ (``_kernel_step``/``_kernel_refresh``)
    _kernel_capable: bool = True

    def __init__(self, params, defaults: Dict[str, Any], *, seed: int = 0, backend: str = "auto",
                 check_finite: Optional[bool] = None):
        _check(isinstance(seed, int) and 0 <= seed < 2 ** 63,
               f"seed must be an int in [0, 2**63), got {seed!r}")
        _check(backend in BACKENDS, f"backend must be one of {BACKENDS}, got {backend!r}")
        _check(check_finite is None or isinstance(check_finite, bool),
               f"check_finite must be None or a bool, got {check_finite!r}")
        self.seed = seed
        super().__init__(params, defaults)
        for g in self.param_groups:
            self._validate_group(g)
        self._build_buckets()
        self.backend = self._resolve_backend(backend)
        #: raise on non-finite gradients (the triton backend then reads one flag from the
        #: device per update; without it a bad update is skipped on the device and counted
        #: in ``skipped_updates``).  Default: True for 'torch' and 'cpp' (where reading the
        #: flag is free), False for 'triton'.
        self.check_finite = (self.backend != "triton") if check_finite is None else check_finite
        # global counters (in the state dict); with a fused backend: updates attempted,
        # the control tensor holds the updates taken
        self._step = 0            # completed inner steps
        self._refreshes = 0       # completed refreshes
        self._pending = _Pending()
        self._active: Optional[Tuple[int, int]] = None   # (kind, draw) of the sample in params
        self._active_eps: Dict[int, Optional[Tensor]] = {}
        self._eps_cache: Dict[int, Tuple[Tuple[int, ...], Tensor]] = {}
        self._engine = None
        if self.backend in ("triton", "cpp"):
            from ._fused_backend import FusedEngine
            from .kernels import ops_for
            self._engine = FusedEngine(self, ops_for(self.backend))

    def _fused_reasons(self, backend: str) -> List[str]:
        """Why the fused ``backend`` ('triton' or 'cpp') cannot run these parameters
        (empty: it can)."""
        from .kernels import cpp_status, triton_status
        name = {"triton": "Triton", "cpp": "C++"}[backend]
        reasons = []
        if not self._kernel_capable:
            reasons.append(f"{type(self).__name__} has no {name} kernels")
        for b in self._buckets:
            if b.segments is not None:
                reasons.append(f"sharded (DTensor, e.g. FSDP2) parameters run on the reference "
                               f"backend only, not the {name} kernels")
            if b.param_dtype == torch.float64:
                reasons.append(f"float64 parameters are not supported by the {name} kernels "
                               "(float32, bfloat16, float16)")
            why = triton_status(b.device) if backend == "triton" else cpp_status(b.device)
            if why is not None:
                reasons.append(why)
        return list(dict.fromkeys(reasons))

    def _resolve_backend(self, backend: str) -> str:
        """'auto': Triton when every parameter is on a CUDA device, the C++ kernels when
        every parameter is on the CPU (and the extension is built), neither for float64
        parameters; the reference otherwise.  'triton' / 'cpp': that, or a clear error."""
        if backend == "torch":
            return "torch"
        if backend in ("triton", "cpp"):
            reasons = self._fused_reasons(backend)
            if reasons:
                raise RuntimeError(f"backend={backend!r} cannot run here: " + "; ".join(reasons)
                                   + ". Use backend='torch' (the reference) or 'auto'.")
            return backend
        devices = {b.device.type for b in self._buckets}
        if devices == {"cuda"} and not self._fused_reasons("triton"):
            return "triton"
        if devices == {"cpu"} and not self._fused_reasons("cpp"):
            return "cpp"
        return "torch"

    # ------------------------------------------------------------------ construction
    def _validate_group(self, group: Dict[str, Any]) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _init_buffers(self, bucket: Bucket, group: Dict[str, Any]) -> Dict[str, Tensor]:
        raise NotImplementedError

    def _build_buckets(self) -> None:
        self._buckets: List[Bucket] = []
        seen = set()
        for gi, group in enumerate(self.param_groups):
            by_key: Dict[Tuple[torch.device, torch.dtype], List[Tensor]] = {}
            for p in group["params"]:
                _check(isinstance(p, Tensor), "parameters must be tensors")
                _check(id(p) not in seen, "a parameter appears in more than one place")
                seen.add(id(p))
                _check(not p.is_sparse, "sparse parameters are not supported")
                _check(not p.is_complex(), "complex parameters are not supported")
                _check(p.dtype in _FLOAT_DTYPES,
                       f"parameters must be float16, bfloat16, float32 or float64, got {p.dtype}")
                by_key.setdefault((p.device, p.dtype), []).append(p)
            for (dev, dt), ps in by_key.items():
                sharded = any(is_sharded(p) for p in ps)
                offsets, n, segments, n_full = [], 0, [], 0
                for p in ps:
                    offsets.append(n)
                    k = _local(p).numel()
                    if sharded:
                        start = _shard_start(p) if is_sharded(p) else 0
                        segments.append((n, k, n_full + start))
                    n += k
                    n_full += p.numel()
                b = Bucket(len(self._buckets), gi, ps, offsets, n, dev, dt, _state_dtype(dt),
                           segments=segments if sharded else None)
                self._buckets.append(b)
        _check(len(self._buckets) <= _noise.MAX_BUCKETS,
               f"at most {_noise.MAX_BUCKETS} (group, device, dtype) buckets are supported")
        for b in self._buckets:
            group = self.param_groups[b.group_index]
            mean = b.flat_params()
            b.buffers = {"mean": mean, **self._init_buffers(b, group)}
            self._expose(b)

    def _expose(self, b: Bucket) -> None:
        """Per-parameter views of the flat buffers, as ``optimizer.state[p]``."""
        for i, (p, off) in enumerate(zip(b.params, b.offsets)):
            loc = b.local(i)
            st = {}
            for name, buf in b.buffers.items():
                if buf.dim() == 1 and buf.numel() == b.numel:
                    st[name] = buf[off:off + loc.numel()].view(loc.shape)
            self.state[p] = st

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "_buckets"):     # after construction: rebuild with the new group
            self._validate_group(self.param_groups[-1])
            old = self._buckets
            self._build_buckets()
            for b_new, b_old in zip(self._buckets, old):
                b_new.buffers = b_old.buffers
                for attr in ("flat_param", "grad_flat", "grad_views"):
                    if hasattr(b_old, attr):
                        setattr(b_new, attr, getattr(b_old, attr))
                self._expose(b_new)
            if self._engine is not None:
                self._engine.flatten()

    # ------------------------------------------------------------------ noise
    def _eps(self, b: Bucket, kind: int, draw: int, counter: int) -> Tensor:
        """The standard normal of (bucket, kind, draw, counter).  The last one drawn per
        bucket is kept: the outer sample with shared noise, and VSGD-PoCo's refresh fold,
        ask again for the draw just made (regenerating costs ~100 integer ops/element)."""
        key = (self.seed, kind, draw, counter)
        hit = self._eps_cache.get(b.index)
        if hit is not None and hit[0] == key:
            return hit[1]
        stream = _noise.stream_id(b.index, kind, draw)
        if b.segments is None:
            eps = _noise.randn(b.numel, self.seed, counter, stream, device=b.device,
                               dtype=b.dtype)
        else:           # local shards: the noise of their places in the unsharded bucket
            eps = torch.empty(b.numel, device=b.device, dtype=b.dtype)
            for off, n, start in b.segments:
                _noise.randn(n, self.seed, counter, stream, offset=start, out=eps[off:off + n])
        self._eps_cache[b.index] = (key, eps)
        return eps

    def _sample_spec(self, b: Bucket, group: Dict[str, Any], kind: int, draw: int) -> "SampleSpec":
        """Where a sample of ``kind`` (draw ``draw``) is centred, how wide it is, and which
        noise it uses: the one statement that both backends follow."""
        raise NotImplementedError

    def _counter(self, slot: int) -> int:
        """The noise counter of a slot: steps taken (``COUNTER_STEPS``) or refreshes
        taken (``COUNTER_REFRESHES``)."""
        return self._step if slot == COUNTER_STEPS else self._refreshes

    def correction_active(self) -> bool:
        """True when a step needs the gradient at the outer sample too: after the first
        refresh, with a nonzero ``alpha`` in some group."""
        return (self._has_correction and self._refreshes > 0
                and any(g.get("alpha", 0.0) != 0.0 for g in self.param_groups))

    # ------------------------------------------------------------------ low-level API
    def sample(self, kind: str = "inner") -> None:
        """Write a posterior sample into the parameters.

        ``kind``: ``"inner"`` (the current posterior, once per Monte-Carlo sample of a
        step), ``"outer"`` (the outer posterior of the correction, same mini-batch) or
        ``"refresh"`` (the current posterior, ONE sample for the whole mega-batch).
        Follow with any number of backward passes, then :meth:`accumulate` (once per
        chunk) and :meth:`restore`.
        """
        _check(kind in KIND_NAMES, f"kind must be one of {tuple(KIND_NAMES)}, got {kind!r}")
        if self._active is not None:
            raise RuntimeError("a sample is already in the parameters: call restore() first")
        k = KIND_NAMES[kind]
        if k == KIND_OUTER:
            if not self.correction_active():
                raise RuntimeError("no outer sample: the correction is not active "
                                   "(no refresh yet, or alpha == 0 in every group)")
        draw = self._pending.draws[k]
        _check(draw < _noise.MAX_DRAWS, f"at most {_noise.MAX_DRAWS} samples of one kind per step")
        self._active_eps = {}
        if self._engine is not None:
            with torch.no_grad():
                self._engine.sample(k, draw)
            self._active = (k, draw)
            self._pending.draws[k] = draw + 1
            return
        self._sync_mean()
        with torch.no_grad():
            for b in self._buckets:
                group = self.param_groups[b.group_index]
                spec = self._sample_spec(b, group, k, draw)
                sigma, eps = None, None
                if spec.noise is not None:
                    nk, nd, slot, sign = spec.noise
                    sigma = spec.sigma_tensor()
                    eps = self._eps(b, nk, nd, self._counter(slot))
                    if sign < 0:
                        eps = -eps             # antithetic draw: the mirror image
                self._active_eps[b.index] = eps
                b.write_params(perturb(spec.centre, sigma, eps))
        self._active = (k, draw)
        self._pending.draws[k] = draw + 1

    def accumulate(self, clear_grads: bool = True) -> None:
        """Fold the parameters' ``.grad`` into the estimate of the active sample and clear
        ``.grad`` (so the next sample starts from zero).  Call once per sample (Monte Carlo)
        or once per chunk of a mega-batch."""
        if self._active is None:
            raise RuntimeError("accumulate() needs an active sample: call sample() first")
        k, draw = self._active
        if self._engine is not None:
            with torch.no_grad():
                self._engine.accumulate(k, draw)
            self._pending.count[k] += 1
            if clear_grads:
                self._clear_grads()
            return
        with torch.no_grad():
            for b in self._buckets:
                g = b.flat_grads()
                key = (k, b.index, "g")
                self._pending.sums[key] = self._pending.sums[key] + g if key in self._pending.sums else g
                eps = self._active_eps.get(b.index)
                if self.uses_hessian and eps is not None:
                    key = (k, b.index, "ge")
                    ge = g * eps
                    self._pending.sums[key] = self._pending.sums[key] + ge if key in self._pending.sums else ge
        self._pending.count[k] += 1
        if clear_grads:
            self._clear_grads()

    def _clear_grads(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def restore(self, _lazy: bool = False) -> None:
        """Put the posterior mean back into the parameters (ends the active sample).
        (``_lazy``, internal: leave the sample there because the next sample or the
        update overwrites the parameters anyway.)"""
        if not (_lazy and self._engine is not None):
            with torch.no_grad():
                if self._engine is not None:
                    self._engine.restore()
                else:
                    for b in self._buckets:
                        b.write_params(b.buffers["mean"])
        self._active = None
        self._active_eps = {}

    @contextlib.contextmanager
    def sampled(self, kind: str = "inner", accumulate: bool = True):
        """``with opt.sampled(kind): loss.backward()`` = sample, (backward), accumulate,
        restore.  On an exception the mean is restored and nothing is accumulated."""
        self.sample(kind)
        try:
            yield self
            if accumulate:
                self.accumulate()
        finally:
            self.restore()

    def _sync_mean(self) -> None:
        """Parameters of the state dtype are the source of truth for the mean (as in
        ``torch.optim``); low-precision ones keep a float32 master copy in the state."""
        if self._active is not None:
            return
        if self._engine is not None:
            with torch.no_grad():
                self._engine.sync_mean()
            return
        with torch.no_grad():
            for b in self._buckets:
                if b.param_dtype == b.dtype:
                    b.buffers["mean"].copy_(b.flat_params())

    # ------------------------------------------------------------------ estimates
    def _estimate(self, kind: int, b: Bucket, grad_scale: Optional[Tensor]
                  ) -> Tuple[Tensor, Optional[Tensor]]:
        """(mean gradient, mean gradient * eps) over the accumulated samples of ``kind``."""
        n = self._pending.count[kind]
        g = self._pending.sums[(kind, b.index, "g")] / n
        ge = self._pending.sums.get((kind, b.index, "ge"))
        ge = None if ge is None else ge / n
        if grad_scale is not None:
            inv = 1.0 / grad_scale.to(device=b.device, dtype=b.dtype)
            g = g * inv
            ge = None if ge is None else ge * inv
        return g, ge

    def _closure_samples(self, group_key: str = "mc_samples") -> int:
        return max(int(g.get(group_key, 1)) for g in self.param_groups)

    def _run_closure(self, closure: Callable, kind: str, lazy: bool = False) -> Tensor:
        self.sample(kind)
        ok = False
        try:
            with torch.enable_grad():
                loss = closure()
            self.accumulate()
            ok = True
        finally:
            self.restore(_lazy=lazy and ok)
        return loss

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None, *, grad_scale: Optional[Tensor] = None,
             found_inf: Optional[Tensor] = None):
        """One inner step.

        With a ``closure`` (zeroes grads, forward, backward, returns the loss): evaluate it
        at ``mc_samples`` inner samples and, once the correction is active, at as many
        outer samples on the same mini-batch; returns the mean loss at the inner samples.

        Without: use what :meth:`sample`/:meth:`accumulate` collected.  AMP: gradients are
        divided by ``grad_scale``; a nonzero ``found_inf`` skips the step, leaving the
        state as it was (the collected gradients are dropped).
        """
        if self._active is not None:
            raise RuntimeError("step() while a sample is in the parameters: call restore() first")
        for g in self.param_groups:
            self._validate_group(g)
        loss = None
        pend = self._pending
        if closure is not None:
            if pend.count[KIND_INNER] or pend.count[KIND_OUTER]:
                raise RuntimeError("step(closure) with gradients already accumulated by "
                                   "sample()/accumulate(): use one protocol per step")
            lazy = self._engine is not None      # the update writes the parameters
            try:
                losses = [self._run_closure(closure, "inner", lazy)
                          for _ in range(self._closure_samples())]
                if self.correction_active():
                    for _ in range(self._closure_samples()):
                        self._run_closure(closure, "outer", lazy)
            except BaseException:
                pend.clear((KIND_INNER, KIND_OUTER))
                if self._engine is not None and not self._engine.params_hold_mean:
                    self.restore()
                raise
            loss = _mean_loss(losses)
        elif pend.count[KIND_INNER] == 0:
            if self.noisy:
                pend.clear((KIND_INNER, KIND_OUTER))
                raise RuntimeError(
                    f"{type(self).__name__}.step() needs gradients at a posterior sample: pass a "
                    "closure, or run the backward pass inside `with optimizer.sampled():` "
                    "(see the README, 'Training loops without closures')")
            # noiseless optimizer, torch-style use: the gradients in .grad are at the mean
            self._sync_mean()
            self._active = (KIND_INNER, 0)
            self._active_eps = {}
            if self._engine is not None:
                self._engine.active_noise.clear()
            self.accumulate(clear_grads=False)
            self._active = None
        try:
            if self._engine is not None:
                self._engine_update("step", grad_scale, found_inf)
                return loss
            if found_inf is not None and bool(found_inf.detach().float().sum() != 0):
                return loss            # AMP overflow: skip, state untouched
            if self.correction_active() and pend.count[KIND_OUTER] == 0:
                raise RuntimeError(
                    "the posterior correction is active but no gradient at the outer sample was "
                    "given: pass a closure to step(), or also run `with optimizer.sampled('outer'):` "
                    "on the same mini-batch")
            new: Dict[int, Dict[str, Tensor]] = {}
            for b in self._buckets:
                group = self.param_groups[b.group_index]
                g_in, ge_in = self._estimate(KIND_INNER, b, grad_scale)
                outer = (self._estimate(KIND_OUTER, b, grad_scale)
                         if self.correction_active() else None)
                self._check_finite(g_in, ge_in, outer)
                new[b.index] = self._inner_update(b, group, g_in, ge_in, outer, self._step + 1)
            self._check_new(new)
            self._commit(new)
            self._step += 1
        finally:
            pend.clear((KIND_INNER, KIND_OUTER))
            self._eps_cache.clear()
        return loss

    def _engine_update(self, which: str, grad_scale, found_inf) -> None:
        """An update through the Triton backend: no host reads (unless ``check_finite``)."""
        if which == "step":
            corr = self.correction_active()
            if corr and self._pending.count[KIND_OUTER] == 0:
                self._engine.restore()
                raise RuntimeError(
                    "the posterior correction is active but no gradient at the outer sample "
                    "was given: pass a closure to step(), or also run `with "
                    "optimizer.sampled('outer'):` on the same mini-batch")
            self._engine.step(corr, grad_scale, found_inf)
            self._step += 1
        else:
            self._engine.refresh(grad_scale, found_inf)
            self._refreshes += 1

    def _check_finite(self, g, ge, outer) -> None:
        ts = [g, ge] + (list(outer) if outer is not None else [])
        for t in ts:
            if t is not None and not bool(torch.isfinite(t).all()):
                raise ValueError("non-finite gradient (inf or nan): the step was not taken and the "
                                 "optimizer state is unchanged (with AMP, pass found_inf to skip)")

    def _check_new(self, new: Dict[int, Dict[str, Tensor]]) -> None:
        for bi, bufs in new.items():
            for name, t in bufs.items():
                if not bool(torch.isfinite(t).all()):
                    raise FloatingPointError(
                        f"the update produced non-finite values in {name!r}: the step was not "
                        f"taken and the optimizer state is unchanged. {self._divergence_hint}")

    def _commit(self, new: Dict[int, Dict[str, Tensor]]) -> None:
        for b in self._buckets:
            added = False
            for name, t in new.get(b.index, {}).items():
                if name in b.buffers:
                    b.buffers[name].copy_(t)
                else:                          # a buffer created at its first use
                    b.buffers[name] = t.clone()
                    added = True
            if added:
                self._expose(b)
            b.write_params(b.buffers["mean"])

    def _inner_update(self, b: Bucket, group: Dict[str, Any], g_in: Tensor,
                      ge_in: Optional[Tensor], outer, t: int) -> Dict[str, Tensor]:
        raise NotImplementedError

    # ------------------------------------------------------------------ refresh
    @torch.no_grad()
    def refresh(self, closures: Optional[Iterable[Callable]] = None, *,
                grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None):
        """Form the outer estimate from a mega-batch (or the full batch).

        ``closures``: one closure per chunk of the mega-batch (each zeroes grads, runs
        forward and backward on its chunk, returns its mean loss); the outer gradient is
        the mean over the chunks, at ONE posterior sample for the whole mega-batch (or at
        each of ``refresh_samples`` samples, where the optimizer has that option).  Chunks
        should be of equal size (or their losses weighted accordingly).  Without closures,
        use what ``sample("refresh")`` / ``accumulate()`` collected.  Returns the mean loss.
        """
        if not self._has_correction:
            raise RuntimeError(f"{type(self).__name__} has no outer loop to refresh")
        if self._active is not None:
            raise RuntimeError("refresh() while a sample is in the parameters: call restore() first")
        for g in self.param_groups:
            self._validate_group(g)
        pend = self._pending
        losses = []
        if closures is not None:
            if pend.count[KIND_REFRESH]:
                raise RuntimeError("refresh(closures) with refresh gradients already accumulated")
            closures = list(closures)
            try:
                for _ in range(self._closure_samples("refresh_samples")):
                    self.sample("refresh")
                    try:
                        for c in closures:
                            with torch.enable_grad():
                                losses.append(c())
                            self.accumulate()
                    finally:
                        self.restore()
            except BaseException:
                pend.clear((KIND_REFRESH,))
                raise
        try:
            if pend.count[KIND_REFRESH] == 0:
                raise ValueError("refresh() needs at least one chunk of the mega-batch")
            if self._engine is not None:
                self._engine_update("refresh", grad_scale, found_inf)
                return _mean_loss(losses)
            if found_inf is not None and bool(found_inf.detach().float().sum() != 0):
                return None
            new = {}
            for b in self._buckets:
                group = self.param_groups[b.group_index]
                gM, geM = self._estimate(KIND_REFRESH, b, grad_scale)
                self._check_finite(gM, geM, None)
                new[b.index] = self._refresh_update(b, group, gM, geM, first=self._refreshes == 0)
            self._check_new(new)
            self._commit(new)
            self._refreshes += 1
        finally:
            pend.clear((KIND_REFRESH,))
            self._eps_cache.clear()
        return _mean_loss(losses)

    def _refresh_update(self, b, group, gM, geM, first: bool) -> Dict[str, Tensor]:
        raise NotImplementedError

    # ------------------------------------------------------------------ state dict
    def state_dict(self) -> Dict[str, Any]:
        if self._active is not None:
            raise RuntimeError("state_dict() while a sample is in the parameters: call restore() first")
        if self._engine is not None:
            with torch.no_grad():
                self._engine.materialise_ge()
            self._step, self._refreshes, _ = self._engine.counters()
        sd = super().state_dict()
        extra = {}
        for b in self._buckets:       # buffers that are not per-parameter (VON-PoCo's S)
            for name, buf in b.buffers.items():
                if not (buf.dim() == 1 and buf.numel() == b.numel):
                    extra[f"{b.index}/{name}"] = buf
        sd["poco"] = {"step": self._step, "refreshes": self._refreshes, "seed": self.seed,
                      "optimizer": type(self).__name__, "pending": self._pending.to_dict(),
                      "bucket_buffers": extra}
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state dict of the same optimizer class over the same parameters.
        Everything is validated before anything changes."""
        if self._active is not None:
            raise RuntimeError("load_state_dict() while a sample is in the parameters")
        _check(isinstance(state_dict, dict) and {"state", "param_groups", "poco"} <= set(state_dict),
               "not a poco_kernels optimizer state dict (missing 'state', 'param_groups' or 'poco')")
        poco = state_dict["poco"]
        _check(poco.get("optimizer") == type(self).__name__,
               f"state dict is for {poco.get('optimizer')!r}, not {type(self).__name__!r}")
        groups, saved_groups = self.param_groups, state_dict["param_groups"]
        _check(len(groups) == len(saved_groups),
               f"state dict has {len(saved_groups)} parameter groups, the optimizer {len(groups)}")
        saved_index = {}
        for gi, (g, sg) in enumerate(zip(groups, saved_groups)):
            _check(len(g["params"]) == len(sg["params"]),
                   f"group {gi}: state dict has {len(sg['params'])} parameters, the optimizer "
                   f"{len(g['params'])}")
            saved_index.update({id(p): i for i, p in zip(sg["params"], g["params"])})
            merged = {**sg, "params": g["params"]}
            self._validate_group(dict(merged))
        # per-parameter buffers: names, shapes
        copies, lazy, drop = [], {}, set()
        for b in self._buckets:
            for p, off in zip(b.params, b.offsets):
                idx = saved_index[id(p)]
                saved = state_dict["state"].get(idx)
                _check(saved is not None, f"state dict has no state for parameter {idx}")
                _check(isinstance(saved, dict), f"parameter {idx}: state is not a dict")
                for name in saved:
                    if name not in b.buffers:     # created at first use (momentum buffers)
                        _check(name in self._lazy_buffers,
                               f"parameter {idx}: unexpected state {name!r} in the state dict")
                        lazy.setdefault(b.index, set()).add(name)
                for name, view in self.state[p].items():
                    if name not in saved and name in self._lazy_buffers:
                        drop.add((b.index, name))     # saved before its first use
                        continue
                    _check(name in saved, f"parameter {idx}: state dict lacks {name!r}")
                    t = saved[name]
                    _check(isinstance(t, Tensor) and tuple(t.shape) == tuple(view.shape),
                           f"parameter {idx}: {name!r} has shape "
                           f"{tuple(getattr(t, 'shape', ()))}, expected {tuple(view.shape)}")
                    copies.append((view, t))
        extra = poco.get("bucket_buffers", {})
        for b in self._buckets:
            for name, buf in b.buffers.items():
                if not (buf.dim() == 1 and buf.numel() == b.numel):
                    key = f"{b.index}/{name}"
                    _check(key in extra and tuple(extra[key].shape) == tuple(buf.shape),
                           f"state dict lacks bucket buffer {key!r} of shape {tuple(buf.shape)}")
                    copies.append((buf, extra[key]))
        pend = _Pending()
        pend.load(poco["pending"], self._buckets)
        for (k, bi, n), t in pend.sums.items():
            _check(bi < len(self._buckets) and t.numel() == self._buckets[bi].numel,
                   "state dict's pending gradients do not match the parameters")
        # ---- commit
        for bi, name in drop:
            self._buckets[bi].buffers.pop(name, None)
            self._expose(self._buckets[bi])
        for bi, names in lazy.items():
            b = self._buckets[bi]
            for name in names:
                b.buffers[name] = torch.zeros(b.numel, device=b.device, dtype=b.dtype)
            self._expose(b)
            for p, off in zip(b.params, b.offsets):
                idx = saved_index[id(p)]
                for name in names:
                    copies.append((self.state[p][name], state_dict["state"][idx][name]))
        with torch.no_grad():
            for dst, src in copies:
                dst.copy_(src.to(device=dst.device, dtype=dst.dtype))
        for g, sg in zip(groups, saved_groups):
            for k, v in sg.items():
                if k != "params":
                    g[k] = v
        self._step = int(poco["step"])
        self._refreshes = int(poco["refreshes"])
        self.seed = int(poco["seed"])
        self._pending = pend
        for b in self._buckets:
            b.write_params(b.buffers["mean"])
        if self._engine is not None:
            self._engine.params_hold_mean = True
            self._engine.set_counters(self._step, self._refreshes)

    # ------------------------------------------------------------------ misc
    @property
    def step_count(self) -> int:
        """Number of inner steps taken (triton backend: read from the device)."""
        return self._engine.counters()[0] if self._engine is not None else self._step

    @property
    def refresh_count(self) -> int:
        """Number of refreshes of the outer estimate (triton backend: read from the device)."""
        return self._engine.counters()[1] if self._engine is not None else self._refreshes

    @property
    def skipped_updates(self) -> int:
        """Updates skipped on the device (AMP overflow, or non-finite gradients without
        ``check_finite``) since the optimizer was built or loaded; triton backend only
        (the reference backend skips AMP overflows and raises on non-finite gradients)."""
        return self._engine.counters()[2] if self._engine is not None else 0

    def flat_state(self, name: str) -> List[Tensor]:
        """The flat buffer ``name`` of every bucket (read-only use, for tests and tools)."""
        return [b.buffers[name] for b in self._buckets]


# ---------------------------------------------------------------------- validation helpers
def check_range(group, key, lo=None, hi=None, lo_open=False, hi_open=False, kind=float,
                allow_inf=False):
    """Raise a ValueError naming ``key`` unless ``group[key]`` is a number in the range."""
    v = group[key]
    if kind is float:
        ok = (isinstance(v, (int, float)) and not isinstance(v, bool)
              and (math.isfinite(v) or (allow_inf and v == math.inf)))
    else:
        ok = isinstance(v, int) and not isinstance(v, bool)
    if ok and lo is not None:
        ok = v > lo if lo_open else v >= lo
    if ok and hi is not None:
        ok = v < hi if hi_open else v <= hi
    if not ok:
        lb = "" if lo is None else ("(" if lo_open else "[") + str(lo)
        ub = "" if hi is None else str(hi) + (")" if hi_open else "]")
        raise ValueError(f"invalid {key}: {v!r} (expected a {kind.__name__} in "
                         f"{lb or '(-inf'}, {ub or 'inf)'})")
