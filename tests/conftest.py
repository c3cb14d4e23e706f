import os
import sys

# Triton runs through its CPU interpreter in the tests: this must be set before anything
# (torch included) imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")
# A pytest-xdist worker (pytest_cmdline_main below: one per core) computes on one thread:
# two workers with two OpenMP threads each on two cores took longer than one process.
# Tests of several threads set their count themselves.
_XDIST_WORKER = "PYTEST_XDIST_WORKER" in os.environ
if _XDIST_WORKER:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

if _XDIST_WORKER:
    torch.set_num_threads(1)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """The tests run on a pytest-xdist worker per core (at most 4), a file's tests in one
    worker (its module fixtures built once), unless ``-n`` says otherwise (``-n 0``: in
    this process).  Here, not in pyproject's addopts: ``pytest benchmarks`` (the
    microbenchmarks, which xdist would disable) stays in one process."""
    if (config.pluginmanager.hasplugin("xdist") and not _XDIST_WORKER
            and not hasattr(config, "workerinput") and config.option.numprocesses is None):
        config.option.numprocesses = "auto"
        config.option.maxprocesses = config.option.maxprocesses or 4
        if config.option.dist == "no":
            config.option.dist = "loadfile"


@pytest.fixture
def one_thread():
    """torch on one thread for the test (tiny tensors and LAPACK calls are faster so)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def pytest_generate_tests(metafunc):
    """A test that takes ``backend`` runs on every backend available here (the torch backend,
    the C++ kernels, the Triton kernels through the interpreter)."""
    if "backend" in metafunc.fixturenames and not any(
            m.name == "parametrize" and "backend" in m.args[0]
            for m in metafunc.definition.iter_markers()):
        from helpers import available_backends
        metafunc.parametrize("backend", available_backends())


@pytest.fixture
def branch_free():
    """The Triton interpreter runs the compiled noise transform (the C++ kernels' branch-free
    polynomials) instead of numpy's log, cos and sin, for the test
    (``triton_noise.BRANCH_FREE``)."""
    import triton.language as tl
    from poco_kernels.kernels import triton_noise
    saved = triton_noise.BRANCH_FREE
    triton_noise.BRANCH_FREE = tl.constexpr(True)
    yield
    triton_noise.BRANCH_FREE = saved
