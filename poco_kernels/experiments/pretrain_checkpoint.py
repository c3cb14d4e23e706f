"""Checkpoints of a pretraining run: ``ckpt.pt`` (model, optimizer, step, data position,
RNG states of every rank, the log), written atomically by rank 0 every ``ckpt_every``
steps; with FSDP the model and optimizer go to a ``torch.distributed.checkpoint``
directory ``ckpt.step<N>.dcp`` beside it (every rank writes its shards; ``ckpt.pt``
names it), which resumes on any number of FSDP ranks or in one process.  ``--resume``
checks that a checkpoint fits the run before anything changes, then continues from it
(bit for bit on the CPU at the same world size).

The functions take the :class:`~poco_kernels.experiments.pretrain_loop.Trainer` whose
model, optimizer and loop counters they save or restore."""
from __future__ import annotations

import os
import shutil
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict

import torch
import torch.distributed as dist

__all__ = ["save_checkpoint", "check_resumable", "load_checkpoint", "full_state",
           "shard_file", "dcp_dir"]


# --------------------------------------------------------------------------- files, RNG
def shard_file(path: Path, rank: int) -> Path:
    """``ckpt.pt`` -> ``ckpt.rank<rank>.pt``: one FSDP rank's shards."""
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def dcp_dir(path: Path, step: int) -> Path:
    """``ckpt.pt`` -> ``ckpt.step<step>.dcp``: an FSDP run's sharded model and optimizer."""
    return path.with_name(f"{path.stem}.step{step}.dcp")


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _rng_state(dev: torch.device) -> Dict[str, Any]:
    st = {"cpu": torch.get_rng_state()}
    if dev.type == "cuda":
        st["cuda"] = torch.cuda.get_rng_state(dev)
    return st


def _set_rng_state(st: Dict[str, Any], dev: torch.device) -> None:
    torch.set_rng_state(st["cpu"])
    if dev.type == "cuda" and "cuda" in st:
        torch.cuda.set_rng_state(st["cuda"], dev)


