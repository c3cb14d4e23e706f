"""The base class of the family, :class:`BucketedOptimizer`: flat buckets of parameters and
state (:mod:`poco_kernels._layout`), the backend that runs them (:mod:`poco_kernels.backends`),
the noise, the counters.  :class:`~poco_kernels.von_poco.VONPoCo` stands on this alone; the
diagonal family adds the sampling protocol (:mod:`poco_kernels._posterior`).

Its other jobs live beside it, as mixins: the parameter groups and the buckets laid out over
them (:mod:`poco_kernels._groups`), the state dict, copies and pickles
(:mod:`poco_kernels._state_dict`).

``eps`` comes from the counter-based stream of :mod:`poco_kernels.noise`, keyed by
``(seed, counter, bucket, kind, draw, element)``: nothing about noise is stored, and
ranks that share the seed draw the same sample.
"""
from __future__ import annotations

from typing import Any, ClassVar, Dict, FrozenSet, List, Optional, Set, Tuple

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from . import backends as _backends
from . import noise as _noise
from .kernels import device_randn
from ._layout import Bucket
from ._protocol import COUNTER_STEPS, KIND_OUTER, Pending, SampleSpec
from ._arguments import DeclaredArguments, argument, option
from ._groups import ParamGroupsMixin, _maybe_nonzero, draw_seed
from ._state_dict import StateDictMixin
from ._transaction import outside_dynamo
from ._validation import check, checked_low_dtypes, hyperparameters, strict_keywords
from ._view import OptimizerView
from .rules import Rule


