"""``bench_gpu.py --quick``: the GPU check that fits one short device call (at most 4
minutes on one H100 or H200, Triton's compilations included).

Sections, in order (each is written to ``OUT/<section>.json`` and summarised in
``OUT/quick.md`` the moment it finishes, so a run cut short keeps what it did; a section
that would start past the time budget is skipped and says so):

1. ``device``: the device, versions, date, the copy bandwidth (the ceiling of the tables);
2. ``openloop``: every kernel operation within its float64 bound, compiled vs interpreted
   bit for bit, the PTX clean (``openloop.py``);
3. ``trajectory``: closed-loop parity, Triton against the torch backend, gated on the
   measured sensitivity of each trajectory (``parity.py``);
4. ``steady``: no host synchronisation in steady-state steps and refreshes, the cached
   Triton launches equal to the JIT's bit for bit, no new compilation when the learning
   rate changes, no growth of allocated memory (``checks.py``);
5. ``capture``: an iteration and a refresh captured in CUDA graphs, 20 replays with a
   scheduled learning rate equal to eager execution bit for bit; ``torch.compile`` of a
   step calling ``opt.step(closure)`` without recompilation (``capture.py``);
6. ``optimizer_only``, ``end_to_end``, ``torch_backend``: the tables of ``tables.py``;
7. ``host_calls``: the host time of each public call of IVON and IVON-PoCoMo beyond the
   kernels (their launches) at GPT-2's 148 tensors shrunk to 1-4 elements
   (``benchmarks/studies/host_calls.py``; ``host_calls.md`` beside ``quick.md``), and
   the whole host time of a ``step(closure)`` iteration without a backward pass against
   fused AdamW's, and with every Triton launch through the JIT
   (``benchmarks/studies/host_step.py``; ``host_step.md``).

Exit status: 0 when every check passed; 1 parity (sections 2-3), 2 steady state or
capture (4-5), 4 a table raised, 16 a section was skipped for time.  ``--smoke`` runs
every section on the CPU under the Triton interpreter at tiny sizes (CI).
"""
from __future__ import annotations

import json
import os
import time
import traceback

import torch

from benchmarks.common.device import device_info, release
from benchmarks.common.report import dump, json_default, log

#: the wall-clock budget of a quick run, seconds (a section starts only with the time it
#: needs left; imports, CUDA's start and the device section come on top, ~15 s)
BUDGET_S = 180.0
#: seconds each section is expected to need at most on a GPU, to decide whether it starts
NEEDS_S = {"openloop": 60, "trajectory": 30, "steady": 10, "capture": 35,
           "optimizer_only": 45, "end_to_end": 20, "torch_backend": 5, "host_calls": 15}
GROUP = {"openloop": 1, "trajectory": 1, "steady": 2, "capture": 2, "optimizer_only": 4,
         "end_to_end": 4, "torch_backend": 4, "host_calls": 4}


def _copy_Bps(dev, smoke):
    n = (1 << 20) if smoke else (1 << 28)
    a, b = torch.randn(n, device=dev), torch.empty(n, device=dev)
    from benchmarks.gpu.tables import _timed
    ms = _timed(dev, lambda: b.copy_(a), 3 if smoke else 10)
    del a, b
    release(dev)
    return 2 * n * 4 / (ms * 1e-3)


def _table(res):
    """A table's result and its failures: the rows that raised."""
    rows = res.get("rows", res) if isinstance(res, dict) else {}
    fails = [f"{k}: {r['error']}" for k, r in rows.items()
             if isinstance(r, dict) and "error" in r]
    return res, fails


def _host_calls(dev, smoke, out_dir):
    """Section 7: :mod:`benchmarks.studies.host_calls` at the tiny shapes, and
    :mod:`benchmarks.studies.host_step`."""
    from benchmarks.studies import host_calls, host_step
    iters, warm, every, hook_rounds = (3, 1, 2, 1) if smoke else (100, 10, 10, 5)
    rows = {k: host_calls.measure(dev, k, "tiny", iters, warm, every, hook_rounds)
            for k in host_calls.KINDS}
    with open(os.path.join(out_dir, "host_calls.md"), "w") as fh:
        fh.write(host_calls.markdown(dev, rows, "tiny", iters, warm, every) + "\n")
    iters, rounds = (3, 1) if smoke else (100, 5)
    step_rows = host_step.measure(dev, host_step.KINDS + host_step.JIT_KINDS
                                  + host_step.NO_PLAN_KINDS + host_step.SAMPLED_KINDS,
                                  iters, rounds)
    with open(os.path.join(out_dir, "host_step.md"), "w") as fh:
        fh.write(host_step.markdown(dev, step_rows, iters, rounds) + "\n")
    return {"calls": rows, "step": step_rows}, []


