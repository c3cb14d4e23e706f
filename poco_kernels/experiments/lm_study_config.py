"""The language-model study's settings (:mod:`.lm_study`): its scales, the correction
weight of the main arm and the alpha schedules."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

__all__ = ["Scale", "SCALES", "ALPHA", "SCHEDULES", "EVAL_SEED"]

EVAL_SEED = 1234567          # the validation windows: the same for every run and seed


@dataclass(frozen=True)
class Scale:
    """One size of the study."""
    name: str
    n_layer: int
    n_head: int
    n_embd: int
    seq_len: int
    batch: int                       # sequences per mini-batch (IVON-3x: 3x this)
    steps: int
    lr_warmup: int
    eval_every: int
    eval_batches: int                # mini-batches per curve point (fixed windows)
    final_eval_batches: int          # mini-batches of the final evaluation
    seeds: int
    start: int                       # the main correction start
    starts: Tuple[int, ...]          # claim (a): correction starts
    early: int                       # the alpha schedules' correction start
    refresh_every: int
    mega_batches: int
    alphas: Tuple[float, ...]        # constant alphas besides 0 (IVON) and ALPHA
    refreshes: Tuple[int, ...]       # refresh intervals besides refresh_every
    adamw_lrs: Tuple[float, ...]
    ivon_lrs: Tuple[float, ...]
    ivon_beta2: float                # 1 - 1/steps: the paper's horizon, 1e5 steps at 0.99999
    preset: str = "gpt-tiny"         # the GPT preset the sizes above override
    device: str = "cpu"
    decisive: bool = True            # False: a smoke scale, whose verdicts decide nothing
    ablations: bool = True           # False: claims (b), (c) and (a) only (no alpha,
    #                                  schedule or refresh arms: claims d-f "not run")
    vocab_size: Optional[int] = None     # the model's, where not the preset's
    block_size: Optional[int] = None     # the position table, where not the preset's
    budget_s: Optional[float] = None     # a device window: no run starts that the time
    #                                      model says would end after it (lm_study_time)
    jobs: Optional[int] = None           # runs at a time by default (None: 2 on the CPU,
    #                                      1 on a GPU); --jobs overrides


ALPHA = 0.7                          # the package's recipes (the paper's continual runs)
SCHEDULES = {"increasing": "0.2:0.8", "decreasing": "0.8:0.2", "one": "1.0"}

SCALES = {
    # 2 layers x 96 wide, context 64, 16 sequences: 0.29M weights, 1,024 tokens a step
    "full": Scale("full", 2, 4, 96, 64, 16, 1000, 50, 10, 4, 64, 3, 500, (250, 500, 750),
                  100, 10, 10, (0.2, 0.5, 0.9, 1.0), (2, 5, 25, 100),
                  (1e-3, 3e-3, 1e-2), (0.3, 1.0, 3.0), 0.999),
    # the pipeline in about a minute (tests): a smoke scale, its verdicts decide nothing
    "quick": Scale("quick", 1, 2, 32, 32, 8, 40, 4, 5, 2, 4, 3, 20, (10, 20, 30), 5, 5, 5,
                   (0.5, 1.0), (2, 20), (3e-3, 1e-2), (0.3, 1.0), 0.975, decisive=False),
    # the paper's ablation set-up on one GPU (App., pretraining): GPT-2 with 4 layers, 4
    # heads, 512 wide (33M weights with GPT-2's vocabulary), batch 64 x 128, about one
    # epoch of wikitext-103 (--data: nanoGPT's uint16 train.bin/val.bin), correction
    # after 5,000 steps; the paper's lrs and their neighbours
    "ablation-33m": Scale("ablation-33m", 4, 4, 512, 128, 64, 12_000, 500, 250, 20, 200, 3,
                          5000, (3000, 5000, 8000), 1000, 10, 10, (0.2, 0.5, 0.9, 1.0),
                          (2, 5, 25, 100), (3e-4, 6e-4, 1.2e-3), (0.1, 0.3, 1.0),
                          1 - 1 / 12_000, preset="gpt2-124m", device="cuda"),
    # one GPU for at most 8 minutes, claims (a)-(c) (docs/lm-study.md,
    # 'On a GPU, inside one device window'): GPT with 6 layers, 6 heads, 384 wide (10.7M
    # weights, byte vocabulary), context 256, 16 sequences (4,096 tokens) a step, 2,000
    # steps (8.2M tokens, 0.7 of the corpus); IVON-PoCoMo corrected from mid-run and from a
    # third; lrs swept over the CPU study's pick and the value below it (AdamW 1e-3: small
    # GPTs'; IVON 0.3: the paper's); four runs at a time (the steps are bound by the host's
    # launches, 15 ms each on the H200 of 2026-11-28, where the FLOP model gives the GPU
    # about 2 ms: not measured)
    "gpu-window": Scale("gpu-window", 6, 6, 384, 256, 16, 2000, 100, 50, 8, 64, 3, 1000,
                        (667, 1000), 100, 10, 10, (), (), (1e-3, 3e-3), (0.3, 1.0), 1 - 1 / 2000,
                        preset="gpt-small", device="cuda", ablations=False, vocab_size=256,
                        budget_s=450.0, jobs=4),
    # the window's pipeline on the CPU in well under a minute (tests): a smoke scale
    "quick-window": Scale("quick-window", 1, 2, 32, 32, 8, 30, 3, 5, 2, 4, 3, 15, (10, 15),
                          5, 5, 5, (), (), (1e-2,), (1.0,), 1 - 1 / 30, decisive=False,
                          ablations=False, budget_s=600.0),
}
