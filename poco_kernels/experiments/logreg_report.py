"""What the logistic-regression study reports: the results table (printed, and in
markdown), ``<dataset>_results.csv``, ``<dataset>_trace.csv`` (every recorded point) and
``<dataset>_report.md`` (settings, table, the paper's claims judged)."""
from __future__ import annotations

import csv
import os
from typing import List, Optional, Sequence

from .logreg_config import Config
from .logreg_loop import MethodResult
from .logreg_methods import ivon_kwargs
from .logreg_problem import Oracle, Problem

__all__ = ["format_table", "write_csv", "write_trace", "settings_text", "write_report"]

# ----------------------------------------------------------------------------- the table
_HEAD = ("method", "train objective", "rel. gap", "test acc", "L-BFGS test acc",
         "grad evals/ex", "wall s", "status")


def _rows(oracle: Oracle, results: Sequence[MethodResult]) -> List[List[str]]:
    rows = [["L-BFGS", f"{oracle.f:.10f}", "0", f"{oracle.test_acc:.4f}",
             f"{oracle.test_acc:.4f}", f"{oracle.iterations} it", f"{oracle.seconds:.2f}",
             f"|grad|max {oracle.grad_norm:.1e}"]]
    for r in results:
        if r.skipped:
            rows.append([r.method, "", "", "", f"{oracle.test_acc:.4f}", "", "", "skipped"])
            continue
        rows.append([r.method, f"{r.objective:.10f}", f"{r.rel_gap:.3e}", f"{r.test_acc:.4f}",
                     f"{oracle.test_acc:.4f}", f"{r.grad_evals_per_example:.1f}",
                     f"{r.seconds:.2f}", r.status])
    return rows


def format_table(oracle: Oracle, results: Sequence[MethodResult],
                 markdown: bool = False) -> str:
    """The results table: the L-BFGS optimum's row, then one row per method (aligned
    text, or markdown)."""
    rows = [list(_HEAD)] + _rows(oracle, results)
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


# ----------------------------------------------------------------------------- files
def write_csv(path: str, oracle: Oracle, results: Sequence[MethodResult]) -> None:
    """The results table as CSV (the L-BFGS optimum's row is ``lbfgs``)."""
    with open(path, "w", newline="") as fh:
        wr = csv.writer(fh)
        wr.writerow(["method", "train_objective", "rel_gap", "test_acc", "lbfgs_test_acc",
                     "grad_evals_per_example", "wall_s", "status", "note"])
        wr.writerow(["lbfgs", repr(oracle.f), 0.0, oracle.test_acc, oracle.test_acc, "",
                     oracle.seconds, "ok", f"max|grad F| {oracle.grad_norm:.3e}"])
        for r in results:
            wr.writerow([r.method, repr(r.objective), repr(r.rel_gap), r.test_acc,
                         oracle.test_acc, r.grad_evals_per_example, r.seconds, r.status,
                         r.skipped or r.error or r.settings])


def write_trace(path: str, oracle: Oracle, results: Sequence[MethodResult]) -> None:
    """Every recorded point: method, step, grad evals per example, F(m), relative gap,
    test accuracy, and whether a refresh was taken at that step."""
    with open(path, "w", newline="") as fh:
        wr = csv.writer(fh)
        wr.writerow(["method", "step", "grad_evals_per_example", "train_objective",
                     "rel_gap", "test_acc", "refresh"])
        for r in results:
            refreshes = set(r.refresh_steps)
            for t, e, f, a in r.trace:
                wr.writerow([r.method, t, f"{e:.6g}", repr(f),
                             f"{(f - oracle.f) / abs(oracle.f):.6e}", f"{a:.6f}",
                             int(t in refreshes)])


def settings_text(cfg: Config, prob: Problem) -> str:
    """The study's settings in one line (printed, and in the report)."""
    ivon = ivon_kwargs(cfg, prob.n)
    return (f"steps {cfg.steps}, lr {cfg.lr}, batch {cfg.batch}, warm-up {cfg.warmup}, refresh "
            f"every {cfg.refresh_every}, mega-batch {min(cfg.megabatch, prob.n)}, alpha "
            f"{cfg.alpha}, lam {cfg.l2}; VSGD sigma {cfg.vsgd_sigma}; IVON: lr {ivon['lr']}, ess "
            f"{ivon['ess']:g}, hess_init {cfg.hess_init}, beta1 {cfg.beta1}, beta2 {cfg.beta2}; "
            f"IVON-PoCo: hess_corr_scale {cfg.hess_corr_scale}, rho {cfg.rho1}/{cfg.rho2}, "
            f"outer_noise {cfg.outer_noise}, refresh samples {cfg.refresh_samples} (pair: 2 "
            f"antithetic); VON-PoCo: schedule x{cfg.von_schedule}, max dim {cfg.von_max_dim}; "
            f"seed {cfg.seed}")


def write_report(path: str, cfg: Config, prob: Problem, oracle: Oracle,
                 results: Sequence[MethodResult], claims, seconds: float,
                 plot: Optional[str]) -> None:
    """``<dataset>_report.md``: the problem, the settings, the L-BFGS optimum, the table,
    the paper's claims judged (:mod:`.claims`), the figure if drawn, the wall time."""
    from . import claims as C
    lines = [f"# Logistic regression: {prob.name}", "",
             f"{prob.description}; lam = {prob.l2}; {prob.d} weights.", "",
             f"Settings: {settings_text(cfg, prob)}.", "",
             f"L-BFGS-B: F* = {oracle.f:.12f}, max|grad F| = {oracle.grad_norm:.1e}, "
             f"test accuracy {oracle.test_acc:.4f}, train accuracy {oracle.train_acc:.4f}.", "",
             format_table(oracle, results, markdown=True), "",
             "## The paper's claims, here", "", C.format_claims(claims, markdown=True), "",
             C.CRITERIA, ""]
    if plot:
        lines += [f"![curves]({os.path.basename(plot)})", ""]
    lines += [f"Total wall time {seconds:.0f} s."]
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")

