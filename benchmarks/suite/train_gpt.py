"""Training-step cost on a small GPT: how much of an iteration is spent outside forward
and backward, for AdamW, ivon-opt's IVON, this package's IVON and its IVON-PoCoMo.

The model is ``poco_kernels.experiments.gpt`` (GPT-2 layout); the data are random tokens
(the cost does not depend on them).  Each optimizer gets the same freshly initialised
model and runs the loop a user would write:

* ``AdamW`` (``torch.optim.AdamW``, fused where the device has it): zero_grad, forward,
  backward, ``step()``: one gradient evaluation per iteration;
* ``IVON`` (ivon-opt 0.1.3): forward and backward inside ``sampled_params(train=True)``,
  then ``step()``: one evaluation;
* ``IVON`` (ours): ``step(closure)``: one evaluation;
* ``IVON-PoCoMo`` (ours) on the paper's GPT schedule (Sec. 5, nanoGPT): a refresh on a
  mega-batch of ``mega`` mini-batches every ``refresh_every`` inner steps, each inner step
  evaluating the mini-batch at the inner and the outer sample.  One *iteration* is
  (one refresh + ``refresh_every`` inner steps) / ``refresh_every``: by design
  ``2 + mega / refresh_every`` evaluations (3 with the paper's 10 and 10).

Every forward + backward is timed on its own (the device synchronised before and after),
inside the optimizer's own loop; what remains of the iteration is *outside forward /
backward*: the optimizer's sampling, restores, gradient accumulation, update and host
work.  Reported per optimizer: evaluations per iteration, iteration time, time in forward
/ backward, time outside, and that as a share of the iteration (medians over the timed
iterations, after warm-up).  Hyperparameters are the paper's GPT-2 ones (IVON: lr 0.3,
ess 1e10, hess_init 1e-3, beta2 0.99999, clip_radius 1e-3; PoCoMo: rho1 0.6, rho2 0.1;
AdamW: lr 6e-4, weight decay 0.1); they do not change the work done.
"""
from __future__ import annotations

import statistics
import time

import torch

from benchmarks.common.device import release, sync
from benchmarks.common.report import log
from benchmarks.common.timing import quantiles

PAPER_IVON = dict(lr=0.3, ess=1e10, hess_init=1e-3, beta1=0.9, beta2=0.99999,
                  weight_decay=1e-4, clip_radius=1e-3)


def default_preset(dev):
    return "gpt2-124m" if dev.type == "cuda" else "gpt-tiny"


class Runner:
    def __init__(self, dev, preset, batch, seq=None, amp=None, seed=0, n_batches=8):
        from poco_kernels.experiments.gpt import PRESETS
        self.dev, self.preset, self.cfg = dev, preset, PRESETS[preset]
        self.seq = seq or self.cfg.block_size
        self.batch, self.seed = batch, seed
        self.amp = (dev.type == "cuda") if amp is None else amp
        g = torch.Generator().manual_seed(seed)
        self.data = [torch.randint(self.cfg.vocab_size, (batch, self.seq + 1), generator=g)
                     .to(dev) for _ in range(n_batches)]
        self.k = 0
        self.fb_times = []

    def model(self):
        from poco_kernels.experiments.gpt import GPT
        torch.manual_seed(self.seed)
        return GPT(self.cfg).to(self.dev)

    def next_batch(self):
        b = self.data[self.k % len(self.data)]
        self.k += 1
        return b

    def fwd_bwd(self, model, zero=None):
        """One timed forward + backward on the next batch (``zero``: zero_grad first,
        inside the timed region, as autograd's accumulation needs it)."""
        b = self.next_batch()
        sync(self.dev)
        t0 = time.perf_counter()
        if zero is not None:
            zero()
        with torch.autocast(self.dev.type, dtype=torch.bfloat16, enabled=self.amp):
            _, loss = model(b[:, :-1], b[:, 1:])
        loss.backward()
        sync(self.dev)
        self.fb_times.append(time.perf_counter() - t0)
        return loss.detach()

    def measure(self, iteration, warmup, iters):
        """Per timed iteration: (total seconds, seconds inside forward/backward)."""
        for _ in range(warmup):
            iteration()
        out = []
        for _ in range(iters):
            self.fb_times = []
            sync(self.dev)
            t0 = time.perf_counter()
            iteration()
            sync(self.dev)
            out.append((time.perf_counter() - t0, sum(self.fb_times), len(self.fb_times)))
        return out


