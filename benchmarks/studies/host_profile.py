"""Where the optimizer's host time goes, at the optimizer table's 148 GPT-2 shapes scaled
down to ~41k parameters (``optimizer_table.SCALES["host"]``), where the kernels cost
little and the host's work (Python, launches, synchronisation) is what a step costs.

Per row of the optimizer table (``--kinds``, default fused AdamW, IVON, IVON
``sample_ahead``, IVON-PoCoMo):

* ``host_us``: the host's wall time per iteration with nothing waited for inside the
  loop (``--iters`` iterations back to back, one synchronisation at the end; on a GPU
  the device keeps up at this size, so this is the host's own time), and ``closure_us``,
  the closure's part of it (timed inside the iteration), ``optimizer_host_us`` the rest;
* ``launches``: device kernels per iteration (``torch.profiler``; CUDA only), and
  ``syncs``: ``cudaStreamSynchronize``/``cudaDeviceSynchronize``/``cudaMemcpy`` calls per
  iteration (the host waiting for the device);
* the top functions of a ``cProfile`` of ``--profile-iters`` iterations of each
  ``--profile`` row, by own time, in ``host_profile.md``.

Writes ``host_profile.json`` and ``host_profile.md`` to ``--out``::

    python -m benchmarks.studies.host_profile --out /tmp/hp            # this machine's device
    python -m benchmarks.studies.host_profile --device cpu --iters 50 --out /tmp/hp
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch

if __package__ in (None, ""):    # run as a script: the repository root, for ``benchmarks.*``
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__)))))

from benchmarks.common import optimizer_table as ot  # noqa: E402
from benchmarks.common.device import device_info, sync  # noqa: E402
from benchmarks.common.report import json_default, log  # noqa: E402

DEFAULT_KINDS = ("adamw_fused", "ivon", "ivon_sample_ahead", "ivon_pocomo")
_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy ",
               "cudaMemcpy(", "cudaEventSynchronize")


def _row(kind, dev, iters, warm):
    f, calls, opt, ps, clock = ot.make_row(kind, dev)
    if f is None:
        return None, None
    for _ in range(warm):
        f()
    sync(dev)
    clock.ms = 0.0
    t0 = time.perf_counter()
    for _ in range(iters):
        f()
    sync(dev)
    total = (time.perf_counter() - t0) / iters * 1e6
    closure = clock.ms * 1e3 / iters
    row = {"host_us": round(total, 1), "closure_us": round(closure, 1),
           "optimizer_host_us": round(total - closure, 1), "closure_calls": calls}
    if dev.type == "cuda":
        row.update(_launches(f, iters=10))
    return row, f


def _launches(f, iters):
    """Device kernels and host-side synchronising calls per iteration."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            f()
        torch.cuda.synchronize()
    kernels = syncs = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels += 1
        elif any(e.name.startswith(s.rstrip(" (")) and s.strip("( ") in e.name
                 for s in _SYNC_CALLS):
            syncs += 1
    return {"launches": round(kernels / iters, 1), "syncs": round(syncs / iters, 1)}


def _profile(f, iters, top):
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(iters):
        f()
    pr.disable()
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    st.sort_stats("tottime").print_stats(top)
    return s.getvalue()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--kinds", nargs="+", default=list(DEFAULT_KINDS), choices=ot.KINDS)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--profile", nargs="*", default=["ivon", "ivon_pocomo"])
    ap.add_argument("--profile-iters", type=int, default=100)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    os.makedirs(a.out, exist_ok=True)
    info = device_info(dev)
    rows, profiles = {}, {}
    for kind in a.kinds:
        row, f = _row(kind, dev, a.iters, a.warm)
        if row is None:
            continue
        rows[kind] = row
        log(f"{kind:26s} " + "  ".join(f"{k} {v}" for k, v in row.items()))
        if kind in a.profile:
            profiles[kind] = _profile(f, a.profile_iters, a.top)
        del f
    with open(os.path.join(a.out, "host_profile.json"), "w") as fh:
        json.dump({"device": info, "rows": rows, "iters": a.iters}, fh, indent=1,
                  default=json_default)
    with open(os.path.join(a.out, "host_profile.md"), "w") as fh:
        fh.write(f"# Host time per iteration at 148 GPT-2 shapes, 41k parameters\n\n"
                 f"{info.get('device', dev)}, {info.get('date', '')}; {a.iters} iterations\n\n")
        cols = sorted({k for r in rows.values() for k in r})
        fh.write("| row | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols) + "\n")
        for kind, r in rows.items():
            fh.write(f"| {kind} | " + " | ".join(str(r.get(c, "")) for c in cols) + " |\n")
        for kind, text in profiles.items():
            fh.write(f"\n## cProfile: {kind}, {a.profile_iters} iterations\n\n```\n{text}```\n")
    log(f"wrote {a.out}/host_profile.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
