"""GPT pretraining with AdamW, IVON or IVON-PoCoMo: the paper's LLM set-up (Sec. 5.2,
App. on pretraining and continual pretraining), single process or data parallel.

    python -m poco_kernels.experiments.pretrain --optimizer ivon-pocomo
    torchrun --nproc_per_node 8 -m poco_kernels.experiments.pretrain --recipe gpt2 \\
        --data data/openwebtext --optimizer ivon-pocomo

``--optimizer``: ``adamw`` (``torch.optim.AdamW``, fused on CUDA), ``ivon`` and
``ivon-pocomo`` (this package's ``IVON`` / ``IVONPoCo``), ``ivon-opt`` (ivon-opt 0.1.3's
IVON, its authors' implementation, e.g. to produce checkpoints for continual
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
with FSDP2 (docs/pretraining.md, 'FSDP2', for what that supports).

Outputs in ``--out-dir`` (default ``pretrain_out/<optimizer>``): ``log.csv`` (step, lr,
alpha, train loss, val loss and perplexity, tokens, tokens per second, optimizer share),
``summary.json``, ``ckpt.pt``.

The code, by role: :mod:`.pretrain_config` (recipes, :class:`RunConfig`, schedules, the
flags), :mod:`.pretrain_setup` (processes, model, optimizer), :mod:`.pretrain_loop` (the
:class:`Trainer`), :mod:`.pretrain_checkpoint` (save, check, resume) and
:mod:`.pretrain_report` (printed lines, ``log.csv``, the summary, the comparison); this
module is the entry point.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, List

import torch.distributed as dist

# OPTIMIZERS, validate_config, parse_alpha, lr_at, alpha_at and init_distributed: still
# importable from here, as before the split
from .pretrain_config import OPTIMIZERS, RECIPES, RunConfig, alpha_at, build_parser, lr_at, \
    parse_alpha, resolve_config, validate_config  # noqa: F401
from .pretrain_loop import Trainer
from .pretrain_report import comparison_table
from .pretrain_setup import dist_info, init_distributed  # noqa: F401

__all__ = ["RunConfig", "RECIPES", "Trainer", "resolve_config", "main"]


def main(argv=None) -> List[Dict[str, Any]]:
    args = vars(build_parser().parse_args(argv))
    names = [s.strip() for s in args.pop("optimizer").split(",") if s.strip()]
    recipe = args.pop("recipe")
    out_dir = args.pop("out_dir")
    summaries = []
    for name in names:
        od = out_dir if (out_dir and len(names) == 1) else \
            (os.path.join(out_dir, name) if out_dir else None)
        cfg = resolve_config(name, recipe, out_dir=od, **args)
        summaries.append(Trainer(cfg).train())
    rank, _ = dist_info()
    if rank == 0 and len(summaries) > 1:
        print("\n" + comparison_table(summaries))
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return summaries


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
