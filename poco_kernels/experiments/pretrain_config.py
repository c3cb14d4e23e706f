"""The pretraining run's settings: the paper's recipes, :class:`RunConfig` and its checks,
the learning-rate and alpha schedules, and the command-line flags of
``python -m poco_kernels.experiments.pretrain`` (every setting has one)."""
from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, fields, replace
from typing import Any, Dict, Optional

import torch

from .gpt import PRESETS

__all__ = ["OPTIMIZERS", "IVON_FAMILY", "PAPER_IVON", "PAPER_ADAMW", "RECIPES", "RunConfig",
           "resolve_config", "validate_config", "parse_alpha", "lr_at", "alpha_at",
           "build_parser"]

OPTIMIZERS = ("adamw", "ivon", "ivon-pocomo", "ivon-opt")
IVON_FAMILY = ("ivon", "ivon-pocomo", "ivon-opt")

# --------------------------------------------------------------------------- recipes
#: The paper's GPT-2 hyperparameters (App., pretraining).  ``rescale_lr=False``: with
#: ivon-opt's default rescaling, lr 0.3 and clip 1e-3 would cap a step at
#: 0.3 (1e-3 + 1e-4) 1e-3 = 3.3e-7 per coordinate
#: (docs/pretraining.md, 'Decisions on what the paper leaves open').
PAPER_IVON = dict(lr=0.3, ess=1e10, hess_init=1e-3, beta1=0.9, beta2=0.99999,
                  weight_decay=1e-4, clip_radius=1e-3, rescale_lr=False)
PAPER_ADAMW = dict(lr=6e-4, beta1=0.9, beta2=0.95, weight_decay=0.1, grad_clip=1.0)

RECIPES: Dict[str, Dict[str, Any]] = {
    # a CPU run of a few minutes: 0.9M parameters on byte-level Python source
    "cpu": dict(preset="gpt-tiny", batch_size=16, micro_batch=16, max_steps=200,
                lr_warmup=20, min_lr_ratio=0.1, poco_start=100, refresh_every=10,
                mega_batches=10, alpha="0.7", rho1=0.6, rho2=0.1, eval_every=50,
                eval_batches=4, log_every=10, ckpt_every=100,
                opt={"adamw": dict(PAPER_ADAMW, lr=3e-3), "ivon": PAPER_IVON}),
    # Sec. 5.2: GPT-2 124M, batch 480 x 1024, 100k steps, correction from step 50k with
    # a 10x mega-batch every 10 steps, rho1 0.6, rho2 0.1
    "gpt2": dict(preset="gpt2-124m", batch_size=480, micro_batch=12, max_steps=100_000,
                 lr_warmup=2000, min_lr_ratio=0.1, poco_start=50_000, refresh_every=10,
                 mega_batches=10, alpha="0.7", rho1=0.6, rho2=0.1, eval_every=1000,
                 eval_batches=10, log_every=10, ckpt_every=1000,
                 opt={"adamw": PAPER_ADAMW, "ivon": PAPER_IVON}),
    # App., continual pretraining: context 512, batch 80, 1,000 warm-up steps, 40 inner
    # steps, mega-batch 40 x 80, alpha 0.7, rho1 0.3, rho2 0.05; IVON ess 3e10, beta2
    # 0.9999, lr 0.04; AdamW lr 1e-4, betas (0.9, 0.999); annealed to zero
    "continual": dict(preset="gpt2-124m", seq_len=512, batch_size=80, micro_batch=20,
                      max_steps=24_000, lr_warmup=0, min_lr_ratio=0.0, poco_start=1000,
                      refresh_every=40, mega_batches=40, alpha="0.7", rho1=0.3, rho2=0.05,
                      eval_every=500, eval_batches=10, log_every=10, ckpt_every=1000,
                      opt={"adamw": dict(PAPER_ADAMW, lr=1e-4, beta2=0.999),
                           "ivon": dict(PAPER_IVON, lr=0.04, ess=3e10, beta2=0.9999)}),
}


