"""The benchmark a user runs before adopting poco_kernels, on whatever device it runs on.

    .venv/bin/python benchmarks/run.py                  # this machine's default device
    .venv/bin/python benchmarks/run.py --record         # also into benchmarks/results/suite/

The device is CUDA when torch sees one, else the CPU (``--device`` overrides).  Five
sections, each written to ``--out`` as soon as it is done:

1. **Optimizer-step microbenchmarks** (``suite/micro.py``) at sizes 2**20, 2**22, ... up to what
   fits in memory (2**26 on a machine with ~23 GB available), float32 and bf16: this
   package's IVON step, IVON-PoCoMo inner step, refresh fold, sample and whole cycles on
   every backend that runs on the device (``cpp`` or ``triton``, and ``torch``, the
   torch backend), ivon-opt's IVON (sample, backward-free restore, step, cycle) and
   ``torch.optim.AdamW`` with ``foreach=True`` and ``fused=True``.  Each row has the bytes
   per parameter its operation must move, the achieved GB/s and that as a percentage of
   the device's copy bandwidth, measured in the same run (the ceiling).
2. **The optimizer table** (``common/optimizer_table.py``, also ``bench_gpu.py --quick``'s):
   one training iteration of fused and foreach AdamW, ivon-opt's IVON, and our IVON and
   IVON-PoCoMo (default, the copy protocol ``sample_ahead=False``, ``sample_ahead``,
   bfloat16 state, ``grad_views=False``) at
   GPT-2 124M's 148 parameter shapes: optimizer milliseconds with the closure
   subtracted, ratio to fused AdamW, host microseconds per iteration (the same shapes at
   41k parameters), bytes per parameter by the model and at the measured copy bandwidth,
   resident bytes per parameter.
3. **Memory** (``suite/memory.py``): optimizer state in bytes per parameter for each optimizer,
   and the allocations one steady-state step makes.
4. **Training-step cost** (``suite/train_gpt.py``): on a small GPT, the share of an iteration
   spent outside forward / backward for AdamW, ivon-opt's IVON, our IVON and our
   IVON-PoCoMo.
5. **Pretraining throughput** (``suite/pretrain.py``): the package's GPT pretraining loop
   (``poco_kernels.experiments.pretrain``) for a few hundred steps on real text, GPT-2
   124M in bf16 on CUDA: tokens per second, step time and the share outside forward /
   backward for AdamW (fused), ivon-opt's IVON, our IVON and our IVON-PoCoMo.

Timing: CPU, ``time.perf_counter`` around each call after warm-up, median / p20 / p80 of
``--reps`` calls (fewer past ``--max-s`` seconds, at least 3), inputs rotated so that a
round touches at least ``--rotate-mib``; CUDA, CUDA events (``triton.testing.do_bench``,
or the same with an untimed setup), the L2 cache flushed before each call.

Outputs in ``--out`` (default ``bench_out/``): ``bench.csv`` (kernel, provider, dtype,
size, median, p20, p80, bytes_per_param, gbps, pct_of_copy, timing, device, date),
``bench.md`` (the short tables), ``bench_report.json`` (everything, the memory
breakdown included).  ``--record`` copies the CSV and the tables to
``benchmarks/results/suite/<device>_<date>[_<tag>].{csv,md}`` (``--record-tag``).  Exit
status 0, or 4 if a benchmark raised (the others still ran).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import time

import torch

if __package__ in (None, ""):    # run as a script: the repository root, for ``benchmarks.*``
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import optimizer_table  # noqa: E402
from benchmarks.common.byte_models import BYTE_MODELS  # noqa: E402
from benchmarks.common.device import device_info  # noqa: E402
from benchmarks.common.report import (RESULTS, Bench, copy_row, cpp_targets, dump,  # noqa: E402
                                      inplace_row, log, markdown, pretrain_csv_rows,
                                      train_csv_rows, write_csv)
from benchmarks.common.setups import import_ivon  # noqa: E402
from benchmarks.common.timing import Timer, copy_bandwidth, inplace_bandwidth  # noqa: E402
from benchmarks.suite import memory, micro, pretrain, train_gpt  # noqa: E402

# --------------------------------------------------------------------------- configuration
def build_parser():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", help="auto (CUDA if present), cpu or cuda")
    ap.add_argument("--sizes", type=int, nargs="+", default=None,
                    help="parameters per microbenchmark (default 2**20, 2**22, ... up to "
                         "what fits)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                    choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--backends", nargs="+", default=None, choices=["cpp", "triton", "torch"],
                    help="this package's backends to measure (default: every one that runs "
                         "on the device; torch runs the reference maths op for op)")
    ap.add_argument("--ref-max-size", type=int, default=None,
                    help="largest size for the torch backend (default: every size)")
    ap.add_argument("--reps", type=int, default=10, help="CPU: timed calls per row")
    ap.add_argument("--max-s", type=float, default=20.0,
                    help="CPU: seconds per row after which it stops (at least 3 calls)")
    ap.add_argument("--rotate-mib", type=int, default=1024,
                    help="CPU: bytes one rotation round touches at least (beyond the cache)")
    ap.add_argument("--copy-mib", type=int, default=1024,
                    help="copy-bandwidth buffer, each way (default 1024)")
    ap.add_argument("--rep-ms", type=float, default=100.0, help="CUDA: timing per row (ms)")
    ap.add_argument("--warmup-ms", type=float, default=25.0, help="CUDA: warm-up per row (ms)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="seconds after which no new microbenchmark (size, dtype) block "
                         "starts (default: none on the CPU, 360 on CUDA, so that a "
                         "10-minute call keeps its tables)")
    ap.add_argument("--memory-numel", type=int, default=2 ** 20 - 1,
                    help="parameters of the memory section's model (three tensors)")
    ap.add_argument("--gpt", default=None,
                    help="GPT preset for the training section (default gpt2-124m on CUDA, "
                         "gpt-tiny on the CPU; see poco_kernels/experiments/gpt.py)")
    ap.add_argument("--gpt-batch", type=int, default=8)
    ap.add_argument("--gpt-seq", type=int, default=None, help="tokens per sequence "
                    "(default: the preset's context)")
    ap.add_argument("--gpt-iters", type=int, default=6, help="timed iterations per optimizer")
    ap.add_argument("--pretrain-preset", default=None, help="GPT preset of the pretraining "
                    "section (default gpt2-124m on CUDA, gpt-tiny on the CPU)")
    ap.add_argument("--pretrain-batch", type=int, default=None,
                    help="sequences per step (default 16)")
    ap.add_argument("--pretrain-steps", type=int, default=None,
                    help="steps per optimizer (default 200 on CUDA, 60 on the CPU)")
    ap.add_argument("--table-scale", default="gpt2", choices=["gpt2", "smoke"],
                    help="shapes of the optimizer table: GPT-2 124M's 148 tensors "
                         "(default), or 16 tiny ones")
    ap.add_argument("--table-reps", type=int, default=None,
                    help="timed iterations per optimizer-table row (default 5 on the CPU, "
                         "15 on CUDA)")
    ap.add_argument("--skip", nargs="*", default=[],
                    choices=["micro", "memory", "train", "pretrain", "table"])
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    ap.add_argument("--record", action="store_true",
                    help="also write benchmarks/results/suite/<device>_<date>[_<tag>].csv "
                         "and .md")
    ap.add_argument("--record-tag", default="",
                    help="appended to the recorded files' names (bench_gpu.py --part N: partN)")
    return ap


def record_base(info, args) -> str:
    """``benchmarks/results/suite/<slug>_<date>[_<tag>]``: the recorded files' path, less
    the extension."""
    tag = re.sub(r"[^A-Za-z0-9_-]+", "_", args.record_tag or "").strip("_")
    name = f"{info['slug']}_{info['date'][:10]}" + (f"_{tag}" if tag else "")
    return os.path.join(RESULTS, "suite", name)


def pick_device(name):
    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    return dev


# --------------------------------------------------------------------------- main
def suite(args, dev, info, report=None, report_name="bench_report.json"):
    """All five sections on ``dev``; returns (exit code, report)."""
    t_start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    report = {} if report is None else report
    report.update(info=info, args=vars(args),
                  byte_models={f.__name__: f.__doc__.strip() for f in BYTE_MODELS})
    date, device = info["date"][:10], info["device"]
    rpath = os.path.join(args.out, report_name)
    cpu = dev.type == "cpu"
    timer = Timer(dev, args.warmup_ms, args.rep_ms, cpu_reps=args.reps, cpu_max_s=args.max_s)
    copy_timer = Timer(dev, args.warmup_ms, args.rep_ms, cpu_reps=max(args.reps, 10),
                       cpu_max_s=args.max_s)
    ivon_mod, ivon_err = import_ivon()
    notes = [] if ivon_mod else [f"ivon-opt not importable ({ivon_err}): its rows are skipped"]
    log(f"[1] {device} | torch {info['torch']} | {info['date']}")
    copies, inplace = [], []

    def measure_copy(when):
        cb = copy_bandwidth(dev, copy_timer, args.copy_mib * 2 ** 20)
        copies.append(cb)
        msg = (f"    copy {args.copy_mib} MiB each way ({when}): "
               f"{cb['bandwidth_Bps'] / 1e9:.1f} GB/s")
        if cpu:      # on a CPU, in-place updates pass the copy model's 100% (benchmarks/README.md)
            inplace.append(inplace_bandwidth(dev, copy_timer, args.copy_mib * 2 ** 20))
            msg += f"; in-place add {inplace[-1]['bandwidth_Bps'] / 1e9:.1f} GB/s"
        log(msg)
    measure_copy("start")
    B = Bench(dev, timer, copies[0]["bandwidth_Bps"])
    dtypes = [getattr(torch, d) for d in args.dtypes]
    sizes = args.sizes or micro.default_sizes(dev)
    torch_max = args.ref_max_size or max(sizes)
    backends = args.backends or micro.kernel_backends(dev) + ["torch"]
    budget = args.budget_s if args.budget_s is not None else (float("inf") if cpu else 360.0)
    mem_rows, train_rows, pre_rows, table = [], [], [], None
    timing = "perf_counter" if cpu else "events"

    def ceiling():
        return statistics.median(c["bandwidth_Bps"] for c in copies)

    def all_rows():
        c = ceiling()
        rows = ([copy_row(x, timing) for x in copies] + [inplace_row(x, timing) for x in inplace]
                + B.rows + train_csv_rows(train_rows) + pretrain_csv_rows(pre_rows))
        for r in rows:
            r["frac_copy"] = r["bandwidth_Bps"] / c if r.get("bandwidth_Bps") else None
        return rows

    def write():
        rows = all_rows()
        inpl = statistics.median(x["bandwidth_Bps"] for x in inplace) if inplace else None
        write_csv(os.path.join(args.out, "bench.csv"), rows, device, date)
        md = markdown(info, ceiling(), inpl, rows, mem_rows, train_rows,
                      notes + B.errors + report.get("targets", []), pre_rows, table)
        with open(os.path.join(args.out, "bench.md"), "w") as f:
            f.write("\n".join(md) + "\n")
        report.update(copies=copies, inplace=inplace, ceiling_Bps=ceiling(), rows=rows,
                      memory=mem_rows, train=train_rows, pretrain=pre_rows,
                      optimizer_table=table, errors=B.errors,
                      notes=notes,
                      seconds=time.perf_counter() - t_start)
        dump(rpath, report)
        return rows, md

    if "micro" not in args.skip:
        log(f"[2] microbenchmarks: sizes {sizes}, {args.dtypes}")

        def between_sizes(rows):
            if cpu and len(B.rows) and B.rows[-1]["dtype"] == args.dtypes[-1]:
                measure_copy(f"after size {B.rows[-1]['size']}")
            write()
        micro.run(B, timer, dev, sizes, dtypes, ivon_mod, torch_max, args.rotate_mib * 2 ** 20,
                  backends=backends, deadline=t_start + budget, flush=between_sizes)
        if cpu:
            report["targets"] = cpp_targets(all_rows(), max(sizes), inplace)
        write()
    if "table" not in args.skip:
        log(f"[3] the optimizer table: one iteration per optimizer at GPT-2 124M's shapes "
            f"({args.table_scale})")
        table = optimizer_table.table(
            dev, ceiling(), scale=args.table_scale, ivon_mod=ivon_mod,
            reps=args.table_reps or (5 if cpu else 15), warm=1 if cpu else 2)
        write()
    if "memory" not in args.skip:
        log("[4] memory: state bytes per parameter, allocations per step")
        mem_rows = memory.run(dev, dtypes, backends, ivon_mod,
                              numel=args.memory_numel)
        write()
    if "train" not in args.skip:
        log("[5] training step on a small GPT")
        train_rows = train_gpt.run(dev, ivon_mod, preset=args.gpt, batch=args.gpt_batch,
                                   seq=args.gpt_seq, iters=args.gpt_iters)
        write()
    if "pretrain" not in args.skip:
        log("[6] pretraining throughput")
        pre_rows = pretrain.run(dev, ivon_mod, preset=args.pretrain_preset,
                                batch=args.pretrain_batch, steps=args.pretrain_steps)
        write()
    rows, md = write()
    if args.record:
        base = record_base(info, args)
        os.makedirs(os.path.dirname(base), exist_ok=True)
        shutil.copyfile(os.path.join(args.out, "bench.csv"), base + ".csv")
        shutil.copyfile(os.path.join(args.out, "bench.md"), base + ".md")
        log(f"    recorded {base}.csv and .md")
    log("")
    log("\n".join(md))
    bad = [e for e in B.errors if "skipped" not in e]
    bad += [f"memory {r['optimizer']} {r['provider']}: {r['error']}" for r in mem_rows
            if "error" in r]
    bad += [f"train {r['optimizer']}: {r['error']}" for r in train_rows if "error" in r]
    bad += [f"pretrain {r['optimizer']}: {r['error']}" for r in pre_rows if "error" in r]
    bad += [f"optimizer table {k}: {r['error']}" for k, r in (table or {}).get("rows", {}).items()
            if "error" in r]
    code = 4 if bad else 0
    log(f"{'PASS' if code == 0 else 'FAIL'} (exit {code}) in "
        f"{time.perf_counter() - t_start:.0f} s; outputs in {args.out}")
    return code, report


def main(argv=None):
    args = build_parser().parse_args(argv)
    dev = pick_device(args.device)
    code, _ = suite(args, dev, device_info(dev))
    return code


if __name__ == "__main__":
    sys.exit(main())
