"""GPU check-and-benchmark of the Triton backend, in one call on a CUDA machine.

    python3 benchmarks/bench_gpu.py --out $OUT            # CUDA: checks, then run.py's suite
    python3 benchmarks/bench_gpu.py --smoke --out /tmp/s  # CPU, TRITON_INTERPRET=1, tiny sizes

Sections, in order (each one is written to ``--out`` as soon as it is done, so a crash
later keeps what came before):

1. **Device**: name, properties, versions, date (the copy bandwidth, the memory ceiling,
   is measured by the benchmark suite, section 3).
2. **Checks** (correctness first):
   * parity: the same trajectory (a quadratic loss, 30 steps, refresh at steps 5, 15, 25)
     with ``backend="torch"`` and ``backend="triton"`` on the device, for IVON-PoCo (Alg. 3
     defaults, several groups, fp32 and bf16 parameters, odd sizes), IVON-PoCo with the
     stabilisers (antithetic refresh pair, floor, 2 MC samples, independent outer noise)
     and plain IVON (2 MC samples).  Gate: ``max|a - b| / max|b|`` per bucket buffer, the
     float32 ``mean`` and ``h`` of float32 buckets at ``RTOL_FP32``, the float32 master
     ``mean`` of bf16 buckets at ``RTOL_BF16_MASTER``;
   * no host synchronisation in steady-state ``sample``/``accumulate``/``restore``/``step``
     (``torch.cuda.set_sync_debug_mode``); no new Triton compilation when the learning
     rate changes every step; no growth of ``torch.cuda.memory_allocated`` across steps;
   * informational (not gating): the bits the kernels store into bf16 parameters against
     torch's float32 -> bfloat16 cast, on random values, rounding ties and specials;
   * CUDA-graph capture of one inner step (sample, fixed gradients written in place,
     accumulate, lazy restore; the outer sample likewise; step), replayed and compared
     with the same steps run eagerly on a twin optimizer (capture failure is reported,
     not fatal).
3. **Benchmarks**: ``benchmarks/run.py``'s suite on the device (microbenchmarks of every
   backend beside ivon-opt and AdamW, memory, the GPT training step; see its docstring),
   plus the Triton-only rows of ``micro.triton_extras`` (the step with ``.grad`` as views
   of the flat buffer, through a CUDA graph, and host-inclusive ``*_wall`` times).  Any
   option after this script's own (``--smoke``, ``--only``) goes to ``run.py``
   (``--sizes``, ``--record``, ``--out``, ...).
4. Output in ``--out``: ``bench_gpu_report.json`` (device and checks) beside run.py's
   ``bench.csv``, ``bench.md`` and ``bench_report.json``; with ``--record``,
   ``benchmarks/results/gpu_<device>_<date>.{csv,md}``.

Exit status: 0 all passed; otherwise the OR of 1 (parity above tolerance), 2 (a
synchronisation, JIT-cache, memory or graph-replay check failed) and 4 (a benchmark
raised).

ivon-opt is pure Python: where it is not installed (the CUDA image has no registry), a
wheel in ``<repo>/.whl/ivon_opt-*.whl`` is put on ``sys.path`` (zip import); without
either, its rows are skipped and the report says so.
"""
from __future__ import annotations

import os
import sys

# The interpreter must be chosen before anything (torch included) imports triton.
SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import poco_kernels as pk  # noqa: E402

# --------------------------------------------------------------------------- tolerances
# Gate: max|a - b| / max|b| over a bucket buffer.  float32: tests/tolerances.py's
# TRAJECTORY rtol for float32 (whole trajectories, 1e-4) where that file is there, else
# 1e-4.  bf16 parameters: their float32 master mean at 1e-3 (tests/tolerances.py has no
# entry for the master copy; its bf16 TRAJECTORY rtol, 2e-2, is for the bf16 parameters).
RTOL_FP32 = 1e-4           # float32 parameters: mean and h buffers
RTOL_BF16_MASTER = 1e-3    # bf16 parameters: the float32 master mean buffer
TOLERANCE_SOURCE = "stated in bench_gpu.py"


