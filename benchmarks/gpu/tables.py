"""The tables of ``bench_gpu.py --quick``: the optimizer alone at GPT-2 124M shapes, the
GPT-2 124M training iteration end to end, and the torch backend's sampling.

* **Optimizer only** (:func:`optimizer_only`): the 148 tensors of GPT-2 124M, float32
  parameters; one call = a closure (``zero_grad`` and the backward pass of ``sum(p * c)``,
  so the gradients reach ``.grad`` through autograd, as in training) and the update; the
  closure's own time, measured alone right after each call, is subtracted per call
  (twice for IVON-PoCoMo, whose step evaluates it at the inner and the outer sample),
  and the median taken.  Milliseconds, ratio to fused AdamW,
  bytes per parameter the time would move at the measured copy bandwidth, and the
  memory the optimizer allocates per parameter (parameters and gradients included).
* **End to end** (:func:`end_to_end`): GPT-2 124M, bf16 autocast, batch 8 x 1024 tokens:
  ms per iteration and tokens/s for AdamW (fused), IVON and IVON-PoCoMo (correction
  active), and one refresh of two chunks.
* **Torch backend** (:func:`torch_backend_rows`): its inner sample and restore at 2^20
  and 2^24 elements against the copy bandwidth (its noise is the kernels' generator on
  a GPU).
"""
from __future__ import annotations

import time

import torch

import poco_kernels as pk
from benchmarks.common.byte_models import b_restore, b_sample_inner
from benchmarks.common.device import release, sync
from benchmarks.common.report import log


def gpt2_shapes(smoke):
    """The parameter shapes of GPT-2 124M (148 tensors; tiny stand-ins with --smoke)."""
    d, v, ctx, L = (16, 97, 32, 1) if smoke else (768, 50304, 1024, 12)
    s = [(v, d), (ctx, d)]
    for _ in range(L):
        s += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d),
              (4 * d,), (4 * d, d), (d,)]
    return s + [(d,), (d,)]


def _timed(dev, fn, reps, warm=2):
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


def _timed_less_closure(dev, fn, closure, calls, reps, warm=2):
    """Median milliseconds of ``fn`` and median of ``fn`` less ``calls`` closure
    evaluations, the closure timed right after each ``fn`` (paired, so a slow moment of
    a shared machine lands on both; one closure time taken once and subtracted from every
    row could exceed a row's own time)."""
    pairs = []
    for _ in range(warm):
        fn()
        closure()
    for _ in range(reps):
        t = _timed(dev, fn, 1, warm=0)
        tc = _timed(dev, closure, 1, warm=0) if calls else 0.0
        pairs.append((t, t - calls * tc, tc))
    mid = len(pairs) // 2
    return (sorted(p[0] for p in pairs)[mid], sorted(p[1] for p in pairs)[mid],
            sorted(p[2] for p in pairs)[mid])


def _fused(dev):
    """The fused backend of the tables: Triton on a GPU; on the CPU (--smoke) the C++
    kernels where they are built (the interpreter would take minutes), else Triton."""
    if dev.type == "cuda":
        return "triton"
    from poco_kernels.kernels import cpp_status
    return "cpp" if cpp_status() is None else "triton"


def _ivon_opt_module():
    """ivon-opt, installed or from a wheel in ``<repo>/.whl/`` (``setups.import_ivon``)."""
    from benchmarks.common.setups import import_ivon
    return import_ivon()[0]


OPTIMIZERS = ("adamw_fused", "adamw_foreach", "ivon_opt", "ivon", "ivon_sample_ahead",
              "ivon_pocomo", "ivon_pocomo_sample_ahead", "ivon_pocomo_bf16_state")


