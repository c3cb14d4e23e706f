"""What the benchmark scripts share: bytes-per-parameter models, timing, the rows and their
CSV schema, the closing table.  Device-independent (CUDA timing through
``triton.testing.do_bench``, CPU timing through ``time.perf_counter``).

CSV schema (one for every script): kernel, provider, dtype, size, median, p20, p80
(seconds), bytes_per_param, gbps (model bytes / median), pct_of_copy (that bandwidth as a
percentage of the copy bandwidth measured in the same run), timing, device, date.
"""
from __future__ import annotations

import csv
import datetime
import glob
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback

import torch

# --------------------------------------------------------------------------- byte models
# Bytes moved per parameter through memory, each input read once and each output written
# once, counted from the kernels (poco_kernels/kernels/triton_kernels.py and
# csrc/kernels_impl.h move the same bytes; state is float32, S = 4 bytes; P = bytes of one
# parameter / gradient element: 4 for float32, 2 for bf16).
S = 4


def b_step_poco(P):
    """step kernel, FAMILY_IVON, CORR, HESS_CORR (hess_corr_scale 0.01 != 0), shared noise,
    one draw (GE_IN = GE_O = False: eps regenerated, not read), no AMP:
    reads  mean, g_in sum, g_o sum, g_out, momentum (s1), h (s2), sigma_out, h_out, m_out
           (9 x S; the parameters are NOT read),
    writes momentum, h, mean (3 x S) and the parameters (P)."""
    return 9 * S + 3 * S + P


def b_step_ivon(P):
    """step kernel, FAMILY_IVON, no CORR: reads mean, g_in sum, momentum, h (4 x S);
    writes momentum, h, mean (3 x S) and the parameters (P)."""
    return 4 * S + 3 * S + P


def b_sample_inner(P, sync):
    """sample kernel, SIGMA_IVON.  SYNC (float32 parameters holding the mean): reads the
    parameters (P), writes mean (S), reads h (S), writes the sample (P).  Otherwise (bf16):
    reads mean, h (2 x S), writes the sample (P)."""
    return (P + S + S + P) if sync else (2 * S + P)


def b_sample_outer(P):
    """sample kernel, SIGMA_BUFFER: reads m_out, sigma_out (2 x S), writes the sample (P)."""
    return 2 * S + P


def b_accumulate(P):
    """accumulate kernel, FIRST, no GE: reads the flat gradient (P), writes the sum (S)."""
    return P + S


def b_gather(P):
    """FusedEngine._gather_grads when .grad is not a view of the flat gradient buffer:
    one foreach copy, reads .grad (P), writes the flat buffer (P)."""
    return 2 * P


def b_restore(P):
    """FusedEngine.restore: reads mean (S), writes the parameters (P)."""
    return S + P


def b_refresh_kernel(P):
    """refresh kernel, FAMILY_IVON, one draw: reads mean, acc_g, h, g_out, h_out (5 x S);
    writes g_out, h_out, m_out, sigma_out (4 x S)."""
    return 5 * S + 4 * S


def b_poco_cycle(P, protocol):
    """One IVON-PoCo step with the correction on, optimizer side only.
    'flat':    .grad are views of the flat gradient buffer (no gather), lazy restores
               (what step(closure) does), accumulate(clear_grads=False);
    'closure': step(closure), the closure assigns .grad (separate tensors, as autograd
               leaves them): lazy restores, one gather copy per accumulate;
    'sampled': the public `with opt.sampled(...)` protocol: full restores, gather copies,
               and (float32) the mean re-read from the parameters before the outer sample."""
    sync = P == S
    inner = b_sample_inner(P, sync) + b_accumulate(P)
    outer = b_sample_outer(P) + b_accumulate(P)
    total = inner + outer + b_step_poco(P)
    if protocol in ("closure", "sampled"):
        total += 2 * b_gather(P)
    if protocol == "sampled":
        total += 2 * b_restore(P) + ((P + S) if sync else 0)
    return total


def b_ivon_cycle(P):
    """One plain IVON step through step(closure): inner sample, gather, accumulate, step."""
    return b_sample_inner(P, P == S) + b_gather(P) + b_accumulate(P) + b_step_ivon(P)


