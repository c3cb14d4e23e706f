"""Properties of the reference maths that the paper's derivation promises."""
import torch

from poco_kernels import reference as R


def test_hessian_update_keeps_h_plus_wd_positive_for_very_negative_hhat():
    """h + wd stays > 0 for ANY hhat, and can at most halve per step:
    new (h + wd) = x (1 + z + z^2/2) >= x/2 with x = h + wd, z = (1 - beta2)(hhat - h)/x."""
    g = torch.Generator().manual_seed(0)
    wd = 1e-4
    h = torch.rand(10_001, generator=g, dtype=torch.float64) * 10 - wd * 0.999   # h + wd > 0
    hhat = -torch.logspace(-6, 12, 10_001, dtype=torch.float64)                   # very negative
    for beta2 in (0.9, 0.999, 0.99999):
        x = h + wd
        new = R.ivon_hessian(h, hhat, beta2, wd) + wd
        assert bool((new > 0).all())
        assert bool((new >= x / 2 * (1 - 1e-12)).all())
        # the bound is attained: z = -1 halves h + wd exactly
        hh = h - x / (1 - beta2)
        torch.testing.assert_close(R.ivon_hessian(h, hh, beta2, wd) + wd, x / 2)


def test_hessian_update_is_ivon_opt_formula():
    h, hhat = torch.tensor([0.5, 2.0]), torch.tensor([-3.0, 7.0])
    b2, wd = 0.9, 0.1
    expect = b2 * h + (1 - b2) * hhat + 0.5 * (1 - b2) ** 2 * (h - hhat) ** 2 / (h + wd)
    torch.testing.assert_close(R.ivon_hessian(h, hhat, b2, wd), expect)


def test_outer_fold_and_control_variate():
    old, new = torch.tensor([1.0, 2.0]), torch.tensor([3.0, -1.0])
    assert torch.equal(R.outer_fold(old, new, 0.3, first=True), new)
    torch.testing.assert_close(R.outer_fold(old, new, 0.3, first=False), 0.3 * old + 0.7 * new)
    assert torch.equal(R.outer_fold(old, new, 0.0, first=False), new)
    x_in, x_at_out, x_out = torch.tensor([1.0]), torch.tensor([4.0]), torch.tensor([2.0])
    assert torch.equal(R.control_variate(x_in, x_at_out, x_out, 0.0), x_in)
    assert torch.equal(R.control_variate(x_in, x_at_out, x_out, 1.0), torch.tensor([-1.0]))


def test_price_hessian_is_unbiased_on_a_quadratic():
    """E[g(m + sigma eps) eps / sigma] = diag(A) for a quadratic with Hessian A."""
    g = torch.Generator().manual_seed(1)
    d, n = 5, 200_000
    A = torch.randn(d, d, generator=g, dtype=torch.float64)
    A = A @ A.T + torch.eye(d, dtype=torch.float64)
    m, sigma = torch.randn(d, generator=g, dtype=torch.float64), torch.full((d,), 0.3, dtype=torch.float64)
    eps = torch.randn(n, d, generator=g, dtype=torch.float64)
    grads = (m + sigma * eps) @ A
    est = R.price_hessian(grads * eps, sigma).mean(0)
    torch.testing.assert_close(est, A.diagonal(), rtol=0, atol=6 * A.norm() / n ** 0.5 * 3)


def test_make_spd_repairs_only_when_needed():
    S = torch.tensor([[2.0, 0.0], [0.0, -1.0]], dtype=torch.float64)
    R_ = R.make_spd(S, 1e-3)
    assert torch.linalg.eigvalsh(R_).min() >= 1e-3 - 1e-12
    good = torch.tensor([[2.0, 0.5], [0.5, 1.0]], dtype=torch.float64)
    assert torch.equal(R.make_spd(good, 1e-3), good)
