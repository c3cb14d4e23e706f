"""The GPT pretraining run (poco_kernels.experiments.pretrain): data, the loop, resume,
data parallel (DDP and FSDP2 over gloo, two processes), continual pretraining from
ivon-opt, bad input.  Small models on the CPU."""
import copy
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from helpers import available_backends
from poco_kernels.experiments import continual as C
from poco_kernels.experiments import lm_data
from poco_kernels.experiments import pretrain as P

# a 34k-parameter GPT on byte-level stdlib text; refreshes at steps 6, 10, 14, 18, 22
SMALL = ["--preset", "gpt-test", "--vocab-size", "256", "--batch-size", "8",
         "--micro-batch", "2", "--eval-every", "12", "--log-every", "1", "--ckpt-every", "100",
         "--quiet"]
POCO = ["--optimizer", "ivon-pocomo", "--max-steps", "24", "--poco-start", "6",
        "--refresh-every", "4", "--mega-batches", "3"]
# hess_init 1: updates mostly inside the clip radius, so rounding differences between
# reduction orders stay rounding differences (with hess_init 1e-3 nearly every
# coordinate is clipped, a sign update, and coordinates whose gradient is zero up to
# rounding, such as attention key biases, move by +-lr*clip on the sign of that rounding)
SMOOTH = ["--hess-init", "1.0"]


def _flat(d, pre=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{pre}{k}/"))
        elif torch.is_tensor(v):
            out[pre + str(k)] = v
    return out


def _load(path):
    return _flat(torch.load(path, map_location="cpu", weights_only=False))


def _max_rel(a, b):
    """Largest |a - b| per tensor relative to that tensor's largest |b|, and its key."""
    assert set(a) == set(b)
    worst = (-1.0, "")
    for k in a:
        if a[k].is_floating_point() and a[k].numel():
            d = (a[k].double() - b[k].double()).abs().max().item()
            s = b[k].double().abs().max().item()
            worst = max(worst, (d / max(s, 1e-30), k))
    return worst


def _torchrun(args, tmp_path, nproc=2):
    # the ranks import the package of the tree under test, whatever is installed
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([root] + [p for p in os.environ.get(
                   "PYTHONPATH", "").split(os.pathsep) if p]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "-m", "poco_kernels.experiments.pretrain", *args]
    r = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r


@pytest.fixture(scope="module")
def stdlib():
    return lm_data.load_tokens("stdlib")


# --------------------------------------------------------------------------- data
def test_stdlib_corpus(stdlib):
    again = lm_data.load_tokens("stdlib")
    assert stdlib.vocab_size == 256 and stdlib.fingerprint == again.fingerprint
    assert len(stdlib.train) > 1_000_000 and len(stdlib.val) > 20_000
    assert len(stdlib.val) < 0.2 * len(stdlib.train)
    x, y = stdlib.batch("train", 3, 8, 32, data_seed=1)
    assert x.shape == y.shape == (8, 32) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])                      # next-token targets
    assert b"def " in stdlib.train[:200_000].tobytes()            # it is Python source
    assert stdlib.train.max() < 256


def test_batches_are_addressed(tmp_path):
    """A token directory (nanoGPT's uint16 files): batch k is a function of (seed, k),
    and rank slices of a global batch are its rows."""
    tr = (np.arange(10_000) * 7 % 50_000).astype(np.uint16)
    va = (np.arange(3_000) * 11 % 50_000).astype(np.uint16)
    tr.tofile(tmp_path / "train.bin")
    va.tofile(tmp_path / "val.bin")
    d = lm_data.load_tokens(str(tmp_path))
    assert d.vocab_size == 50257 and np.array_equal(d.train, tr)
    x, y = d.batch("train", 5, 6, 16, data_seed=3)
    offs = d.offsets("train", 5, 6, 16, data_seed=3)
    for row, o in zip(range(6), offs):
        assert torch.equal(x[row], torch.from_numpy(tr[o:o + 16].astype(np.int64)))
        assert torch.equal(y[row], torch.from_numpy(tr[o + 1:o + 17].astype(np.int64)))
    x2, _ = d.batch("train", 5, 6, 16, data_seed=3, lo=2, hi=4)
    assert torch.equal(x2, x[2:4])
    assert not torch.equal(d.batch("train", 6, 6, 16, data_seed=3)[0], x)
    assert not torch.equal(d.batch("train", 5, 6, 16, data_seed=4)[0], x)
    assert d.batch("val", 0, 2, 16, data_seed=3)[0].max() < 50_000