def b_refresh(P):
    """A refresh with one chunk, .grad views of the flat buffer: refresh sample (the
    parameters hold the mean), accumulate, full restore, refresh kernel."""
    return b_sample_inner(P, P == S) + b_accumulate(P) + b_restore(P) + b_refresh_kernel(P)


def b_adamw(P):
    """torch AdamW (fused), state in the parameter dtype: reads param, grad, exp_avg,
    exp_avg_sq; writes param, exp_avg, exp_avg_sq."""
    return 7 * P


def b_ivonopt_step(P):
    """The fewest bytes of IVON's update as ivon-opt states it (state in the parameter
    dtype): reads param, avg_grad, avg_nxg, momentum, hess; writes param, momentum, hess.
    (ivon-opt runs it as ~15 separate torch ops, so it moves several times this.)"""
    return 8 * P


def b_ivonopt_sample(P):
    """Fewest bytes of ivon-opt's sample (entering ``sampled_params``): reads param, hess;
    writes the noise and the sample (ivon-opt also copies the mean with ``torch.cat``)."""
    return 4 * P


def b_ivonopt_restore(P):
    """Fewest bytes of ivon-opt's restore with ``train=True`` (leaving ``sampled_params``):
    the mean is put back by pointer; reads grad, noise; writes avg_grad, avg_nxg."""
    return 4 * P


def b_ivonopt_cycle(P):
    """Fewest bytes of ivon-opt's cycle: its sample, restore + collect, then its step."""
    return b_ivonopt_sample(P) + b_ivonopt_restore(P) + b_ivonopt_step(P)


def b_accumulate_restore(P):
    """Ours, leaving ``sampled(...)`` (closure-assigned .grad, not views of the flat
    buffer): gather copy, accumulate, restore."""
    return b_gather(P) + b_accumulate(P) + b_restore(P)


BYTE_MODELS = (b_step_poco, b_step_ivon, b_sample_inner, b_sample_outer, b_accumulate,
               b_gather, b_restore, b_refresh_kernel, b_poco_cycle, b_ivon_cycle, b_refresh,
               b_accumulate_restore, b_adamw, b_ivonopt_step, b_ivonopt_sample,
               b_ivonopt_restore, b_ivonopt_cycle)


# --------------------------------------------------------------------------- helpers
def log(msg=""):
    print(msg, flush=True)


def dtype_name(dt):
    return str(dt).replace("torch.", "")


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def release(dev):
    import gc
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _quantiles(ts):
    ts = sorted(ts)
    q = lambda f: ts[min(len(ts) - 1, int(f * len(ts)))]  # noqa: E731
    return statistics.median(ts), q(0.2), q(0.8)


class Timer:
    """Median / p20 / p80 seconds of ``fn``.

    CUDA: ``triton.testing.do_bench`` (CUDA events, L2 flushed before each call).
    CPU: ``time.perf_counter`` around each call, after ``cpu_warmup`` untimed calls, for
    ``cpu_reps`` calls or until ``cpu_max_s`` seconds have been spent (at least 3 calls);
    ``setup`` (CPU only) runs untimed before each call (e.g. the gradients a step consumes).
    """

    def __init__(self, dev, warmup_ms=25.0, rep_ms=100.0, cpu_reps=10, cpu_warmup=2,
                 cpu_max_s=30.0):
        self.dev, self.warmup_ms, self.rep_ms = dev, warmup_ms, rep_ms
        self.cpu_reps, self.cpu_warmup, self.cpu_max_s = cpu_reps, cpu_warmup, cpu_max_s

    def __call__(self, fn, setup=None):
        if self.dev.type == "cuda":
            if setup is not None:
                return self._cuda_with_setup(fn, setup)
            import triton.testing
            q = triton.testing.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms,
                                        quantiles=[0.5, 0.2, 0.8])
            return tuple(float(x) * 1e-3 for x in q)
        t_first = None
        for i in range(self.cpu_warmup):
            if setup is not None:
                setup()
            t0 = time.perf_counter()
            fn()
            t_first = time.perf_counter() - t0
            if t_first > self.cpu_max_s / 8:      # a slow row: one warm-up call is enough
                break
            if setup is not None:
                setup()
            fn()
        ts, t_end = [], time.perf_counter() + self.cpu_max_s
        while len(ts) < self.cpu_reps and (len(ts) < 3 or time.perf_counter() < t_end):
            if setup is not None:
                setup()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return _quantiles(ts)

    def _cuda_with_setup(self, fn, setup):
        """As ``do_bench`` (CUDA events around each call, L2 flushed before each), with
        ``setup`` enqueued untimed before each call."""
        flush = torch.empty(256 * 2 ** 20, dtype=torch.int8, device=self.dev)
        ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731

        def once(s, e):
            setup()
            flush.zero_()
            s.record()
            fn()
            e.record()
        once(ev(), ev())
        torch.cuda.synchronize(self.dev)
        probe = [(ev(), ev()) for _ in range(5)]
        for s, e in probe:
            once(s, e)
        torch.cuda.synchronize(self.dev)
        est_ms = max(1e-3, statistics.median(s.elapsed_time(e) for s, e in probe))
        for _ in range(max(1, int(self.warmup_ms / est_ms))):
            once(ev(), ev())
        pairs = [(ev(), ev()) for _ in range(max(5, min(1000, int(self.rep_ms / est_ms))))]
        for s, e in pairs:
            once(s, e)
        torch.cuda.synchronize(self.dev)
        return _quantiles([s.elapsed_time(e) * 1e-3 for s, e in pairs])

    def wall(self, fn, n=20, rounds=5):
        """Host-inclusive time per call: ``n`` calls back to back, then a synchronise;
        median / p20 / p80 over ``rounds`` (no L2 flush: what a training loop sees)."""
        fn()
        sync(self.dev)
        per = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            sync(self.dev)
            per.append((time.perf_counter() - t0) / n)
        return _quantiles(per)


