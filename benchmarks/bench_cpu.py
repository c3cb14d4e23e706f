"""CPU benchmark of the C++ backend, beside the reference backend, ivon-opt and AdamW.

    python3 benchmarks/bench_cpu.py                 # sizes 2**20 2**24, float32 and bfloat16
    python3 benchmarks/bench_cpu.py --record        # also benchmarks/results/cpu_<cpu>_<date>.csv

Every row is the median (p20, p80) of ``time.perf_counter`` around one call, after
warm-up calls, over ``--reps`` calls (fewer when a row passes ``--max-s`` seconds).  At
sizes whose buffers would fit in the last-level cache the row rotates through copies of
its inputs (at least ``--rotate-mib`` per round), so caches do not flatter small sizes.
Each row has the bytes-per-parameter model of its operation (``benchmarks/common.py``),
the bandwidth that model implies and its percentage of the copy bandwidth, which is
measured in the same run: ``torch.Tensor.copy_`` of ``--copy-mib`` MiB each way (beyond
the cache), at the start and before each size; the median is the ceiling.  Beside it,
``inplace_add`` (``a.add_(b)``, 12 bytes per element) measures the bandwidth of an
in-place update: on a CPU the copy's destination lines are read before they are written
(12 bytes move for the 8 its model counts), so kernels that update state in place, as
the optimizers' do, can pass 100% of the copy.

Rows (provider ``poco_kernels.cpp`` = the C++ backend, ``poco_kernels.torch`` = the
reference):

* ``step_kernel_poco``, ``step_kernel_ivon`` (cpp, direct): the fused inner-step operator
  on prepared buffers: IVON-PoCoMo (correction, shared noise, Hessian correction) and IVON;
* ``ivon_poco_step`` (cpp, torch): ``optimizer.step()`` alone, the inner and outer
  gradients collected before each call (untimed);
* ``ivon_poco_cycle`` (cpp, torch): inner sample, gradient, outer sample, gradient, step,
  through the public ``sampled`` protocol (no model: the gradient is given);
* ``refresh`` (cpp, torch): refresh sample, one chunk's gradient, refresh;
* ``ivon_cycle`` (cpp, torch, ivon-opt 0.1.3): one IVON step with its sample;
  ``ivon_step`` (ivon-opt): its ``step()`` alone;
* ``adamw_step``: ``torch.optim.AdamW`` with ``foreach=True`` and ``fused=True``.

At the end the script checks the C++ backend's targets at the largest size (float32):
the IVON-PoCoMo step at >= 70% of the copy bandwidth, and >= 4x faster than the
reference backend's step and than ivon-opt's IVON cycle.  Exit status 0 when met, 1 when
not, 4 when a benchmark raised.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import statistics
import subprocess
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from poco_kernels.kernels import cpp_status  # noqa: E402

from common import (BYTE_MODELS, Bench, Timer, b_adamw, b_ivon_cycle, b_ivonopt_cycle,  # noqa: E402
                    b_ivonopt_step, b_poco_cycle, b_refresh, b_step_ivon, b_step_poco,
                    copy_bandwidth, copy_row, dtype_name, dump, import_ivon, inplace_bandwidth,
                    inplace_row,
                    log, poco_opt, print_table, rotation, round_robin, step_buffers,
                    step_launcher, write_csv)

CPU = torch.device("cpu")


def cpu_info():
    info = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "python": platform.python_version()}
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        info["cpu"] = re.search(r"model name\s*:\s*(.*)", text).group(1).strip()
        info["logical_cpus"] = text.count("processor\t:")
    except (OSError, AttributeError):
        info["cpu"] = platform.processor() or platform.machine()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        info["caches"] = "; ".join(line.split(":", 1)[0].strip() + " " +
                                   line.split(":", 1)[1].strip()
                                   for line in lscpu.splitlines() if "cache" in line)
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        info["git_head"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO,
                                          capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    if cpp_status() is None:
        from poco_kernels.kernels import cpp_ops
        info["isa"] = cpp_ops.isa()
    else:
        info["isa"] = f"unavailable: {cpp_status()}"
    info["device"] = f"cpu: {info['cpu']}, {info['threads']} threads, C++ kernels {info['isa']}"
    return info


class Instances:
    """``k`` optimizers over parameters of ``size`` elements (rotated so that consecutive
    calls touch different memory), with the correction active for IVON-PoCo."""

    def __init__(self, k, size, dt, backend, cls):
        self.items = [poco_opt(size, dt, CPU, backend, cls=cls, seed=3 + i) for i in range(k)]
        self.i = 0
        if cls == "IVONPoCo":
            for p, opt, grad in self.items:
                with opt.sampled("refresh", accumulate=False):
                    p.grad = grad
                    opt.accumulate()
                opt.refresh()

    def next(self):
        item = self.items[self.i % len(self.items)]
        self.i += 1
        return item


def collect(opt, p, grad, kinds=("inner", "outer")):
    for kind in kinds:
        with opt.sampled(kind):
            p.grad = grad


def bench_size(B, timer, size, dt, args, ivon_mod):
    P = torch.tensor([], dtype=dt).element_size()
    rot_bytes = args.rotate_mib * 2 ** 20
    have_cpp = cpp_status() is None
    backends = (["cpp"] if have_cpp else []) + (["torch"] if size <= args.ref_max_size else [])

    if have_cpp:
        def kernels():
            from poco_kernels.kernels import cpp_ops
            for corr, name, bpp in ((True, "step_kernel_poco", b_step_poco(P)),
                                    (False, "step_kernel_ivon", b_step_ivon(P))):
                k = rotation(bpp * size, rot_bytes)
                sets = [step_buffers(size, dt, CPU, seed=i) for i in range(k)]
                fn = round_robin([step_launcher(cpp_ops, b, corr=corr) for b in sets])
                B.add(name, "poco_kernels.cpp(direct)", dt, size, timer(fn), bpp)
                del sets, fn
        B.run(f"step kernels {size}/{dtype_name(dt)}", kernels)

    for backend in backends:
        prov = f"poco_kernels.{backend}"

        def poco_rows():
            k = rotation(b_poco_cycle(P, "sampled") * size, rot_bytes)
            inst = Instances(k, size, dt, backend, "IVONPoCo")
            cur = {}

            def setup():
                cur["item"] = inst.next()
                p, opt, grad = cur["item"]
                collect(opt, p, grad)
            B.add("ivon_poco_step", prov, dt, size,
                  timer(lambda: cur["item"][1].step(), setup=setup), b_step_poco(P))

            def cycle():
                p, opt, grad = inst.next()
                collect(opt, p, grad)
                opt.step()
            B.add("ivon_poco_cycle", prov + "(sampled)", dt, size, timer(cycle),
                  b_poco_cycle(P, "sampled"))

            def refresh():
                p, opt, grad = inst.next()
                collect(opt, p, grad, kinds=("refresh",))
                opt.refresh()
            B.add("refresh", prov, dt, size, timer(refresh), b_refresh(P))
        B.run(f"{backend} IVON-PoCo {size}/{dtype_name(dt)}", poco_rows)

        def ivon_rows():
            k = rotation(b_ivon_cycle(P) * size, rot_bytes)
            inst = Instances(k, size, dt, backend, "IVON")

            def cycle():
                p, opt, grad = inst.next()
                opt.step(lambda: setattr(p, "grad", grad))
            B.add("ivon_cycle", prov + "(closure)", dt, size, timer(cycle), b_ivon_cycle(P))
        B.run(f"{backend} IVON {size}/{dtype_name(dt)}", ivon_rows)

    def ivonopt_rows():
        if ivon_mod is None:
            return
        k = rotation(b_ivonopt_cycle(P) * size, rot_bytes)
        items = []
        for i in range(k):
            g = torch.Generator().manual_seed(2 + i)
            p = torch.nn.Parameter(torch.randn(size, generator=g).to(dt))
            grad = torch.randn(size, generator=g).to(dt)
            nxg = torch.randn(size, generator=g).to(dt) * 1e-3
            items.append((p, ivon_mod.IVON([p], lr=1e-3, ess=1.0), grad, nxg))
        it = {"i": 0}

        def nxt():
            item = items[it["i"] % len(items)]
            it["i"] += 1
            return item

        def step_only():          # what sampled_params(train=True) leaves, then step
            p, ref, grad, nxg = nxt()
            ref.state["count"] = 1
            ref.state["avg_grad"] = grad
            ref.state["avg_nxg"] = nxg
            ref.step()
        B.add("ivon_step", "ivon-opt-0.1.3", dt, size, timer(step_only), b_ivonopt_step(P))

        def cycle():
            p, ref, grad, nxg = nxt()
            with ref.sampled_params(train=True):
                p.grad = grad
            ref.step()
        B.add("ivon_cycle", "ivon-opt-0.1.3", dt, size, timer(cycle), b_ivonopt_cycle(P))
    B.run(f"ivon-opt {size}/{dtype_name(dt)}", ivonopt_rows)

    def adamw_rows():
        k = rotation(b_adamw(P) * size, rot_bytes)
        for flag in ("foreach", "fused"):
            opts = []
            for i in range(k):
                g = torch.Generator().manual_seed(1 + i)
                p = torch.nn.Parameter(torch.randn(size, generator=g).to(dt))
                p.grad = torch.randn(size, generator=g).to(dt)
                opts.append(torch.optim.AdamW([p], lr=1e-3, **{flag: True}))
            B.add("adamw_step", f"torch.AdamW({flag})", dt, size,
                  timer(round_robin([o.step for o in opts])), b_adamw(P))
            del opts
    B.run(f"adamw {size}/{dtype_name(dt)}", adamw_rows)


def targets(rows, size, inplace_bw):
    """The C++ backend's targets at ``size``, float32: (lines, all met)."""
    def med(kernel, provider):
        for r in rows:
            if (r["kernel"], r["provider"], r["dtype"], r["size"]) == (kernel, provider,
                                                                       "float32", size):
                return r
        return None
    lines, ok = [], True
    k = med("step_kernel_poco", "poco_kernels.cpp(direct)")
    if k is None:
        return [f"targets: no C++ step row at size {size}"], False
    checks = [("IVON-PoCoMo step at >= 70% of copy bandwidth", k["frac_copy"], 0.70, "{:.0%}")]
    ref = med("ivon_poco_step", "poco_kernels.torch")
    if ref is not None:
        checks.append(("... >= 4x faster than the reference backend's step",
                       ref["median"] / k["median"], 4.0, "{:.1f}x"))
    opt = med("ivon_cycle", "ivon-opt-0.1.3")
    if opt is not None:
        checks.append(("... >= 4x faster than ivon-opt's IVON cycle",
                       opt["median"] / k["median"], 4.0, "{:.1f}x"))
    for label, value, need, fmt in checks:
        met = value is not None and value >= need
        ok &= met
        lines.append(f"{'MET    ' if met else 'NOT MET'} {label}: "
                     f"{'n/a' if value is None else fmt.format(value)} (size {size}, float32)")
    if inplace_bw:
        lines.append(f"(for context: the same step at {k['bandwidth_Bps'] / inplace_bw:.0%} of "
                     f"the in-place update bandwidth, {inplace_bw / 1e9:.1f} GB/s)")
    return lines, ok


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[2 ** 20, 2 ** 24])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                    choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--reps", type=int, default=10, help="timed calls per row (default 10)")
    ap.add_argument("--max-s", type=float, default=20.0,
                    help="seconds per row after which it stops (at least 3 calls)")
    ap.add_argument("--copy-mib", type=int, default=1024,
                    help="copy-bandwidth buffer, each way (default 1024: beyond the cache)")
    ap.add_argument("--rotate-mib", type=int, default=1024,
                    help="bytes a row's rotation touches at least (default 1024 MiB)")
    ap.add_argument("--ref-max-size", type=int, default=2 ** 24,
                    help="largest size for the reference backend's rows")
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/bench_cpu")
    ap.add_argument("--record", action="store_true",
                    help="also write benchmarks/results/cpu_<cpu>_<date>.csv")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    info = cpu_info()
    date = info["date"][:10]
    log(f"[1] {info['device']} | torch {info['torch']} | {info['date']}")
    log(f"    caches: {info.get('caches', 'n/a')}")
    ivon_mod, ivon_err = import_ivon()
    log(f"    ivon-opt: {'ok' if ivon_mod else 'skipped: ' + ivon_err}")
    timer = Timer(CPU, cpu_reps=args.reps, cpu_warmup=2, cpu_max_s=args.max_s)
    copy_timer = Timer(CPU, cpu_reps=max(args.reps, 10), cpu_warmup=2, cpu_max_s=args.max_s)
    copies, inplace = [], []

    def measure_copy(when):
        cb = copy_bandwidth(CPU, copy_timer, args.copy_mib * 2 ** 20)
        copies.append(cb)
        ib = inplace_bandwidth(CPU, copy_timer, args.copy_mib * 2 ** 20)
        inplace.append(ib)
        log(f"    copy {args.copy_mib} MiB each way ({when}): median "
            f"{cb['median_s'] * 1e3:.2f} ms -> {cb['bandwidth_Bps'] / 1e9:.1f} GB/s; "
            f"in-place add {ib['bandwidth_Bps'] / 1e9:.1f} GB/s")
    measure_copy("start")
    B = Bench(CPU, timer, copies[0]["bandwidth_Bps"])
    dtypes = [getattr(torch, d) for d in args.dtypes]
    for size in args.sizes:
        log(f"[2] size {size}")
        measure_copy(f"before size {size}")
        for dt in dtypes:
            bench_size(B, timer, size, dt, args, ivon_mod)
    # the ceiling: the median of the copy measurements; fractions recomputed against it
    ceiling = statistics.median(c["bandwidth_Bps"] for c in copies)
    inplace_bw = statistics.median(c["bandwidth_Bps"] for c in inplace)
    rows = ([copy_row(c, "perf_counter") for c in copies]
            + [inplace_row(c, "perf_counter") for c in inplace] + B.rows)
    for r in rows:
        r["frac_copy"] = r["bandwidth_Bps"] / ceiling if r["bandwidth_Bps"] else None
    report = {"info": info, "copies": copies, "ceiling_Bps": ceiling, "inplace": inplace,
              "inplace_Bps": inplace_bw, "rows": rows,
              "errors": B.errors, "byte_models": {f.__name__: f.__doc__.strip()
                                                  for f in BYTE_MODELS}}
    lines, met = targets(rows, max(args.sizes), inplace_bw)
    report["targets"] = lines
    report["seconds"] = time.perf_counter() - t_start
    write_csv(os.path.join(args.out, "bench_cpu.csv"), rows, info["device"], date)
    dump(os.path.join(args.out, "bench_cpu_report.json"), report)
    if args.record:
        name = re.sub(r"[^A-Za-z0-9]+", "_", info["cpu"]).strip("_")
        path = os.path.join(REPO, "benchmarks", "results", f"cpu_{name}_{date}.csv")
        write_csv(path, rows, info["device"], date)
        log(f"    recorded {path}")
    print_table(rows, ceiling, f"bench_cpu summary, {info['device']}",
                os.path.join(args.out, "bench_cpu_table.txt"))
    log("-" * 96)
    each = ", ".join(f"{c['bandwidth_Bps'] / 1e9:.1f}" for c in copies)
    log(f"copy bandwidth: {each} GB/s (median {ceiling / 1e9:.1f}: the ceiling above); "
        f"in-place add: {inplace_bw / 1e9:.1f} GB/s")
    for line in lines:
        log(line)
    for e in B.errors:
        log(f"ERROR {e}")
    code = (4 if B.errors else 0) | (0 if met else 1)
    log(f"{'PASS' if code == 0 else 'FAIL'} (exit {code}) in {report['seconds']:.0f} s; "
        f"outputs in {args.out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
