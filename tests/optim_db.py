"""The tests' optimizer database, in the spirit of torch's ``OptimizerInfo`` database
(``torch/testing/_internal/common_optimizers.py``): every optimizer class once, with what the
suites select it by (:class:`OptimizerInfo`), and every optimizer configuration that a test
suite runs declared once (:class:`OptimConfig`: the class, its keywords, the backends that run
it, its tolerances per dtype, its refresh schedule).

A generic suite takes its configurations with :func:`configs` (the suite's name in ``uses``,
and properties: ``configs("copy", has_refresh=True)``) or its optimizer classes with
:func:`infos` (``infos(grad_closure=True, noisy=True)``), and parametrizes over them with
:func:`cases`; it keeps no table of its own.  A new optimizer is one :class:`OptimizerInfo`
and one :class:`OptimConfig` per suite here (docs/design.md, 'Adding an optimizer').

The suites (``uses``):

* ``trajectory``: tests/protocol/test_backends.py, whole trajectories of every fused backend
  against the torch backend, within ``tolerances[dtype]``;
* ``resume``: tests/state/test_state_dict.py, save / reload mid-run, bit for bit;
* ``copy``: tests/state/test_copy_and_sharing.py, deepcopy / pickle, bit for bit;
* ``conventions``: tests/conventions/test_torch_*.py, torch.optim's generic checks
  (powers of two for lr: a float lr and the same lr as a float32 tensor are one number);
* ``transactional``: tests/state/transaction_rig.py (for test_transactional.py and its
  siblings), bad calls change nothing;
* ``legacy``: tests/state/legacy_checkpoints.py, the checkpoints written at commit 720fa9a.
  Their keywords are history: they must stay what wrote the file (the check compares them
  with the file's records).  A legacy configuration shares an entry with another suite only
  where the keywords are identical; the others are entries of their own, ``historical``.
"""
from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, Dict, Mapping, Optional, Tuple

import pytest
import torch

import poco_kernels as pk
from helpers import available_backends
from tolerances import TRAJECTORY

ALL_BACKENDS = ("torch", "cpp", "triton")


@functools.lru_cache(maxsize=None)
def _here() -> Tuple[str, ...]:
    return tuple(available_backends())


# ============================================================================ the classes
@dataclasses.dataclass(frozen=True)
class OptimizerInfo:
    """An optimizer class of the package and the properties the suites select by."""
    name: str                   #: its name in ``poco_kernels``
    fused: bool                 #: fused kernels (C++, Triton); False: the torch backend only
    has_refresh: bool           #: an outer loop (``refresh()``, a correction)
    noisy: bool                 #: draws noise every step (another seed, another run)
    grad_closure: bool          #: closures call backward (``.grad``); False: they return the loss
    momentum_key: Optional[str]     #: the hyperparameter CyclicLR / OneCycleLR cycle
    sample_ahead: bool = False  #: takes ``sample_ahead``
    state_dtype: bool = False   #: takes ``state_dtype`` (bfloat16 state)
    outer_dtype: bool = False   #: takes ``outer_dtype`` (bfloat16 outer estimates)

    @property
    def cls(self):
        return getattr(pk, self.name)

    @property
    def backends(self) -> Tuple[str, ...]:
        return ALL_BACKENDS if self.fused else ("torch",)


#: every optimizer class, in the order the suites list them
OPTIMIZERS: Dict[str, OptimizerInfo] = {i.name: i for i in [
    OptimizerInfo("IVON", fused=True, has_refresh=False, noisy=True, grad_closure=True,
                  momentum_key="beta1", sample_ahead=True, state_dtype=True),
    OptimizerInfo("IVONPoCo", fused=True, has_refresh=True, noisy=True, grad_closure=True,
                  momentum_key="beta1", sample_ahead=True, state_dtype=True, outer_dtype=True),
    OptimizerInfo("SVRG", fused=True, has_refresh=True, noisy=False, grad_closure=True,
                  momentum_key="momentum"),
    OptimizerInfo("SVRGAdamW", fused=True, has_refresh=True, noisy=False, grad_closure=True,
                  momentum_key="betas"),
    OptimizerInfo("VSGDPoCo", fused=True, has_refresh=True, noisy=True, grad_closure=True,
                  momentum_key="momentum"),
    OptimizerInfo("VONPoCo", fused=False, has_refresh=True, noisy=True, grad_closure=False,
                  momentum_key=None),
]}


