"""Closed-loop parity of the compiled kernels with the torch backend (which calls the
reference maths): the same trajectory of a quadratic loss with ``backend="torch"`` and
``backend="triton"`` on the device, compared buffer by buffer, against how far the
trajectory carries rounding at the level of the kernels' open-loop bounds (the torch
backend with its state moved by a few ulps after every update, several times):
``bench_gpu.py``'s trajectory section, and ``tests/repo/test_bench_run.py`` on the CPU.

A trajectory of IVON-PoCo amplifies the differences of a step (the normals' last bit,
the order of a sum) as its dynamics do; a fixed tolerance would measure that, not the
kernels.  Measured this way a real defect (a coefficient wrong in its fourth digit, a
wrong noise stream) stands out by orders of magnitude, and rounding does not."""
from __future__ import annotations

import math
import time

import torch

import poco_kernels as pk
from benchmarks.common.device import release, sync
from benchmarks.common.internals import (bucket_buffer_names, bucket_dtypes, bucket_numels,
                                         perturb_state)
from benchmarks.common.report import dtype_name, log
from benchmarks.gpu.config import (MAX_FACTOR, PARITY_CONFIGS, QUANTILE_FACTOR,
                                   SENSITIVITY_RUNS, SENSITIVITY_ULPS, parity_layout)


class Quadratic:
    """``loss_k(theta) = sum_p 0.5 a_p (theta_p - c_p - s_k d_p)^2`` per parameter, with
    curvatures ``a`` in [0.5, 1.5]: mini-batch ``k`` shifts the target along ``d``.  The
    loss is computed in float32 from the parameters (bf16 parameters get bf16 gradients)."""

    def __init__(self, sizes, dev, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.a = [(0.5 + torch.rand(n, generator=g)).to(dev) for n in sizes]
        self.c = [torch.randn(n, generator=g).to(dev) for n in sizes]
        self.d = [torch.randn(n, generator=g).to(dev) for n in sizes]

    def loss(self, params, k):
        s = 0.1 * (k % 4) - 0.15
        return sum((0.5 * a * (p.float() - c - s * d) ** 2).sum()
                   for p, a, c, d in zip(params, self.a, self.c, self.d))


def build(cfg, backend, dev, smoke):
    """The parameters of ``parity_layout``, in the groups of ``cfg``, and their optimizer on
    ``backend``."""
    sizes, dtypes, groups = parity_layout(smoke)
    g = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(n, generator=g).to(dev).to(dt))
              for n, dt in zip(sizes, dtypes)]
    pg = [{"params": [p for p, gi in zip(params, groups) if gi == k], **extra}
          for k, extra in enumerate(cfg["groups"])]
    opt = getattr(pk, cfg["cls"])(pg, backend=backend, **cfg["kw"])
    return params, opt, sizes


def trajectory(opt, params, prob, steps=30, warmup=5, every=10, after_update=None):
    """``steps`` inner steps with a refresh at warmup + k * every; the first half through
    closures (step(closure), refresh(closures)), the second half through the manual
    protocol (sampled(...) blocks, step(), sample/accumulate/restore, refresh()).
    ``after_update(opt)`` runs after every step and refresh (the sensitivity runs)."""
    poco = isinstance(opt, pk.IVONPoCo)
    mc = max(g.get("mc_samples", 1) for g in opt.param_groups)
    n_refresh = max(g.get("refresh_samples", 1) for g in opt.param_groups) if poco else 0

    def closure(k):
        def c():
            opt.zero_grad()
            loss = prob.loss(params, k)
            loss.backward()
            return loss
        return c

    for t in range(steps):
        manual = t >= steps // 2
        if poco and t >= warmup and (t - warmup) % every == 0:
            if not manual:
                opt.refresh([closure(k) for k in range(4)])
            else:
                for _ in range(n_refresh):
                    with opt.sampled("refresh", accumulate=False):
                        for k in range(4):
                            opt.zero_grad()
                            prob.loss(params, k).backward()
                            opt.accumulate()
                opt.refresh()
            if after_update is not None:
                after_update(opt)
        if not manual:
            opt.step(closure(t))
        else:
            for kind in ("inner", "outer"):
                if kind == "outer" and not opt.correction_active():
                    break
                for _ in range(mc):
                    with opt.sampled(kind):
                        opt.zero_grad()
                        prob.loss(params, t).backward()
            opt.step()
        if after_update is not None:
            after_update(opt)


#: (steps, warm-up, refresh interval) of a trajectory: 30 steps with refreshes at 5, 15,
#: 25; a shorter one with --smoke (the code runs in CI)
SCHEDULE = (30, 5, 10)
SMOKE_SCHEDULE = (8, 2, 4)
#: the configurations of --smoke (the code runs in CI; the parity of short runs on every
#: backend is tests/protocol/test_backends.py's)
SMOKE_CONFIGS = ("ivon_poco",)


def _run(cfg, backend, dev, smoke, perturb=None):
    """One trajectory of ``cfg`` on ``backend``; its buffers, dtypes, sizes and counters.
    ``perturb``: (seed, rel) moves the state by ``rel`` after every update."""
    params, opt, sizes = build(cfg, backend, dev, smoke)
    after = None
    if perturb is not None:
        gen = torch.Generator().manual_seed(perturb[0])
        after = lambda o: perturb_state(o, perturb[1], gen)  # noqa: E731
    steps, warmup, every = SMOKE_SCHEDULE if smoke else SCHEDULE
    trajectory(opt, params, Quadratic(sizes, dev), steps, warmup, every, after_update=after)
    sync(dev)
    names = bucket_buffer_names(opt, ("mean", "h", "momentum", "g_out", "h_out", "m_out",
                                      "sigma_out"))
    out = dict(bufs={n: [t.detach().clone() for t in opt.flat_state(n)] for n in names},
               dtypes=bucket_dtypes(opt), numel=bucket_numels(opt),
               counts=(opt.step_count, opt.refresh_count, opt.skipped_updates))
    del params, opt
    release(dev)
    return out