def test_token_dir_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="train.bin and val.bin"):
        lm_data.load_tokens(str(tmp_path / "nope"))
    np.zeros(10, np.uint16).tofile(tmp_path / "train.bin")
    with pytest.raises(FileNotFoundError, match="val.bin"):
        lm_data.load_tokens(str(tmp_path))
    (tmp_path / "val.bin").write_bytes(b"\0" * 7)
    with pytest.raises(ValueError, match="uint16"):
        lm_data.load_tokens(str(tmp_path))


# --------------------------------------------------------------------------- the loop
def test_schedules():
    cfg = P.resolve_config("ivon-pocomo", "cpu", max_steps=100, lr=1.0, lr_warmup=10,
                           min_lr_ratio=0.1, poco_start=20, alpha="0.2:0.8", out_dir="x")
    lrs = [P.lr_at(cfg, t) for t in range(100)]
    assert lrs[0] == pytest.approx(1 / 11) and lrs[9] == pytest.approx(10 / 11)
    assert lrs[10] == pytest.approx(1.0) and all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert P.lr_at(cfg, 100) == pytest.approx(0.1) and lrs[-1] > 0.1
    assert P.alpha_at(cfg, 20) == pytest.approx(0.2) and P.alpha_at(cfg, 99) == pytest.approx(0.8)
    assert P.alpha_at(cfg, 60) == pytest.approx(0.2 + 0.6 * 40 / 79)
    cfg = P.resolve_config("ivon-pocomo", "cpu", alpha="0.7", out_dir="x")
    assert P.alpha_at(cfg, 0) == P.alpha_at(cfg, 10 ** 6) == 0.7


def test_paper_recipes():
    g = P.resolve_config("ivon-pocomo", "gpt2", out_dir="x")
    assert (g.preset, g.batch_size, g.max_steps, g.poco_start, g.refresh_every,
            g.mega_batches, g.rho1, g.rho2) == ("gpt2-124m", 480, 100_000, 50_000, 10, 10, 0.6, 0.1)
    assert (g.lr, g.ess, g.hess_init, g.beta2, g.clip_radius) == (0.3, 1e10, 1e-3, 0.99999, 1e-3)
    a = P.resolve_config("adamw", "gpt2", out_dir="x")
    assert (a.lr, a.beta2, a.weight_decay) == (6e-4, 0.95, 0.1)
    c = P.resolve_config("ivon-pocomo", "continual", init_from="ck.pt", out_dir="x")
    assert (c.ess, c.beta2, c.lr, c.poco_start, c.refresh_every, c.mega_batches, c.alpha,
            c.rho1, c.rho2, c.seq_len, c.batch_size, c.min_lr_ratio) == \
        (3e10, 0.9999, 0.04, 1000, 40, 40, "0.7", 0.3, 0.05, 512, 80, 0.0)


def test_pocomo_schedule_counts(tmp_path):
    """Refreshes at poco_start + j m, each on k mini-batches; 2 evaluations per corrected
    step; data position and gradient evaluations counted as the paper's cost model."""
    s = P.main(SMALL + POCO + ["--out-dir", str(tmp_path)])[0]
    ck = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert ck["optimizer"]["poco"]["refreshes"] == 5 and ck["optimizer"]["poco"]["step"] == 24
    assert ck["data_pos"] == 24 + 5 * 3
    assert s["grad_evals_minibatches"] == 6 + 18 * 2 + 5 * 3
    refreshes = [r["refreshes"] for r in ck["history"]]
    assert refreshes[6] == 0 and refreshes[7] == 1 and refreshes[11] == 2 and refreshes[-1] == 5
    alphas = [r["alpha"] for r in ck["history"]]
    assert alphas[6] == 0.0 and alphas[7] == 0.7