def loops(R, ivon_mod, refresh_every, mega):
    """(name, provider, make(model) -> (iteration, inner steps per iteration))."""
    import poco_kernels as pk

    def adamw(model):
        try:
            opt, prov = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1,
                                          fused=True), "fused"
        except Exception:
            opt, prov = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1,
                                          foreach=True), "foreach"

        def it():
            R.fwd_bwd(model, zero=lambda: opt.zero_grad(set_to_none=True))
            opt.step()
        return it, 1, f"torch.AdamW({prov})"

    def ivonopt(model):
        opt = ivon_mod.IVON(model.parameters(), **PAPER_IVON)

        def it():
            with opt.sampled_params(train=True):
                R.fwd_bwd(model, zero=lambda: opt.zero_grad(set_to_none=True))
            opt.step()
        return it, 1, "ivon-opt-0.1.3"

    def ours_ivon(model):
        opt = pk.IVON(model.parameters(), **PAPER_IVON)
        closure = lambda: R.fwd_bwd(model, zero=lambda: opt.zero_grad(set_to_none=True))  # noqa

        def it():
            opt.step(closure)
        return it, 1, f"poco_kernels.{opt.backend}"

    def ours_poco(model):
        opt = pk.IVONPoCo(model.parameters(), alpha=1.0, rho1=0.6, rho2=0.1, **PAPER_IVON)
        closure = lambda: R.fwd_bwd(model, zero=lambda: opt.zero_grad(set_to_none=True))  # noqa

        def it():
            opt.refresh([closure] * mega)
            for _ in range(refresh_every):
                opt.step(closure)
        return it, refresh_every, f"poco_kernels.{opt.backend}"

    out = [("AdamW", adamw)]
    if ivon_mod is not None:
        out.append(("IVON", ivonopt))
    out += [("IVON", ours_ivon), ("IVON-PoCoMo", ours_poco)]
    return out


def run(dev, ivon_mod, preset=None, batch=None, seq=None, warmup=2, iters=5,
        refresh_every=10, mega=10):
    """Rows: one per optimizer, times per iteration (see the module docstring)."""
    preset = preset or default_preset(dev)
    batch = batch or 8
    R = Runner(dev, preset, batch, seq)
    model = R.model()
    numel = model.num_params()
    log(f"  model {preset}: {numel / 1e6:.2f}M parameters, batch {batch} x {R.seq} tokens, "
        f"{'bf16 autocast' if R.amp else 'float32'}")
    # forward + backward alone: the yardstick
    base = R.measure(lambda: R.fwd_bwd(model, zero=lambda: model.zero_grad(set_to_none=True)),
                     warmup, iters)
    fb_alone = statistics.median(t for t, _, _ in base)
    log(f"  forward + backward alone: {fb_alone * 1e3:.2f} ms")
    del model
    rows = [dict(optimizer="(forward + backward alone)", provider="torch", numel=numel,
                 preset=preset, evals_per_iter=1, iter_s=fb_alone, fwd_bwd_s=fb_alone,
                 outside_s=0.0, outside_share=0.0, iter_p20_s=quantiles([t for t, _, _ in base])[1],
                 iter_p80_s=quantiles([t for t, _, _ in base])[2])]
    for name, make in loops(R, ivon_mod, refresh_every, mega):
        try:
            model = R.model()
            it, per, provider = make(model)
            # PoCoMo's iteration is a whole period: fewer of them
            n_w, n_i = (max(1, warmup // 2), max(3, iters // 2)) if per > 1 else (warmup, iters)
            m = R.measure(it, n_w, n_i)
            totals = [t / per for t, _, _ in m]
            fbs = [f / per for _, f, _ in m]
            outs = [t - f for t, f in zip(totals, fbs)]
            med, p20, p80 = quantiles(totals)
            row = dict(optimizer=name, provider=provider, numel=numel, preset=preset,
                       evals_per_iter=m[0][2] / per, iter_s=med, iter_p20_s=p20, iter_p80_s=p80,
                       fwd_bwd_s=statistics.median(fbs), outside_s=statistics.median(outs),
                       outside_p20_s=quantiles(outs)[1], outside_p80_s=quantiles(outs)[2])
            row["outside_share"] = row["outside_s"] / med
            rows.append(row)
            log(f"  {name:12s} {provider:26s} {row['evals_per_iter']:.1f} evals/iter: iteration "
                f"{med * 1e3:8.2f} ms, fwd/bwd {row['fwd_bwd_s'] * 1e3:8.2f} ms, outside "
                f"{row['outside_s'] * 1e3:7.2f} ms ({100 * row['outside_share']:.1f}%)")
        except Exception as exc:
            rows.append(dict(optimizer=name, provider="?", numel=numel, preset=preset,
                             error=f"{type(exc).__name__}: {exc}"))
            log(f"  {name}: ERROR {rows[-1]['error']}")
        finally:
            model = None
            release(dev)
    return rows
