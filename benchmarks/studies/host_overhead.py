"""Host overhead of the optimizer's protocol: what a call costs besides the kernels.

A model of many small parameters (``--tensors`` of ``--numel`` elements each, float32,
the shape of a transformer's parameter list at a size where the kernels cost little) and
fixed gradients, so the time is the host's: validation, bookkeeping, launches.  Rows, per
backend:

* ``protocol_step``: IVON-PoCo with the correction active, ``step(closure)`` (an inner and
  an outer sample, two accumulations, the update); the closure only assigns ``.grad``;
* ``protocol_refresh``: ``refresh([closure])`` (one sample, one accumulation, the fold;
  on the fused backends also the one read of whether the device took it);
* ``protocol_step_skip``: ``protocol_step`` where one tensor gets no gradient (``None``),
  so the step skips it: the cost of copying its state before the update and back after.

Writes the benchmarks' CSV schema (``CSV_FIELDS`` of ``common/report.py``).  Usage::

    .venv/bin/python benchmarks/studies/host_overhead.py --out /tmp/host.csv
        [--backends cpp torch]
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

if __package__ in (None, ""):    # run as a script: the repository root, for ``benchmarks.*``
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__)))))

from benchmarks.common.device import device_info  # noqa: E402
from benchmarks.common.report import write_csv  # noqa: E402
from benchmarks.common.timing import Timer  # noqa: E402

import poco_kernels as pk  # noqa: E402


def _setup(backend, tensors, numel, dev):
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel, generator=g).to(dev))
              for _ in range(tensors)]
    grads = [torch.randn(numel, generator=g).to(dev) * 1e-3 for _ in range(tensors)]
    opt = pk.IVONPoCo(params, lr=1e-3, ess=1e4, alpha=0.5, backend=backend)

    def closure():
        for p, gr in zip(params, grads):
            p.grad = gr.clone()
        return None

    def closure_skip():              # the last tensor gets no gradient
        for p, gr in zip(params[:-1], grads):
            p.grad = gr.clone()
        return None

    opt.step(closure)
    opt.refresh([closure])          # the correction is active from here on
    return opt, closure, closure_skip


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", nargs="+", default=None,
                    help="default: every backend that runs on the device")
    ap.add_argument("--tensors", type=int, default=148, help="GPT-2 124M has 148")
    ap.add_argument("--numel", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    backends = a.backends or (["triton", "torch"] if dev.type == "cuda" else ["cpp", "torch"])
    timer = Timer(dev, cpu_reps=a.reps, cpu_warmup=10, cpu_max_s=60.0)
    info = device_info(dev)
    rows = []
    for backend in backends:
        opt, closure, closure_skip = _setup(backend, a.tensors, a.numel, dev)
        for kernel, fn in (("protocol_step", lambda: opt.step(closure)),
                           ("protocol_refresh", lambda: opt.refresh([closure])),
                           ("protocol_step_skip", lambda: opt.step(closure_skip))):
            med, p20, p80 = timer(fn)
            rows.append(dict(kernel=kernel, provider=f"poco_kernels.{backend}", dtype="float32",
                             size=a.tensors * a.numel, median=med, p20=p20, p80=p80,
                             timing=f"{a.tensors} tensors x {a.numel}"))
            print(f"{kernel:18s} {backend:6s} median {med * 1e6:9.1f} us  "
                  f"(p20 {p20 * 1e6:.1f}, p80 {p80 * 1e6:.1f})", flush=True)
    write_csv(a.out, rows, info["device"],
              datetime.date.today().isoformat())


if __name__ == "__main__":
    main()