def infos(**props) -> list:
    """The optimizer classes whose properties are ``props`` (``infos(grad_closure=True)``)."""
    return [i for i in OPTIMIZERS.values()
            if all(getattr(i, k) == v for k, v in props.items())]


def names(**props) -> list:
    return [i.name for i in infos(**props)]


# ============================================================================ the configurations
@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """One configuration of an optimizer: ``info.cls(params, **kwargs)``."""
    id: str                     #: unique in the database; the suites' test ids
    optimizer: str              #: the :data:`OPTIMIZERS` key
    kwargs: Mapping[str, Any]   #: read-only
    uses: frozenset             #: the suites that run it (see the module's docstring)
    #: the backends that run it where not every backend of its class does; None: every one
    backends: Optional[Tuple[str, ...]] = None
    #: a suite's refresh schedule: every ``refresh_every`` steps from step ``warmup``
    #: (None: no outer loop)
    refresh_every: Optional[int] = None
    warmup: int = 0
    #: the parameter dtypes of its trajectory runs
    dtypes: Tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
    tolerances: Dict[torch.dtype, dict] = dataclasses.field(default_factory=lambda: TRAJECTORY)
    #: the costlier variants of a suite run it (every copy mode, the Triton round trips)
    representative: bool = False
    #: legacy checkpoints: (case name, class written, seed, backends); keywords frozen
    legacy: Optional[Tuple[str, str, int, Tuple[str, ...]]] = None
    #: kept only for the legacy checkpoints: its keywords are what wrote the file
    historical: bool = False

    @property
    def info(self) -> OptimizerInfo:
        return OPTIMIZERS[self.optimizer]

    @property
    def cls(self):
        return self.info.cls

    @property
    def name(self) -> str:
        return self.optimizer

    def runs_on(self) -> Tuple[str, ...]:
        """Its backends that run here."""
        here = _here()
        return tuple(b for b in (self.backends or self.info.backends) if b in here)

    def tol(self, dtype: torch.dtype) -> dict:
        return self.tolerances[dtype]

    def make(self, params, backend: str, **over):
        """The optimizer over ``params`` (``over`` replaces or adds keywords)."""
        return self.cls(params, backend=backend, **{**self.kwargs, **over})

    def __repr__(self):
        return self.id


def _c(id, optimizer, uses, **kw):
    fields = {f.name for f in dataclasses.fields(OptimConfig)}
    own = {k: kw.pop(k) for k in list(kw) if k in fields}
    return OptimConfig(id, optimizer, types.MappingProxyType(kw), frozenset(uses.split()),
                       **own)


_CPU = ("torch", "cpp")