def _load_tolerances():
    global RTOL_FP32, TOLERANCE_SOURCE
    path = os.path.join(REPO, "tests", "tolerances.py")
    if not os.path.exists(path):
        return
    try:
        import importlib.util
        spec = importlib.util.spec_from_file_location("_poco_tolerances", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        RTOL_FP32 = float(mod.TRAJECTORY[torch.float32]["rtol"])
        TOLERANCE_SOURCE = "float32 from tests/tolerances.py TRAJECTORY; bf16 master stated here"
    except Exception as exc:  # keep the stated values
        TOLERANCE_SOURCE = f"stated in bench_gpu.py (tests/tolerances.py unreadable: {exc})"


_load_tolerances()

# device description, CUDA-graph helpers, report files: device.py, cuda_graph.py, report.py
# (shared with run.py); the optimizers' private attributes: internals.py
from cuda_graph import capture, graph_seq  # noqa: E402
from device import device_info, release, sync as _sync  # noqa: E402
from internals import bucket_buffer_names, bucket_dtypes, bucket_numels, reset_host  # noqa: E402
from report import dtype_name, dump, json_default, log  # noqa: E402


def rel_err(a, b):
    """(max|a - b| / max|b|, elementwise max |a - b| / max(|b|, 1e-6 max|b|)); NaN -> inf."""
    a, b = a.detach().double(), b.detach().double()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return math.inf, math.inf
    scale = float(b.abs().max()) if b.numel() else 0.0
    if scale == 0.0:
        d = float((a - b).abs().max()) if a.numel() else 0.0
        return d, d
    diff = (a - b).abs()
    return float(diff.max()) / scale, float((diff / b.abs().clamp_min(1e-6 * scale)).max())


def jit_variants():
    """Compiled variants per kernel of poco_kernels.kernels.triton_kernels, from the JIT
    caches (triton 3.x: ``JITFunction.device_caches[device][0]`` is the kernel cache;
    older: ``.cache[device]``); None under the interpreter (it has no cache)."""
    from poco_kernels.kernels import triton_kernels as K
    out = {}
    for name in ("sample_kernel", "accumulate_kernel", "fold_ge_kernel", "step_kernel",
                 "refresh_kernel", "finish_kernel"):
        fn = getattr(K, name)
        caches = getattr(fn, "device_caches", None)
        if caches is not None:
            n = 0
            for v in list(caches.values()):
                kc = v[0] if isinstance(v, (tuple, list)) else v
                n += len(kc)
            out[name] = n
        elif isinstance(getattr(fn, "cache", None), dict):
            out[name] = sum(len(c) for c in fn.cache.values())
        else:
            return None
    return out


# --------------------------------------------------------------------------- 2. parity
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


def _parity_layout(smoke):
    """(sizes, dtypes, group of each parameter): three groups; group 2 mixes dtypes (two
    buckets); odd sizes."""
    if smoke:
        sizes = [1003, 37, 1001, 17, 513, 33]
    else:
        sizes = [1_000_003, 4097, 1_000_003, 129, 65_537, 999]
    dtypes = [torch.float32, torch.float32, torch.bfloat16, torch.bfloat16, torch.float32,
              torch.bfloat16]
    groups = [0, 0, 1, 1, 2, 2]
    return sizes, dtypes, groups


PARITY_CONFIGS = {
    # Alg. 3 defaults except beta2: 0.99999 barely moves h in 30 steps; 0.999 without the
    # stabilisers drives h + wd toward 0 (README, 'Stability of IVON-PoCo'), which amplifies
    # float rounding ~16x (measured on the smoke sizes) so the comparison would measure the
    # trajectory's conditioning instead of the kernels.  Per-group lr / weight decay /
    # outer momentum / clip.
    "ivon_poco": dict(
        cls="IVONPoCo", kw=dict(lr=0.1, ess=1e4, beta2=0.9999, seed=11),
        groups=[{}, {"lr": 0.05, "weight_decay": 1e-3}, {"rho1": 0.6, "rho2": 0.1,
                                                          "clip_radius": 0.5}]),
    # stabilisers: antithetic refresh pair, floor, 2 MC samples (GE sums, fold_ge),
    # independent outer noise
    "ivon_poco_stabilised": dict(
        cls="IVONPoCo", kw=dict(lr=0.1, ess=1e4, beta2=0.999, seed=12, mc_samples=2,
                                refresh_samples=2, refresh_antithetic=True, hess_floor=0.0,
                                outer_noise="independent"),
        groups=[{}, {"lr": 0.05}, {"alpha": 0.5}]),
    "ivon": dict(
        cls="IVON", kw=dict(lr=0.1, ess=1e4, beta2=0.999, seed=13, mc_samples=2),
        groups=[{}, {"lr": 0.05}, {"weight_decay": 1e-3}]),
}


def _build(cfg, backend, dev, smoke):
    sizes, dtypes, groups = _parity_layout(smoke)
    g = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(n, generator=g).to(dev).to(dt))
              for n, dt in zip(sizes, dtypes)]
    pg = [{"params": [p for p, gi in zip(params, groups) if gi == k], **extra}
          for k, extra in enumerate(cfg["groups"])]
    opt = getattr(pk, cfg["cls"])(pg, backend=backend, **cfg["kw"])
    return params, opt, sizes


