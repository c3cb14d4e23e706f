"""The refresh kernel (IVON family, with and without the summed gradient * eps; SGD family,
with and without noise) and the finish kernel (the counters, skipped steps), Triton
(under TRITON_INTERPRET=1) and C++, against the reference functions."""
import pytest
import torch

from helpers import FUSED_BACKENDS
from kernel_parity import NV, SEED, SIZES, _ctl, _eps, _gen
from kernel_parity import ops  # noqa: F401
from poco_kernels import noise
from poco_kernels import reference as R
from poco_kernels.ivon import ivon_refresh_update
from poco_kernels.kernels import interface as K
from tolerances import STATE, assert_close

pytestmark = pytest.mark.skipif(not FUSED_BACKENDS, reason="no kernels to test here")


# --------------------------------------------------------------------------- refresh
@pytest.mark.parametrize("n", SIZES[1:])
@pytest.mark.parametrize("refreshes", [0, 3])
@pytest.mark.parametrize("ge", [False, True])
def test_refresh_kernel_ivon_family(n, refreshes, ge, ops):
    r = _gen(n, n + 10 * refreshes + ge)
    grp = dict(ess=80.0, weight_decay=1e-3, rho1=0.6, rho2=0.1)
    mean, h = r(), r(0.3).abs() + 0.05
    g_out, h_out = r(), r()
    m_out, sigma_out = torch.full((n,), float("nan")), torch.full((n,), float("nan"))
    k = 3
    acc_g, acc_ge = r() * k, r() * k
    stream = noise.stream_id(4, 2, 0)
    before = dict(g_out=g_out.clone(), h_out=h_out.clone())
    ops.refresh(mean, h, acc_g, acc_ge if ge else None, g_out, h_out, m_out, sigma_out, _ctl(9,
            refreshes), None, None, SEED, NV, stream, K.RefreshHyper.ivon(ess=grp["ess"],
            wd=grp["weight_decay"], rho1=grp["rho1"], rho2=grp["rho2"]).counted(inv_n=1.0 / k),
            K.RefreshFlags(K.FAMILY_IVON, ge=ge, noisy=True))
    gM = acc_g / k
    geM = acc_ge / k if ge else gM * _eps(n, refreshes, stream)
    exp = ivon_refresh_update(mean=mean, h=h, gM=gM, geM=geM, g_out=before["g_out"],
                              h_out=before["h_out"], group=grp, first=refreshes == 0)
    for name, got in (("g_out", g_out), ("h_out", h_out), ("m_out", m_out),
                      ("sigma_out", sigma_out)):
        assert_close(got, exp[name], STATE[torch.float32], name)


@pytest.mark.parametrize("noisy", [False, True])
def test_refresh_kernel_sgd_family(noisy, ops):
    n, k, sigma = 3001, 2, 0.05
    r = _gen(n, 77 + noisy)
    mean, acc_g = r(), r()
    g_out, theta_out = torch.full((n,), float("nan")), torch.full((n,), float("nan"))
    stream = noise.stream_id(0, 2, 0)
    ops.refresh(mean, None, acc_g, None, g_out, None, theta_out, None, _ctl(5, 2), None,
                None, SEED, NV, stream, K.RefreshHyper.sgd(sigma=sigma).counted(inv_n=1.0 / k),
                K.RefreshFlags(K.FAMILY_SGD, ge=False, noisy=noisy))
    assert_close(g_out, acc_g / k, STATE[torch.float32], "g_out")
    exp = R.perturb(mean, sigma, _eps(n, 2, stream)) if noisy else mean
    assert_close(theta_out, exp, STATE[torch.float32], "theta_out")


@pytest.mark.parametrize("found_inf, bad, expect", [
    (None, 0, [8, 3, 0, 1]), (0.0, 0, [8, 3, 0, 1]), (1.0, 0, [7, 3, 0, 2]),
    (None, 1, [7, 3, 0, 2])])
def test_finish_kernel(found_inf, bad, expect, ops):
    ctl = torch.tensor([7, 3, bad, 1], dtype=torch.int64)
    fi = None if found_inf is None else torch.tensor([found_inf])
    ops.finish(ctl, fi, 0)
    assert ctl.tolist() == expect
