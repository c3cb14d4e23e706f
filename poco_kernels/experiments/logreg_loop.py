"""The logistic-regression study's loop: :func:`run_method` trains one method from
``w = 0`` on shuffled mini-batches (refreshing on a mega-batch where the method has an
outer loop), records ``F(m)`` and the test accuracy along the way, and ends in a
:class:`MethodResult`; :func:`run_study` runs every method of a :class:`Config`."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from .logreg_config import Config
from .logreg_methods import has_outer_loop, make_optimizer, method_schedule
from .logreg_problem import DTYPE, Oracle, Problem, accuracy, data_loss, lbfgs_oracle, \
    load_problem, objective, residual

__all__ = ["MethodResult", "run_method", "run_study"]


# ----------------------------------------------------------------------------- batches
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
            g = (self.X.T @ residual(self.w.detach(), self.X, self.y)).reshape(-1)
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


# ----------------------------------------------------------------------------- results
@dataclass
class MethodResult:
    """One method's run: its final objective, gap to the L-BFGS optimum and accuracies,
    its cost, how it ended, its refreshes and its recorded points."""
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
    # (inner step, grad evals per example, relative gap (F(m) - F*) / |F*|) at 10x the
    # trace's resolution (``cfg.fine_every``): the "faster" claim's first-reach brackets
    gap_trace: List[Tuple[int, float, float]] = field(default_factory=list)
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


# ----------------------------------------------------------------------------- training
class _MegaBatch:
    """The refresh's mega-batch, in a closure like the steps': the full training set when
    ``cfg.megabatch >= N`` (set once), else ``cfg.megabatch`` examples drawn without
    replacement at each refresh (``torch.Generator`` seeded by ``seed + 1``)."""

    def __init__(self, prob: Problem, cfg: Config, closure: _BatchGrad):
        self.prob, self.closure = prob, closure
        self.gen = torch.Generator().manual_seed(cfg.seed + 1)
        self.full = cfg.megabatch >= prob.n
        self.size = min(cfg.megabatch, prob.n)
        if self.full:
            closure.set(prob.Xtr, prob.ytr)

    def next(self) -> _BatchGrad:
        if not self.full:
            idx = torch.randperm(self.prob.n, generator=self.gen)[:self.size]
            self.closure.set(self.prob.Xtr[idx], self.prob.ytr[idx])
        return self.closure


class _BlowUp(Exception):
    """``F(m) > cfg.blowup * F(0)`` at a recorded point: finite, but far off."""


def run_method(method: str, prob: Problem, oracle: Oracle, cfg: Config,
               log=None, optimizer_factory=None, callback=None) -> MethodResult:
    """Train one method from ``w = 0`` for its inner steps
    (:func:`~.logreg_methods.method_schedule`); ``oracle``: the L-BFGS optimum the gaps
    are measured to.

    ``optimizer_factory(w, cfg, n)`` replaces the method's optimizer (for studies of
    variants); ``log`` (a callable taking a string) receives progress lines every
    ``cfg.log_every`` steps; ``callback(step, optimizer, F(m))`` is called at every
    recorded point.  A refused update (the package raises ``FloatingPointError``, or a
    ``ValueError`` on non-finite gradients) ends the run with ``diverged_at`` set; so does
    ``F(m) > cfg.blowup * F(0)`` at a recorded point (a finite blow-up)."""
    n = prob.n
    steps, warmup, refresh_every = method_schedule(method, cfg)
    res = MethodResult(method, math.nan, math.nan, math.nan, math.nan, 0.0, 0.0, 0)
    if method == "von-poco" and optimizer_factory is None and prob.d > cfg.von_max_dim:
        res.skipped = (f"d = {prob.d} > --von-max-dim {cfg.von_max_dim} (a dense d x d "
                       "precision and a Hessian per gradient)")
        if log is not None:
            log(f"  {method:>14s} skipped: {res.skipped}")
        return res
    w = torch.zeros(prob.d, dtype=DTYPE, requires_grad=True)
    opt = (optimizer_factory(w, cfg, n) if optimizer_factory is not None
           else make_optimizer(method, w, cfg, n))
    outer = (has_outer_loop(method) if optimizer_factory is None
             else bool(getattr(getattr(opt, "rule", None), "has_correction", False)))
    make_closure = ((lambda: _BatchLoss(w, prob.l2)) if method == "von-poco"
                    else (lambda: _BatchGrad(w)))
    closure = make_closure()
    batches = _Batches(prob.Xtr, prob.ytr, cfg.batch, cfg.seed)
    mega = _MegaBatch(prob, cfg, make_closure())
    k_refresh = max(int(g.get("refresh_samples", 1)) for g in opt.param_groups)
    samples = max(int(g.get("mc_samples", 1)) for g in opt.param_groups)
    eval_every = cfg.eval_every or max(steps // 400, 1)
    fine_every = cfg.fine_every or max(eval_every // 10, 1)
    evals = 0
    f_star = oracle.f
    f_limit = cfg.blowup * objective(w, prob.Xtr, prob.ytr, prob.l2)

    def gap_point(t, f=None):
        if f is None:
            f = objective(w, prob.Xtr, prob.ytr, prob.l2)
        if not res.gap_trace or res.gap_trace[-1][0] != t:
            res.gap_trace.append((t, evals / n, (f - f_star) / abs(f_star)))
        return f

    def record(t):
        f = objective(w, prob.Xtr, prob.ytr, prob.l2)
        res.trace.append((t, evals / n, f, accuracy(w, prob.Xte, prob.yte)))
        gap_point(t, f)
        if callback is not None:
            callback(t, opt, f)
        return f

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
                mega_closure = mega.next()
                before = evals / n
                opt.refresh([mega_closure])       # at k_refresh posterior samples
                evals += mega.size * k_refresh
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
            elif t % fine_every == 0:
                te = time.perf_counter()
                gap_point(t)
                eval_time += time.perf_counter() - te
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
    _finish(res, w, prob, oracle, t, evals)
    if method == "von-poco":
        res.settings = (f"{steps} steps, warm-up {warmup}, refresh every {refresh_every} "
                        f"(--von-schedule {cfg.von_schedule})")
    return res


def _finish(res: MethodResult, w: torch.Tensor, prob: Problem, oracle: Oracle, t: int,
            evals: int) -> None:
    """The result at the mean ``w`` after ``t`` steps and ``evals`` gradient evaluations:
    objective, gap to the L-BFGS optimum, accuracies, and the last point of the trace."""
    n = prob.n
    res.steps = t
    m = w.detach().clone()            # the parameters hold the mean between steps
    res.objective = objective(m, prob.Xtr, prob.ytr, prob.l2)
    res.rel_gap = (res.objective - oracle.f) / abs(oracle.f)
    res.test_acc = accuracy(m, prob.Xte, prob.yte)
    res.train_acc = accuracy(m, prob.Xtr, prob.ytr)
    res.grad_evals_per_example = evals / n
    if res.trace[-1][0] != t:
        res.trace.append((t, evals / n, res.objective, res.test_acc))
    if not res.gap_trace or res.gap_trace[-1][0] != t:
        res.gap_trace.append((t, evals / n, res.rel_gap))


def run_study(cfg: Config, log=None) -> Tuple[Problem, Oracle, List[MethodResult]]:
    """Every method of ``cfg`` on its data set, after the L-BFGS optimum."""
    prob = load_problem(cfg)
    oracle = lbfgs_oracle(prob, cfg.lbfgs_gtol)
    results = []
    for m in cfg.methods:
        if log is not None:
            log(f"running {m} ...")
        results.append(run_method(m, prob, oracle, cfg, log=log))
    return prob, oracle, results