# --------------------------------------------------------------------------- the config
@dataclass
class RunConfig:
    """Every setting of one run (:func:`resolve_config` fills it from a recipe)."""
    optimizer: str = "ivon-pocomo"
    recipe: str = "cpu"
    data: str = "stdlib"
    preset: str = "gpt-tiny"
    vocab_size: Optional[int] = None
    block_size: Optional[int] = None
    n_layer: Optional[int] = None
    n_head: Optional[int] = None
    n_embd: Optional[int] = None
    dropout: Optional[float] = None
    seq_len: Optional[int] = None            # default: the model's block size
    batch_size: int = 16                     # global sequences per optimizer step
    micro_batch: int = 16                    # sequences per forward/backward per rank
    max_steps: int = 200
    lr: float = 0.3
    min_lr_ratio: float = 0.1
    lr_warmup: int = 20
    lr_decay_steps: Optional[int] = None     # default: max_steps
    weight_decay: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.99999
    grad_clip: float = 1.0                   # AdamW only
    ess: float = 1e10
    hess_init: float = 1e-3
    clip_radius: float = 1e-3
    rescale_lr: bool = False
    mc_samples: int = 1
    alpha: str = "0.7"
    poco_start: int = 100
    refresh_every: int = 10
    mega_batches: int = 10
    rho1: float = 0.6
    rho2: float = 0.1
    hess_corr_scale: float = 0.01
    outer_noise: str = "shared"
    refresh_samples: int = 1
    refresh_antithetic: bool = False
    state_dtype: str = "float32"             # IVON family: "bfloat16" (momentum, outer buffers)
    outer_dtype: Optional[str] = None        # IVON-PoCoMo: "bfloat16" (g_out, h_out); None: state's
    eval_every: int = 50
    eval_batches: int = 4
    log_every: int = 10
    ckpt_every: int = 100
    out_dir: Optional[str] = None
    resume: bool = False
    init_from: Optional[str] = None
    init_step: Optional[int] = None
    stop_after: Optional[int] = None         # stop (with a checkpoint) after this step
    device: str = "auto"
    amp: str = "auto"
    compile: bool = False
    backend: str = "auto"
    parallel: str = "ddp"
    seed: int = 0
    data_seed: Optional[int] = None
    time_split: bool = False
    save_rank_states: bool = False
    quiet: bool = False


def _recipe_values(recipe: str, optimizer: str) -> Dict[str, Any]:
    r = dict(RECIPES[recipe])
    opt = r.pop("opt")
    fam = "adamw" if optimizer == "adamw" else "ivon"
    r.update(opt[fam])
    return r


