"""Logistic regression study of the paper (Sec. 5.1, Fig. 1), on scikit-learn's data sets.

``python -m poco_kernels.experiments.logreg`` compares SGD, SVRG, VSGD, VSGD-PoCo, IVON and
IVON-PoCo on the L2-regularised mean logistic loss

    F(w) = (1/N) sum_i [log(1 + exp(x_i^T w)) - y_i x_i^T w] + (lam / 2) ||w||^2,

(``y_i`` in {0, 1}, ``x_i`` standardised features plus a bias column; the bias is
regularised like every other weight) against a full-batch L-BFGS-B minimiser of the SAME
``F``, and prints, per method: the final train objective at the mean ``m``, its relative
gap ``(F(m) - F*) / F*`` to L-BFGS, the test accuracy (and L-BFGS's), gradient evaluations
per training example (inner steps count ``batch`` per gradient, twice once the correction
is active; a refresh counts its mega-batch, as in Sec. 4.3 of the paper) and wall time.

Everything is float64 (data, parameters, optimizer state; the package's noise is drawn in
float32 and cast).  The regulariser enters every optimizer as its ``weight_decay`` (IVON's
``delta``), so the data loss seen by the optimizers is the mean logistic loss only; the
gradients are computed in closed form (``X_B^T (sigmoid(X_B w) - y_B) / B``) instead of with
autograd, which keeps the per-step cost at the optimizer's own overhead.

Presets (every value can be overridden by its flag; ``--lr`` is the learning rate of every
method, IVON's included, unless ``--ivon-lr`` is given):

* ``quick`` (default): lr 0.05, batch 5, 12,000 inner steps, 2,000 warm-up steps, a refresh
  every 2,000 steps on the full training set; about 1.5-2 minutes on two CPU cores.  The
  paper's lr 0.01 needs ~10^5 steps on this problem (its slowest direction contracts by
  ``lr * lam`` per step), hence the larger lr in a short run.
* ``paper``: the paper's settings, lr 0.01, batch 5, 20,000 warm-up steps, a refresh every
  10,000 steps on a mega-batch of 50,000 (the full data when smaller), 100,000 steps.

Common defaults: ``lam = 0.01``; IVON(-PoCo) with ivon-opt's defaults (``hess_init 1``,
``beta1 0.9``, ``beta2 0.99999``) and ``ess = 100 N``; IVON-PoCo as in Sec. 5.1 (alpha 1, no
outer momentum, Hessian-correction term scaled by 0.01), shared outer noise, one refresh
sample.  Why not ``ess = N``: with 455 examples and 31 weights the posterior is wide
(sigma ~ 0.25 per weight), and IVON-PoCo's one-sample refresh leaves its mean about one
posterior standard deviation from the optimum after every refresh (the outer gradient
``g_out`` is the full gradient at ONE sample, a persistent error ~ ``H sigma eps``), so its
objective gap floors near ``sum_j H_jj sigma_j^2 / 2`` (~1e-4 relative with ``ess = 100 N``,
~1e-2 with ``ess = N``).  IVON-PoCo diverged on this problem with ``beta2 <= 0.9999`` or
``hess_corr_scale = 1``; see the stability notes of the package README.

Methods: ``sgd`` (``torch.optim.SGD``), ``svrg`` (:class:`~poco_kernels.SVRG`), ``vsgd``
(:class:`~poco_kernels.VSGDPoCo` never refreshed), ``vsgd-poco``, ``ivon``
(:class:`~poco_kernels.IVON`) and ``ivon-poco`` (:class:`~poco_kernels.IVONPoCo`).  All
methods see the same sequence of mini-batches (shuffled epochs, seeded by ``--seed``).
An update that would make the optimizer state non-finite raises in the package (state
unchanged); the study catches it and reports ``diverged@k`` instead of crashing.
"""
from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

__all__ = ["Config", "Problem", "Reference", "MethodResult", "PRESETS", "METHODS",
           "DATASETS", "load_problem", "objective", "accuracy", "lbfgs_reference",
           "gradient", "run_method", "run_study", "format_table", "write_csv", "main"]

