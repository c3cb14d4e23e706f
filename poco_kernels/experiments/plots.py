"""The logistic-regression study's figure, drawn as the paper draws Fig. 2 and 4: test
accuracy against gradient evaluations per example, one curve per method, the full-batch
L-BFGS accuracy as a dashed grey line, the refreshes (mega-batch gradients) as grey bars.
A second row shows the relative train-objective gap on a log scale, where methods that
tie in accuracy still differ.  Needs matplotlib (the ``experiments`` extra)."""
from __future__ import annotations

__all__ = ["plot_study", "COLORS"]

COLORS = {"sgd": "tab:blue", "svrg": "tab:orange", "vsgd": "tab:green",
          "vsgd-poco": "tab:red", "ivon": "tab:purple", "ivon-poco": "tab:brown",
          "ivon-poco-pair": "tab:pink", "von-poco": "tab:olive"}


def plot_study(path, prob, oracle, results, cfg) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from .logreg_config import FIRST_ORDER, IVON_TYPE

    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5), sharex="col", squeeze=False)
    panels = (("first-order methods (paper Fig. 4)", FIRST_ORDER),
              ("IVON-type methods (paper Fig. 2)", IVON_TYPE))
    accs = [a for r in results if not r.skipped for *_, a in r.trace[len(r.trace) // 20:]]
    lo = min([oracle.test_acc - 0.03] + sorted(accs)[:max(1, len(accs) // 50)])
    for col, (title, names) in enumerate(panels):
        ax_acc, ax_gap = axes[0][col], axes[1][col]
        shaded = False
        for r in results:
            if r.method not in names or r.skipped or len(r.trace) < 2:
                continue
            color = COLORS.get(r.method)
            x = [p[1] for p in r.trace]
            label = r.method + ("" if r.status == "ok" else f" ({r.status})")
            ax_acc.plot(x, [p[3] for p in r.trace], color=color, lw=1.3, label=label)
            ax_gap.plot(x, [max((p[2] - oracle.f) / abs(oracle.f), 1e-16) for p in r.trace],
                        color=color, lw=1.3, label=label)
            if not shaded:          # one method's refreshes shade the panel (same schedule)
                for b, a in r.refresh_evals:
                    for ax in (ax_acc, ax_gap):
                        ax.axvspan(b, a, color="0.8", alpha=0.7, lw=0)
                shaded = bool(r.refresh_evals)
            steps = {p[0]: p for p in r.trace}
            pts = [steps[s] for s in r.refresh_steps if s in steps]
            ax_acc.plot([p[1] for p in pts], [p[3] for p in pts], "|", color=color, ms=9)
        ax_acc.axhline(oracle.test_acc, ls="--", color="0.45", lw=1.2, label="L-BFGS")
        ax_gap.axhline(cfg.reach_tol, ls=":", color="0.45", lw=1.0, label="reach tol")
        ax_gap.set_yscale("log")
        ax_acc.set_title(title)
        ax_acc.set_ylim(max(0.0, lo), min(1.0, max([oracle.test_acc] + accs) + 0.01))
        ax_gap.set_xlabel("gradient evaluations per example")
        ax_acc.legend(fontsize=8, loc="lower right")
        ax_gap.legend(fontsize=8, loc="upper right")
        ax_acc.grid(alpha=0.3)
        ax_gap.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("test accuracy")
    axes[1][0].set_ylabel("(F(m) - F*) / F*  (train)")
    fig.suptitle(f"logistic regression, {prob.name}: {prob.n} train examples, {prob.d} "
                 f"weights, lr {cfg.lr}, batch {cfg.batch}, refresh every "
                 f"{cfg.refresh_every} after {cfg.warmup} steps (grey: mega-batch gradients)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
