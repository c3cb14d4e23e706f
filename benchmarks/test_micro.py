"""The optimizer-step microbenchmarks under pytest-benchmark, for users who compare runs
with its tooling (``--benchmark-compare``, ``--benchmark-json``):

    .venv/bin/python -m pytest benchmarks --benchmark-columns=median,iqr,rounds

Not part of the CI test run.  One test per (kernel, provider, dtype) at ``POCO_BENCH_SIZE``
parameters (default 2**20) on the default device (CUDA if present), with the same phases
as ``benchmarks/run.py`` (``micro.py``): each round's setup runs the phases before the
timed one, untimed.  On CUDA every timed call ends with a synchronisation.  ``run.py``
remains the place for bandwidth figures (it measures the copy ceiling beside them).
"""
import os

import pytest
import torch

import micro
from common import import_ivon, poco_opt, release, sync

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


@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("phase", ["sample_inner", "restore_accumulate", "ivon_step"])
def test_ivon_phase(benchmark, backend, dt, phase):
    ph = micro._instances(1, lambda i: _ours("IVON", backend, dt), micro.ours_ivon)
    fn, setup = ph.timed(["sample_inner", "restore_accumulate", "ivon_step"].index(phase))
    _bench(benchmark, fn, setup)
    ph.finish()


@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ivon_poco_step(benchmark, backend, dt):
    ph = micro._instances(1, lambda i: _ours("IVONPoCo", backend, dt, ready=True),
                          micro.ours_poco)
    fn, setup = ph.timed(2)
    _bench(benchmark, fn, setup)
    ph.finish()


@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_refresh_fold(benchmark, backend, dt):
    ph = micro._instances(1, lambda i: _ours("IVONPoCo", backend, dt, ready=True),
                          micro.ours_refresh)
    fn, setup = ph.timed(1)
    _bench(benchmark, fn, setup)
    ph.finish()


@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ivon_poco_cycle(benchmark, backend, dt):
    ph = micro._instances(1, lambda i: _ours("IVONPoCo", backend, dt, ready=True),
                          micro.ours_poco)
    _bench(benchmark, ph.cycle())


@pytest.mark.skipif(IVON_MOD is None, reason="ivon-opt is not installed")
@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("phase", ["sample_inner", "restore_accumulate", "ivon_step"])
def test_ivonopt_phase(benchmark, dt, phase):
    def make(i):
        g = torch.Generator(device=DEV).manual_seed(2)
        p = torch.nn.Parameter(torch.randn(SIZE, device=DEV, generator=g).to(dt))
        return IVON_MOD.IVON([p], lr=1e-3, ess=1.0), p, torch.randn_like(p)
    ph = micro._instances(1, make, micro.ivonopt_phases)
    fn, setup = ph.timed(["sample_inner", "restore_accumulate", "ivon_step"].index(phase))
    _bench(benchmark, fn, setup)
    ph.finish()


@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("flag", ["foreach", "fused"])
def test_adamw_step(benchmark, dt, flag):
    p = torch.nn.Parameter(torch.randn(SIZE, device=DEV).to(dt))
    p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([p], lr=1e-3, **{flag: True})
    _bench(benchmark, opt.step)
