"""The optimizer table: every optimizer a user weighs against this package, one training
iteration each at GPT-2 124M's 148 parameter shapes, measured the same way on every device
(``run.py``'s section 2 on any device, ``bench_gpu.py --quick``'s ``optimizer_only`` on a
GPU).

Rows: fused and foreach AdamW (``closure(); step()``), ivon-opt's IVON (a closure inside
``sampled_params(train=True)``, then ``step()``), and this package's IVON and IVON-PoCoMo
(``step(closure)``; IVON-PoCoMo with the correction active; the default
``sample_ahead=None``: parked where it applies), each of ours also with the copy protocol
(``sample_ahead=False``, rows ``*_copy``), with ``sample_ahead=True``, with bfloat16 state (IVON-PoCoMo also with bfloat16 outer
estimates alone, ``outer_dtype``), and with the ``grad_views`` setting that is
not the device's default (``is_default``: views the backward adds into on Triton;
autograd's own ``.grad`` tensors, copied in, on C++).  The closure is what
training does to the gradients: zero them (the optimizer's ``zero_grad()``), the
backward pass of ``sum(p * c)`` (one gradient tensor per parameter, through autograd).

Columns, per row:

* ``cycle_ms``: the whole iteration (median);
* ``optimizer_ms``: the iteration less its closure evaluations (twice for IVON-PoCoMo),
  median over the iterations; on the CPU the closure calls are timed inside each
  iteration, on a GPU (where a synchronised timer inside would serialise the iteration)
  the closure is timed alone right after each iteration (paired); and
  ``ratio_to_fused_adamw`` of it;
* ``model_B_per_param``: the bytes per parameter the optimizer must move per iteration
  (``byte_models.b_iteration``, ``b_adamw``, ``b_ivonopt_cycle``), and
  ``B_per_param_at_copy_bw``: what its measured time would move at the device's copy
  bandwidth (``model / at_copy_bw``: the share of copy speed it reaches);
* ``protocol`` (ours): ``parked``, ``copy`` or ``sample_ahead``: what the row ran (a
  default row runs the copy protocol where parking does not apply, e.g. without the C++
  extension), which its byte model follows;
* ``resident_B_per_param``: what the iteration keeps allocated per parameter, parameter and
  gradient included (CUDA: the allocator's count; elsewhere: the parameters, their
  gradients and the tensors the optimizer object holds, each storage once);
* ``host_us``: ``optimizer_ms`` again, at the same 148 shapes scaled down to ~41k
  parameters, where the kernels' share is small: mostly the host's time per iteration
  (Python, launches, synchronisation) that a small or medium model pays on every step.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

import poco_kernels as pk
from benchmarks.common.byte_models import S, b_adamw, b_iteration, b_ivonopt_cycle
from benchmarks.common.device import release, sync
from benchmarks.common.report import log

#: the rows, in the table's order
KINDS = ("adamw_fused", "adamw_foreach", "ivon_opt", "ivon", "ivon_copy", "ivon_sample_ahead",
         "ivon_bf16_state", "ivon_grad_views", "ivon_no_grad_views", "ivon_pocomo",
         "ivon_pocomo_copy", "ivon_pocomo_sample_ahead", "ivon_pocomo_bf16_state",
         "ivon_pocomo_bf16_outer", "ivon_pocomo_grad_views", "ivon_pocomo_no_grad_views")


def views_default(dev) -> bool:
    """``grad_views`` left to the default on ``dev``'s fused backend: False on Triton on a
    GPU, True elsewhere (C++, the Triton interpreter)."""
    return not (dev.type == "cuda" and fused_backend(dev) == "triton")


def is_default(kind: str, dev) -> bool:
    """A ``*_grad_views`` or ``*_no_grad_views`` row that is the default row on ``dev``:
    not run twice."""
    views_default_ = views_default(dev)
    if kind.endswith("_no_grad_views"):
        return not views_default_
    return kind.endswith("_grad_views") and views_default_

#: (d, vocab, context, layers) of the shape sets
SCALES = {"gpt2": (768, 50304, 1024, 12),      # GPT-2 124M: 124.4M parameters
          "host": (16, 64, 32, 12),            # the same 148 shapes, 41k parameters
          "smoke": (16, 97, 32, 1),            # (CI: 16 tensors)
          "tiny": (1, 2, 1, 12)}               # the 148 shapes, 1 to 4 elements each


def gpt2_shapes(scale: str = "gpt2") -> List[Tuple[int, ...]]:
    """GPT-2's parameter shapes: embeddings, 12 per block, the final norm."""
    d, v, ctx, layers = SCALES[scale]
    s = [(v, d), (ctx, d)]
    for _ in range(layers):
        s += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d),
              (4 * d,), (4 * d, d), (d,)]
    return s + [(d,), (d,)]


