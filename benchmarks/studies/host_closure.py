"""What the closure does to the optimizer's host time: ``step(closure)`` at GPT-2's 148
tensors shrunk to 1-4 elements (the kernels compute nothing), the optimizer's time beyond
its closure (each call's wall time less the closure's own, timed inside it), with four
closures that leave the same gradients:

* ``flat``: ``zero_grad()``, then one in-place add per flat gradient buffer and the marks
  of the optimizer's hooks (``host_step.py``'s closure: the views' version counters do
  not move);
* ``views``: the same with one add per ``.grad`` view (every counter moves, as a
  backward's accumulation moves them);
* ``backward``: ``zero_grad()``, a forward and a real backward, the loss returned (its
  autograd graph is released when the step returns it: inside the timed call);
* ``backward_detached``: the same returning ``loss.detach()``, the graph released inside
  the closure.

The rows alternate, ``--rounds`` rounds of ``--iters`` iterations each; medians and
minima per row.  ``flat`` against ``views`` is the counters' cost, ``views`` against
``backward_detached`` what running after a backward (the caches it evicts) costs,
``backward_detached`` against ``backward`` the graph's release::

    python -m benchmarks.studies.host_closure --out /tmp/hcl [--kind ivon_pocomo]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

import torch

if __package__ in (None, ""):    # run as a script: the repository root, for ``benchmarks.*``
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__)))))

from benchmarks.common import optimizer_table as ot  # noqa: E402
from benchmarks.common.device import device_info  # noqa: E402
from benchmarks.common.report import write_study  # noqa: E402

CLOSURES = ("flat", "views", "backward", "backward_detached")


def _closure(mode: str, opt, ps, inside):
    def closure():
        t0 = time.perf_counter()
        opt.zero_grad()
        out = None
        if mode.startswith("backward"):
            loss = sum(p.sum() for p in ps)
            loss.backward()
            out = loss.detach() if mode == "backward_detached" else loss
            del loss
        else:
            for b in opt._buckets:
                gb = b.grad_bufs[b.handed]
                if mode == "views":
                    torch._foreach_add_(gb.views, 1e-3)
                else:
                    gb.flat.add_(1e-3)
                ctypes.memset(b.presence.addr, 1, b.presence.n)   # (the hooks' marks)
        inside[0] += time.perf_counter() - t0
        return out
    return closure


def measure(kind: str, iters: int, rounds: int) -> dict:
    dev = torch.device("cpu")
    _, _, opt, ps, _ = ot.make_row(kind, dev, "tiny")
    if not hasattr(opt, "_buckets") or not opt._runner.view.grad_views:
        raise SystemExit(f"{kind}: needs the C++ backend's gradient views")
    inside = [0.0]
    closures = {m: _closure(m, opt, ps, inside) for m in CLOSURES}
    if kind.startswith("ivon_pocomo"):
        opt.refresh([closures["backward"]])
    samples = {m: [] for m in CLOSURES}
    for r in range(rounds + 1):                   # (round 0: warm-up, not kept)
        for m, closure in closures.items():
            for _ in range(20):
                opt.step(closure)
            for _ in range(iters):
                inside[0] = 0.0
                t0 = time.perf_counter()
                opt.step(closure)
                wall = time.perf_counter() - t0
                if r:
                    samples[m].append((wall - inside[0]) * 1e6)
    return {m: {"median_us": round(statistics.median(xs), 1), "min_us": round(min(xs), 1),
                "iterations": len(xs)} for m, xs in samples.items()}


def markdown(kind: str, rows: dict, iters: int, rounds: int) -> str:
    out = [f"# {kind}: host time of step(closure) beyond its closure, by closure", "",
           f"{device_info(torch.device('cpu'))['name']}; 148 tensors of 1-4 elements; "
           f"{rounds} rounds of {iters} iterations per closure, alternated", "",
           "| closure | median us | min us |", "|---|---|---|"]
    out += [f"| {m} | {r['median_us']} | {r['min_us']} |" for m, r in rows.items()]
    return "\n".join(out) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--kind", default="ivon", choices=("ivon", "ivon_pocomo"))
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    rows = measure(a.kind, a.iters, a.rounds)
    write_study(a.out, "host_closure", markdown(a.kind, rows, a.iters, a.rounds),
                {"device": device_info(torch.device("cpu")), "kind": a.kind,
                 "iters": a.iters, "rounds": a.rounds, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
