"""The language-model study's figures (:mod:`.lm_study`): mean curves over seeds with
their min-max band, correction starts marked.  Needs matplotlib (the ``experiments``
extra).

* ``curves.png``: AdamW, IVON, IVON-3x and IVON-PoCoMo against steps, gradient
  evaluations and wall time (claims b, c);
* ``starts.png``: IVON-PoCoMo from each start against IVON, and the per-seed difference
  to IVON (claim a);
* ``ablations.png``: final loss against alpha, per alpha schedule, and against the
  refresh interval (claims d, e, f; at a scale that runs their arms).
"""
from __future__ import annotations

import math

from pathlib import Path
from typing import Any, Dict, List, Sequence

from .lm_study_config import ALPHA, SCHEDULES

__all__ = ["plot_all"]

COLORS = {"adamw": "tab:blue", "ivon": "tab:purple", "ivon-3x": "tab:green",
          "pocomo": "tab:red"}


def _band(results: Sequence[Dict[str, Any]], arm: str, key: str):
    """x (of seed 0's curve), mean, min and max of the validation loss over seeds."""
    runs = sorted((r for r in results if r["arm"] == arm), key=lambda r: r["seed"])
    if not runs:
        return [], [], [], []
    n = min(len(r["curve"]) for r in runs)
    xs = [sum(r["curve"][i][key] for r in runs) / len(runs) for i in range(n)]
    ys = [[r["curve"][i]["val_loss"] for r in runs] for i in range(n)]
    return xs, [sum(y) / len(y) for y in ys], [min(y) for y in ys], [max(y) for y in ys]


def _curve(ax, results, arm, key, color, label, ls="-"):
    xs, m, lo, hi = _band(results, arm, key)
    if not xs:
        return
    ax.plot(xs, m, color=color, lw=1.4, ls=ls, label=label)
    ax.fill_between(xs, lo, hi, color=color, alpha=0.18, lw=0)


