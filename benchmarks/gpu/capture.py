"""CUDA-graph capture and torch.compile of a training loop on the Triton backend
(``bench_gpu.py``'s capture section).

* **Graph**: one whole inner iteration of IVON-PoCoMo (the inner sample, forward and
  backward, accumulation, the outer sample and its backward, the step) captured in one
  CUDA graph, and a refresh (two chunks) in another; replayed ``steps`` times with a
  ``LambdaLR`` moving a tensor ``lr`` and a tensor ``alpha`` filled every step, a refresh
  every fifth step and a new mini-batch copied into the static input each time, against
  a twin optimizer running the same steps eagerly: equal bit for bit (parameters, every
  state buffer, the counters).
* **Compile**: ``torch.compile`` of a step function calling ``opt.step(closure)`` around a
  compiled model, the learning rate moved by a scheduler every step: it runs, and after
  the first steps nothing is compiled again (``torch._dynamo.config.error_on_recompile``).

On the CPU (``--smoke``) the 'graph' is the same calls run eagerly (what the capture
would record), so the section's code runs in CI.
"""
from __future__ import annotations

import copy
import time

import torch

import poco_kernels as pk
from benchmarks.common.device import release, sync
from benchmarks.common.report import log


def _setup(dev, smoke, seed=0):
    """A small MLP, a fixed data set, and IVON-PoCoMo on it with tensor ``lr`` and ``alpha``
    (float64, so the schedules move them as floats) and an lr scheduler."""
    g = torch.Generator().manual_seed(seed)
    width = 64 if smoke else 1024
    model = torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.Tanh(),
                                torch.nn.Linear(width, 10)).to(dev)
    data = (torch.randn(512, 32, generator=g).to(dev), torch.randint(0, 10, (512,),
                                                                     generator=g).to(dev))
    return model, data


def _optimizer(model, dev):
    f64 = dict(dtype=torch.float64, device=dev)
    opt = pk.IVONPoCoMo(model.parameters(), lr=torch.tensor(0.05, **f64), ess=512.0,
                        alpha=torch.tensor(0.6, **f64), backend="triton", seed=7)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1.0 + 0.05 * t))
    return opt, sched


class Loop:
    """A model, its optimizer and static inputs; ``iteration`` and ``refresh`` are what a
    graph captures."""

    def __init__(self, model, dev, data):
        self.model, self.data = model, data
        self.opt, self.sched = _optimizer(model, dev)
        self.x = torch.empty(32, 32, device=dev)
        self.y = torch.empty(32, dtype=torch.int64, device=dev)
        self.cx = torch.empty(2, 64, 32, device=dev)
        self.cy = torch.empty(2, 64, dtype=torch.int64, device=dev)

    def loss(self, x, y):
        return torch.nn.functional.cross_entropy(self.model(x), y)

    def batch(self, t):
        idx = (torch.arange(32, device=self.x.device) * 7 + 13 * t) % 512
        self.x.copy_(self.data[0][idx])
        self.y.copy_(self.data[1][idx])
        cidx = (torch.arange(128, device=self.x.device) * 3 + 5 * t) % 512
        self.cx.copy_(self.data[0][cidx].view(2, 64, 32))
        self.cy.copy_(self.data[1][cidx].view(2, 64))

    def iteration(self):
        opt = self.opt
        with opt.sampled("inner"):
            self.loss(self.x, self.y).backward()
        if opt.correction_active():
            with opt.sampled("outer"):
                self.loss(self.x, self.y).backward()
        opt.step()

    def refresh(self):
        opt = self.opt
        with opt.sampled("refresh", accumulate=False):
            for k in range(2):
                self.loss(self.cx[k], self.cy[k]).backward()
                opt.accumulate()
        opt.refresh()

    def state(self):
        out = [p.detach().clone() for p in self.model.parameters()]
        for name in ("mean", "h", "momentum", "g_out", "h_out", "m_out", "sigma_out"):
            out += [t.clone() for t in self.opt.flat_state(name)]
        return out


def _warm(loop, t0=0):
    """Three iterations, a refresh, three iterations: the steady state."""
    for t in range(t0, t0 + 7):
        loop.batch(t)
        if t == t0 + 3:
            loop.refresh()
        else:
            loop.iteration()
        loop.sched.step()


