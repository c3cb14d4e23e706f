"""The sample, accumulate, fold_ge and check kernels, Triton (under TRITON_INTERPRET=1)
and C++, against the reference functions: a sample of each kind of sigma (with and
without SYNC), the sums of gradients and of gradient * eps over draws and chunks, and the
flag of non-finite gradients."""
import pytest
import torch

from helpers import FUSED_BACKENDS
from kernel_parity import NV, PDTYPES, SEED, SIZES, _ctl, _eps, _gen
from kernel_parity import ops  # noqa: F401
from poco_kernels import noise
from poco_kernels import reference as R
from poco_kernels.kernels import interface as K
from tolerances import PARAM, STATE, assert_close

pytestmark = pytest.mark.skipif(not FUSED_BACKENDS, reason="no kernels to test here")


# --------------------------------------------------------------------------- sample
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("pdtype, sync", [(d, False) for d in PDTYPES] + [(torch.float32, True)])
@pytest.mark.parametrize("mode", ["none", "h", "buffer", "const"])
def test_sample_kernel(n, pdtype, mode, sync, ops):
    """(SYNC is for float32 parameters, which hold the mean between steps.)"""
    r = _gen(n, hash((n, str(pdtype), mode, sync)) % 2 ** 31)
    centre = r()
    h = r().abs() + 0.1
    sigma_buf = r().abs() * 0.1
    ess, wd, const, sign, counter, stream = 37.0, 3e-3, 0.25, -1.0, 5, noise.stream_id(3, 1, 2)
    param = (centre if sync else r()).to(pdtype).clone()
    mean = torch.full((n,), float("nan"))
    ctl = _ctl(steps=counter)
    mode_id = {"none": K.SIGMA_NONE, "h": K.SIGMA_IVON, "buffer": K.SIGMA_BUFFER,
               "const": K.SIGMA_CONST}[mode]
    ops.sample(param, param if sync else centre, mean, h, sigma_buf, ctl, SEED, NV, stream, 0,
               K.SampleHyper(ess, wd, const), sign, mode_id, sync)
    sigma = {"none": None, "h": R.ivon_sigma(h, ess, wd), "buffer": sigma_buf,
             "const": const}[mode]
    eps = None if mode == "none" else _eps(n, counter, stream, sign)
    expect = R.perturb(centre, sigma, eps).to(pdtype)
    assert_close(param, expect, PARAM[pdtype], "theta")
    if sync:
        assert torch.equal(mean, centre)
    else:
        assert torch.isnan(mean).all(), "without SYNC the mean buffer is not written"


# --------------------------------------------------------------------------- accumulate
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("pdtype", PDTYPES)
def test_accumulate_and_fold_kernels(n, pdtype, ops):
    """Three draws of two chunks each: acc_g is the sum of all gradients, acc_ge the sum
    of gradient * eps of its draw (draw 0 folded in when draw 1 starts)."""
    r = _gen(n, n + 17)
    ctl = _ctl(refreshes=4)
    acc_g, acc_ge = torch.full((n,), float("nan")), torch.full((n,), float("nan"))
    exp_g, exp_ge = torch.zeros(n), torch.zeros(n)
    first = True
    for draw in range(3):
        stream, sign = noise.stream_id(1, 2, draw // 2), (-1.0 if draw % 2 else 1.0)
        if draw == 1:
            s0 = noise.stream_id(1, 2, 0)
            ops.fold_ge(acc_g, acc_ge, ctl, SEED, NV, s0, 1, 1.0)
            assert_close(acc_ge, exp_ge, STATE[torch.float32], "fold")
        for _ in range(2):
            g = r().to(pdtype)
            ops.accumulate(g, acc_g, acc_ge, ctl, SEED, NV, stream, 1, sign, first, draw >= 1)
            first = False
            exp_g += g.float()
            exp_ge += g.float() * _eps(n, 4, stream, sign)
        assert_close(acc_g, exp_g, STATE[torch.float32], f"acc_g draw {draw}")
    assert_close(acc_ge, exp_ge, STATE[torch.float32], "acc_ge")
    assert int(ctl[K.CTL_BAD]) == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_accumulate_flags_nonfinite_gradients(bad, ops):
    n = 3001
    g = torch.randn(n)
    g[2345] = bad
    ctl = _ctl()
    acc = torch.zeros(n)
    ops.accumulate(g, acc, None, ctl, SEED, NV, 0, 0, 1.0, True, False)
    assert int(ctl[K.CTL_BAD]) == 1
    ok = _ctl()
    ops.accumulate(torch.randn(n), acc, None, ok, SEED, NV, 0, 0, 1.0, True, False)
    assert int(ok[K.CTL_BAD]) == 0


@pytest.mark.parametrize("pdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), None])
def test_check_flags_nonfinite_gradients_and_reads_only(bad, pdtype, ops):
    """The check of a gradient buffer adopted as its own sum: the flag set exactly when an
    element (here one near the end of an odd size) is inf or NaN, the buffer untouched."""
    n = 3001
    g = torch.randn(n).to(pdtype)
    g[-2] = 3.0e38 if bad is None else bad       # (the largest finite values pass)
    before = g.clone()
    ctl = _ctl()
    ops.check(g, ctl)
    assert bool(torch.isfinite(g).all()) == (bad is None)
    assert int(ctl[K.CTL_BAD]) == (0 if bad is None else 1)
    assert torch.equal(g.view(torch.uint8), before.view(torch.uint8))   # bits (NaN != NaN)
