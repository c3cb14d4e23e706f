"""The LM study's outputs: the verdict table as text and Markdown, the curves as CSV,
``claims.json`` and the plots (:mod:`.lm_study_plots`); the verdicts themselves are
:mod:`.lm_study_claims`'s."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any, Dict

__all__ = ["SMOKE_NOTE", "CURVE_FIELDS", "claims_markdown", "claims_text", "write_outputs"]


def _secs(x: float) -> str:
    """Seconds with the digits that matter: 0.47, 3.2, 41 (a quick run takes under one)."""
    if not math.isfinite(x) or x >= 10:
        return f"{x:.0f}"
    return f"{x:.2f}" if x < 1 else f"{x:.1f}"


#: what a scale too small to decide anything says above its verdicts
SMOKE_NOTE = ("SMOKE SCALE: a tiny model for a few dozen steps, to exercise the pipeline; "
              "these verdicts decide nothing about the paper's claims (the full study: "
              "without --quick)")


def _mean(d: Dict[int, float]) -> float:
    v = list(d.values())
    return sum(v) / len(v) if v else math.nan


def _sd(d: Dict[int, float]) -> float:
    v = list(d.values())
    if len(v) < 2:
        return math.nan
    m = sum(v) / len(v)
    return math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1))


def claims_markdown(summary: Dict[str, Any]) -> str:
    rows = [] if summary.get("decisive", True) else [f"**{SMOKE_NOTE}.**", ""]
    rows += ["| claim | setting | result (difference: mean [95% interval], nats) | verdict |",
             "|---|---|---|---|"]
    for c in summary["claims"]:
        rows.append(f"| ({c['id']}) {c['claim']} | {c['setting']} | "
                    f"{'<br>'.join(c['result'])} | **{c['verdict']}** |")
    if summary.get("diverged"):
        rows += ["", f"Diverged (non-finite final loss): {', '.join(summary['diverged'])}"]
    return "\n".join(rows)


def claims_text(summary: Dict[str, Any]) -> str:
    out = [] if summary.get("decisive", True) else [SMOKE_NOTE]
    if summary.get("diverged"):
        out.append(f"DIVERGED (non-finite final loss): {', '.join(summary['diverged'])}")
    for c in summary["claims"]:
        smoke = "" if summary.get("decisive", True) else " (smoke scale: decides nothing)"
        out.append(f"({c['id']}) {c['claim']}: {c['verdict'].upper()}{smoke}")
        out += [f"      {line}" for line in c["result"]]
    return "\n".join(out)


# --------------------------------------------------------------------------- files
CURVE_FIELDS = ("arm", "seed", "step", "evals", "wall_s", "val_loss", "train_loss",
                "alpha", "lr")


def write_outputs(out: Path, results, sweeps, summary, sc, meta) -> None:
    """``curves.csv``, ``finals.csv``, ``claims.md``, ``claims.json`` and the plots."""
    seen = {}
    for r in list(sweeps) + list(results):
        seen[(r["arm"], r["seed"])] = r
    rows = sorted(seen.values(), key=lambda r: (r["arm"], r["seed"]))
    with open(out / "curves.csv", "w", newline="") as f:
        w = csv.DictWriter(f, CURVE_FIELDS)
        w.writeheader()
        for r in rows:
            for p in r["curve"]:
                w.writerow({"arm": r["arm"], "seed": r["seed"],
                            **{k: p.get(k) for k in CURVE_FIELDS[2:]}})
    with open(out / "finals.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arm", "seed", "optimizer", "lr", "poco_start", "alpha", "refresh_every",
                    "batch_size", "steps", "evals", "train_wall_s", "final_val_loss",
                    "backend"])
        for r in rows:
            s = r["settings"]
            w.writerow([r["arm"], r["seed"], r["optimizer"], s.get("lr"),
                        s.get("poco_start", ""), s.get("alpha", ""),
                        s.get("refresh_every", ""), s["batch_size"], r["steps"],
                        f"{r['evals']:.0f}", f"{r['train_wall_s']:.2f}",
                        f"{r['final_val_loss']:.5f}", r["backend"]])
    (out / "claims.json").write_text(json.dumps(
        {k: v for k, v in summary.items() if k not in ("table_md", "table_text")},
        indent=1, default=str))
    settings = dict(sc.__dict__) if hasattr(sc, "__dict__") else meta["scale"]
    where = meta["machine"] if meta.get("device", meta["machine"]) == meta["machine"] \
        else f"{meta['device']} (host: {meta['machine']})"
    lines = [f"# The paper's LLM claims, scale {sc.name}", "",
             f"Command: `{meta['command']}`; {meta['date']}; {where}; "
             f"{meta['runs']} runs, {meta['run_s_total'] / 60:.1f} min of run time, "
             f"{meta['jobs']} at a time" + (" (one thread each)." if meta["jobs"] > 1 else ".")]
    tm = meta.get("time_model")
    if tm:
        lines.append(f"Window {meta['budget_s']:.0f} s, time model: rates {tm['rates']}; the "
                     f"worst ratio of a run's time to its prediction {tm['worst_ratio']:.2f}; "
                     f"wall time of this call {meta['wall_s']:.0f} s.")
    if meta.get("not_started"):
        lines.append(f"**Not started (the window ended first): "
                     f"{', '.join(meta['not_started'])}.** The verdicts use the runs that "
                     "finished; a rerun trains the rest.")
    lines += ["", f"Learning rates (seed-0 sweeps, final validation loss): AdamW "
             f"{_sweep_text(meta['adamw_sweep'])} -> **{meta['adamw_lr']:g}**; IVON "
             f"{_sweep_text(meta['ivon_sweep'])} -> **{meta['ivon_lr']:g}** (IVON-PoCoMo "
             f"and IVON-3x take IVON's).", "",
             summary["table_md"], "", "## Every arm (final validation loss, mean +- sd over "
             "seeds)", "", "| arm | final loss | gradient evaluations | train wall s |",
             "|---|---|---|---|"]
    for arm, a in summary["arms"].items():
        lines.append(f"| {arm} | {a['stat']} | {a['evals']:.0f} | {a['wall_s']:.1f} |")
    lines += ["", "## Settings", "", "```", json.dumps(settings, indent=1, default=str),
              "```", ""]
    (out / "claims.md").write_text("\n".join(lines))
    try:
        from .lm_study_plots import plot_all
    except ImportError:
        return
    try:
        plot_all(out, results, sc, meta)
    except Exception as e:                    # (the tables and CSVs are written: keep them)
        (out / "plots_failed.txt").write_text(f"{type(e).__name__}: {e}\n")


def _sweep_text(sweep: Dict[Any, float]) -> str:
    return ", ".join(f"{float(k):g}: {v:.4f}" for k, v in sorted(sweep.items(),
                                                                key=lambda kv: float(kv[0])))
