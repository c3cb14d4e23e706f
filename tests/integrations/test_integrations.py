"""poco_kernels.integrations: the Hugging Face Trainer (PoCoTrainer), accelerate and
Lightning (PoCoLightningModule), on the CPU with the fused C++ backend.

* PoCoTrainer equals the package's sampling-protocol loop written by hand on the batches
  the Trainer drew (its micro-batches, its refresh mega-batches), bit for bit, and a
  checkpoint-resume cycle continues bit for bit; a plain Trainer refuses IVON-PoCoMo with
  a pointer to the integration and changes nothing;
* accelerate: save_state/load_state (safetensors) resumes bit for bit; 2 gloo ranks
  (DDP) stay bit-identical to each other and equal one process to float rounding;
* Lightning: PoCoLightningModule equals the protocol loop on the same batches and
  resumes from an epoch checkpoint bit for bit; a plain LightningModule trains IVON
  through Lightning's closure exactly as opt.step(closure);
* safetensors saves every parameter of a fused bucket once the state dict owns its
  storage (and drops them without); the examples run."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import poco_kernels
from poco_kernels.integrations import keep_state_dicts_separate, own_storage

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


# --------------------------------------------------------------------------- storage
def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def test_safetensors_keeps_every_parameter_of_a_fused_bucket(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    model = _net()
    poco_kernels.IVON(model.parameters(), lr=0.1, ess=10.0, backend="cpp")
    ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(ptrs) == 1                            # one flat bucket: the problem
    # without separate storage, safetensors keeps one name of the bucket at best
    try:
        st.save_model(model, str(tmp_path / "plain.safetensors"))
        plain = st.load_file(str(tmp_path / "plain.safetensors"))
        assert len(plain) < len(model.state_dict())
    except RuntimeError:
        pass                                         # or refuses outright
    handle = keep_state_dicts_separate(model)
    sd = model.state_dict()
    assert len({v.untyped_storage().data_ptr() for v in sd.values()}) == len(sd)
    st.save_model(model, str(tmp_path / "sep.safetensors"))
    twin = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    st.load_model(twin, str(tmp_path / "sep.safetensors"))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    handle.remove()
    assert len({v.untyped_storage().data_ptr() for v in model.state_dict().values()}) == 1


def test_own_storage_keeps_ties_and_leaves_owners_alone():
    w = torch.zeros(12)
    a, b = w[:6].view(2, 3), w[6:].view(2, 3)
    lone = torch.ones(4)
    sd = own_storage({"a": a, "tied": a, "b": b, "lone": lone, "step": 3})
    assert sd["a"] is sd["tied"] and sd["a"].untyped_storage().data_ptr() != \
        w.untyped_storage().data_ptr()
    assert sd["lone"] is lone and sd["step"] == 3 and torch.equal(sd["b"], b)


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


# --------------------------------------------------------------------------- accelerate
def _accelerate_run(steps, save_at=None, state_dir=None, load=False, backend="cpp"):
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from poco_kernels.integrations import accelerate as pa
    acc = Accelerator(cpu=True)
    model = _net()
    opt = poco_kernels.IVONPoCoMo(model.parameters(), lr=0.05, ess=64.0, alpha=0.7, seed=3,
                                  backend=backend)
    g = torch.Generator().manual_seed(1)
    X, y = torch.randn(64, 5, generator=g), torch.randn(64, 3, generator=g)
    model, opt = pa.prepare(acc, model, opt)

    def loss_fn(m, idx):
        return torch.nn.functional.mse_loss(m(X[idx]), y[idx])
    start = 0
    if load:
        acc.load_state(state_dir)
        start = save_at
    for t in range(start, steps):
        if t == save_at and not load:
            acc.save_state(state_dir)            # safetensors, accelerate's default
            return
        if t >= 3 and (t - 3) % 3 == 0:
            pa.refresh(acc, model, opt, [[torch.arange(16), torch.arange(16, 32)],
                                         [torch.arange(32, 64)]], loss_fn)
        idx = (torch.arange(8) + 8 * t) % 64
        pa.train_step(acc, model, opt, [idx[:4], idx[4:]], loss_fn)
    return [p.detach().clone() for p in model.parameters()], pa.unwrap(opt)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_accelerate_save_state_resumes_bit_for_bit(tmp_path, backend):
    ref, opt = _accelerate_run(10, backend=backend)
    assert opt.refresh_count == 3
    state = str(tmp_path / "state")
    _accelerate_run(10, save_at=5, state_dir=state, backend=backend)
    assert "model.safetensors" in os.listdir(state)
    got, _ = _accelerate_run(10, save_at=5, state_dir=state, load=True, backend=backend)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


def test_accelerate_helpers_equal_the_protocol_loop_bit_for_bit():
    got, opt_a = _accelerate_run(10)
    model = _net()
    opt = poco_kernels.IVONPoCoMo(model.parameters(), lr=0.05, ess=64.0, alpha=0.7, seed=3,
                                  backend="cpp")
    g = torch.Generator().manual_seed(1)
    X, y = torch.randn(64, 5, generator=g), torch.randn(64, 3, generator=g)

    def backward(idx, n):
        (torch.nn.functional.mse_loss(model(X[idx]), y[idx]) / n).backward()
    for t in range(10):
        if t >= 3 and (t - 3) % 3 == 0:
            with opt.sampled("refresh", accumulate=False):
                for chunk in ([torch.arange(16), torch.arange(16, 32)], [torch.arange(32, 64)]):
                    for idx in chunk:
                        backward(idx, len(chunk))
                    opt.accumulate()
            opt.refresh()
        idx = (torch.arange(8) + 8 * t) % 64
        for kind in ["inner"] + (["outer"] if opt.correction_active() else []):
            with opt.sampled(kind):
                backward(idx[:4], 2)
                backward(idx[4:], 2)
        opt.step()
    assert opt.refresh_count == opt_a.refresh_count == 3
    for a, b in zip(got, model.parameters()):
        assert torch.equal(a, b)


def test_accelerate_train_step_is_the_step_an_lr_scheduler_sees():
    """An lr scheduler over the prepared optimizer, stepped after each ``train_step``
    (the right order): torch's check that ``optimizer.step()`` came first sees the
    step, so no 'lr_scheduler.step() before optimizer.step()' warning; the schedule
    reaches the package's optimizer."""
    pytest.importorskip("accelerate")
    import warnings
    from accelerate import Accelerator
    from poco_kernels.integrations import accelerate as pa
    acc = Accelerator(cpu=True)
    model = _net()
    opt = poco_kernels.IVONPoCoMo(model.parameters(), lr=0.05, ess=64.0, seed=3,
                                  backend="torch")
    g = torch.Generator().manual_seed(1)
    X, y = torch.randn(16, 5, generator=g), torch.randn(16, 3, generator=g)
    model, opt = pa.prepare(acc, model, opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def loss_fn(m, idx):
        return torch.nn.functional.mse_loss(m(X[idx]), y[idx])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=r"(?s).*optimizer\.step\(\)")
        for t in range(3):
            idx = torch.arange(8) + 8 * (t % 2)
            pa.train_step(acc, model, opt, [idx[:4], idx[4:]], loss_fn)
            sched.step()
    inner = pa.unwrap(opt)
    assert inner.step_count == 3
    assert inner.param_groups[0]["lr"] == pytest.approx(0.05 * 0.5 ** 3)


