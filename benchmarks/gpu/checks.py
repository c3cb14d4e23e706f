"""The steady-state checks of the Triton backend (``bench_gpu.py``, section 2): no host
synchronisation (steps and refreshes), no new compilation when only the learning rate
changes, no growth of allocated memory, the bits stored into bf16 parameters
(informational).  The CUDA-graph and torch.compile checks are ``capture.py``."""
from __future__ import annotations

import warnings

import torch

import poco_kernels as pk
from benchmarks.common.device import release, sync
from benchmarks.common.internals import reset_host
from benchmarks.common.report import log


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
    """set_sync_debug_mode: 'error' over whole steady-state steps and refreshes (the
    verdict), then 'warn' per phase of a step (to say where, if anywhere)."""
    if dev.type != "cuda":
        return {"skipped": "CUDA only"}, []
    params, opt, grads = _steady_setup(dev, smoke)
    _warm(opt, params, grads)
    torch.cuda.synchronize()
    res, failures = {}, []
    for label, fn in (("public protocol step", lambda: _run_cycle(opt, params, grads)),
                      ("step(closure)", lambda: _closure_step(opt, params, grads)),
                      ("refresh", lambda: _refresh_once(opt, params, grads))):
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
    del params, opt, grads
    release(dev)
    return res, failures


def check_jit_and_memory(dev, smoke, steps=20):
    """Steady-state steps with a new learning rate every step: JIT variants before/after,
    and memory_allocated at the same point of every step."""
    params, opt, grads = _steady_setup(dev, smoke)
    _warm(opt, params, grads)
    sync(dev)
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
        sync(dev)
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


def _tensors(obj, prefix=""):
    """Every tensor of a nested state dict, by path."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}/{i}")


def check_launch(dev, smoke):
    """The cached launches (``triton_launch``) against the JIT's: two twins of the
    steady-state optimizer run the same steps (public protocol, ``step(closure)``, a
    refresh), one with every launch through the JIT; parameters and every state tensor
    equal bit for bit, and on a GPU the cached path taken."""
    from poco_kernels.kernels import triton_launch
    from poco_kernels.kernels import triton_ops
    launchers = list(vars(triton_ops._L).values())
    runs = []
    for enabled in (False, True):
        triton_launch.ENABLED = enabled
        before = sum(x.hits for x in launchers)
        try:
            params, opt, grads = _steady_setup(dev, smoke)
            _warm(opt, params, grads)
            for _ in range(3):
                _run_cycle(opt, params, grads)
                _closure_step(opt, params, grads)
            sync(dev)
        finally:
            triton_launch.ENABLED = True
        runs.append(([p.detach().clone() for p in params],
                     dict(_tensors(opt.state_dict())), sum(x.hits for x in launchers) - before))
        del params, opt, grads
    (p_jit, s_jit, hits_jit), (p_fast, s_fast, hits_fast) = runs
    differ = [f"param {i}" for i, (a, b) in enumerate(zip(p_jit, p_fast)) if not torch.equal(a, b)]
    differ += [k for k in s_jit if k not in s_fast or not torch.equal(s_jit[k], s_fast[k])]
    res = {"fast_path": triton_launch.fast_path_available(), "cached_launches": hits_fast,
           "jit_run_cached_launches": hits_jit, "state_tensors": len(s_jit), "differ": differ,
           "misses": {x.fn.fn.__name__: x.misses for x in launchers if x.misses}}
    failures = []
    if differ:
        failures.append(f"launch: the cached launches differ from the JIT's in {differ[:5]}")
    if hits_jit:
        failures.append(f"launch: {hits_jit} cached launches while they were disabled")
    if res["fast_path"] and not hits_fast:
        failures.append("launch: the cached launches never ran")
    if dev.type == "cuda" and torch.version.hip is None and not res["fast_path"]:
        failures.append("launch: the cached launches are off on this NVIDIA GPU "
                        "(triton_launch.fast_path_available() is False)")
    log(f"    launch: cached {hits_fast} launches, bitwise "
        f"{'equal' if not differ else 'DIFFERENT'} to the JIT's over {len(s_jit)} state "
        f"tensors and {len(p_jit)} parameters (fast path {res['fast_path']})")
    release(dev)
    return res, failures


def check_bf16_store(dev):
    """Informational: the bits the kernels write into bf16 parameters (``_to_param``,
    through ``sample_kernel`` with no noise) against torch's float32 -> bfloat16 cast, on
    random values, rounding ties and specials.  NaN counts as equal to NaN whatever the
    payload.  Not gated (a mismatch is reported as a package finding)."""
    from poco_kernels.kernels import triton_ops as ops
    from poco_kernels.kernels import interface as K
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
    ops.sample(param, centre, mean, None, None, ctl, 0, 2, 0, 0, K.SampleHyper(1.0, 0.0, 0.0),
               1.0, K.SIGMA_NONE, False)
    cast = centre.to(torch.bfloat16)
    got_b = param.view(torch.int16).cpu().to(torch.int64) & 0xFFFF
    cast_b = cast.view(torch.int16).cpu().to(torch.int64) & 0xFFFF
    both_nan = torch.isnan(param.cpu().float()) & torch.isnan(cast.cpu().float())
    bad = ((got_b != cast_b) & ~both_nan).nonzero().flatten().tolist()
    inp = bits.tolist()
    examples = [f"f32 0x{inp[i]:08x} -> kernel 0x{got_b[i]:04x}, torch 0x{cast_b[i]:04x}"
                for i in bad[:8]]
    res = {"values": len(inp), "mismatches": len(bad), "examples": examples}
    if bad:
        log(f"    WARN bf16 store: {len(bad)} of {len(inp)} values differ from torch's cast: "
            + "; ".join(examples[:4]))
    return res