def _ylim(ax, results, arms, sc):
    vals = [p["val_loss"] for r in results if r["arm"] in arms
            for p in r["curve"] if p["step"] >= sc.steps // 5 and math.isfinite(p["val_loss"])]
    if vals:
        ax.set_ylim(min(vals) - 0.02, max(vals) + 0.02)


def _finals(results, arm):
    return [r["final_val_loss"] for r in results if r["arm"] == arm]


def plot_all(out: Path, results: List[Dict[str, Any]], sc, meta) -> List[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = f"pocomo@{sc.start}"
    paths = []
    n_seeds = sc.seeds
    # curves.png -------------------------------------------------------------
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    arms = [("adamw", "AdamW", COLORS["adamw"]), ("ivon", "IVON", COLORS["ivon"]),
            ("ivon-3x", "IVON, 3x batch", COLORS["ivon-3x"]),
            (main, f"IVON-PoCoMo (from step {sc.start})", COLORS["pocomo"])]
    for ax, (key, xlabel) in zip(axes, (("step", "optimizer steps"),
                                        ("evals", "gradient evaluations (mini-batches)"),
                                        ("wall_s", "train wall time (s, one thread)"))):
        for arm, label, color in arms:
            _curve(ax, results, arm, key, color, label)
        if key == "step":
            ax.axvline(sc.start, color="0.5", ls=":", lw=1)
        else:
            xs, *_ = _band(results, main, key)
            if xs:
                steps = [p["step"] for p in next(r for r in results
                                                  if r["arm"] == main)["curve"]]
                ax.axvline(xs[min(range(len(steps)), key=lambda i: abs(steps[i] - sc.start))],
                           color="0.5", ls=":", lw=1)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        _ylim(ax, results, [a for a, *_ in arms], sc)
    axes[0].set_ylabel("validation loss (nats / byte)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"claims (b), (c): mean over {n_seeds} seeds, band = min..max; dotted: "
                 f"correction starts", fontsize=10)
    fig.tight_layout()
    paths.append(str(out / "curves.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    # starts.png -------------------------------------------------------------
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    starts = sorted(set(sc.starts) | {sc.start})
    cmap = plt.get_cmap("autumn")
    _curve(axes[0], results, "ivon", "step", COLORS["ivon"], "IVON")
    ivon = {r["seed"]: r for r in results if r["arm"] == "ivon"}
    for i, s in enumerate(starts):
        color = cmap(i / max(len(starts), 2))
        arm = f"pocomo@{s}"
        _curve(axes[0], results, arm, "step", color, f"IVON-PoCoMo from {s}")
        for ax in axes:
            ax.axvline(s, color=color, ls=":", lw=1)
        diffs = {}
        for r in results:
            if r["arm"] != arm or r["seed"] not in ivon:
                continue
            base = {p["step"]: p["val_loss"] for p in ivon[r["seed"]]["curve"]}
            diffs[r["seed"]] = [(p["step"], p["val_loss"] - base[p["step"]])
                                for p in r["curve"] if p["step"] in base]
        if diffs:
            n = min(len(d) for d in diffs.values())
            xs = [list(diffs.values())[0][k][0] for k in range(n)]
            ys = [[d[k][1] for d in diffs.values()] for k in range(n)]
            axes[1].plot(xs, [sum(y) / len(y) for y in ys], color=color, lw=1.4,
                         label=f"from {s}")
            axes[1].fill_between(xs, [min(y) for y in ys], [max(y) for y in ys],
                                 color=color, alpha=0.2, lw=0)
    axes[1].axhline(0, color="0.3", lw=0.8)
    axes[0].set_ylabel("validation loss")
    axes[1].set_ylabel("IVON-PoCoMo minus IVON, same seed")
    _ylim(axes[0], results, ["ivon"] + [f"pocomo@{s}" for s in starts], sc)
    for ax in axes:
        ax.set_xlabel("optimizer steps")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # (no IVON-PoCoMo run yet: nothing to name)
            ax.legend(fontsize=8)
    fig.suptitle("claim (a): correction started at different steps (dotted)", fontsize=10)
    fig.tight_layout()
    paths.append(str(out / "starts.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    if not getattr(sc, "ablations", True):    # (no alpha, schedule or refresh arms)
        return paths

    # ablations.png ----------------------------------------------------------
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))

    def dots(ax, x, ys, color="k"):
        if not ys:
            return
        ax.plot([x] * len(ys), ys, ".", color=color, alpha=0.5)
        ax.errorbar([x], [sum(ys) / len(ys)], yerr=[[sum(ys) / len(ys) - min(ys)],
                    [max(ys) - sum(ys) / len(ys)]], fmt="o", color=color, capsize=3)

    alphas = sorted(set(sc.alphas) | {ALPHA, 0.0})
    for a in alphas:
        arm = "ivon" if a == 0 else (main if abs(a - ALPHA) < 1e-12 else f"alpha={a:g}")
        dots(axes[0], a, _finals(results, arm), COLORS["ivon"] if a == 0 else "tab:red")
    axes[0].set_xlabel(f"alpha (constant from step {sc.start}; 0 = IVON)")
    axes[0].set_ylabel(f"final validation loss ({sc.steps} steps)")
    names = ["increasing", "warm-up, 0.5", "decreasing", "alpha 1"]
    arms = ["sched=increasing", "alpha=0.5", "sched=decreasing", "sched=one"]
    for i, arm in enumerate(arms):
        dots(axes[1], i, _finals(results, arm))
    axes[1].set_xticks(range(len(names)))
    axes[1].set_xticklabels([f"{n}\n({SCHEDULES.get(a.split('=')[1], '0.5')})"
                             for n, a in zip(names, arms)], fontsize=8)
    axes[1].set_xlabel(f"alpha schedule (ramps from step {sc.early})")
    ms = sorted(set(sc.refreshes) | {sc.refresh_every})
    for k in ms:
        arm = main if k == sc.refresh_every else f"refresh={k}"
        dots(axes[2], k, _finals(results, arm))
    axes[2].set_xscale("log")
    axes[2].set_xlabel(f"refresh every m steps (mega-batch {sc.mega_batches} mini-batches, "
                       f"from step {sc.start})")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle("claims (d), (e), (f): final loss per seed (dots), mean and min..max",
                 fontsize=10)
    fig.tight_layout()
    paths.append(str(out / "ablations.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths
