"""Logistic-regression problems for the VON-PoCo tests: binary logistic regression with an
L2 term over one flat parameter, and random instances of it."""
import torch


class LogReg:
    """Binary logistic regression with an L2 term, one flat parameter w; per-example
    losses available for autograd.functional checks."""

    def __init__(self, X, y, delta, dtype=torch.float64):
        self.X, self.y, self.delta = X.to(dtype), y.to(dtype), delta
        self.n, self.d = X.shape
        self.w = torch.nn.Parameter(torch.zeros(self.d, dtype=dtype))

    def f(self, w, idx, weight=None):
        z = -self.y[idx] * (self.X[idx] @ w)
        data = torch.nn.functional.softplus(z)
        data = data.mean() if weight is None else data.sum() * weight
        return data + 0.5 * self.delta * w @ w

    def closure(self, idx, weight=None, log=None):
        def c():
            if log is not None:
                log.append(self.w.detach().clone())
            return self.f(self.w, idx, weight)
        return c

    def chunks(self, k):
        """k closures whose mean is the full-batch mean loss (chunks of unequal size)."""
        return [self.closure(c, weight=k / self.n) for c in torch.arange(self.n).chunk(k)]

    def grad_hess(self, w, idx):
        w = w.detach()
        g = torch.autograd.functional.jacobian(lambda u: self.f(u, idx), w)
        H = torch.autograd.functional.hessian(lambda u: self.f(u, idx), w)
        return g, H


def random_logreg(n=40, d=6, seed=0, scale=1.0, delta=1e-2):
    g = torch.Generator().manual_seed(seed)
    X = scale * torch.randn(n, d, generator=g, dtype=torch.float64)
    y = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    return LogReg(X, y, delta)
