"""Does bfloat16 state cost validation loss?  IVON-PoCoMo on gpt-tiny (the ``cpu`` recipe
of ``poco_kernels.experiments.pretrain``: 200 steps, correction from step 100), with
float32 state, with ``state_dtype=torch.bfloat16`` (momentum and outer buffers) and with
float32 state and ``outer_dtype=torch.bfloat16`` (the outer estimates alone), the same
seeds: the final validation loss of each run, and per seed the difference.

Each seed fixes the model's initialisation, the noise and the data order, so runs of one
seed differ only by how the state is stored.  A last run per seed is the yardstick:
float32 state with the C++ kernels' portable ``base`` instruction set instead of
AVX2/AVX-512, whose noise transform may differ in the last bit; how far that moves the
final loss is how far any perturbation of the trajectory moves it.  Writes ``runs.csv``
(one row per run, written as each finishes; ``--reuse`` keeps the runs already there)
and ``README.md`` (the table, mean and spread) into ``--out``.

    .venv/bin/python benchmarks/studies/state_dtype.py [--seeds 0 1 2] [--steps 200]
        [--out benchmarks/results/state_dtype/<device>_<date>] [--reuse]
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import statistics
import sys
import tempfile

if __package__ in (None, ""):    # run as a script: the repository root, for ``benchmarks.*``
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__)))))


#: (column, state dtype, outer estimates' dtype, C++ instruction set: None = the best this
#: CPU has); the first is the yardstick of the differences
VARIANTS = (("float32", "float32", "float32", None),
            ("bfloat16", "bfloat16", "bfloat16", None),
            ("float32, bf16 outer", "float32", "bfloat16", None),
            ("float32, base ISA", "float32", "float32", "base"))
#: the table's heading of each column
HEADINGS = {"float32": "float32 state", "bfloat16": "bfloat16 state",
            "float32, bf16 outer": "bfloat16 outer estimates",
            "float32, base ISA": "float32, base ISA"}


def run_one(seed: int, state_dtype: str, outer_dtype: str, isa, steps: int,
            eval_batches: int, workdir: str):
    from poco_kernels.experiments.pretrain import main
    from poco_kernels.kernels import cpp_ops
    out = os.path.join(workdir, f"{state_dtype}-{outer_dtype}-{isa}-{seed}")
    argv = ["--optimizer", "ivon-pocomo", "--recipe", "cpu", "--seed", str(seed),
            "--state-dtype", state_dtype, "--outer-dtype", outer_dtype,
            "--max-steps", str(steps),
            "--eval-every", str(steps), "--eval-batches", str(eval_batches),
            "--ckpt-every", str(10 ** 9), "--out-dir", out, "--quiet"]
    before = cpp_ops.set_isa(isa or "best")
    try:
        return main(argv)[0], cpp_ops.isa()
    finally:
        cpp_ops.set_isa(before)


def _save(out: str, rows) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "runs.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[-1]), restval="")
        w.writeheader()
        w.writerows(rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--out", default=None, help="default benchmarks/results/state_dtype/"
                   "<device>_<date>")
    p.add_argument("--reuse", action="store_true", help="keep the runs in --out/runs.csv")
    a = p.parse_args(argv)
    import torch
    from benchmarks.common.device import device_info
    from benchmarks.common.report import RESULTS
    info = device_info(torch.device("cpu"))
    if a.out is None:
        a.out = os.path.join(RESULTS, "state_dtype", f"{info['slug']}_{info['date'][:10]}")
    where = info['device']
    rows = []
    done = set()
    if a.reuse and os.path.exists(os.path.join(a.out, "runs.csv")):
        with open(os.path.join(a.out, "runs.csv")) as f:
            for r in csv.DictReader(f):
                r.setdefault("variant", r["state_dtype"])     # (rows of the first version)
                r.setdefault("isa", info["cpp_isa"])
                r.setdefault("outer_dtype", r["state_dtype"])
                r["seed"], r["val_loss"] = int(r["seed"]), float(r["val_loss"])
                rows.append(r)
                done.add((r["seed"], r["variant"]))
    with tempfile.TemporaryDirectory() as work:
        for seed in a.seeds:
            for name, sd, od, isa in VARIANTS:
                if (seed, name) in done:
                    continue
                s, ran = run_one(seed, sd, od, isa, a.steps, a.eval_batches, work)
                rows.append(dict(seed=seed, variant=name, state_dtype=sd, outer_dtype=od,
                                 isa=ran, steps=s["steps"],
                                 val_loss=round(s["val_loss"], 5),
                                 val_loss_first=round(s["val_loss_first"], 5),
                                 wall_s=round(s["wall_s"], 1), backend=s["backend"],
                                 device=where, torch=torch.__version__,
                                 date=datetime.date.today().isoformat()))
                print(f"seed {seed} {name:18s} val loss {s['val_loss']:.4f} "
                      f"({s['wall_s']:.0f} s, {s['backend']})", flush=True)
                _save(a.out, rows)      # (each run as it finishes: --reuse goes on from it)
    _save(a.out, rows)
    by = {(r["seed"], r["variant"]): r["val_loss"] for r in rows}
    names = [v[0] for v in VARIANTS]
    others = names[1:]
    lines = ["| seed | " + " | ".join(HEADINGS[n] for n in names) + " | "
             + " | ".join(f"{HEADINGS[n]} - float32" for n in others) + " |",
             "|---" * (1 + len(names) + len(others)) + "|"]
    cols = {n: [] for n in names}
    diffs = {n: [] for n in others}
    for seed in a.seeds:
        vals = {n: by[(seed, n)] for n in names}
        for n in names:
            cols[n].append(vals[n])
        for n in others:
            diffs[n].append(vals[n] - vals[names[0]])
        lines.append(f"| {seed} | " + " | ".join(f"{vals[n]:.4f}" for n in names) + " | "
                     + " | ".join(f"{diffs[n][-1]:+.4f}" for n in others) + " |")

    def ms(xs):
        sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
        return f"{statistics.mean(xs):.4f} +- {sd:.4f}"
    lines.append("| mean +- sd | " + " | ".join(ms(cols[n]) for n in names) + " | "
                 + " | ".join(ms(diffs[n]) for n in others) + " |")
    text = (f"# Validation loss with float32 and bfloat16 optimizer state\n\n"
            f"IVON-PoCoMo, gpt-tiny, the `cpu` recipe ({a.steps} steps, correction from "
            f"step 100), validation loss over {a.eval_batches} batches after the last "
            f"step; {rows[0]['backend']} backend on {where}, "
            f"torch {torch.__version__}, {rows[0]['date']}.\n"
            f"`benchmarks/studies/state_dtype.py`; one row per run in `runs.csv`.\n\n"
            + "\n".join(lines) + "\n")
    with open(os.path.join(a.out, "README.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
