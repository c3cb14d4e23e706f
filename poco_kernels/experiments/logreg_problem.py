"""The logistic-regression problem: the data set as float64 tensors (:class:`Problem`),
the objective ``F(w) = (1/N) sum_i loss(x_i, y_i; w) + (lam / 2) ||w||^2`` with its
gradient in closed form and the accuracy, and the oracle every method is measured
against: the L-BFGS optimum of the same ``F`` (:func:`lbfgs_oracle`)."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from . import datasets
from .logreg_config import Config

__all__ = ["DTYPE", "Problem", "load_problem", "data_loss", "objective", "gradient",
           "residual", "accuracy", "Oracle", "lbfgs_oracle"]

DTYPE = torch.float64


# ----------------------------------------------------------------------------- problem
@dataclass
class Problem:
    name: str
    Xtr: torch.Tensor            # (N, d) float64, standardised + bias column (last)
    ytr: torch.Tensor            # binary: (N,) float64 in {0, 1}; else (N,) int64 labels
    Xte: torch.Tensor
    yte: torch.Tensor
    l2: float
    classes: int = 2
    description: str = ""

    @property
    def n(self) -> int:
        return self.Xtr.shape[0]

    @property
    def d(self) -> int:
        """Number of weights: features (with the bias) times outputs."""
        return self.Xtr.shape[1] * self.outputs

    @property
    def outputs(self) -> int:
        """1 for a binary problem (one logit), K for K > 2 classes (softmax)."""
        return 1 if self.classes == 2 else self.classes


def load_problem(cfg: Config) -> Problem:
    """The data set of ``cfg`` (:func:`poco_kernels.experiments.datasets.load`)."""
    data = datasets.load(cfg.dataset, seed=cfg.seed, test_size=cfg.test_size,
                         data_dir=cfg.data_dir, n_synthetic=cfg.n_synthetic,
                         max_train=cfg.max_train, features=cfg.features)
    ydt = DTYPE if data.classes == 2 else torch.int64
    t = lambda A, dt=DTYPE: torch.from_numpy(np.ascontiguousarray(A)).to(dt)  # noqa: E731
    return Problem(cfg.dataset, t(data.Xtr), t(data.ytr, ydt), t(data.Xte), t(data.yte, ydt),
                   float(cfg.l2), data.classes, data.description)


# ----------------------------------------------------------------------------- objective
def _outputs(w: torch.Tensor, X: torch.Tensor) -> int:
    return w.numel() // X.shape[1]


def _logits(w: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    k = _outputs(w, X)
    return X @ w.reshape(-1) if k == 1 else X @ w.reshape(-1, k)


def data_loss(w: torch.Tensor, X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean logistic (binary) or softmax cross-entropy loss; differentiable in ``w``."""
    z = _logits(w, X)
    if z.dim() == 1:
        return (torch.nn.functional.softplus(z) - y * z).mean()
    return torch.nn.functional.cross_entropy(z, y)


def objective(w: torch.Tensor, X: torch.Tensor, y: torch.Tensor, l2: float) -> float:
    """``F(w)``: the mean loss plus ``l2 / 2 ||w||^2`` (float64)."""
    with torch.no_grad():
        w = w.detach().to(DTYPE).reshape(-1)
        return float(data_loss(w, X, y) + 0.5 * l2 * w.dot(w))


def residual(w: torch.Tensor, X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``p - y``: sigmoid minus label (binary), softmax minus one-hot (K classes)."""
    z = _logits(w, X)
    if z.dim() == 1:
        return torch.sigmoid(z) - y
    r = torch.softmax(z, dim=1)
    r[torch.arange(len(y)), y] -= 1.0
    return r


def gradient(w: torch.Tensor, X: torch.Tensor, y: torch.Tensor, l2: float) -> torch.Tensor:
    """Gradient of :func:`objective` (flat, like ``w``)."""
    with torch.no_grad():
        w = w.detach().to(DTYPE).reshape(-1)
        return (X.T @ residual(w, X, y)).reshape(-1) / X.shape[0] + l2 * w


def accuracy(w: torch.Tensor, X: torch.Tensor, y: torch.Tensor) -> float:
    """The share of examples whose predicted class is the label."""
    with torch.no_grad():
        z = _logits(w.detach(), X)
        pred = (z > 0).to(y.dtype) if z.dim() == 1 else z.argmax(1)
        return float((pred == y).to(DTYPE).mean())


# ----------------------------------------------------------------------------- the oracle
@dataclass
class Oracle:
    """The L-BFGS optimum of ``F``: the line every method is measured against."""
    w: torch.Tensor
    f: float
    grad_norm: float             # max-abs gradient of F at w
    test_acc: float
    train_acc: float
    iterations: int
    seconds: float


def lbfgs_oracle(prob: Problem, gtol: float = 1e-10) -> Oracle:
    """The L-BFGS optimum: the full-batch minimiser of ``F`` by scipy's L-BFGS-B at a
    tight tolerance."""
    from scipy.optimize import minimize
    X, y, lam, k = prob.Xtr.numpy(), prob.ytr.numpy(), prob.l2, prob.outputs
    rows = np.arange(len(y))

    def fg(w):
        if k == 1:
            z = X @ w
            p = 0.5 * (1.0 + np.tanh(0.5 * z))           # stable sigmoid
            f = np.mean(np.logaddexp(0.0, z) - y * z)
            g = X.T @ (p - y) / X.shape[0]
        else:
            Z = X @ w.reshape(-1, k)
            Z = Z - Z.max(1, keepdims=True)
            lse = np.log(np.exp(Z).sum(1))
            f = np.mean(lse - Z[rows, y])
            P = np.exp(Z - lse[:, None])
            P[rows, y] -= 1.0
            g = (X.T @ P).reshape(-1) / X.shape[0]
        return f + 0.5 * lam * w.dot(w), g + lam * w

    t0 = time.perf_counter()
    res = minimize(fg, np.zeros(prob.d), jac=True, method="L-BFGS-B",
                   options=dict(maxiter=100_000, maxfun=200_000, maxcor=50, gtol=gtol,
                                ftol=1e-16))
    secs = time.perf_counter() - t0
    w = torch.from_numpy(res.x.copy()).to(DTYPE)
    gn = float(gradient(w, prob.Xtr, prob.ytr, lam).abs().max())
    return Oracle(w, objective(w, prob.Xtr, prob.ytr, lam), gn,
                  accuracy(w, prob.Xte, prob.yte), accuracy(w, prob.Xtr, prob.ytr),
                  int(res.nit), secs)

