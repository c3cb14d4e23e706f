"""The optimizer-step microbenchmarks under pytest-benchmark, for users who compare runs
with its tooling (``--benchmark-compare``, ``--benchmark-json``):

    .venv/bin/python -m pytest benchmarks --benchmark-columns=median,iqr,rounds

(this file is the only test module under ``benchmarks/``).  Not part of the CI test run
(``tests/``).  One test per (kernel, provider, dtype) at ``POCO_BENCH_SIZE`` parameters
(default 2**20) on the default device (CUDA if present), with the same phases as
``benchmarks/run.py`` (``suite/micro.py``): each round's setup runs the phases before the
timed one, untimed.  On CUDA every timed call ends with a synchronisation.  ``run.py``
remains the place for bandwidth figures (it measures the copy ceiling beside them).
"""
import os

import pytest
import torch

from benchmarks.common.device import release, sync
from benchmarks.common.setups import import_ivon, poco_opt
from benchmarks.suite import micro

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SIZE = int(os.environ.get("POCO_BENCH_SIZE", 2 ** 20))
DTYPES = [torch.float32, torch.bfloat16]
BACKENDS = micro.kernel_backends(DEV) + ["torch"]
IVON_MOD, _ = import_ivon()


def _synced(fn):
    def call():
        fn()
        sync(DEV)
    return call


def _bench(benchmark, fn, setup=None, rounds=10):
    if setup is None:
        benchmark.pedantic(_synced(fn), rounds=rounds, warmup_rounds=2)
    else:
        benchmark.pedantic(_synced(fn), setup=lambda: (setup(), sync(DEV))[0], rounds=rounds,
                           warmup_rounds=2)
    release(DEV)


def _ours(cls, backend, dt, ready=False):
    p, opt, grad = poco_opt(SIZE, dt, DEV, backend, cls=cls)
    if ready:
        micro._poco_ready(opt, p, grad)
    return opt, p, grad


# kernel -> (optimizer class, its phases, the timed phase; None: the whole cycle)
OURS = {"sample_inner": ("IVON", micro.ours_ivon, 0),
        "restore_accumulate": ("IVON", micro.ours_ivon, 1),
        "ivon_step": ("IVON", micro.ours_ivon, 2),
        "ivon_cycle": ("IVON", micro.ours_ivon, None),
        "ivon_poco_step": ("IVONPoCo", micro.ours_poco, 2),
        "ivon_poco_cycle": ("IVONPoCo", micro.ours_poco, None),
        "refresh_fold": ("IVONPoCo", micro.ours_refresh, 1),
        "refresh_cycle": ("IVONPoCo", micro.ours_refresh, None)}


def _time_phase(benchmark, ph, index):
    if index is None:
        _bench(benchmark, ph.cycle())
    else:
        fn, setup = ph.timed(index)
        _bench(benchmark, fn, setup)
        ph.finish()


@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kernel", list(OURS))
def test_ours(benchmark, kernel, backend, dt):
    cls, phases_of, index = OURS[kernel]
    ph = micro._instances(1, lambda i: _ours(cls, backend, dt, ready=cls == "IVONPoCo"),
                          phases_of)
    _time_phase(benchmark, ph, index)


@pytest.mark.skipif(IVON_MOD is None, reason="ivon-opt is not installed")
@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("kernel", list(micro.IVON_PHASES) + ["ivon_cycle"])
def test_ivonopt(benchmark, dt, kernel):
    def make(i):
        g = torch.Generator(device=DEV).manual_seed(2)
        p = torch.nn.Parameter(torch.randn(SIZE, device=DEV, generator=g).to(dt))
        return IVON_MOD.IVON([p], lr=1e-3, ess=1.0), p, torch.randn_like(p)
    ph = micro._instances(1, make, micro.ivonopt_phases)
    _time_phase(benchmark, ph, micro.IVON_PHASES.index(kernel)
                if kernel in micro.IVON_PHASES else None)


@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("flag", ["foreach", "fused"])
def test_adamw_step(benchmark, dt, flag):
    p = torch.nn.Parameter(torch.randn(SIZE, device=DEV).to(dt))
    p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([p], lr=1e-3, **{flag: True})
    _bench(benchmark, opt.step)