def resolve_config(optimizer: str, recipe: str = "auto", **overrides) -> RunConfig:
    """The recipe's values for ``optimizer``, then ``overrides`` (None: keep)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if recipe == "auto":
        recipe = "gpt2" if torch.cuda.is_available() else "cpu"
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {('auto',) + tuple(RECIPES)}, got {recipe!r}")
    names = {f.name for f in fields(RunConfig)}
    bad = sorted(k for k in overrides if k not in names)
    if bad:
        raise ValueError(f"unknown settings {bad}")
    vals = _recipe_values(recipe, optimizer)
    vals.update({k: v for k, v in overrides.items() if v is not None})
    cfg = replace(RunConfig(), optimizer=optimizer, recipe=recipe,
                  **{k: v for k, v in vals.items() if k in names})
    if cfg.out_dir is None:
        cfg.out_dir = os.path.join("pretrain_out", optimizer)
    validate_config(cfg)
    return cfg


def parse_alpha(spec: str):
    """``"0.7"``: constant; ``"0.2:0.8"``: linear from the first corrected step to the
    last.  Returns ``(start, end)``."""
    try:
        parts = [float(x) for x in str(spec).split(":")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2) or not all(0.0 <= a <= 1.0 for a in parts):
        raise ValueError(f"alpha must be a number in [0, 1] or 'start:end' (a linear ramp), "
                         f"got {spec!r}")
    return parts[0], parts[-1]


def validate_config(cfg: RunConfig) -> None:
    def need(cond, msg):
        if not cond:
            raise ValueError(msg)
    need(cfg.preset in PRESETS, f"preset must be one of {sorted(PRESETS)}, got {cfg.preset!r}")
    for k in ("batch_size", "micro_batch", "max_steps", "refresh_every", "mega_batches",
              "eval_every", "eval_batches", "log_every", "ckpt_every", "mc_samples",
              "refresh_samples"):
        v = getattr(cfg, k)
        need(isinstance(v, int) and v >= 1, f"{k} must be a positive int, got {v!r}")
    for k in ("poco_start", "lr_warmup", "seed"):
        v = getattr(cfg, k)
        need(isinstance(v, int) and v >= 0, f"{k} must be a non-negative int, got {v!r}")
    need(cfg.batch_size % cfg.micro_batch == 0,
         f"batch_size ({cfg.batch_size}) must be a multiple of micro_batch ({cfg.micro_batch})")
    need(cfg.lr >= 0 and 0 <= cfg.min_lr_ratio <= 1,
         f"lr must be >= 0 and min_lr_ratio in [0, 1], got {cfg.lr}, {cfg.min_lr_ratio}")
    need(cfg.amp in ("auto", "bf16", "none"), f"amp must be auto, bf16 or none, got {cfg.amp!r}")
    need(cfg.parallel in ("ddp", "fsdp"), f"parallel must be ddp or fsdp, got {cfg.parallel!r}")
    need(not (cfg.resume and cfg.init_from),
         "--resume continues a run, --init-from starts one from another run's state: not both")
    need(cfg.recipe != "continual" or cfg.init_from or cfg.resume,
         "the continual recipe starts from a pretrained model: pass --init-from CKPT")
    need(cfg.stop_after is None or cfg.stop_after >= 1, "stop_after must be >= 1")
    need(cfg.outer_dtype is None or cfg.optimizer == "ivon-pocomo",
         f"--outer-dtype is IVON-PoCoMo's (its outer estimates), not {cfg.optimizer}'s")
    need(not (cfg.outer_dtype == "float32" and cfg.state_dtype == "bfloat16"),
         "--outer-dtype float32 with --state-dtype bfloat16: the outer estimates follow the "
         "state dtype (--outer-dtype bfloat16 with float32 state keeps them alone in bfloat16)")
    parse_alpha(cfg.alpha)


# --------------------------------------------------------------------------- schedules
def lr_at(cfg: RunConfig, it: int) -> float:
    """Linear warm-up over ``lr_warmup`` steps, then cosine to ``min_lr_ratio * lr`` at
    ``lr_decay_steps`` (nanoGPT's schedule)."""
    decay = cfg.lr_decay_steps or cfg.max_steps
    lo = cfg.lr * cfg.min_lr_ratio
    if it < cfg.lr_warmup:
        return cfg.lr * (it + 1) / (cfg.lr_warmup + 1)
    if it >= decay:
        return lo
    f = (it - cfg.lr_warmup) / max(1, decay - cfg.lr_warmup)
    return lo + 0.5 * (1.0 + math.cos(math.pi * f)) * (cfg.lr - lo)


def alpha_at(cfg: RunConfig, it: int) -> float:
    """The correction weight at step ``it``: :func:`parse_alpha`'s ramp over the corrected
    steps (``poco_start`` to ``max_steps - 1``), constant outside."""
    a, b = parse_alpha(cfg.alpha)
    span = max(1, cfg.max_steps - 1 - cfg.poco_start)
    f = min(max((it - cfg.poco_start) / span, 0.0), 1.0)
    return a + (b - a) * f


# --------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    """The flags of ``python -m poco_kernels.experiments.pretrain``; unset ones are None
    (:func:`resolve_config` then takes the recipe's value)."""
    p = argparse.ArgumentParser(
        prog="python -m poco_kernels.experiments.pretrain",
        description="GPT pretraining with AdamW, IVON or IVON-PoCoMo (the paper's LLM "
                    "set-up). Unset flags take the recipe's value.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--optimizer", default="adamw,ivon,ivon-pocomo",
                   help=f"one of {OPTIMIZERS}, or a comma-separated list run in turn")
    p.add_argument("--recipe", default="auto", choices=("auto",) + tuple(RECIPES),
                   help="defaults: gpt2 with CUDA, cpu without")
    p.add_argument("--data", default=None, help="'stdlib' or a directory with train.bin "
                   "and val.bin (uint16 tokens, nanoGPT's format)")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS))
    for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None)
    p.add_argument("--dropout", type=float, default=None)
    ints = ("seq_len", "batch_size", "micro_batch", "max_steps", "lr_warmup", "lr_decay_steps",
            "mc_samples", "poco_start", "refresh_every", "mega_batches", "refresh_samples",
            "eval_every", "eval_batches", "log_every", "ckpt_every", "init_step", "stop_after",
            "seed", "data_seed")
    floats = ("lr", "min_lr_ratio", "weight_decay", "beta1", "beta2", "grad_clip", "ess",
              "hess_init", "clip_radius", "rho1", "rho2", "hess_corr_scale")
    helps = {"batch_size": "global sequences per optimizer step",
             "micro_batch": "sequences per forward/backward on each rank",
             "poco_start": "steps of plain IVON before the first refresh",
             "refresh_every": "inner steps between refreshes (m)",
             "mega_batches": "mini-batches per refresh (k)",
             "stop_after": "stop after this step with a checkpoint (resume later)",
             "init_step": "optimizer steps the --init-from run took (ivon-opt does not save it)",
             "grad_clip": "AdamW's gradient-norm clipping (0: off)"}
    for k in ints:
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None, help=helps.get(k))
    for k in floats:
        p.add_argument("--" + k.replace("_", "-"), type=float, default=None, help=helps.get(k))
    p.add_argument("--alpha", default=None, help="correction weight: 0.7, or a linear ramp "
                   "over the corrected steps, e.g. 0.2:0.8")
    p.add_argument("--outer-noise", default=None, choices=("shared", "independent"))
    p.add_argument("--rescale-lr", default=None, action=argparse.BooleanOptionalAction,
                   help="IVON's lr (hess_init + wd) rescaling")
    p.add_argument("--refresh-antithetic", default=None, action=argparse.BooleanOptionalAction)
    p.add_argument("--state-dtype", default=None, choices=("float32", "bfloat16"),
                   help="IVON family: bfloat16 momentum and outer buffers (stochastic "
                   "rounding)")
    p.add_argument("--outer-dtype", default=None, choices=("float32", "bfloat16"),
                   help="IVON-PoCoMo: the outer estimates g_out and h_out in bfloat16 "
                   "(stochastic rounding), the rest in the state dtype (default: as it)")
    p.add_argument("--out-dir", default=None, help="default pretrain_out/<optimizer>")
    p.add_argument("--resume", action="store_true", help="continue from <out-dir>/ckpt.pt")
    p.add_argument("--init-from", default=None, help="continual pretraining: a checkpoint "
                   "(ours, or nanoGPT-layout with an ivon-opt state)")
    p.add_argument("--device", default=None)
    p.add_argument("--amp", default=None, choices=("auto", "bf16", "none"))
    p.add_argument("--compile", action="store_true", default=None)
    p.add_argument("--backend", default=None, choices=("auto", "torch", "triton", "cpp"))
    p.add_argument("--parallel", default=None, choices=("ddp", "fsdp"))
    p.add_argument("--time-split", action="store_true", default=None,
                   help="time forward/backward apart (synchronises the device)")
    p.add_argument("--save-rank-states", action="store_true", default=None)
    p.add_argument("--quiet", action="store_true", default=None)
    return p

