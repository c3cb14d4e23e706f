"""The host time of ``accumulate()`` when it reads autograd's own gradients in place
(Triton's default on a GPU, ``grad_views=False``), with the kernels taken out.

At GPT-2's 148 tensors shrunk to 1-4 elements, IVON on the Triton backend: per iteration
``zero_grad``, ``sample``, a real backward pass (which leaves new ``.grad`` tensors,
usually at new addresses), then ``accumulate`` timed, then ``restore`` and ``step``.
The kernel wrappers are replaced by no-ops, so what is timed is the engine's host work
(the sweeps over the gradients, the address table rewritten for new addresses), on any
device, the CPU included (where Triton would otherwise run through its interpreter).
Medians over ``--iters`` iterations after ``--warm``::

    python -m benchmarks.studies.direct_reads --out /tmp/dr [--device cpu]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

if __package__ in (None, ""):    # run as a script: the repository root, for ``benchmarks.*``
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__)))))

from benchmarks.common import optimizer_table as ot  # noqa: E402
from benchmarks.common.device import device_info, sync  # noqa: E402
from benchmarks.common.report import write_study  # noqa: E402

#: the kernel wrappers the engine calls while accumulating, sampling and stepping
STUBBED = ("accumulate_shards", "accumulate", "sample", "step", "finish", "check")


def measure(dev, iters: int, warm: int) -> dict:
    import poco_kernels as pk
    from poco_kernels.kernels import triton_ops
    saved = {name: getattr(triton_ops, name) for name in STUBBED}
    try:
        for name in STUBBED:
            setattr(triton_ops, name, lambda *a, **k: None)
        ps = [torch.nn.Parameter(torch.randn(s, device=dev)) for s in ot.gpt2_shapes("tiny")]
        opt = pk.IVON(ps, lr=0.1, ess=1e6, hess_init=1e-3, backend="triton",
                      grad_views=False)
        times = []
        for i in range(warm + iters):
            opt.zero_grad()
            opt.sample("inner")
            sum(p.sum() for p in ps).backward()
            sync(dev)
            t0 = time.perf_counter()
            opt.accumulate()
            t = time.perf_counter() - t0
            opt.restore()
            opt.step()
            if i >= warm:
                times.append(t * 1e6)
        eng = opt._runner
        tables = sum(len(e[1]) for e in eng._direct_tables.values())
    finally:
        for name, fn in saved.items():
            setattr(triton_ops, name, fn)
    return {"accumulate_host_us_median": round(statistics.median(times), 1),
            "accumulate_host_us_min": round(min(times), 1), "tables_kept": tables,
            "tensors": len(ps)}


def markdown(dev, res, iters: int, warm: int) -> str:
    return "\n".join([
        "# accumulate() reading autograd's gradients in place: host time, kernels out", "",
        f"{device_info(dev)['name']}; IVON, Triton backend, grad_views=False; GPT-2's "
        f"{res['tensors']} tensors, 1-4 elements each; {iters} iterations after {warm}", "",
        "| median us | min us | address tables kept |", "|---|---|---|",
        f"| **{res['accumulate_host_us_median']}** | {res['accumulate_host_us_min']} | "
        f"{res['tables_kept']} |"])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--warm", type=int, default=10)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cpu":         # (Triton's launches on the CPU: the interpreter; stubbed)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    res = measure(dev, a.iters, a.warm)
    write_study(a.out, "direct_reads", markdown(dev, res, a.iters, a.warm),
                {"device": device_info(dev), "iters": a.iters, "warm": a.warm, **res})
    return 0


if __name__ == "__main__":
    sys.exit(main())