DTYPE = torch.float64
METHODS = ("sgd", "svrg", "vsgd", "vsgd-poco", "ivon", "ivon-poco", "ivon-poco-pair")
DATASETS = ("breast_cancer", "digits-binary", "wine-binary", "iris-binary", "synthetic")


# ----------------------------------------------------------------------------- config
@dataclass
class Config:
    """Settings of one study; the defaults are the ``quick`` preset."""
    dataset: str = "breast_cancer"
    test_size: float = 0.2
    l2: float = 1e-2                     # lam of F (and every optimizer's weight_decay)
    n_synthetic: int = 20_000            # examples of the 'synthetic' data set
    methods: Tuple[str, ...] = METHODS
    steps: int = 12_000
    lr: float = 0.05
    batch: int = 5
    refresh_every: int = 2_000
    warmup: int = 2_000
    megabatch: int = 50_000              # the full training set when larger
    refresh_samples: int = 1             # posterior samples per refresh (IVON-PoCo; Alg. 3: 1)
    refresh_antithetic: bool = False     # mirrored refresh pairs (ivon-poco-pair always)
    hess_floor: Optional[float] = None   # IVON-PoCo: corrected hhat >= -c (h + wd)
    alpha: float = 1.0
    # VSGD
    vsgd_sigma: float = 0.01
    # IVON / IVON-PoCo
    ivon_lr: Optional[float] = None      # None: --lr
    ess: Optional[float] = None          # None: ess_per_example * N
    ess_per_example: float = 100.0
    hess_init: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.99999
    clip_radius: float = math.inf
    mc_samples: int = 1
    rho1: float = 0.0
    rho2: float = 0.0
    hess_corr_scale: float = 0.01        # the paper's down-weighting of line 14's extra term
    outer_noise: str = "shared"
    # bookkeeping
    seed: int = 0
    eval_every: int = 0                  # 0: steps // 100 (at least 1)
    log_every: int = 0                   # 0: no progress lines
    lbfgs_gtol: float = 1e-10
    blowup: float = 10.0                 # F(m) > blowup * F(0): the run has blown up


PRESETS: Dict[str, Dict[str, object]] = {
    "quick": dict(steps=12_000, warmup=2_000, refresh_every=2_000, megabatch=50_000,
                  lr=0.05),
    "paper": dict(steps=100_000, warmup=20_000, refresh_every=10_000, megabatch=50_000,
                  lr=0.01),
}


# ----------------------------------------------------------------------------- data
@dataclass
class Problem:
    name: str
    Xtr: torch.Tensor            # (N, d) float64, standardised + bias column (last)
    ytr: torch.Tensor            # (N,) float64 in {0, 1}
    Xte: torch.Tensor
    yte: torch.Tensor
    l2: float

    @property
    def n(self) -> int:
        return self.Xtr.shape[0]

    @property
    def d(self) -> int:
        return self.Xtr.shape[1]


def _raw_dataset(name: str, seed: int, n_synthetic: int):
    import sklearn.datasets as skd
    if name == "breast_cancer":
        X, y = skd.load_breast_cancer(return_X_y=True)
    elif name == "digits-binary":            # digits 0-4 against 5-9
        X, y = skd.load_digits(return_X_y=True)
        y = (y >= 5).astype(np.int64)
    elif name == "wine-binary":              # class 0 against the rest
        X, y = skd.load_wine(return_X_y=True)
        y = (y == 0).astype(np.int64)
    elif name == "iris-binary":              # versicolor against the rest (not separable)
        X, y = skd.load_iris(return_X_y=True)
        y = (y == 1).astype(np.int64)
    elif name == "synthetic":
        X, y = skd.make_classification(n_samples=n_synthetic, n_features=50, n_informative=20,
                                       n_redundant=10, flip_y=0.05, class_sep=0.8,
                                       random_state=seed)
    else:
        raise ValueError(f"unknown dataset {name!r} (expected one of {DATASETS})")
    return np.asarray(X, dtype=np.float64), np.asarray(y, dtype=np.float64)


