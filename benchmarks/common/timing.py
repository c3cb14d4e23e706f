"""How the benchmarks time: ``Timer`` (CUDA events with the L2 cache flushed before each
call, or ``time.perf_counter`` on the CPU), the rotation of inputs that keeps caches from
flattering small sizes, and the two bandwidth measurements every row is set against
(``torch.Tensor.copy_``, the ceiling, and on the CPU ``a.add_(b)``)."""
from __future__ import annotations

import math
import statistics
import time

import torch

from benchmarks.common.device import release, sync


def quantiles(ts):
    """(median, p20, p80) of ``ts``."""
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
        return quantiles(ts)

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
        return quantiles([s.elapsed_time(e) * 1e-3 for s, e in pairs])

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
        return quantiles(per)


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
    second yardstick beside the copy: on a CPU a copy's destination lines are read before
    they are written (12 bytes move for the 8 the copy model counts), while an in-place
    update writes lines it has just read, as the optimizers' kernels mostly do."""
    n = nbytes // 4
    bufs = [torch.randn(n, device=dev), torch.randn(n, device=dev)]
    med, p20, p80 = timer(lambda: bufs[0].add_(bufs[1]))
    bufs.clear()
    release(dev)
    return {"bytes_each_way": n * 4, "median_s": med, "p20_s": p20, "p80_s": p80,
            "bandwidth_Bps": 3 * n * 4 / med}
