"""The tables of ``bench_gpu.py --quick``: the optimizer alone at GPT-2 124M shapes, the
GPT-2 124M training iteration end to end, and the torch backend's sampling.

* **Optimizer only** (:func:`optimizer_only`): the optimizer table of
  ``benchmarks/common/optimizer_table.py`` (the suite's too), at the 148 tensors of
  GPT-2 124M: optimizer milliseconds per iteration with the closure subtracted, ratio to
  fused AdamW, host microseconds per iteration, bytes per parameter by the model and at
  the measured copy bandwidth, resident bytes per parameter.
* **End to end** (:func:`end_to_end`): GPT-2 124M, bf16 autocast, batch 8 x 1024 tokens:
  ms per iteration and tokens/s for AdamW (fused), IVON and IVON-PoCoMo (correction
  active), and one refresh of two chunks.
* **Torch backend** (:func:`torch_backend_rows`): its inner sample and restore at 2^20
  and 2^24 elements against the copy bandwidth (its noise is the kernels' generator on
  a GPU).
"""
from __future__ import annotations

import torch

import poco_kernels as pk
from benchmarks.common import optimizer_table
from benchmarks.common.optimizer_table import fused_backend as _fused, timed as _timed
from benchmarks.common.byte_models import b_restore, b_sample_inner
from benchmarks.common.device import release
from benchmarks.common.report import log


def _ivon_opt_module():
    """ivon-opt, installed or from a wheel in ``<repo>/.whl/`` (``setups.import_ivon``)."""
    from benchmarks.common.setups import import_ivon
    return import_ivon()[0]


def optimizer_only(dev, smoke, copy_Bps, reps=None):
    """The optimizer table (``benchmarks/common/optimizer_table.py``) at GPT-2 124M's shapes
    (tiny stand-ins with ``--smoke``)."""
    return optimizer_table.table(dev, copy_Bps, scale="smoke" if smoke else "gpt2",
                                 reps=reps or (3 if smoke else 15), warm=1 if smoke else 2,
                                 host_reps=3 if smoke else 30, ivon_mod=_ivon_opt_module())


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