def timed(dev, fn: Callable, reps: int, warm: int = 2) -> float:
    """Median milliseconds of ``fn`` (CUDA events on a GPU)."""
    for _ in range(warm):
        fn()
    sync(dev)
    ts = []
    for _ in range(reps):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
    return sorted(ts)[len(ts) // 2]


def timed_less_closure(dev, fn, closure, calls, reps, warm=2) -> Tuple[float, float, float]:
    """Medians of ``fn``, of ``fn`` less ``calls`` closure evaluations, and of the closure,
    timed right after each ``fn`` (paired, so a slow moment of a shared machine lands on
    both; one closure time subtracted from every row could exceed a row's own time)."""
    for _ in range(warm):
        fn()
        closure()
    pairs = []
    for _ in range(reps):
        t = timed(dev, fn, 1, warm=0)
        tc = timed(dev, closure, 1, warm=0) if calls else 0.0
        pairs.append((t, t - calls * tc, tc))
    mid = len(pairs) // 2
    return tuple(sorted(p[i] for p in pairs)[mid] for i in range(3))


def _timed_inside(fn, clock, calls, reps, warm) -> Tuple[float, float, float]:
    """(CPU) medians of ``fn``, of ``fn`` less the closure time inside it, and of one
    closure call."""
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        clock.ms = 0.0
        t0 = time.perf_counter()
        fn()
        t = (time.perf_counter() - t0) * 1e3
        ts.append((t, t - clock.ms, clock.ms / max(calls, 1)))
    mid = len(ts) // 2
    return tuple(sorted(x[i] for x in ts)[mid] for i in range(3))


def fused_backend(dev) -> str:
    """Triton on a GPU; elsewhere the C++ kernels where they are built (the Triton
    interpreter would take minutes), else Triton."""
    if dev.type == "cuda":
        return "triton"
    from poco_kernels.kernels import cpp_status
    return "cpp" if cpp_status(dev) is None else "triton"


def protocol(kind: str, opt) -> str:
    """How the row's optimizer handled its parameters between calls: ``sample_ahead``,
    ``copy`` (``sample_ahead=False``, or the default where parking does not apply: no
    C++ extension, say) or ``parked``."""
    if kind.endswith("sample_ahead"):
        return "sample_ahead"
    if kind.endswith("_copy"):
        return "copy"
    return "parked" if opt._runner.parks() else "copy"


def model_bytes(kind: str, dev=torch.device("cuda"), protocol: Optional[str] = None) -> float:
    """Bytes per parameter the iteration must move (float32 parameters) on ``dev``'s fused
    backend (``protocol`` "copy": a default row that did not park)."""
    if protocol == "copy" and not kind.endswith("_copy"):
        kind += "_copy"
    if kind.startswith("adamw"):
        return b_adamw(S)
    if kind == "ivon_opt":
        return b_ivonopt_cycle(S)
    name = "IVON-PoCoMo" if kind.startswith("ivon_pocomo") else "IVON"
    return b_iteration(name, kind, S, views_default(dev), fused_backend(dev) == "triton")


class _ClosureClock:
    """Milliseconds spent in the closure calls since the last ``reset`` (the CPU: timed
    inside the iteration itself, so nothing else lands between the two timings)."""

    def __init__(self):
        self.ms = 0.0

    def wrap(self, fn):
        def timed_fn():
            t0 = time.perf_counter()
            out = fn()
            self.ms += (time.perf_counter() - t0) * 1e3
            return out
        return timed_fn


def _make(kind, dev, shapes, cs, g, ivon_mod, clock, options=None):
    """(iteration, closure evaluations per iteration, optimizer, parameters); the
    closure's calls add their time to ``clock``; ``options``: more keyword arguments of
    this package's optimizers (``grad_views=False``)."""
    ps = [torch.nn.Parameter(torch.randn(s, generator=g).to(dev) * 0.02) for s in shapes]
    opt = None

    @clock.wrap
    def zero_backward():            # the closure: the optimizer's zero_grad, the backward
        opt.zero_grad()
        sum((p * c).sum() for p, c in zip(ps, cs)).backward()
    if kind.startswith("adamw"):
        opt = torch.optim.AdamW(ps, lr=1e-3, **{kind.split("_")[1]: True})

        def adamw():
            zero_backward()
            opt.step()
        return adamw, 1, opt, ps
    if kind == "ivon_opt":
        if ivon_mod is None:
            return None, 0, None, ps
        opt = ivon_mod.IVON(ps, lr=0.1, ess=1e6, hess_init=1e-3)

        def ivon_opt():
            with opt.sampled_params(train=True):
                zero_backward()
            opt.step()
        return ivon_opt, 1, opt, ps
    kw = dict(lr=0.1, ess=1e6, hess_init=1e-3, backend=fused_backend(dev),
              sample_ahead=(True if kind.endswith("sample_ahead") else
                            False if kind.endswith("_copy") else None),
              state_dtype=torch.bfloat16 if kind.endswith("bf16_state") else None)
    if kind.endswith("grad_views"):
        kw["grad_views"] = not kind.endswith("no_grad_views")
    kw.update(options or {})
    poco = kind.startswith("ivon_pocomo")
    if kind.endswith("bf16_outer"):
        kw["outer_dtype"] = torch.bfloat16
    opt = pk.IVONPoCoMo(ps, alpha=0.7, **kw) if poco else pk.IVON(ps, **kw)
    if poco:
        opt.refresh([zero_backward])
    return (lambda: opt.step(zero_backward)), (2 if poco else 1), opt, ps


def make_row(kind, dev, scale: str = "host", options=None):
    """One row's iteration on its own, for the studies: (iteration, closure evaluations
    per iteration, optimizer, parameters, the closure's clock) at ``scale``'s shapes."""
    shapes = gpt2_shapes(scale)
    g = torch.Generator().manual_seed(0)
    cs = [torch.randn(s, generator=g).to(dev) for s in shapes]
    clock = _ClosureClock()
    return (*_make(kind, dev, shapes, cs, g, None, clock, options), clock)


def _resident(dev, opt, ps, base: int, n: int) -> float:
    if dev.type == "cuda":
        return (torch.cuda.memory_allocated(dev) - base) / n
    from benchmarks.suite.memory import held_bytes
    own = sum(p.numel() * p.element_size() for p in ps)
    own += sum(p.grad.numel() * p.grad.element_size() for p in ps if p.grad is not None
               and p.grad.untyped_storage().data_ptr() not in
               {q.untyped_storage().data_ptr() for q in ps})
    return (own + held_bytes(opt, ps)[0]) / n


def measure(dev, scale: str, reps: int, warm: int, ivon_mod=None,
            kinds=KINDS, options=None) -> Tuple[Dict[str, dict], float]:
    """Per kind: cycle_ms, optimizer_ms, resident_B_per_param (or ``error``/``skipped``);
    and the median closure milliseconds."""
    shapes = gpt2_shapes(scale)
    g = torch.Generator().manual_seed(0)
    cs = [torch.randn(s, generator=g).to(dev) for s in shapes]
    n = sum(c.numel() for c in cs)
    cl_ps = ([torch.nn.Parameter(torch.randn(s, generator=g).to(dev)) for s in shapes]
             if dev.type == "cuda" else [])   # (CUDA: the closure alone, timed paired)

    def closure():
        for p in cl_ps:
            p.grad = None
        sum((p * c).sum() for p, c in zip(cl_ps, cs)).backward()
    rows, closures = {}, []
    for kind in (k for k in kinds if not is_default(k, dev)):
        f = opt = ps = None
        try:
            release(dev)
            base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
            clock = _ClosureClock()
            f, calls, opt, ps = _make(kind, dev, shapes, cs, g, ivon_mod, clock, options)
            if f is None:
                rows[kind] = {"skipped": "ivon-opt is not installed, nor a wheel in .whl/"}
                continue
            if dev.type == "cuda":      # (a synchronised clock inside would serialise it)
                t, own, tc = timed_less_closure(dev, f, closure, calls, reps, warm)
            else:
                t, own, tc = _timed_inside(f, clock, calls, reps, warm)
            closures.append(tc)
            rows[kind] = {"cycle_ms": t, "optimizer_ms": own,
                          "resident_B_per_param": _resident(dev, opt, ps, base, n)}
            if not kind.startswith("adamw") and kind != "ivon_opt":
                rows[kind]["protocol"] = protocol(kind, opt)
        except Exception as exc:
            rows[kind] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        del f, opt, ps
    release(dev)
    return rows, (statistics.median(closures) if closures else 0.0)


def table(dev, copy_Bps: Optional[float], *, scale: str = "gpt2", reps: int = 5,
          warm: int = 2, host_reps: int = 30, ivon_mod=None, kinds=KINDS) -> dict:
    """The table (module docstring) at ``scale``'s shapes, with ``host_us`` from the same
    rows at the 41k-parameter shapes."""
    rows, tc = measure(dev, scale, reps, warm, ivon_mod, kinds)
    host, _ = measure(dev, "host" if scale != "smoke" else "smoke", host_reps, warm,
                      ivon_mod, kinds)
    n = sum(torch.Size(s).numel() for s in gpt2_shapes(scale))
    ref = rows.get("adamw_fused", {}).get("optimizer_ms")
    out = {"n_params": n, "scale": scale, "closure_ms": round(tc, 3), "rows": {}}
    for kind, r in rows.items():
        row = dict(r)
        if "optimizer_ms" in r:
            own = r["optimizer_ms"]
            model = model_bytes(kind, dev, r.get("protocol"))
            at_bw = own * 1e-3 * copy_Bps / n if copy_Bps else None
            row.update(cycle_ms=round(r["cycle_ms"], 3), optimizer_ms=round(own, 3),
                       ratio_to_fused_adamw=round(own / ref, 2) if ref else None,
                       model_B_per_param=round(model, 1),
                       B_per_param_at_copy_bw=round(at_bw, 1) if at_bw else None,
                       share_of_copy=round(model / at_bw, 3) if at_bw and at_bw > 0 else None,
                       resident_B_per_param=round(r["resident_B_per_param"], 1),
                       host_us=round(host[kind]["optimizer_ms"] * 1e3, 1)
                       if "optimizer_ms" in host.get(kind, {}) else None)
        out["rows"][kind] = row
    log(f"    {n / 1e6:.1f}M parameters in {len(gpt2_shapes(scale))} tensors; closure "
        f"{tc:.3f} ms")
    log(f"    {'row':26s} {'opt ms':>9s} {'x AdamW':>8s} {'host us':>8s} {'model B':>8s} "
        f"{'B at copy':>9s} {'resident B':>10s} protocol")
    for kind in kinds:
        if kind not in out["rows"] and is_default(kind, dev):
            log(f"    {kind:26s} (the default row here: not run twice)")
            continue
        r = out["rows"].get(kind, {})
        if "optimizer_ms" in r:
            log(f"    {kind:26s} {r['optimizer_ms']:9.3f} {r['ratio_to_fused_adamw']!s:>8s} "
                f"{r['host_us']!s:>8s} {r['model_B_per_param']:8.1f} "
                f"{r['B_per_param_at_copy_bw']!s:>9s} {r['resident_B_per_param']:10.1f} "
                f"{r.get('protocol', '')}")
        else:
            log(f"    {kind:26s} {r}")
    return out