def _trajectory(opt, params, prob, steps=30, warmup=5, every=10):
    """``steps`` inner steps with a refresh at warmup + k * every; the first half through
    closures (step(closure), refresh(closures)), the second half through the manual
    protocol (sampled(...) blocks, step(), sample/accumulate/restore, refresh())."""
    poco = isinstance(opt, pk.IVONPoCo)
    mc = max(g.get("mc_samples", 1) for g in opt.param_groups)
    nref = max(g.get("refresh_samples", 1) for g in opt.param_groups) if poco else 0

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
                for _ in range(nref):
                    with opt.sampled("refresh", accumulate=False):
                        for k in range(4):
                            opt.zero_grad()
                            prob.loss(params, k).backward()
                            opt.accumulate()
                opt.refresh()
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


def parity(dev, smoke):
    results, failures = {}, []
    for name, cfg in PARITY_CONFIGS.items():
        t0 = time.perf_counter()
        runs = {}
        for backend in ("torch", "triton"):
            params, opt, sizes = _build(cfg, backend, dev, smoke)
            prob = Quadratic(sizes, dev)
            _trajectory(opt, params, prob)
            _sync(dev)
            names = bucket_buffer_names(opt, ("mean", "h", "momentum", "g_out", "h_out",
                                              "m_out", "sigma_out"))
            runs[backend] = dict(
                bufs={n: [t.detach().clone() for t in opt.flat_state(n)] for n in names},
                dtypes=bucket_dtypes(opt),
                numel=bucket_numels(opt),
                counts=(opt.step_count, opt.refresh_count, opt.skipped_updates))
            del params, opt
            release(dev)
        # the trajectory's own conditioning: the reference again, its float32 initial
        # parameters perturbed by 1e-7 (about one float32 rounding); what that moves is the
        # floor under which torch-vs-triton differences are rounding, not a kernel bug
        params, opt, sizes = _build(cfg, "torch", dev, smoke)
        with torch.no_grad():
            for p in params:
                if p.dtype == torch.float32:
                    p.mul_(1.0 + 1e-7)
        _trajectory(opt, params, Quadratic(sizes, dev))
        floor = {n: max(rel_err(a, b)[0] for a, b, dt in zip(
            opt.flat_state(n), runs["torch"]["bufs"][n], runs["torch"]["dtypes"])
            if dt == torch.float32) for n in ("mean", "h")}
        del params, opt
        release(dev)
        ref, tri = runs["torch"], runs["triton"]
        rows = []
        for n in ref["bufs"]:
            for bi, (a, b) in enumerate(zip(tri["bufs"][n], ref["bufs"][n])):
                dt = ref["dtypes"][bi]
                err, elem = rel_err(a, b)
                if dt == torch.float32 and n in ("mean", "h"):
                    tol = RTOL_FP32
                elif dt != torch.float32 and n == "mean":
                    tol = RTOL_BF16_MASTER
                else:
                    tol = None           # reported, not gated
                ok = tol is None or err <= tol
                rows.append(dict(buffer=n, bucket=bi, param_dtype=dtype_name(dt),
                                 numel=ref["numel"][bi], maxnorm_rel=err, elementwise_rel=elem,
                                 tol=tol, ok=ok))
                if not ok:
                    failures.append(f"{name}: {n}[bucket {bi}, {dtype_name(dt)}] "
                                    f"rel {err:.3g} > {tol:g}")
        if ref["counts"][:2] != tri["counts"][:2] or tri["counts"][2] != 0:
            failures.append(f"{name}: counters (steps, refreshes, skipped) torch "
                            f"{ref['counts']} triton {tri['counts']}")
        results[name] = dict(rows=rows, counts={"torch": ref["counts"], "triton": tri["counts"]},
                             reference_perturbed_1e7=floor, seconds=time.perf_counter() - t0)
        worst = max((r["maxnorm_rel"] for r in rows if r["tol"] is not None), default=0.0)
        log(f"  parity {name:22s} gated worst max-norm rel {worst:.3g}; reference vs itself "
            f"perturbed 1e-7: mean {floor['mean']:.2g}, h {floor['h']:.2g}; counters "
            f"torch {ref['counts']} triton {tri['counts']} ({time.perf_counter() - t0:.1f} s)")
        for r in rows:
            if r["tol"] is not None or r["maxnorm_rel"] > 1e-3:
                log(f"    {r['buffer']:9s} bucket {r['bucket']} {r['param_dtype']:8s} "
                    f"n={r['numel']:<8d} max-norm rel {r['maxnorm_rel']:.3g} "
                    f"(elementwise {r['elementwise_rel']:.3g}) tol {r['tol']} "
                    f"{'ok' if r['ok'] else 'FAIL'}")
    return results, failures


