"""The base classes of the family: what every optimizer shares, and the sampling protocol.

* :class:`BucketedOptimizer`: flat buckets of parameters and state
  (:mod:`poco_kernels._layout`), the backend that runs them
  (:mod:`poco_kernels.backends`), the noise, the counters and the state dict.
  :class:`~poco_kernels.von_poco.VONPoCo` stands on this alone.
* :class:`PosteriorOptimizer`: the sampling protocol of the diagonal family --
  ``sample(kind)`` writes ``theta = centre + sigma * eps`` into the parameters,
  ``accumulate()`` folds ``.grad`` into the running estimate of that sample, ``restore()``
  puts the posterior mean back; ``step(closure)`` and ``refresh(closures)`` drive it.  The
  updates themselves are the backend's.

``eps`` comes from the counter-based stream of :mod:`poco_kernels.noise`, keyed by
``(seed, counter, bucket, kind, draw, element)``: nothing about noise is stored, and
ranks that share the seed draw the same sample.
"""
from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from typing import Any, Callable, Dict, FrozenSet, Iterable, List, Optional, Set, Tuple

import torch
from torch import Tensor

from . import backends as _backends
from . import noise as _noise
from .kernels import device_randn
from ._layout import Bucket, as_local, as_saved, build_buckets, expose, is_sharded, padded_copy
from ._protocol import (COUNTER_STEPS, KIND_INNER, KIND_NAMES, KIND_OUTER, KIND_REFRESH,
                        KernelRefresh, KernelStep, Pending, SampleSpec, mean_loss)
from ._validation import check, check_group_keys, hyperparameters, strict_keywords

#: layout of the ``poco`` entry of the state dict (absent before issue 17: read as 1)
STATE_FORMAT = 2


#: the arguments every optimizer takes, documented once (``{common_arguments}`` in a class
#: docstring is replaced by this)
COMMON_ARGUMENTS = """\
    * ``seed``: key of the counter-based noise stream, an int in ``[0, 2**63)``.  Default
      None: drawn from torch's global generator at construction, so ``torch.manual_seed``
      before building the optimizer fixes the noise and a seed sweep done the usual way
      varies it; an explicit ``seed`` wins.  The seed is in the state dict (a resumed run
      continues the same stream).  Ranks that share the seed draw the same posterior
      sample without communicating: under data parallelism give every rank the same
      global seed, or pass ``seed`` explicitly.  The stream's definition is
      ``opt.noise_version`` (2, four normals per Philox call); a state dict records it and
      loading one sets it, so a run resumed from a checkpoint written before version 2
      keeps drawing version 1 bit for bit (set ``opt.noise_version = 2`` after loading to
      move it to the cheaper stream).
    * ``backend``: ``"auto"`` (default: Triton for CUDA parameters, C++ for CPU ones, the
      torch backend otherwise), ``"torch"`` (the reference maths op for op, any device and
      dtype), ``"triton"`` or ``"cpp"`` (fused kernels; a clear error where they cannot
      run).  See docs/design.md, 'Backends'.
    * ``check_finite``: raise ``ValueError`` on a non-finite gradient, state unchanged
      (``True``), or skip such an update on the device and count it in
      ``skipped_updates`` (``False``).  Default ``None``: True on the torch and C++
      backends, False on Triton, where the check costs a device-to-host read per update.
    * ``grad_views``: on the fused backends, each sample hands the trainable parameters a
      ``.grad`` that is a view of a zeroed flat gradient buffer, so the backward pass
      accumulates straight into what the kernels read (no copy), and ``zero_grad()``
      zeroes those buffers in place, keeping the views (default True).  A ``.grad``
      replaced since (``p.grad = t``, ``zero_grad(set_to_none=True)``, a hook) still works:
      it is copied in once.  False: ``.grad`` is left to autograd and always copied in.
    * ``state_dtype``: ``None`` (default: float32 state; float64 for float64 parameters)
      or ``torch.bfloat16``: the optimizer's low-precision buffers (IVON: the momentum;
      IVON-PoCo(Mo): also ``g_out``, ``h_out``, ``m_out``, ``sigma_out``) are kept in
      bfloat16 and written with stochastic rounding (unbiased; bits from a counter-based
      hash, the same on every backend); the mean and ``h`` stay float32.  See
      docs/design.md, 'Low-precision state'.
"""


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


