"""The host work the fused engine does per call, at the optimizer table's 148 GPT-2 shapes
scaled to 41k parameters (``optimizer_table.SCALES["host"]``), after a few steady-state
iterations of IVON: the best of ``--rounds`` means over ``--calls`` calls each, in µs.

* ``hand_out``: a sample's hand-out of the ``.grad`` views (they are already in place and
  the buffer holds zeros: the steady state);
* ``unwritten``: which handed-out views no backward reached (every one did);
* ``zero_grad``: the optimizer's public ``zero_grad()`` (the views zeroed in place);
* ``gather``: ``accumulate``'s collection of a bucket's gradients (every ``.grad`` the
  view: nothing to copy).

These are per-parameter Python loops that run once or twice per sample in every
iteration; the kernels are not in them.  Writes ``engine_calls.json`` to ``--out`` and
prints the rows::

    python -m benchmarks.studies.engine_calls --out /tmp/ec [--device cpu]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

if __package__ in (None, ""):    # run as a script: the repository root, for ``benchmarks.*``
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__)))))

from benchmarks.common import internals  # noqa: E402
from benchmarks.common import optimizer_table as ot  # noqa: E402
from benchmarks.common.device import device_info, sync  # noqa: E402
from benchmarks.common.report import json_default, log  # noqa: E402


def best_us(fn, calls: int, rounds: int, dev) -> float:
    fn()
    sync(dev)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(dev)
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return round(best, 2)


def measure(dev, calls: int, rounds: int) -> dict:
    f, _, opt, _, _ = ot.make_row("ivon", dev)
    for _ in range(5):
        f()
    calls_of = internals.engine_calls(opt)
    rows = {"hand_out": calls_of["hand_out"], "unwritten": calls_of["unwritten"],
            "zero_grad": opt.zero_grad, "gather": calls_of["gather"]}
    return {k: best_us(fn, calls, rounds, dev) for k, fn in rows.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    os.makedirs(a.out, exist_ok=True)
    rows = measure(dev, a.calls, a.rounds)
    for k, v in rows.items():
        log(f"{k:12s} {v:9.2f} us")
    with open(os.path.join(a.out, "engine_calls.json"), "w") as fh:
        json.dump({"device": device_info(dev), "us_per_call": rows, "calls": a.calls,
                   "rounds": a.rounds}, fh, indent=1, default=json_default)
    return 0


if __name__ == "__main__":
    sys.exit(main())
