"""The paper's logistic-regression study (Sec. 5.1, Fig. 2 and 4), rerun and judged.

``python -m poco_kernels.experiments.logreg`` trains SGD, SVRG, VSGD, VSGD-PoCo, IVON,
IVON-PoCo (Alg. 3 as written, and with the package's antithetic refresh pair) and
VON-PoCo (where the dimension allows) on the L2-regularised logistic loss

    F(w) = (1/N) sum_i loss(x_i, y_i; w) + (lam / 2) ||w||^2

(binary: ``log(1 + exp(x^T w)) - y x^T w``; K > 2 classes: softmax cross-entropy with a
weight vector per class), against a full-batch L-BFGS-B minimiser of the SAME ``F``.  It
writes, to ``--out-dir``:

* ``<dataset>_curves.png``: test accuracy and train-objective gap against gradient
  evaluations per example, one curve per method, first-order methods (Fig. 4) and
  IVON-type methods (Fig. 2) side by side, the L-BFGS accuracy as a dashed line and the
  refreshes (mega-batch gradients) as grey bars;
* ``<dataset>_report.md``: the settings, the results table (final train objective, its
  relative gap to L-BFGS, test accuracy, gradient evaluations per example) and, for each
  of the paper's claims, whether it holds here and the numbers that decide it
  (:mod:`poco_kernels.experiments.claims`);
* ``<dataset>_results.csv`` and ``<dataset>_trace.csv``: the table, and every recorded
  point of every run.

Settings.  The defaults are the paper's (Sec. 5.1): constant lr 0.01 for every method,
batch 5, a refresh every 10,000 steps on a mega-batch of 50,000 (the full training set
when smaller) after 20,000 warm-up steps, IVON-PoCo without outer momentum and with the
Hessian-correction term scaled by 0.01.  The paper does not state the run length, the
regulariser or IVON's effective sample size: here 80,000 steps (six refreshes),
``lam = 0.01`` and ``ess = 100 N`` (with ``ess = N`` and 455 examples the posterior is
wide, sigma ~ 0.25 per weight, and the objective at the mean floors near
``sum_j H_jj sigma_j^2 / 2``).  VON-PoCo (Alg. 4, a dense ``d x d`` precision, a Hessian
per gradient) is not in the paper's Sec. 5.1: it runs with IVON's lr, ess and batch, its
precision rate ``beta`` = lr, on a schedule scaled by ``--von-schedule`` (0.1: a tenth of
the steps, warm-up and refresh interval; a Newton method needs fewer steps and each costs
a Hessian), and only where ``d <= --von-max-dim``.  ``--preset quick`` is a 12,000-step
look with lr 0.05.  Every setting has a flag.

Everything is float64 (data, parameters, optimizer state; the package's noise is drawn in
float32 and cast): the reference backend.  The regulariser enters every optimizer as its
``weight_decay`` (IVON's ``delta``; VON-PoCo's loss carries it, as Alg. 4 wants), so the
data loss they see is the mean logistic loss; its gradients are computed in closed form
(``X_B^T (p(X_B w) - y_B) / B``).  All methods see the same sequence of mini-batches
(shuffled epochs, seeded by ``--seed``).  Gradient evaluations count ``batch`` per
gradient, twice once the correction is active, and a refresh counts its mega-batch (Sec.
4.3 of the paper).  An update the package refuses (non-finite values) ends a run as
``diverged@k``; an objective above ``--blowup`` times ``F(0)`` ends it as ``blow-up@k``.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from . import datasets

__all__ = ["Config", "Problem", "Reference", "MethodResult", "PRESETS", "METHODS",
           "FIRST_ORDER", "IVON_TYPE", "DATASETS", "load_problem", "objective", "accuracy",
           "lbfgs_reference", "gradient", "run_method", "run_study", "format_table",
           "write_csv", "write_trace", "main"]

DTYPE = torch.float64
FIRST_ORDER = ("sgd", "svrg", "vsgd", "vsgd-poco")
IVON_TYPE = ("ivon", "ivon-poco", "ivon-poco-pair", "von-poco")
METHODS = FIRST_ORDER + IVON_TYPE
DATASETS = datasets.DATASETS


# ----------------------------------------------------------------------------- config
@dataclass
class Config:
    """Settings of one study; the defaults are the paper's (the ``paper`` preset)."""
    dataset: str = "breast_cancer"
    data_dir: str = "data"               # where mnist/, covertype/, cifar10/ live
    max_train: Optional[int] = None      # stratified subset of the training set
    features: str = "standardize"        # or "scale" (datasets.load)
    test_size: float = 0.2
    l2: float = 1e-2                     # lam of F (and every optimizer's weight_decay)
    n_synthetic: int = 20_000            # examples of the 'synthetic' data set
    methods: Tuple[str, ...] = METHODS
    steps: int = 80_000
    lr: float = 0.01
    batch: int = 5
    refresh_every: int = 10_000
    warmup: int = 20_000
    megabatch: int = 50_000              # the full training set when larger
    refresh_samples: int = 1             # posterior samples per refresh (IVON-PoCo; Alg. 3: 1)
    refresh_antithetic: bool = False     # mirrored refresh pairs (ivon-poco-pair always)
    hess_floor: Optional[float] = None   # IVON-PoCo: corrected hhat >= -c (h + wd)
    alpha: float = 1.0
    # VSGD
    vsgd_sigma: float = 0.01
    # IVON / IVON-PoCo
    ivon_lr: Optional[float] = None      # None: lr
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
    # VON-PoCo
    von_lr: Optional[float] = None       # None: the IVON lr
    von_beta: Optional[float] = None     # None: the IVON lr
    von_schedule: float = 0.1            # fraction of steps / warm-up / refresh interval
    von_max_dim: int = 128               # larger problems skip VON-PoCo
    # bookkeeping
    seed: int = 0
    eval_every: int = 0                  # 0: steps // 400 (at least 1)
    log_every: int = 0                   # 0: no progress lines
    lbfgs_gtol: float = 1e-10
    blowup: float = 10.0                 # F(m) > blowup * F(0): the run has blown up
    reach_tol: float = 1e-6              # relative gap at which a method "reaches" L-BFGS