def _sections(dev, smoke, state):
    from benchmarks.gpu import capture as gpu_capture
    from benchmarks.gpu import checks as gpu_checks
    from benchmarks.gpu import openloop as gpu_openloop
    from benchmarks.gpu import parity as gpu_parity
    from benchmarks.gpu import tables as gpu_tables

    def steady():
        res, fails = {}, []
        for name, fn in (("sync", gpu_checks.check_sync), ("launch", gpu_checks.check_launch),
                         ("jit_memory", lambda d, s: gpu_checks.check_jit_and_memory(
                             d, s, steps=4 if s else 20))):
            r, f = fn(dev, smoke)
            res[name] = r
            fails += f
        return res, fails

    def capture():
        g, f1 = gpu_capture.check_graph(dev, smoke)
        c, f2 = gpu_capture.check_compile(dev, smoke)
        return {"graph": g, "compile": c}, f1 + f2

    bw = state["copy_Bps"]
    return [
        ("openloop", lambda: gpu_openloop.run(dev, smoke, log, budget_s=NEEDS_S["openloop"])),
        ("trajectory", lambda: gpu_parity.parity(dev, smoke)),
        ("steady", steady),
        ("capture", capture),
        ("optimizer_only", lambda: _table(gpu_tables.optimizer_only(dev, smoke, bw))),
        ("end_to_end", lambda: _table(gpu_tables.end_to_end(dev, smoke))),
        ("torch_backend", lambda: _table(gpu_tables.torch_backend_rows(dev, smoke, bw))),
        ("host_calls", lambda: _host_calls(dev, smoke, state["out_dir"])),
    ]


def main(out_dir, smoke, budget_s=BUDGET_S, only=None):
    t_start = time.perf_counter()
    os.makedirs(out_dir, exist_ok=True)
    dev = torch.device("cpu") if smoke else torch.device("cuda", torch.cuda.current_device())
    md = open(os.path.join(out_dir, "quick.md"), "w")

    def note(line):
        log(line)
        md.write(line + "\n")
        md.flush()

    info = device_info(dev)
    state = {"copy_Bps": _copy_Bps(dev, smoke), "out_dir": out_dir}
    info["copy_GBps"] = round(state["copy_Bps"] / 1e9, 1)
    dump(os.path.join(out_dir, "device.json"), info)
    note(f"# bench_gpu --quick: {info['device']} | torch {info['torch']} | triton "
         f"{info.get('triton')} | {info['date']} | copy {info['copy_GBps']} GB/s")
    code, summary = 0, {"sections": {}}
    for name, fn in _sections(dev, smoke, state):
        if only and name not in only:
            continue
        left = budget_s - (time.perf_counter() - t_start)
        if not smoke and left < NEEDS_S[name]:
            summary["sections"][name] = {"skipped": f"{left:.0f} s left of {budget_s:.0f}"}
            note(f"## {name}: SKIPPED ({left:.0f} s left)")
            code |= 16
            continue
        note(f"## {name}")
        t0 = time.perf_counter()
        try:
            res, fails = fn()
        except Exception as exc:
            traceback.print_exc()
            res, fails = {"raised": f"{type(exc).__name__}: {exc}"[:1000]}, [
                f"{name} raised {type(exc).__name__}: {exc}"[:300]]
        secs = time.perf_counter() - t0
        dump(os.path.join(out_dir, f"{name}.json"), {"seconds": secs, "failures": fails,
                                                      "result": res})
        summary["sections"][name] = {"seconds": round(secs, 1), "failures": fails}
        for f in fails:
            note(f"- FAIL {f}")
        note(f"- {name}: {'pass' if not fails else 'FAIL'} in {secs:.1f} s")
        if fails:
            code |= GROUP[name]
        release(dev)
    summary["seconds"] = round(time.perf_counter() - t_start, 1)
    summary["exit"] = code
    dump(os.path.join(out_dir, "quick.json"), summary)
    note(f"\n{'PASS' if code == 0 else 'FAIL'} (exit {code}) in {summary['seconds']:.0f} s "
         f"(budget {budget_s:.0f} s); outputs in {out_dir}")
    md.close()
    log(json.dumps(summary, default=json_default)[:2000])
    return code