@pytest.mark.parametrize("opt", ["ivon-pocomo", "adamw", "ivon", "ivon-opt"])
def test_resume_mid_inner_loop_reproduces_the_run(tmp_path, opt):
    """Stop after step 13 (inside the inner loop that started with the refresh at step
    10), resume: the loss curve and the final state equal the uninterrupted run's, bit
    for bit."""
    args = SMALL + POCO[2:] + ["--optimizer", opt]
    P.main(args + ["--out-dir", str(tmp_path / "full")])
    P.main(args + ["--out-dir", str(tmp_path / "part"), "--stop-after", "13"])
    mid = torch.load(tmp_path / "part" / "ckpt.pt", weights_only=False)
    assert mid["step"] == 13
    P.main(args + ["--out-dir", str(tmp_path / "part"), "--resume"])
    a = torch.load(tmp_path / "full" / "ckpt.pt", weights_only=False)
    b = torch.load(tmp_path / "part" / "ckpt.pt", weights_only=False)
    curve = lambda ck: [(r["step"], r["train_loss"], r["val_loss"]) for r in ck["history"]]  # noqa
    assert len(curve(a)) == 25 and curve(a) == curve(b)
    fa, fb = _flat({"m": a["model"], "o": a["optimizer"]}), _flat({"m": b["model"], "o": b["optimizer"]})
    assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)
    assert a["data_pos"] == b["data_pos"]


_LOOP_ARGS = SMALL[:] + ["--optimizer", "ivon-pocomo", "--max-steps", "6", "--poco-start",
                         "2", "--refresh-every", "3", "--mega-batches", "2", "--eval-every",
                         "6", "--save-rank-states"] + SMOOTH


@pytest.fixture(scope="module")
def loop_baseline(tmp_path_factory):
    """The loop on the torch backend, run once for every backend's comparison."""
    out = tmp_path_factory.mktemp("baseline")
    P.main(_LOOP_ARGS + ["--backend", "torch", "--out-dir", str(out)])
    return _load(out / "rank0.pt")


@pytest.mark.parametrize("backend", [
    pytest.param(b, marks=pytest.mark.long) if b == "triton" else b   # (interpreted: 15-19 s)
    for b in available_backends()])
def test_every_backend_runs_the_loop(tmp_path, backend, loop_baseline):
    """The PoCoMo loop (micro-batches, refreshes, outer samples) on each backend
    (Triton through its interpreter, in the long tier) follows the trajectory of a
    baseline run on the torch backend."""
    P.main(_LOOP_ARGS + ["--backend", backend, "--out-dir", str(tmp_path / backend)])
    ck = torch.load(tmp_path / backend / "ckpt.pt", weights_only=False)
    assert ck["optimizer"]["poco"]["refreshes"] == 2            # at steps 2 and 5
    rel, key = _max_rel(_load(tmp_path / backend / "rank0.pt"), loop_baseline)
    assert rel < 1e-4, (rel, key)


def test_val_loss_falls_for_all_three(tmp_path):
    """A short CPU run: each of AdamW, IVON and IVON-PoCoMo lowers the validation loss
    (byte-level text starts near ln 256 = 5.55)."""
    out = P.main(["--optimizer", "adamw,ivon,ivon-pocomo", "--preset", "gpt-test",
                  "--vocab-size", "256", "--batch-size", "16", "--micro-batch", "16",
                  "--max-steps", "60", "--poco-start", "20", "--refresh-every", "10",
                  "--mega-batches", "4", "--eval-every", "20", "--log-every", "20",
                  "--lr-warmup", "5", "--quiet", "--out-dir", str(tmp_path)])
    assert [s["optimizer"] for s in out] == ["adamw", "ivon", "ivon-pocomo"]
    for s in out:
        assert s["val_loss_first"] > 5.3
        assert s["val_loss"] < s["val_loss_first"] - 0.5, s
        ck = torch.load(tmp_path / s["optimizer"] / "ckpt.pt", weights_only=False)
        vals = [r["val_loss"] for r in ck["history"] if r["val_loss"] is not None]
        assert len(vals) == 4 and all(b < a for a, b in zip(vals, vals[1:])), vals