def distances(a, b):
    """How far buffer ``a`` is from the reference ``b``, relative to ``max|b|``: the largest
    elementwise distance (``max``) and its 90th and 99th percentiles (``q90``, ``q99``;
    over the first 2**24 elements)."""
    a, b = a.detach().double().reshape(-1), b.detach().double().reshape(-1)
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return dict(max=math.inf, q90=math.inf, q99=math.inf)
    scale = float(b.abs().max()) if b.numel() else 0.0
    d = (a - b).abs() / (scale if scale > 0 else 1.0)
    if d.numel() == 0:
        return dict(max=0.0, q90=0.0, q99=0.0)
    q = torch.quantile(d[:2 ** 24], torch.tensor([0.9, 0.99], dtype=d.dtype, device=d.device))
    return dict(max=float(d.max()), q90=float(q[0]), q99=float(q[1]))


def parity(dev, smoke, candidate="triton", candidate_kw=None):
    """Per configuration: the torch backend's trajectory (the reference maths), the
    ``candidate`` backend's (``candidate_kw``: hyperparameters it runs with instead, to
    show the gate fails), and runs of the torch backend whose state is moved by
    ``SENSITIVITY_ULPS`` float32 ulps (relative, uniform at random) after every update:
    how far rounding carries this trajectory.  Gate, per bucket buffer (the mean and h of
    float32 buckets, the float32 master mean of bf16 ones), on the elementwise distances
    from the reference relative to its largest element (:func:`distances`): the
    candidate's 90th and 99th percentiles at most ``QUANTILE_FACTOR`` times the largest
    of the sensitivity runs', its maximum at most ``MAX_FACTOR`` times theirs.  (The
    percentiles see a defect that moves every element; the maximum, a gross one: a few
    chaotic coordinates dominate it in rounding and defect alike.)  (results, failures)."""
    results, failures = {}, []
    rel = SENSITIVITY_ULPS * 2.0 ** -24
    for name, cfg in PARITY_CONFIGS.items():
        if smoke and name not in SMOKE_CONFIGS:
            continue
        t0 = time.perf_counter()
        base = _run(cfg, "torch", dev, smoke)
        ccfg = cfg if not candidate_kw else dict(cfg, kw=dict(cfg["kw"], **candidate_kw))
        cand = _run(ccfg, candidate, dev, smoke)
        sens = [_run(cfg, "torch", dev, smoke, perturb=(100 + k, rel))
                for k in range(1 if smoke else SENSITIVITY_RUNS)]
        rows = []
        for n in base["bufs"]:
            for bi, b in enumerate(base["bufs"][n]):
                dt = base["dtypes"][bi]
                gated = (dt == torch.float32 and n in ("mean", "h")) or \
                    (dt != torch.float32 and n == "mean")
                c = distances(cand["bufs"][n][bi], b)
                ss = [distances(x["bufs"][n][bi], b) for x in sens]
                sd = {k: max(x[k] for x in ss) for k in ("max", "q90", "q99")}
                ratio = {k: c[k] / max(sd[k], 1e-15) for k in sd}
                ok = not gated or (ratio["q90"] <= QUANTILE_FACTOR and ratio["q99"]
                                   <= QUANTILE_FACTOR and ratio["max"] <= MAX_FACTOR)
                rows.append(dict(buffer=n, bucket=bi, param_dtype=dtype_name(dt),
                                 numel=base["numel"][bi], candidate=c, sensitivity=sd,
                                 ratio=ratio, gated=gated, ok=ok))
                if not ok:
                    failures.append(f"{name}: {n}[bucket {bi}, {dtype_name(dt)}] distance / "
                                    f"sensitivity q90 {ratio['q90']:.3g}, q99 "
                                    f"{ratio['q99']:.3g} (gate {QUANTILE_FACTOR}), max "
                                    f"{ratio['max']:.3g} (gate {MAX_FACTOR})")
        if base["counts"][:2] != cand["counts"][:2] or cand["counts"][2] != 0:
            failures.append(f"{name}: counters (steps, refreshes, skipped) torch "
                            f"{base['counts']} {candidate} {cand['counts']}")
        results[name] = dict(rows=rows, counts={"torch": base["counts"],
                                                candidate: cand["counts"]},
                             seconds=time.perf_counter() - t0)
        worst = max((max(r["ratio"]["q90"], r["ratio"]["q99"]) for r in rows if r["gated"]),
                    default=0.0)
        log(f"  trajectory {name:22s} worst gated percentile distance / sensitivity "
            f"{worst:.3g} (gate {QUANTILE_FACTOR}); counters torch {base['counts']} "
            f"{candidate} {cand['counts']} ({time.perf_counter() - t0:.1f} s)")
        for r in rows:
            if r["gated"]:
                c, sd = r["candidate"], r["sensitivity"]
                log(f"    {r['buffer']:9s} bucket {r['bucket']} {r['param_dtype']:8s} "
                    f"n={r['numel']:<8d} q90/q99/max {c['q90']:.2g}/{c['q99']:.2g}/"
                    f"{c['max']:.2g}; sensitivity {sd['q90']:.2g}/{sd['q99']:.2g}/"
                    f"{sd['max']:.2g} {'ok' if r['ok'] else 'FAIL'}")
    return results, failures