def rotation(bytes_per_call, min_bytes):
    """How many copies of a call's inputs to rotate through so that consecutive calls
    touch at least ``min_bytes`` (larger than the last-level cache): caches then do not
    flatter small sizes."""
    return max(1, min(64, math.ceil(min_bytes / max(1, bytes_per_call))))


def round_robin(fns):
    """One callable that runs the next of ``fns`` at each call."""
    it = {"i": 0}

    def call():
        fn = fns[it["i"] % len(fns)]
        it["i"] += 1
        return fn()
    return call


def copy_bandwidth(dev, timer, nbytes):
    """Copy of ``nbytes`` (one buffer to another on ``dev``): (bytes read + written) /
    median time.  On the CPU, buffers beyond the last-level cache measure memory, not
    cache: the default callers use 1 GiB each way."""
    n = nbytes // 4
    bufs = [torch.randn(n, device=dev), torch.empty(n, device=dev)]
    med, p20, p80 = timer(lambda: bufs[1].copy_(bufs[0]))
    ok = bool(torch.equal(bufs[1], bufs[0]))
    bufs.clear()
    release(dev)
    return {"bytes_each_way": n * 4, "median_s": med, "p20_s": p20, "p80_s": p80,
            "bandwidth_Bps": 2 * n * 4 / med, "copy_verified": ok}


def inplace_bandwidth(dev, timer, nbytes):
    """``a.add_(b)`` on two buffers of ``nbytes``: (2 reads + 1 write) / median time.  A
    second reference beside the copy: on a CPU a copy's destination lines are read before
    they are written (12 bytes move for the 8 the copy model counts), while an in-place
    update writes lines it has just read, as the optimizers' kernels mostly do."""
    n = nbytes // 4
    bufs = [torch.randn(n, device=dev), torch.randn(n, device=dev)]
    med, p20, p80 = timer(lambda: bufs[0].add_(bufs[1]))
    bufs.clear()
    release(dev)
    return {"bytes_each_way": n * 4, "median_s": med, "p20_s": p20, "p80_s": p80,
            "bandwidth_Bps": 3 * n * 4 / med}


def copy_row(cb, timing):
    """The copy measurement as a row of the table (its own ceiling: 100%)."""
    return dict(kernel="copy", provider="torch.Tensor.copy_", dtype="float32",
                size=cb["bytes_each_way"] // 4, median=cb["median_s"], p20=cb["p20_s"],
                p80=cb["p80_s"], bytes_per_param=8, bandwidth_Bps=cb["bandwidth_Bps"],
                frac_copy=1.0, timing=timing)


