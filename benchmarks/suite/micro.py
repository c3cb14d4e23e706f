"""Optimizer-step microbenchmarks on one device: every row of ``run.py``'s first section.

Providers (the ``provider`` column):

* ``poco_kernels.<backend>``: this package through its public API, for every backend that
  runs on the device (``cpp`` on the CPU when the extension is built, ``triton`` on CUDA,
  and ``torch``, which calls the reference maths directly, up to ``torch_max_size``);
  ``poco_kernels.<backend>(direct)``: the fused step operator alone, on prepared buffers;
* ``ivon-opt-0.1.3``: ivon-opt's ``IVON``, the published implementation;
* ``torch.AdamW(foreach)``, ``torch.AdamW(fused)``: what most LLM runs use.

Kernels (the ``kernel`` column).  A *phase* row times one phase of a cycle; the phases
before it run untimed first (the ``setup`` of ``timing.Timer``) and those after it untimed
afterwards, so every timed call starts from the state a training loop would give it:

=======================  ==================================================================
``sample_inner``         draw the inner sample into the parameters (ours: ``sample``;
                         ivon-opt: entering ``sampled_params``)
``restore_accumulate``   fold the gradient at the sample into the estimate and put the
                         mean back, with no backward in between (ours: ``accumulate`` +
                         ``restore``; ivon-opt: leaving ``sampled_params(train=True)``)
``ivon_step``            IVON's update alone (``step()`` after one collected sample)
``ivon_cycle``           IVON: sample, gradient, restore, step
``ivon_poco_step``       IVON-PoCoMo's inner step alone (inner and outer gradients
                         collected, correction active): the fused inner-step kernel
``ivon_poco_cycle``      IVON-PoCoMo: inner sample, gradient, outer sample, gradient, step
``refresh_fold``         ``refresh()`` alone: folding the mega-batch gradient into the
                         outer state (g_out, h_out, m_out, sigma_out)
``refresh_cycle``        a refresh: sample, gradient, restore, fold
``step_kernel_poco``     the inner-step operator launched directly (``(direct)``)
``step_kernel_ivon``     IVON's step operator launched directly
``adamw_step``           ``torch.optim.AdamW.step()``
=======================  ==================================================================

There is no model: the gradient is a fixed tensor assigned to ``.grad``, as autograd
would leave it.  Every row carries its bytes-per-parameter model (``byte_models.b_*``).  On
the CPU, rows rotate through copies of their inputs (at least ``rot_bytes`` per round) so
the last-level cache does not flatter small sizes; on CUDA the L2 cache is flushed
before each timed call.
"""
from __future__ import annotations

import math
import time

import torch

from benchmarks.common.byte_models import (b_accumulate_restore, b_adamw, b_gather,
                                           b_ivon_cycle, b_ivonopt_cycle, b_ivonopt_restore,
                                           b_ivonopt_sample, b_ivonopt_step, b_poco_cycle,
                                           b_refresh, b_refresh_kernel, b_sample_inner,
                                           b_step_ivon, b_step_poco)
from benchmarks.common.device import free_bytes
from benchmarks.common.internals import reset_host
from benchmarks.common.report import dtype_name, log
from benchmarks.common.setups import poco_opt, step_buffers, step_launcher
from benchmarks.common.timing import rotation, round_robin
from benchmarks.suite.cuda_graph import capture, graph_seq

IVONOPT = "ivon-opt-0.1.3"
# bytes per parameter the largest set of one row holds (the torch backend's IVON-PoCo
# with its transactional copies), with headroom: sizes beyond free memory / this are skipped
BYTES_PER_PARAM_NEEDED = 200


