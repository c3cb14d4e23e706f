"""Parking's memory (csrc/park.cpp): the parameters' storage keeps the mean's memory and
its own alive, whatever is dropped or given other memory first (the optimizer, the mean
buffer's storage resized or moved to shared memory, a raw pointer taken inside a call or
between calls), and a bucket that cannot unpark leaves every bucket parked."""
import gc

import pytest
import torch

import poco_kernels as pk
from helpers import FUSED_BACKENDS, Problem, params_of
from parking_twins import assert_twins, equal, iteration, make, state_of, warm

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_the_parameters_outlive_a_parked_optimizer(backend):
    """Dropped while parked, the optimizer leaves the parameters reading the mean (their
    storage holds a reference to its memory)."""
    prob = Problem()
    m, opt = make(backend, None, pk.IVON)
    for t in range(3):
        iteration(opt, m, prob, t, "closure")
    mean = params_of(m)
    del opt
    gc.collect()
    junk = [torch.full((4096,), 7.0) for _ in range(64)]     # (reuse freed memory)
    assert equal(params_of(m), mean)
    del junk
    opt = pk.IVON(m.parameters(), lr=0.05, ess=200.0, backend=backend)
    assert equal(params_of(m), mean)
    iteration(opt, m, prob, 0, "closure")


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_a_raw_view_taken_while_parked_stays_valid(backend):
    """numpy (or DLPack, or ``data_ptr()``) taken between calls reads the mean buffer's
    memory: it stays allocated while the parameter's storage lives, after an unpark and
    the optimizer dropped."""
    prob = Problem()
    m, opt = make(backend, None, pk.IVON)
    for t in range(2):
        iteration(opt, m, prob, t, "closure")
    arr = next(m.parameters()).detach().numpy()
    was = arr.copy()
    opt.sample()                              # (unparked: the parameters hold a sample)
    del opt
    gc.collect()
    junk = [torch.full((4096,), 7.0) for _ in range(64)]
    assert (arr == was).all()
    del junk


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_a_raw_view_taken_inside_a_call_outlives_a_parked_optimizer(backend):
    """numpy taken inside a ``sampled()`` block reads the flat buffer's own memory, which
    parking hands to the optimizer's spare: dropped while parked, the optimizer leaves that
    memory allocated while the parameter's storage lives (it was freed under the view)."""
    prob = Problem()
    m, opt = make(backend, None, pk.IVON)
    iteration(opt, m, prob, 0, "closure")
    with opt.sampled("inner"):
        prob.loss(m, 1).backward()
        arr = next(m.parameters()).detach().numpy()
    opt.step()
    assert opt._runner.parked
    was = arr.copy()
    del opt
    gc.collect()
    junk = [torch.full(arr.shape, 7.0) for _ in range(64)]     # (reuse freed memory)
    assert (arr == was).all()
    arr[...] = 1.5                            # (no write into memory the heap reuses)
    assert all((j == 7.0).all() for j in junk)


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
@pytest.mark.parametrize("move", ["resize", "share_memory"])
def test_a_mean_buffer_given_other_memory_while_parked(backend, move):
    """The mean buffer's storage given other memory between calls (resized in place,
    moved to shared memory: what pickling the state through torch.multiprocessing does):
    the parameters keep reading the mean they read (its memory stays allocated), a write
    into them is the new mean, and the run goes on as its twin's, bit for bit.  Shared
    memory stays shared (the optimizer parks no more: it would hide it from torch)."""
    prob = Problem()
    runs = []
    for moved in (False, True):
        m, opt = warm(backend, None, prob)
        assert opt._runner.parked
        first = next(m.parameters())
        mean = opt.state[first]["mean"]
        if moved:
            st = mean.untyped_storage()
            before = st.data_ptr()
            st.resize_(st.nbytes()) if move == "resize" else mean.share_memory_()
            assert st.data_ptr() != before
            junk = [torch.full((4096,), 7.0) for _ in range(64)]
            assert equal(params_of(m), [opt.state[p]["mean"] for p in m.parameters()])
            assert all((j == 7.0).all() for j in junk)
        with torch.no_grad():
            first.mul_(0.5)                   # (an edit: the new mean)
        for t in range(3, 6):
            iteration(opt, m, prob, t, "closure")
        assert opt._runner.parked is not (moved and move == "share_memory")
        assert mean.is_shared() is (moved and move == "share_memory")
        runs.append((params_of(m), state_of(opt)))
    assert_twins(*runs)


def _two_buckets(backend):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(7, 6), torch.nn.Linear(6, 5))
    opt = pk.IVONPoCoMo([{"params": m[0].parameters()},
                         {"params": m[1].parameters(), "lr": 0.02}],
                        lr=0.05, ess=200.0, seed=5, backend=backend)
    return m, opt


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_a_bucket_that_cannot_unpark_leaves_every_bucket_parked(backend):
    """The second bucket's mean storage resized to another size while parked: every
    call raises, naming it, with both buckets still parked (the first one's parameters
    still read its mean); its size given back, the run goes on as its twin's that never
    saw the failed calls, bit for bit."""
    def closure(m, opt, t):
        def run():
            opt.zero_grad()
            torch.manual_seed(100 + t)
            loss = m(torch.randn(4, 7)).square().mean()
            loss.backward()
            return loss
        return run

    runs = []
    for broken in (False, True):
        m, opt = _two_buckets(backend)
        for t in range(3):
            opt.step(closure(m, opt, t))
        assert opt._runner.parked and len(opt._runner.view.buckets) == 2
        if broken:
            first, second = next(m[0].parameters()), next(m[1].parameters())
            st = opt.state[second]["mean"].untyped_storage()
            size = st.nbytes()
            st.resize_(size + 64)
            for _ in range(2):
                with pytest.raises(RuntimeError, match="resized"):
                    opt.step(closure(m, opt, 3))
                assert opt._runner.parked
                assert torch.equal(first, opt.state[first]["mean"])
            st.resize_(size)
        for t in range(3, 6):
            opt.step(closure(m, opt, t))
        runs.append((params_of(m), state_of(opt)))
    assert_twins(*runs)


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_share_memory_while_parked_keeps_the_mean_and_stops_parking(backend):
    """``model.share_memory()`` between steps gives the parked storage other memory,
    holding the mean: the optimizer continues as the copy protocol does (the shared
    memory is the parameters'), and parks no more."""
    prob = Problem()
    runs = []
    for ahead in (False, None):
        m, opt = warm(backend, ahead, prob)
        m.share_memory()
        for t in range(3, 6):
            iteration(opt, m, prob, t, "closure")
        assert not opt._runner.parked
        assert all(p.is_shared() for p in m.parameters())
        runs.append((params_of(m), state_of(opt)))
    assert_twins(*runs)
