"""Continual pretraining from ivon-opt (poco_kernels.experiments.continual, through the
pretraining run): a checkpoint of our run with ivon-opt or one in the IVON authors'
nanoGPT layout starts IVON-PoCoMo with its weights and optimizer state; bad checkpoints
are refused.  Small models on the CPU."""
import copy

import numpy as np
import pytest
import torch

from poco_kernels.experiments import continual as C
from poco_kernels.experiments import pretrain as P
from pretrain_runs import SMALL
from pretrain_runs import stdlib  # noqa: F401


# --------------------------------------------------------------------------- continual
def test_continual_from_ivon_opt(tmp_path):
    """Pretrain with ivon-opt, continue with IVON-PoCoMo: our h and momentum start as
    ivon-opt's, the step counter as its step count, the hyperparameters the continual
    recipe's; the run then trains."""
    P.main(SMALL + ["--optimizer", "ivon-opt", "--max-steps", "8", "--out-dir",
                    str(tmp_path / "src")])
    src = torch.load(tmp_path / "src" / "ckpt.pt", weights_only=False)
    cfg = P.resolve_config("ivon-pocomo", "continual", init_from=str(tmp_path / "src" / "ckpt.pt"),
                           batch_size=8, micro_batch=4, seq_len=16, max_steps=8, poco_start=2,
                           refresh_every=3, mega_batches=2, eval_every=4, log_every=4,
                           quiet=True, out_dir=str(tmp_path / "dst"))
    t = P.Trainer(cfg)
    assert t.gcfg.vocab_size == 256 and t.gcfg.n_layer == 2        # from the checkpoint
    for (name, p), q in zip(t.raw.state_dict().items(), src["model"].values()):
        assert torch.equal(p, q), name
    for g_ours, g_src in zip(t.opt.param_groups, src["optimizer"]["param_groups"]):
        h = torch.cat([t.opt.state[p]["h"].reshape(-1) for p in g_ours["params"]])
        m = torch.cat([t.opt.state[p]["momentum"].reshape(-1) for p in g_ours["params"]])
        assert torch.equal(h, g_src["hess"]) and torch.equal(m, g_src["momentum"])
        assert (g_ours["ess"], g_ours["beta2"], g_ours["lr"]) == (3e10, 0.9999, 0.04)
    assert not torch.equal(h, torch.full_like(h, 1e-3))              # ivon-opt moved it
    assert t.opt.step_count == 8 and t.opt.refresh_count == 0
    s = t.train()
    assert s["steps"] == 8 and np.isfinite(s["val_loss"]) and t.opt.refresh_count == 2


def test_continual_from_nanogpt_layout(tmp_path, stdlib):
    """A checkpoint as the IVON authors' nanoGPT runs save it: nanoGPT parameter names
    (compiled: _orig_mod.), model_args, iter_num, ivon-opt's state over nanoGPT's two
    parameter groups."""
    import ivon
    from poco_kernels.experiments.gpt import GPT
    cfg = P.resolve_config("ivon-pocomo", "cpu", preset="gpt-test", vocab_size=256,
                           out_dir=str(tmp_path / "x"))
    torch.manual_seed(5)
    model = GPT(P.Trainer(cfg, data=stdlib).gcfg)
    opt = ivon.IVON(C.decay_groups(model, 1e-4), lr=0.1, ess=1e6, hess_init=1e-3)
    x = torch.randint(256, (2, 16))
    for _ in range(3):
        with opt.sampled_params(train=True):
            opt.zero_grad()
            model(x, x)[1].backward()
        opt.step()
    ours_to_nano = {v: k for k, v in _nano_names(model).items()}
    nano = {"_orig_mod." + ours_to_nano[k]: v for k, v in model.state_dict().items()}
    nano["_orig_mod.transformer.h.0.attn.bias"] = torch.ones(1, 1, 16, 16)   # the mask
    margs = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, bias=True, vocab_size=256,
                 dropout=0.0)
    torch.save({"model": nano, "optimizer": opt.state_dict(), "model_args": margs,
                "iter_num": 3}, tmp_path / "nano.pt")
    t = P.Trainer(P.resolve_config("ivon-pocomo", "cpu", init_from=str(tmp_path / "nano.pt"),
                                   out_dir=str(tmp_path / "y"), quiet=True), data=stdlib)
    for k, v in model.state_dict().items():
        assert torch.equal(t.raw.state_dict()[k], v), k
    flat_h = torch.cat([t.opt.state[p]["h"].reshape(-1) for g in t.opt.param_groups
                        for p in g["params"]])
    assert torch.equal(flat_h, torch.cat([g["hess"] for g in opt.param_groups]))
    assert t.opt.step_count == 3


def _nano_names(model):
    """Our parameter names -> nanoGPT's, written out independently of continual.py."""
    out = {}
    for k in model.state_dict():
        n = k.replace("blocks.", "transformer.h.").replace(".ln1.", ".ln_1.") \
            .replace(".ln2.", ".ln_2.").replace(".attn.qkv.", ".attn.c_attn.") \
            .replace(".attn.proj.", ".attn.c_proj.").replace(".fc.", ".mlp.c_fc.") \
            .replace(".out.", ".mlp.c_proj.")
        n = {"wte.weight": "transformer.wte.weight", "wpe.weight": "transformer.wpe.weight",
             "ln_f.weight": "transformer.ln_f.weight", "ln_f.bias": "transformer.ln_f.bias",
             "head.weight": "lm_head.weight"}.get(n, n)
        out[n] = k
    return out


def test_continual_errors(tmp_path, stdlib):
    P.main(SMALL + ["--optimizer", "ivon-opt", "--max-steps", "2", "--out-dir",
                    str(tmp_path / "src")])
    ck = torch.load(tmp_path / "src" / "ckpt.pt", weights_only=False)
    bad = copy.deepcopy(ck)
    bad["optimizer"]["param_groups"][0]["hess"] = bad["optimizer"]["param_groups"][0]["hess"][:-1]
    torch.save(bad, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="elements"):
        P.Trainer(P.resolve_config("ivon-pocomo", "cpu", init_from=str(tmp_path / "bad.pt"),
                                   out_dir=str(tmp_path / "y"), quiet=True), data=stdlib)
    bad = copy.deepcopy(ck)
    del bad["opt_step"], bad["step"]
    torch.save(bad, tmp_path / "nostep.pt")
    with pytest.raises(ValueError, match="--init-step"):
        P.Trainer(P.resolve_config("ivon-pocomo", "cpu", init_from=str(tmp_path / "nostep.pt"),
                                   out_dir=str(tmp_path / "y"), quiet=True), data=stdlib)
    torch.save({k: v for k, v in ck.items() if k not in ("model", "optimizer")} | {"sharded": True},
               tmp_path / "sharded.pt")
    with pytest.raises(ValueError, match="sharded FSDP checkpoint"):
        P.Trainer(P.resolve_config("ivon-pocomo", "cpu", init_from=str(tmp_path / "sharded.pt"),
                                   out_dir=str(tmp_path / "y"), quiet=True), data=stdlib)
    bad = copy.deepcopy(ck)
    bad["model"]["blocks.0.fc.weight"] = bad["model"]["blocks.0.fc.weight"][:, :3]
    torch.save(bad, tmp_path / "shape.pt")
    with pytest.raises(ValueError, match="blocks.0.fc.weight"):
        P.Trainer(P.resolve_config("ivon-pocomo", "cpu", init_from=str(tmp_path / "shape.pt"),
                                   out_dir=str(tmp_path / "y"), quiet=True), data=stdlib)