PRESETS: Dict[str, Dict[str, object]] = {
    "paper": dict(steps=80_000, warmup=20_000, refresh_every=10_000, megabatch=50_000,
                  lr=0.01),
    "quick": dict(steps=12_000, warmup=2_000, refresh_every=2_000, megabatch=50_000,
                  lr=0.05),
}


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


def _residual(w: torch.Tensor, X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
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
        return (X.T @ _residual(w, X, y)).reshape(-1) / X.shape[0] + l2 * w


def accuracy(w: torch.Tensor, X: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        z = _logits(w.detach(), X)
        pred = (z > 0).to(y.dtype) if z.dim() == 1 else z.argmax(1)
        return float((pred == y).to(DTYPE).mean())


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
    return Reference(w, objective(w, prob.Xtr, prob.ytr, lam), gn,
                     accuracy(w, prob.Xte, prob.yte), accuracy(w, prob.Xtr, prob.ytr),
                     int(res.nit), secs)


# ----------------------------------------------------------------------------- training
class _BatchGrad:
    """The closure of every step: writes the mean data-loss gradient of the current batch
    (``X_B^T (p(X_B w) - y_B) / |B|``, without the regulariser) into ``w.grad`` at whatever
    the optimizer put into ``w``.  The batch is set by the loop; nothing is rebuilt."""

    def __init__(self, w: torch.Tensor):
        self.w = w
        self.X = self.y = None
        self.inv_b = 1.0

    def set(self, X: torch.Tensor, y: torch.Tensor) -> None:
        self.X, self.y, self.inv_b = X, y, 1.0 / X.shape[0]

    def __call__(self):
        with torch.no_grad():
            g = (self.X.T @ _residual(self.w.detach(), self.X, self.y)).reshape(-1)
            g *= self.inv_b
        self.w.grad = g
        return None


class _BatchLoss(_BatchGrad):
    """VON-PoCo's closure: returns the batch's mean loss PLUS the regulariser (Alg. 4's
    losses carry ``l_0 / N``), with its graph; the optimizer differentiates it twice."""

    def __init__(self, w: torch.Tensor, l2: float):
        super().__init__(w)
        self.l2 = l2

    def __call__(self):
        return data_loss(self.w, self.X, self.y) + 0.5 * self.l2 * self.w.square().sum()


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
    skipped: str = ""                           # why the method did not run
    refresh_steps: List[int] = field(default_factory=list)
    # grad evals per example just before and just after each refresh's mega-batch
    refresh_evals: List[Tuple[float, float]] = field(default_factory=list)
    # (inner step, grad evals per example, F(m), test accuracy); also at each refresh
    trace: List[Tuple[int, float, float, float]] = field(default_factory=list)
    settings: str = ""

    @property
    def status(self) -> str:
        """``ok``; ``diverged@k``: the package refused update k (non-finite values);
        ``blow-up@k``: F(m) exceeded ``blowup * F(0)`` at the recorded step k;
        ``skipped``: the method did not run (see ``skipped``)."""
        if self.skipped:
            return "skipped"
        if self.diverged_at is None:
            return "ok"
        kind = "blow-up" if self.error.startswith("blow-up") else "diverged"
        return f"{kind}@{self.diverged_at}"


def _ivon_kwargs(cfg: Config, n: int) -> dict:
    return dict(lr=cfg.lr if cfg.ivon_lr is None else cfg.ivon_lr,
                ess=cfg.ess_per_example * n if cfg.ess is None else cfg.ess,
                hess_init=cfg.hess_init, beta1=cfg.beta1, beta2=cfg.beta2,
                weight_decay=cfg.l2, mc_samples=cfg.mc_samples, clip_radius=cfg.clip_radius,
                seed=cfg.seed)


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
    ivon_kw = _ivon_kwargs(cfg, n)
    if method == "ivon":
        return pk.IVON([w], **ivon_kw)
    if method in ("ivon-poco", "ivon-poco-pair"):
        pair = method == "ivon-poco-pair"     # the stability recipe: a mirrored refresh pair
        return pk.IVONPoCo([w], alpha=cfg.alpha, rho1=cfg.rho1, rho2=cfg.rho2,
                           hess_corr_scale=cfg.hess_corr_scale, outer_noise=cfg.outer_noise,
                           refresh_samples=2 if pair else cfg.refresh_samples,
                           refresh_antithetic=pair or cfg.refresh_antithetic,
                           hess_floor=cfg.hess_floor, **ivon_kw)
    if method == "von-poco":
        lr = ivon_kw["lr"]
        return pk.VONPoCo([w], ess=ivon_kw["ess"], lr=lr if cfg.von_lr is None else cfg.von_lr,
                          beta=lr if cfg.von_beta is None else cfg.von_beta, alpha=cfg.alpha,
                          prior_precision=lam, min_eig=lam, rho1=cfg.rho1, rho2=cfg.rho2,
                          seed=cfg.seed)
    raise ValueError(f"unknown method {method!r} (expected one of {METHODS})")


def _has_outer_loop(method: str) -> bool:
    return method in ("svrg", "vsgd-poco", "ivon-poco", "ivon-poco-pair", "von-poco")


def _schedule(method: str, cfg: Config) -> Tuple[int, int, int]:
    """(steps, warm-up, refresh interval) of a method: VON-PoCo's scaled by von_schedule."""
    if method != "von-poco":
        return cfg.steps, cfg.warmup, cfg.refresh_every
    s = cfg.von_schedule
    return (max(1, round(cfg.steps * s)), max(0, round(cfg.warmup * s)),
            max(1, round(cfg.refresh_every * s)))


def run_method(method: str, prob: Problem, ref: Reference, cfg: Config,
               log=None, optimizer_factory=None, callback=None) -> MethodResult:
    """Train one method from ``w = 0`` for its inner steps (:func:`_schedule`).

    ``optimizer_factory(w, cfg, n)`` replaces the method's optimizer (for studies of
    variants); ``log`` (a callable taking a string) receives progress lines every
    ``cfg.log_every`` steps; ``callback(step, optimizer, F(m))`` is called at every
    recorded point.  A refused update (the package raises ``FloatingPointError``, or a
    ``ValueError`` on non-finite gradients) ends the run with ``diverged_at`` set; so does
    ``F(m) > cfg.blowup * F(0)`` at a recorded point (a finite blow-up)."""
    n = prob.n
    steps, warmup, refresh_every = _schedule(method, cfg)
    res = MethodResult(method, math.nan, math.nan, math.nan, math.nan, 0.0, 0.0, 0)
    if method == "von-poco" and optimizer_factory is None and prob.d > cfg.von_max_dim:
        res.skipped = (f"d = {prob.d} > --von-max-dim {cfg.von_max_dim} (a dense d x d "
                       "precision and a Hessian per gradient)")
        if log is not None:
            log(f"  {method:>14s} skipped: {res.skipped}")
        return res
    w = torch.zeros(prob.d, dtype=DTYPE, requires_grad=True)
    opt = (optimizer_factory(w, cfg, n) if optimizer_factory is not None
           else _make_optimizer(method, w, cfg, n))
    outer = (_has_outer_loop(method) if optimizer_factory is None
             else bool(getattr(opt, "_has_correction", False)))
    make_closure = ((lambda: _BatchLoss(w, prob.l2)) if method == "von-poco"
                    else (lambda: _BatchGrad(w)))
    closure = make_closure()
    batches = _Batches(prob.Xtr, prob.ytr, cfg.batch, cfg.seed)
    mega_gen = torch.Generator().manual_seed(cfg.seed + 1)
    mega_full = cfg.megabatch >= n
    mega_n = min(cfg.megabatch, n)
    mega_closure = make_closure()
    if mega_full:
        mega_closure.set(prob.Xtr, prob.ytr)
    k_refresh = max(int(g.get("refresh_samples", 1)) for g in opt.param_groups)
    samples = max(int(g.get("mc_samples", 1)) for g in opt.param_groups)
    eval_every = cfg.eval_every or max(steps // 400, 1)
    evals = 0
    f_star = ref.f
    f_limit = cfg.blowup * objective(w, prob.Xtr, prob.ytr, prob.l2)

    def record(t):
        f = objective(w, prob.Xtr, prob.ytr, prob.l2)
        res.trace.append((t, evals / n, f, accuracy(w, prob.Xte, prob.yte)))
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
        while t < steps:
            if outer and t >= warmup and (t - warmup) % refresh_every == 0:
                te = time.perf_counter()
                if res.trace[-1][0] != t:
                    record(t)
                eval_time += time.perf_counter() - te
                if not mega_full:
                    idx = torch.randperm(n, generator=mega_gen)[:mega_n]
                    mega_closure.set(prob.Xtr[idx], prob.ytr[idx])
                before = evals / n
                opt.refresh([mega_closure])       # at k_refresh posterior samples
                evals += mega_n * k_refresh
                res.refresh_steps.append(t)
                res.refresh_evals.append((before, evals / n))
            closure.set(*batches.next())
            active = outer and opt.correction_active()
            opt.step(closure)
            evals += cfg.batch * samples * (2 if active else 1)
            t += 1
            if t % eval_every == 0 or t == steps:
                te = time.perf_counter()
                f = record(t)
                if log is not None and cfg.log_every and t % cfg.log_every == 0:
                    log(f"  {method:>14s} step {t:>7d}  evals/N {evals / n:9.2f}  "
                        f"F {f:.10f}  gap {(f - f_star) / abs(f_star):.3e}  "
                        f"test acc {res.trace[-1][3]:.4f}")
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
            log(f"  {method:>14s} stopped at step {res.diverged_at}: {res.error}")
    res.seconds = time.perf_counter() - t_start - eval_time
    res.steps = t
    m = w.detach().clone()            # the parameters hold the mean between steps
    res.objective = objective(m, prob.Xtr, prob.ytr, prob.l2)
    res.rel_gap = (res.objective - f_star) / abs(f_star)
    res.test_acc = accuracy(m, prob.Xte, prob.yte)
    res.train_acc = accuracy(m, prob.Xtr, prob.ytr)
    res.grad_evals_per_example = evals / n
    if res.trace[-1][0] != t:
        res.trace.append((t, evals / n, res.objective, res.test_acc))
    if method == "von-poco":
        res.settings = (f"{steps} steps, warm-up {warmup}, refresh every {refresh_every} "
                        f"(--von-schedule {cfg.von_schedule})")
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
        if r.skipped:
            rows.append([r.method, "", "", "", f"{ref.test_acc:.4f}", "", "", "skipped"])
            continue
        rows.append([r.method, f"{r.objective:.10f}", f"{r.rel_gap:.3e}", f"{r.test_acc:.4f}",
                     f"{ref.test_acc:.4f}", f"{r.grad_evals_per_example:.1f}",
                     f"{r.seconds:.2f}", r.status])
    return rows


def format_table(ref: Reference, results: Sequence[MethodResult], markdown: bool = False) -> str:
    rows = [list(_HEAD)] + _rows(ref, results)
    if markdown:
        cell = lambda c: c.replace("|", "\\|")  # noqa: E731
        out = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(_HEAD)]
        return "\n".join(out + ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows[1:]])
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
                         r.skipped or r.error or r.settings])


