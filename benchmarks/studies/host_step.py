"""The optimizer's whole host time per iteration, with no backward pass to blur it.

``step(closure)`` at GPT-2's 148 tensors shrunk to 1-4 elements (the kernels compute
nothing), with a closure that produces the gradients without autograd: the optimizer's
``zero_grad()``, then the gradients written the way the backward would leave them (the
``.grad`` views handed out: one in-place add per flat gradient buffer, and the marks
the optimizer's hooks would make; autograd's own tensors: a fixed tensor assigned to
each ``.grad``), less that writing timed alone.  So each row is the optimizer's own host
work per iteration, ``zero_grad()`` included, the hooks inside the backward aside
(``host_calls.py`` measures those).  Rows: fused AdamW (``zero_grad(); <gradients>;
step()``), IVON and IVON-PoCoMo (the correction active, two closure calls), the fused
backend of the device; ``*_jit_launch``: the same with every Triton launch through the
JIT (``triton_launch.ENABLED = False``; what the cached launches save; on the CPU the
C++ kernels run and both are the same); ``*_no_plan``: without step plans
(``opt.step_plans = False``: every iteration by the slow path); ``*_sampled``: the
protocol without a closure, ``with opt.sampled(): <gradients>`` per sample, then
``opt.step()`` (no plan: the slow path).  Best of ``--rounds`` rounds of ``--iters`` iterations, the rows
interleaved round by round (this machine's timings drift by tens of percent)::

    python -m benchmarks.studies.host_step --out /tmp/hs [--device cpu]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

import torch

if __package__ in (None, ""):    # run as a script: the repository root, for ``benchmarks.*``
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__)))))

from benchmarks.common import optimizer_table as ot  # noqa: E402
from benchmarks.common.device import device_info, sync  # noqa: E402
from benchmarks.common.report import write_study  # noqa: E402

KINDS = ("adamw_fused", "ivon", "ivon_pocomo")
#: the rows with every Triton launch through the JIT
JIT_KINDS = ("ivon_jit_launch", "ivon_pocomo_jit_launch")
#: the rows without step plans (every iteration by the slow path: what the plans save)
NO_PLAN_KINDS = ("ivon_no_plan", "ivon_pocomo_no_plan")
#: the rows of the protocol without a closure: ``with opt.sampled(): <gradients>`` (and
#: ``sampled("outer")``), then ``opt.step()``
SAMPLED_KINDS = ("ivon_sampled", "ivon_pocomo_sampled")


def _row(kind: str, dev):
    """(one iteration, the gradient writing alone, closure calls per iteration)."""
    if kind in JIT_KINDS:
        from poco_kernels.kernels import triton_launch
        step, write, calls = _row(kind[:-len("_jit_launch")], dev)

        def jit_step():
            triton_launch.ENABLED = False
            try:
                step()
            finally:
                triton_launch.ENABLED = True
        return jit_step, write, calls
    no_plan = kind in NO_PLAN_KINDS
    if no_plan:
        kind = kind[:-len("_no_plan")]
    sampled = kind in SAMPLED_KINDS
    if sampled:
        kind = kind[:-len("_sampled")]
    ps = [torch.nn.Parameter(torch.randn(s, device=dev)) for s in ot.gpt2_shapes("tiny")]
    fixed = [torch.full_like(p, 1e-3) for p in ps]
    loss = torch.zeros((), device=dev)

    def assign():
        for p, g in zip(ps, fixed):
            p.grad = g
    if kind == "adamw_fused":
        opt = torch.optim.AdamW(ps, lr=1e-3, fused=True)

        def adamw():
            opt.zero_grad()
            assign()
            opt.step()
        return adamw, assign, 1
    import poco_kernels as pk
    kw = dict(lr=0.1, ess=1e6, hess_init=1e-3, backend=ot.fused_backend(dev))
    poco = kind == "ivon_pocomo"
    opt = pk.IVONPoCoMo(ps, alpha=0.7, **kw) if poco else pk.IVON(ps, **kw)
    opt.step_plans = not no_plan
    eng = opt._runner

    def write():
        if not eng.view.grad_views:
            assign()
            return
        for b in opt._buckets:
            b.grad_bufs[b.handed].flat.add_(1e-3)
            pres = getattr(b, "presence", None)
            if pres is not None:              # (the hooks' marks: every one reached)
                ctypes.memset(pres.addr, 1, pres.n)
            else:                             # (code before the byte arrays)
                eng.reached.update(b.ids())

    def closure():
        opt.zero_grad()
        write()
        return loss
    opt.step(closure)                         # (the views handed out)
    if poco:
        opt.refresh([closure])
    if sampled:
        def protocol():
            with opt.sampled():
                write()
            if poco:
                with opt.sampled("outer"):
                    write()
            opt.step()
        return protocol, write, 2 if poco else 1
    return (lambda: opt.step(closure)), write, 2 if poco else 1


def measure(dev, kinds, iters: int, rounds: int) -> dict:
    rows = {k: _row(k, dev) for k in kinds}
    best = {k: [float("inf"), float("inf")] for k in kinds}
    for f, _, _ in rows.values():
        for _ in range(20):
            f()
    for _ in range(rounds):
        for k, (f, write, _) in rows.items():
            for i, fn in enumerate((f, write)):
                sync(dev)
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                sync(dev)
                best[k][i] = min(best[k][i], (time.perf_counter() - t0) / iters * 1e6)
    out = {}
    for k, (_, _, calls) in rows.items():
        it, w = best[k]
        out[k] = {"iteration_us": round(it, 1), "gradient_writing_us": round(w, 1),
                  "closure_calls": calls, "host_us": round(it - calls * w, 1)}
    base = out.get("adamw_fused", {}).get("host_us")
    for r in out.values():
        r["x_fused_adamw"] = round(r["host_us"] / base, 2) if base else None
    return out


def markdown(dev, rows, iters: int, rounds: int) -> str:
    out = ["# The optimizer's host time per iteration, no backward pass", "",
           f"{device_info(dev)['name']}; GPT-2's 148 tensors, 1-4 elements each; best of "
           f"{rounds} rounds of {iters} iterations, interleaved", "",
           "| optimizer | iteration us | gradient writing us (x calls) | host us | x fused AdamW |",
           "|---|---|---|---|---|"]
    for k, r in rows.items():
        out.append(f"| {k} | {r['iteration_us']} | {r['gradient_writing_us']} "
                   f"(x{r['closure_calls']}) | **{r['host_us']}** | {r['x_fused_adamw']} |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--kinds", nargs="+", default=list(KINDS + NO_PLAN_KINDS + SAMPLED_KINDS),
                    choices=KINDS + JIT_KINDS + NO_PLAN_KINDS + SAMPLED_KINDS)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = measure(dev, a.kinds, a.iters, a.rounds)
    write_study(a.out, "host_step", markdown(dev, rows, a.iters, a.rounds),
                {"device": device_info(dev), "iters": a.iters, "rounds": a.rounds,
                 "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
