"""End-to-end pretraining throughput: the package's GPT pretraining loop
(``poco_kernels.experiments.pretrain``) for a few hundred steps with AdamW (fused on
CUDA), ivon-opt's IVON, our IVON and our IVON-PoCoMo, on the real data pipeline.

Per optimizer, over the steps after the first tenth (IVON-PoCoMo: over its corrected
steps, refreshes included): tokens per second (mini-batch tokens per second of wall
time, the training throughput users compare: IVON-PoCoMo's extra gradient evaluations
cost it here by design), all tokens forwarded and backwarded per second, the step time
(median, p20, p80; a PoCoMo step that refreshes is an outlier above p80), the share of
the time spent outside forward/backward (data, optimizer, logging; each forward/backward
timed with the device synchronised on both sides), and the validation loss at the start
and the end.

Defaults: CUDA, the paper's GPT-2 124M with bf16 autocast, 16 x 1024 tokens per step,
200 steps; CPU, ``gpt-tiny`` on 16 x 128, 60 steps.  IVON-PoCoMo
is corrected from a third of the steps on (refresh every 10 steps on 10 mini-batches,
the paper's schedule), so its rows mix IVON steps and corrected ones.  The data are the ``stdlib`` corpus (byte-level Python source).
"""
from __future__ import annotations

import os
import tempfile

from benchmarks.common.device import release
from benchmarks.common.report import log
from benchmarks.common.timing import quantiles


def defaults(dev):
    if dev.type == "cuda":
        return dict(preset="gpt2-124m", batch=16, micro=16, steps=200)
    return dict(preset="gpt-tiny", batch=16, micro=16, steps=60)


def run(dev, ivon_mod, preset=None, batch=None, micro=None, steps=None, poco_start=None):
    """Rows, one per optimizer (module docstring).  IVON-PoCoMo is corrected from
    ``poco_start`` (default: a third of the steps)."""
    from poco_kernels.experiments import pretrain as P
    from poco_kernels.experiments.gpt import PRESETS
    from poco_kernels.experiments.lm_data import load_tokens
    d = defaults(dev)
    preset, batch = preset or d["preset"], batch or d["batch"]
    micro, steps = micro or min(d["micro"], batch), steps or d["steps"]
    poco_start = steps // 3 if poco_start is None else poco_start
    data = load_tokens("stdlib")
    vocab = max(PRESETS[preset].vocab_size, data.vocab_size)
    names = ["adamw"] + (["ivon-opt"] if ivon_mod is not None else []) + ["ivon", "ivon-pocomo"]
    rows = []
    for name in names:
        try:
            with tempfile.TemporaryDirectory() as tmp:
                cfg = P.resolve_config(
                    name, "gpt2" if dev.type == "cuda" else "cpu", preset=preset,
                    vocab_size=vocab, batch_size=batch, micro_batch=micro, max_steps=steps,
                    lr_warmup=max(1, steps // 10), poco_start=poco_start, eval_every=steps,
                    eval_batches=2, log_every=1, ckpt_every=10 ** 9, time_split=True,
                    device=str(dev), quiet=True, out_dir=os.path.join(tmp, name))
                t = P.Trainer(cfg, data=data)
                provider = _provider(t.opt, name)
                s = t.train()
                hist = [r for r in t.history if r.get("step_ms")]
                steady = hist[max(1, len(hist) // 10):]
                if name == "ivon-pocomo":       # the corrected phase (before it: IVON)
                    steady = [r for r in hist if r["step"] > poco_start]
                dts = [r["step_ms"] / 1e3 for r in steady]
                med, p20, p80 = quantiles(dts)
                wall = sum(dts)
                share = sum(r["opt_share"] * dt for r, dt in zip(steady, dts)) / wall
                all_tok = sum(r["all_tok_s"] * dt for r, dt in zip(steady, dts))
                rows.append(dict(
                    optimizer=name, provider=provider, preset=preset, numel=s["params"],
                    dtype="bf16-autocast" if t.amp else "float32", batch=batch, seq=t.seq,
                    steps=steps, poco_start=poco_start,
                    tok_s=len(steady) * batch * t.seq / wall, all_tok_s=all_tok / wall,
                    step_s=med, step_p20_s=p20, step_p80_s=p80, outside_share=share,
                    val_first=s["val_loss_first"], val_last=s["val_loss"], wall_s=s["wall_s"]))
                log(f"  {name:12s} {provider:24s} {rows[-1]['tok_s']:>10,.0f} tok/s, step "
                    f"{med * 1e3:8.2f} ms, outside fwd/bwd {100 * share:5.1f}%, val "
                    f"{s['val_loss_first']:.3f} -> {s['val_loss']:.3f}")
                del t
        except Exception as exc:           # the others still run
            rows.append(dict(optimizer=name, provider="?", preset=preset,
                             error=f"{type(exc).__name__}: {exc}"))
            log(f"  {name}: ERROR {rows[-1]['error']}")
        finally:
            release(dev)
    return rows


def _provider(opt, name):
    if name == "adamw":
        return "torch.AdamW(fused)" if opt.defaults.get("fused") else "torch.AdamW(foreach)"
    if name == "ivon-opt":
        return "ivon-opt-0.1.3"
    return f"poco_kernels.{opt.backend}"