def write_trace(path: str, ref: Reference, results: Sequence[MethodResult]) -> None:
    """Every recorded point: method, step, grad evals per example, F(m), relative gap,
    test accuracy, and whether a refresh was taken at that step."""
    with open(path, "w", newline="") as fh:
        wr = csv.writer(fh)
        wr.writerow(["method", "step", "grad_evals_per_example", "train_objective",
                     "rel_gap", "test_acc", "refresh"])
        for r in results:
            refreshes = set(r.refresh_steps)
            for t, e, f, a in r.trace:
                wr.writerow([r.method, t, f"{e:.6g}", repr(f), f"{(f - ref.f) / abs(ref.f):.6e}",
                             f"{a:.6f}", int(t in refreshes)])


def settings_text(cfg: Config, prob: Problem) -> str:
    ivon = _ivon_kwargs(cfg, prob.n)
    return (f"steps {cfg.steps}, lr {cfg.lr}, batch {cfg.batch}, warm-up {cfg.warmup}, refresh "
            f"every {cfg.refresh_every}, mega-batch {min(cfg.megabatch, prob.n)}, alpha "
            f"{cfg.alpha}, lam {cfg.l2}; VSGD sigma {cfg.vsgd_sigma}; IVON: lr {ivon['lr']}, ess "
            f"{ivon['ess']:g}, hess_init {cfg.hess_init}, beta1 {cfg.beta1}, beta2 {cfg.beta2}; "
            f"IVON-PoCo: hess_corr_scale {cfg.hess_corr_scale}, rho {cfg.rho1}/{cfg.rho2}, "
            f"outer_noise {cfg.outer_noise}, refresh samples {cfg.refresh_samples} (pair: 2 "
            f"antithetic); VON-PoCo: schedule x{cfg.von_schedule}, max dim {cfg.von_max_dim}; "
            f"seed {cfg.seed}")


