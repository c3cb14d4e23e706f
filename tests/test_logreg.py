"""The logistic-regression study (poco_kernels.experiments.logreg), shortened to seconds."""
import csv
import math

import pytest
import torch

pytest.importorskip("sklearn")
pytest.importorskip("scipy")

import poco_kernels as pk  # noqa: E402
from poco_kernels.experiments import logreg as L  # noqa: E402

# breast cancer, lr 0.1, batch 5, 2,000 steps: SGD is at its noise floor, SVRG (refresh
# every 250 steps on the full training set) far below it
SHORT = ["--dataset", "breast_cancer", "--lr", "0.1", "--batch", "5", "--steps", "2000",
         "--warmup", "250", "--refresh-every", "250", "--methods", "sgd,svrg",
         "--log-every", "0"]


@pytest.fixture(scope="module")
def problem():
    cfg = L.Config(dataset="breast_cancer", l2=0.01)
    prob = L.load_problem(cfg)
    return cfg, prob, L.lbfgs_reference(prob)


def test_cli_prints_table_and_svrg_beats_sgd(tmp_path, capsys):
    out_csv = tmp_path / "t.csv"
    assert L.main(SHORT + ["--csv", str(out_csv)]) == 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.startswith("method"))
    for col in ("train objective", "rel. gap", "test acc", "L-BFGS test acc", "grad evals/ex",
                "wall s"):
        assert col in header
    body = text[text.index(header):].splitlines()
    assert [ln.split()[0] for ln in body[2:5]] == ["L-BFGS", "sgd", "svrg"]
    rows = {r["method"]: r for r in csv.DictReader(out_csv.open())}
    assert set(rows) == {"lbfgs", "sgd", "svrg"}
    sgd, svrg = float(rows["sgd"]["rel_gap"]), float(rows["svrg"]["rel_gap"])
    assert rows["sgd"]["status"] == rows["svrg"]["status"] == "ok"
    assert 0 < sgd and math.isfinite(sgd)
    assert svrg < sgd / 10, (sgd, svrg)            # same lr, same mini-batches
    assert abs(svrg) < 1e-3
    # cost accounting: SGD 2,000 x 5 evaluations; SVRG twice that after the warm-up,
    # plus one full-data refresh (455 examples) every 250 steps from step 250
    n = 455
    assert float(rows["sgd"]["grad_evals_per_example"]) == pytest.approx(2000 * 5 / n)
    assert float(rows["svrg"]["grad_evals_per_example"]) == pytest.approx(
        (250 * 5 + 1750 * 10 + 7 * n) / n)


def test_lbfgs_reference_is_the_minimiser(problem):
    cfg, prob, ref = problem
    assert ref.grad_norm < 1e-8
    g = L.gradient(ref.w, prob.Xtr, prob.ytr, prob.l2)
    assert float(g.abs().max()) == pytest.approx(ref.grad_norm)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):                              # strictly convex: any move goes up
        d = 1e-3 * torch.randn(prob.d, generator=gen, dtype=torch.float64)
        assert L.objective(ref.w + d, prob.Xtr, prob.ytr, prob.l2) > ref.f
    assert 0.9 < ref.test_acc <= 1.0


def test_objective_and_closed_form_gradient_match_autograd(problem):
    cfg, prob, ref = problem
    w = torch.randn(prob.d, dtype=torch.float64, requires_grad=True)
    z = prob.Xtr @ w
    f = torch.nn.functional.binary_cross_entropy_with_logits(z, prob.ytr) \
        + 0.5 * prob.l2 * w.dot(w)
    f.backward()
    assert L.objective(w, prob.Xtr, prob.ytr, prob.l2) == pytest.approx(f.detach().item(), rel=1e-12)
    assert torch.allclose(L.gradient(w, prob.Xtr, prob.ytr, prob.l2), w.grad, atol=1e-12)
    # the per-step closure writes the data-loss gradient (without the regulariser)
    c = L._BatchGrad(w)
    c.set(prob.Xtr[:5], prob.ytr[:5])
    c()
    w2 = w.detach().clone().requires_grad_(True)
    torch.nn.functional.binary_cross_entropy_with_logits(prob.Xtr[:5] @ w2, prob.ytr[:5]).backward()
    assert torch.allclose(w.grad, w2.grad, atol=1e-14)


