"""One training iteration per optimizer, as a training loop runs it: the optimizer's own
time (the cycle minus the closure's measured time), its model bytes, the memory it keeps
resident between iterations (measured) and its allocations per iteration.

The model: three parameters of odd sizes, ``numel`` elements in all (2^24 by default); the
closure ``zero_grad(); loss = sum(p * c); loss.backward()`` (a linear loss: its backward
writes one gradient tensor per parameter, as any model's does).  Rows, for fused and
foreach AdamW (``closure(); step()``), IVON and IVON-PoCoMo (``step(closure)``; IVON-PoCoMo
with the correction active, its refresh timed apart; the default, parked), each also with
the copy protocol (``sample_ahead=False``), with ``sample_ahead=True`` and with
``sample_ahead=True, state_dtype=torch.bfloat16``; IVON-PoCoMo with
``outer_dtype=torch.bfloat16``; and IVON and IVON-PoCoMo drawing noise stream version 1
(one Philox call per normal, the stream before version 2):

* ``iter_cycle``: the whole iteration, closure calls included;
* ``iter_closure``: the closure calls inside those iterations (timed each time, summed);
* ``iter_optimizer``: the difference, per iteration (median of the per-iteration
  differences), with the byte model of ``common/byte_models.py``'s ``b_iteration``;
* ``iter_refresh`` (IVON-PoCoMo): ``refresh([closure])``, closure included.

Memory: each optimizer runs in a fresh process; its resident set (``/proc/self/statm``)
after warm-up iterations, minus what it was with the parameters and one gradient each
before the optimizer was built, per parameter (on CUDA: ``torch.cuda.memory_allocated``);
beside it the bytes the optimizer object holds (``held_bytes`` of ``suite/memory.py``);
allocations per iteration from the profiler (its ``count_allocations``), those of the
closure calls subtracted.

    .venv/bin/python benchmarks/studies/iteration.py [--numel 16777216] [--reps 10]
        [--out F.csv]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

if __package__ in (None, ""):    # run as a script: the repository root, for ``benchmarks.*``
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__)))))

from benchmarks.common.byte_models import b_iteration  # noqa: E402
from benchmarks.common.device import device_info, sync  # noqa: E402
from benchmarks.common.report import write_csv  # noqa: E402
from benchmarks.suite.memory import count_allocations, held_bytes  # noqa: E402

SIZES = (600001, 300007, 148567)


def _params(dev, numel, seed=0):
    total = sum(SIZES)
    sizes = [max(1, (n * numel) // total) | 1 for n in SIZES]
    g = torch.Generator(device="cpu").manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(n, generator=g).to(dev)) for n in sizes]
    cs = [torch.randn(n, generator=g).to(dev) for n in sizes]
    return ps, cs


def _rss() -> int:
    """The resident set, after glibc gave back the heap memory freed so far (malloc_trim:
    freed parameter and gradient storages would otherwise count)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _resident(dev) -> int:
    if dev.type == "cuda":
        sync(dev)
        return torch.cuda.memory_allocated(dev)
    return _rss()


def _noise_v1(opt):
    opt.noise_version = 1
    return opt