def write_report(path: str, cfg: Config, prob: Problem, ref: Reference,
                 results: Sequence[MethodResult], claims, seconds: float,
                 plot: Optional[str]) -> None:
    from . import claims as C
    lines = [f"# Logistic regression: {prob.name}", "",
             f"{prob.description}; lam = {prob.l2}; {prob.d} weights.", "",
             f"Settings: {settings_text(cfg, prob)}.", "",
             f"L-BFGS-B: F* = {ref.f:.12f}, max|grad F| = {ref.grad_norm:.1e}, "
             f"test accuracy {ref.test_acc:.4f}, train accuracy {ref.train_acc:.4f}.", "",
             format_table(ref, results, markdown=True), "",
             "## The paper's claims, here", "", C.format_claims(claims, markdown=True), "",
             C.CRITERIA, ""]
    if plot:
        lines += [f"![curves]({os.path.basename(plot)})", ""]
    lines += [f"Total wall time {seconds:.0f} s."]
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")


# ----------------------------------------------------------------------------- CLI
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m poco_kernels.experiments.logreg",
        description="Sec. 5.1 of the paper: SGD/SVRG/VSGD/VSGD-PoCo/IVON/IVON-PoCo/VON-PoCo "
                    "on L2-regularised logistic regression against full-batch L-BFGS "
                    "(float64): plots, a table, and the paper's claims checked.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = Config()
    p.add_argument("--preset", choices=sorted(PRESETS), default="paper",
                   help="defaults for --steps/--warmup/--refresh-every/--megabatch/--lr: "
                        + "; ".join(f"{k}: {v}" for k, v in PRESETS.items()))
    p.add_argument("--dataset", choices=DATASETS, default=d.dataset,
                   help="bundled with scikit-learn, or read from --data-dir (mnist, "
                        "covertype, cifar10; see poco_kernels/experiments/datasets.py)")
    p.add_argument("--data-dir", default=d.data_dir,
                   help="folder holding mnist/, covertype/, cifar10/ (nothing is downloaded)")
    p.add_argument("--max-train", type=int, default=None,
                   help="keep a stratified subset of this many training examples")
    p.add_argument("--features", choices=datasets.FEATURES, default=d.features,
                   help="standardize every feature, or only scale it to [-1, 1] (uncentred)")
    p.add_argument("--methods", default=",".join(d.methods),
                   help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--out-dir", default="logreg_out",
                   help="where the plot, report and CSVs go ('' for none)")
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
    p.add_argument("--von-lr", type=float, default=None, help="VON-PoCo lr (default: IVON's)")
    p.add_argument("--von-beta", type=float, default=None,
                   help="VON-PoCo precision rate (default: IVON's lr)")
    p.add_argument("--von-schedule", type=float, default=d.von_schedule,
                   help="VON-PoCo's steps, warm-up and refresh interval as a fraction of "
                        "the others'")
    p.add_argument("--von-max-dim", type=int, default=d.von_max_dim,
                   help="skip VON-PoCo above this many weights")
    p.add_argument("--reach-tol", type=float, default=d.reach_tol,
                   help="relative objective gap at which a method has reached L-BFGS, i.e. "
                        "matches its objective to about 6 digits (the claims)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--eval-every", type=int, default=d.eval_every,
                   help="record F(m) and the test accuracy every this many steps "
                        "(0: steps/400)")
    p.add_argument("--log-every", type=int, default=None,
                   help="progress line every this many steps (default: steps/10; 0: none)")
    p.add_argument("--blowup", type=float, default=d.blowup,
                   help="stop a run as 'blow-up' once F(m) > BLOWUP * F(0) at a recorded step")
    p.add_argument("--csv", default=None, metavar="PATH", help="also write the table here")
    p.add_argument("--no-plot", action="store_true", help="no PNG (no matplotlib needed)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads (one thread is fastest for these small models)")
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
        dataset=args.dataset, data_dir=args.data_dir, max_train=args.max_train,
        features=args.features,
        test_size=args.test_size, l2=args.l2, n_synthetic=args.n_synthetic, methods=methods,
        steps=steps, lr=pick(args.lr, "lr"), batch=args.batch,
        refresh_every=pick(args.refresh_every, "refresh_every"),
        warmup=pick(args.warmup, "warmup"), megabatch=pick(args.megabatch, "megabatch"),
        refresh_samples=args.refresh_samples, refresh_antithetic=args.refresh_antithetic,
        hess_floor=args.hess_floor, ess_per_example=args.ess_per_example,
        alpha=args.alpha, vsgd_sigma=args.vsgd_sigma, ivon_lr=args.ivon_lr, ess=args.ess,
        hess_init=args.hess_init, beta1=args.beta1, beta2=args.beta2,
        clip_radius=args.clip_radius, mc_samples=args.mc_samples, rho1=args.rho1,
        rho2=args.rho2, hess_corr_scale=args.hess_corr_scale, outer_noise=args.outer_noise,
        von_lr=args.von_lr, von_beta=args.von_beta, von_schedule=args.von_schedule,
        von_max_dim=args.von_max_dim, reach_tol=args.reach_tol,
        seed=args.seed, eval_every=args.eval_every, blowup=args.blowup,
        log_every=max(steps // 10, 1) if args.log_every is None else args.log_every)
    for k in ("steps", "batch", "refresh_every", "megabatch", "refresh_samples"):
        if getattr(cfg, k) < 1:
            raise SystemExit(f"--{k.replace('_', '-')} must be positive")
    if cfg.warmup < 0:
        raise SystemExit("--warmup must be non-negative")
    if not 0 < cfg.von_schedule <= 1:
        raise SystemExit("--von-schedule must be in (0, 1]")
    return cfg


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    cfg = config_from_args(args)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _main(args, cfg)
    except datasets.MissingDataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)