def check_graph(dev, smoke, steps=None):
    """Capture an iteration and a refresh; replay ``steps`` steps against an eager twin."""
    res, failures = {}, []
    steps = steps or (6 if smoke else 20)
    torch.manual_seed(0)
    model, data = _setup(dev, smoke)
    twin_model = copy.deepcopy(model)
    a, b = Loop(model, dev, data), Loop(twin_model, dev, data)
    t0 = time.perf_counter()
    if dev.type == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _warm(a)
        torch.cuda.current_stream().wait_stream(side)
        sync(dev)
        g_it, g_rf = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g_it):
                a.iteration()
            with torch.cuda.graph(g_rf):
                a.refresh()
        except Exception as exc:
            res["capture"] = f"FAILED: {type(exc).__name__}: {exc}"
            failures.append(f"graph: capture failed: {exc}")
            return res, failures
        replay_it, replay_rf = g_it.replay, g_rf.replay
        res["capture"] = "ok"
    else:
        _warm(a)
        replay_it, replay_rf = a.iteration, a.refresh
        res["capture"] = "skipped on the CPU (the captured calls run eagerly)"
    _warm(b)
    for t in range(7, 7 + steps):
        for loop, it, rf in ((a, replay_it, replay_rf), (b, b.iteration, b.refresh)):
            loop.batch(t)
            loop.opt.param_groups[0]["alpha"].fill_(0.5 + 0.01 * (t % 7))   # an alpha schedule
            if t % 5 == 0:
                rf()
            it()
            loop.sched.step()
    sync(dev)
    sa, sb = a.state(), b.state()
    diff = [i for i, (x, y) in enumerate(zip(sa, sb)) if not torch.equal(x, y)]
    ca, cb = a.opt._runner.counters(), b.opt._runner.counters()
    res.update(replay_steps=steps, tensors_compared=len(sa), tensors_differing=len(diff),
               counters={"graph": ca, "eager": cb},
               lr_last=float(b.opt.param_groups[0]["lr"]), seconds=time.perf_counter() - t0)
    if diff or ca != cb:
        res["replay"] = "MISMATCH"
        failures.append(f"graph: replay differs from eager in {len(diff)} of {len(sa)} "
                        f"tensors; counters graph {ca} eager {cb}")
    else:
        res["replay"] = "bitwise equal to eager"
    log(f"    graph: capture {res['capture']}; replay of {steps} steps (lr scheduled, "
        f"refresh every 5): {res['replay']}; counters {ca}")
    del a, b, model, twin_model
    release(dev)
    return res, failures


def check_compile(dev, smoke, steps=5):
    """``torch.compile`` (inductor on a GPU) of a step calling ``opt.step(closure)`` around
    a compiled model, lr moved every step: no compilation after the first steps."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    res, failures = {}, []
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model, data = _setup(dev, smoke)
    backend = "inductor" if dev.type == "cuda" else "eager"
    net = torch.compile(model, backend=backend)
    opt = pk.IVONPoCoMo(model.parameters(), lr=0.05, ess=512.0, alpha=0.6, backend="triton")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)

    @torch.compile(backend=backend)
    def train_step(x, y):
        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x), y)
            loss.backward()
            return loss
        return opt.step(closure) * 1.0

    t0 = time.perf_counter()
    saved = torch._dynamo.config.error_on_recompile
    try:
        for t in range(steps):
            x, y = data[0][32 * t:32 * t + 32], data[1][32 * t:32 * t + 32]
            if t == 1:
                opt.refresh([lambda: (opt.zero_grad(), torch.nn.functional.cross_entropy(
                    net(x), y).backward())[0]])
            if t == 3:
                torch._dynamo.config.error_on_recompile = True
            loss = train_step(x, y)
            sched.step()
        sync(dev)
        res.update(backend=backend, steps=steps, loss=float(loss.detach()),
                   graphs=counters["stats"]["unique_graphs"], recompiled=False)
    except Exception as exc:
        res.update(backend=backend, error=f"{type(exc).__name__}: {exc}"[:500])
        failures.append(f"compile: {exc}"[:300])
    finally:
        torch._dynamo.config.error_on_recompile = saved
        torch._dynamo.reset()
    res["seconds"] = time.perf_counter() - t0
    log(f"    compile ({backend}): {res.get('error') or 'ran, no recompilation after step 3'} "
        f"({res['seconds']:.1f} s)")
    release(dev)
    return res, failures
