"""Memory of each optimizer: the state it holds between steps, in bytes per parameter, and
the allocations one steady-state step makes (expected: zero for this package's fused
backends).

* **State bytes per parameter**: every tensor reachable from the optimizer object (its
  ``state``, its ``param_groups``, and the attributes of this package's and ivon-opt's
  own objects), counted once per storage, excluding the storages of the parameters and
  of their ``.grad``.  For the fused backends this includes the float32 master mean of
  bf16 parameters and the flat gradient buffers beyond the one the parameters' ``.grad``
  are views of (IVON-PoCoMo: the second, for the outer gradient; ``.grad`` are counted
  only while they are set).  On CUDA,
  the allocator's own count (``memory_allocated`` after building the optimizer and
  taking steps, minus before) is given beside it, with the peak during a step.
* **Allocations per step**: the allocator events one steady-state iteration makes
  (``torch.profiler`` with ``profile_memory=True``; allocations, not frees), as a count
  and in bytes, averaged over ``n`` iterations.  An iteration is what a training loop
  calls: ``step(closure)`` (IVON-PoCoMo: inner and outer samples; the closure assigns
  ``.grad`` a fixed tensor, as autograd would), ivon-opt's ``sampled_params`` + ``step``,
  AdamW's ``step``; and, separately, a refresh of IVON-PoCoMo.
"""
from __future__ import annotations

import torch

from benchmarks.common.device import release
from benchmarks.common.report import dtype_name, log

# one model-like set of parameters: odd sizes, 2**20 - 1 elements in all (scaled down by
# ``run(..., numel=...)``)
SIZES = (600001, 300007, 148567)