def load_problem(cfg: Config) -> Problem:
    """Train/test split (stratified, ``random_state=cfg.seed``), features standardised with
    the training statistics, a bias column of ones appended."""
    from sklearn.model_selection import train_test_split
    X, y = _raw_dataset(cfg.dataset, cfg.seed, cfg.n_synthetic)
    Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=cfg.test_size, random_state=cfg.seed,
                                          stratify=y)
    mu, sd = Xtr.mean(0), Xtr.std(0)
    sd[sd == 0] = 1.0
    prep = lambda A: np.hstack([(A - mu) / sd, np.ones((A.shape[0], 1))])  # noqa: E731
    t = lambda A: torch.from_numpy(np.ascontiguousarray(A)).to(DTYPE)  # noqa: E731
    return Problem(cfg.dataset, t(prep(Xtr)), t(ytr), t(prep(Xte)), t(yte), float(cfg.l2))


# ----------------------------------------------------------------------------- objective
def objective(w: torch.Tensor, X: torch.Tensor, y: torch.Tensor, l2: float) -> float:
    """``F(w)``: mean logistic loss plus ``l2 / 2 ||w||^2`` (float64)."""
    with torch.no_grad():
        w = w.detach().to(DTYPE).reshape(-1)
        z = X @ w
        return float((torch.nn.functional.softplus(z) - y * z).mean() + 0.5 * l2 * w.dot(w))


def gradient(w: torch.Tensor, X: torch.Tensor, y: torch.Tensor, l2: float) -> torch.Tensor:
    """Gradient of :func:`objective`."""
    w = w.detach().to(DTYPE).reshape(-1)
    return X.T @ (torch.sigmoid(X @ w) - y) / X.shape[0] + l2 * w