def candidates(backend):
    import poco_kernels as pk
    return [
        ("AdamW", "torch.AdamW(fused)", lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
         "plain"),
        ("AdamW", "torch.AdamW(foreach)",
         lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True), "plain"),
        ("IVON", f"poco_kernels.{backend}",
         lambda ps: pk.IVON(ps, lr=1e-3, ess=1.0, backend=backend), "ours"),
        ("IVONPoCoMo", f"poco_kernels.{backend}",
         lambda ps: pk.IVONPoCoMo(ps, lr=1e-3, ess=1.0, backend=backend), "ours"),
        # the copy protocol: a sample pass each iteration (the default before parking)
        ("IVON", f"poco_kernels.{backend}(copy)",
         lambda ps: pk.IVON(ps, lr=1e-3, ess=1.0, backend=backend, sample_ahead=False), "ours"),
        ("IVONPoCoMo", f"poco_kernels.{backend}(copy)",
         lambda ps: pk.IVONPoCoMo(ps, lr=1e-3, ess=1.0, backend=backend, sample_ahead=False),
         "ours"),
        # the noise stream of checkpoints written before version 2, for the before/after
        ("IVON", f"poco_kernels.{backend}(noise v1)",
         lambda ps: _noise_v1(pk.IVON(ps, lr=1e-3, ess=1.0, backend=backend)), "ours"),
        ("IVONPoCoMo", f"poco_kernels.{backend}(noise v1)",
         lambda ps: _noise_v1(pk.IVONPoCoMo(ps, lr=1e-3, ess=1.0, backend=backend)), "ours"),
        ("IVON", f"poco_kernels.{backend}(sample_ahead)",
         lambda ps: pk.IVON(ps, lr=1e-3, ess=1.0, backend=backend, sample_ahead=True), "ours"),
        ("IVONPoCoMo", f"poco_kernels.{backend}(sample_ahead)",
         lambda ps: pk.IVONPoCoMo(ps, lr=1e-3, ess=1.0, backend=backend, sample_ahead=True),
         "ours"),
        ("IVON", f"poco_kernels.{backend}(sample_ahead,bf16_state)",
         lambda ps: pk.IVON(ps, lr=1e-3, ess=1.0, backend=backend, sample_ahead=True,
                            state_dtype=torch.bfloat16), "ours"),
        ("IVONPoCoMo", f"poco_kernels.{backend}(sample_ahead,bf16_state)",
         lambda ps: pk.IVONPoCoMo(ps, lr=1e-3, ess=1.0, backend=backend, sample_ahead=True,
                                  state_dtype=torch.bfloat16), "ours"),
        ("IVONPoCoMo", f"poco_kernels.{backend}(bf16_outer)",
         lambda ps: pk.IVONPoCoMo(ps, lr=1e-3, ess=1.0, backend=backend,
                                  outer_dtype=torch.bfloat16), "ours"),
    ]