def test_compile_and_bf16_autocast(tmp_path):
    """The PoCoMo loop with refreshes under --compile (inductor on the CPU) follows the
    eager run's trajectory (measured 3e-6 relative); under bf16 autocast its validation
    loss stays within bf16 accuracy of float32's (measured 7e-5), well inside what the
    6 steps move it (0.025)."""
    args = SMALL + SMOOTH + ["--optimizer", "ivon-pocomo", "--max-steps", "6",
                             "--poco-start", "2", "--refresh-every", "2", "--mega-batches",
                             "2", "--eval-every", "6", "--save-rank-states"]
    eager = P.main(args + ["--out-dir", str(tmp_path / "e")])[0]
    assert eager["val_loss"] < eager["val_loss_first"] - 0.01
    P.main(args + ["--out-dir", str(tmp_path / "c"), "--compile"])
    rel, key = _max_rel(_load(tmp_path / "c" / "rank0.pt"), _load(tmp_path / "e" / "rank0.pt"))
    assert rel < 1e-4, (rel, key)
    bf16 = P.main(args + ["--out-dir", str(tmp_path / "b"), "--amp", "bf16"])[0]
    assert bf16["val_loss"] == pytest.approx(eager["val_loss"], abs=2e-3)


# --------------------------------------------------------------------------- distributed
@pytest.mark.long
def test_ddp_two_ranks(tmp_path, stdlib):
    """torchrun, 2 processes, gloo: IVON-PoCoMo for 24 steps with 5 refreshes.  Both
    ranks end with bit-identical parameters and optimizer state, equal to one process
    on the same global batches (different reduction order: float rounding)."""
    args = SMALL + POCO + SMOOTH + ["--save-rank-states"]
    _torchrun(args + ["--out-dir", "ddp"], tmp_path)
    P.main(args + ["--out-dir", str(tmp_path / "one")])
    r0, r1 = _load(tmp_path / "ddp" / "rank0.pt"), _load(tmp_path / "ddp" / "rank1.pt")
    assert r0.keys() == r1.keys() and all(torch.equal(r0[k], r1[k]) for k in r0)
    ck = torch.load(tmp_path / "ddp" / "ckpt.pt", weights_only=False)
    assert ck["world_size"] == 2 and ck["optimizer"]["poco"]["refreshes"] == 5
    one = _load(tmp_path / "one" / "rank0.pt")
    rel, key = _max_rel(r0, one)
    assert rel < 1e-4, (rel, key)
    # a single-process checkpoint taken mid inner loop resumes on two ranks
    P.main(args + ["--out-dir", str(tmp_path / "mix"), "--stop-after", "13"])
    _torchrun(args + ["--out-dir", "mix", "--resume"], tmp_path)
    rel, key = _max_rel(_load(tmp_path / "mix" / "rank1.pt"), one)
    assert rel < 1e-4, (rel, key)
    # the runs moved: the comparison is not between two untouched initialisations
    init = P.Trainer(P.resolve_config("ivon-pocomo", "cpu", preset="gpt-test", vocab_size=256,
                                      out_dir=str(tmp_path / "init")), data=stdlib)
    w0 = init.raw.state_dict()["blocks.0.fc.weight"]
    assert (one["model/blocks.0.fc.weight"] - w0).abs().max() > 1e-3


