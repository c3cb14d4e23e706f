"""The host time of each public call of an iteration, beyond the kernels: the measure of
the optimizer's host work that its users pay on a GPU for every small or medium model.

At the optimizer table's 148 GPT-2 shapes (``--scale``: ``host``, 41k parameters, or
``tiny``, the same 148 tensors of 1 to 4 elements, where the kernels compute nothing),
fused backend of this device, for IVON and IVON-PoCoMo (the correction active):

* per public call of the protocol (``zero_grad``, ``sample``, ``accumulate``,
  ``restore``, ``step``, and ``refresh`` once every ``--refresh-every`` iterations), its
  wall time, the time spent inside the kernels' wrapper functions (``kernel_us``: the
  operator dispatch and the kernel itself; on a GPU the launch), and the rest
  (``host_us``: the Python work of the call);
* the same for ``step(closure)`` (the closure's own time, its forward and backward,
  subtracted) and for ``with opt.sampled():`` around the backward;
* ``hooks in a backward``: what the optimizer's hooks on the parameters add to each
  backward pass (the ``.grad`` views' hooks that note which parameters autograd reached:
  ``backends/fused_presence.py``), the backward over the optimizer's parameters less
  the same backward over twins without hooks (also accumulating into existing
  ``.grad``), the median of ``--hook-rounds`` paired differences: optimizer host time that runs
  inside autograd, and so inside the closure;
* per iteration, the sum of ``host_us`` over the calls of one iteration, the hooks'
  share of its backward passes included.

The backward passes' own host work (autograd's, the model's) is not counted.  Each loop
(the explicit calls, ``step(closure)``, ``sampled()`` blocks) runs in its own phase,
``--warm`` iterations then ``--iters`` timed, as a training loop keeps to one protocol
(a step of another protocol drops a step plan or an update memo); medians.
Writes ``host_calls.json`` and ``host_calls.md`` to ``--out``::

    python -m benchmarks.studies.host_calls --out /tmp/hc [--device cpu] [--scale tiny]

On a GPU it is also a section of the quick GPU check (``bench_gpu.py --quick``).
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

from benchmarks.common import internals  # noqa: E402
from benchmarks.common import optimizer_table as ot  # noqa: E402
from benchmarks.common.device import device_info, sync  # noqa: E402
from benchmarks.common.report import write_study  # noqa: E402

KINDS = ("ivon", "ivon_pocomo")


class _Split:
    """Per named call: wall µs and µs inside the kernels' wrappers, one list entry per
    call."""

    def __init__(self, dev):
        self.dev, self.kernel_s = dev, 0.0
        self.rows = {}

    def call(self, name, fn, *args):
        sync(self.dev)
        k0 = self.kernel_s
        t0 = time.perf_counter()
        out = fn(*args)
        wall = time.perf_counter() - t0
        kern = self.kernel_s - k0
        self.rows.setdefault(name, []).append((wall * 1e6, kern * 1e6))
        return out


def _protocol(opt, ps, split, poco: bool, refresh: bool):
    """One iteration by sample/accumulate/restore/step, each call timed."""
    def backward():
        sum(p.sum() for p in ps).backward()
    split.call("zero_grad", opt.zero_grad)
    kinds = ("inner", "outer") if poco else ("inner",)
    for k in kinds:
        split.call("sample", opt.sample, k)
        backward()
        split.call("accumulate", opt.accumulate)
        split.call("restore", opt.restore)
    split.call("step", opt.step)
    if refresh:
        split.call("zero_grad", opt.zero_grad)
        split.call("sample", opt.sample, "refresh")
        backward()
        split.call("accumulate", opt.accumulate)
        split.call("restore", opt.restore)
        split.call("refresh", opt.refresh)


def _closure(opt, ps, closure_s):
    """The closure: ``zero_grad()``, forward, backward; its own time added to
    ``closure_s[0]``."""
    def closure():
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = sum(p.sum() for p in ps)
        loss.backward()
        closure_s[0] += time.perf_counter() - t0
        return loss
    return closure


def _closure_step(opt, ps, split, poco: bool, refresh: bool):
    """One iteration by ``step(closure)`` (timed less the closure's own time), and the
    refresh by closures once every ``refresh_every``."""
    closure_s = [0.0]
    closure = _closure(opt, ps, closure_s)
    sync(split.dev)
    k0 = split.kernel_s
    t0 = time.perf_counter()
    opt.step(closure)
    wall = time.perf_counter() - t0 - closure_s[0]
    split.rows.setdefault("step(closure)", []).append((wall * 1e6, (split.kernel_s - k0) * 1e6))
    if refresh:
        closure_s[0] = 0.0
        k0 = split.kernel_s
        t0 = time.perf_counter()
        opt.refresh([closure])
        wall = time.perf_counter() - t0 - closure_s[0]
        split.rows.setdefault("refresh(closures)", []).append(
            (wall * 1e6, (split.kernel_s - k0) * 1e6))


def _sampled_step(opt, ps, split, poco: bool, refresh: bool):
    """One iteration by ``sampled()`` blocks and ``step()`` (timed less the blocks'
    backward passes); the refresh, untimed, once every ``refresh_every``."""
    sync(split.dev)
    k0 = split.kernel_s
    t0 = time.perf_counter()
    inside = 0.0
    for k in (("inner", "outer") if poco else ("inner",)):
        with opt.sampled(k):
            t1 = time.perf_counter()
            opt.zero_grad()
            sum(p.sum() for p in ps).backward()
            inside += time.perf_counter() - t1
    opt.step()
    wall = time.perf_counter() - t0 - inside
    split.rows.setdefault("sampled()+step", []).append((wall * 1e6, (split.kernel_s - k0) * 1e6))
    if refresh:
        opt.refresh([_closure(opt, ps, [0.0])])


#: the loops timed, each in its own phase (a step plan or an update memo serves a loop
#: that keeps to one protocol; a step of another protocol drops it)
PHASES = (_protocol, _closure_step, _sampled_step)


def hook_us(ps, dev, rounds: int = 15, n: int = 20) -> float:
    """µs the optimizer's hooks on ``ps`` add to a backward pass (see the module doc)."""
    twins = [torch.nn.Parameter(torch.zeros_like(p)) for p in ps]
    for t in twins:
        t.grad = torch.zeros_like(t)
    with torch.no_grad():
        for p in ps:
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    def per_backward(xs):
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(n):
            sum(x.sum() for x in xs).backward()
        sync(dev)
        return (time.perf_counter() - t0) / n * 1e6
    diffs = []                        # (paired, back to back: drift cancels)
    for r in range(rounds):
        if r % 2:
            t, o = per_backward(twins), per_backward(ps)
        else:
            o, t = per_backward(ps), per_backward(twins)
        diffs.append(o - t)
    return round(max(0.0, statistics.median(diffs)), 1)


def measure(dev, kind: str, scale: str, iters: int, warm: int, refresh_every: int,
            hook_rounds: int = 15) -> dict:
    _, _, opt, ps, _ = ot.make_row(kind, dev, scale)
    split = _Split(dev)
    internals.time_kernels(opt, split)
    poco = kind.startswith("ivon_pocomo")
    rows = {}
    for phase in PHASES:                      # (each to its steady state: warm, then timed)
        split.rows = {}
        for i in range(warm + iters):
            if i == warm:
                split.rows = rows
            r = poco and i % refresh_every == refresh_every - 1
            phase(opt, ps, split, poco, r)
    split.rows = rows
    sync(dev)
    calls = {}
    for name, xs in split.rows.items():
        per_iter = len(xs) / iters
        wall = statistics.median(w for w, _ in xs)
        kern = statistics.median(k for _, k in xs)
        host = statistics.median(w - k for w, k in xs)
        calls[name] = {"calls_per_iteration": per_iter, "wall_us": round(wall, 1),
                       "kernel_us": round(kern, 1), "host_us": round(host, 1)}
    # (one backward per sample; after the timed iterations, with the views handed out)
    calls["hooks in a backward"] = {
        "calls_per_iteration": calls["accumulate"]["calls_per_iteration"],
        "wall_us": None, "kernel_us": 0.0, "host_us": hook_us(ps, dev, hook_rounds)}
    per_iter = sum(calls[n]["host_us"] * calls[n]["calls_per_iteration"]
                   for n in ("sample", "accumulate", "restore", "step", "hooks in a backward"))
    if "refresh" in calls:
        per_iter += sum(calls[n]["host_us"] for n in ("refresh",)) / refresh_every
    return {"calls": calls, "protocol_host_us_per_iteration": round(per_iter, 1),
            "numel": sum(p.numel() for p in ps), "tensors": len(ps)}


def markdown(dev, rows, scale: str, iters: int, warm: int, refresh_every: int) -> str:
    """The rows of :func:`measure` per kind as markdown tables."""
    out = [f"# Host time per public call, beyond the kernels ({scale} shapes)", "",
           f"{device_info(dev)['name']}; {iters} iterations after {warm}; medians; "
           f"refresh every {refresh_every} iterations (IVON-PoCoMo)", ""]
    for kind, r in rows.items():
        out += [f"## {kind}: {r['tensors']} tensors, {r['numel']} parameters", "",
                "| call | per iteration | wall us | kernel us | host us |", "|---|---|---|---|---|"]
        for name, c in r["calls"].items():
            wall = "-" if c["wall_us"] is None else c["wall_us"]
            out.append(f"| {name} | {c['calls_per_iteration']:g} | {wall} | "
                       f"{c['kernel_us']} | {c['host_us']} |")
        out += ["", f"sample/accumulate/restore/step and the hooks in the backward passes, "
                    f"host us per iteration (zero_grad apart, refresh amortised): "
                    f"**{r['protocol_host_us_per_iteration']}**", ""]
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--scale", default="host", choices=("host", "tiny"))
    ap.add_argument("--kinds", nargs="+", default=list(KINDS))
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warm", type=int, default=20)
    ap.add_argument("--refresh-every", type=int, default=10)
    ap.add_argument("--hook-rounds", type=int, default=15)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = {k: measure(dev, k, a.scale, a.iters, a.warm, a.refresh_every, a.hook_rounds)
            for k in a.kinds}
    write_study(a.out, "host_calls", markdown(dev, rows, a.scale, a.iters, a.warm,
                                              a.refresh_every),
                {"device": device_info(dev), "scale": a.scale, "iters": a.iters,
                 "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