def accuracy(w: torch.Tensor, X: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float(((X @ w.detach().reshape(-1) > 0).to(DTYPE) == y).to(DTYPE).mean())


@dataclass
class Reference:
    w: torch.Tensor
    f: float
    grad_norm: float             # max-abs gradient of F at w
    test_acc: float
    train_acc: float
    iterations: int
    seconds: float


def lbfgs_reference(prob: Problem, gtol: float = 1e-10) -> Reference:
    """Full-batch minimiser of ``F`` by scipy's L-BFGS-B at a tight tolerance."""
    from scipy.optimize import minimize
    X, y, lam = prob.Xtr.numpy(), prob.ytr.numpy(), prob.l2

    def fg(w):
        z = X @ w
        p = 0.5 * (1.0 + np.tanh(0.5 * z))          # stable sigmoid
        f = np.mean(np.logaddexp(0.0, z) - y * z) + 0.5 * lam * w.dot(w)
        return f, X.T @ (p - y) / X.shape[0] + lam * w

    t0 = time.perf_counter()
    res = minimize(fg, np.zeros(X.shape[1]), jac=True, method="L-BFGS-B",
                   options=dict(maxiter=100_000, maxfun=200_000, maxcor=50, gtol=gtol,
                                ftol=1e-16))
    secs = time.perf_counter() - t0
    w = torch.from_numpy(res.x.copy()).to(DTYPE)
    gn = float(gradient(w, prob.Xtr, prob.ytr, lam).abs().max())
    return Reference(w, objective(w, prob.Xtr, prob.ytr, lam), gn,
                     accuracy(w, prob.Xte, prob.yte), accuracy(w, prob.Xtr, prob.ytr),
                     int(res.nit), secs)


# ----------------------------------------------------------------------------- training
class _BatchGrad:
    """The closure of every step: writes ``X_B^T (sigmoid(X_B w) - y_B) / |B|`` (the mean
    logistic-loss gradient, without the regulariser) into ``w.grad`` at whatever the
    optimizer put into ``w``.  The batch is set by the loop; nothing is rebuilt per step."""

    def __init__(self, w: torch.Tensor):
        self.w = w
        self.X = self.y = None
        self.inv_b = 1.0

    def set(self, X: torch.Tensor, y: torch.Tensor) -> None:
        self.X, self.y, self.inv_b = X, y, 1.0 / X.shape[0]

    def __call__(self):
        with torch.no_grad():
            r = torch.sigmoid(self.X @ self.w.detach())
            r -= self.y
            g = self.X.T @ r
            g *= self.inv_b
        self.w.grad = g
        return None


class _Batches:
    """Mini-batches of shuffled epochs: each epoch permutes the training set once
    (``torch.Generator`` seeded by ``seed``) and cuts it into ``N // batch`` batches (a
    remainder smaller than a batch is dropped), made once per epoch as a list of views.
    Same seed, same sequence."""

    def __init__(self, X, y, batch: int, seed: int):
        if batch > X.shape[0]:
            raise ValueError(f"batch {batch} exceeds the {X.shape[0]} training examples")
        self.X, self.y, self.batch = X, y, batch
        self.gen = torch.Generator().manual_seed(seed)
        self.per_epoch = X.shape[0] // batch
        self.k = self.per_epoch
        self.Xs = self.ys = ()

    def next(self):
        k = self.k
        if k == self.per_epoch:
            n = self.per_epoch * self.batch
            perm = torch.randperm(self.X.shape[0], generator=self.gen)[:n]
            self.Xs = self.X[perm].view(self.per_epoch, self.batch, -1).unbind(0)
            self.ys = self.y[perm].view(self.per_epoch, self.batch).unbind(0)
            k = 0
        self.k = k + 1
        return self.Xs[k], self.ys[k]


@dataclass
class MethodResult:
    method: str
    objective: float
    rel_gap: float
    test_acc: float
    train_acc: float
    grad_evals_per_example: float
    seconds: float
    steps: int                                  # inner steps taken
    diverged_at: Optional[int] = None           # inner step whose update was refused
    error: str = ""
    refresh_steps: List[int] = field(default_factory=list)
    # (inner step, grad evals per example, F(m)); also just before and after each refresh
    trace: List[Tuple[int, float, float]] = field(default_factory=list)

    @property
    def status(self) -> str:
        """``ok``; ``diverged@k``: the package refused update k (non-finite values);
        ``blow-up@k``: F(m) exceeded ``blowup * F(0)`` at the recorded step k."""
        if self.diverged_at is None:
            return "ok"
        kind = "blow-up" if self.error.startswith("blow-up") else "diverged"
        return f"{kind}@{self.diverged_at}"


def _make_optimizer(method: str, w: torch.Tensor, cfg: Config, n: int):
    import poco_kernels as pk
    lam = cfg.l2
    if method == "sgd":
        return torch.optim.SGD([w], lr=cfg.lr, weight_decay=lam)
    if method == "svrg":
        return pk.SVRG([w], lr=cfg.lr, alpha=cfg.alpha, weight_decay=lam, seed=cfg.seed)
    if method in ("vsgd", "vsgd-poco"):
        return pk.VSGDPoCo([w], lr=cfg.lr, sigma=cfg.vsgd_sigma,
                           alpha=cfg.alpha if method == "vsgd-poco" else 0.0,
                           weight_decay=lam, mc_samples=cfg.mc_samples, seed=cfg.seed)
    ivon_kw = dict(lr=cfg.lr if cfg.ivon_lr is None else cfg.ivon_lr,
                   ess=cfg.ess_per_example * n if cfg.ess is None else cfg.ess,
                   hess_init=cfg.hess_init,
                   beta1=cfg.beta1, beta2=cfg.beta2, weight_decay=lam,
                   mc_samples=cfg.mc_samples, clip_radius=cfg.clip_radius, seed=cfg.seed)
    if method == "ivon":
        return pk.IVON([w], **ivon_kw)
    if method in ("ivon-poco", "ivon-poco-pair"):
        pair = method == "ivon-poco-pair"     # the stability recipe: a mirrored refresh pair
        return pk.IVONPoCo([w], alpha=cfg.alpha, rho1=cfg.rho1, rho2=cfg.rho2,
                           hess_corr_scale=cfg.hess_corr_scale, outer_noise=cfg.outer_noise,
                           refresh_samples=2 if pair else cfg.refresh_samples,
                           refresh_antithetic=pair or cfg.refresh_antithetic,
                           hess_floor=cfg.hess_floor, **ivon_kw)
    raise ValueError(f"unknown method {method!r} (expected one of {METHODS})")


def _has_outer_loop(method: str) -> bool:
    return method in ("svrg", "vsgd-poco", "ivon-poco", "ivon-poco-pair")


def run_method(method: str, prob: Problem, ref: Reference, cfg: Config,
               log=None, optimizer_factory=None, callback=None) -> MethodResult:
    """Train one method for ``cfg.steps`` inner steps from ``w = 0``.

    ``optimizer_factory(w, cfg, n)`` replaces the method's optimizer (for studies of
    variants); ``log`` (a callable taking a string) receives progress lines every
    ``cfg.log_every`` steps; ``callback(step, optimizer, F(m))`` is called at every
    recorded point.  A refused update (the package raises ``FloatingPointError``, or a
    ``ValueError`` on non-finite gradients) ends the run with ``diverged_at`` set; so does
    ``F(m) > cfg.blowup * F(0)`` at a recorded point (a finite blow-up)."""
    n = prob.n
    w = torch.zeros(prob.d, dtype=DTYPE, requires_grad=True)
    opt = (optimizer_factory(w, cfg, n) if optimizer_factory is not None
           else _make_optimizer(method, w, cfg, n))
    outer = (_has_outer_loop(method) if optimizer_factory is None
             else bool(getattr(opt, "_has_correction", False)))
    closure = _BatchGrad(w)
    batches = _Batches(prob.Xtr, prob.ytr, cfg.batch, cfg.seed)
    mega_gen = torch.Generator().manual_seed(cfg.seed + 1)
    mega_full = cfg.megabatch >= n
    mega_n = min(cfg.megabatch, n)
    mega_closure = _BatchGrad(w)
    if mega_full:
        mega_closure.set(prob.Xtr, prob.ytr)
    k_refresh = max(int(g.get("refresh_samples", 1)) for g in opt.param_groups)
    samples = max(int(g.get("mc_samples", 1)) for g in opt.param_groups)
    eval_every = cfg.eval_every or max(cfg.steps // 100, 1)
    res = MethodResult(method, math.nan, math.nan, math.nan, math.nan, 0.0, 0.0, 0)
    evals = 0
    f_star = ref.f
    f_limit = cfg.blowup * objective(w, prob.Xtr, prob.ytr, prob.l2)

    def record(t):
        f = objective(w, prob.Xtr, prob.ytr, prob.l2)
        res.trace.append((t, evals / n, f))
        if callback is not None:
            callback(t, opt, f)
        return f

    class _BlowUp(Exception):
        pass

    eval_time = 0.0
    t_start = time.perf_counter()
    record(0)
    t = 0
    try:
        while t < cfg.steps:
            if (outer and t >= cfg.warmup and (t - cfg.warmup) % cfg.refresh_every == 0):
                te = time.perf_counter()
                if res.trace[-1][0] != t:
                    record(t)
                eval_time += time.perf_counter() - te
                if not mega_full:
                    idx = torch.randperm(n, generator=mega_gen)[:mega_n]
                    mega_closure.set(prob.Xtr[idx], prob.ytr[idx])
                opt.refresh([mega_closure])       # at k_refresh posterior samples
                evals += mega_n * k_refresh
                res.refresh_steps.append(t)
            closure.set(*batches.next())
            active = outer and opt.correction_active()
            opt.step(closure)
            evals += cfg.batch * samples * (2 if active else 1)
            t += 1
            if t % eval_every == 0 or t == cfg.steps:
                te = time.perf_counter()
                f = record(t)
                if log is not None and cfg.log_every and t % cfg.log_every == 0:
                    log(f"  {method:>10s} step {t:>7d}  evals/N {evals / n:9.2f}  F {f:.10f}  "
                        f"gap {(f - f_star) / abs(f_star):.3e}")
                eval_time += time.perf_counter() - te
                if not (f <= f_limit):
                    raise _BlowUp(f"F(m) = {f:.3g} > {cfg.blowup:g} F(0)")
    except (FloatingPointError, ValueError, _BlowUp) as e:
        if isinstance(e, ValueError) and "non-finite" not in str(e):
            raise
        if isinstance(e, _BlowUp):                 # finite, but far off: stop here
            res.diverged_at, res.error = t, f"blow-up: {e}"
        else:                                      # update t + 1 refused, state unchanged
            res.diverged_at, res.error = t + 1, f"{type(e).__name__}: {str(e).split(':')[0]}"
        if log is not None:
            log(f"  {method:>10s} stopped at step {res.diverged_at}: {res.error}")
    res.seconds = time.perf_counter() - t_start - eval_time
    res.steps = t
    m = w.detach().clone()            # the parameters hold the mean between steps
    res.objective = objective(m, prob.Xtr, prob.ytr, prob.l2)
    res.rel_gap = (res.objective - f_star) / abs(f_star)
    res.test_acc = accuracy(m, prob.Xte, prob.yte)
    res.train_acc = accuracy(m, prob.Xtr, prob.ytr)
    res.grad_evals_per_example = evals / n
    if res.trace[-1][0] != t:
        res.trace.append((t, evals / n, res.objective))
    return res


def run_study(cfg: Config, log=None) -> Tuple[Problem, Reference, List[MethodResult]]:
    prob = load_problem(cfg)
    ref = lbfgs_reference(prob, cfg.lbfgs_gtol)
    results = []
    for m in cfg.methods:
        if log is not None:
            log(f"running {m} ...")
        results.append(run_method(m, prob, ref, cfg, log=log))
    return prob, ref, results


# ----------------------------------------------------------------------------- output
_HEAD = ("method", "train objective", "rel. gap", "test acc", "L-BFGS test acc",
         "grad evals/ex", "wall s", "status")


def _rows(ref: Reference, results: Sequence[MethodResult]) -> List[List[str]]:
    rows = [["L-BFGS", f"{ref.f:.10f}", "0", f"{ref.test_acc:.4f}", f"{ref.test_acc:.4f}",
             f"{ref.iterations} it", f"{ref.seconds:.2f}", f"|grad|max {ref.grad_norm:.1e}"]]
    for r in results:
        rows.append([r.method, f"{r.objective:.10f}", f"{r.rel_gap:.3e}", f"{r.test_acc:.4f}",
                     f"{ref.test_acc:.4f}", f"{r.grad_evals_per_example:.1f}",
                     f"{r.seconds:.2f}", r.status])
    return rows


def format_table(ref: Reference, results: Sequence[MethodResult]) -> str:
    rows = [list(_HEAD)] + _rows(ref, results)
    widths = [max(len(r[i]) for r in rows) for i in range(len(_HEAD))]
    line = lambda r: "  ".join(c.rjust(wd) if i else c.ljust(wd)  # noqa: E731
                               for i, (c, wd) in enumerate(zip(r, widths)))
    out = [line(rows[0]), "  ".join("-" * wd for wd in widths)]
    out += [line(r) for r in rows[1:]]
    return "\n".join(out)


def write_csv(path: str, ref: Reference, results: Sequence[MethodResult]) -> None:
    with open(path, "w", newline="") as fh:
        wr = csv.writer(fh)
        wr.writerow(["method", "train_objective", "rel_gap", "test_acc", "lbfgs_test_acc",
                     "grad_evals_per_example", "wall_s", "status", "note"])
        wr.writerow(["lbfgs", repr(ref.f), 0.0, ref.test_acc, ref.test_acc, "", ref.seconds,
                     "ok", f"max|grad F| {ref.grad_norm:.3e}"])
        for r in results:
            wr.writerow([r.method, repr(r.objective), repr(r.rel_gap), r.test_acc,
                         ref.test_acc, r.grad_evals_per_example, r.seconds, r.status,
                         r.error])


# ----------------------------------------------------------------------------- CLI
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m poco_kernels.experiments.logreg",
        description="Sec. 5.1 of the paper: SGD/SVRG/VSGD/VSGD-PoCo/IVON/IVON-PoCo on "
                    "L2-regularised logistic regression against full-batch L-BFGS (float64).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = Config()
    p.add_argument("--preset", choices=sorted(PRESETS), default="quick",
                   help="defaults for --steps/--warmup/--refresh-every/--megabatch: "
                        + "; ".join(f"{k}: {v}" for k, v in PRESETS.items()))
    p.add_argument("--dataset", choices=DATASETS, default=d.dataset)
    p.add_argument("--methods", default=",".join(d.methods),
                   help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--steps", type=int, default=None, help="inner steps (preset)")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate of every method (preset)")
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--refresh-every", type=int, default=None, help="inner steps between "
                   "refreshes (preset)")
    p.add_argument("--warmup", type=int, default=None,
                   help="inner steps before the first refresh (preset)")
    p.add_argument("--megabatch", type=int, default=None,
                   help="mega-batch size; the full training set when larger (preset)")
    p.add_argument("--refresh-samples", type=int, default=d.refresh_samples,
                   help="IVON-PoCo: posterior samples per refresh, averaged (Alg. 3: 1)")
    p.add_argument("--refresh-antithetic", action="store_true",
                   help="IVON-PoCo: refresh samples in mirrored pairs +eps, -eps")
    p.add_argument("--hess-floor", type=float, default=None,
                   help="IVON-PoCo: floor the corrected Hessian estimate at -c (h + wd)")
    p.add_argument("--alpha", type=float, default=d.alpha, help="correction weight")
    p.add_argument("--l2", type=float, default=d.l2, help="lam of the objective = "
                   "weight_decay of every optimizer")
    p.add_argument("--test-size", type=float, default=d.test_size)
    p.add_argument("--n-synthetic", type=int, default=d.n_synthetic)
    p.add_argument("--vsgd-sigma", type=float, default=d.vsgd_sigma)
    p.add_argument("--ivon-lr", type=float, default=None, help="IVON(-PoCo) lr (default --lr)")
    p.add_argument("--ess", type=float, default=None,
                   help="IVON effective sample size (default: --ess-per-example x N)")
    p.add_argument("--ess-per-example", type=float, default=d.ess_per_example,
                   help="ess as a multiple of the number N of training examples")
    p.add_argument("--hess-init", type=float, default=d.hess_init)
    p.add_argument("--beta1", type=float, default=d.beta1)
    p.add_argument("--beta2", type=float, default=d.beta2)
    p.add_argument("--clip-radius", type=float, default=d.clip_radius)
    p.add_argument("--mc-samples", type=int, default=d.mc_samples)
    p.add_argument("--rho1", type=float, default=d.rho1,
                   help="outer momentum on g_out (Alg. 3 convention: 0 = none)")
    p.add_argument("--rho2", type=float, default=d.rho2,
                   help="outer momentum on h_out (Alg. 3 convention: 0 = none)")
    p.add_argument("--hess-corr-scale", type=float, default=d.hess_corr_scale)
    p.add_argument("--outer-noise", choices=("shared", "independent"), default=d.outer_noise)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--eval-every", type=int, default=d.eval_every,
                   help="record F(m) every this many steps (0: steps/100)")
    p.add_argument("--log-every", type=int, default=None,
                   help="progress line every this many steps (default: steps/10; 0: none)")
    p.add_argument("--blowup", type=float, default=d.blowup,
                   help="stop a run as 'blow-up' once F(m) > BLOWUP * F(0) at a recorded step")
    p.add_argument("--csv", default=None, metavar="PATH", help="also write the table as CSV")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads (one thread is fastest for these tiny models)")
    return p


