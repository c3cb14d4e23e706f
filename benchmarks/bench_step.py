"""Optimizer-step microbenchmark of the reference (``torch``) backend against ivon-opt.

Times one optimizer cycle with the gradient given (no forward/backward), so only the
optimizer's own work is measured:

* ``ivon_cycle``        sample -> (gradient) -> accumulate/restore -> step   (IVON)
* ``ivon_poco_cycle``   inner and outer sample, both gradients, step          (IVON-PoCo, correction on)
* ``refresh``           refresh sample, one chunk, fold                        (IVON-PoCo)

ivon-opt's cycle is ``sampled_params(train=True)`` with the same gradient, then ``step()``.
Writes one CSV row per (kernel, provider, size): kernel, provider, dtype, size, median,
p20, p80 (seconds), device, date.  Usage::

    python benchmarks/bench_step.py --sizes 65536 1048576 4194304 --out benchmarks/results/cpu.csv
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import poco_kernels as pk  # noqa: E402


def _quantiles(ts):
    ts = sorted(ts)
    q = lambda f: ts[min(len(ts) - 1, int(f * len(ts)))]  # noqa: E731
    return statistics.median(ts), q(0.2), q(0.8)


def _time(fn, reps, warmup=2):
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return _quantiles(out)


def bench(size, reps):
    rows = []
    w = torch.nn.Parameter(torch.randn(size))
    grads = [torch.randn(size) for _ in range(4)]          # rotated so caches do not flatter
    k = {"i": 0}

    def give_grad():
        w.grad = grads[k["i"] % 4]
        k["i"] += 1

    opt = pk.IVON([w], lr=0.1, ess=1e6)

    def ours():
        with opt.sampled():
            give_grad()
        opt.step()
    rows.append(("ivon_cycle", "poco_kernels.torch", _time(ours, reps)))

    try:
        import ivon
        w2 = torch.nn.Parameter(torch.randn(size))
        ref = ivon.IVON([w2], lr=0.1, ess=1e6)

        def theirs():
            with ref.sampled_params(train=True):
                w2.grad = grads[k["i"] % 4]
                k["i"] += 1
            ref.step()
        rows.append(("ivon_cycle", "ivon-opt-0.1.3", _time(theirs, reps)))
    except ImportError:
        pass

    poco = pk.IVONPoCo([w], lr=0.1, ess=1e6, alpha=0.5, rho1=0.6, rho2=0.1)

    def refresh():
        with poco.sampled("refresh"):
            give_grad()
        poco.refresh()
    rows.append(("refresh", "poco_kernels.torch", _time(refresh, reps)))

    def poco_cycle():
        with poco.sampled("inner"):
            give_grad()
        with poco.sampled("outer"):
            give_grad()
        poco.step()
    rows.append(("ivon_poco_cycle", "poco_kernels.torch", _time(poco_cycle, reps)))

    adam = torch.optim.AdamW([w], lr=1e-3, foreach=True)

    def adamw():
        give_grad()
        adam.step()
    rows.append(("adamw_step", "torch.AdamW(foreach)", _time(adamw, reps)))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[2 ** 16, 2 ** 20])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = f"cpu: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    date = datetime.date.today().isoformat()
    out = []
    for size in args.sizes:
        for kernel, provider, (med, p20, p80) in bench(size, args.reps):
            out.append(dict(kernel=kernel, provider=provider, dtype="float32", size=size,
                            median=f"{med:.6g}", p20=f"{p20:.6g}", p80=f"{p80:.6g}",
                            device=device, date=date))
            print(f"{kernel:16s} {provider:22s} {size:>9d}  median {med * 1e3:9.3f} ms "
                  f"[p20 {p20 * 1e3:.3f}, p80 {p80 * 1e3:.3f}]", flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(out[0]))
            wr.writeheader()
            wr.writerows(out)


if __name__ == "__main__":
    main()
