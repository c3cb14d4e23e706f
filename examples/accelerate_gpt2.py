"""IVON-PoCoMo under Hugging Face ``accelerate``: a tiny GPT-2 (built from a GPT2Config, no
download) on the package's built-in corpus, with gradient accumulation, refreshes and
``save_state``/``load_state``.

    python examples/accelerate_gpt2.py                        # one process
    accelerate launch --num_processes 2 --cpu examples/accelerate_gpt2.py   # DDP, gloo

Needs ``pip install "poco-kernels[hf]"`` (transformers, accelerate)."""
from __future__ import annotations

import argparse
import os

import torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel

import poco_kernels
from poco_kernels.experiments.lm_data import load_tokens
from poco_kernels.integrations import accelerate as pa


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out-dir", default="accelerate_out")
    p.add_argument("--resume", action="store_true", help="continue from --out-dir/state")
    a = p.parse_args(argv)
    acc = Accelerator(cpu=not torch.cuda.is_available())
    data = load_tokens("stdlib")
    seq, rows, micro = 64, 16, 2                    # 16 sequences a step, 2 micro-batches
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=seq, n_embd=64,
                                       n_layer=2, n_head=4))
    opt = poco_kernels.IVONPoCoMo(model.parameters(), lr=0.3, ess=1e7, beta2=0.999)
    model, opt = pa.prepare(acc, model, opt)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, a.steps)
    acc.register_for_checkpointing(sched)
    poco_start, refresh_every, mega = a.steps // 2, 5, 5
    state = os.path.join(a.out_dir, "state")

    def micro_batches(index):
        """This rank's rows of global mini-batch ``index``, as micro-batches."""
        per = rows // acc.num_processes
        x, y = data.batch("train", index, rows, seq, 0, acc.process_index * per,
                          (acc.process_index + 1) * per)
        return [(xs.to(acc.device), ys.to(acc.device))
                for xs, ys in zip(x.chunk(micro), y.chunk(micro))]

    def loss_fn(m, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(m(input_ids=x).logits.flatten(0, 1),
                                                 y.flatten())
    start, data_pos = 0, 0
    if a.resume:
        acc.load_state(state)
        start = pa.unwrap(opt).step_count
        data_pos = start + pa.unwrap(opt).refresh_count * mega
    for t in range(start, a.steps):
        if t >= poco_start and (t - poco_start) % refresh_every == 0:
            pa.refresh(acc, model, opt, [micro_batches(data_pos + c) for c in range(mega)],
                       loss_fn)
            data_pos += mega
        loss = pa.train_step(acc, model, opt, micro_batches(data_pos), loss_fn)
        data_pos += 1
        sched.step()
        if (t + 1) % 10 == 0:
            acc.print(f"step {t + 1}: train loss {loss.item():.4f}")
        if t + 1 == a.steps // 2:
            acc.save_state(state)
    model.eval()
    with torch.no_grad():
        x, y = data.batch("val", 0, 32, seq, 0)
        val = loss_fn(model, (x.to(acc.device), y.to(acc.device))).item()
    acc.print(f"validation loss {val:.4f} at the posterior mean after {a.steps} steps")
    acc.end_training()
    return val


if __name__ == "__main__":
    main()