class BucketedOptimizer(DeclaredArguments, ParamGroupsMixin, StateDictMixin,
                        torch.optim.Optimizer):
    """Buckets, backend, noise, counters and state dict.

    Subclasses set their algorithm's :class:`~poco_kernels.rules.Rule` (``rule``: buffers,
    samples, updates, kernel records, flags), declare their arguments
    (:mod:`poco_kernels._arguments`: the constructor follows) and validate their
    hyperparameters (``_validate_group``); every constructor refuses unknown keywords,
    naming the closest valid one.
    """

    params: ParamsT = argument(doc=(
        "the parameters to optimise: an iterable of tensors, of ``(name, tensor)`` pairs, "
        "or of dicts (parameter groups, each with its own hyperparameters)"))
    seed: Optional[int] = option(default=None, doc="""\
        key of the counter-based noise stream, an int in ``[0, 2**63)``.  None: drawn from
        torch's global generator at construction, so ``torch.manual_seed`` before building the
        optimizer fixes the noise and a seed sweep done the usual way varies it; an explicit
        ``seed`` wins.  The seed is in the state dict (a resumed run continues the same stream).
        Ranks that share the seed draw the same posterior sample without communicating: under
        data parallelism give every rank the same global seed, or pass ``seed`` explicitly.  The
        stream's definition is ``opt.noise_version`` (2, four normals per Philox call); a state
        dict records it and loading one sets it, so a run resumed from a checkpoint written
        before version 2 keeps drawing version 1 bit for bit (set ``opt.noise_version = 2`` after
        loading to move it to the cheaper stream).""")
    backend: str = option(default="auto", doc="""\
        ``"auto"``: Triton for CUDA parameters, C++ for CPU ones, the torch backend otherwise;
        ``"torch"``: the reference maths op for op, any device and dtype; ``"triton"`` or
        ``"cpp"``: fused kernels, a clear error where they cannot run.  See docs/design.md,
        'Backends'.""")
    check_finite: Optional[bool] = option(default=None, doc="""\
        raise ``ValueError`` on a non-finite gradient, state unchanged (``True``), or skip such
        an update on the device and count it in ``skipped_updates`` (``False``).  ``None``: True
        on the torch and C++ backends, False on Triton, where the check costs a device-to-host
        read per update.""")
    grad_views: Optional[bool] = option(default=None, doc="""\
        on the fused backends, each sample hands the trainable parameters a ``.grad`` that is a
        view of a zeroed flat gradient buffer, so the backward pass accumulates straight into
        what the kernels read (no copy), and ``zero_grad()`` zeroes those buffers in place,
        keeping the views.  A ``.grad`` replaced since (``p.grad = t``,
        ``zero_grad(set_to_none=True)``, a hook) still works: it is read once.  False:
        ``.grad`` is left to autograd; Triton reads those tensors in place (one launch over a
        table of their addresses), C++ copies them in.  ``None``: False on Triton on a GPU
        (autograd hands over its own tensors instead of adding into a view, one kernel launch
        less per parameter per backward), True elsewhere (C++, the Triton interpreter).""")

    #: the algorithm, stated once (:mod:`poco_kernels.rules`)
    rule: ClassVar[Rule]
    _warned_lightning: ClassVar[bool] = False   # the one warning of _from_lightning
    #: other classes whose state dicts this one loads as they are (the same state)
    _loads_from: ClassVar[Tuple[str, ...]] = ()
    #: classes whose state dicts this one continues: their state is a subset of this
    #: one's; missing hyperparameters keep this optimizer's values, missing buffers start
    #: at their initial values (IVON -> IVON-PoCo)
    _continues_from: ClassVar[Tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        strict_keywords(cls)

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

    def _initialise(self, params, defaults: Dict[str, Any], *, seed: Optional[int] = None,
                    backend: str = "auto", check_finite: Optional[bool] = None,
                    grad_views: Optional[bool] = None, sample_ahead: Optional[bool] = False,
                    state_dtype: Optional[torch.dtype] = None,
                    outer_dtype: Optional[torch.dtype] = None):
        """The constructor every generated ``__init__`` calls: ``defaults`` are the
        per-group hyperparameters, the keywords the options."""
        check(seed is None or (isinstance(seed, int) and not isinstance(seed, bool)
                               and 0 <= seed < 2 ** 63),
              f"seed must be None or an int in [0, 2**63), got {seed!r}")
        check(backend in _backends.NAMES, f"backend must be one of {_backends.NAMES}, got "
              f"{backend!r}")
        check(check_finite is None or isinstance(check_finite, bool),
              f"check_finite must be None or a bool, got {check_finite!r}")
        check(grad_views is None or isinstance(grad_views, bool),
              f"grad_views must be None or a bool, got {grad_views!r}")
        #: fused backends: the parameters' ``.grad`` are views of the flat gradient buffers
        #: the kernels read (see ``zero_grad``); False: autograd's own tensors, read in
        #: place or copied in (None until the backend resolves it, below)
        self.grad_views = grad_views
        self._grad_views_requested = grad_views
        check(sample_ahead is None or isinstance(sample_ahead, bool),
              f"sample_ahead must be None or a bool, got {sample_ahead!r}")
        #: the step writes the next step's inner sample (IVON family): True, into the
        #: parameters; None, beside the mean where the engine parks (the parameters hold
        #: the mean between public calls); False: no sample ahead
        self.sample_ahead = sample_ahead
        #: dtype of the rule's ``low_state_buffers`` and of its ``outer_estimate_buffers``
        #: (None: float32 state; the outer estimates follow ``state_dtype``)
        self.state_dtype, self.outer_dtype = checked_low_dtypes(self, state_dtype, outer_dtype)
        super().__init__(params, self._group_type(defaults))
        for gi, g in enumerate(self._groups):
            self._check_group(g, gi, new=True)
        #: key of the noise stream: the argument, or drawn from torch's global generator
        #: (so ``torch.manual_seed`` governs it, as it governs a model's initialisation)
        self._seed = seed if seed is not None else draw_seed()     # (the property seed)
        self._noise_version = _noise.STREAM_VERSION      # (the property noise_version)
        #: as requested ("auto", None): a copy resolves them again (__getstate__)
        self._requested = (backend, check_finite)
        self._buckets: List[Bucket] = self._new_buckets(self._groups, [])
        for b in self._buckets:
            self._expose(b)
        #: what the backend sees of this optimizer
        self._view = OptimizerView(self)
        #: the name of the backend that runs (``backend="auto"`` resolved)
        self.backend = _backends.resolve(backend, self._view)
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
        #: the backend object that runs the rule (``self.backend`` is its name)
        self._runner = _backends.create(self.backend, self._view)
        #: raise on non-finite gradients (the triton backend then reads one flag from the
        #: device per update; without it a bad update is skipped on the device and counted
        #: in ``skipped_updates``).  Default: True for 'torch' and 'cpp' (where reading the
        #: flag is free), False for 'triton'.
        self.check_finite = (self._runner.check_finite_default if check_finite is None
                             else check_finite)
        if grad_views is None:
            self.grad_views = self._runner.grad_views_default

    @property
    def uses_hessian(self) -> bool:
        """The update needs Price Hessian estimates (the rule's)."""
        return self.rule.uses_hessian

    @property
    def noisy(self) -> bool:
        """The optimizer perturbs the parameters: a sample before each gradient (the
        rule's)."""
        return self.rule.noisy

    # ------------------------------------------------------------------ noise
    def _seed_get(self) -> int:
        return self._seed

    def _seed_set(self, seed: int) -> None:
        check(isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2 ** 63,
              f"seed must be an int in [0, 2**63), got {seed!r}")
        seed = int(seed)
        if seed != self._seed:
            self._noise_changes("seed")
            self._seed = seed
            self._eps_cache.clear()

    def _noise_changes(self, name: str) -> None:
        """A setting the noise depends on (``seed``, ``noise_version``) may change: not while
        a sample is in the parameters, nor with gradients pending (the step or refresh draws
        their noise again, under the value they were sampled with)."""
        if self._active is not None:
            raise RuntimeError(f"{name} changed while a sample is in the parameters: call "
                               "restore() first")
        if any(self._pending.count.values()):
            raise RuntimeError(f"{name} changed with gradients pending from sample()/"
                               "accumulate(): call step() or refresh() first")

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
        if version != self._noise_version:
            self._noise_changes("noise_version")
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

    def _corrected_buckets(self) -> FrozenSet[int]:
        """The buckets whose step uses the correction: after the first refresh, those of
        every group a refresh has taken in; none while ``alpha == 0`` in all of those."""
        if not (self.rule.has_correction and self._refreshes > 0):
            return frozenset()
        awaiting = self._awaiting
        if not any([_maybe_nonzero(dict.get(g, "alpha", 0.0))   # (not an alias: dict's get)
                    for gi, g in enumerate(self._groups) if gi not in awaiting]):
            return frozenset()
        if not awaiting:                      # (every bucket; its index is its position)
            return frozenset(range(len(self._buckets)))
        return frozenset(b.index for b in self._buckets if b.group_index not in awaiting)

    def correction_active(self) -> bool:
        """True when a step needs the gradient at the outer sample too: after the first
        refresh, with a nonzero ``alpha`` in some group that a refresh has taken in."""
        return bool(self._corrected_buckets())

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
        family's rule (``rule.sample_spec``), except that the outer sample of a group not yet
        taken in by a refresh is its mean (its gradient there is not used)."""
        if kind == KIND_OUTER and self._joining(b):
            return SampleSpec(b.buffers["mean"])
        return self.rule.sample_spec(b, self._groups[b.group_index], kind, draw)

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
            self._runner.sync_mean()

    # ------------------------------------------------------------------ counters
    def _read_counters(self) -> Tuple[int, int, int]:
        """(steps, refreshes, skipped updates) as the backend holds them (fused: read
        from the device); the host's counts are brought up to date."""
        self._step, self._refreshes, skipped = self._runner.counters()
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

    @outside_dynamo
    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Reset the gradients.  ``.grad`` that are views of the fused backends' flat
        gradient buffers (``grad_views``) are zeroed in place and stay views (one memset
        per bucket, none when the buffer is known to hold zeros); the others are set to
        None, as ``torch.optim`` does.  ``set_to_none=True``: every ``.grad`` to None
        (the next backward's gradients are then copied into the buffers once);
        ``False``: every ``.grad`` zeroed in place."""
        done = self._runner.zero_grads() if set_to_none is not True else set()
        if len(done) == sum([len(dict.__getitem__(g, "params")) for g in self._groups]):
            return                            # (every one a view, zeroed in place)
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


# ``seed`` is a declared constructor option (its class attribute read when the class was
# made) and, on an optimizer, the property that validates and guards a change:
BucketedOptimizer.seed = property(  # type: ignore[assignment]
    BucketedOptimizer._seed_get, BucketedOptimizer._seed_set, doc="""\
    The key of the noise stream (the ``seed`` argument, or drawn from torch's global
    generator when built).  Settable (an int in ``[0, 2**63)``), outside a sample and with no
    gradients pending (their noise is drawn again by the step or refresh, under the seed they
    were sampled with); a sample the step left in the parameters (``sample_ahead``) is drawn
    again under the new seed before the next step uses it.""")