# --------------------------------------------------------------------------- 2b. checks
def _steady_setup(dev, smoke, seed=21):
    """A triton IVON-PoCo with a float32 and a bf16 group, warmed up past its first
    refresh, with fixed gradients (separate tensors, assigned to .grad like autograd
    leaves them).  ess = 1 keeps the state finite over many steps on one fixed gradient
    (see ``setups.poco_opt``)."""
    n = 1003 if smoke else 1 << 20
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=g).to(dev)),
              torch.nn.Parameter(torch.randn(n + 5, generator=g).to(dev).to(torch.bfloat16))]
    opt = pk.IVONPoCo([{"params": params[:1]}, {"params": params[1:], "lr": 0.05}],
                      lr=1e-2, ess=1.0, seed=seed, backend="triton")
    grads = [torch.randn(p.shape, generator=g).to(dev).to(p.dtype) for p in params]
    return params, opt, grads


def _assign(params, grads):
    for p, gr in zip(params, grads):
        p.grad = gr


def _cycle_parts(opt, params, grads):
    """One steady-state step of the public protocol, as named phases."""
    def inner_sample():
        opt.sample("inner")

    def inner_acc():
        _assign(params, grads)
        opt.accumulate()

    def restore():
        opt.restore()

    def outer_sample():
        opt.sample("outer")

    def outer_acc():
        _assign(params, grads)
        opt.accumulate()

    def step():
        opt.step()
    return [("sample(inner)", inner_sample), ("accumulate", inner_acc), ("restore", restore),
            ("sample(outer)", outer_sample), ("accumulate(outer)", outer_acc),
            ("restore(outer)", restore), ("step", step)]


def _run_cycle(opt, params, grads):
    for _, f in _cycle_parts(opt, params, grads):
        f()


def _refresh_once(opt, params, grads):
    with opt.sampled("refresh", accumulate=False):
        _assign(params, grads)
        opt.accumulate()
    opt.refresh()


def _closure_step(opt, params, grads):
    opt.step(lambda: _assign(params, grads))


def _warm(opt, params, grads):
    for _ in range(3):
        _run_cycle(opt, params, grads) if opt.correction_active() else _closure_step(
            opt, params, grads)
    _refresh_once(opt, params, grads)
    for _ in range(3):
        _run_cycle(opt, params, grads)
        _closure_step(opt, params, grads)


def check_sync(dev, smoke):
    """set_sync_debug_mode: 'error' over whole steady-state steps (the verdict), then
    'warn' per phase (to say where, if anywhere)."""
    if dev.type != "cuda":
        return {"skipped": "CUDA only"}, []
    params, opt, grads = _steady_setup(dev, smoke)
    _warm(opt, params, grads)
    torch.cuda.synchronize()
    res, failures = {}, []
    for label, fn in (("public protocol step", lambda: _run_cycle(opt, params, grads)),
                      ("step(closure)", lambda: _closure_step(opt, params, grads))):
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                fn()
            res[label] = "no synchronisation"
        except Exception as exc:
            res[label] = f"SYNCHRONISED: {type(exc).__name__}: {exc}"
            failures.append(f"sync: {label}: {exc}")
        finally:
            torch.cuda.set_sync_debug_mode(0)
        reset_host(opt)                      # (a phase that raised left it mid-step)
    # where: per phase, warn mode
    per_phase = {}
    torch.cuda.synchronize()
    for name, f in _cycle_parts(opt, params, grads):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                f()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        msgs = [str(x.message).splitlines()[0] for x in w
                if "synchroniz" in str(x.message).lower()]
        per_phase[name] = msgs[:3] if msgs else "none"
    res["per_phase"] = per_phase
    # informational: the refresh
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _refresh_once(opt, params, grads)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    msgs = [str(x.message).splitlines()[0] for x in w if "synchroniz" in str(x.message).lower()]
    res["refresh (informational)"] = msgs[:3] if msgs else "none"
    del params, opt, grads
    release(dev)
    return res, failures


