"""The gradient views against autograd's own gradient tensors, in one run: the optimizer
table's rows (``common/optimizer_table.py``) with ``grad_views=True`` and with
``grad_views=False``, alternated over ``--rounds`` rounds at each ``--scales`` (GPT-2
124M's 148 shapes, and the same shapes at 41k parameters where the host's time shows).

With the views, autograd adds each parameter's gradient into a zeroed ``.grad`` in place
(one kernel per parameter and 16 bytes per float32 parameter, the memset included); with
its own tensors it hands over the backward's output (no kernel, no bytes) and the
optimizer copies them into its flat buffer with one multi-tensor copy (8 bytes).  Which
costs less depends on the device's launch cost and bandwidth: this measures it.

Writes ``grad_views.csv`` (round, scale, grad_views, row, optimizer_ms,
ratio_to_fused_adamw, closure_ms) and ``grad_views.md`` (medians over the rounds) to
``--out``::

    python -m benchmarks.studies.grad_views --out /tmp/gv                  # this device
    python -m benchmarks.studies.grad_views --device cpu --rounds 1 --scales smoke --out /tmp/gv
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys

import torch

if __package__ in (None, ""):    # run as a script: the repository root, for ``benchmarks.*``
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__)))))

from benchmarks.common import optimizer_table as ot  # noqa: E402
from benchmarks.common.device import device_info  # noqa: E402
from benchmarks.common.report import log  # noqa: E402

DEFAULT_KINDS = ("adamw_fused", "ivon", "ivon_sample_ahead", "ivon_bf16_state",
                 "ivon_pocomo", "ivon_pocomo_sample_ahead", "ivon_pocomo_bf16_state")
FIELDS = ("round", "scale", "grad_views", "row", "optimizer_ms", "ratio_to_fused_adamw",
          "closure_ms")


def run(dev, scales, rounds, reps, kinds):
    """The rows of ``grad_views.csv``."""
    out = []
    for r in range(rounds):
        for scale in scales:
            for views in (False, True):
                rows, closure = ot.measure(dev, scale, reps, 2, kinds=kinds,
                                           options={"grad_views": views})
                base = rows.get("adamw_fused", {}).get("optimizer_ms")
                for kind, row in rows.items():
                    if "optimizer_ms" not in row:
                        log(f"    {kind}: {row}")
                        continue
                    ms = row["optimizer_ms"]
                    out.append({"round": r, "scale": scale, "grad_views": views, "row": kind,
                                "optimizer_ms": round(ms, 4),
                                "ratio_to_fused_adamw": round(ms / base, 3) if base else "",
                                "closure_ms": round(closure, 4)})
                log(f"round {r} {scale} grad_views={views}: " + ", ".join(
                    f"{x['row']} {x['optimizer_ms']:.3f}" for x in out
                    if x["round"] == r and x["scale"] == scale and x["grad_views"] == views))
    return out


def summary(rows, info) -> str:
    """Medians over the rounds: per scale and row, ms and ratio with and without views."""
    lines = [f"# Gradient views against autograd's tensors\n\n{info.get('device', '')}, "
             f"{info.get('date', '')}; medians over {1 + max(r['round'] for r in rows)} "
             "round(s); the ratio is to fused AdamW measured in the same pass\n",
             "| scale | row | ms, views | ms, autograd's | x AdamW, views | x AdamW, autograd's |",
             "|---|---|---|---|---|---|"]
    keys = sorted({(r["scale"], r["row"]) for r in rows},
                  key=lambda k: (k[0], ot.KINDS.index(k[1])))
    for scale, kind in keys:
        def med(views, field):
            v = [r[field] for r in rows if r["scale"] == scale and r["row"] == kind
                 and r["grad_views"] == views and r[field] != ""]
            return f"{statistics.median(v):.3f}" if v else ""
        lines.append(f"| {scale} | {kind} | {med(True, 'optimizer_ms')} | "
                     f"{med(False, 'optimizer_ms')} | {med(True, 'ratio_to_fused_adamw')} | "
                     f"{med(False, 'ratio_to_fused_adamw')} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--scales", nargs="+", default=["gpt2", "host"], choices=list(ot.SCALES))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--kinds", nargs="+", default=list(DEFAULT_KINDS),
                    choices=[k for k in ot.KINDS if not k.endswith("grad_views")])
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    os.makedirs(a.out, exist_ok=True)
    rows = run(dev, a.scales, a.rounds, a.reps, a.kinds)
    with open(os.path.join(a.out, "grad_views.csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(a.out, "grad_views.md"), "w") as fh:
        fh.write(summary(rows, device_info(dev)))
    log(f"wrote {a.out}/grad_views.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