def _main(args: argparse.Namespace, cfg: Config) -> int:
    from . import claims as C
    log = lambda s: print(s, flush=True)  # noqa: E731
    t0 = time.perf_counter()
    prob = load_problem(cfg)
    ref = lbfgs_reference(prob, cfg.lbfgs_gtol)
    log(f"{prob.description}; lam = {cfg.l2}; {prob.d} weights; float64")
    log(f"settings: {settings_text(cfg, prob)}")
    log(f"L-BFGS-B: F* = {ref.f:.12f}, max|grad F| = {ref.grad_norm:.2e}, "
        f"test acc {ref.test_acc:.4f}")
    results = []
    for m in cfg.methods:
        tm = time.perf_counter()
        log(f"running {m} ...")
        results.append(run_method(m, prob, ref, cfg, log=log))
        log(f"  {m} done in {time.perf_counter() - tm:.1f} s ({results[-1].status})")
    claims = C.evaluate(results, ref, cfg, prob)
    print()
    print(format_table(ref, results))
    print()
    print(C.format_claims(claims))
    seconds = time.perf_counter() - t0
    if args.csv:
        write_csv(args.csv, ref, results)
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        stem = os.path.join(args.out_dir, prob.name)
        plot = None
        if not args.no_plot:
            from .plots import plot_study
            plot = plot_study(stem + "_curves.png", prob, ref, results, cfg)
        write_csv(stem + "_results.csv", ref, results)
        write_trace(stem + "_trace.csv", ref, results)
        write_report(stem + "_report.md", cfg, prob, ref, results, claims, seconds, plot)
        log(f"\nwrote {stem}_report.md, _results.csv, _trace.csv"
            + (", _curves.png" if plot else ""))
    print(f"\ntotal wall time {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