def check_jit_and_memory(dev, smoke, steps=20):
    """Steady-state steps with a new learning rate every step: JIT variants before/after,
    and memory_allocated at the same point of every step."""
    params, opt, grads = _steady_setup(dev, smoke)
    _warm(opt, params, grads)
    _sync(dev)
    before = jit_variants()
    mem = []
    base = [g["lr"] for g in opt.param_groups]
    for i in range(steps):
        for g, lr in zip(opt.param_groups, base):
            g["lr"] = lr * (1.0 + 0.013 * (i + 1))
        if i % 2:
            _run_cycle(opt, params, grads)
        else:
            _closure_step(opt, params, grads)
        _sync(dev)
        if dev.type == "cuda":
            mem.append(torch.cuda.memory_allocated(dev))
    after = jit_variants()
    res, failures = {}, []
    if before is None:
        res["jit"] = "n/a under the interpreter (no compile cache)"
    else:
        grew = {k: (before[k], after[k]) for k in before if after[k] != before[k]}
        res["jit"] = {"variants_before": before, "variants_after": after, "grew": grew}
        if grew:
            failures.append(f"jit: new compilations while only lr changed: {grew}")
    if mem:
        res["memory_allocated"] = {"first": mem[0], "last": mem[-1], "max": max(mem),
                                   "growth_bytes": mem[-1] - mem[0]}
        if mem[-1] != mem[0] or max(mem) != mem[0]:
            failures.append(f"memory: memory_allocated moved across steady-state steps "
                            f"(first {mem[0]}, last {mem[-1]}, max {max(mem)})")
    else:
        res["memory_allocated"] = "CUDA only"
    del params, opt, grads
    release(dev)
    return res, failures


def check_bf16_store(dev):
    """Informational: the bits the kernels write into bf16 parameters (``_to_param``,
    through ``sample_kernel`` with no noise) against torch's float32 -> bfloat16 cast, on
    random values, rounding ties and specials.  NaN counts as equal to NaN whatever the
    payload.  Not gated (a mismatch is reported as a package finding)."""
    from poco_kernels.kernels import triton_ops as ops
    from poco_kernels.kernels import triton_kernels as K
    g = torch.Generator().manual_seed(4)
    rnd = torch.randn(4093, generator=g) * torch.logspace(-30, 30, 4093)
    ties = (torch.randint(0, 2 ** 15, (64,), generator=g).to(torch.int64) * 2 ** 17
            + 0x8000 + (torch.arange(64) % 2) * 0x10000 + 0x3F000000)
    special = torch.tensor([0x7FFFFFFF, 0x7FC00000, 0x7F800001, 0xFFC00000, 0xFFFFFFFF,
                            0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x00000001,
                            0x80000000, 0x00000000, 0x3F808000, 0x3F818000],
                           dtype=torch.int64)
    bits = torch.cat([rnd.view(torch.int32).to(torch.int64) & 0xFFFFFFFF, ties, special])
    centre = torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32).view(
        torch.float32).to(dev)
    param = torch.empty(centre.numel(), dtype=torch.bfloat16, device=dev)
    mean = torch.zeros_like(centre)
    ctl = torch.zeros(K.CTL_SIZE, dtype=torch.int64, device=dev)
    ops.sample(param, centre, mean, None, None, ctl, 0, 0, 0, 1.0, 0.0, 0.0, 1.0,
               K.SIGMA_NONE, False)
    ref = centre.to(torch.bfloat16)
    got_b = param.view(torch.int16).cpu().to(torch.int64) & 0xFFFF
    ref_b = ref.view(torch.int16).cpu().to(torch.int64) & 0xFFFF
    both_nan = torch.isnan(param.cpu().float()) & torch.isnan(ref.cpu().float())
    bad = ((got_b != ref_b) & ~both_nan).nonzero().flatten().tolist()
    inp = bits.tolist()
    examples = [f"f32 0x{inp[i]:08x} -> kernel 0x{got_b[i]:04x}, torch 0x{ref_b[i]:04x}"
                for i in bad[:8]]
    res = {"values": len(inp), "mismatches": len(bad), "examples": examples}
    if bad:
        log(f"    WARN bf16 store: {len(bad)} of {len(inp)} values differ from torch's cast: "
            + "; ".join(examples[:4]))
    return res


