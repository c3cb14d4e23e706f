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
float32 and cast): the torch backend.  The regulariser enters every optimizer as its
``weight_decay`` (IVON's ``delta``; VON-PoCo's loss carries it, as Alg. 4 wants), so the
data loss they see is the mean logistic loss; its gradients are computed in closed form
(``X_B^T (p(X_B w) - y_B) / B``).  All methods see the same sequence of mini-batches
(shuffled epochs, seeded by ``--seed``).  Gradient evaluations count ``batch`` per
gradient, twice once the correction is active, and a refresh counts its mega-batch (Sec.
4.3 of the paper).  An update the package refuses (non-finite values) ends a run as
``diverged@k``; an objective above ``--blowup`` times ``F(0)`` ends it as ``blow-up@k``.

The code, by role: :mod:`.logreg_config` (the methods, :class:`Config`, the presets, the
flags), :mod:`.logreg_problem` (the data, the objective, the L-BFGS optimum),
:mod:`.logreg_methods` (each method's optimizer and schedule), :mod:`.logreg_loop` (the
training loop and its trace) and :mod:`.logreg_report` (the table, the CSVs, the report);
:mod:`.claims` judges the paper's claims, :mod:`.plots` draws the figure.  This module is
the entry point.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional, Sequence

import torch

from . import datasets
from .logreg_config import DATASETS, FIRST_ORDER, IVON_TYPE, METHODS, PRESETS, Config, \
    build_parser, config_from_args
from .logreg_loop import MethodResult, run_method, run_study
from .logreg_problem import Oracle, Problem, accuracy, gradient, lbfgs_oracle, load_problem, \
    objective
from .logreg_report import format_table, settings_text, write_csv, write_report, write_trace

__all__ = ["Config", "Problem", "Oracle", "MethodResult", "PRESETS", "METHODS",
           "FIRST_ORDER", "IVON_TYPE", "DATASETS", "load_problem", "objective", "accuracy",
           "lbfgs_oracle", "gradient", "run_method", "run_study", "format_table",
           "write_csv", "write_trace", "main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
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
    oracle = lbfgs_oracle(prob, cfg.lbfgs_gtol)
    log(f"{prob.description}; lam = {cfg.l2}; {prob.d} weights; float64")
    log(f"settings: {settings_text(cfg, prob)}")
    log(f"L-BFGS-B: F* = {oracle.f:.12f}, max|grad F| = {oracle.grad_norm:.2e}, "
        f"test acc {oracle.test_acc:.4f}")
    results = []
    for m in cfg.methods:
        tm = time.perf_counter()
        log(f"running {m} ...")
        results.append(run_method(m, prob, oracle, cfg, log=log))
        log(f"  {m} done in {time.perf_counter() - tm:.1f} s ({results[-1].status})")
    claims = C.evaluate(results, oracle, cfg, prob)
    print()
    print(format_table(oracle, results))
    print()
    print(C.format_claims(claims))
    seconds = time.perf_counter() - t0
    if args.csv:
        write_csv(args.csv, oracle, results)
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        stem = os.path.join(args.out_dir, prob.name)
        plot = None
        if not args.no_plot:
            from .plots import plot_study
            plot = plot_study(stem + "_curves.png", prob, oracle, results, cfg)
        write_csv(stem + "_results.csv", oracle, results)
        write_trace(stem + "_trace.csv", oracle, results)
        write_report(stem + "_report.md", cfg, prob, oracle, results, claims, seconds, plot)
        log(f"\nwrote {stem}_report.md, _results.csv, _trace.csv"
            + (", _curves.png" if plot else ""))
    print(f"\ntotal wall time {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
