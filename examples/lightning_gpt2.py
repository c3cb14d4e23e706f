"""IVON-PoCoMo in PyTorch Lightning: a tiny GPT-2 (built from a GPT2Config, no download) on
the package's built-in corpus, with PoCoLightningModule (manual optimization running the
sampling protocol), a checkpoint at the end of each epoch and ``--resume``.

    python examples/lightning_gpt2.py
    python examples/lightning_gpt2.py --epochs 3 --resume      # one more epoch

Needs ``pip install "poco-kernels[lightning,hf]"`` (lightning; transformers for GPT2)."""
from __future__ import annotations

import argparse
import os

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from transformers import GPT2Config, GPT2LMHeadModel

import poco_kernels
from poco_kernels.experiments.lm_data import load_tokens
from poco_kernels.integrations.lightning import PoCoLightningModule

SEQ, ROWS = 64, 16


class TinyGPT(PoCoLightningModule):
    refresh_every = 5

    def __init__(self, steps_per_epoch: int, poco_start: int):
        super().__init__()
        torch.manual_seed(0)
        self.gpt = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=64,
                                              n_layer=2, n_head=4))
        self.data = load_tokens("stdlib")
        self.steps_per_epoch = steps_per_epoch
        self.poco_start = poco_start

    def _batch(self, split, index, rows=ROWS):
        x, y = self.data.batch(split, index, rows, SEQ, 0)
        return x.to(self.device), y.to(self.device)

    def poco_loss(self, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.gpt(input_ids=x).logits.flatten(0, 1),
                                                 y.flatten())

    def poco_micro_batches(self, batch):            # 2 micro-batches of 8 sequences
        x, y = batch
        return list(zip(x.chunk(2), y.chunk(2)))

    def poco_mega_batch(self, index):               # 5 mini-batches, from their own stream
        return [self.poco_micro_batches(self._batch("train", 10**6 + 5 * index + c))
                for c in range(5)]

    def train_dataloader(self):
        xs = [self.data.batch("train", i, ROWS, SEQ, 0) for i in range(self.steps_per_epoch)]
        return torch.utils.data.DataLoader(xs, batch_size=None, shuffle=False)

    def configure_optimizers(self):
        return poco_kernels.IVONPoCoMo(self.parameters(), lr=0.3, ess=1e7, beta2=0.999)

    def validate(self) -> float:
        self.eval()
        with torch.no_grad():
            return self.poco_loss(self._batch("val", 0, 32)).item()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--steps-per-epoch", type=int, default=20)
    p.add_argument("--out-dir", default="lightning_out")
    p.add_argument("--resume", action="store_true", help="continue from --out-dir/last.ckpt")
    a = p.parse_args(argv)
    model = TinyGPT(a.steps_per_epoch, poco_start=a.steps_per_epoch)   # correct epoch 2 on
    trainer = pl.Trainer(max_epochs=a.epochs, accelerator="auto", devices=1, logger=False,
                         enable_progress_bar=False, default_root_dir=a.out_dir,
                         callbacks=[ModelCheckpoint(dirpath=a.out_dir, save_last=True)])
    ckpt = os.path.join(a.out_dir, "last.ckpt") if a.resume else None
    trainer.fit(model, ckpt_path=ckpt)
    val = model.validate()                           # at the posterior mean
    opt = trainer.strategy.optimizers[0].optimizer
    print(f"validation loss {val:.4f} after {opt.step_count} steps, "
          f"{opt.refresh_count} refreshes")
    return val


if __name__ == "__main__":
    main()
