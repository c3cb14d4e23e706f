"""The only place the benchmarks reach past the optimizers' public API.

Every access to a private attribute or argument of ``poco_kernels``' optimizers is here,
so that a change of the package's internals is followed in one file:

* ``opt._buckets`` and a bucket's ``buffers``, ``param_dtype``, ``numel``, ``params``,
  ``write_params`` (the layout; :func:`perturb_state` moves the state in place);
* ``opt._active`` and ``opt._pending`` (the host's record of the open sample and of the
  collected gradient sums);
* the fused engine's per-call host work (:func:`engine_calls`);
* ending a sample without restoring the mean (``opt._active = None``: what
  ``step(closure)`` does between its samples on the fused backends, whose next sample or
  step overwrites the parameters).
"""
from __future__ import annotations

import ctypes


def bucket_buffer_names(opt, names):
    """Those of ``names`` that the first bucket of ``opt`` holds a buffer for."""
    return [n for n in names if n in opt._buckets[0].buffers]


def bucket_dtypes(opt):
    """The parameter dtype of each bucket."""
    return [b.param_dtype for b in opt._buckets]


def bucket_numels(opt):
    """The number of elements of each bucket."""
    return [b.numel for b in opt._buckets]


def lazy_restore(opt):
    """``restore`` that leaves the sample in the parameters (what ``step(closure)`` does
    between its samples)."""
    opt._active = None


def reset_host(opt):
    """After a failed capture or a phase that raised: end any sample left active and drop
    pending sums."""
    if opt._active is not None:
        opt.restore()
    opt._pending.clear((0, 1))


def perturb_state(opt, rel, gen):
    """Move every float32 number of ``opt``'s state by a random relative amount of at most
    ``rel`` (uniform, from the CPU generator ``gen``), in place: the parameters where they
    hold the mean (float32 buckets), the mean buffer where they do not (low precision),
    and the float32 state buffers.  What a kernel's rounding does to a trajectory at each
    update, at the level ``rel`` (the trajectory parity's sensitivity runs)."""
    import torch

    def move(t):
        if t.dtype != torch.float32 or t.numel() == 0:
            return
        r = torch.rand(t.numel(), generator=gen).to(t.device).view_as(t)
        t.mul_(1.0 + rel * (2.0 * r - 1.0))
    with torch.no_grad():
        for b in opt._buckets:
            if b.param_dtype == torch.float32:
                for p in b.params:
                    move(p.data)
            for name, buf in b.buffers.items():
                if name == "mean" and b.param_dtype == torch.float32:
                    continue           # (the parameters are the mean's truth there)
                move(buf)
            if b.param_dtype != torch.float32:
                b.write_params(b.buffers["mean"])



def engine_calls(opt):
    """The fused engine's per-call host work on ``opt`` as callables
    (``benchmarks/studies/engine_calls.py``): the ``.grad`` hand-out of a sample, the
    check of which views no backward reached (with every one reached), and
    ``accumulate``'s gathering of every bucket's gradients."""
    eng = opt._runner

    def unwritten():
        for b in opt._buckets:        # (every one reached)
            if b.presence is not None:
                ctypes.memset(b.presence.addr, 1, b.presence.n)
        eng.unwritten()

    def gather():
        lent = eng._lent()
        for b in opt._buckets:
            eng._gather_grads(b, lent)[0]
    return {"hand_out": eng.hand_out, "unwritten": unwritten, "gather": gather}


def time_kernels(opt, clock):
    """Route the fused engine's kernel calls of ``opt`` through timers that add the
    seconds spent inside them to ``clock.kernel_s`` (``benchmarks/studies/host_calls.py``:
    a call's time less its kernels' is its host work); the calls it prepares are timed
    when they run, not when they are prepared."""
    import time
    import types
    eng = opt._runner
    ops = eng.ops

    def timed(fn):
        def run(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                clock.kernel_s += time.perf_counter() - t0
        return run

    def prepare(name, args):          # (a call prepared once and replayed: plans, memos)
        fn, bound = ops.prepare(name, args)
        return timed(fn), bound
    eng.ops = types.SimpleNamespace(**{n: timed(getattr(ops, n)) if callable(getattr(ops, n))
                                       else getattr(ops, n) for n in dir(ops)
                                       if not n.startswith("__")})
    if hasattr(ops, "prepare"):
        eng.ops.prepare = prepare
