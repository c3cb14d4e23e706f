"""VON-PoCo on logistic regression (sklearn's breast-cancer data, against the L-BFGS
optimum): without noise it reaches the optimum, with noise it stays near it, and the BLR
precision update is stable where the paper's clamped update is not.

VON-PoCo closures RETURN the loss and do not call backward()."""
import numpy as np
import pytest
import torch

from poco_kernels.von_poco import VONPoCo
from von_poco_problems import LogReg


#: tiny LAPACK calls (31 x 31 eigh) are ~100x slower with several busy threads
pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------- logistic regression
@pytest.fixture(scope="module")
def cancer():
    sklearn = pytest.importorskip("sklearn.datasets")
    so = pytest.importorskip("scipy.optimize")
    X, y = sklearn.load_breast_cancer(return_X_y=True)
    X = (X - X.mean(0)) / X.std(0)
    X = np.hstack([X, np.ones((len(X), 1))])
    y = 2.0 * y - 1.0
    n, delta = len(X), 1e-2

    def obj(w):
        z = y * (X @ w)
        return (np.logaddexp(0, -z).mean() + 0.5 * delta * w @ w,
                X.T @ (-y * np.exp(-np.logaddexp(0, z))) / n + delta * w)
    r = so.minimize(obj, np.zeros(X.shape[1]), jac=True, method="L-BFGS-B",
                    options=dict(maxiter=10_000, gtol=1e-12, ftol=1e-15))
    assert r.success
    return torch.tensor(X), torch.tensor(y), delta, obj, r.fun


def _run_cancer(cancer, *, update, noise_scale, steps, batch, every, lr, beta, seed=0,
                warmup=0):
    X, y, delta, obj, fstar = cancer
    prob = LogReg(X, y, delta)
    opt = VONPoCo([prob.w], ess=float(prob.n), lr=lr, beta=beta, alpha=1.0,
                  noise_scale=noise_scale, prior_precision=delta, min_eig=delta,
                  precision_update=update, seed=seed)
    g = torch.Generator().manual_seed(seed)
    gaps = []
    for t in range(steps):
        if t >= warmup and (t - warmup) % every == 0:
            opt.refresh(prob.chunks(4))          # full batch in 4 unequal chunks
        opt.step(prob.closure(torch.randint(0, prob.n, (batch,), generator=g)))
        gaps.append((obj(prob.w.detach().numpy())[0] - fstar) / fstar)
    return np.array(gaps), opt


@pytest.mark.parametrize("update", ["blr", "paper"])
def test_logistic_regression_reaches_lbfgs_without_noise(cancer, update):
    """60 plain-VON warm-up steps (as the paper's logistic-regression runs), then a
    full-batch refresh every 20 steps of batch 32."""
    gaps, _ = _run_cancer(cancer, update=update, noise_scale=0.0, steps=160, batch=32,
                          every=20, lr=0.2, beta=0.1, warmup=60)
    assert gaps[59] > 1e-3              # VON alone stalls
    assert abs(gaps[-1]) < 1e-9, gaps[-1]
    assert gaps.min() > -1e-9            # never below the L-BFGS optimum (sanity)


def test_logistic_regression_with_noise_stays_near_lbfgs(cancer):
    """With sampling the mean fluctuates on the scale noise_scale * posterior std: the
    objective gap at the mean is O(noise_scale^2) (measured: median 1.5e-5 at 0.01,
    1.5e-3 at 0.1, 1e-2 at 0.3, 0.2 to 0.9 with spikes at 1.0 for this problem)."""
    gaps, opt = _run_cancer(cancer, update="blr", noise_scale=0.1, steps=200, batch=32,
                            every=20, lr=0.5, beta=0.3)
    assert np.median(gaps[-60:]) < 1e-2, np.median(gaps[-60:])
    ev = torch.linalg.eigvalsh(opt.flat_state("precision")[0])
    assert float(ev.min()) >= 569 * 1e-2 * (1 - 1e-9)


def test_blr_precision_update_is_stable_where_the_papers_update_is_not(cancer):
    """Documents the default: no warm-up, batch 10, lr = beta = 1, refresh every 20 steps.
    The clamped paper update keeps taking 1/min_eig-sized steps along clamped directions."""
    blr, _ = _run_cancer(cancer, update="blr", noise_scale=0.0, steps=160, batch=10,
                         every=20, lr=1.0, beta=1.0)
    paper, _ = _run_cancer(cancer, update="paper", noise_scale=0.0, steps=160, batch=10,
                           every=20, lr=1.0, beta=1.0)
    assert abs(blr[-1]) < 1e-9, blr[-1]
    assert paper[-20:].min() > 1.0, paper[-20:].min()