def inplace_row(ib, timing):
    """The in-place update measurement as a row (fraction filled in by the caller)."""
    return dict(kernel="inplace_add", provider="torch.Tensor.add_", dtype="float32",
                size=ib["bytes_each_way"] // 4, median=ib["median_s"], p20=ib["p20_s"],
                p80=ib["p80_s"], bytes_per_param=12, bandwidth_Bps=ib["bandwidth_Bps"],
                frac_copy=None, timing=timing)


class Bench:
    """Collects the rows: each gets its byte model, achieved bandwidth and fraction of the
    copy bandwidth; a failing benchmark is recorded and the run goes on."""

    def __init__(self, dev, timer, copy_bw):
        self.dev, self.timer, self.copy_bw = dev, timer, copy_bw
        self.rows, self.errors = [], []

    def add(self, kernel, provider, dt, size, t, bpp, wall=False):
        med, p20, p80 = t
        nbytes = bpp * size if bpp is not None else None
        bw = nbytes / med if nbytes else None
        frac = bw / self.copy_bw if (bw and self.copy_bw) else None
        row = dict(kernel=kernel, provider=provider, dtype=dtype_name(dt), size=size,
                   median=med, p20=p20, p80=p80, bytes_per_param=bpp,
                   bandwidth_Bps=bw, frac_copy=frac,
                   timing="wall" if wall else ("events" if self.dev.type == "cuda"
                                               else "perf_counter"))
        self.rows.append(row)
        log(f"  {kernel:22s} {provider:34s} {dtype_name(dt):8s} {size:>10d} "
            f"median {med * 1e3:9.4f} ms [p20 {p20 * 1e3:.4f}, p80 {p80 * 1e3:.4f}]"
            + (f"  {bw / 1e9:7.1f} GB/s" if bw else "")
            + (f"  {100 * frac:5.1f}% copy" if frac else ""))
        return row

    def run(self, label, fn):
        try:
            fn()
        except Exception as exc:
            msg = f"{label}: {type(exc).__name__}: {exc}"
            self.errors.append(msg)
            log(f"  ERROR {msg}")
            traceback.print_exc()
        finally:
            release(self.dev)


def import_ivon():
    """(the ivon-opt module, None) or (None, why not).  Where it is not installed (a lent
    GPU machine reaches no registry), a wheel in ``<repo>/.whl/ivon_opt-*.whl`` is imported
    from the zip (ivon-opt is pure Python)."""
    try:
        import ivon
        return ivon, None
    except ImportError as exc:
        err = f"{type(exc).__name__}: {exc}"
    for whl in sorted(glob.glob(os.path.join(REPO, ".whl", "ivon_opt-*.whl"))):
        sys.path.insert(0, whl)
        try:
            import ivon
            return ivon, None
        except ImportError as exc:
            err = f"{type(exc).__name__}: {exc} (from {whl})"
    return None, err


# --------------------------------------------------------------------------- the device
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_bytes(dev):
    """Memory a benchmark may use on ``dev``: CUDA free memory, or the host's available
    memory (``/proc/meminfo``; unknown: 8 GiB)."""
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2 ** 30


def _git_head():
    try:
        return subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except Exception:
        return None