_CONFIGS = [
    # ------------------------------------------------------------------ IVON
    _c("IVON-clip", "IVON", "trajectory", lr=0.05, ess=300.0, hess_init=0.5, beta2=0.999,
       clip_radius=0.5),
    _c("IVON-mc2-nodebias", "IVON", "trajectory", lr=0.05, ess=300.0, mc_samples=2,
       debias=False, rescale_lr=False),
    _c("IVON-mc2", "IVON", "resume", lr=0.05, ess=300.0, mc_samples=2),
    _c("IVON-mc2-ess100", "IVON", "copy", lr=0.05, ess=100.0, mc_samples=2),
    _c("IVON-pow2", "IVON", "conventions", lr=0.125, ess=100.0),
    _c("IVON-beta2", "IVON", "transactional", lr=0.05, ess=300.0, beta2=0.999),
    # historical: IVON-mc2 with clip_radius
    _c("IVON-mc2-clip", "IVON", "legacy", lr=0.05, ess=300.0, mc_samples=2, clip_radius=0.5,
       legacy=("IVON", "IVON", 13, _CPU), historical=True),
    # ------------------------------------------------------------------ IVON-PoCo
    _c("IVONPoCo-clip", "IVONPoCo", "trajectory", lr=0.05, ess=200.0, hess_init=0.5,
       beta2=0.999, alpha=0.8, clip_radius=0.5, refresh_every=8, warmup=4),
    _c("IVONPoCoMo-independent", "IVONPoCo", "trajectory", lr=0.05, ess=200.0, beta2=0.9995,
       alpha=0.6, rho1=0.5, rho2=0.2, outer_noise="independent", refresh_every=8, warmup=3),
    _c("IVONPoCo-antithetic-floor-mc2", "IVONPoCo", "trajectory", lr=0.05, ess=200.0,
       beta2=0.999, alpha=0.7, refresh_samples=2, refresh_antithetic=True, hess_floor=0.5,
       mc_samples=2, hess_corr_scale=1.0, refresh_every=8, warmup=2),
    _c("IVONPoCo-rho2", "IVONPoCo", "resume", lr=0.05, ess=300.0, beta2=0.999, alpha=0.5,
       rho1=0.3, rho2=0.1),
    _c("IVONPoCo-antithetic-rho1", "IVONPoCo", "copy", lr=0.05, ess=100.0, alpha=0.8, rho1=0.5,
       refresh_samples=2, refresh_antithetic=True, representative=True),
    _c("IVONPoCo-pow2", "IVONPoCo", "conventions", lr=0.125, ess=100.0, alpha=0.5, rho1=0.3,
       rho2=0.1, representative=True),
    _c("IVONPoCo-rho1", "IVONPoCo", "transactional", lr=0.05, ess=300.0, beta2=0.999,
       alpha=0.5, rho1=0.3),
    # historical: IVONPoCoMo with alpha 0.6; an antithetic pair of refresh samples
    _c("IVONPoCoMo-alpha0.6", "IVONPoCo", "legacy", lr=0.05, ess=300.0, beta2=0.999,
       alpha=0.6, rho1=0.3, rho2=0.1, legacy=("IVONPoCoMo", "IVONPoCo", 11, _CPU),
       historical=True),
    _c("IVONPoCo-pair", "IVONPoCo", "legacy", lr=0.05, ess=300.0, alpha=0.5, refresh_samples=2,
       refresh_antithetic=True, hess_floor=0.0, outer_noise="independent", mc_samples=2,
       legacy=("IVONPoCo-pair", "IVONPoCo", 12, _CPU), historical=True),
    # ------------------------------------------------------------------ SVRG
    _c("SVRG-plain", "SVRG", "trajectory", lr=0.1, refresh_every=8, warmup=2),
    _c("SVRG-nesterov-wd", "SVRG", "trajectory", lr=0.05, momentum=0.9, nesterov=True,
       weight_decay=1e-3, alpha=0.5, refresh_every=8, warmup=2),
    _c("SVRG-dampening", "SVRG", "trajectory", lr=0.05, momentum=0.8, dampening=0.3,
       refresh_every=8, warmup=2),
    _c("SVRG-momentum-alpha", "SVRG", "resume transactional", lr=0.05, momentum=0.9,
       alpha=0.7),
    _c("SVRG-momentum", "SVRG", "copy", lr=0.1, momentum=0.9, representative=True),
    _c("SVRG-pow2", "SVRG", "conventions", lr=0.0625, alpha=0.5, momentum=0.9,
       weight_decay=1e-3, representative=True),
    # historical: SVRG-momentum-alpha with weight decay
    _c("SVRG-momentum-alpha-wd", "SVRG", "legacy", lr=0.05, momentum=0.9, alpha=0.7,
       weight_decay=1e-3, legacy=("SVRG", "SVRG", 14, _CPU), historical=True),
    # ------------------------------------------------------------------ SVRG-AdamW
    _c("SVRGAdamW-wd", "SVRGAdamW", "trajectory", lr=3e-3, weight_decay=1e-2, alpha=0.7,
       refresh_every=8, warmup=2),
    _c("SVRGAdamW-alpha", "SVRGAdamW", "resume transactional legacy", lr=1e-2, alpha=0.5,
       legacy=("SVRGAdamW", "SVRGAdamW", 15, _CPU)),
    _c("SVRGAdamW-lr0.01", "SVRGAdamW", "copy", lr=1e-2, weight_decay=1e-2),
    _c("SVRGAdamW-pow2", "SVRGAdamW", "conventions", lr=0.015625, alpha=0.5),
    # ------------------------------------------------------------------ VSGD-PoCo
    _c("VSGDPoCo-momentum", "VSGDPoCo", "trajectory", lr=0.1, sigma=0.01, momentum=0.5,
       refresh_every=8, warmup=2),
    _c("VSGDPoCo-lr0.05", "VSGDPoCo", "resume legacy", lr=0.05, sigma=0.01, momentum=0.5,
       legacy=("VSGDPoCo", "VSGDPoCo", 16, _CPU)),
    _c("VSGDPoCo-plain", "VSGDPoCo", "copy", lr=0.1, sigma=0.01),
    _c("VSGDPoCo-pow2", "VSGDPoCo", "conventions", lr=0.0625, sigma=0.01, alpha=0.5,
       momentum=0.5),
    _c("VSGDPoCo-alpha", "VSGDPoCo", "transactional", lr=0.05, sigma=0.01, momentum=0.5,
       alpha=0.8),
    # ------------------------------------------------------------------ VON-PoCo
    _c("VONPoCo-ess50", "VONPoCo", "copy", ess=50.0, lr=0.5),
    _c("VONPoCo-pow2", "VONPoCo", "conventions", ess=100.0, lr=0.125, beta=0.125, alpha=0.5,
       min_eig=1e-2),
    _c("VONPoCo-noise", "VONPoCo", "transactional", ess=24.0, lr=0.1, beta=0.1,
       prior_precision=1.0, min_eig=1e-2, noise_scale=0.5),
    # historical
    _c("VONPoCo-beta0.2", "VONPoCo", "legacy", ess=50.0, lr=0.2, beta=0.2, alpha=0.8,
       legacy=("VONPoCo", "VONPoCo", 17, ("torch",)), historical=True),
]
CONFIGS: Dict[str, OptimConfig] = {c.id: c for c in _CONFIGS}
assert len(CONFIGS) == len(_CONFIGS), "two configurations with one id"


