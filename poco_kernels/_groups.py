"""Parameter groups: torch.optim's names for some hyperparameters (:class:`ParamGroup`),
and the groups' life in an optimizer (:class:`ParamGroupsMixin`): validation, the flat
buckets laid out over them, groups added later, and the trainable set following
``requires_grad``."""
from __future__ import annotations

import operator
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import Tensor

from . import _sweeps
from . import noise as _noise
from ._layout import Bucket, build_buckets, expose, padded_copy
from ._transaction import parking
from ._validation import check, check_group_keys

_requires_grad = operator.attrgetter("requires_grad")


def _immutable(v) -> bool:
    """A hyperparameter value that cannot change in place."""
    return v is None or isinstance(v, (bool, int, float, str)) or (
        isinstance(v, tuple) and all(map(_immutable, v)))


def group_items(g) -> tuple:
    """A group's keys and values, compared by identity to see that nothing in it was
    replaced (its parameter list too)."""
    return (*dict.keys(g), *dict.values(g))


def as_closures(closures) -> List[Callable]:
    """``refresh``'s argument as a list: one closure, or an iterable of closures."""
    if callable(closures):
        return [closures]
    try:
        closures = list(closures)
    except TypeError:
        raise TypeError("refresh() takes a closure or an iterable of closures (one per chunk "
                        f"of the mega-batch), got {type(closures).__name__}") from None
    for c in closures:
        if not callable(c):
            raise TypeError(f"refresh(): a chunk's closure must be callable, got "
                            f"{type(c).__name__}")
    return closures


class ParamGroup(dict):
    """A parameter group that also answers to torch.optim's name for some of an
    optimizer's hyperparameters (``aliases``: IVON's ``beta1``/``beta2`` as ``betas``), so
    tools that read or set that name (``OneCycleLR``/``CyclicLR`` with ``cycle_momentum``)
    act on the optimizer's own keys.  An alias is not a key: it is not in ``keys()``,
    ``items()`` or the state dict."""

    aliases: Dict[str, Tuple[str, ...]] = {}

    def __init__(self, *args, **kwargs):
        super().__init__()
        for k, v in dict(*args, **kwargs).items():
            self[k] = v

    # (super() rather than dict.__getitem__(self, ...): torch.compile traces the former)
    def __getitem__(self, key):
        names = self.aliases.get(key)
        if names is not None:
            return tuple(super(ParamGroup, self).__getitem__(n) for n in names)
        return super().__getitem__(key)

    def __setitem__(self, key, value):
        names = self.aliases.get(key)
        if names is None:
            super().__setitem__(key, value)
            return
        values = tuple(value) if isinstance(value, (tuple, list)) else None
        check(values is not None and len(values) == len(names),
              f"{key!r} stands for ({', '.join(names)}): set it to a tuple of "
              f"{len(names)}, got {value!r}")
        for n, v in zip(names, values):
            super().__setitem__(n, v)

    def __contains__(self, key):
        return key in self.aliases or super().__contains__(key)

    def get(self, key, default=None):
        return self[key] if key in self else default

    def update(self, *args, **kwargs):
        for k, v in dict(*args, **kwargs).items():
            self[k] = v

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]

    def __ior__(self, other):
        self.update(other)
        return self


def _maybe_nonzero(alpha) -> bool:
    """Whether a group's ``alpha`` may be nonzero: a tensor ``alpha`` is not read (on a GPU
    that would synchronise), so it counts as nonzero."""
    return isinstance(alpha, Tensor) or alpha != 0.0


def draw_seed() -> int:
    """A noise seed in ``[0, 2**63)`` from torch's global CPU generator (one draw)."""
    return int(torch.empty((), dtype=torch.int64).random_(0, 2 ** 63 - 1))


def _from_lightning(closure) -> bool:
    """Whether ``closure`` is the one Lightning's automatic optimization hands step()."""
    fn = getattr(closure, "func", closure)
    owner = getattr(fn, "__self__", None)
    return type(owner).__module__.split(".")[0] in ("lightning", "pytorch_lightning")


