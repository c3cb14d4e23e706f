"""The sampling protocol's vocabulary, shared by the optimizers and the backends.

* **Sample kinds**: ``inner`` (the current posterior, per step), ``outer`` (the outer
  posterior of the correction, same mini-batch) and ``refresh`` (the current posterior,
  ONE sample for the whole mega-batch).
* **Noise counters**: a sample's noise is keyed by the steps taken (``COUNTER_STEPS``) or
  the refreshes taken (``COUNTER_REFRESHES``).
* :class:`SampleSpec`: where a sample is centred, how wide it is and which noise it
  uses -- the one statement that every backend follows.
* :class:`Pending`: the gradient sums collected since the last step or refresh.
* :class:`KernelStep` / :class:`KernelRefresh`: what an optimizer hands the fused
  backends for one bucket (its buffers and the typed records of
  :mod:`poco_kernels.kernels.interface`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .kernels.interface import RefreshHyper, StepFlags, StepHyper
from .noise import MAX_DRAWS
from .reference import ivon_sigma

KIND_INNER, KIND_OUTER, KIND_REFRESH = 0, 1, 2
KIND_NAMES = {"inner": KIND_INNER, "outer": KIND_OUTER, "refresh": KIND_REFRESH}
COUNTER_STEPS, COUNTER_REFRESHES = 0, 1


@dataclass
class SampleSpec:
    """A posterior sample ``centre + sigma * sign * eps``.

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
            return ivon_sigma(self.h, self.ess, self.wd)
        return self.sigma


class KernelStep(NamedTuple):
    """A rule's step for one bucket on the fused backends: its two state buffers (``s1``,
    ``s2``; None where the family has none) and the records, the family in ``flags``
    (the host engine sets the rest of each record)."""
    s1: Optional[Tensor]
    s2: Optional[Tensor]
    hp: StepHyper
    flags: StepFlags


class KernelRefresh(NamedTuple):
    """A rule's refresh for one bucket on the fused backends: the family, the buffers
    it reads (``h``) and writes, and the record."""
    family: int
    h: Optional[Tensor]
    g_out: Tensor
    h_out: Optional[Tensor]
    m_out: Tensor
    sigma_out: Optional[Tensor]
    hp: RefreshHyper