def config_from_args(args: argparse.Namespace) -> Config:
    preset = PRESETS[args.preset]
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"unknown method {m!r} (expected some of {','.join(METHODS)})")
    pick = lambda v, k: preset[k] if v is None else v  # noqa: E731
    steps = pick(args.steps, "steps")
    cfg = Config(
        dataset=args.dataset, test_size=args.test_size, l2=args.l2,
        n_synthetic=args.n_synthetic, methods=methods, steps=steps, lr=pick(args.lr, "lr"),
        batch=args.batch, refresh_every=pick(args.refresh_every, "refresh_every"),
        warmup=pick(args.warmup, "warmup"), megabatch=pick(args.megabatch, "megabatch"),
        refresh_samples=args.refresh_samples, refresh_antithetic=args.refresh_antithetic,
        hess_floor=args.hess_floor, ess_per_example=args.ess_per_example,
        alpha=args.alpha, vsgd_sigma=args.vsgd_sigma, ivon_lr=args.ivon_lr, ess=args.ess,
        hess_init=args.hess_init, beta1=args.beta1, beta2=args.beta2,
        clip_radius=args.clip_radius, mc_samples=args.mc_samples, rho1=args.rho1,
        rho2=args.rho2, hess_corr_scale=args.hess_corr_scale, outer_noise=args.outer_noise,
        seed=args.seed, eval_every=args.eval_every, blowup=args.blowup,
        log_every=max(steps // 10, 1) if args.log_every is None else args.log_every)
    for k in ("steps", "batch", "refresh_every", "megabatch", "refresh_samples"):
        if getattr(cfg, k) < 1:
            raise SystemExit(f"--{k.replace('_', '-')} must be positive")
    if cfg.warmup < 0:
        raise SystemExit("--warmup must be non-negative")
    return cfg


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    cfg = config_from_args(args)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _main(args, cfg)
    finally:
        torch.set_num_threads(threads)


def _main(args: argparse.Namespace, cfg: Config) -> int:
    log = lambda s: print(s, flush=True)  # noqa: E731
    t0 = time.perf_counter()
    prob = load_problem(cfg)
    ref = lbfgs_reference(prob, cfg.lbfgs_gtol)
    log(f"dataset {cfg.dataset}: {prob.n} train / {prob.Xte.shape[0]} test examples, "
        f"d = {prob.d} (incl. bias), lam = {cfg.l2}, float64")
    log(f"settings: steps {cfg.steps}, lr {cfg.lr}, batch {cfg.batch}, warm-up {cfg.warmup}, "
        f"refresh every {cfg.refresh_every}, mega-batch {min(cfg.megabatch, prob.n)}, "
        f"alpha {cfg.alpha}; IVON: lr {cfg.lr if cfg.ivon_lr is None else cfg.ivon_lr}, "
        f"ess {cfg.ess_per_example * prob.n if cfg.ess is None else cfg.ess:g}, "
        f"hess_init {cfg.hess_init}, beta2 {cfg.beta2}, hess_corr_scale {cfg.hess_corr_scale}, "
        f"rho {cfg.rho1}/{cfg.rho2}, outer_noise {cfg.outer_noise}, "
        f"refresh samples {cfg.refresh_samples}; VSGD sigma {cfg.vsgd_sigma}; seed {cfg.seed}")
    log(f"L-BFGS-B: F* = {ref.f:.12f}, max|grad F| = {ref.grad_norm:.2e}, "
        f"test acc {ref.test_acc:.4f}")
    results = []
    for m in cfg.methods:
        log(f"running {m} ...")
        results.append(run_method(m, prob, ref, cfg, log=log))
    print()
    print(format_table(ref, results))
    print(f"\ntotal wall time {time.perf_counter() - t0:.1f} s")
    if args.csv:
        write_csv(args.csv, ref, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