def check_graph(dev, smoke, replays=5):
    """Capture on optimizer A, replay; run the same steps eagerly on twin B; compare."""
    res, failures = {}, []
    twins = []
    for _ in range(2):
        params, opt, grads = _steady_setup(dev, smoke)
        _warm(opt, params, grads)
        _assign(params, [g.clone() for g in grads])       # .grad buffers written in place
        twins.append((params, opt, grads))
    (pa, oa, ga), (pb, ob, gb) = twins
    seq_a, seq_b = graph_seq(oa, pa, ga), graph_seq(ob, pb, gb)
    replay, err = capture(dev, seq_a)
    for _ in range(3):                                      # B: the warm-up steps of A
        seq_b()
    if err is not None:
        reset_host(oa)
        res["capture"] = f"FAILED: {err}"
        log(f"  graph capture FAILED: {err}")
    else:
        res["capture"] = "ok" if dev.type == "cuda" else "skipped on CPU (seq run eagerly)"
        try:
            for _ in range(replays):
                replay()
            for _ in range(replays):
                seq_b()
            _sync(dev)
            cmp = {}
            for n in ("mean", "h", "momentum"):
                cmp[n] = max(rel_err(a, b)[0] for a, b in zip(oa.flat_state(n), ob.flat_state(n)))
            cmp["params"] = max(rel_err(a, b)[0] for a, b in zip(pa, pb))
            sa, sb = oa.step_count, ob.step_count
            res["replay_vs_eager_maxnorm_rel"] = cmp
            res["device_steps"] = {"graph": sa, "eager": sb}
            bad = {k: v for k, v in cmp.items() if v != 0.0}
            if bad or sa != sb:
                failures.append(f"graph: replay differs from eager: {bad}, steps {sa} vs {sb}")
                res["replay"] = "MISMATCH"
            else:
                res["replay"] = "bitwise equal to eager"
            res["note"] = ("hyperparameters are baked into the graph at capture (a new lr "
                           "needs a new capture); the host step counter of A stays at the "
                           "capture, the device counter advances per replay")
        except Exception as exc:
            res["replay"] = f"FAILED: {type(exc).__name__}: {exc}"
            failures.append(f"graph: replay raised {exc}")
    del twins, pa, oa, ga, pb, ob, gb, replay, seq_a, seq_b
    release(dev)
    return res, failures


