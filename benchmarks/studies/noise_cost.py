"""What the noise costs: every kernel that generates it, under noise stream version 1 (one
Philox call per normal, the stream before version 2 landed in f1a0973) and version 2
(four normals per call, the default), in one run, against the device's copy bandwidth
measured in the same run.

Rows (``kernel`` column), each on the fused backend of the device (``cpp`` on the CPU,
``triton`` on CUDA), float32, ``--numel`` elements (2^24 by default):

* ``noise_stream``: the stream alone written to a buffer (4 B/element);
* ``sample_inner``: the inner sample into float32 parameters that hold the mean (the
  sample kernel, SIGMA_IVON, SYNC: ``byte_models.b_sample_inner``);
* ``step_ivon``: IVON's step operator (``b_step_ivon``);
* ``step_poco``: IVON-PoCoMo's inner step operator, correction active, shared noise
  (``b_step_poco``);
* ``step_poco_next``: the same with the next inner sample written by the step
  (``sample_ahead``: two noise streams per element).

``provider`` is ``poco_kernels.<backend>(noise v1)`` or ``(noise v2)``; the CSV has the
benchmarks' schema (``CSV_FIELDS`` of ``common/report.py``), with GB/s and the percentage
of the copy bandwidth from each row's byte model.

    .venv/bin/python benchmarks/studies/noise_cost.py [--numel 16777216] [--out F.csv]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

if __package__ in (None, ""):    # run as a script: the repository root, for ``benchmarks.*``
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__)))))

from benchmarks.common.byte_models import b_sample_inner, b_step_ivon, b_step_poco  # noqa: E402
from benchmarks.common.device import device_info, sync  # noqa: E402
from benchmarks.common.report import write_csv  # noqa: E402
from benchmarks.common.setups import step_buffers, step_launcher  # noqa: E402
from benchmarks.common.timing import Timer, copy_bandwidth  # noqa: E402

S = 4


def rows_for(ops, backend, version, n, dev, timer):
    from poco_kernels import noise
    from poco_kernels.kernels import interface as K
    provider = f"poco_kernels.{backend}(noise v{version})"
    out = []

    def row(kernel, fn, bpp):
        fn()
        sync(dev)
        med, p20, p80 = timer(lambda: (fn(), sync(dev)))
        out.append(dict(kernel=kernel, provider=provider, dtype="float32", size=n, median=med,
                        p20=p20, p80=p80, bytes_per_param=bpp,
                        bandwidth_Bps=bpp * n / med, timing="perf_counter"
                        if dev.type == "cpu" else "cuda_events"))
        print(f"  {kernel:16s} {provider:32s} {med * 1e3:8.2f} ms  "
              f"{bpp * n / med / 1e9:7.2f} GB/s", flush=True)

    eps = torch.empty(n, device=dev)
    stream = noise.stream_id(1, 0, 0)
    if backend == "cpp":
        row("noise_stream", lambda: ops.randn(eps, 7, 5, stream, 0, version), S)
    b = step_buffers(n, torch.float32, dev)
    ctl = b["ctl"]
    row("sample_inner", lambda: ops.sample(b["param"], b["param"], b["mean"], b["s2"], None,
                                           ctl, 7, version, stream, 0,
                                           K.SampleHyper(1.0, 1e-4, 0.0), 1.0,
                                           K.SIGMA_IVON, True),
        b_sample_inner(4, True))
    row("step_ivon", step_launcher(ops, b, corr=False, noise=version), b_step_ivon(4))
    row("step_poco", step_launcher(ops, b, corr=True, noise=version), b_step_poco(4))
    row("step_poco_next", step_launcher(ops, b, corr=True, noise=version, next_sample=True),
        b_step_poco(4))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=2 ** 24)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--copy-mib", type=int, default=256)
    ap.add_argument("--out", default="bench_out/noise_cost.csv")
    a = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = "triton" if dev.type == "cuda" else "cpp"
    from poco_kernels.kernels import ops_for
    ops = ops_for(backend)
    info = device_info(dev)
    print(f"device: {info['device']}", flush=True)
    timer = Timer(dev, cpu_reps=a.reps)
    cb = copy_bandwidth(dev, timer, a.copy_mib * 2 ** 20)
    ceiling = cb["bandwidth_Bps"]
    print(f"copy bandwidth: {ceiling / 1e9:.2f} GB/s", flush=True)
    rows = []
    for version in (1, 2):
        rows += rows_for(ops, backend, version, a.numel, dev, timer)
    copy = dict(kernel="copy", provider="torch", dtype="float32",
                size=cb["bytes_each_way"] // 4, median=cb["median_s"], p20=cb["p20_s"],
                p80=cb["p80_s"], bytes_per_param=2 * S, bandwidth_Bps=ceiling,
                timing="perf_counter" if dev.type == "cpu" else "cuda_events")
    rows.insert(0, copy)
    for r in rows:
        r["frac_copy"] = r["bandwidth_Bps"] / ceiling
    write_csv(a.out, rows, info["device"], time.strftime("%Y-%m-%d"))
    by = {(r["kernel"], r["provider"]): r for r in rows}
    lines = [f"Device: {info['device']}; {a.numel} float32 elements; copy "
             f"{ceiling / 1e9:.2f} GB/s; medians of one run.", "",
             "| kernel | B/param | v1 ms | v1 % of copy | v2 ms | v2 % of copy | v1 / v2 |",
             "|---|---|---|---|---|---|---|"]
    for kernel in ("noise_stream", "sample_inner", "step_ivon", "step_poco", "step_poco_next"):
        r1 = by.get((kernel, f"poco_kernels.{backend}(noise v1)"))
        r2 = by.get((kernel, f"poco_kernels.{backend}(noise v2)"))
        if r1 is None or r2 is None:
            continue
        lines.append(f"| {kernel} | {r1['bytes_per_param']} | {r1['median'] * 1e3:.2f} | "
                     f"{100 * r1['frac_copy']:.0f} | {r2['median'] * 1e3:.2f} | "
                     f"{100 * r2['frac_copy']:.0f} | {r1['median'] / r2['median']:.2f} |")
    table = "\n".join(lines) + "\n"
    md = os.path.splitext(a.out)[0] + ".md"
    with open(md, "w") as f:
        f.write(table)
    print("\n" + table)
    print(f"wrote {a.out} and {md}")


if __name__ == "__main__":
    main()
