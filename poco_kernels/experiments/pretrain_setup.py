"""Setting up a pretraining run: the process group (``torchrun``), the device, the split
of the global batch over ranks and micro-batches, the model (from a preset, or from
``--init-from``), FSDP2 sharding, DDP, and the optimizer (with the IVON state of
``--init-from`` for continual pretraining)."""
from __future__ import annotations

import os
from dataclasses import fields, replace
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from .continual import checkpoint_step, decay_groups, ivon_moments, load_ivon_moments
from .gpt import PRESETS, GPTConfig
from .lm_data import TokenData
from .pretrain_config import RunConfig, parse_alpha

__all__ = ["dist_info", "init_distributed", "sync_device", "pick_device", "split_batch",
           "load_init_checkpoint", "model_config", "sequence_length", "shard_model",
           "wrap_ddp", "make_optimizer", "init_optimizer_from"]


# --------------------------------------------------------------------------- processes
def dist_info() -> Tuple[int, int]:
    """(rank, world size); (0, 1) outside a process group."""
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
    r, w = dist_info()
    return r, w, int(os.environ.get("LOCAL_RANK", "0"))


def sync_device(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def pick_device(device: str, local_rank: int) -> torch.device:
    """``--device``; ``auto``: this rank's GPU when there is one, else the CPU."""
    if device == "auto":
        return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def split_batch(cfg: RunConfig, world: int) -> Tuple[int, int]:
    """(sequences per rank, micro-batches per rank) of one global mini-batch."""
    per_rank = cfg.batch_size // world
    if cfg.batch_size % (world * cfg.micro_batch):
        raise ValueError(f"batch_size ({cfg.batch_size}) must be a multiple of world size "
                         f"x micro_batch ({world} x {cfg.micro_batch})")
    return per_rank, per_rank // cfg.micro_batch


# --------------------------------------------------------------------------- the model
def load_init_checkpoint(path: str) -> Dict[str, Any]:
    """The checkpoint ``--init-from`` names (ours, or nanoGPT's layout)."""
    init_ckpt = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(init_ckpt, dict) or "model" not in init_ckpt:
        raise ValueError(f"--init-from {path}: not a checkpoint with a "
                         "'model' (a sharded FSDP checkpoint cannot start a run)")
    return init_ckpt


def model_config(cfg: RunConfig, init_ckpt: Optional[Dict[str, Any]]) -> GPTConfig:
    """The preset, overridden by the checkpoint's model settings, overridden by the flags
    (``--vocab-size`` etc.)."""
    over = {k: getattr(cfg, k) for k in ("vocab_size", "block_size", "n_layer", "n_head",
                                         "n_embd", "dropout") if getattr(cfg, k) is not None}
    if init_ckpt is not None:
        margs = init_ckpt.get("model_config") or init_ckpt.get("model_args")
        if margs:
            keys = {f.name for f in fields(GPTConfig)}
            over = {**{k: v for k, v in margs.items() if k in keys}, **over}
    return replace(PRESETS[cfg.preset], **over)


def sequence_length(cfg: RunConfig, gcfg: GPTConfig, data: TokenData) -> int:
    """``--seq-len`` (default: the model's block size), checked against the model and the
    data."""
    seq = cfg.seq_len or gcfg.block_size
    if seq > gcfg.block_size:
        raise ValueError(f"seq_len {seq} > the model's block_size {gcfg.block_size}")
    if data.vocab_size > gcfg.vocab_size:
        raise ValueError(f"the data's vocabulary ({data.vocab_size}) is larger than the "
                         f"model's ({gcfg.vocab_size}): pass --vocab-size")
    data.check_seq_len(seq)
    return seq


def shard_model(model: torch.nn.Module, dev: torch.device, world: int) -> None:
    """FSDP2: every transformer block, then the rest, sharded over all ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(dev.type, (world,))
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)


def wrap_ddp(model: torch.nn.Module, dev: torch.device):
    from torch.nn.parallel import DistributedDataParallel as DDP
    return DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)


# --------------------------------------------------------------------------- the optimizer
def make_optimizer(cfg: RunConfig, model: torch.nn.Module, dev: torch.device, fsdp: bool):
    """``cfg.optimizer`` over ``model``'s parameters in nanoGPT's two groups (weight decay
    on those with two or more dimensions only)."""
    name = cfg.optimizer
    groups = decay_groups(model, cfg.weight_decay)
    if name == "adamw":
        kw = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
        if dev.type == "cuda" and not fsdp:
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
        if fsdp:
            raise ValueError("ivon-opt keeps flat state per group and cannot run on "
                             "sharded parameters: use --parallel ddp")
        return ivon_opt.IVON(groups, **ivon)
    import poco_kernels as pk
    common = dict(seed=cfg.seed, backend=cfg.backend,
                  state_dtype=torch.bfloat16 if cfg.state_dtype == "bfloat16" else None)
    if name == "ivon":
        return pk.IVON(groups, **ivon, **common)
    return pk.IVONPoCo(groups, **ivon, alpha=parse_alpha(cfg.alpha)[0], rho1=cfg.rho1,
                       rho2=cfg.rho2, hess_corr_scale=cfg.hess_corr_scale,
                       outer_noise=cfg.outer_noise, refresh_samples=cfg.refresh_samples,
                       refresh_antithetic=cfg.refresh_antithetic,
                       outer_dtype=cfg.outer_dtype and getattr(torch, cfg.outer_dtype),
                       **common)


def init_optimizer_from(opt, cfg: RunConfig, ckpt: Dict[str, Any],
                        log: Callable[[str], None]) -> None:
    """Continual pretraining: the IVON moments (h, momentum) and step count of the
    checkpoint's optimizer (ours or ivon-opt's), when ours is IVON-type."""
    name = cfg.optimizer
    opt_sd = ckpt.get("optimizer")
    if name not in ("ivon", "ivon-pocomo") or opt_sd is None:
        log(f"init-from: model weights only ({name} starts a fresh state)")
        return
    groups = [g["params"] for g in opt.param_groups]
    moments = ivon_moments(opt_sd, groups)
    step = checkpoint_step(ckpt, cfg.init_step)
    load_ivon_moments(opt, moments, step)
    log(f"init-from: model and IVON state (h, momentum) of {cfg.init_from}, "
        f"optimizer step {step}")