def test_all_methods_see_the_same_batches_and_svrg_is_sgd_before_refresh(problem):
    cfg, prob, ref = problem
    short = L.Config(steps=150, warmup=1000, refresh_every=1000, lr=0.05)
    sgd = L.run_method("sgd", prob, ref, short)
    svrg = L.run_method("svrg", prob, ref, short)
    assert svrg.refresh_steps == [] and svrg.objective == pytest.approx(sgd.objective, rel=1e-12)


def test_divergence_is_reported_not_raised(problem):
    cfg, prob, ref = problem

    class Exploding(pk.SVRG):
        def step(self, closure=None, **kw):
            if self.step_count == 7:
                raise FloatingPointError("the update produced non-finite values in 'mean'")
            return super().step(closure, **kw)

    short = L.Config(steps=50, warmup=10, refresh_every=10)
    r = L.run_method("svrg", prob, ref, short,
                     optimizer_factory=lambda w, c, n: Exploding([w], lr=c.lr, weight_decay=c.l2))
    assert r.status == "diverged@8" and r.steps == 7
    assert math.isfinite(r.objective)               # the state before the refused update
    table = L.format_table(ref, [r])
    assert "diverged@8" in table


@pytest.mark.parametrize("antithetic", [False, True])
def test_refresh_samples_average_the_outer_estimates(problem, antithetic):
    """refresh_samples=K averages g and the Price estimate over K draws; antithetic draws
    come in mirrored pairs +eps_j, -eps_j (checked against a hand computation)."""
    cfg, prob, ref = problem
    K = 4
    w = ref.w.clone().requires_grad_(True)
    opt = pk.IVONPoCo([w], lr=0.01, ess=float(prob.n), weight_decay=prob.l2, seed=5,
                      refresh_samples=K, refresh_antithetic=antithetic)
    c = L._BatchGrad(w)
    c.set(prob.Xtr, prob.ytr)
    opt.refresh([c])
    b = opt._buckets[0]
    sigma = 1.0 / torch.sqrt(prob.n * (opt.flat_state("h")[0] + prob.l2))
    gs, hs = [], []
    for k in range(K):
        if antithetic:
            eps = opt._eps(b, 2, k // 2, 0) * (-1 if k % 2 else 1)
        else:
            eps = opt._eps(b, 2, k, 0)                   # refresh draws 0..K-1 of refresh 0
        g = L.gradient(ref.w + sigma * eps, prob.Xtr, prob.ytr, 0.0)
        gs.append(g)
        hs.append(g * eps / sigma)
    assert torch.allclose(opt.flat_state("g_out")[0], torch.stack(gs).mean(0), atol=1e-14)
    assert torch.allclose(opt.flat_state("h_out")[0], torch.stack(hs).mean(0), atol=1e-12)
    assert not torch.allclose(gs[0], gs[1])            # the draws really differ


def test_cli_rejects_unknown_method():
    with pytest.raises(SystemExit):
        L.main(["--methods", "sgd,adam", "--steps", "10"])


def test_finite_blow_up_is_reported(problem):
    cfg, prob, ref = problem
    short = L.Config(steps=400, warmup=1000, refresh_every=1000, lr=1e4, eval_every=50)
    r = L.run_method("sgd", prob, ref, short)       # lr 1e4: F explodes but stays finite
    assert r.status.startswith("blow-up@") and r.steps < 400
    assert r.error.startswith("blow-up") and math.isfinite(r.objective)