class BucketedOptimizer(torch.optim.Optimizer):
    """Buckets, backend, noise, counters and state dict.

    Subclasses define the hyperparameters (``_validate_group``) and the per-bucket buffers
    (``_init_buffers``); every constructor refuses unknown keywords, naming the closest
    valid one.
    """

    #: the optimizer has an outer loop (refresh) and a correction
    _has_correction: bool = True
    _warned_lightning: bool = False   # the one warning of _from_lightning (class default)
    #: appended to the error raised when an update would produce non-finite state
    _divergence_hint: str = "Lower the learning rate."
    #: per-parameter buffers created at their first use (not present before)
    _lazy_buffers: Tuple[str, ...] = ()
    #: the optimizer has fused kernels, Triton and C++ (``_kernel_step``/``_kernel_refresh``)
    _kernel_capable: bool = True
    #: the update needs Price Hessian estimates (accumulate grad * eps)
    uses_hessian: bool = True
    #: other classes whose state dicts this one loads as they are (the same state)
    _loads_from: Tuple[str, ...] = ()
    #: classes whose state dicts this one continues: their state is a subset of this
    #: one's; missing hyperparameters keep this optimizer's values, missing buffers start
    #: at their initial values (IVON -> IVON-PoCo)
    _continues_from: Tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        strict_keywords(cls)
        if cls.__doc__ and "{common_arguments}" in cls.__doc__:
            cls.__doc__ = cls.__doc__.replace("{common_arguments}", COMMON_ARGUMENTS.strip())

    #: the type of the parameter groups (a :class:`ParamGroup` where torch.optim names
    #: some hyperparameters differently)
    _group_type = dict

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        """torch.optim's parameter groups.  The optimizer's own code reads the same list
        as ``_groups``: torch.compile treats ``param_groups`` of an optimizer specially
        (it takes the groups for plain dicts, which :class:`ParamGroup` is not)."""
        return self._groups

    @param_groups.setter
    def param_groups(self, groups: List[Dict[str, Any]]) -> None:
        self._groups = groups

    def __init__(self, params, defaults: Dict[str, Any], *, seed: Optional[int] = None,
                 backend: str = "auto", check_finite: Optional[bool] = None,
                 grad_views: bool = True, sample_ahead: bool = False,
                 state_dtype: Optional[torch.dtype] = None):
        check(seed is None or (isinstance(seed, int) and not isinstance(seed, bool)
                               and 0 <= seed < 2 ** 63),
              f"seed must be None or an int in [0, 2**63), got {seed!r}")
        check(backend in _backends.NAMES, f"backend must be one of {_backends.NAMES}, got "
              f"{backend!r}")
        check(check_finite is None or isinstance(check_finite, bool),
              f"check_finite must be None or a bool, got {check_finite!r}")
        check(isinstance(grad_views, bool), f"grad_views must be a bool, got {grad_views!r}")
        #: fused backends: the parameters' ``.grad`` are views of the flat gradient buffers
        #: the kernels read (see ``zero_grad``); False: autograd's own tensors, copied in
        self.grad_views = grad_views
        check(isinstance(sample_ahead, bool),
              f"sample_ahead must be a bool, got {sample_ahead!r}")
        #: the step leaves the next step's inner sample in the parameters (IVON family)
        self.sample_ahead = sample_ahead
        if state_dtype == torch.float32:
            state_dtype = None
        check(state_dtype is None or state_dtype == torch.bfloat16,
              f"state_dtype must be None, torch.float32 or torch.bfloat16, got {state_dtype!r}")
        check(state_dtype is None or self._low_state_buffers,
              f"{type(self).__name__} has no state that state_dtype={state_dtype} applies to "
              "(it is for the IVON family's momentum and outer buffers)")
        #: dtype of the buffers named in ``_low_state_buffers`` (None: the state dtype)
        self.state_dtype = state_dtype
        super().__init__(params, self._group_type(defaults))
        for gi, g in enumerate(self._groups):
            self._check_group(g, gi, new=True)
        #: key of the noise stream: the argument, or drawn from torch's global generator
        #: (so ``torch.manual_seed`` governs it, as it governs a model's initialisation)
        self.seed = seed if seed is not None else draw_seed()
        self._noise_version = _noise.STREAM_VERSION      # (the property noise_version)
        #: as requested ("auto", None): a copy resolves them again (__getstate__)
        self._requested = (backend, check_finite)
        self._buckets: List[Bucket] = self._new_buckets(self._groups, [])
        for b in self._buckets:
            self._expose(b)
        #: the name of the backend that runs (``backend="auto"`` resolved)
        self.backend = _backends.resolve(backend, self)
        # global counters (in the state dict), advanced only by updates taken.  A fused
        # backend without check_finite decides on the device whether a step is taken: its
        # control tensor holds the count, read into _step when the counters are read.
        self._step = 0            # inner steps taken
        self._refreshes = 0       # refreshes taken (known on the host on every backend)
        #: groups added while the correction was active: they step as the base method
        #: until the next refresh takes them in
        self._awaiting: Set[int] = set()
        self._pending = Pending()
        self._active: Optional[Tuple[int, int]] = None   # (kind, draw) of the sample in params
        #: (step) the parameters held the next sample when the call began (sample_ahead)
        self._was_ahead = False
        self._eps_cache: Dict[int, Tuple[Tuple[int, ...], Tensor]] = {}
        self._backend = _backends.create(self.backend, self)
        #: raise on non-finite gradients (the triton backend then reads one flag from the
        #: device per update; without it a bad update is skipped on the device and counted
        #: in ``skipped_updates``).  Default: True for 'torch' and 'cpp' (where reading the
        #: flag is free), False for 'triton'.
        self.check_finite = (self._backend.check_finite_default if check_finite is None
                             else check_finite)

    # ------------------------------------------------------------------ construction
    def _validate_group(self, group: Dict[str, Any]) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _init_buffers(self, bucket: Bucket, group: Dict[str, Any]) -> Dict[str, Tensor]:
        raise NotImplementedError

    #: the buffers that ``state_dtype`` stores in low precision (stochastic rounding)
    _low_state_buffers: Tuple[str, ...] = ()

    def _initial_buffers(self, b: Bucket, group: Dict[str, Any]) -> Dict[str, Tensor]:
        """``_init_buffers``, the ``_low_state_buffers`` in ``state_dtype``."""
        bufs = self._init_buffers(b, group)
        if self.state_dtype is not None:
            for name in self._low_state_buffers:
                if name in bufs:
                    bufs[name] = bufs[name].to(self.state_dtype)
        return bufs

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
        for gi, g in enumerate(self._groups):
            self._check_group(g, gi)

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
            self._backend.check_buckets(buckets[len(self._buckets):])
        except BaseException:
            del self._groups[gi:]
            raise
        # ---- commit (nothing below raises on valid input)
        if not self._backend.params_hold_mean:
            self._backend.restore()          # (sample_ahead: the mean back, laid out anew)
        old = self._buckets
        self._buckets = buckets
        for b in buckets:
            self._expose(b)
        if self._has_correction and self._refreshes > 0:
            self._awaiting.add(gi)
        self._backend.rebuilt(old)

    # ------------------------------------------------------------------ trainable set
    def _trainable_changed(self) -> bool:
        """A parameter's ``requires_grad`` changed since the buckets were laid out."""
        n = 0
        for g in self._groups:
            for p in g["params"]:
                if p.requires_grad:
                    n += 1
        return n != sum(len(b.params) for b in self._buckets) or not all(
            p.requires_grad for b in self._buckets for p in b.params)

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
        if self._active is None and not self._backend.params_hold_mean:
            self._backend.restore()          # (sample_ahead: the mean back, laid out anew)
        before = {id(p): self.state[p] for b in old for p in b.params}
        buckets = self._new_buckets(self._groups, [])      # fresh buffers, initial state
        self._backend.check_buckets(buckets)
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
        if self._has_correction and self._refreshes > 0:
            self._awaiting |= changed
        self._eps_cache.clear()
        self._backend.relayout()

    # ------------------------------------------------------------------ copy and pickle
    #: the attributes that __setstate__ rebuilds (the other public ones are copied)
    _REBUILT = frozenset({"defaults", "state", "param_groups", "seed", "backend", "check_finite",
                          "grad_views", "sample_ahead", "state_dtype", "noise_version"})

    def __getstate__(self) -> Dict[str, Any]:
        """``copy.deepcopy`` and pickle: the parameter groups (with the parameters), the
        constructor's configuration and the state dict; :meth:`__setstate__` builds the
        optimizer again from them (buckets, backend, flat buffers: the copy's parameters
        become views of its own buffers) and loads the state dict, so the copy continues
        as the original would.  Hooks are not copied (as in ``torch.optim``); refused
        while a sample is in the parameters."""
        if self._active is not None:
            raise RuntimeError("copying or pickling the optimizer while a sample is in the "
                               "parameters: call restore() first")
        # the state dict without the user's state_dict hooks (a copy is not a checkpoint)
        hooks = (self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks)
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        try:
            sd = self.state_dict()
        finally:
            self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks = hooks
        backend, check_finite = self._requested
        if self.check_finite != (self._backend.check_finite_default if check_finite is None
                                 else check_finite):
            check_finite = self.check_finite        # set by hand since
        return {"poco_copy": 1, "param_groups": self.param_groups, "defaults": self.defaults,
                "seed": self.seed, "backend": backend, "check_finite": check_finite,
                "grad_views": self.grad_views, "sample_ahead": self.sample_ahead,
                "state_dtype": self.state_dtype,
                "ahead": not self._backend.params_hold_mean, "state_dict": sd, "skipped": self._read_counters()[2],
                "attributes": {k: v for k, v in self.__dict__.items()
                               if not k.startswith("_") and k not in self._REBUILT}}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        if "poco_copy" not in state:            # torch.optim's layout: nothing to rebuild from
            super().__setstate__(state)
            return
        groups = state["param_groups"]
        values = [p.detach().clone() for g in groups for p in g["params"]]
        # the hyperparameters only: the state dict brings back every key of the groups
        bare = [{"params": g["params"], **{k: g[k] for k in state["defaults"] if k in g}}
                for g in groups]
        BucketedOptimizer.__init__(self, bare, state["defaults"], seed=state["seed"],
                                   backend=state["backend"], check_finite=state["check_finite"],
                                   grad_views=state.get("grad_views", True),
                                   sample_ahead=state.get("sample_ahead", False),
                                   state_dtype=state.get("state_dtype"))
        self._plan_load(state["state_dict"])()
        with torch.no_grad():                   # the parameters as they were (the truth)
            for p, v in zip((p for g in self.param_groups for p in g["params"]), values):
                p.copy_(v)
        self._backend.set_skipped(state["skipped"])
        self.__dict__.update(state["attributes"])
        if state.get("ahead"):   # the original's parameters held its next sample: so do these
            self._backend.restore()
            self._backend.prefetch()

    # ------------------------------------------------------------------ noise
    @property
    def noise_version(self) -> int:
        """The noise stream definition this optimizer draws (:mod:`poco_kernels.noise`):
        ``noise.STREAM_VERSION`` (2) when built, that of a loaded state dict after
        ``load_state_dict``, so a resumed run continues its own noise.  Settable (1 or 2),
        outside a sample and with no gradients pending (their noise is drawn again by the
        step or refresh, under the version they were sampled with); a sample the step left in the parameters (``sample_ahead``) is
        drawn again under the new version before the next step uses it."""
        return self._noise_version

    @noise_version.setter
    def noise_version(self, version: int) -> None:
        check(type(version) is int and version in _noise.STREAM_VERSIONS,
              f"noise_version must be one of {_noise.STREAM_VERSIONS}, got {version!r}")
        if version == self._noise_version:
            return
        if self._active is not None:
            raise RuntimeError("noise_version changed while a sample is in the parameters: "
                               "call restore() first")
        if any(self._pending.count.values()):   # their noise must be drawn again as sampled
            raise RuntimeError("noise_version changed with gradients pending from "
                               "sample()/accumulate(): call step() or refresh() first")
        self._noise_version = version
        self._eps_cache.clear()

    def _eps(self, b: Bucket, kind: int, draw: int, counter: int) -> Tensor:
        """The standard normal of (bucket, kind, draw, counter) (on a GPU drawn by the
        kernels' generator: :func:`poco_kernels.kernels.device_randn`).  The last one drawn
        per bucket is kept: the outer sample with shared noise, and VSGD-PoCo's refresh
        fold, ask again for the draw just made (regenerating costs ~100 integer
        ops/element)."""
        key = (self.seed, self._noise_version, kind, draw, counter)
        hit = self._eps_cache.get(b.index)
        if hit is not None and hit[0] == key:
            return hit[1]
        stream = _noise.stream_id(b.index, kind, draw)
        if b.segments is None:
            eps = device_randn(b.numel, self.seed, counter, stream, device=b.device,
                               dtype=b.dtype, version=self.noise_version)
        else:           # local shards: the noise of their places in the unsharded bucket
            eps = torch.empty(b.numel, device=b.device, dtype=b.dtype)
            for off, n, start in b.segments:
                device_randn(n, self.seed, counter, stream, offset=start, device=b.device,
                             dtype=b.dtype, out=eps[off:off + n], version=self.noise_version)
        self._eps_cache[b.index] = (key, eps)
        return eps

    def _rounding_bits(self, b: Bucket, name: str, counter: int) -> Tensor:
        """The stochastic-rounding bits of low-precision buffer ``name`` of ``b`` at
        ``counter`` (``state_dtype``); a shard's are those of its places in the
        unsharded bucket, as its noise."""
        tag = _noise.ROUND_TAGS[name]
        if b.segments is None:
            return _noise.rounding_bits(self.seed, counter, b.index, tag, b.numel, b.device)
        bits = torch.empty(b.numel, dtype=torch.int64, device=b.device)
        for off, n, start in b.segments:
            bits[off:off + n] = _noise.rounding_bits(self.seed, counter, b.index, tag, n,
                                                     b.device, offset=start)
        return bits

    def _counter(self, slot: int) -> int:
        """The noise counter of a slot: steps taken (``COUNTER_STEPS``) or refreshes
        taken (``COUNTER_REFRESHES``)."""
        return self._step if slot == COUNTER_STEPS else self._refreshes

    def _corrected(self) -> FrozenSet[int]:
        """The buckets whose step uses the correction: after the first refresh, those of
        every group a refresh has taken in; none while ``alpha == 0`` in all of those."""
        if not (self._has_correction and self._refreshes > 0):
            return frozenset()
        if not any(_maybe_nonzero(g.get("alpha", 0.0)) for gi, g in enumerate(self._groups)
                   if gi not in self._awaiting):
            return frozenset()
        return frozenset(b.index for b in self._buckets if b.group_index not in self._awaiting)

    def correction_active(self) -> bool:
        """True when a step needs the gradient at the outer sample too: after the first
        refresh, with a nonzero ``alpha`` in some group that a refresh has taken in."""
        return bool(self._corrected())

    def _correction_settled(self) -> bool:
        """A refresh has been taken and no group waits for its first: which buckets the
        correction covers no longer depends on whether the next refresh is taken."""
        return self._refreshes > 0 and not self._awaiting

    def _joining(self, b: Bucket) -> bool:
        """The bucket's group was added after the last refresh: its next refresh is its
        first (the outer estimates are set, not folded with outer momentum)."""
        return b.group_index in self._awaiting

    def _first_refresh(self, b: Bucket) -> bool:
        return self._refreshes == 0 or self._joining(b)

    def _spec(self, b: Bucket, kind: int, draw: int) -> SampleSpec:
        """Where a sample of ``kind`` lies for bucket ``b`` (what the backends follow): the
        family's rule (``_sample_spec``), except that the outer sample of a group not yet
        taken in by a refresh is its mean (its gradient there is not used)."""
        if kind == KIND_OUTER and self._joining(b):
            return SampleSpec(b.buffers["mean"])
        return self._sample_spec(b, self._groups[b.group_index], kind, draw)

    def _group(self, b: Bucket, keep_tensors: bool = False) -> Dict[str, Any]:
        """Bucket ``b``'s hyperparameters for an update (a tensor ``lr`` or ``alpha`` read
        as a float, or kept: ``keep_tensors``, the fused backends)."""
        return hyperparameters(self._groups[b.group_index], keep_tensors)

    def _refresh_taken(self) -> None:
        self._refreshes += 1
        self._awaiting.clear()

    def _sync_mean(self) -> None:
        """Parameters of the state dtype are the source of truth for the mean (as in
        ``torch.optim``); low-precision ones keep a float32 master copy in the state."""
        if self._active is None:
            self._backend.sync_mean()

    # ------------------------------------------------------------------ state dict
    @torch._disable_dynamo
    def state_dict(self) -> Dict[str, Any]:
        """``torch.optim``'s state dict (``state`` keyed by parameter index, ``param_groups``)
        plus a ``poco`` entry: counters, seed, pending sums, per-bucket buffers.  Runs the
        hooks of ``register_state_dict_pre_hook``/``post_hook`` (a post hook sees, and may
        replace, the whole dict)."""
        if self._active is not None:
            raise RuntimeError("state_dict() while a sample is in the parameters: call restore() first")
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        self._check_trainable()           # (the layout of the current requires_grad flags)
        self._sync_mean()                 # the parameters are the truth (fused: re-linked)
        self._backend.prepare_state_dict()
        self._read_counters()
        sd = self._packed_state()
        extra = {}
        for b in self._buckets:       # buffers that are not per-parameter (VON-PoCo's S)
            for name, buf in b.buffers.items():
                if not b.is_flat_buffer(buf):
                    extra[f"{b.index}/{name}"] = buf
        meta = {"format": STATE_FORMAT, "noise": self.noise_version, "step": self._step,
                "refreshes": self._refreshes, "seed": self.seed,
                "optimizer": type(self).__name__, "awaiting_refresh": sorted(self._awaiting)}
        sd["poco"] = {**meta, "pending": self._pending.to_dict(), "bucket_buffers": extra}
        # torch.distributed.checkpoint keeps only 'state' and 'param_groups': each group
        # carries the counters too, and whether gradients were pending or a sample drawn
        # since the last update (what it drops)
        pending = any(self._pending.count.values()) or any(self._pending.draws.values())
        for g in sd["param_groups"]:
            g["poco"] = {**meta, "pending_gradients": pending}
        params = [p for g in self._groups for p in g["params"]]
        for i, p in enumerate(params):                # sharded: DTensors, as p is
            if is_sharded(p) and isinstance(sd["state"].get(i), dict):
                sd["state"][i] = {k: as_saved(v, p) for k, v in sd["state"][i].items()}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def _packed_state(self) -> Dict[str, Any]:
        """torch.optim's layout: parameters replaced by their index over all groups."""
        index: Dict[int, int] = {}
        groups = []
        for g in self._groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            for p in g["params"]:
                index.setdefault(id(p), len(index))
            packed["params"] = [index[id(p)] for p in g["params"]]
            groups.append(packed)
        state = {(index[id(k)] if isinstance(k, Tensor) else k): v  # (a hook's own keys)
                 for k, v in self.state.items()}
        return {"state": state, "param_groups": groups}

    @torch._disable_dynamo
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state dict of the same optimizer class over the same parameters (or one
        this class can continue: :meth:`_loadable_from`).  The hooks of
        ``register_load_state_dict_pre_hook`` run first (on a shallow copy; one may return
        a replacement) and ``post_hook`` last; the whole dict is validated (keys, types,
        ranges, shapes, dtypes, finiteness, format and noise versions) before anything
        changes."""
        if self._active is not None:
            raise RuntimeError("load_state_dict() while a sample is in the parameters: call "
                               "restore() first")
        if isinstance(state_dict, dict):
            state_dict = state_dict.copy()      # shallow, as torch.optim
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._backend.check_layout()      # (fused: re-links parameters taken off its buffers)
        self._check_trainable()
        commit = self._plan_load(state_dict)
        commit()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _plan_load(self, sd: Dict[str, Any]) -> Callable[[], None]:
        """Validate ``sd`` and return the function that commits it (which cannot fail)."""
        def is_int(v, lo, hi):
            return isinstance(v, int) and not isinstance(v, bool) and lo <= v < hi

        check(isinstance(sd, dict) and {"state", "param_groups"} <= set(sd),
              "not a poco_kernels optimizer state dict (missing 'state' or 'param_groups')")
        saved_state, saved_groups = sd["state"], sd["param_groups"]
        poco = sd["poco"] if "poco" in sd else self._poco_of_groups(saved_groups)
        check(isinstance(poco, dict), "state dict: 'poco' is not a dict")
        check(isinstance(saved_state, dict), "state dict: 'state' is not a dict")
        check(isinstance(saved_groups, (list, tuple)), "state dict: 'param_groups' is not a list")
        missing = [k for k in ("optimizer", "step", "refreshes", "seed", "pending")
                   if k not in poco]
        check(not missing, f"state dict: 'poco' lacks {', '.join(map(repr, missing))}")
        src = poco["optimizer"]
        fill = src in self._continues_from     # a subset of this class's state
        check(src == type(self).__name__ or src in self._loads_from or fill,
              f"state dict is for {src!r}, not {type(self).__name__!r}"
              + (f" (it loads those of {', '.join(self._loads_from + self._continues_from)})"
                 if self._loads_from or self._continues_from else ""))
        fmt = poco.get("format", 1)
        check(is_int(fmt, 1, STATE_FORMAT + 1),
              f"state dict format {fmt!r} is not one this version reads (1..{STATE_FORMAT})")
        nv = poco.get("noise", 1)       # (written before the key existed: version 1)
        check(type(nv) is int and nv in _noise.STREAM_VERSIONS,
              f"state dict was written with noise stream version {nv!r}; this version of "
              f"poco_kernels draws versions {_noise.STREAM_VERSIONS} (the run would continue "
              "with other samples than it was drawing)")
        for key in ("step", "refreshes"):
            check(is_int(poco[key], 0, _noise.MAX_COUNTER),
                  f"state dict: {key} must be an int in [0, 2**32), got {poco[key]!r}")
        check(not fill or poco["refreshes"] == 0,
              f"state dict: an {src} state dict has no refreshes, got {poco['refreshes']!r}")
        check(is_int(poco["seed"], 0, 2 ** 63),
              f"state dict: seed must be an int in [0, 2**63), got {poco['seed']!r}")
        groups = self._groups
        check(len(groups) == len(saved_groups),
              f"state dict has {len(saved_groups)} parameter groups, the optimizer {len(groups)}")
        awaiting = poco.get("awaiting_refresh", [])
        check(isinstance(awaiting, (list, tuple, set))
              and all(is_int(i, 0, len(groups)) for i in awaiting),
              f"state dict: awaiting_refresh must list group indices, got {awaiting!r}")
        check(not awaiting or poco["refreshes"] > 0,
              "state dict: groups awaiting a refresh before any refresh")
        # ---- groups
        saved_index, seen, new_groups = {}, set(), []
        for gi, (g, sg) in enumerate(zip(groups, saved_groups)):
            check(isinstance(sg, dict) and isinstance(sg.get("params"), (list, tuple)),
                  f"state dict: param group {gi} is not a dict with a 'params' list")
            check(len(g["params"]) == len(sg["params"]),
                  f"param group {gi}: state dict has {len(sg['params'])} parameters, the "
                  f"optimizer {len(g['params'])}")
            for i, p in zip(sg["params"], g["params"]):
                # (ints; names where torch.distributed.checkpoint's set_state_dict loads)
                check(isinstance(i, (int, str)) and not isinstance(i, bool) and i not in seen,
                      f"param group {gi}: parameter ids must be distinct ints or names, got "
                      f"{i!r}")
                seen.add(i)
                saved_index[id(p)] = i
            # (from a class with fewer hyperparameters, this optimizer's values stay)
            sg = {k: v for k, v in sg.items() if k != "poco"}      # (the counters' copy)
            merged = {**(g if fill else {}), **sg, "params": g["params"]}
            self._check_group(merged, gi)
            new_groups.append({k: v for k, v in merged.items() if k != "params"})
        # ---- per-parameter buffers: names, shapes, dtypes, values
        copies, lazy, drop, fresh = [], {}, set(), []

        def tensor_for(t, like: Tensor, what: str) -> Tensor:
            check(isinstance(t, Tensor), f"{what} is not a tensor")
            check(tuple(t.shape) == tuple(like.shape),
                  f"{what} has shape {tuple(t.shape)}, expected {tuple(like.shape)}")
            check(t.is_floating_point(), f"{what} has dtype {t.dtype}, expected a float dtype")
            check(bool(torch.isfinite(t).all()), f"{what} holds non-finite values")
            out = t.detach().to(device=like.device, dtype=like.dtype, copy=True)
            check(bool(torch.isfinite(out).all()),
                  f"{what} overflows {like.dtype} (its state dtype)")
            return out

        for b in self._buckets:
            group = new_groups[b.group_index]
            saved_of = []
            for p in b.params:
                idx = saved_index[id(p)]
                saved = saved_state.get(idx)
                check(saved is not None, f"state dict has no state for parameter {idx}")
                check(isinstance(saved, dict), f"parameter {idx}: state is not a dict")
                for name in saved:
                    check(name in b.buffers or name in self._lazy_buffers,
                          f"parameter {idx}: unexpected state {name!r} in the state dict")
                saved_of.append((idx, saved))
            # a buffer made at its first use (momentum) is saved for all of a bucket or none
            for name in self._lazy_buffers:
                have = [name in saved for _, saved in saved_of]
                if any(have) and not all(have):
                    idx = saved_of[have.index(False)][0]
                    raise ValueError(f"parameter {idx}: state dict lacks {name!r} (other "
                                     "parameters of its group have it)")
                if all(have) and have and name not in b.buffers:
                    lazy.setdefault(b.index, set()).add(name)
                elif not any(have) and name in b.buffers:
                    drop.add((b.index, name))     # saved before its first use
            if fill:        # buffers the source class lacks start at their initial values
                init = self._initial_buffers(b, group)
                names = [n for n in init if b.is_flat_buffer(b.buffers.get(n, init[n]))
                         and not any(n in saved for _, saved in saved_of)]
                fresh += [(b.index, n, init[n]) for n in names]
            for i, (p, (idx, saved)) in enumerate(zip(b.params, saved_of)):
                views = self.state[p]
                for name in b.buffers:
                    if fill and any(f[:2] == (b.index, name) for f in fresh):
                        continue
                    if b.is_flat_buffer(b.buffers[name]) and (b.index, name) not in drop:
                        check(name in saved, f"parameter {idx}: state dict lacks {name!r}")
                for name, t in saved.items():
                    like = views.get(name)
                    if like is None:
                        like = torch.empty(b.local(i).shape, device=b.device, dtype=b.dtype)
                    what = f"parameter {idx}: {name!r}"
                    t = tensor_for(as_local(t, p, what), like, what)
                    self._check_state_value(name, t, group, what)
                    copies.append((b.index, p, name, t))
        extra = poco.get("bucket_buffers", {})
        check(isinstance(extra, dict), "state dict: 'bucket_buffers' is not a dict")
        bucket_copies = []
        for b in self._buckets:
            for name, buf in b.buffers.items():
                if not b.is_flat_buffer(buf):
                    key = f"{b.index}/{name}"
                    check(key in extra, f"state dict lacks bucket buffer {key!r} of shape "
                                        f"{tuple(buf.shape)}")
                    bucket_copies.append((buf, tensor_for(extra[key], buf,
                                                          f"bucket buffer {key!r}")))
        pend = Pending.validated(poco["pending"], self._buckets)
        self._check_pending(pend, set(awaiting))
        # ---- the commit: nothing below can fail
        step, refreshes, seed = poco["step"], poco["refreshes"], poco["seed"]

        def commit() -> None:
            for bi, name in drop:
                self._buckets[bi].buffers.pop(name, None)
            for bi, names in lazy.items():
                b = self._buckets[bi]
                for name in names:
                    if name not in b.buffers:
                        b.buffers[name] = b.new_buffer()
            for b in self._buckets:
                self._expose(b)
            with torch.no_grad():
                for bi, name, init in fresh:
                    self._buckets[bi].buffers[name].copy_(init)
                for bi, p, name, src in copies:
                    self.state[p][name].copy_(src)
                for dst, src in bucket_copies:
                    dst.copy_(src)
            for g, sg in zip(groups, new_groups):
                for k in [k for k in g if k != "params" and k not in sg]:
                    del g[k]
                g.update(sg)
            self._step, self._refreshes, self.seed = step, refreshes, seed
            self._noise_version = nv
            self._awaiting = set(awaiting)
            self._pending = pend
            self._eps_cache.clear()
            for b in self._buckets:
                b.write_params(b.buffers["mean"])
            self._backend.loaded()
        return commit

    def _poco_of_groups(self, groups) -> Dict[str, Any]:
        """The ``poco`` entry of a state dict that lost it (``torch.distributed.checkpoint``
        keeps only 'state' and 'param_groups'), from the copy of the counters every group
        carries; refused where that dict would have carried more (pending gradients, a
        bucket's dense buffers), so nothing is dropped without a word."""
        metas = [g.get("poco") if isinstance(g, dict) else None for g in groups]
        check(bool(metas) and all(isinstance(m, dict) for m in metas),
              "not a poco_kernels optimizer state dict (no 'poco' entry, and its param "
              "groups carry no copy of it; torch.distributed.checkpoint's "
              "flatten_optimizer_state_dict=True rebuilds the groups without it: use the "
              "default, False)")
        check(all(m == metas[0] for m in metas),
              "state dict: the param groups carry different 'poco' counters")
        meta = metas[0]
        check(not meta.get("pending_gradients"),
              "state dict was taken with gradients pending or a sample drawn (after "
              "sample()/accumulate(), before step() or refresh()) and lost them on the way "
              "(it has no 'poco' entry: torch.distributed.checkpoint keeps only 'state' and "
              "'param_groups'): take it between updates")
        dense = [f"{b.index}/{n}" for b in self._buckets for n, buf in b.buffers.items()
                 if not b.is_flat_buffer(buf)]
        check(not dense, f"state dict has no 'poco' entry, which holds {type(self).__name__}'s "
                         f"dense buffers ({', '.join(dense)}): save the whole state dict")
        return {**{k: v for k, v in meta.items() if k != "pending_gradients"},
                "pending": {"count": {}, "draws": {}, "sums": {}}, "bucket_buffers": {}}

    def _check_state_value(self, name: str, t: Tensor, group: Dict[str, Any],
                           what: str) -> None:
        """Refuse a loaded state tensor outside its domain (a subclass's rule, e.g. IVON's
        ``h + weight_decay > 0``); ``group``: the loaded hyperparameters."""

    def _check_pending(self, pend: Pending, awaiting: Set[int]) -> None:
        """Refuse loaded pending sums that the next update could not use."""
        check(not any(pend.count.values()), "state dict: pending gradients for an optimizer "
                                            "without the sampling protocol")

    # ------------------------------------------------------------------ counters
    def _read_counters(self) -> Tuple[int, int, int]:
        """(steps, refreshes, skipped updates) as the backend holds them (fused: read
        from the device); the host's counts are brought up to date."""
        self._step, self._refreshes, skipped = self._backend.counters()
        return self._step, self._refreshes, skipped

    @property
    def step_count(self) -> int:
        """Number of inner steps taken (fused backends: read from the device)."""
        return self._read_counters()[0]

    @property
    def refresh_count(self) -> int:
        """Number of refreshes of the outer estimate taken."""
        return self._read_counters()[1]

    @property
    def skipped_updates(self) -> int:
        """Updates skipped on the device (AMP overflow, or non-finite gradients without
        ``check_finite``) since the optimizer was built or loaded; fused backends only
        (the torch backend skips AMP overflows and raises on non-finite gradients)."""
        return self._read_counters()[2]

    @torch._disable_dynamo
    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Reset the gradients.  ``.grad`` that are views of the fused backends' flat
        gradient buffers (``grad_views``) are zeroed in place and stay views (one memset
        per bucket, none when the buffer is known to hold zeros); the others are set to
        None, as ``torch.optim`` does.  ``set_to_none=True``: every ``.grad`` to None
        (the next backward's gradients are then copied into the buffers once);
        ``False``: every ``.grad`` zeroed in place."""
        done = self._backend.zero_grads() if set_to_none is not True else set()
        with torch.no_grad():
            for group in self._groups:
                for p in group["params"]:
                    if p.grad is None or id(p) in done:
                        continue
                    if set_to_none is False:
                        if p.grad.grad_fn is not None:
                            p.grad.detach_()
                        else:
                            p.grad.requires_grad_(False)
                        p.grad.zero_()
                    else:
                        p.grad = None

    def flat_state(self, name: str) -> List[Tensor]:
        """The flat buffer ``name`` of every bucket (read-only use, for tests and tools)."""
        return [b.buffers[name] for b in self._buckets]


class PosteriorOptimizer(BucketedOptimizer):
    """The sampling protocol (``sample``/``accumulate``/``restore``, ``sampled``) and the
    closure-driven ``step``/``refresh`` of the diagonal family.

    Subclasses define, besides the hyperparameters and buffers: where samples are centred
    and how wide they are (``_sample_spec``), whether Hessian estimates are needed
    (``uses_hessian``), the two updates in the reference maths (``_inner_update``,
    ``_refresh_update``: the torch backend) and as kernel records (``_kernel_step``,
    ``_kernel_refresh``: the fused backends).
    """

    #: the optimizer perturbs parameters (needs a sample before each gradient)
    noisy: bool = True

    # ------------------------------------------------------------------ the family's rules
    def _sample_spec(self, b: Bucket, group: Dict[str, Any], kind: int, draw: int) -> SampleSpec:
        """Where a sample of ``kind`` (draw ``draw``) is centred, how wide it is, and which
        noise it uses: the one statement that every backend follows."""
        raise NotImplementedError

    def _inner_update(self, b: Bucket, group: Dict[str, Any], g_in: Tensor,
                      ge_in: Optional[Tensor], outer, t: int) -> Dict[str, Tensor]:
        """The new buffers of an inner step (reference maths, out of place)."""
        raise NotImplementedError

    def _refresh_update(self, b: Bucket, group: Dict[str, Any], gM: Tensor,
                        geM: Optional[Tensor], first: bool) -> Dict[str, Tensor]:
        """The new buffers of a refresh (reference maths, out of place)."""
        raise NotImplementedError

    def _kernel_step(self, b: Bucket, group: Dict[str, Any]) -> KernelStep:
        """The step kernel's buffers and records for a bucket (the same maths as
        ``_inner_update``)."""
        raise NotImplementedError

    def _kernel_refresh(self, b: Bucket, group: Dict[str, Any]) -> KernelRefresh:
        """The refresh kernel's buffers and record for a bucket (``_refresh_update``)."""
        raise NotImplementedError

    def _check_pending(self, pend: Pending, awaiting: Set[int]) -> None:
        """Every noisy kind's sums carry their ``gradient * eps`` sum (the state dict has
        the torch backend's layout), where the family estimates Hessians."""
        if not self.uses_hessian:
            return
        for (k, bi, n) in list(pend.sums):
            if n != "g":
                continue
            b = self._buckets[bi]
            if k == KIND_OUTER and b.group_index in awaiting:
                continue
            noisy = self._sample_spec(b, self._groups[b.group_index], k, 0).noise
            check(noisy is None or (k, bi, "ge") in pend.sums,
                  f"state dict's pending gradients: sample kind {k}, bucket {bi} has a "
                  "gradient sum but not its gradient * eps sum")

    # ------------------------------------------------------------------ low-level API
    # torch.compile: the protocol's bookkeeping (``self._active``, the counters) runs
    # outside Dynamo (``torch._disable_dynamo``: a graph break around sample, restore,
    # step and refresh).  Dynamo does not write back attributes assigned on a
    # torch.optim.Optimizer while it traces (it wraps the optimizer without tracking its
    # mutations), so a traced sample() would leave no active sample behind it.
    @torch._disable_dynamo
    def sample(self, kind: str = "inner") -> None:
        """Write a posterior sample into the parameters.

        ``kind``: ``"inner"`` (the current posterior, once per Monte-Carlo sample of a
        step), ``"outer"`` (the outer posterior of the correction, same mini-batch) or
        ``"refresh"`` (the current posterior, ONE sample for the whole mega-batch).
        Follow with any number of backward passes, then :meth:`accumulate` (once per
        chunk) and :meth:`restore`.
        """
        self._sample(kind, trainable_checked=False)

    def _sample(self, kind: str, trainable_checked: bool) -> None:
        """:meth:`sample` (``trainable_checked``: step/refresh followed ``requires_grad``
        already, the closures cannot change it unnoticed: accumulate sees their grads)."""
        check(kind in KIND_NAMES, f"kind must be one of {tuple(KIND_NAMES)}, got {kind!r}")
        if self._active is not None:
            raise RuntimeError("a sample is already in the parameters: call restore() first")
        k = KIND_NAMES[kind]
        if k == KIND_REFRESH and not self._has_correction:
            raise RuntimeError(f"{type(self).__name__} has no outer loop: no refresh sample")
        self._check_no_mix(k)
        if not trainable_checked:
            self._check_trainable()
        if k == KIND_OUTER and not self.correction_active():
            raise RuntimeError("no outer sample: the correction is not active "
                               "(no refresh yet, or alpha == 0 in every group)")
        draw = self._pending.draws[k]
        check(draw < _noise.MAX_DRAWS, f"at most {_noise.MAX_DRAWS} samples of one kind per "
                                       "step: call step() or refresh()")
        try:
            self._backend.sample(k, draw)
        except BaseException:
            self._backend.restore()
            raise
        self._active = (k, draw)
        self._pending.draws[k] = draw + 1

    def _check_no_mix(self, k: int) -> None:
        """Gradients for a step and for a refresh are not collected at the same time (each
        update consumes its own; a non-finite one must not refuse the other)."""
        cnt = self._pending.count
        if k == KIND_REFRESH and (cnt[KIND_INNER] or cnt[KIND_OUTER]):
            raise RuntimeError("gradients for a step are pending: call step() before "
                               "collecting refresh gradients")
        if k != KIND_REFRESH and cnt[KIND_REFRESH]:
            raise RuntimeError("refresh gradients are pending: call refresh() before "
                               "collecting gradients for a step")

    def accumulate(self, clear_grads: bool = True) -> None:
        """Fold the parameters' ``.grad`` into the estimate of the active sample and clear
        ``.grad`` (so the next sample starts from zero).  Call once per sample (Monte Carlo)
        or once per chunk of a mega-batch."""
        if self._active is None:
            raise RuntimeError("accumulate() needs an active sample: call sample() first")
        k, draw = self._active
        missing = frozenset({(b.index, i) for b in self._buckets
                             for i, p in enumerate(b.params) if p.grad is None}
                            | self._backend.unwritten())
        self._backend.accumulate(k, draw, lend=clear_grads)
        self._pending.note_grads(k, missing)
        self._pending.count[k] += 1
        if clear_grads:
            for group in self._groups:
                for p in group["params"]:
                    p.grad = None

    @torch._disable_dynamo
    def restore(self) -> None:
        """Put the posterior mean back into the parameters (ends the active sample)."""
        self._backend.restore()
        self._active = None

    @contextlib.contextmanager
    def sampled(self, kind: str = "inner", accumulate: bool = True):
        """``with opt.sampled(kind): loss.backward()`` = sample, (backward), accumulate,
        restore.  On an exception the mean is restored and, unless the block accumulated
        itself, the sample is forgotten, and with it the gradients the block left in
        ``.grad``: the next draws and gradients are those of an optimizer that never
        entered the block."""
        self.sample(kind)
        k, draw = self._active
        count = self._pending.count[k]
        grads = self._grads_now()
        ok = False
        try:
            yield self
            if accumulate:
                self.accumulate()
            ok = True
        finally:
            self.restore()
            if not ok and self._pending.count[k] == count:
                self._pending.draws[k] = draw
                self._put_back_grads(grads)

    @torch._disable_dynamo
    def _grads_now(self) -> List[Tuple[Tensor, Optional[Tensor], int]]:
        """Every parameter's ``.grad`` and its version counter (no copy), for
        :meth:`_put_back_grads`."""
        out = []
        for group in self._groups:
            for p in group["params"]:
                g = p.grad
                out.append((p, g, 0 if g is None else g._version))
        return out

    @torch._disable_dynamo
    def _put_back_grads(self, saved) -> None:
        """Drop the gradients a failed ``sampled()`` block left in ``.grad``: a ``.grad``
        that was None is None again, one that was replaced is put back, and one the
        backward accumulated into in place (a zeroed ``.grad``, or a view of the fused
        backends' gradient buffer, zero when the sample handed it out) is zeroed.
        Otherwise the next block's backward would add to them (a loop that relies on
        ``accumulate()`` clearing ``.grad`` calls no ``zero_grad()``)."""
        with torch.no_grad():
            for p, g, version in saved:
                if g is not None and g._version != version:
                    if g.grad_fn is not None:
                        g.detach_()
                    g.zero_()
                if p.grad is not g:
                    p.grad = g

    def _drop_pending(self, kinds) -> None:
        """A call failed after collecting gradients of ``kinds``: drop them and what
        collecting them noted, and put back what the parameters held before the call: the
        mean, or the next sample a step left there (``sample_ahead``)."""
        self._pending.clear(kinds)
        self._backend.discard()
        was_ahead = self._was_ahead and KIND_INNER in kinds
        if not self._backend.params_hold_mean or was_ahead:
            self.restore()
            if was_ahead:
                self._backend.prefetch()

    def _closure_samples(self, group_key: str = "mc_samples") -> int:
        return max(int(g.get(group_key, 1)) for g in self._groups)

    def _run_closure(self, closure: Callable, kind: str) -> Tensor:
        """One evaluation at a ``kind`` sample.  A backend whose update rewrites the
        parameters leaves the sample there (the next sample or the update overwrites it)."""
        self._sample(kind, trainable_checked=True)
        ok = False
        try:
            with torch.enable_grad():
                loss = closure()
            self.accumulate()
            ok = True
        finally:
            if ok and self._backend.lazy_restore:
                self._active = None
            else:
                self.restore()
        return loss

    def _check_amp(self, grad_scale, found_inf) -> None:
        """AMP arguments: one-element real tensors, as torch.amp.GradScaler passes them;
        ``grad_scale`` positive and finite, checked where reading it is free (a CPU tensor,
        or the torch backend, which reads its gradients anyway)."""
        for name, t in (("grad_scale", grad_scale), ("found_inf", found_inf)):
            check(t is None or (isinstance(t, Tensor) and t.numel() == 1 and t.dim() <= 1
                                and not t.is_complex() and t.device.type != "meta"),
                  f"{name} must be None or a one-element real tensor (torch.amp.GradScaler's)"
                  f", got {type(t).__name__}"
                  f"{'' if not isinstance(t, Tensor) else f' of shape {tuple(t.shape)}'}")
        if grad_scale is None:
            return
        check(grad_scale.is_floating_point(),
              f"grad_scale must be a float tensor, got {grad_scale.dtype}")
        if self._backend.host_readable(grad_scale):
            v = float(grad_scale.detach().reshape(()))
            check(v > 0 and v != float("inf"), f"grad_scale must be finite and > 0, got {v}")

    # ------------------------------------------------------------------ step
    @torch._disable_dynamo           # (see sample(); the closure runs eagerly too)
    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None, *, grad_scale: Optional[Tensor] = None,
             found_inf: Optional[Tensor] = None):
        """One inner step.

        With a ``closure`` (zeroes grads, forward, backward, returns the loss): evaluate it
        at ``mc_samples`` inner samples and, once the correction is active, at as many
        outer samples on the same mini-batch; returns the mean loss at the inner samples.

        Without: use what :meth:`sample`/:meth:`accumulate` collected.  AMP: gradients are
        divided by ``grad_scale``; a nonzero ``found_inf`` skips the step, leaving the
        state as it was.

        A step refused before the update (call order, hyperparameters) keeps the collected
        gradients; an update that runs (taken, skipped, or refused for non-finite
        gradients) consumes them.
        """
        if self._active is not None:
            raise RuntimeError("step() while a sample is in the parameters: call restore() first")
        self._check_groups()
        self._check_amp(grad_scale, found_inf)
        pend = self._pending
        self._check_no_mix(KIND_INNER)
        self._check_trainable()
        corr = self._corrected()
        loss = None
        #: the parameters held the next sample: a failure puts it back, not the mean
        self._was_ahead = self._backend.ahead is not None
        if closure is not None:
            if self._has_correction and self._refreshes == 0 and not self._warned_lightning \
                    and _from_lightning(closure):
                self._warned_lightning = True
                warnings.warn(f"{type(self).__name__} under Lightning's automatic optimization "
                              "takes IVON's steps: nothing here calls refresh(), so the "
                              "correction never starts. Use poco_kernels.integrations."
                              "lightning.PoCoLightningModule (docs/integrations.md)",
                              stacklevel=2)
            if pend.count[KIND_INNER] or pend.count[KIND_OUTER]:
                raise RuntimeError("step(closure) with gradients already accumulated by "
                                   "sample()/accumulate(): call step() without a closure, or "
                                   "use one protocol per step")
            try:
                losses = [self._run_closure(closure, "inner")
                          for _ in range(self._closure_samples())]
                if corr:
                    for _ in range(self._closure_samples()):
                        self._run_closure(closure, "outer")
            except BaseException:
                self._drop_pending((KIND_INNER, KIND_OUTER))
                raise
            loss = mean_loss(losses)
        else:
            if pend.count[KIND_INNER] == 0 and self.noisy:
                raise RuntimeError(
                    f"{type(self).__name__}.step() needs gradients at a posterior sample: pass a "
                    "closure, or run the backward pass inside `with optimizer.sampled():` "
                    "(see the README, 'Training loops without closures'). A training loop "
                    "that owns step(), such as the Hugging Face Trainer's, needs "
                    "poco_kernels.integrations (docs/integrations.md): "
                    "poco_kernels.integrations.hf.PoCoTrainer in place of Trainer")
            if (corr and pend.count[KIND_OUTER] == 0
                    and not self._backend.skipped_on_host(found_inf)):
                raise RuntimeError(
                    "the posterior correction is active but no gradient at the outer sample "
                    "was given: pass a closure to step(), or also run `with "
                    "optimizer.sampled('outer'):` on the same mini-batch, then step()")
            if pend.count[KIND_INNER] == 0:
                # noiseless optimizer, torch-style use: the gradients in .grad are at the mean
                self._sync_mean()
                self._active = (KIND_INNER, 0)
                self._backend.at_mean()
                try:
                    self.accumulate(clear_grads=False)
                finally:
                    self._active = None
        skip = self._without_grad((KIND_INNER, KIND_OUTER))
        saved = self._save_params(skip) if skip else None
        had = [set(b.buffers) for b in self._buckets]
        try:
            taken = self._backend.step(corr, grad_scale, found_inf)
        except BaseException:
            self._drop_new_buffers(had)
            self._drop_pending((KIND_INNER, KIND_OUTER))
            raise
        finally:
            pend.clear((KIND_INNER, KIND_OUTER))
            self._eps_cache.clear()
            if saved:
                self._put_back(saved)
            self._backend.after_update()
        if taken:
            self._step += 1
        elif taken is False:
            self._drop_new_buffers(had)
        if self._backend.ahead_family() and (saved or self._backend.ahead is None):
            # the torch backend, or parameters put back without a gradient: the next
            # sample by a sample pass (the fused kernels wrote it in the step's pass)
            self._backend.restore()
            self._backend.prefetch()
        return loss


    def _drop_new_buffers(self, had) -> None:
        """An update not taken leaves no buffer made at its first use (SGD's momentum)."""
        for b, names in zip(self._buckets, had):
            new = [n for n in b.buffers if n not in names]
            for n in new:
                del b.buffers[n]
            if new:
                self._expose(b)

    def _without_grad(self, kinds) -> FrozenSet[Tuple[int, int]]:
        """The parameters that had no gradient at any sample of ``kinds`` collected for
        this update (``(bucket, index)``).  If that is every trainable parameter, the
        update is refused (pending gradients dropped): a closure that forgot
        ``backward()`` must not train on zeros."""
        pend = self._pending
        sets = [pend.no_grad[k] for k in kinds if pend.count[k]]
        missing = frozenset.intersection(*sets) if sets else frozenset()
        n = sum(len(b.params) for b in self._buckets)
        if n and len(missing) == n:
            self._drop_pending(kinds)
            what = "step" if KIND_INNER in kinds else "refresh"
            raise RuntimeError(
                f"no parameter received a gradient for this {what} (every .grad was None, "
                "nothing was updated): did the closure call loss.backward()?  With "
                "sample()/accumulate(), call backward() inside the `with "
                "optimizer.sampled():` block.")
        return missing

    def _save_params(self, which) -> List[Tuple[Tensor, Tensor, Dict[str, Tensor]]]:
        """Copies of the value and state of parameters a step skips (no gradient)."""
        out = []
        for bi, i in sorted(which):
            b = self._buckets[bi]
            p = b.params[i]
            out.append((b.local(i), {n: v.clone() for n, v in self.state[p].items()}, p))
        return out

    def _put_back(self, saved) -> None:
        """A skipped parameter's value and state as they were before the step (a buffer
        the step created, as SGD's momentum, stays zero for it)."""
        with torch.no_grad():
            for loc, state, p in saved:
                for n, v in self.state[p].items():
                    if n in state:
                        v.copy_(state[n])
                    else:
                        v.zero_()
                loc.copy_(state["mean"])        # (the parameter may hold a sample)

    # ------------------------------------------------------------------ refresh
    @torch._disable_dynamo
    @torch.no_grad()
    def refresh(self, closures: Optional[Iterable[Callable]] = None, *,
                grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None):
        """Form the outer estimate from a mega-batch (or the full batch).

        ``closures``: one closure, or one per chunk of the mega-batch (each zeroes grads, runs
        forward and backward on its chunk, returns its mean loss); the outer gradient is
        the mean over the chunks, at ONE posterior sample for the whole mega-batch (or at
        each of ``refresh_samples`` samples, where the optimizer has that option).  Chunks
        should be of equal size (or their losses weighted accordingly).  Without closures,
        use what ``sample("refresh")`` / ``accumulate()`` collected.  Returns the mean loss
        (None when the refresh was skipped: AMP overflow, or non-finite gradients on a
        fused backend with ``check_finite=False``).

        Whether a refresh was taken decides whether the correction is active, so the
        fused backends read that one flag from the device here (one synchronisation per
        refresh; steps have none).
        """
        if not self._has_correction:
            raise RuntimeError(f"{type(self).__name__} has no outer loop to refresh")
        if self._active is not None:
            raise RuntimeError("refresh() while a sample is in the parameters: call restore() first")
        self._check_groups()
        self._check_amp(grad_scale, found_inf)
        pend = self._pending
        self._check_no_mix(KIND_REFRESH)
        self._check_trainable()
        losses = []
        if closures is not None:
            if pend.count[KIND_REFRESH]:
                raise RuntimeError("refresh(closures) with refresh gradients already "
                                   "accumulated: call refresh() without closures")
            closures = as_closures(closures)
            check(len(closures) > 0, "refresh() needs at least one chunk of the mega-batch "
                                     "(closures is empty)")
            try:
                for _ in range(self._closure_samples("refresh_samples")):
                    self._sample("refresh", trainable_checked=True)
                    try:
                        for c in closures:
                            with torch.enable_grad():
                                losses.append(c())
                            self.accumulate()
                    finally:
                        self.restore()
            except BaseException:
                self._drop_pending((KIND_REFRESH,))
                raise
        elif pend.count[KIND_REFRESH] == 0:
            raise ValueError("refresh() needs at least one chunk of the mega-batch: pass "
                             "closures, or accumulate inside `with optimizer.sampled("
                             "'refresh'):` first")
        self._without_grad((KIND_REFRESH,))
        try:
            taken = self._backend.refresh(grad_scale, found_inf)
        except BaseException:
            self._drop_pending((KIND_REFRESH,))
            raise
        finally:
            pend.clear((KIND_REFRESH,))
            self._eps_cache.clear()
            self._backend.after_update()
        if not taken:
            return None
        self._refresh_taken()
        return mean_loss(losses)
