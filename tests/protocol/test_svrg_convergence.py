"""SVRG with full-batch refreshes reaches the optimum of a strongly convex logistic
regression (checked against scipy's L-BFGS); SGD with the same learning rate stalls."""
import numpy as np
import pytest
import torch

import poco_kernels as pk

scipy_optimize = pytest.importorskip("scipy.optimize")

N, D, LAM = 200, 6, 1e-2


def _data():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(N, D, generator=g, dtype=torch.float64)
    w = torch.randn(D, generator=g, dtype=torch.float64)
    y = (torch.rand(N, generator=g, dtype=torch.float64) < torch.sigmoid(X @ w)).double()
    return X, y


def _objective(w, X, y):
    z = X @ w
    return torch.nn.functional.softplus(z).mean() - (y * z).mean() + 0.5 * LAM * w.square().sum()


def _lbfgs(X, y):
    def f(w):
        wt = torch.tensor(w, requires_grad=True)
        loss = _objective(wt, X, y)
        loss.backward()
        return loss.item(), wt.grad.numpy().copy()

    res = scipy_optimize.minimize(f, np.zeros(D), jac=True, method="L-BFGS-B",
                                  options={"gtol": 1e-14, "ftol": 1e-16, "maxiter": 10_000})
    return res.fun, res.x


def _train(opt_cls, epochs, lr, refresh=True, **kw):
    X, y = _data()
    w = torch.zeros(D, dtype=torch.float64, requires_grad=True)
    opt = opt_cls([w], lr=lr, **kw)
    g = torch.Generator().manual_seed(1)

    def closure_for(idx):
        def c():
            opt.zero_grad()
            loss = _objective(w, X[idx], y[idx])
            loss.backward()
            return loss
        return c

    m = 2 * N      # inner steps per refresh (batch 1)
    for t in range(epochs * N):
        if refresh and t % m == 0:
            opt.refresh([closure_for(torch.arange(N))])
        opt.step(closure_for(torch.randint(0, N, (1,), generator=g)))
    with torch.no_grad():
        return _objective(w, X, y).item()


@pytest.mark.long
def test_svrg_reaches_lbfgs_optimum_and_sgd_stalls():
    X, y = _data()
    f_star, w_star = _lbfgs(X, y)
    # the L-BFGS optimum is a true stationary point
    wt = torch.tensor(w_star, requires_grad=True)
    _objective(wt, X, y).backward()
    assert wt.grad.norm() < 1e-9

    lr = 0.1
    f_svrg = _train(pk.SVRG, epochs=25, lr=lr)
    f_sgd = _train(pk.SVRG, epochs=25, lr=lr, refresh=False)       # = SGD
    gap_svrg = (f_svrg - f_star) / abs(f_star)
    gap_sgd = (f_sgd - f_star) / abs(f_star)
    assert gap_svrg >= -1e-12                 # cannot beat the optimum
    assert gap_svrg < 1e-8, gap_svrg
    assert gap_sgd > 1e-5, gap_sgd            # SGD stalls well above: the noise floor
