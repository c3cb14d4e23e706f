"""GPT pretraining with AdamW, IVON or IVON-PoCoMo: the paper's LLM set-up (Sec. 5.2,
App. on pretraining and continual pretraining), single process or data parallel.

    python -m poco_kernels.experiments.pretrain --optimizer ivon-pocomo
    torchrun --nproc_per_node 8 -m poco_kernels.experiments.pretrain --recipe gpt2 \\
        --data data/openwebtext --optimizer ivon-pocomo

``--optimizer``: ``adamw`` (``torch.optim.AdamW``, fused on CUDA), ``ivon`` and
``ivon-pocomo`` (this package's ``IVON`` / ``IVONPoCo``), ``ivon-opt`` (ivon-opt 0.1.3's
IVON, the reference implementation, e.g. to produce checkpoints for continual
pretraining); a comma-separated list runs each in turn and prints a comparison.

``--recipe`` picks the defaults (every one has a flag): ``cpu`` (the default without a
GPU: a 0.9M-parameter GPT on byte-level Python source, a few minutes), ``gpt2`` (the
default with one: the paper's GPT-2 124M run, Sec. 5.2) and ``continual`` (the paper's
continual pretraining from ``--init-from``).

The loop (:class:`Trainer`), per optimizer step ``t`` on a global mini-batch of
``batch_size`` sequences split over ranks and micro-batches of ``micro_batch``:

* IVON-PoCoMo: no correction before ``poco_start`` (plain IVON, the paper's warm-up);
  from then on, every ``refresh_every`` steps a refresh on a mega-batch of
  ``mega_batches`` fresh mini-batches at ONE posterior sample, and each inner step
  evaluates its mini-batch at the inner and the outer sample; ``alpha`` is a constant or
  a linear ramp ``a:b`` over the corrected steps;
* IVON: one posterior sample per step; AdamW: the usual step (gradient clipping);
* the learning rate: linear warm-up then cosine decay to ``min_lr_ratio * lr``;
* bf16 autocast on CUDA (``--amp``), optional ``--compile``;
* every ``eval_every`` steps the validation loss and perplexity at the posterior mean;
* every ``ckpt_every`` steps a checkpoint: model, optimizer, step, data position, RNG
  states of every rank, the log.  ``--resume`` continues from it, bit for bit on the CPU.

Data parallel (``torchrun``): DDP all-reduces the gradients of the last micro-batch of
each sample (``no_sync`` before); every rank draws the same posterior sample from the
shared seed (the noise is counter-based, nothing is communicated), so parameters and
optimizer state stay bit-identical on all ranks.  ``--parallel fsdp`` shards parameters
with FSDP2 (README, 'Pretraining a GPT', for what that supports).

Outputs in ``--out-dir`` (default ``pretrain_out/<optimizer>``): ``log.csv`` (step, lr,
alpha, train loss, val loss and perplexity, tokens, tokens per second, optimizer share),
``summary.json``, ``ckpt.pt``.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from .continual import checkpoint_step, decay_groups, ivon_moments, load_ivon_moments, \
    load_model_state
from .gpt import GPT, PRESETS, GPTConfig
from .lm_data import TokenData, load_tokens

__all__ = ["RunConfig", "RECIPES", "Trainer", "resolve_config", "main"]

OPTIMIZERS = ("adamw", "ivon", "ivon-pocomo", "ivon-opt")
IVON_FAMILY = ("ivon", "ivon-pocomo", "ivon-opt")

# --------------------------------------------------------------------------- recipes
#: The paper's GPT-2 hyperparameters (App., pretraining).  ``rescale_lr=False``: with
#: ivon-opt's default rescaling, lr 0.3 and clip 1e-3 would cap a step at
#: 0.3 (1e-3 + 1e-4) 1e-3 = 3.3e-7 per coordinate (README, 'Pretraining a GPT').
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


@dataclass
class RunConfig:
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
    parse_alpha(cfg.alpha)


# --------------------------------------------------------------------------- helpers
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
    a, b = parse_alpha(cfg.alpha)
    span = max(1, cfg.max_steps - 1 - cfg.poco_start)
    f = min(max((it - cfg.poco_start) / span, 0.0), 1.0)
    return a + (b - a) * f


def _dist_info():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_distributed(device: str = "auto"):
    """Join the process group when launched by ``torchrun`` (``WORLD_SIZE`` set):
    NCCL on CUDA, gloo on the CPU.  Returns (rank, world size, local rank)."""
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        cuda = torch.cuda.is_available() and device in ("auto", "cuda")
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if cuda else "gloo")
    r, w = _dist_info()
    return r, w, int(os.environ.get("LOCAL_RANK", "0"))


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _rng_state(dev: torch.device) -> Dict[str, Any]:
    st = {"cpu": torch.get_rng_state()}
    if dev.type == "cuda":
        st["cuda"] = torch.cuda.get_rng_state(dev)
    return st


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _set_rng_state(st: Dict[str, Any], dev: torch.device) -> None:
    torch.set_rng_state(st["cpu"])
    if dev.type == "cuda" and "cuda" in st:
        torch.cuda.set_rng_state(st["cuda"], dev)


# --------------------------------------------------------------------------- trainer
class Trainer:
    """One pretraining run (module docstring).  ``train()`` returns the summary."""

    def __init__(self, cfg: RunConfig, data: Optional[TokenData] = None):
        validate_config(cfg)
        self.cfg = cfg
        self.rank, self.world, local = init_distributed(cfg.device)
        if cfg.device == "auto":
            self.dev = torch.device(f"cuda:{local}" if torch.cuda.is_available() else "cpu")
        else:
            self.dev = torch.device(cfg.device)
        per_rank = cfg.batch_size // self.world
        if cfg.batch_size % (self.world * cfg.micro_batch):
            raise ValueError(f"batch_size ({cfg.batch_size}) must be a multiple of world size "
                             f"x micro_batch ({self.world} x {cfg.micro_batch})")
        self.rows, self.accum = per_rank, per_rank // cfg.micro_batch
        self.amp = cfg.amp == "bf16" or (cfg.amp == "auto" and self.dev.type == "cuda")
        self.data = data if data is not None else load_tokens(cfg.data)
        self.data_seed = cfg.seed if cfg.data_seed is None else cfg.data_seed
        # the model
        over = {k: getattr(cfg, k) for k in ("vocab_size", "block_size", "n_layer", "n_head",
                                             "n_embd", "dropout") if getattr(cfg, k) is not None}
        init_ckpt = None
        if cfg.init_from:
            init_ckpt = torch.load(cfg.init_from, map_location="cpu", weights_only=False)
            if not isinstance(init_ckpt, dict) or "model" not in init_ckpt:
                raise ValueError(f"--init-from {cfg.init_from}: not a checkpoint with a "
                                 "'model' (a sharded FSDP checkpoint cannot start a run)")
            margs = init_ckpt.get("model_config") or init_ckpt.get("model_args")
            if margs:
                keys = {f.name for f in fields(GPTConfig)}
                over = {**{k: v for k, v in margs.items() if k in keys}, **over}
        self.gcfg = replace(PRESETS[cfg.preset], **over)
        self.seq = cfg.seq_len or self.gcfg.block_size
        if self.seq > self.gcfg.block_size:
            raise ValueError(f"seq_len {self.seq} > the model's block_size {self.gcfg.block_size}")
        if self.data.vocab_size > self.gcfg.vocab_size:
            raise ValueError(f"the data's vocabulary ({self.data.vocab_size}) is larger than the "
                             f"model's ({self.gcfg.vocab_size}): pass --vocab-size")
        self.data.check_seq_len(self.seq)
        torch.manual_seed(cfg.seed)
        self.raw = GPT(self.gcfg).to(self.dev)
        if init_ckpt is not None:
            load_model_state(self.raw, init_ckpt["model"])
        self.model = self.raw
        self.fsdp = self.world > 1 and cfg.parallel == "fsdp"
        if self.fsdp:
            self._shard()
        self.opt = self._make_optimizer()
        if init_ckpt is not None:
            self._init_optimizer_from(init_ckpt)
        if cfg.compile:
            self.model = torch.compile(self.model)
        self.ddp = None
        if self.world > 1 and not self.fsdp:
            from torch.nn.parallel import DistributedDataParallel as DDP
            self.ddp = DDP(self.model, device_ids=[self.dev.index] if self.dev.type == "cuda"
                           else None)
            self.model = self.ddp
        # loop state
        self.step = 0                # optimizer steps taken
        self.data_pos = 0            # global train mini-batches drawn
        self.tokens = 0              # tokens forwarded and backwarded (all ranks)
        self.evals = 0               # gradient evaluations, in mini-batches
        self.history: List[Dict[str, Any]] = []
        self.out = Path(cfg.out_dir or os.path.join("pretrain_out", cfg.optimizer))
        if cfg.resume:
            self._load(self.out / "ckpt.pt")

    # ------------------------------------------------------------------ set-up
    def _shard(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh(self.dev.type, (self.world,))
        for blk in self.raw.blocks:
            fully_shard(blk, mesh=mesh)
        fully_shard(self.raw, mesh=mesh)

    def _make_optimizer(self):
        cfg, name = self.cfg, self.cfg.optimizer
        groups = decay_groups(self.raw, cfg.weight_decay)
        if name == "adamw":
            kw = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
            if self.dev.type == "cuda" and not self.fsdp:
                kw["fused"] = True
            return torch.optim.AdamW(groups, **kw)
        ivon = dict(lr=cfg.lr, ess=cfg.ess, hess_init=cfg.hess_init, beta1=cfg.beta1,
                    beta2=cfg.beta2, mc_samples=cfg.mc_samples, clip_radius=cfg.clip_radius,
                    rescale_lr=cfg.rescale_lr)
        if name == "ivon-opt":
            try:
                import ivon as ivon_opt
            except ImportError as exc:
                raise ImportError("--optimizer ivon-opt needs ivon-opt: pip install "
                                  "ivon-opt==0.1.3") from exc
            if self.fsdp:
                raise ValueError("ivon-opt keeps flat state per group and cannot run on "
                                 "sharded parameters: use --parallel ddp")
            return ivon_opt.IVON(groups, **ivon)
        import poco_kernels as pk
        backend = cfg.backend
        if self.fsdp and backend == "auto":
            backend = "torch"
        common = dict(seed=cfg.seed, backend=backend)
        if name == "ivon":
            return pk.IVON(groups, **ivon, **common)
        return pk.IVONPoCo(groups, **ivon, alpha=parse_alpha(cfg.alpha)[0], rho1=cfg.rho1,
                           rho2=cfg.rho2, hess_corr_scale=cfg.hess_corr_scale,
                           outer_noise=cfg.outer_noise, refresh_samples=cfg.refresh_samples,
                           refresh_antithetic=cfg.refresh_antithetic, **common)

    def _init_optimizer_from(self, ckpt: Dict[str, Any]) -> None:
        """Continual pretraining: the IVON moments (h, momentum) and step count of the
        checkpoint's optimizer (ours or ivon-opt's), when ours is IVON-type."""
        name = self.cfg.optimizer
        opt_sd = ckpt.get("optimizer")
        if name not in ("ivon", "ivon-pocomo") or opt_sd is None:
            self._log(f"init-from: model weights only ({name} starts a fresh state)")
            return
        groups = [g["params"] for g in self.opt.param_groups]
        moments = ivon_moments(opt_sd, groups)
        step = checkpoint_step(ckpt, self.cfg.init_step)
        load_ivon_moments(self.opt, moments, step)
        self._log(f"init-from: model and IVON state (h, momentum) of {self.cfg.init_from}, "
                  f"optimizer step {step}")

    # ------------------------------------------------------------------ data + passes
    def _rows(self, j: int):
        lo = self.rank * self.rows + j * self.cfg.micro_batch
        return lo, lo + self.cfg.micro_batch

    def _autocast(self):
        return torch.autocast(self.dev.type, dtype=torch.bfloat16, enabled=self.amp)

    def _backward(self, index: int) -> torch.Tensor:
        """Forward and backward of global train mini-batch ``index`` (this rank's rows,
        in micro-batches); DDP all-reduces at the last one.  Returns the rank's mean loss."""
        total = torch.zeros((), device=self.dev)
        cfg = self.cfg
        for j in range(self.accum):
            lo, hi = self._rows(j)
            x, y = self.data.batch("train", index, cfg.batch_size, self.seq, self.data_seed,
                                   lo, hi)
            x, y = x.to(self.dev, non_blocking=True), y.to(self.dev, non_blocking=True)
            last = j == self.accum - 1
            ctx = self.ddp.no_sync() if (self.ddp is not None and not last) \
                else contextlib.nullcontext()
            if self.fsdp:
                self.raw.set_requires_gradient_sync(last)
            if self.cfg.time_split:
                _sync(self.dev)
                t0 = time.perf_counter()
            with ctx:
                with self._autocast():
                    _, loss = self.model(x, y)
                (loss / self.accum).backward()
            if self.cfg.time_split:
                _sync(self.dev)
                self._fb_time += time.perf_counter() - t0
            total += loss.detach()
        self.tokens += cfg.batch_size * self.seq
        self.evals += 1
        return total / self.accum

    def _global_mean(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            t = t.clone()
            dist.all_reduce(t)
            t /= self.world
        return t

    # ------------------------------------------------------------------ one step
    def _refresh_due(self, it: int) -> bool:
        c = self.cfg
        return (c.optimizer == "ivon-pocomo" and it >= c.poco_start
                and (it - c.poco_start) % c.refresh_every == 0)

    def _refresh(self) -> None:
        opt, k = self.opt, self.cfg.mega_batches
        for _ in range(opt.param_groups[0]["refresh_samples"]):
            with opt.sampled("refresh", accumulate=False):
                for c in range(k):
                    self._backward(self.data_pos + c)
                    opt.accumulate()
        opt.refresh()
        self.data_pos += k

    def _train_step(self, it: int) -> torch.Tensor:
        opt, name = self.opt, self.cfg.optimizer
        lr = lr_at(self.cfg, it)
        for g in opt.param_groups:
            g["lr"] = lr
        index = self.data_pos
        if name == "adamw":
            opt.zero_grad(set_to_none=True)
            loss = self._backward(index)
            if self.cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.raw.parameters(), self.cfg.grad_clip)
            opt.step()
        elif name == "ivon-opt":
            loss = torch.zeros((), device=self.dev)
            for _ in range(self.cfg.mc_samples):
                opt.zero_grad(set_to_none=True)
                with opt.sampled_params(train=True):
                    loss += self._backward(index) / self.cfg.mc_samples
            opt.step()
        else:
            if name == "ivon-pocomo":
                a = alpha_at(self.cfg, it)
                for g in opt.param_groups:
                    g["alpha"] = a
                if self._refresh_due(it):
                    self._refresh()
            loss = torch.zeros((), device=self.dev)
            for _ in range(self.cfg.mc_samples):
                with opt.sampled("inner"):
                    loss += self._backward(index) / self.cfg.mc_samples
            if opt.correction_active():
                for _ in range(self.cfg.mc_samples):
                    with opt.sampled("outer"):
                        self._backward(index)
            opt.step()
        self.data_pos += 1
        self.step = it + 1
        return loss

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss at the posterior mean over ``eval_batches`` fixed global
        mini-batches (the same ones at every evaluation)."""
        cfg = self.cfg
        model = self.raw
        was = model.training
        model.eval()
        total = torch.zeros((), device=self.dev)
        for i in range(cfg.eval_batches):
            for j in range(self.accum):
                lo, hi = self._rows(j)
                x, y = self.data.batch("val", i, cfg.batch_size, self.seq, self.data_seed, lo, hi)
                with self._autocast():
                    _, loss = model(x.to(self.dev), y.to(self.dev))
                total += loss.float()
        model.train(was)
        return float(self._global_mean(total / (cfg.eval_batches * self.accum)))

    # ------------------------------------------------------------------ checkpoints
    def _shard_file(self, path: Path, rank: int) -> Path:
        return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")

    def _save(self, path: Path) -> None:
        """``ckpt.pt`` (written by rank 0, atomically).  With FSDP each rank also writes
        its shards to ``ckpt.rank<r>.pt`` (resume with the same world size)."""
        mine = _rng_state(self.dev)
        rngs = [mine]
        if self.world > 1:
            rngs = [None] * self.world
            dist.all_gather_object(rngs, {k: v.cpu() for k, v in mine.items()})
        state = {"model": self.raw.state_dict(), "optimizer": self.opt.state_dict()}
        if self.cfg.optimizer == "ivon-opt":
            state["opt_step"] = self.opt.current_step   # not in ivon-opt's state dict
        path.parent.mkdir(parents=True, exist_ok=True)
        if self.fsdp:
            _atomic_save(state, self._shard_file(path, self.rank))
            state = {"sharded": True}
        if self.rank == 0:
            ck = {"version": 1, "config": asdict(self.cfg), "model_config": self.gcfg.as_dict(),
                  **state, "optimizer_name": self.cfg.optimizer, "step": self.step,
                  "data_pos": self.data_pos, "tokens": self.tokens, "evals": self.evals,
                  "history": self.history, "rng": rngs, "world_size": self.world,
                  "data": {"name": self.data.name, "fingerprint": self.data.fingerprint}}
            _atomic_save(ck, path)
        if self.world > 1:
            dist.barrier()

    def _load(self, path: Path) -> None:
        """Everything is checked before the model or the optimizer changes."""
        if not path.is_file():
            raise FileNotFoundError(f"--resume: no checkpoint at {path}")
        ck = torch.load(path, map_location="cpu", weights_only=False)
        c = ck["config"]
        for k in ("optimizer", "batch_size", "seq_len", "seed", "data_seed"):
            if c.get(k) != getattr(self.cfg, k):
                raise ValueError(f"--resume: the checkpoint's {k} is {c.get(k)!r}, this run's "
                                 f"{getattr(self.cfg, k)!r}")
        if ck["model_config"] != self.gcfg.as_dict():
            raise ValueError("--resume: the checkpoint's model differs from this run's")
        if ck["data"]["fingerprint"] != self.data.fingerprint:
            raise ValueError(f"--resume: the checkpoint was trained on other data "
                             f"({ck['data']['name']})")
        state = ck
        if ck.get("sharded"):
            if not self.fsdp or ck["world_size"] != self.world:
                raise ValueError(f"--resume: the checkpoint is sharded over {ck['world_size']} "
                                 f"FSDP ranks: resume with --parallel fsdp on as many")
            state = torch.load(self._shard_file(path, self.rank), map_location=self.dev,
                               weights_only=False)
        elif self.fsdp:
            raise ValueError("--resume: the checkpoint is not sharded: resume without "
                             "--parallel fsdp")
        self.raw.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        if self.cfg.optimizer == "ivon-opt":
            self.opt.current_step = int(state["opt_step"])
        self.step, self.data_pos = int(ck["step"]), int(ck["data_pos"])
        self.tokens, self.evals = int(ck["tokens"]), int(ck["evals"])
        self.history = list(ck["history"])
        rngs = ck["rng"]
        _set_rng_state(rngs[self.rank] if self.rank < len(rngs) else rngs[0], self.dev)
        self._log(f"resumed from {path} at step {self.step}")

    def full_state(self) -> Dict[str, Any]:
        """Model and optimizer state as one process would hold them: sharded tensors are
        gathered (a collective: every rank calls it)."""
        from .._layout import is_sharded
        model = {k: (v.full_tensor() if is_sharded(v) else v).detach().cpu()
                 for k, v in self.raw.state_dict().items()}
        sd = self.opt.state_dict()
        if self.fsdp and "poco" in sd:
            from torch.distributed.tensor import DTensor
            params = [p for g in self.opt.param_groups for p in g["params"]]
            for i, p in enumerate(params):
                sd["state"][i] = {
                    k: DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape,
                                          stride=p.stride()).full_tensor()
                    for k, v in sd["state"][i].items()}
        return {"model": model, "optimizer": sd}

    # ------------------------------------------------------------------ the loop
    def _log(self, msg: str) -> None:
        if self.rank == 0 and not self.cfg.quiet:
            print(msg, flush=True)

    def train(self) -> Dict[str, Any]:
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        n = self.raw.num_params()
        self._log(f"[{cfg.optimizer}] {cfg.preset} ({n / 1e6:.2f}M parameters) on "
                  f"{self.data.name}, {self.world} rank(s) on {self.dev}, batch "
                  f"{cfg.batch_size} x {self.seq} ({self.accum} micro-batches of "
                  f"{cfg.micro_batch} per rank), {cfg.max_steps} steps"
                  + (", bf16 autocast" if self.amp else ""))
        self._fb_time = 0.0
        last = self.step
        stop = cfg.max_steps if cfg.stop_after is None else min(cfg.max_steps, cfg.stop_after)
        _sync(self.dev)
        t_mark, tok_mark, fb_mark = time.perf_counter(), self.tokens, 0.0
        train_tok_mark = self.step
        t_start = t_mark
        if self.step == 0 and not self.history:
            self._record(0, None, evaluate=True, rate=None)
        for it in range(self.step, stop):
            loss = self._train_step(it)
            done = it + 1
            do_eval = done % cfg.eval_every == 0 or done == cfg.max_steps
            if done % cfg.log_every == 0 or do_eval or done == stop:
                loss_g = float(self._global_mean(loss))
                _sync(self.dev)
                now = time.perf_counter()
                dt = now - t_mark
                rate = dict(tok_s=(done - train_tok_mark) * cfg.batch_size * self.seq / dt,
                            all_tok_s=(self.tokens - tok_mark) / dt,
                            step_ms=1e3 * dt / (done - train_tok_mark),
                            opt_share=(1.0 - (self._fb_time - fb_mark) / dt)
                            if cfg.time_split else None)
                self._record(done, loss_g, evaluate=do_eval, rate=rate)
                t_mark, tok_mark, fb_mark, train_tok_mark = (time.perf_counter(), self.tokens,
                                                             self._fb_time, done)
            if done % cfg.ckpt_every == 0 or done == stop:
                self._save(self.out / "ckpt.pt")
            last = done
        wall = time.perf_counter() - t_start
        summary = self._summary(wall, last)
        if cfg.save_rank_states:
            torch.save(self.full_state(), self.out / f"rank{self.rank}.pt")
        if self.rank == 0:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def _record(self, step, loss, evaluate, rate) -> None:
        poco = self.cfg.optimizer == "ivon-pocomo"
        row = {"step": step, "lr": self.opt.param_groups[0]["lr"] if step else 0.0,
               "alpha": self.opt.param_groups[0]["alpha"]
               if poco and self.opt.correction_active() else 0.0,
               "train_loss": loss, "val_loss": None, "val_ppl": None,
               "tokens": self.tokens, "evals": self.evals, "data_pos": self.data_pos,
               "refreshes": self.opt.refresh_count if poco else 0}
        if rate:
            row.update(rate)
        if evaluate:
            v = self.evaluate()
            row["val_loss"], row["val_ppl"] = v, math.exp(min(v, 50.0))
        self.history.append(row)
        if self.rank == 0:
            self._write_csv()
            parts = [f"step {step:6d}"]
            if loss is not None:
                parts.append(f"loss {loss:.4f}")
            if row["val_loss"] is not None:
                parts.append(f"val {row['val_loss']:.4f} (ppl {row['val_ppl']:.2f})")
            if rate:
                parts.append(f"{rate['tok_s']:,.0f} tok/s ({rate['step_ms']:.1f} ms/step)")
                if rate.get("opt_share") is not None:
                    parts.append(f"outside fwd/bwd {100 * rate['opt_share']:.1f}%")
            if row["refreshes"]:
                parts.append(f"refreshes {row['refreshes']}")
            self._log("  " + ", ".join(parts))

    def _write_csv(self) -> None:
        keys = ["step", "lr", "alpha", "train_loss", "val_loss", "val_ppl", "tokens", "evals",
                "data_pos", "refreshes", "tok_s", "all_tok_s", "step_ms", "opt_share"]
        with open(self.out / "log.csv", "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=keys, extrasaction="ignore")
            w.writeheader()
            for r in self.history:
                w.writerow(r)

    def _summary(self, wall: float, last: int) -> Dict[str, Any]:
        rates = [r for r in self.history if r.get("tok_s")]
        # steady state: leave out the first logged interval (compilation, warm-up)
        steady = rates[1:] if len(rates) > 1 else rates
        vals = [r for r in self.history if r["val_loss"] is not None]

        def med(key):
            xs = sorted(r[key] for r in steady if r.get(key) is not None)
            return xs[len(xs) // 2] if xs else None
        return {"optimizer": self.cfg.optimizer, "preset": self.cfg.preset,
                "params": self.raw.num_params(), "world_size": self.world,
                "device": str(self.dev), "backend": getattr(self.opt, "backend", "torch"),
                "steps": last, "tokens": self.tokens, "grad_evals_minibatches": self.evals,
                "wall_s": wall, "tok_s": med("tok_s"), "all_tok_s": med("all_tok_s"),
                "step_ms": med("step_ms"), "opt_share": med("opt_share"),
                "val_loss_first": vals[0]["val_loss"] if vals else None,
                "val_loss": vals[-1]["val_loss"] if vals else None,
                "val_ppl": vals[-1]["val_ppl"] if vals else None,
                "out_dir": str(self.out)}


# --------------------------------------------------------------------------- CLI
def _parser() -> argparse.ArgumentParser:
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


def main(argv=None) -> List[Dict[str, Any]]:
    args = vars(_parser().parse_args(argv))
    names = [s.strip() for s in args.pop("optimizer").split(",") if s.strip()]
    recipe = args.pop("recipe")
    out_dir = args.pop("out_dir")
    summaries = []
    for name in names:
        od = out_dir if (out_dir and len(names) == 1) else \
            (os.path.join(out_dir, name) if out_dir else None)
        cfg = resolve_config(name, recipe, out_dir=od, **args)
        summaries.append(Trainer(cfg).train())
    rank, _ = _dist_info()
    if rank == 0 and len(summaries) > 1:
        print("\noptimizer     val loss (start -> end)   ppl     tok/s    ms/step  "
              "outside fwd/bwd")
        for s in summaries:
            share = "" if s["opt_share"] is None else f"{100 * s['opt_share']:.1f}%"
            print(f"{s['optimizer']:12s}  {s['val_loss_first']:.3f} -> {s['val_loss']:.3f}"
                  f"          {s['val_ppl']:7.2f}  {s['tok_s']:8,.0f}  {s['step_ms']:7.1f}  "
                  f"{share}")
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return summaries


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
