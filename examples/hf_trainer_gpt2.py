"""IVON-PoCoMo inside the Hugging Face Trainer: a tiny GPT-2 (built from a GPT2Config, no
download) on the package's built-in corpus (Python's standard library as bytes).

    python examples/hf_trainer_gpt2.py                 # 40 steps, a checkpoint every 20
    python examples/hf_trainer_gpt2.py --resume        # continue from the last checkpoint

Needs ``pip install "poco-kernels[hf]"`` (transformers, accelerate)."""
from __future__ import annotations

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

import poco_kernels
from poco_kernels.experiments.lm_data import load_tokens
from poco_kernels.integrations.hf import PoCoTrainer


class Windows(torch.utils.data.Dataset):
    """Fixed windows of a token split: item i is ``{"input_ids", "labels"}`` (the model
    shifts the labels itself)."""

    def __init__(self, tokens, n: int, seq: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.from_numpy(tokens.astype("int64"))
        self.starts = torch.randint(len(tokens) - seq, (n,), generator=g)
        self.seq = seq

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        x = self.tokens[self.starts[i]:self.starts[i] + self.seq]
        return {"input_ids": x, "labels": x}


def collate(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out-dir", default="hf_trainer_out")
    p.add_argument("--resume", action="store_true")
    a = p.parse_args(argv)
    data = load_tokens("stdlib")
    seq = 64
    train = Windows(data.train, 4096, seq, seed=0)
    val = Windows(data.val, 64, seq, seed=1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=seq, n_embd=64,
                                       n_layer=2, n_head=4))
    opt = poco_kernels.IVONPoCoMo(model.parameters(), lr=0.3, ess=1e7, beta2=0.999)
    args = TrainingArguments(a.out_dir, max_steps=a.steps, per_device_train_batch_size=8,
                             gradient_accumulation_steps=2, learning_rate=0.3,
                             lr_scheduler_type="cosine", warmup_steps=5, max_grad_norm=0.0,
                             eval_strategy="steps", eval_steps=a.steps // 2,
                             save_strategy="steps", save_steps=a.steps // 2,
                             logging_steps=10, report_to=[], use_cpu=True, seed=0)
    trainer = PoCoTrainer(model=model, args=args, train_dataset=train, eval_dataset=val,
                          data_collator=collate, optimizers=(opt, None),
                          poco_start=a.steps // 2, refresh_every=5, mega_batches=5)
    trainer.train(resume_from_checkpoint=True if a.resume else None)
    metrics = trainer.evaluate()                       # at the posterior mean
    print(f"validation loss {metrics['eval_loss']:.4f} after "
          f"{trainer.poco_optimizer.step_count} steps, "
          f"{trainer.poco_optimizer.refresh_count} refreshes")
    return metrics


if __name__ == "__main__":
    main()