@pytest.mark.long
def test_accelerate_ddp_two_ranks_equal_one_process(tmp_path):
    pytest.importorskip("accelerate")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT] + [p for p in os.environ.get(
                   "PYTHONPATH", "").split(os.pathsep) if p]))
    for world in (1, 2):
        r = subprocess.run([sys.executable, os.path.join(HERE, "accelerate_ranks.py"),
                            str(world), str(tmp_path / f"w{world}")], env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    one = torch.load(tmp_path / "w1" / "rank0.pt")
    r0, r1 = (torch.load(tmp_path / "w2" / f"rank{i}.pt") for i in range(2))
    assert one["refreshes"] == r0["refreshes"] == 3 and r0["steps"] == 10
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b)                     # the ranks agree bit for bit
    for k in r0["state"]:
        assert all(torch.equal(r0["state"][k][n], r1["state"][k][n]) for n in r0["state"][k])
    for a, b in zip(one["params"], r0["params"]):    # DDP's mean over ranks: rounding only
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        assert not torch.equal(a, torch.zeros_like(a))


# --------------------------------------------------------------------------- examples
@pytest.mark.parametrize("name", ["hf_trainer_gpt2", "accelerate_gpt2", "lightning_gpt2"])
def test_the_examples_run(name, tmp_path):
    pytest.importorskip("transformers")
    if name.startswith("lightning"):
        pytest.importorskip("lightning")
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples",
                                                                     name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    short = ["--steps-per-epoch", "2"] if name.startswith("lightning") else ["--steps", "4"]
    out = mod.main(short + ["--out-dir", str(tmp_path)])
    loss = out["eval_loss"] if isinstance(out, dict) else out
    assert 0.0 < loss < 10.0