def configs(use: str, **props) -> list:
    """The configurations suite ``use`` runs, whose optimizer classes have ``props``
    (``configs("copy", has_refresh=True)``), in the database's order."""
    return [c for c in CONFIGS.values() if use in c.uses
            and all(getattr(c.info, k) == v for k, v in props.items())]


def config(use: str, optimizer: str) -> OptimConfig:
    """Suite ``use``'s one configuration of class ``optimizer``."""
    found = [c for c in configs(use) if c.optimizer == optimizer]
    assert len(found) == 1, (use, optimizer, found)
    return found[0]


def cases(cfgs, backends=None, *, extra=()):
    """``pytest.param(config, backend)`` for each configuration and each backend of it that
    runs here (restricted to ``backends`` when given); ``extra``: more parameters per case
    (each a tuple, with its id), e.g. ``[(("deepcopy",), "deepcopy")]``."""
    out = []
    for c in cfgs:
        for b in c.runs_on():
            if backends is not None and b not in backends:
                continue
            for values, vid in (extra or [((), None)]):
                out.append(pytest.param(c, b, *values,
                                        id="-".join(x for x in (c.id, b, vid) if x)))
    return out


def legacy_cases():
    """The legacy checkpoints' cases, in the order they were written:
    ``(name, class, keywords with the seed, backends)``."""
    order = ["IVONPoCoMo", "IVONPoCo-pair", "IVON", "SVRG", "SVRGAdamW", "VSGDPoCo", "VONPoCo"]
    by_name = {c.legacy[0]: c for c in configs("legacy")}
    assert sorted(by_name) == sorted(order)
    out = []
    for name in order:
        c = by_name[name]
        _, cls, seed, backends = c.legacy
        out.append((name, cls, dict(c.kwargs, seed=seed), backends))
    return out