def measure(dev, name, provider, make, kind, numel, reps):
    ps, cs = _params(dev, numel)
    n = sum(p.numel() for p in ps)
    # the baseline: parameters with one gradient each, as a model has before its optimizer
    (sum((p * c).sum() for p, c in zip(ps, cs))).backward()
    sync(dev)
    base = _resident(dev)
    opt = make(ps)
    spent = []

    def closure():
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = sum((p * c).sum() for p, c in zip(ps, cs))
        loss.backward()
        sync(dev)
        spent.append(time.perf_counter() - t0)
        return loss

    if kind == "plain":
        def it():
            closure()
            opt.step()
    else:
        def it():
            opt.step(closure)
    refresh = None
    if name == "IVONPoCoMo":
        def refresh():
            opt.refresh([closure])
        it()
        refresh()                          # the correction is active from here on
    for _ in range(3):
        it()
    sync(dev)
    resident = (_resident(dev) - base) / n
    cycles, closures, opts = [], [], []
    for _ in range(reps):
        spent.clear()
        sync(dev)
        t0 = time.perf_counter()
        it()
        sync(dev)
        dt = time.perf_counter() - t0
        cycles.append(dt)
        closures.append(sum(spent))
        opts.append(dt - sum(spent))
    rows = []
    runner = getattr(opt, "_runner", None)      # (a default row that did not park copies)
    parked = runner is None or "(" in provider or runner.parks()
    model = b_iteration(name, provider if parked else provider + "(copy)")
    for kernel, ts, bpp in (("iter_cycle", cycles, None), ("iter_closure", closures, None),
                            ("iter_optimizer", opts, model)):
        rows.append(_row(kernel, provider, name, n, ts, bpp, dev))
    if refresh is not None:
        ts = []
        for _ in range(max(3, reps // 3)):
            sync(dev)
            t0 = time.perf_counter()
            refresh()
            sync(dev)
            ts.append(time.perf_counter() - t0)
            it()
        rows.append(_row("iter_refresh", provider, name, n, ts, None, dev))
    # the optimizer's allocations: those of an iteration minus those of its closure calls
    calls = 2 if name == "IVONPoCoMo" else 1
    allocs, abytes = count_allocations(it, 3)
    c_allocs, c_bytes = count_allocations(closure, 3 * calls)
    held = held_bytes(opt, ps)[0] / n
    for r in rows:
        r.update(resident_bytes_per_param=round(resident, 2),
                 held_bytes_per_param=round(held, 2),
                 allocs_per_iter=None if allocs is None else allocs - calls * c_allocs,
                 alloc_bytes_per_iter=None if abytes is None else abytes - calls * c_bytes)
    return rows


_INFO = {}


def _device(dev):
    if dev not in _INFO:
        _INFO[dev] = device_info(dev)["device"]
    return _INFO[dev]


def _row(kernel, provider, name, n, ts, bpp, dev):
    ts = sorted(ts)
    q = lambda f: ts[min(len(ts) - 1, int(f * len(ts)))]  # noqa: E731
    return dict(kernel=f"{kernel}_{name}", provider=provider, dtype="float32", size=n,
                median=statistics.median(ts), p20=q(0.2), p80=q(0.8),
                bytes_per_param=bpp, timing="perf_counter",
                device=_device(dev), date=time.strftime("%Y-%m-%d"))


def markdown(rows, device):
    """The run as one table: per optimizer, the optimizer's time per iteration against
    fused AdamW's, the closure's and the cycle's, the byte model, memory, allocations."""
    get = {(r["kernel"].split("_", 2)[1] + "_" + r["kernel"].split("_", 2)[2],
            r["provider"]): r for r in rows}
    out = [f"Device: {device}; {rows[0]['size']} float32 parameters; medians (p20-p80) of "
           "the iterations of one run.", "",
           "| optimizer | provider | optimizer ms | x fused AdamW | closure ms | cycle ms "
           "| model B/param | resident B/param (held) | allocations / iteration |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["kernel"].startswith("iter_optimizer_"):
            continue
        name = r["kernel"][len("iter_optimizer_"):]
        c = get.get((f"closure_{name}", r["provider"]))
        y = get.get((f"cycle_{name}", r["provider"]))
        ms = lambda x: f"{x['median'] * 1e3:.1f} ({x['p20'] * 1e3:.1f}-{x['p80'] * 1e3:.1f})"  # noqa: E731
        out.append(f"| {name} | {r['provider']} | {ms(r)} | {r.get('vs_fused_adamw_optimizer')} "
                   f"| {ms(c)} | {ms(y)} | {r['bytes_per_param']} "
                   f"| {r['resident_bytes_per_param']} ({r['held_bytes_per_param']}) "
                   f"| {r['allocs_per_iter']} |")
    ref = [r for r in rows if r["kernel"].startswith("iter_refresh_")]
    for r in ref:
        out.append(f"\nRefresh of {r['kernel'][len('iter_refresh_'):]} ({r['provider']}), "
                   f"closure included: {r['median'] * 1e3:.1f} ms.")
    return "\n".join(out) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=2 ** 24)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--backend", default=None, help="cpp (CPU) or triton (CUDA)")
    ap.add_argument("--out", default="bench_out/iteration.csv")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = a.backend or ("triton" if dev.type == "cuda" else "cpp")
    cands = candidates(backend)
    if a.one is not None:            # a child: one candidate, its rows as JSON on stdout
        name, provider, make, kind = cands[a.one]
        print("ROWS " + json.dumps(measure(dev, name, provider, make, kind, a.numel, a.reps)))
        return
    rows = []
    for i, (name, provider, _, _) in enumerate(cands):
        # each in a fresh process: its resident memory is its own, not the allocator's
        # leftovers of the ones before
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", str(i),
                              "--numel", str(a.numel), "--reps", str(a.reps),
                              "--backend", backend], capture_output=True, text=True)
        line = next((x for x in out.stdout.splitlines() if x.startswith("ROWS ")), None)
        if line is None:
            raise RuntimeError(f"{name} {provider}: {out.stderr[-2000:]}")
        rows += json.loads(line[5:])
        r = next(r for r in rows if r["kernel"] == f"iter_optimizer_{name}"
                 and r["provider"] == provider)
        print(f"{name:11s} {provider:22s} optimizer {r['median'] * 1e3:8.2f} ms  resident "
              f"{r['resident_bytes_per_param']:6.2f} B/param (held {r['held_bytes_per_param']})"
              f"  allocations/iteration {r['allocs_per_iter']}", flush=True)
    by = {(r["kernel"], r["provider"]): r["median"] for r in rows}
    fused = by.get(("iter_optimizer_AdamW", "torch.AdamW(fused)"))
    for r in rows:
        if r["kernel"].startswith("iter_"):
            r["vs_fused_adamw_optimizer"] = round(r["median"] / fused, 2) if fused else None
            print(f"  {r['kernel']:28s} {r['provider']:22s} {r['median'] * 1e3:8.2f} ms "
                  f"(p20 {r['p20'] * 1e3:.2f}, p80 {r['p80'] * 1e3:.2f})  "
                  f"x fused AdamW optimizer {r['vs_fused_adamw_optimizer']}")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(os.path.splitext(a.out)[0] + ".md", "w") as f:
        f.write(markdown(rows, _device(dev)))
    write_csv(a.out, rows, _device(dev), time.strftime("%Y-%m-%d"))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