class ParamGroupsMixin:
    """The groups of a :class:`~poco_kernels._optimizer.BucketedOptimizer`: validating them,
    laying their buckets out, adding one, and following the trainable set."""

    # ------------------------------------------------------------------ construction
    def _validate_group(self, group: Dict[str, Any]) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _initial_buffers(self, b: Bucket, group: Dict[str, Any]) -> Dict[str, Tensor]:
        """The rule's initial buffers, its ``low_state_buffers`` in ``state_dtype`` and
        its ``outer_estimate_buffers`` in ``outer_dtype``."""
        bufs = self.rule.init_buffers(b, group)
        for name, dtype in self._stored_dtypes().items():
            if name in bufs:
                bufs[name] = bufs[name].to(dtype)
        return bufs

    def _stored_dtypes(self) -> Dict[str, torch.dtype]:
        """The buffers stored in another dtype than the state's, and that dtype."""
        out = {}
        if self.state_dtype is not None:
            out.update(dict.fromkeys(self.rule.low_state_buffers, self.state_dtype))
        if self.outer_dtype is not None:
            out.update(dict.fromkeys(self.rule.outer_estimate_buffers, self.outer_dtype))
        return out

    def _check_group(self, group: Dict[str, Any], gi: int, new: bool = False) -> None:
        """Validate group ``gi``'s hyperparameters (``new``: also refuse a key that looks
        like a misspelled hyperparameter); errors name the group."""
        where = f"param group {gi}"
        check_group_keys(group, self.defaults, where, misspelled=new)
        try:
            self._validate_group(group)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    def _check_groups(self) -> None:
        """Validate every group (before each step and refresh).  A group whose keys and
        values are the very objects last validated (:func:`group_items`), each value
        immutable (numbers, strings, tuples of them: not a tensor or a list, which change
        in place), is not validated again.  ``_group_stamp``: the groups as validated
        (the step plans' key), None while a group's values can change in place."""
        seen = self.__dict__.setdefault("_validated", {})
        groups = self._groups
        changed = len(groups) != self.__dict__.get("_stamped", -1)
        try:
            for gi, g in enumerate(groups):
                items = group_items(g)
                last = seen.get(gi)
                if (last is not None and last[0] is g and len(last[1]) == len(items)
                        and all(map(operator.is_, last[1], items))):
                    continue
                changed = True
                seen[gi] = None
                self._check_group(g, gi)
                if all(_immutable(v) for k, v in dict.items(g) if k != "params"):
                    seen[gi] = (g, items)
        finally:
            if changed:
                stamp = tuple(seen.get(gi) for gi in range(len(groups)))
                self._group_stamp = None if None in stamp else stamp
                self._stamped = len(groups)

    def _new_buckets(self, groups: List[Dict[str, Any]], old: List[Bucket]) -> List[Bucket]:
        """Buckets for ``groups``, the first ``len(old)`` taking over the old buckets'
        buffers (groups are only ever appended), the others with new buffers.  Pure: the
        optimizer is not touched."""
        buckets = build_buckets(groups, _noise.MAX_BUCKETS)
        for b in buckets:
            if b.index < len(old):
                b.buffers = old[b.index].buffers
            else:
                b.buffers = {"mean": b.flat_params(),
                             **self._initial_buffers(b, groups[b.group_index])}
                # (flat buffers padded for the kernels: poco_kernels._layout.alloc_flat)
                b.buffers = {k: padded_copy(v) if b.is_flat_buffer(v) else v
                             for k, v in b.buffers.items()}
        return buckets

    def _expose(self, b: Bucket) -> None:
        """Per-parameter views of the flat buffers, as ``optimizer.state[p]``."""
        expose(self.state, b)

    @parking
    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a parameter group (``torch.optim`` semantics).  Refused, with the optimizer
        unchanged, while a sample is in the parameters or gradients are pending, or if the
        group is invalid.  A group added after a refresh steps as the base method (no
        correction) until the next refresh takes it in, as
        docs/design.md, 'Adding a parameter group' explains."""
        if isinstance(param_group, dict) and type(param_group) is not self._group_type:
            param_group = self._group_type(param_group)
        if not hasattr(self, "_buckets"):       # torch's constructor
            super().add_param_group(param_group)
            return
        if self._active is not None:
            raise RuntimeError("add_param_group() while a sample is in the parameters: call "
                               "restore() first")
        if any(self._pending.count.values()):
            raise RuntimeError("add_param_group() with gradients pending from "
                               "sample()/accumulate(): call step() or refresh() first")
        check(isinstance(param_group, dict), "add_param_group() takes a dict with 'params'")
        self._check_trainable()          # (the existing buckets follow requires_grad first)
        gi = len(self._groups)
        super().add_param_group(param_group)    # torch's checks; appends the group
        try:
            self._check_group(self._groups[gi], gi, new=True)
            buckets = self._new_buckets(self._groups, self._buckets)
            self._runner.check_buckets(buckets[len(self._buckets):])
        except BaseException:
            del self._groups[gi:]
            raise
        # ---- commit (nothing below raises on valid input)
        if not self._runner.params_hold_mean:
            self._runner.restore()          # (sample_ahead: the mean back, laid out anew)
        old = self._buckets
        self._buckets = buckets
        for b in buckets:
            self._expose(b)
        if self.rule.has_correction and self._refreshes > 0:
            self._awaiting.add(gi)
        self._runner.rebuilt(old)

    # ------------------------------------------------------------------ trainable set
    def _trainable_changed(self) -> bool:
        """A parameter's ``requires_grad`` changed since the buckets were laid out (one
        sweep over the parameters, in C, when every one is trainable)."""
        n = total = nb = 0
        for g in self._groups:
            params = dict.__getitem__(g, "params")
            n += _sweeps.trainable(params)
            total += len(params)
        for b in self._buckets:
            nb += len(b.params)
        if n != nb:
            return True
        return n != total and sum(_sweeps.trainable(b.params) for b in self._buckets) != nb

    def _check_trainable(self) -> None:
        """Follow the parameters' ``requires_grad`` (freezing or unfreezing layers between
        steps, as with torch.optim): the buckets are laid out again over the trainable
        parameters; a parameter keeps its state, a newly trainable one starts from the
        initial state (and, after a refresh, its group steps without correction until
        the next refresh takes it in: docs/design.md, 'torch.optim conventions').  The
        state dict and copies follow the new flags too."""
        if not self._trainable_changed():
            return
        if any(self._pending.count.values()):
            raise RuntimeError("a parameter's requires_grad changed while gradients are "
                               "pending: finish the step (or refresh) first")
        # (a fused backend settles what only the device knew, a momentum buffer made by a
        # step it skipped, before the buffers are laid out again)
        self._read_counters()
        for b in self._buckets:
            for name, buf in b.buffers.items():
                if not b.is_flat_buffer(buf):
                    raise RuntimeError(
                        f"a parameter's requires_grad changed since {type(self).__name__} "
                        f"was built: its state {name!r} couples the parameters of a "
                        "bucket, so it cannot follow; build the optimizer again over the "
                        "trainable parameters")
        old = self._buckets
        if self._active is None and not self._runner.params_hold_mean:
            self._runner.restore()          # (sample_ahead: the mean back, laid out anew)
        before = {id(p): self.state[p] for b in old for p in b.params}
        buckets = self._new_buckets(self._groups, [])      # fresh buffers, initial state
        self._runner.check_buckets(buckets)
        changed = set()
        with torch.no_grad():
            for b in buckets:
                for i, p in enumerate(b.params):
                    prev = before.get(id(p))
                    if prev is None:
                        changed.add(b.group_index)
                        continue
                    off, n = b.offsets[i], b.local(i).numel()
                    for name, v in prev.items():
                        if name not in b.buffers:           # (made at first use: SGD's)
                            b.buffers[name] = b.new_buffer()
                        b.buffers[name][off:off + n].copy_(v.reshape(-1))
        kept = {id(p) for b in buckets for p in b.params}
        for b in old:             # (a frozen one leaves: the others' outer state holds)
            for p in b.params:
                if id(p) not in kept:
                    self.state.pop(p, None)
        # ---- commit
        self._buckets = buckets
        for b in buckets:
            self._expose(b)
        if self.rule.has_correction and self._refreshes > 0:
            self._awaiting |= changed
        self._eps_cache.clear()
        self._runner.relayout()
