"""poco_kernels.integrations.lightning on the CPU with the fused C++ backend:
PoCoLightningModule equals the protocol loop on the same batches and resumes from an
epoch checkpoint bit for bit; a plain LightningModule trains IVON through Lightning's
closure exactly as opt.step(closure), and warns once that IVON-PoCoMo never refreshes
there."""
from __future__ import annotations

import pytest
import torch

import poco_kernels
from integration_common import _net


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
