"""poco_kernels.integrations.hf: the Hugging Face Trainer (PoCoTrainer) on the CPU with
the fused C++ backend.  PoCoTrainer equals the package's sampling-protocol loop written by
hand on the batches the Trainer drew (its micro-batches, its refresh mega-batches), bit
for bit, and a checkpoint-resume cycle continues bit for bit; it runs IVON, and under bf16
autocast with gradient clipping; a plain Trainer refuses IVON-PoCoMo with a pointer to the
integration and changes nothing."""
from __future__ import annotations

import pytest
import torch

import poco_kernels


# --------------------------------------------------------------------------- HF Trainer
def _hf_setup(out, trainer_cls, steps=8, optimizer="ivon-pocomo", **extra_args):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    class Tokens(torch.utils.data.Dataset):
        def __init__(self):
            self.x = torch.randint(64, (256, 16), generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"input_ids": self.x[i], "labels": self.x[i]}

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2,
                                       n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0))
    cls = poco_kernels.IVONPoCoMo if optimizer == "ivon-pocomo" else poco_kernels.IVON
    opt = cls(model.parameters(), lr=0.05, ess=1e4, seed=3, backend="cpp")
    args = TrainingArguments(str(out), max_steps=steps, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, learning_rate=0.05, seed=0,
                             save_strategy="steps", save_steps=4, logging_steps=4,
                             report_to=[], use_cpu=True, lr_scheduler_type="cosine",
                             warmup_steps=2, max_grad_norm=0.0, disable_tqdm=True,
                             **extra_args)
    kw = dict(poco_start=2, refresh_every=3, mega_batches=2) if trainer_cls.__name__ != \
        "Trainer" else {}
    return trainer_cls(model=model, args=args, train_dataset=Tokens(),
                       data_collator=lambda rows: {k: torch.stack([r[k] for r in rows])
                                                   for k in rows[0]},
                       optimizers=(opt, None), **kw)


def _recording_trainer():
    from poco_kernels.integrations.hf import PoCoTrainer

    class Recording(PoCoTrainer):
        """Notes every micro-batch and mega-batch the Trainer draws."""
        def training_step(self, model, inputs, num_items_in_batch=None):
            self.rec.setdefault(self.state.global_step, {"inner": [], "mega": None})
            self.rec[self.state.global_step]["inner"].append((inputs, num_items_in_batch))
            return super().training_step(model, inputs, num_items_in_batch)

        def _mega_batch(self, index):
            chunks = super()._mega_batch(index)
            self.rec.setdefault(self.state.global_step, {"inner": [], "mega": None})
            self.rec[self.state.global_step]["mega"] = [
                (c, self._num_items(c)) for c in chunks]
            return chunks
    return Recording


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    tr = _hf_setup(out, _recording_trainer())
    tr.rec = {}
    tr.train()
    return out, tr


def test_pocotrainer_equals_the_protocol_loop_bit_for_bit(hf_run):
    from transformers import GPT2Config, GPT2LMHeadModel
    _, tr = hf_run
    opt_t = tr.poco_optimizer
    assert opt_t.step_count == 8 and opt_t.refresh_count == 2       # refreshes at 2 and 5
    assert sorted(t for t, s in tr.rec.items() if s["mega"]) == [2, 5]
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2,
                                       n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0))
    model.train()
    opt = poco_kernels.IVONPoCoMo(model.parameters(), lr=0.05, ess=1e4, seed=3,
                                  backend="cpp")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, tr.lr_scheduler.lr_lambdas[0])

    def backward(inputs, n):
        model(**inputs, num_items_in_batch=n).loss.backward()
    for t in sorted(tr.rec):
        step = tr.rec[t]
        if step["mega"]:
            with opt.sampled("refresh", accumulate=False):
                for chunk, n in step["mega"]:
                    for mb in chunk:
                        backward(mb, n)
                    opt.accumulate()
            opt.refresh()
        with opt.sampled("inner"):
            for inputs, n in step["inner"]:
                backward(inputs, n)
        if opt.correction_active():
            with opt.sampled("outer"):
                for inputs, n in step["inner"]:
                    backward(inputs, n)
        opt.step()
        sched.step()
        opt.zero_grad()
    for a, b in zip(tr.model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert all(torch.equal(opt.state[p][k], opt_t.state[q][k]) for p, q in
               zip(model.parameters(), tr.model.parameters()) for k in opt.state[p])


def test_pocotrainer_resumes_from_a_checkpoint_bit_for_bit(hf_run, tmp_path):
    from poco_kernels.integrations.hf import PoCoTrainer
    out, tr = hf_run
    assert (out / "checkpoint-4" / "model.safetensors").exists()
    again = _hf_setup(out, PoCoTrainer)
    again.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert again.poco_optimizer.refresh_count == 2
    for a, b in zip(tr.model.parameters(), again.model.parameters()):
        assert torch.equal(a, b)


def test_pocotrainer_runs_ivon_without_refreshes(tmp_path):
    from poco_kernels.integrations.hf import PoCoTrainer
    tr = _hf_setup(tmp_path, PoCoTrainer, steps=3, optimizer="ivon")
    before = [p.detach().clone() for p in tr.model.parameters()]
    tr.train()
    assert type(tr.poco_optimizer).__name__ == "IVON" and tr.poco_optimizer.step_count == 3
    assert not any(torch.equal(a, b) for a, b in zip(before, tr.model.parameters()))


def test_pocotrainer_under_bf16_autocast_and_gradient_clipping(tmp_path):
    """bf16 autocast (the Trainer's) over the inner, outer and refresh passes, and the
    Trainer's clipping inside each sample: the run completes, corrected, finite."""
    from poco_kernels.integrations.hf import PoCoTrainer
    tr = _hf_setup(tmp_path, PoCoTrainer, steps=3, bf16=True)
    tr.args.max_grad_norm = 0.5
    out = tr.train()
    assert tr.poco_optimizer.refresh_count == 1 and tr.poco_optimizer.correction_active()
    assert torch.isfinite(torch.tensor(out.training_loss))
    assert all(torch.isfinite(p).all() for p in tr.model.parameters())


def test_a_plain_trainer_refuses_ivon_and_points_to_the_integration(tmp_path):
    from transformers import Trainer
    tr = _hf_setup(tmp_path, Trainer, steps=2)
    before = [p.detach().clone() for p in tr.model.parameters()]
    with pytest.raises(RuntimeError, match="poco_kernels.integrations.hf.PoCoTrainer"):
        tr.train()
    assert all(torch.equal(a, b) for a, b in zip(before, tr.model.parameters()))
