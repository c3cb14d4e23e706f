"""What a pretraining run reports: the start line and the progress lines it prints,
``log.csv`` (one row per logged step), the summary (``summary.json``) and, for several
optimizers run in turn, the comparison table."""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["LOG_COLUMNS", "start_line", "progress_line", "write_log", "summarize",
           "comparison_table"]

#: The columns of ``log.csv``: step, lr, alpha, train loss, val loss and perplexity,
#: tokens, gradient evaluations (mini-batches), data position, refreshes, tokens per
#: second (train steps; all forward/backward passes), ms per step, optimizer share.
LOG_COLUMNS = ["step", "lr", "alpha", "train_loss", "val_loss", "val_ppl", "tokens", "evals",
               "data_pos", "refreshes", "tok_s", "all_tok_s", "step_ms", "opt_share"]


def start_line(tr) -> str:
    """What the run is: optimizer, model, data, ranks, batch, steps."""
    cfg = tr.cfg
    n = tr.raw.num_params()
    return (f"[{cfg.optimizer}] {cfg.preset} ({n / 1e6:.2f}M parameters) on "
            f"{tr.data.name}, {tr.world} rank(s) on {tr.dev}, batch "
            f"{cfg.batch_size} x {tr.seq} ({tr.accum} micro-batches of "
            f"{cfg.micro_batch} per rank), {cfg.max_steps} steps"
            + (", bf16 autocast" if tr.amp else ""))


def progress_line(row: Dict[str, Any], rate: Optional[Dict[str, Any]]) -> str:
    """One logged step: its train loss, val loss and perplexity, throughput, refreshes."""
    parts = [f"step {row['step']:6d}"]
    loss = row["train_loss"]
    if loss is not None:
        parts.append(f"loss {loss:.4f}")
    if row["val_loss"] is not None:
        parts.append(f"val {row['val_loss']:.4f} (ppl {row['val_ppl']:.2f})")
    if rate:
        parts.append(f"{rate['tok_s']:,.0f} tok/s ({rate['step_ms']:.1f} ms/step)")
        if rate.get("opt_share") is not None:
            parts.append(f"outside fwd/bwd {100 * rate['opt_share']:.1f}%")
    if row["refreshes"]:
        parts.append(f"refreshes {row['refreshes']}")
    return "  " + ", ".join(parts)


def write_log(path: Path, history: Sequence[Dict[str, Any]]) -> None:
    """``log.csv``: every row of ``history`` (rewritten whole at each logged step)."""
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=LOG_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in history:
            w.writerow(r)


def summarize(tr, wall: float, last: int) -> Dict[str, Any]:
    """``summary.json``: the run, its throughput (medians over the logged intervals after
    the first) and its first and last validation losses."""
    rates = [r for r in tr.history if r.get("tok_s")]
    # steady state: leave out the first logged interval (compilation, warm-up)
    steady = rates[1:] if len(rates) > 1 else rates
    vals = [r for r in tr.history if r["val_loss"] is not None]

    def med(key):
        xs = sorted(r[key] for r in steady if r.get(key) is not None)
        return xs[len(xs) // 2] if xs else None
    return {"optimizer": tr.cfg.optimizer, "preset": tr.cfg.preset,
            "params": tr.raw.num_params(), "world_size": tr.world,
            "device": str(tr.dev), "backend": getattr(tr.opt, "backend", "torch"),
            "steps": last, "tokens": tr.tokens, "grad_evals_minibatches": tr.evals,
            "wall_s": wall, "tok_s": med("tok_s"), "all_tok_s": med("all_tok_s"),
            "step_ms": med("step_ms"), "opt_share": med("opt_share"),
            "val_loss_first": vals[0]["val_loss"] if vals else None,
            "val_loss": vals[-1]["val_loss"] if vals else None,
            "val_ppl": vals[-1]["val_ppl"] if vals else None,
            "out_dir": str(tr.out)}


def comparison_table(summaries: List[Dict[str, Any]]) -> str:
    """One line per optimizer: val loss from start to end, perplexity, throughput."""
    lines = ["optimizer     val loss (start -> end)   ppl     tok/s    ms/step  "
             "outside fwd/bwd"]
    for s in summaries:
        share = "" if s["opt_share"] is None else f"{100 * s['opt_share']:.1f}%"
        lines.append(f"{s['optimizer']:12s}  {s['val_loss_first']:.3f} -> {s['val_loss']:.3f}"
                     f"          {s['val_ppl']:7.2f}  {s['tok_s']:8,.0f}  {s['step_ms']:7.1f}  "
                     f"{share}")
    return "\n".join(lines)