def device_info(dev):
    """What the rows were measured on.  ``info["device"]`` is the one-line description
    that goes into every CSV row; ``info["slug"]`` names the recorded result files."""
    info = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "torch": torch.__version__, "python": platform.python_version(),
            "threads": torch.get_num_threads(), "git_head": _git_head(),
            "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "")}
    try:
        import triton
        info["triton"] = triton.__version__
    except Exception as exc:
        info["triton"] = f"unavailable: {type(exc).__name__}"
    from poco_kernels.kernels import cpp_status
    if cpp_status() is None:
        from poco_kernels.kernels import cpp_ops
        info["cpp_isa"] = cpp_ops.isa()
    else:
        info["cpp_isa"] = f"unavailable: {cpp_status()}"
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        info.update(name=torch.cuda.get_device_name(dev), capability=list(
            torch.cuda.get_device_capability(dev)), sm_count=p.multi_processor_count,
            total_memory_gib=round(p.total_memory / 2 ** 30, 2),
            l2_cache_mib=round(getattr(p, "L2_cache_size", 0) / 2 ** 20, 1),
            cuda=torch.version.cuda)
        try:
            q = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.mem,clocks.max.sm,"
                 "temperature.gpu,power.draw,power.limit", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20)
            info["nvidia_smi"] = q.stdout.strip() or q.stderr.strip()
        except Exception as exc:
            info["nvidia_smi"] = f"unavailable: {exc}"
        info["device"] = f"{info['name']}, CUDA {info['cuda']}"
        info["slug"] = "gpu_" + re.sub(r"[^A-Za-z0-9]+", "_", info["name"]).strip("_")
        return info
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        cpu = re.search(r"model name\s*:\s*(.*)", text).group(1).strip()
        info["logical_cpus"] = text.count("processor\t:")
    except (OSError, AttributeError):
        pass
    info["name"] = cpu
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        info["caches"] = "; ".join(line.split(":", 1)[0].strip() + " " +
                                   line.split(":", 1)[1].strip()
                                   for line in lscpu.splitlines() if "cache" in line)
    except (OSError, subprocess.SubprocessError):
        pass
    interp = " (Triton interpreter)" if info["TRITON_INTERPRET"] == "1" else ""
    info["device"] = (f"cpu: {cpu}, {info['threads']} threads, C++ kernels "
                      f"{info['cpp_isa']}{interp}")
    info["slug"] = "cpu_" + re.sub(r"[^A-Za-z0-9]+", "_", cpu).strip("_")
    return info


# --------------------------------------------------------------------------- CUDA graphs
def graph_seq(opt, params, grads_fixed=None):
    """One IVON-PoCo step as a graph captures it: inner sample, fixed gradients written
    into .grad in place (``grads_fixed``; None: .grad already holds them, e.g. as views of
    the flat gradient buffer), accumulate (grads kept), lazy restore; the same for the
    outer sample; step."""
    def write():
        if grads_fixed is not None:
            for p, g in zip(params, grads_fixed):
                p.grad.copy_(g)

    def seq():
        opt.sample("inner")
        write()
        opt.accumulate(clear_grads=False)
        opt.restore(_lazy=True)
        if opt.correction_active():
            opt.sample("outer")
            write()
            opt.accumulate(clear_grads=False)
            opt.restore(_lazy=True)
        opt.step()
    return seq


def reset_host(opt):
    """After a failed capture or a phase that raised: end any sample left active and drop
    pending sums."""
    if opt._active is not None:
        opt.restore()
    opt._pending.clear((0, 1))


def capture(dev, seq, warm=3):
    """Warm ``seq`` up on a side stream, capture it in a CUDA graph; (replay, None) or
    (None, error).  On the CPU the 'graph' is ``seq`` itself."""
    if dev.type != "cuda":
        for _ in range(warm):
            seq()
        return seq, None
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(warm):
                seq()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            seq()
        torch.cuda.synchronize()
        return g.replay, None
    except Exception as exc:
        try:
            torch.cuda.synchronize()
        except Exception:
            pass
        return None, f"{type(exc).__name__}: {exc}"


# --------------------------------------------------------------------------- inputs
def step_buffers(n, dt, dev, ess=1.0, wd=1e-4, seed=None):
    """The buffers of one bucket's inner step, with plausible values (h near 1)."""
    g = torch.Generator(device=dev).manual_seed(n % 9973 if seed is None else seed)

    def r(scale=1.0, shift=0.0):
        return torch.randn(n, device=dev, generator=g) * scale + shift
    h = 1.0 + 0.1 * torch.rand(n, device=dev, generator=g)
    b = dict(mean=r(), s1=r(0.01), s2=h, g_in=r(), g_o=r(), g_out=r(), h_out=r(0.1, 1.0),
             m_out=r(), sigma_out=torch.rsqrt(ess * (h + wd)))
    b["param"] = b["mean"].to(dt)
    b["ctl"] = torch.tensor([5, 1, 0, 0], device=dev, dtype=torch.int64)
    return b