# --------------------------------------------------------------------------- main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, add_help=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes on the CPU under TRITON_INTERPRET=1 (CUDA-only parts skipped)")
    ap.add_argument("--only", nargs="*", default=None,
                    choices=["parity", "checks", "graph", "bench"],
                    help="sections to run (default: all)")
    ap.add_argument("-h", "--help", action="store_true")
    args, rest = ap.parse_known_args(argv)
    import run as suite_mod
    if args.help:
        ap.print_help()
        print("\nBenchmark options (benchmarks/run.py):")
        suite_mod.build_parser().print_help()
        return 0
    sections = set(args.only or ["parity", "checks", "graph", "bench"])
    if args.smoke:
        rest = ["--device", "cpu", "--sizes", "1024", "2053", "--reps", "2", "--max-s", "1",
                "--copy-mib", "4", "--rotate-mib", "4", "--memory-numel", "3001", "--gpt", "gpt-test",
                "--gpt-iters", "2"] + rest
        dev = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            log("no CUDA device: run with --smoke for the CPU (interpreter) check")
            return 8
        dev = torch.device("cuda", torch.cuda.current_device())
    bargs = suite_mod.build_parser().parse_args(rest)
    if args.smoke and bargs.record:
        log("    --record ignored with --smoke (results/ holds device measurements)")
        bargs.record = False
    t_start = time.perf_counter()
    os.makedirs(bargs.out, exist_ok=True)
    report_path = os.path.join(bargs.out, "bench_gpu_report.json")

    # 1. device
    info = device_info(dev)
    report = {"info": info, "tolerances": {"RTOL_FP32": RTOL_FP32,
                                           "RTOL_BF16_MASTER": RTOL_BF16_MASTER,
                                           "source": TOLERANCE_SOURCE}}
    log(f"[1] device: {info['device']} | torch {info['torch']} | triton {info['triton']} | "
        f"{info['date']}")
    for k in ("capability", "sm_count", "total_memory_gib", "l2_cache_mib", "cuda",
              "nvidia_smi", "git_head"):
        if k in info:
            log(f"    {k}: {info[k]}")
    dump(report_path, report)

    failures = {"parity": [], "checks": [], "bench": []}
    warns = []                                   # reported, not gating
    # 2. checks
    if "parity" in sections:
        log(f"[2] parity torch vs triton on {dev} (gate: max-norm rel, fp32 mean/h "
            f"{RTOL_FP32:g}, bf16 master mean {RTOL_BF16_MASTER:g})")
        try:
            report["parity"], failures["parity"] = parity(dev, args.smoke)
        except Exception as exc:
            traceback.print_exc()
            failures["parity"].append(f"parity raised {type(exc).__name__}: {exc}")
            report["parity"] = f"RAISED: {exc}"
        dump(report_path, report)
    if "checks" in sections:
        log("[2b] steady state: synchronisation, JIT cache, memory")
        for name, fn in (("sync", check_sync), ("jit_memory", check_jit_and_memory)):
            try:
                res, fails = fn(dev, args.smoke)
            except Exception as exc:
                traceback.print_exc()
                res, fails = f"RAISED: {exc}", [f"{name} raised {type(exc).__name__}: {exc}"]
            report[name] = res
            failures["checks"] += fails
            log(f"    {name}: {json.dumps(res, default=json_default)[:1500]}")
        try:
            report["bf16_store"] = check_bf16_store(dev)
            if report["bf16_store"]["mismatches"]:
                warns.append(f"bf16 store differs from torch's cast on "
                             f"{report['bf16_store']['mismatches']} values "
                             f"({'; '.join(report['bf16_store']['examples'][:3])})")
        except Exception as exc:
            traceback.print_exc()
            report["bf16_store"] = f"RAISED: {exc}"
            warns.append(f"bf16 store check raised {type(exc).__name__}: {exc}")
        dump(report_path, report)
    if "graph" in sections:
        log("[2c] CUDA graph of one step (capture, replay, compare with eager twin)")
        try:
            res, fails = check_graph(dev, args.smoke)
        except Exception as exc:
            traceback.print_exc()
            res, fails = f"RAISED: {exc}", []
        report["graph"] = res
        failures["checks"] += fails
        log(f"    graph: {json.dumps(res, default=json_default)[:1500]}")
        dump(report_path, report)

    # 3. the benchmarks: benchmarks/run.py's suite, on this device
    if "bench" in sections:
        log("[3] benchmarks (benchmarks/run.py)")
        try:
            code, _ = suite_mod.suite(bargs, dev, info)
            if code:
                failures["bench"].append(f"benchmark suite exit {code} (see bench.md)")
        except Exception as exc:
            traceback.print_exc()
            failures["bench"].append(f"benchmark suite raised {type(exc).__name__}: {exc}")
    report["failures"] = failures
    report["warnings"] = warns
    report["seconds"] = time.perf_counter() - t_start
    dump(report_path, report)

    code = (1 if failures["parity"] else 0) | (2 if failures["checks"] else 0) | (
        4 if failures["bench"] else 0)
    log("-" * 96)
    for k, v in failures.items():
        for msg in v:
            log(f"FAIL [{k}] {msg}")
    for msg in warns:
        log(f"WARN (not gating) {msg}")
    gr = report.get("graph", "not run")
    log(f"graph capture: {gr.get('capture') if isinstance(gr, dict) else gr}; "
        f"replay: {gr.get('replay') if isinstance(gr, dict) else '-'}")
    log(f"{'PASS' if code == 0 else 'FAIL'} (exit {code}) in {report['seconds']:.0f} s; "
        f"outputs in {bargs.out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