# --------------------------------------------------------------------------- save
def save_checkpoint(tr, path: Path) -> None:
    """``ckpt.pt`` (written by rank 0, atomically).  With FSDP each rank also writes
    its shards to ``ckpt.rank<r>.pt`` (resume with the same world size).  Every rank
    calls it (the RNG states are gathered)."""
    mine = _rng_state(tr.dev)
    rngs = [mine]
    if tr.world > 1:
        rngs = [None] * tr.world
        dist.all_gather_object(rngs, {k: v.cpu() for k, v in mine.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    new_dir = None
    if not tr.fsdp:
        state = {"model": tr.raw.state_dict(), "optimizer": tr.opt.state_dict()}
        if tr.cfg.optimizer == "ivon-opt":
            state["opt_step"] = tr.opt.current_step   # not in ivon-opt's state dict
    else:           # every rank writes its shards (DCP: reshards on load)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        msd, osd = get_state_dict(tr.raw, tr.opt)
        new_dir = dcp_dir(path, tr.step)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(new_dir))
        dist.barrier()
        state = {"sharded": True, "dcp": new_dir.name}
    if tr.rank == 0:
        ck = {"version": 1, "config": asdict(tr.cfg), "model_config": tr.gcfg.as_dict(),
              **state, "optimizer_name": tr.cfg.optimizer, "step": tr.step,
              "data_pos": tr.data_pos, "tokens": tr.tokens, "evals": tr.evals,
              "history": tr.history, "rng": rngs, "world_size": tr.world,
              "data": {"name": tr.data.name, "fingerprint": tr.data.fingerprint}}
        _atomic_save(ck, path)
        if new_dir is not None:     # ckpt.pt names the new directory: the older ones go
            for old in path.parent.glob(f"{path.stem}.step*.dcp"):
                if old.name != new_dir.name:
                    shutil.rmtree(old, ignore_errors=True)
    if tr.world > 1:
        dist.barrier()


# --------------------------------------------------------------------------- resume
def check_resumable(tr, ck: Dict[str, Any]) -> None:
    """A clear error unless checkpoint ``ck`` continues this run: same optimizer, batch,
    sequence length, seeds, model and data."""
    c = ck["config"]
    for k in ("optimizer", "batch_size", "seq_len", "seed", "data_seed"):
        if c.get(k) != getattr(tr.cfg, k):
            raise ValueError(f"--resume: the checkpoint's {k} is {c.get(k)!r}, this run's "
                             f"{getattr(tr.cfg, k)!r}")
    if ck["model_config"] != tr.gcfg.as_dict():
        raise ValueError("--resume: the checkpoint's model differs from this run's")
    if ck["data"]["fingerprint"] != tr.data.fingerprint:
        raise ValueError(f"--resume: the checkpoint was trained on other data "
                         f"({ck['data']['name']})")


def _model_and_optimizer_state(tr, ck: Dict[str, Any], path: Path) -> Dict[str, Any]:
    """Where this rank's model and optimizer state are: ``ck`` itself, or this rank's
    shard file for a sharded (FSDP) checkpoint, which needs as many FSDP ranks."""
    if ck.get("sharded") and "dcp" in ck:
        return _load_dcp(tr, path.with_name(ck["dcp"]))
    if ck.get("sharded"):       # (per-rank shard files, before the DCP directories)
        if not tr.fsdp or ck["world_size"] != tr.world:
            raise ValueError(f"--resume: the checkpoint is sharded over {ck['world_size']} "
                             f"FSDP ranks: resume with --parallel fsdp on as many")
        return torch.load(shard_file(path, tr.rank), map_location=tr.dev, weights_only=False)
    if tr.fsdp:
        raise ValueError("--resume: the checkpoint is not sharded: resume without "
                         "--parallel fsdp")
    return ck


def _load_dcp(tr, d: Path) -> Dict[str, Any]:
    """The model and optimizer state of DCP directory ``d`` laid out as this run holds
    them (FSDP over this run's ranks, or whole): read into copies of this run's own state
    dicts (``dcp.load`` writes into the tensors it is given, and those alias the model and
    the optimizer), so nothing changes before ``load_state_dict`` has checked them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.utils._pytree import tree_map_only
    if not d.is_dir():
        raise FileNotFoundError(f"--resume: the checkpoint's sharded state {d} is missing")
    msd, osd = get_state_dict(tr.raw, tr.opt)
    both = tree_map_only(torch.Tensor, lambda t: t.detach().clone(),
                         {"model": msd, "optimizer": osd})
    one = not (dist.is_available() and dist.is_initialized())
    with warnings.catch_warnings():     # (one process: DCP says so, and that is the intent)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(both, checkpoint_id=str(d), no_dist=one)
    return {"model": both["model"], "optimizer": both["optimizer"], "dcp": True}


def load_checkpoint(tr, path: Path) -> None:
    """Continue from ``path``.  Everything is checked before the model or the optimizer
    changes."""
    if not path.is_file():
        raise FileNotFoundError(f"--resume: no checkpoint at {path}")
    ck = torch.load(path, map_location="cpu", weights_only=False)
    check_resumable(tr, ck)
    state = _model_and_optimizer_state(tr, ck, path)
    if state.get("dcp"):        # (keys are names: the state-dict helpers map them)
        from torch.distributed.checkpoint.state_dict import set_state_dict
        set_state_dict(tr.raw, tr.opt, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
    else:
        tr.raw.load_state_dict(state["model"])
        tr.opt.load_state_dict(state["optimizer"])
    if tr.cfg.optimizer == "ivon-opt":
        tr.opt.current_step = int(state["opt_step"])
    tr.step, tr.data_pos = int(ck["step"]), int(ck["data_pos"])
    tr.tokens, tr.evals = int(ck["tokens"]), int(ck["evals"])
    tr.history = list(ck["history"])
    rngs = ck["rng"]
    _set_rng_state(rngs[tr.rank] if tr.rank < len(rngs) else rngs[0], tr.dev)
    tr._log(f"resumed from {path} at step {tr.step}")


# --------------------------------------------------------------------------- gathered
def full_state(tr) -> Dict[str, Any]:
    """Model and optimizer state as one process would hold them: sharded tensors are
    gathered (a collective: every rank calls it)."""
    from .._layout import is_sharded
    model = {k: (v.full_tensor() if is_sharded(v) else v).detach().cpu()
             for k, v in tr.raw.state_dict().items()}
    sd = tr.opt.state_dict()
    if tr.fsdp:         # (the state of sharded parameters is DTensors, as they are)
        sd["state"] = {i: ({k: v.full_tensor() if is_sharded(v) else v for k, v in s.items()}
                           if isinstance(s, dict) else s) for i, s in sd["state"].items()}
    return {"model": model, "optimizer": sd}