def _sizes(numel):
    total = sum(SIZES)
    return tuple(max(1, (n * numel) // total) | 1 for n in SIZES)


def _storage_key(t):
    try:
        st = t.untyped_storage()
        return st.data_ptr(), st.nbytes()
    except Exception:
        return None, 0


def held_bytes(opt, params):
    """(bytes, {path: bytes}) of the tensors ``opt`` holds, each storage once, parameters
    and their gradients excluded."""
    exclude = set()
    for p in params:
        exclude.add(_storage_key(p)[0])
        if p.grad is not None:
            exclude.add(_storage_key(p.grad)[0])
    seen, found = set(), {}

    def visit(o, path, depth):
        if depth > 8:
            return
        if isinstance(o, torch.Tensor):
            key, nbytes = _storage_key(o)
            if key and key not in exclude and key not in found:
                found[key] = (path, nbytes)
            return
        if id(o) in seen or isinstance(o, (str, bytes, int, float, bool, type(None))):
            return
        seen.add(id(o))
        if isinstance(o, dict):
            for k, v in o.items():
                if k != "params":
                    visit(v, f"{path}[{k if isinstance(k, str) else type(k).__name__}]",
                          depth + 1)
        elif isinstance(o, (list, tuple, set, frozenset)):
            for i, v in enumerate(o):
                visit(v, f"{path}[{i}]", depth + 1)
        elif depth == 0 or type(o).__module__.split(".")[0] in ("poco_kernels", "ivon"):
            for k, v in vars(o).items() if hasattr(o, "__dict__") else ():
                visit(v, f"{path}.{k}", depth + 1)
            for k in getattr(type(o), "__slots__", ()):
                visit(getattr(o, k, None), f"{path}.{k}", depth + 1)

    visit(opt, "opt", 0)
    per = {}
    for path, nbytes in found.values():
        per[path] = per.get(path, 0) + nbytes
    return sum(per.values()), per


def count_allocations(fn, n=5):
    """(allocations, bytes allocated) per call of ``fn``, averaged over ``n`` calls, from
    the profiler's allocator events; (None, None) if the profiler cannot say."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available()
                                     else [])
    try:
        with profile(activities=acts, profile_memory=True) as prof:
            for _ in range(n):
                fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        count, nbytes = 0, 0
        stack = list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            kind, extra = e.typed
            if str(kind).endswith("Allocation") and extra.alloc_size > 0:
                count += 1
                nbytes += extra.alloc_size
            stack.extend(e.children)
        return count / n, nbytes / n
    except Exception as exc:   # an experimental profiler API: report, do not fail the run
        log(f"    allocation count unavailable: {type(exc).__name__}: {exc}")
        return None, None


def _model(dev, dt, numel, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    sizes = _sizes(numel)
    params = [torch.nn.Parameter(torch.randn(n, device=dev, generator=g).to(dt)) for n in sizes]
    grads = [torch.randn(n, device=dev, generator=g).to(dt) for n in sizes]
    return params, grads


def _assign(params, grads):
    for p, g in zip(params, grads):
        p.grad = g


def candidates(backends, ivon_mod):
    """(name, provider, factory(params) -> optimizer, driver) for every optimizer."""
    import poco_kernels as pk
    out = []
    for flag in ("foreach", "fused"):
        out.append(("AdamW", f"torch.AdamW({flag})",
                    (lambda flag: lambda ps: torch.optim.AdamW(ps, lr=1e-3, **{flag: True}))(flag),
                    "plain"))
    if ivon_mod is not None:
        out.append(("IVON", "ivon-opt-0.1.3", lambda ps: ivon_mod.IVON(ps, lr=1e-3, ess=1.0),
                    "ivonopt"))
    ours = [("SVRG", lambda ps, b: pk.SVRG(ps, lr=1e-3, momentum=0.9, backend=b)),
            ("SVRGAdamW", lambda ps, b: pk.SVRGAdamW(ps, lr=1e-3, backend=b)),
            ("VSGDPoCo", lambda ps, b: pk.VSGDPoCo(ps, lr=1e-3, sigma=1e-3, momentum=0.9,
                                                   backend=b)),
            ("IVON", lambda ps, b: pk.IVON(ps, lr=1e-3, ess=1.0, backend=b)),
            ("IVONPoCoMo", lambda ps, b: pk.IVONPoCo(ps, lr=1e-3, ess=1.0, alpha=1.0, rho1=0.6,
                                                     rho2=0.1, backend=b))]
    for backend in backends:
        for name, make in ours:
            out.append((name, f"poco_kernels.{backend}",
                        (lambda make, backend: lambda ps: make(ps, backend))(make, backend),
                        "ours"))
    return out


def run(dev, dtypes, backends, ivon_mod, n=5, numel=sum(SIZES)):
    """One row per (optimizer, provider, dtype), over three parameters of about ``numel``
    elements in all."""
    rows = []
    for dt in dtypes:
        for name, provider, factory, kind in candidates(backends, ivon_mod):
            try:
                rows.append(_one(dev, dt, name, provider, factory, kind, n, numel))
                r = rows[-1]
                log(f"  {name:11s} {provider:28s} {dtype_name(dt):8s} state "
                    f"{r['state_bytes_per_param']:6.2f} B/param; per step "
                    f"{r['allocs_per_step']} allocations ({r['alloc_bytes_per_step']} B)"
                    + (f"; per refresh {r['allocs_per_refresh']} ({r['alloc_bytes_per_refresh']} B)"
                       if r.get("allocs_per_refresh") is not None else ""))
            except Exception as exc:
                rows.append(dict(optimizer=name, provider=provider, dtype=dtype_name(dt),
                                 error=f"{type(exc).__name__}: {exc}"))
                log(f"  {name} {provider} {dtype_name(dt)}: ERROR {rows[-1]['error']}")
            finally:
                release(dev)
    return rows


def _one(dev, dt, name, provider, factory, kind, n, numel):
    cuda = dev.type == "cuda"
    params, grads = _model(dev, dt, numel)
    numel = sum(p.numel() for p in params)
    _assign(params, grads)
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(dev)
    opt = factory(params)

    if kind == "plain":
        it = opt.step
    elif kind == "ivonopt":
        def it():
            with opt.sampled_params(train=True):
                _assign(params, grads)
            opt.step()
    else:
        closure = lambda: _assign(params, grads)  # noqa: E731

        def it():
            opt.step(closure)
    refresh = None           # IVON has no outer loop
    if kind == "ours" and name != "IVON":
        refresh = lambda: opt.refresh([closure])  # noqa: E731
        it()
        refresh()             # correction active from here on
    for _ in range(3):        # warm-up: every buffer allocated, kernels compiled
        it()
    if refresh is not None:
        refresh()
        it()
    row = dict(optimizer=name, provider=provider, dtype=dtype_name(dt), numel=numel)
    held, per = held_bytes(opt, params)
    row["state_bytes_per_param"] = round(held / numel, 3)
    # in opt.state (torch.optim's per-parameter state) vs elsewhere: ivon-opt's
    # param_groups; the fused engines' gradient buffers and sums, control words
    st = sum(v for k, v in per.items() if k.startswith("opt.state["))
    row["opt_state_bytes_per_param"] = round(st / numel, 3)
    row["other_bytes_per_param"] = round((held - st) / numel, 3)
    row["state_tensors"] = {k: round(v / numel, 3) for k, v in sorted(per.items())}
    if cuda:
        torch.cuda.synchronize()
        row["allocator_bytes_per_param"] = round(
            (torch.cuda.memory_allocated(dev) - before) / numel, 3)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        it()
        torch.cuda.synchronize()
        row["peak_extra_bytes_per_param"] = round(
            (torch.cuda.max_memory_allocated(dev) - base) / numel, 3)
    a, b = count_allocations(it, n)
    row["allocs_per_step"], row["alloc_bytes_per_step"] = a, b
    if refresh is not None:
        a, b = count_allocations(refresh, max(2, n // 2))
        row["allocs_per_refresh"], row["alloc_bytes_per_refresh"] = a, b
    return row