@pytest.mark.long
def test_fsdp2_two_ranks_and_resume(tmp_path):
    """FSDP2 (fully_shard) over 2 gloo processes ("auto": the C++ backend): each rank
    samples its shards at their places in the unsharded noise stream, so the run equals
    the single-process run to float rounding; a sharded checkpoint (DCP) taken mid inner
    loop resumes to the same final state on 2 ranks, and in one process (resharded: the
    reductions of one process from there on)."""
    import shutil
    args = SMALL + POCO + SMOOTH + ["--save-rank-states", "--parallel", "fsdp"]
    _torchrun(args + ["--out-dir", "fsdp"], tmp_path)
    _torchrun(args + ["--out-dir", "part", "--stop-after", "13"], tmp_path)
    assert [d.name for d in (tmp_path / "part").glob("ckpt.step*.dcp")] == ["ckpt.step13.dcp"]
    shutil.copytree(tmp_path / "part", tmp_path / "part1")
    _torchrun(args + ["--out-dir", "part", "--resume"], tmp_path)
    assert [d.name for d in (tmp_path / "part").glob("ckpt.step*.dcp")] == ["ckpt.step24.dcp"]
    P.main(SMALL + POCO + SMOOTH + ["--save-rank-states", "--out-dir", str(tmp_path / "one")])
    P.main(SMALL + POCO + SMOOTH + ["--save-rank-states", "--out-dir", str(tmp_path / "part1"),
                                    "--resume"])
    f0, f1 = _load(tmp_path / "fsdp" / "rank0.pt"), _load(tmp_path / "fsdp" / "rank1.pt")
    assert all(torch.equal(f0[k], f1[k]) for k in f0)          # gathered: the same
    rel, key = _max_rel(f0, _load(tmp_path / "one" / "rank0.pt"))
    # measured 1.5e-3 (sharded all-gather buffers round differently); wrong shard
    # offsets in the noise give > 1
    assert rel < 1e-2, (rel, key)
    p = _load(tmp_path / "part" / "rank0.pt")
    assert all(torch.equal(p[k], f0[k]) for k in f0)
    ck = torch.load(tmp_path / "part" / "ckpt.pt", weights_only=False)
    assert ck["sharded"] and ck["step"] == 24
    p1 = _load(tmp_path / "part1" / "rank0.pt")       # 2 -> 1 from step 13
    assert not torch.equal(p1["model/blocks.0.fc.weight"], f0["model/blocks.0.fc.weight"])
    rel, key = _max_rel(p1, f0)
    assert rel < 1e-2, (rel, key)


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


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("over, match", [
    (dict(batch_size=10, micro_batch=4), "multiple of micro_batch"),
    (dict(max_steps=0), "max_steps"),
    (dict(alpha="1.5"), "alpha"),
    (dict(alpha="0.2:x"), "alpha"),
    (dict(amp="fp16"), "amp"),
    (dict(resume=True, init_from="x.pt"), "not both"),
])
def test_bad_config(over, match):
    with pytest.raises(ValueError, match=match):
        P.resolve_config("ivon-pocomo", "cpu", out_dir="x", **over)


def test_bad_settings_and_names():
    with pytest.raises(ValueError, match="optimizer"):
        P.resolve_config("sgd", "cpu")
    with pytest.raises(ValueError, match="unknown settings"):
        P.resolve_config("ivon", "cpu", learning_rate=1.0)
    with pytest.raises(ValueError, match="--init-from"):
        P.resolve_config("ivon", "continual")


def test_bad_run_shapes(stdlib, tmp_path):
    with pytest.raises(ValueError, match="block_size"):
        P.Trainer(P.resolve_config("ivon", "cpu", preset="gpt-test", vocab_size=256,
                                   seq_len=17, out_dir=str(tmp_path)), data=stdlib)
    with pytest.raises(ValueError, match="vocabulary"):
        P.Trainer(P.resolve_config("ivon", "cpu", preset="gpt-test", out_dir=str(tmp_path)),
                  data=stdlib)


def test_resume_refuses_another_run_and_changes_nothing(tmp_path, stdlib):
    P.main(SMALL + ["--optimizer", "ivon", "--max-steps", "3", "--out-dir", str(tmp_path)])
    before = (tmp_path / "ckpt.pt").read_bytes()
    for over, match in [(dict(batch_size=16), "batch_size"), (dict(seed=1), "seed"),
                        (dict(n_embd=64), "model")]:
        cfg = P.resolve_config("ivon", "cpu", preset="gpt-test", vocab_size=256, micro_batch=2,
                               resume=True, out_dir=str(tmp_path), quiet=True,
                               **{"batch_size": 8, **over})
        with pytest.raises(ValueError, match=match):
            P.Trainer(cfg, data=stdlib)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        P.Trainer(P.resolve_config("ivon", "cpu", preset="gpt-test", vocab_size=256,
                                   resume=True, out_dir=str(tmp_path / "none")), data=stdlib)
    assert (tmp_path / "ckpt.pt").read_bytes() == before
