"""The GPT pretraining run (poco_kernels.experiments.pretrain): data, the loop (schedules,
recipes, resume, every backend, compile and bf16 autocast), bad input.  Small models on
the CPU.  Data parallel runs: test_pretrain_distributed.py; continual pretraining from
ivon-opt: test_continual_pretraining.py."""
import numpy as np
import pytest
import torch

from helpers import available_backends
from poco_kernels.experiments import lm_data
from poco_kernels.experiments import pretrain as P
from pretrain_runs import POCO, SMALL, SMOOTH, _flat, _load, _max_rel
from pretrain_runs import stdlib  # noqa: F401


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
