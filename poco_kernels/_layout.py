"""Flat buckets: how an optimizer lays out its parameters and state.

The trainable parameters (``requires_grad``) of each parameter group are split by
(device, dtype) into buckets (frozen ones have no state and are never touched); every
piece of optimizer state is one flat float32 (float64 for float64 parameters) buffer per
bucket, and ``optimizer.state[p]`` holds views into those buffers (:func:`expose`), so
``torch.optim`` tooling sees the usual per-parameter state while kernels see one
contiguous buffer per bucket.

Sharded parameters (FSDP2's ``DTensor``, sharded on dim 0): a bucket holds the local
shards; each shard's noise is drawn at its elements' positions in the unsharded bucket
(``Bucket.segments``), so a sharded run draws exactly the unsharded sample.  The maths is
elementwise, so nothing else needs communication.

Padding: every flat buffer is allocated with room for a multiple of :data:`PAD` elements
(:func:`alloc_flat`) and is a view of its first ``numel``; the elements past it belong to
no parameter.  A Triton launch whose every buffer is such a view (:func:`launch_numel`)
runs over the padded length, so the length the kernel is specialised on is divisible by
16 and its loads and stores are vectorised; what it writes past ``numel`` (any value, NaN
included: the state padding starts at zero) is never read as a value: each element
depends only on the same element of its inputs.  The one padding that is read is the
gradients', by the non-finite check, and it stays zero: gradient buffers start zeroed,
backward writes only their first ``numel``, and a kernel writes into a gradient buffer
only while it is lent as a pending sum (``accumulate`` adds the next gradient to it),
which adds zero padding to zero padding.
Any other tensor (a clone, a user's, a loaded state dict's) makes the launch use the
exact length, the scalar path: the same values.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ._validation import check

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:                     # pragma: no cover - torch without distributed
    _DTensor = ()


#: flat buffers have room for a multiple of this many elements (Triton specialises a
#: length divisible by 16 and then vectorises masked loads and stores)
PAD = 16

#: id -> weak reference of every live tensor made by :func:`alloc_flat`
_PADDED: Dict[int, "weakref.ref"] = {}


def padded_numel(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`PAD`."""
    return -(-n // PAD) * PAD


def alloc_flat(n: int, device, dtype: torch.dtype, fill: float = 0.0) -> Tensor:
    """A flat buffer of ``n`` elements filled with ``fill``: a view of the first ``n`` of
    ``padded_numel(n)`` (the padding holds ``fill`` too and is this buffer's alone).  While
    ``torch.compile`` traces, an unpadded one."""
    if torch.compiler.is_compiling():        # (traced: no registry; exact launches)
        return torch.full((n,), fill, device=device, dtype=dtype)
    v = torch.full((padded_numel(n),), fill, device=device, dtype=dtype)[:n]
    key = id(v)

    def forget(ref, key=key):
        if _PADDED.get(key) is ref:
            del _PADDED[key]
    _PADDED[key] = weakref.ref(v, forget)
    return v


def padded_copy(t: Tensor) -> Tensor:
    """``t`` itself when :func:`alloc_flat` made it, else a padded flat copy of it."""
    if is_padded(t):
        return t
    out = alloc_flat(t.numel(), t.device, t.dtype)
    out.copy_(t.reshape(-1))
    return out


def is_padded(t: Tensor) -> bool:
    """True for a live tensor made by :func:`alloc_flat` (its padding is its own).  False
    while ``torch.compile`` traces (ids of traced tensors mean nothing)."""
    if torch.compiler.is_compiling():
        return False
    ref = _PADDED.get(id(t))
    return ref is not None and ref() is t


def launch_numel(n: int, *tensors: Optional[Tensor]) -> int:
    """The length a kernel over ``n`` elements of ``tensors`` (None: absent) runs over:
    ``padded_numel(n)`` when every tensor is a padded flat buffer of ``n`` elements, else
    ``n``."""
    if n % PAD == 0:
        return n
    for t in tensors:
        if t is not None and (not is_padded(t) or t.numel() != n):
            return n
    return padded_numel(n)


def state_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """float64 state for float64 parameters, float32 otherwise."""
    return torch.float64 if param_dtype == torch.float64 else torch.float32


def is_sharded(t) -> bool:
    """True for a ``torch.distributed`` ``DTensor`` (FSDP2's sharded parameters)."""
    return isinstance(t, _DTensor)


def local(t: Tensor) -> Tensor:
    """The local shard of a ``DTensor`` (an alias: in-place writes reach the parameter),
    else the tensor itself."""
    return t.to_local() if is_sharded(t) else t


def shard_start(p: Tensor) -> int:
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
    local_rows = local(p).shape[0]
    if local_rows != max(0, min(chunk, rows - start)):
        raise ValueError(f"unexpected shard: {local_rows} of {rows} rows on rank {r} of {w}")
    return start * (p.numel() // max(rows, 1))


def as_saved(v: Tensor, p: Tensor) -> Tensor:
    """A per-parameter state tensor ``v`` (this process's part) as a state dict holds it:
    for a sharded ``p`` a ``DTensor`` of ``p``'s shape and placements (what
    ``torch.distributed.checkpoint`` saves sharded and reshards), else ``v``."""
    if not is_sharded(p):
        return v
    with torch.no_grad():           # (state is not part of any graph)
        return _as_dtensor(v, p)


def _as_dtensor(v: Tensor, p: Tensor) -> Tensor:
    # torch.save fails on a DTensor whose local tensor has a storage offset (torch 2.13:
    # "invalid python storage"): the same memory as a tensor at offset 0 of a storage
    # slice (an alias: nothing is copied)
    if v.numel() == 0:
        v = v.new_empty(v.shape)
    elif v.storage_offset() != 0:
        es, off = v.element_size(), v.storage_offset()
        st = v.untyped_storage()[off * es:(off + v.numel()) * es]
        v = v.new_empty(0).set_(st, 0, v.shape, v.stride())
    return _DTensor.from_local(v, p.device_mesh, p.placements, run_check=False,
                               shape=p.shape, stride=p.stride())


def as_local(t, p: Tensor, what: str):
    """A saved per-parameter state value as this process holds ``p``: a ``DTensor`` placed
    as ``p`` gives its local part; a plain tensor of ``p``'s whole shape, for a sharded
    ``p``, this rank's part of it (a state dict of an unsharded run); anything else is
    returned as it is (the caller checks the shape).  A ``DTensor`` placed otherwise is
    refused (``torch.distributed.checkpoint`` reshards: load into the state dict of this
    model and optimizer, ``get_state_dict``)."""
    if is_sharded(t):
        ok = (is_sharded(p) and tuple(t.placements) == tuple(p.placements)
              and t.device_mesh.size() == p.device_mesh.size()
              and tuple(t.shape) == tuple(p.shape))
        check(ok, f"{what} is a DTensor of shape {tuple(t.shape)} placed {tuple(t.placements)} "
                  f"over {t.device_mesh.size()} ranks, the parameter "
                  + (f"{tuple(p.shape)} placed {tuple(p.placements)} over "
                     f"{p.device_mesh.size()}" if is_sharded(p) else "is not sharded")
                  + ": load sharded checkpoints with torch.distributed.checkpoint into "
                    "get_state_dict(model, optimizer) of this model (it reshards)")
        return t.to_local()
    if is_sharded(p) and isinstance(t, Tensor) and tuple(t.shape) == tuple(p.shape) \
            and tuple(p.shape) != tuple(local(p).shape):
        start, n = shard_start(p), local(p).numel()
        return t.reshape(-1)[start:start + n].view(local(p).shape)
    return t


def shard_groups(buckets) -> list:
    """The process groups the sharded parameters of ``buckets`` are sharded over (each
    once; empty when nothing is sharded)."""
    out = []
    for b in buckets:
        if b.segments is None:
            continue
        for p in b.params:
            if is_sharded(p):
                g = p.device_mesh.get_group()
                if all(g is not h for h in out):
                    out.append(g)
    return out


def any_rank(flag: Tensor, groups) -> Tensor:
    """``flag`` (a one-element integer tensor, nonzero where this rank saw something, e.g.
    a non-finite gradient in its shards) made the maximum over the ranks of ``groups``,
    in place, on its device (no host read).  Every rank then decides alike, as the
    unsharded run, which sees every element, would."""
    if groups:
        import torch.distributed as dist
        for g in groups:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=g)
    return flag


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
    # What a backend keeps on the bucket (not constructor arguments, not compared or shown).
    # The fused backends ("triton", "cpp") set these; the torch backend leaves them None.
    #: the flat buffer of the parameter dtype the parameters are views of (fused:
    #: backends/fused_layout.py, flatten; None while sharded: FSDP2 owns the shards)
    flat_param: Optional[Tensor] = field(default=None, init=False, repr=False, compare=False)
    #: the parameters' addresses as views of ``flat_param``, cached to tell whether they
    #: still are (fused: backends/fused_layout.py, _is_flat; an ``array('Q')``, which the
    #: sweeps read in place)
    flat_ptrs: Optional[Sequence[int]] = field(default=None, init=False, repr=False,
                                               compare=False)
    #: the flat gradient buffers of the parameter dtype, fused_grads.GradBuffer objects,
    #: more while some are lent as pending sums (fused: flatten, _free_buffer; [] sharded)
    grad_bufs: Optional[list] = field(default=None, init=False, repr=False, compare=False)
    #: index in ``grad_bufs`` of the buffer whose views the parameters were handed as
    #: ``.grad`` (fused: backends/fused_grads.py, hand_out; None: none handed out)
    handed: Optional[int] = field(default=None, init=False, repr=False, compare=False)
    #: which parameters autograd reached since the views were handed out, a byte each
    #: set by a hook (fused: backends/fused_presence.py, Presence; made by hand_out)
    presence: Optional[object] = field(default=None, init=False, repr=False, compare=False)
    #: the first gradient buffer's flat tensor, ``grad_bufs[0].flat`` (fused: flatten)
    grad_flat: Optional[Tensor] = field(default=None, init=False, repr=False, compare=False)
    #: the first gradient buffer's per-parameter views, whose shapes are the parameters'
    #: as flattened, read by the re-link (fused: flatten)
    grad_views: Optional[List[Tensor]] = field(default=None, init=False, repr=False,
                                               compare=False)
    #: ``id`` of each parameter, for set operations over the bucket (:meth:`ids`: made at
    #: first use, as ``params`` never changes)
    param_ids: Optional[frozenset] = field(default=None, init=False, repr=False,
                                           compare=False)

    #: fused: ``(handed, other)`` while the memory of two gradient buffers is swapped
    #: (backends/fused_grads.py, ``GradsMixin._swap_in``)
    swapped: Optional[Tuple[int, int]] = field(default=None, init=False, repr=False,
                                               compare=False)

    def ids(self) -> frozenset:
        """The ``id`` of each parameter (made once)."""
        if self.param_ids is None:
            self.param_ids = frozenset(map(id, self.params))
        return self.param_ids

    def local(self, i: int) -> Tensor:
        """Parameter ``i`` as this process holds it (its local shard when sharded)."""
        return local(self.params[i])

    def new_buffer(self, fill: float = 0.0, dtype: Optional[torch.dtype] = None) -> Tensor:
        """A flat (padded, :func:`alloc_flat`) buffer of the bucket's length, filled with
        ``fill``, in ``dtype`` (default: the state dtype)."""
        return alloc_flat(self.numel, self.device, dtype or self.dtype, fill)

    def flat_params(self, out: Optional[Tensor] = None) -> Tensor:
        """The parameters as one flat state-dtype buffer: a new padded one, or ``out``."""
        out = self.new_buffer() if out is None else out
        parts = [local(p.detach()).reshape(-1) for p in self.params]
        if parts and self.param_dtype == self.dtype:
            torch.cat(parts, out=out)
        elif parts:
            out.copy_(torch.cat(parts))
        return out

    def flat_grads(self) -> Tensor:
        """Gradients as one flat state-dtype vector; ``None`` gradients count as zero."""
        parts = []
        for i, p in enumerate(self.params):
            if p.grad is None:
                parts.append(torch.zeros(self.local(i).numel(), device=self.device,
                                         dtype=self.dtype))
            else:
                if p.grad.is_sparse:
                    raise RuntimeError("poco_kernels optimizers do not support sparse "
                                       "gradients (e.g. nn.Embedding(sparse=True)): nothing "
                                       "was accumulated")
                parts.append(local(p.grad.detach()).reshape(-1).to(self.dtype))
        return torch.cat(parts) if parts else torch.zeros(0, device=self.device, dtype=self.dtype)

    def write_params(self, flat: Tensor) -> None:
        with torch.no_grad():
            for i, off in enumerate(self.offsets):
                loc = self.local(i)
                loc.copy_(flat[off:off + loc.numel()].view_as(loc))

    def f32(self, name: str) -> Tensor:
        """Buffer ``name`` in the state dtype (a low-precision buffer, ``state_dtype``,
        widened exactly; otherwise the buffer itself)."""
        buf = self.buffers[name]
        return buf if buf.dtype == self.dtype else buf.to(self.dtype)

    def is_flat_buffer(self, buf: Tensor) -> bool:
        """True for a per-parameter buffer (one element per parameter element)."""
        return buf.dim() == 1 and buf.numel() == self.numel


def build_buckets(param_groups: Sequence[dict], max_buckets: int) -> List[Bucket]:
    """Validate the parameters and lay each group's trainable ones (``requires_grad``) out
    in (device, dtype) buckets."""
    buckets: List[Bucket] = []
    seen = set()
    for gi, group in enumerate(param_groups):
        by_key: Dict[Tuple[torch.device, torch.dtype], List[Tensor]] = {}
        for p in group["params"]:
            check(isinstance(p, Tensor), "parameters must be tensors")
            check(id(p) not in seen, "a parameter appears in more than one place")
            seen.add(id(p))
            check(not p.is_sparse, "sparse parameters are not supported")
            check(not p.is_complex(), "complex parameters are not supported")
            check(p.dtype in FLOAT_DTYPES,
                  f"parameters must be float16, bfloat16, float32 or float64, got {p.dtype}")
            if p.requires_grad:            # frozen parameters: no state, never sampled
                by_key.setdefault((p.device, p.dtype), []).append(p)
        for (dev, dt), ps in by_key.items():
            sharded = any(is_sharded(p) for p in ps)
            offsets, n, segments, n_full = [], 0, [], 0
            for p in ps:
                offsets.append(n)
                k = local(p).numel()
                if sharded:
                    start = shard_start(p) if is_sharded(p) else 0
                    segments.append((n, k, n_full + start))
                n += k
                n_full += p.numel()
            buckets.append(Bucket(len(buckets), gi, ps, offsets, n, dev, dt, state_dtype(dt),
                                  segments=segments if sharded else None))
    _check_memory([p for b in buckets for p in b.params])
    kinds = {is_sharded(p) for b in buckets for p in b.params}
    check(len(kinds) < 2,
          "the trainable parameters are partly sharded (some DTensor, some plain tensors): "
          "shard the whole model (e.g. fully_shard the root module too) or none of it, so "
          "every parameter's gradient is reduced the same way")
    check(len(buckets) <= max_buckets,
          f"at most {max_buckets} (group, device, dtype) buckets are supported")
    return buckets


def _check_memory(params: Sequence[Tensor]) -> None:
    """Refuse trainable parameters whose elements share memory, which an update that keeps
    one value per element (a flat buffer's copy, or the torch backend's writes) cannot
    honour: an expanded one (stride 0), or two over the same bytes (a tie by storage,
    ``dec.weight.data = enc.weight.data``)."""
    spans = []
    for p in params:
        t = local(p)
        if t.numel() == 0 or t.device.type == "meta":
            continue
        check(all(st != 0 or n == 1 for st, n in zip(t.stride(), t.shape)),
              f"a parameter of shape {tuple(p.shape)} is an expanded view (stride "
              f"{tuple(t.stride())}): its elements share memory; give it its own (.clone())")
        lo = t.data_ptr()
        hi = lo + t.element_size() * (1 + sum((n - 1) * abs(st) for st, n
                                               in zip(t.stride(), t.shape)))
        spans.append((lo, hi, tuple(p.shape)))
    spans.sort()
    for (_, hi0, a), (lo1, _, b) in zip(spans, spans[1:]):
        check(lo1 >= hi0, f"parameters of shapes {a} and {b} share memory (a tie by storage, "
                          "such as `dec.weight.data = enc.weight.data`): an update keeps one "
                          "value per element, so it would break the tie; tie them as one "
                          "Parameter (`dec.weight = enc.weight`) instead")


def expose(state: dict, b: Bucket) -> None:
    """Per-parameter views of the bucket's flat buffers, as ``optimizer.state[p]``."""
    for i, (p, off) in enumerate(zip(b.params, b.offsets)):
        loc = b.local(i)
        state[p] = {name: buf[off:off + loc.numel()].view(loc.shape)
                    for name, buf in b.buffers.items() if b.is_flat_buffer(buf)}