def optimizer_only(dev, smoke, copy_Bps, reps=None):
    shapes = gpt2_shapes(smoke)
    g = torch.Generator().manual_seed(0)
    cs = [torch.randn(s, generator=g).to(dev) for s in shapes]
    n = sum(c.numel() for c in cs)
    reps = reps or (3 if smoke else 15)
    warm = 1 if smoke else 2
    out = {"n_params": n, "rows": {}}

    def make(kind):
        ps = [torch.nn.Parameter(torch.randn(s, generator=g).to(dev) * 0.02) for s in shapes]

        def closure():
            for p in ps:
                p.grad = None
            sum((p * c).sum() for p, c in zip(ps, cs)).backward()
        if kind == "closure":
            return closure, 0
        if kind.startswith("adamw"):
            opt = torch.optim.AdamW(ps, lr=1e-3, **{kind.split("_")[1]: True})
            return (lambda: (closure(), opt.step())), 1
        if kind == "ivon_opt":
            mod = _ivon_opt_module()
            if mod is None:
                return None, 0
            opt = mod.IVON(ps, lr=0.1, ess=1e6, hess_init=1e-3)

            def f():
                with opt.sampled_params(train=True):
                    closure()
                opt.step()
            return f, 1
        kw = dict(lr=0.1, ess=1e6, hess_init=1e-3, backend=_fused(dev),
                  sample_ahead=kind.endswith("sample_ahead"))
        if kind.startswith("ivon_pocomo"):
            if kind.endswith("bf16_state"):
                kw["state_dtype"] = torch.bfloat16
            opt = pk.IVONPoCoMo(ps, alpha=0.7, **kw)

            def zc():
                opt.zero_grad()
                sum((p * c).sum() for p, c in zip(ps, cs)).backward()
            opt.refresh([zc])
            return (lambda: opt.step(zc)), 2
        opt = pk.IVON(ps, **kw)

        def zc1():
            opt.zero_grad()
            sum((p * c).sum() for p, c in zip(ps, cs)).backward()
        return (lambda: opt.step(zc1)), 1

    ms, closures = {}, []
    closure, _ = make("closure")
    for kind in OPTIMIZERS:
        try:
            release(dev)
            base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
            f, calls = make(kind)
            if f is None:
                out["rows"][kind] = {"skipped": "ivon-opt is not installed, nor a wheel in .whl/"}
                continue
            t, own, tc = _timed_less_closure(dev, f, closure, calls, reps, warm)
            closures.append(tc)
            mem = ((torch.cuda.memory_allocated(dev) - base) / n if dev.type == "cuda"
                   else None)
            ms[kind] = own
            out["rows"][kind] = {"cycle_ms": round(t, 3), "allocated_B_per_param":
                                 None if mem is None else round(mem, 2)}
            del f
        except Exception as exc:
            out["rows"][kind] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
    tc = sorted(closures)[len(closures) // 2] if closures else 0.0
    ref = ms.get("adamw_fused")
    for kind, own in ms.items():
        row = out["rows"][kind]
        row["optimizer_ms"] = round(own, 3)
        row["ratio_to_fused_adamw"] = round(own / ref, 2) if ref else None
        row["B_per_param_at_copy_bw"] = round(own * 1e-3 * copy_Bps / n, 1) if copy_Bps else None
    out["closure_ms"] = round(tc, 3)
    for kind in OPTIMIZERS:
        r = out["rows"].get(kind, {})
        log(f"    {kind:26s} " + (f"{r['optimizer_ms']:8.3f} ms  x{r['ratio_to_fused_adamw']} "
                                   f"fused AdamW  {r['B_per_param_at_copy_bw']} B/param at copy bw"
                                   f"  alloc {r['allocated_B_per_param']} B/param"
                                   if "optimizer_ms" in r else str(r)))
    del cs
    release(dev)
    return out


def end_to_end(dev, smoke, batch=8, seq=1024, reps=None):
    from poco_kernels.experiments.gpt import GPT, PRESETS
    if smoke:
        batch, seq = 1, 8
    reps = reps or (1 if smoke else 8)
    warm = 1 if smoke else 2
    out = {"batch": batch, "seq": seq, "rows": {}}
    g = torch.Generator().manual_seed(0)
    vocab = 50304 if not smoke else 64
    data = torch.randint(0, vocab, (batch, seq + 1), generator=g).to(dev)
    x, y = data[:, :-1], data[:, 1:]
    fused = _fused(dev)
    for kind in ("adamw", "ivon", "ivon_pocomo"):
        try:
            torch.manual_seed(0)
            model = GPT(PRESETS["gpt-test" if smoke else "gpt2-124m"]).to(dev)
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)

            def loss():
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=not smoke):
                    return model(x, y)[1]
            if kind == "adamw":
                opt = torch.optim.AdamW(model.parameters(), lr=6e-4,
                                        fused=dev.type == "cuda")

                def it():
                    opt.zero_grad(set_to_none=True)
                    loss().backward()
                    opt.step()
            else:
                cls = pk.IVON if kind == "ivon" else pk.IVONPoCoMo
                kw = {} if kind == "ivon" else {"alpha": 0.7}
                opt = cls(model.parameters(), lr=0.3, ess=1e10, hess_init=1e-3,
                          clip_radius=1e-3, backend=fused, **kw)

                def closure():
                    opt.zero_grad()
                    lo = loss()
                    lo.backward()
                    return lo

                def it():
                    opt.step(closure)
                if kind == "ivon_pocomo":
                    opt.refresh([closure, closure])
                    out["refresh_2_chunks_ms"] = round(_timed(
                        dev, lambda: opt.refresh([closure, closure]), 1 if smoke else 2,
                        warm=1), 2)
            t = _timed(dev, it, reps, warm=warm)
            out["rows"][kind] = {"ms_per_iter": round(t, 2),
                                 "tokens_per_s": round(batch * seq / (t * 1e-3)),
                                 "peak_GB": round(torch.cuda.max_memory_allocated(dev) / 1e9, 2)
                                 if dev.type == "cuda" else None}
            log(f"    {kind:12s} {t:8.2f} ms/iteration  {batch * seq / (t * 1e-3):10.0f} tokens/s")
            del model, opt
        except Exception as exc:
            out["rows"][kind] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        release(dev)
    return out


def torch_backend_rows(dev, smoke, copy_Bps, sizes=None):
    """The torch backend's inner sample and restore (float32 parameters holding the mean:
    the noise, sigma and the perturbation in torch ops, the noise by the kernels'
    generator on a GPU), against the bytes they must move."""
    sizes = sizes or ([1024, 2053] if smoke else [2 ** 20, 2 ** 24])
    out = {}
    for n in sizes:
        p = torch.nn.Parameter(torch.randn(n, device=dev))
        opt = pk.IVON([p], lr=0.1, ess=1e4, backend="torch")

        def f():
            opt.sample("inner")
            opt.restore()
        t = _timed(dev, f, 1 if smoke else 10, 1 if smoke else 2)
        nbytes = (b_sample_inner(4, True) + b_restore(4)) * n
        bw = nbytes / (t * 1e-3)
        out[n] = {"sample_restore_ms": round(t, 4), "GBps": round(bw / 1e9, 1),
                  "share_of_copy": round(bw / copy_Bps, 3) if copy_Bps else None}
        log(f"    torch backend sample + restore, n={n}: {t:.4f} ms, {bw / 1e9:.1f} GB/s"
            + (f", {100 * bw / copy_Bps:.1f}% of copy" if copy_Bps else ""))
        del p, opt
        release(dev)
    return out