def default_sizes(dev, lo=20):
    """2**20, 2**22, ... up to the largest power of two whose rows fit in the device's free
    memory (that one appended if odd): 2**26 on a machine with ~23 GB available."""
    cap = int(math.log2(max(2 ** lo, free_bytes(dev) // BYTES_PER_PARAM_NEEDED)))
    sizes = [2 ** k for k in range(lo, cap + 1, 2)]
    if sizes[-1] != 2 ** cap:
        sizes.append(2 ** cap)
    return sizes


def kernel_backends(dev):
    """The fused backends that run on ``dev``: ``cpp`` (CPU, extension built) or
    ``triton`` (CUDA, or the CPU under ``TRITON_INTERPRET=1``)."""
    from poco_kernels.kernels import cpp_status, triton_status
    out = []
    if dev.type == "cpu" and cpp_status() is None:
        out.append("cpp")
    if triton_status(dev) is None:
        out.append("triton")
    return out


class Phases:
    """Instances (opt, p, grad) cycled round-robin, each driven through its own list of
    phases (``phases_of(opt, p, grad)``: callables with no arguments).  ``timed(i)``
    gives (fn, setup) for ``Timer``: the setup finishes the previous instance's cycle
    (phases after ``i``), takes the next instance and runs phases before ``i``; fn runs
    phase ``i``."""

    def __init__(self, items, phases_of):
        self.items = items
        self.phases = [phases_of(*it) for it in items]
        self.n, self.cur, self.tail = 0, None, []

    def _next(self):
        k = self.n % len(self.items)
        self.n += 1
        return self.phases[k]

    def finish(self):
        for ph in self.tail:
            ph()
        self.tail = []

    def timed(self, i):
        def setup():
            self.finish()
            self.cur = self._next()
            for ph in self.cur[:i]:
                ph()
            self.tail = self.cur[i + 1:]
        return (lambda: self.cur[i]()), setup

    def cycle(self):
        """fn for the whole cycle on the next instance (no setup)."""
        def fn():
            for ph in self._next():
                ph()
        return fn


def _grad_phase(p, grad):
    p.grad = grad


def ours_ivon(opt, p, grad):
    return [lambda: opt.sample("inner"),
            lambda: (_grad_phase(p, grad), opt.accumulate(), opt.restore()),
            lambda: opt.step()]


def ours_poco(opt, p, grad):
    def collect(kind):
        def ph():
            with opt.sampled(kind):
                p.grad = grad
        return ph
    return [collect("inner"), collect("outer"), lambda: opt.step()]


def ours_refresh(opt, p, grad):
    def collect():
        with opt.sampled("refresh"):
            p.grad = grad
    return [collect, lambda: opt.refresh()]


def ivonopt_phases(opt, p, grad):
    cm = {}

    def sample():
        cm["cm"] = opt.sampled_params(train=True)
        cm["cm"].__enter__()

    def restore():
        p.grad = grad
        cm.pop("cm").__exit__(None, None, None)
    return [sample, restore, lambda: opt.step()]


def _instances(k, make, phases_of):
    """``k`` instances from ``make(i)`` -> (opt, p, grad), driven by ``phases_of``."""
    return Phases([make(i) for i in range(k)], phases_of)


def _poco_ready(opt, p, grad):
    """Correction active: one refresh."""
    with opt.sampled("refresh"):
        p.grad = grad
    opt.refresh()


IVON_PHASES = ("sample_inner", "restore_accumulate", "ivon_step")


def _ivon_rows(B, timer, ph, prov, dt, size, bpps):
    """IVON's three phase rows and its cycle, for ours and ivon-opt alike; ``bpps``: the
    byte models of the phases and of the cycle."""
    for i, name in enumerate(IVON_PHASES):
        fn, setup = ph.timed(i)
        B.add(name, prov, dt, size, timer(fn, setup=setup), bpps[i])
        ph.finish()
    B.add("ivon_cycle", prov, dt, size, timer(ph.cycle()), bpps[3])


def bench_size(B, timer, dev, size, dt, backends, ivon_mod, rot_bytes, with_torch):
    """All rows at one (size, dtype)."""
    P = torch.tensor([], dtype=dt).element_size()
    cpu = dev.type == "cpu"
    rot = (lambda bpp: rotation(bpp * size, rot_bytes)) if cpu else (lambda bpp: 1)
    tag = f"{size}/{dtype_name(dt)}"

    for backend in [b for b in backends if b != "torch"]:
        def direct(backend=backend):
            from poco_kernels.kernels import ops_for
            ops = ops_for(backend)
            for corr, name, bpp in ((True, "step_kernel_poco", b_step_poco(P)),
                                    (False, "step_kernel_ivon", b_step_ivon(P))):
                sets = [step_buffers(size, dt, dev, seed=i) for i in range(rot(bpp))]
                fn = round_robin([step_launcher(ops, b, corr=corr) for b in sets])
                B.add(name, f"poco_kernels.{backend}(direct)", dt, size, timer(fn), bpp)
                del sets, fn
        B.run(f"{backend} direct step kernels {tag}", direct)

    for backend in backends + (["torch"] if with_torch and "torch" not in backends else []):
        prov = f"poco_kernels.{backend}"

        def ivon_rows(backend=backend, prov=prov):
            def make(i):
                p, opt, grad = poco_opt(size, dt, dev, backend, cls="IVON", seed=3 + i)
                return opt, p, grad
            ph = _instances(rot(b_ivon_cycle(P)), make, ours_ivon)
            _ivon_rows(B, timer, ph, prov, dt, size,
                       (b_sample_inner(P, P == 4), b_accumulate_restore(P), b_step_ivon(P),
                        b_ivon_cycle(P)))
        B.run(f"{backend} IVON {tag}", ivon_rows)

        def poco_rows(backend=backend, prov=prov):
            def make(i):
                p, opt, grad = poco_opt(size, dt, dev, backend, cls="IVONPoCo", seed=3 + i)
                _poco_ready(opt, p, grad)
                return opt, p, grad
            k = rot(b_poco_cycle(P, "sampled"))
            ph = _instances(k, make, ours_poco)
            fn, setup = ph.timed(2)
            B.add("ivon_poco_step", prov, dt, size, timer(fn, setup=setup), b_step_poco(P))
            ph.finish()
            B.add("ivon_poco_cycle", prov, dt, size, timer(ph.cycle()),
                  b_poco_cycle(P, "sampled"))
            rf = Phases(ph.items, ours_refresh)
            fn, setup = rf.timed(1)
            B.add("refresh_fold", prov, dt, size, timer(fn, setup=setup), b_refresh_kernel(P))
            rf.finish()
            B.add("refresh_cycle", prov, dt, size, timer(rf.cycle()),
                  b_refresh(P) + b_gather(P))
            if dev.type == "cuda" and backend == "triton":
                triton_extras(B, timer, dev, size, dt, *ph.items[0])
        B.run(f"{backend} IVON-PoCoMo {tag}", poco_rows)

    def ivonopt_rows():
        if ivon_mod is None:
            return

        def make(i):
            g = torch.Generator(device=dev).manual_seed(2 + i)
            p = torch.nn.Parameter(torch.randn(size, device=dev, generator=g).to(dt))
            grad = torch.randn(size, device=dev, generator=g).to(dt)
            return ivon_mod.IVON([p], lr=1e-3, ess=1.0), p, grad
        ph = _instances(rot(b_ivonopt_cycle(P)), make, ivonopt_phases)
        _ivon_rows(B, timer, ph, IVONOPT, dt, size,
                   (b_ivonopt_sample(P), b_ivonopt_restore(P), b_ivonopt_step(P),
                    b_ivonopt_cycle(P)))
    B.run(f"ivon-opt {tag}", ivonopt_rows)

    def adamw_rows():
        for flag in ("foreach", "fused"):
            opts = []
            for i in range(rot(b_adamw(P))):
                g = torch.Generator(device=dev).manual_seed(1 + i)
                p = torch.nn.Parameter(torch.randn(size, device=dev, generator=g).to(dt))
                p.grad = torch.randn(size, device=dev, generator=g).to(dt)
                opts.append(torch.optim.AdamW([p], lr=1e-3, **{flag: True}))
            B.add("adamw_step", f"torch.AdamW({flag})", dt, size,
                  timer(round_robin([o.step for o in opts])), b_adamw(P))
            del opts
    B.run(f"adamw {tag}", adamw_rows)


def triton_extras(B, timer, dev, size, dt, opt, p, grad):
    """CUDA only: what the Triton backend costs without host overhead and without the
    gather copy (the gradients reach ``.grad``, the views of the engine's flat gradient
    buffer, through autograd: the backward pass of ``sum(p * grad)``), through a CUDA
    graph, and host-inclusive (``*_wall``).  The backward pass's own time is in these
    rows (2 elementwise passes per gradient)."""
    P = torch.tensor([], dtype=dt).element_size()
    prov = "poco_kernels.triton"

    def backward():
        (p * grad).sum().backward()
    flat = graph_seq(opt, backward)
    B.add("ivon_poco_cycle", prov + "(flat-grads)", dt, size, timer(flat),
          b_poco_cycle(P, "flat"))
    B.add("ivon_poco_cycle_wall", prov + "(flat-grads)", dt, size, timer.wall(flat),
          b_poco_cycle(P, "flat"), wall=True)
    closure = lambda: opt.step(lambda: setattr(p, "grad", grad))  # noqa: E731
    B.add("ivon_poco_cycle_wall", prov + "(closure)", dt, size, timer.wall(closure),
          b_poco_cycle(P, "closure"), wall=True)
    replay, err = capture(dev, graph_seq(opt, backward))
    if err is not None:
        reset_host(opt)
        B.errors.append(f"graph capture {size}/{dtype_name(dt)}: {err}")
        return
    B.add("ivon_poco_cycle", prov + "(flat-grads,cuda-graph)", dt, size, timer(replay),
          b_poco_cycle(P, "flat"))


def run(B, timer, dev, sizes, dtypes, ivon_mod, torch_max_size, rot_bytes, backends=None,
        deadline=math.inf, flush=lambda rows: None):
    """Every row at every (size, dtype) for ``backends`` (default: the fused ones that run
    on ``dev``, and ``torch`` up to ``torch_max_size``); past ``deadline``
    (perf_counter seconds) the remaining blocks are skipped with a note in ``B.errors``."""
    backends = kernel_backends(dev) + ["torch"] if backends is None else list(backends)
    with_torch = "torch" in backends
    backends = [b for b in backends if b != "torch"]
    log(f"  backends: {backends + (['torch (up to %d)' % torch_max_size] if with_torch else [])}; "
        f"ivon-opt {'yes' if ivon_mod else 'no'}")
    for size in sizes:
        need = BYTES_PER_PARAM_NEEDED * size
        if free_bytes(dev) < need:
            B.errors.append(f"size {size}: skipped, {free_bytes(dev) / 2 ** 30:.1f} GiB free "
                            f"< {need / 2 ** 30:.1f} GiB")
            log("  " + B.errors[-1])
            continue
        for dt in dtypes:
            if time.perf_counter() > deadline:
                B.errors.append(f"size {size} {dtype_name(dt)}: skipped, time budget spent")
                log("  " + B.errors[-1])
                continue
            log(f"  -- size {size}, {dtype_name(dt)}")
            bench_size(B, timer, dev, size, dt, backends, ivon_mod, rot_bytes,
                       with_torch=with_torch and size <= torch_max_size)
            flush(B.rows)
    return B