def step_launcher(ops, b, corr, ess=1.0, wd=1e-4):
    """The step operator of a kernel set (``triton_ops`` or ``cpp_ops``) on ``b``:
    IVON-PoCoMo (correction, shared noise, Hessian correction, debiasing) or plain IVON."""
    from poco_kernels.kernels import common as K
    flags = K.step_flags(K.FAMILY_IVON, CORR=corr, SHARED_NOISE=corr, HESS_CORR=corr,
                         DEBIAS=True)
    # sign_o, inv_n_in, inv_n_o, lr, beta1, beta2, wd, ess, alpha, hess_corr, floor, clip,
    # momentum, dampening, eps, mom_first
    hp = [1.0, 1.0, 1.0 if corr else 0.0, 1e-3, 0.9, 0.99999, wd, ess, 1.0 if corr else 0.0,
          0.01 if corr else 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    args = (b["mean"], b["param"], b["s1"], b["s2"], b["g_in"], None,
            b["g_o"] if corr else None, None,
            b["g_out"] if corr else None, b["h_out"] if corr else None,
            b["m_out"] if corr else None, b["sigma_out"] if corr else None,
            b["ctl"], None, None, [7, 0, 0], hp, flags)
    return lambda: ops.step(*args)


def poco_opt(n, dt, dev, backend, cls="IVONPoCo", seed=3):
    """One parameter of ``n`` elements, its optimizer and a gradient.  ess = 1: the timed
    loops repeat thousands of steps on ONE fixed gradient, and with ess 1e6 (1/sigma =
    1000) IVON-PoCo at Alg. 3 defaults runs to non-finite state in ~100 such steps (the
    README's instability; the reference backend then raises).  With ess = 1 both IVON and
    IVON-PoCo stay finite and h stays within [0.69, 1.24] over 6000 steps (checked on the
    reference, 2**14 elements).  The values do not change the work done."""
    import poco_kernels as pk
    g = torch.Generator(device=dev).manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(n, device=dev, generator=g).to(dt))
    kw = dict(lr=1e-3, ess=1.0, seed=seed, backend=backend)
    opt = getattr(pk, cls)([p], **kw)
    grad = torch.randn(n, device=dev, generator=g).to(dt)
    return p, opt, grad


# --------------------------------------------------------------------------- output
CSV_FIELDS = ["kernel", "provider", "dtype", "size", "median", "p20", "p80", "bytes_per_param",
              "gbps", "pct_of_copy", "timing", "device", "date"]


def write_csv(path, rows, device, date):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:
            bw, fr = r.get("bandwidth_Bps"), r.get("frac_copy")
            w.writerow(dict(kernel=r["kernel"], provider=r["provider"], dtype=r["dtype"],
                            size=r["size"], median=f"{r['median']:.6g}", p20=f"{r['p20']:.6g}",
                            p80=f"{r['p80']:.6g}", bytes_per_param=r.get("bytes_per_param") or "",
                            gbps="" if bw is None else f"{bw / 1e9:.2f}",
                            pct_of_copy="" if fr is None else f"{100 * fr:.1f}",
                            timing=r.get("timing", ""), device=device, date=date))


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, (torch.dtype, torch.device)):
        return str(o)
    return repr(o)


def dump(path, report):
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=_json_default)


def table_lines(rows, copy_bw, title):
    out = [f"{title} (copy bandwidth "
           f"{'n/a' if not copy_bw else f'{copy_bw / 1e9:.1f} GB/s'}; B/p = bytes-per-param "
           f"model; *_wall = host-inclusive)",
           f"{'kernel':20s} {'provider':37s} {'dt':4s} {'size':>9s} {'med ms':>10s} "
           f"{'B/p':>3s} {'GB/s':>6s} {'%copy':>5s}"]
    for r in rows:
        bw, fr = r["bandwidth_Bps"], r["frac_copy"]
        prov = r["provider"].replace("poco_kernels.", "pk.")
        dt = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(r["dtype"], r["dtype"])
        out.append(f"{r['kernel'][:20]:20s} {prov[:37]:37s} {dt[:4]:4s} "
                   f"{r['size']:>9d} {r['median'] * 1e3:>10.4f} {r['bytes_per_param'] or 0:>3d} "
                   f"{'' if bw is None else f'{bw / 1e9:6.1f}':>6s} "
                   f"{'' if fr is None else f'{100 * fr:4.0f}%':>5s}")
    return out


def print_table(rows, copy_bw, title, path=None):
    lines = table_lines(rows, copy_bw, title)
    if path:
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
    log("")
    log("=" * 96)
    for line in lines:
        log(line)