# --------------------------------------------------------------------------- Lightning
def _lightning_module():
    pytest.importorskip("lightning")
    from poco_kernels.integrations.lightning import PoCoLightningModule
    g = torch.Generator().manual_seed(1)
    X, y = torch.randn(64, 5, generator=g), torch.randn(64, 3, generator=g)

    class Regression(PoCoLightningModule):
        poco_start, refresh_every = 2, 3

        def __init__(self, backend="cpp"):
            super().__init__()
            self.net = _net()
            self.backend = backend
            self.data = (X, y)

        def poco_loss(self, batch):
            xb, yb = batch
            return torch.nn.functional.mse_loss(self.net(xb), yb)

        def poco_micro_batches(self, batch):
            xb, yb = batch
            return [(xb[:4], yb[:4]), (xb[4:], yb[4:])]

        def poco_mega_batch(self, index):
            idx = torch.randperm(64, generator=torch.Generator().manual_seed(100 + index))
            return [[(X[c], y[c])] for c in idx[:32].chunk(2)]

        def configure_optimizers(self):
            opt = poco_kernels.IVONPoCoMo(self.net.parameters(), lr=0.05, ess=64.0, alpha=0.7,
                                          seed=3, backend=self.backend)
            return {"optimizer": opt, "lr_scheduler": {
                "scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1 / (1 + 0.1 * t)),
                "interval": "step"}}

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y),
                                               batch_size=8, shuffle=False)
    return Regression


def _lightning_trainer(out, epochs, **kw):
    import lightning.pytorch as pl
    return pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(out), **kw)


def test_lightning_equals_the_protocol_loop_and_resumes_bit_for_bit(tmp_path):
    Regression = _lightning_module()
    from lightning.pytorch.callbacks import ModelCheckpoint
    model = Regression()
    _lightning_trainer(tmp_path / "a", 2, enable_checkpointing=False).fit(model)
    inner = model.trainer.strategy.optimizers[0].optimizer
    assert inner.step_count == 16 and inner.refresh_count == 5     # 2, 5, 8, 11, 14
    # the hand-written protocol loop on the same batches
    twin = Regression()
    opt = twin.configure_optimizers()["optimizer"]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1 / (1 + 0.1 * t))
    batches = list(twin.train_dataloader()) * 2
    for t, batch in enumerate(batches):
        if t >= 2 and (t - 2) % 3 == 0:
            with opt.sampled("refresh", accumulate=False):
                for chunk in twin.poco_mega_batch(opt.refresh_count):
                    for mb in chunk:
                        twin.poco_loss(mb).backward()
                    opt.accumulate()
            opt.refresh()
        for kind in ["inner"] + (["outer"] if opt.correction_active() else []):
            with opt.sampled(kind):
                for mb in twin.poco_micro_batches(batch):
                    (twin.poco_loss(mb) / 2).backward()
        opt.step()
        sched.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    # one epoch, a checkpoint, the second epoch from it
    first = Regression()
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)
    _lightning_trainer(tmp_path / "b", 1, callbacks=[ckpt]).fit(first)
    resumed = Regression()
    _lightning_trainer(tmp_path / "c", 2, enable_checkpointing=False).fit(
        resumed, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def _plain_lightning(make_optimizer, data):
    """A plain LightningModule (automatic optimization) over ``_net()``."""
    import lightning.pytorch as pl

    class Plain(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _net()

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return make_optimizer(self.net.parameters())

        def train_dataloader(self):
            return torch.utils.data.DataLoader(data, batch_size=8)
    return Plain


def test_lightning_automatic_optimization_runs_ivon_through_its_closure(tmp_path):
    """Lightning hands step() a closure (forward, backward): IVON evaluates it at its
    sample, so a plain LightningModule trains IVON exactly as opt.step(closure) does.
    (IVON-PoCoMo's refreshes need PoCoLightningModule.)"""
    pytest.importorskip("lightning")
    data = torch.utils.data.TensorDataset(torch.randn(32, 5, generator=torch.Generator()
                                                      .manual_seed(2)),
                                          torch.randn(32, 3, generator=torch.Generator()
                                                      .manual_seed(3)))
    Plain = _plain_lightning(lambda ps: poco_kernels.IVON(ps, lr=0.05, ess=64.0, seed=3,
                                                          backend="cpp"), data)
    m = Plain()
    _lightning_trainer(tmp_path, 2, enable_checkpointing=False).fit(m)
    twin = Plain()
    opt = twin.configure_optimizers()
    for batch in list(twin.train_dataloader()) * 2:
        def closure():
            opt.zero_grad()
            loss = twin.training_step(batch, 0)
            loss.backward()
            return loss
        opt.step(closure)
    assert opt.step_count == 8
    for a, b in zip(m.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_lightning_automatic_optimization_warns_that_pocomo_never_refreshes(tmp_path):
    pytest.importorskip("lightning")
    data = torch.utils.data.TensorDataset(torch.randn(16, 5), torch.randn(16, 3))
    Plain = _plain_lightning(lambda ps: poco_kernels.IVONPoCoMo(ps, lr=0.05, ess=64.0), data)
    with pytest.warns(UserWarning, match="PoCoLightningModule") as rec:
        _lightning_trainer(tmp_path, 1, enable_checkpointing=False).fit(Plain())
    assert sum("PoCoLightningModule" in str(w.message) for w in rec) == 1     # once
