"""The pretraining loop: :class:`Trainer` (see :mod:`poco_kernels.experiments.pretrain`
for what one step does).  Its set-up is in :mod:`.pretrain_setup`, its checkpoints in
:mod:`.pretrain_checkpoint`, what it prints and writes in :mod:`.pretrain_report`."""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .continual import load_model_state
from .gpt import GPT
from .lm_data import TokenData, load_tokens
from .pretrain_checkpoint import full_state, load_checkpoint, save_checkpoint
from .pretrain_config import RunConfig, alpha_at, lr_at, validate_config
from .pretrain_report import progress_line, start_line, summarize, write_log
from .pretrain_setup import init_distributed, init_optimizer_from, load_init_checkpoint, \
    make_optimizer, model_config, pick_device, sequence_length, shard_model, split_batch, \
    sync_device, wrap_ddp

__all__ = ["Trainer"]


class Trainer:
    """One pretraining run (:mod:`poco_kernels.experiments.pretrain`).  ``train()``
    returns the summary."""

    def __init__(self, cfg: RunConfig, data: Optional[TokenData] = None):
        validate_config(cfg)
        self.cfg = cfg
        self.rank, self.world, local = init_distributed(cfg.device)
        self.dev = pick_device(cfg.device, local)
        self.rows, self.accum = split_batch(cfg, self.world)
        self.amp = cfg.amp == "bf16" or (cfg.amp == "auto" and self.dev.type == "cuda")
        self.data = data if data is not None else load_tokens(cfg.data)
        self.data_seed = cfg.seed if cfg.data_seed is None else cfg.data_seed
        init_ckpt = load_init_checkpoint(cfg.init_from) if cfg.init_from else None
        self.gcfg = model_config(cfg, init_ckpt)
        self.seq = sequence_length(cfg, self.gcfg, self.data)
        self._build(init_ckpt)
        # loop state
        self.step = 0                # optimizer steps taken
        self.data_pos = 0            # global train mini-batches drawn
        self.tokens = 0              # tokens forwarded and backwarded (all ranks)
        self.evals = 0               # gradient evaluations, in mini-batches
        self.history: List[Dict[str, Any]] = []
        self.out = Path(cfg.out_dir or os.path.join("pretrain_out", cfg.optimizer))
        if cfg.resume:
            load_checkpoint(self, self.out / "ckpt.pt")

    def _build(self, init_ckpt: Optional[Dict[str, Any]]) -> None:
        """The model (``raw``; ``model``: compiled and/or in DDP), sharded with FSDP2
        (``--parallel fsdp`` on several ranks), and its optimizer; from ``init_ckpt``
        (``--init-from``) when given."""
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        self.raw = GPT(self.gcfg).to(self.dev)
        if init_ckpt is not None:
            load_model_state(self.raw, init_ckpt["model"])
        self.model = self.raw
        self.fsdp = self.world > 1 and cfg.parallel == "fsdp"
        if self.fsdp:
            shard_model(self.raw, self.dev, self.world)
        self.opt = make_optimizer(cfg, self.raw, self.dev, self.fsdp)
        if init_ckpt is not None:
            init_optimizer_from(self.opt, cfg, init_ckpt, self._log)
        if cfg.compile:
            self.model = torch.compile(self.model)
        self.ddp = None
        if self.world > 1 and not self.fsdp:
            self.ddp = wrap_ddp(self.model, self.dev)
            self.model = self.ddp

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
                sync_device(self.dev)
                t0 = time.perf_counter()
            with ctx:
                with self._autocast():
                    _, loss = self.model(x, y)
                (loss / self.accum).backward()
            if self.cfg.time_split:
                sync_device(self.dev)
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
        """Optimizer step ``it`` on the next global mini-batch; returns the rank's loss."""
        lr = lr_at(self.cfg, it)
        for g in self.opt.param_groups:
            g["lr"] = lr
        name = self.cfg.optimizer
        if name == "adamw":
            loss = self._adamw_step(self.data_pos)
        elif name == "ivon-opt":
            loss = self._ivon_opt_step(self.data_pos)
        else:
            loss = self._ivon_step(it, self.data_pos)
        self.data_pos += 1
        self.step = it + 1
        return loss

    def _adamw_step(self, index: int) -> torch.Tensor:
        opt = self.opt
        opt.zero_grad(set_to_none=True)
        loss = self._backward(index)
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.raw.parameters(), self.cfg.grad_clip)
        opt.step()
        return loss

    def _ivon_opt_step(self, index: int) -> torch.Tensor:
        opt = self.opt
        loss = torch.zeros((), device=self.dev)
        for _ in range(self.cfg.mc_samples):
            opt.zero_grad(set_to_none=True)
            with opt.sampled_params(train=True):
                loss += self._backward(index) / self.cfg.mc_samples
        opt.step()
        return loss

    def _ivon_step(self, it: int, index: int) -> torch.Tensor:
        """IVON, or IVON-PoCoMo: its alpha and, when due, a refresh first; then global
        mini-batch ``index`` (the data position before the refresh, whose mega-batch
        starts there) at the inner sample and, once the correction is active, at the
        outer sample too."""
        opt = self.opt
        if self.cfg.optimizer == "ivon-pocomo":
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

    def full_state(self) -> Dict[str, Any]:
        """Model and optimizer state as one process would hold them (a collective:
        every rank calls it); :func:`.pretrain_checkpoint.full_state`."""
        return full_state(self)

    # ------------------------------------------------------------------ the loop
    def _log(self, msg: str) -> None:
        if self.rank == 0 and not self.cfg.quiet:
            print(msg, flush=True)

    def train(self) -> Dict[str, Any]:
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        self._log(start_line(self))
        self._fb_time = 0.0
        last = self.step
        stop = cfg.max_steps if cfg.stop_after is None else min(cfg.max_steps, cfg.stop_after)
        sync_device(self.dev)
        mark = self._mark(self.step)
        t_start = mark[0]
        if self.step == 0 and not self.history:
            self._record(0, None, evaluate=True, rate=None)
        for it in range(self.step, stop):
            loss = self._train_step(it)
            done = it + 1
            do_eval = done % cfg.eval_every == 0 or done == cfg.max_steps
            if done % cfg.log_every == 0 or do_eval or done == stop:
                loss_g = float(self._global_mean(loss))
                sync_device(self.dev)
                rate = self._rate(mark, done)
                self._record(done, loss_g, evaluate=do_eval, rate=rate)
                mark = self._mark(done)
            if done % cfg.ckpt_every == 0 or done == stop:
                save_checkpoint(self, self.out / "ckpt.pt")
            last = done
        wall = time.perf_counter() - t_start
        summary = summarize(self, wall, last)
        if cfg.save_rank_states:
            torch.save(self.full_state(), self.out / f"rank{self.rank}.pt")
        if self.rank == 0:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def _mark(self, step: int) -> Tuple[float, int, float, int]:
        """The start of a logging interval: wall time, tokens, forward/backward time, and
        the optimizer steps taken."""
        return time.perf_counter(), self.tokens, self._fb_time, step

    def _rate(self, mark: Tuple[float, int, float, int], done: int) -> Dict[str, Any]:
        """Throughput since ``mark``: train tokens per second, all tokens (refreshes and
        outer passes too) per second, ms per step and, with ``--time-split``, the share of
        wall time outside forward/backward."""
        cfg = self.cfg
        t_mark, tok_mark, fb_mark, step_mark = mark
        dt = time.perf_counter() - t_mark
        return dict(tok_s=(done - step_mark) * cfg.batch_size * self.seq / dt,
                    all_tok_s=(self.tokens - tok_mark) / dt,
                    step_ms=1e3 * dt / (done - step_mark),
                    opt_share=(1.0 - (self._fb_time - fb_mark) / dt)
                    if cfg.time_split else None)

    def _record(self, step, loss, evaluate, rate) -> None:
        """A row of the log at ``step`` (evaluating first if asked); rank 0 rewrites
        ``log.csv`` and prints the progress line."""
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
            write_log(self.out / "log.csv", self.history)
            self._log(progress_line(row, rate))