class Pending:
    """Gradient sums collected since the last step/refresh, per sample kind."""

    def __init__(self):
        self.count = {KIND_INNER: 0, KIND_OUTER: 0, KIND_REFRESH: 0}
        self.draws = {KIND_INNER: 0, KIND_OUTER: 0, KIND_REFRESH: 0}
        self.sums: Dict[Tuple[int, int, str], Tensor] = {}   # (kind, bucket, "g"|"ge")
        #: per kind, the parameters (bucket, index in bucket) whose ``.grad`` was None at
        #: every accumulation so far (meaningful where count > 0)
        self.no_grad: Dict[int, FrozenSet[Tuple[int, int]]] = {
            KIND_INNER: frozenset(), KIND_OUTER: frozenset(), KIND_REFRESH: frozenset()}

    def clear(self, kinds: Iterable[int]) -> None:
        for k in kinds:
            self.count[k] = 0
            self.draws[k] = 0
            self.no_grad[k] = frozenset()
        self.sums = {key: v for key, v in self.sums.items() if key[0] not in kinds}

    def note_grads(self, kind: int, missing: FrozenSet[Tuple[int, int]]) -> None:
        """An accumulation of ``kind`` found these parameters without a gradient."""
        self.no_grad[kind] = missing if self.count[kind] == 0 else self.no_grad[kind] & missing

    def to_dict(self) -> Dict[str, Any]:
        d = {"count": dict(self.count), "draws": dict(self.draws),
             "sums": {f"{k}/{b}/{n}": v.clone() for (k, b, n), v in self.sums.items()}}
        no_grad = {k: sorted([bi, i] for bi, i in v)
                   for k, v in self.no_grad.items() if v and self.count[k]}
        if no_grad:          # (optional: absent, every parameter had a gradient)
            d["no_grad"] = no_grad
        return d

    @classmethod
    def validated(cls, d: Any, buckets: Sequence) -> "Pending":
        """The pending sums of a state dict, checked against the buckets (ValueError
        naming what is wrong); a new object, nothing else is touched."""
        def bad(msg):
            raise ValueError(f"state dict's pending gradients: {msg}")

        if not (isinstance(d, dict) and {"count", "draws", "sums"} <= set(d)):
            bad("not a dict with 'count', 'draws' and 'sums'")
        out = cls()
        for name, limit in (("count", 2 ** 62), ("draws", MAX_DRAWS + 1)):
            src = d[name]
            if not isinstance(src, dict):
                bad(f"{name!r} is not a dict")
            for k, v in src.items():
                if k not in out.count:
                    bad(f"unknown sample kind {k!r} in {name!r}")
                if not (isinstance(v, int) and not isinstance(v, bool) and 0 <= v < limit):
                    bad(f"{name}[{k}] must be an int in [0, {limit}), got {v!r}")
                getattr(out, name)[k] = v
        if not isinstance(d["sums"], dict):
            bad("'sums' is not a dict")
        for key, v in d["sums"].items():
            parts = key.split("/") if isinstance(key, str) else []
            if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() \
                    or parts[2] not in ("g", "ge"):
                bad(f"malformed key {key!r}")
            k, bi, n = int(parts[0]), int(parts[1]), parts[2]
            if k not in out.count or out.count[k] == 0:
                bad(f"a sum {key!r} for a kind with no gradients collected")
            if bi >= len(buckets):
                bad(f"a sum {key!r} for bucket {bi}; the optimizer has {len(buckets)}")
            bk = buckets[bi]
            if not (isinstance(v, Tensor) and v.is_floating_point() and v.dim() == 1
                    and v.numel() == bk.numel):
                bad(f"{key!r} must be a float vector of {bk.numel} elements")
            if not bool(torch.isfinite(v).all()):
                bad(f"{key!r} holds non-finite values")
            out.sums[(k, bi, n)] = v.detach().to(device=bk.device, dtype=bk.dtype, copy=True)
        for k, c in out.count.items():
            for bk in buckets:
                if c and (k, bk.index, "g") not in out.sums:
                    bad(f"kind {k} has {c} gradients collected but no sum for bucket {bk.index}")
        no_grad = d.get("no_grad", {})
        if not isinstance(no_grad, dict):
            bad("'no_grad' is not a dict")
        for k, v in no_grad.items():
            if k not in out.count or out.count[k] == 0:
                bad(f"'no_grad' for sample kind {k!r}, which has no gradients collected")
            ok = isinstance(v, (list, tuple))
            pairs = set()
            for e in (v if ok else ()):
                ok = (isinstance(e, (list, tuple)) and len(e) == 2
                      and all(isinstance(x, int) and not isinstance(x, bool) for x in e)
                      and 0 <= e[0] < len(buckets) and 0 <= e[1] < len(buckets[e[0]].params))
                if not ok:
                    break
                pairs.add((e[0], e[1]))
            if not ok:
                bad(f"'no_grad'[{k}] must list [bucket, parameter] pairs, got {v!r}")
            out.no_grad[k] = frozenset(pairs)
        return out


def mean_loss(losses: List[Any]):
    """The closure's loss for one evaluation, whatever it is; the (detached) mean for
    several, each then a number or a one-element tensor (None if one is None).  Called
    before the update, inside the call's transaction: a value that has no mean refuses
    the call."""
    if not losses or any(l is None for l in losses):
        return None
    if len(losses) == 1:
        return losses[0]
    for l in losses:
        if isinstance(l, bool) or not isinstance(l, (int, float, Tensor)) or \
                (isinstance(l, Tensor) and (l.numel() != 1 or l.is_complex())):
            what = (f"a tensor of shape {tuple(l.shape)}" if isinstance(l, Tensor)
                    else f"a {type(l).__name__}")
            raise TypeError(f"the closure returned {what}: with several evaluations in one "
                            "call (mc_samples > 1, or a refresh over several chunks) the "
                            "call returns the mean of their losses, so each must be a "
                            "number or a one-element tensor (or None); the call changed "
                            "nothing")
    return torch.stack([torch.as_tensor(l).detach().float().reshape(()) for l in losses]).mean()
