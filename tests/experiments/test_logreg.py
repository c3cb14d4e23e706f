"""The logistic-regression study (poco_kernels.experiments.logreg), shortened to seconds."""
import csv
import math

import pytest
import torch

pytest.importorskip("sklearn")
pytest.importorskip("scipy")

import poco_kernels as pk  # noqa: E402
from poco_kernels.experiments import logreg as L  # noqa: E402
from poco_kernels.experiments import logreg_loop  # noqa: E402

# breast cancer, lr 0.1, batch 5, 2,000 steps: SGD is at its noise floor, SVRG (refresh
# every 250 steps on the full training set) far below it
SHORT = ["--dataset", "breast_cancer", "--lr", "0.1", "--batch", "5", "--steps", "2000",
         "--warmup", "250", "--refresh-every", "250", "--methods", "sgd,svrg",
         "--log-every", "0", "--out-dir", ""]


@pytest.fixture(scope="module")
def problem():
    cfg = L.Config(dataset="breast_cancer", l2=0.01)
    prob = L.load_problem(cfg)
    return cfg, prob, L.lbfgs_oracle(prob)


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


def test_lbfgs_oracle_is_the_minimiser(problem):
    cfg, prob, oracle = problem
    assert oracle.grad_norm < 1e-8
    g = L.gradient(oracle.w, prob.Xtr, prob.ytr, prob.l2)
    assert float(g.abs().max()) == pytest.approx(oracle.grad_norm)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):                              # strictly convex: any move goes up
        d = 1e-3 * torch.randn(prob.d, generator=gen, dtype=torch.float64)
        assert L.objective(oracle.w + d, prob.Xtr, prob.ytr, prob.l2) > oracle.f
    assert 0.9 < oracle.test_acc <= 1.0


def test_objective_and_closed_form_gradient_match_autograd(problem):
    cfg, prob, oracle = problem
    w = torch.randn(prob.d, dtype=torch.float64, requires_grad=True)
    z = prob.Xtr @ w
    f = torch.nn.functional.binary_cross_entropy_with_logits(z, prob.ytr) \
        + 0.5 * prob.l2 * w.dot(w)
    f.backward()
    assert L.objective(w, prob.Xtr, prob.ytr, prob.l2) == pytest.approx(f.detach().item(), rel=1e-12)
    assert torch.allclose(L.gradient(w, prob.Xtr, prob.ytr, prob.l2), w.grad, atol=1e-12)
    # the per-step closure writes the data-loss gradient (without the regulariser)
    c = logreg_loop._BatchGrad(w)
    c.set(prob.Xtr[:5], prob.ytr[:5])
    c()
    w2 = w.detach().clone().requires_grad_(True)
    torch.nn.functional.binary_cross_entropy_with_logits(prob.Xtr[:5] @ w2, prob.ytr[:5]).backward()
    assert torch.allclose(w.grad, w2.grad, atol=1e-14)


def test_all_methods_see_the_same_batches_and_svrg_is_sgd_before_refresh(problem):
    cfg, prob, oracle = problem
    short = L.Config(steps=150, warmup=1000, refresh_every=1000, lr=0.05)
    sgd = L.run_method("sgd", prob, oracle, short)
    svrg = L.run_method("svrg", prob, oracle, short)
    assert svrg.refresh_steps == [] and svrg.objective == pytest.approx(sgd.objective, rel=1e-12)


def test_divergence_is_reported_not_raised(problem):
    cfg, prob, oracle = problem

    class Exploding(pk.SVRG):
        def step(self, closure=None, **kw):
            if self.step_count == 7:
                raise FloatingPointError("the update produced non-finite values in 'mean'")
            return super().step(closure, **kw)

    short = L.Config(steps=50, warmup=10, refresh_every=10, lr=0.05)
    r = L.run_method("svrg", prob, oracle, short,
                     optimizer_factory=lambda w, c, n: Exploding([w], lr=c.lr, weight_decay=c.l2))
    assert r.status == "diverged@8" and r.steps == 7
    assert math.isfinite(r.objective)               # the state before the refused update
    table = L.format_table(oracle, [r])
    assert "diverged@8" in table


@pytest.mark.parametrize("antithetic", [False, True])
def test_refresh_samples_average_the_outer_estimates(problem, antithetic):
    """refresh_samples=K averages g and the Price estimate over K draws; antithetic draws
    come in mirrored pairs +eps_j, -eps_j (checked against a hand computation)."""
    cfg, prob, oracle = problem
    K = 4
    w = oracle.w.clone().requires_grad_(True)
    opt = pk.IVONPoCo([w], lr=0.01, ess=float(prob.n), weight_decay=prob.l2, seed=5,
                      refresh_samples=K, refresh_antithetic=antithetic)
    c = logreg_loop._BatchGrad(w)
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
        g = L.gradient(oracle.w + sigma * eps, prob.Xtr, prob.ytr, 0.0)
        gs.append(g)
        hs.append(g * eps / sigma)
    assert torch.allclose(opt.flat_state("g_out")[0], torch.stack(gs).mean(0), atol=1e-14)
    assert torch.allclose(opt.flat_state("h_out")[0], torch.stack(hs).mean(0), atol=1e-12)
    assert not torch.allclose(gs[0], gs[1])            # the draws really differ


def test_cli_rejects_unknown_method():
    with pytest.raises(SystemExit):
        L.main(["--methods", "sgd,adam", "--steps", "10"])


def test_finite_blow_up_is_reported(problem):
    cfg, prob, oracle = problem
    short = L.Config(steps=400, warmup=1000, refresh_every=1000, lr=1e4, eval_every=50)
    r = L.run_method("sgd", prob, oracle, short)    # lr 1e4: F explodes but stays finite
    assert r.status.startswith("blow-up@") and r.steps < 400
    assert r.error.startswith("blow-up") and math.isfinite(r.objective)


# --------------------------------------------------------------------------- the study
def test_the_study_writes_its_plot_report_and_traces(tmp_path, capsys):
    """Every method, a shortened schedule: the PNG, the report with the claims, the CSVs."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    argv = ["--steps", "600", "--warmup", "200", "--refresh-every", "100", "--lr", "0.05",
            "--out-dir", str(out), "--log-every", "0"]
    assert L.main(argv) == 0
    text = capsys.readouterr().out
    for claim in ("stall below L-BFGS", "reach L-BFGS", "jump after each refresh",
                  "faster than first-order"):
        assert claim in text
    png = out / "breast_cancer_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    report = (out / "breast_cancer_report.md").read_text()
    assert "| claim | here | evidence |" in report and "von-poco" in report
    assert "![curves](breast_cancer_curves.png)" in report
    rows = list(csv.DictReader((out / "breast_cancer_trace.csv").open()))
    assert {r["method"] for r in rows} == set(L.METHODS)
    refreshed = [r for r in rows if r["method"] == "svrg" and r["refresh"] == "1"]
    assert [int(r["step"]) for r in refreshed] == [200, 300, 400, 500]
    von = [r for r in rows if r["method"] == "von-poco"]
    assert int(von[-1]["step"]) == 60                     # its schedule, scaled by 0.1
    assert all(0.0 <= float(r["test_acc"]) <= 1.0 for r in rows)


@pytest.fixture(scope="module")
def digits():
    cfg = L.Config(dataset="digits", max_train=400)
    prob = L.load_problem(cfg)
    return cfg, prob, L.lbfgs_oracle(prob)


def test_multiclass_objective_gradient_and_minimiser(digits):
    cfg, prob, oracle = digits
    assert prob.classes == 10 and prob.d == 65 * 10 and prob.ytr.dtype == torch.int64
    w = (0.1 * torch.randn(prob.d, dtype=torch.float64)).requires_grad_(True)
    f = torch.nn.functional.cross_entropy(prob.Xtr @ w.view(65, 10), prob.ytr) \
        + 0.5 * prob.l2 * w.dot(w)
    f.backward()
    assert L.objective(w, prob.Xtr, prob.ytr, prob.l2) == pytest.approx(float(f.detach()),
                                                                        rel=1e-12)
    assert torch.allclose(L.gradient(w, prob.Xtr, prob.ytr, prob.l2), w.grad, atol=1e-12)
    c = logreg_loop._BatchGrad(w)
    c.set(prob.Xtr[:5], prob.ytr[:5])
    c()
    w2 = w.detach().clone().requires_grad_(True)
    torch.nn.functional.cross_entropy(prob.Xtr[:5] @ w2.view(65, 10), prob.ytr[:5]).backward()
    assert torch.allclose(w.grad, w2.grad, atol=1e-14)
    assert oracle.grad_norm < 1e-8 and 0.85 < oracle.test_acc <= 1.0


def test_multiclass_svrg_beats_sgd_and_von_poco_respects_its_limit(digits):
    cfg, prob, oracle = digits
    short = L.Config(dataset="digits", steps=3000, warmup=500, refresh_every=500, lr=0.05,
                     von_max_dim=100)
    sgd = L.run_method("sgd", prob, oracle, short)
    svrg = L.run_method("svrg", prob, oracle, short)
    assert svrg.rel_gap < sgd.rel_gap / 10 and svrg.status == sgd.status == "ok"
    von = L.run_method("von-poco", prob, oracle, short)
    assert von.status == "skipped" and "650 > --von-max-dim 100" in von.skipped
    assert "skipped" in L.format_table(oracle, [sgd, von])


# --------------------------------------------------------------------------- the claims
def _result(method, gaps, oracle, step=100, refresh_steps=(), accs=None):
    """A MethodResult whose recorded relative gaps are ``gaps`` (one point per ``step``)."""
    trace = [(i * step, i * 1.0, oracle.f * (1 + g), (accs or [0.9] * len(gaps))[i])
             for i, g in enumerate(gaps)]
    r = L.MethodResult(method, trace[-1][2], gaps[-1], trace[-1][3], 0.9, trace[-1][1], 0.0,
                       trace[-1][0])
    r.trace, r.refresh_steps = trace, list(refresh_steps)
    return r


def test_claim_criteria_on_constructed_runs():
    from poco_kernels.experiments import claims as C
    oracle = L.Oracle(torch.zeros(2), 0.1, 0.0, 0.9, 0.9, 1, 0.0)
    cfg = L.Config(refresh_every=1000, reach_tol=1e-6)
    flat = [1e-3] * 21                                    # a plateau
    falling = [10.0 ** (-k / 2 - 0.1) for k in range(21)]  # 0.8 .. 8e-11, steadily
    slow = [1e-2 * 0.8 ** k for k in range(21)]           # still falling at the end, > tol
    assert C.classify(_result("sgd", flat, oracle), oracle, 1e-6) == "stalls"
    assert C.classify(_result("svrg", falling, oracle), oracle, 1e-6) == "reaches"
    assert C.classify(_result("svrg", slow, oracle), oracle, 1e-6) == "still descending"
    # a jump: a plateau, then a 100x drop right after the refresh at step 1000
    jump = [1e-3] * 11 + [1e-5] * 10
    r = _result("svrg", jump, oracle, refresh_steps=[1000])
    (step, after, before, dacc), = C.refresh_jumps(r, oracle, 1000)
    assert step == 1000 and after == pytest.approx(100) and before == pytest.approx(1)
    # a noisy plateau (x3 up and down) is still a plateau: medians, not single points
    noisy = [1e-3 * (3.0 if k % 2 else 1 / 3) for k in range(21)]
    assert C.classify(_result("sgd", noisy, oracle), oracle, 1e-6) == "stalls"
    # a steady linear rate through the refresh (five points per window, as real runs have)
    steady = _result("svrg", [10.0 ** (-k / 10 - 0.1) for k in range(101)], oracle, step=20,
                     refresh_steps=[1000])
    (_, after, before, _), = C.refresh_jumps(steady, oracle, 1000)
    assert after == pytest.approx(before, rel=0.05)       # no acceleration: not a jump
    assert after < 2 * before
    assert C.evals_to_reach(_result("x", falling, oracle), oracle, 1e-3) == 6.0
    assert C.evals_to_reach(_result("x", flat, oracle), oracle, 1e-4) is None
    # whole verdicts
    results = [_result("sgd", flat, oracle), _result("vsgd", flat, oracle),
               _result("ivon", flat, oracle),
               _result("svrg", jump, oracle, refresh_steps=[1000]),
               _result("vsgd-poco", falling, oracle, refresh_steps=[1000]),
               _result("ivon-poco", falling, oracle, refresh_steps=[1000])]
    prob = L.Problem("x", torch.zeros(4, 2), torch.zeros(4), torch.zeros(10, 2), torch.zeros(10),
                     0.01)
    verdicts = {c.claim.split()[0]: c.verdict for c in C.evaluate(results, oracle, cfg, prob)}
    # IVON ties with SGD (not faster); after the refresh IVON-PoCo ("falling") reaches the
    # decades below 1e-3 that SVRG ("jump", floor 1e-5) never reaches, and ties VSGD-PoCo
    assert verdicts == {"SGD,": "holds", "SVRG,": "partly", "a": "partly",
                        "IVON-type": "partly"}
    slower = [1e-1 * 0.8 ** k for k in range(21)]         # 1e-2 at point 11, 1e-3 never
    faster = [_result("sgd", slower, oracle), _result("ivon", falling, oracle),
              _result("svrg", slower, oracle), _result("ivon-poco", falling, oracle)]
    claims = {c.claim.split()[0]: c for c in C.evaluate(faster, oracle, cfg, prob)}
    assert claims["IVON-type"].verdict == "holds"
    assert claims["IVON-type"].evidence == [
        "ivon vs sgd, over the run, evaluations/example to first reach: g<=1e-02: 3.00-4.00 "
        "vs 10.00-11.00, g<=1e-03: 5.00-6.00 vs never, g<=1e-04: 7.00-8.00 vs never -> faster",
        "ivon-poco vs svrg, after the first refresh (evaluations counted from it, mega-batch "
        "included), evaluations/example to first reach: no target below both gaps at the "
        "refresh -> neither reaches"]


def test_faster_is_judged_in_its_phase_at_its_resolution(problem):
    """Corrected methods are compared after their first refresh (the warm-up is their
    uncorrected twins'), on brackets of first reach: overlapping brackets are a tie,
    touching ones decide."""
    from poco_kernels.experiments import claims as C
    oracle = L.Oracle(torch.zeros(2), 0.1, 0.0, 0.9, 0.9, 1, 0.0)
    warm = [10.0 ** (-k * 0.3) for k in range(11)]             # the same warm-up to 1e-3
    quick = warm + [0.9e-3 * 10.0 ** -(k + 1) for k in range(10)]        # a decade a point
    slow = warm + [0.9e-3 * 10.0 ** (-(k + 1) / 2) for k in range(10)]   # half a decade
    a = _result("ivon-poco", quick, oracle, refresh_steps=[1000])
    b = _result("svrg", slow, oracle, refresh_steps=[1000])
    assert C.phase_targets(a, b, oracle, "corrected") == pytest.approx([1e-4, 1e-5, 1e-6])
    verdict, text = C.compare_speed(a, b, oracle, "corrected")
    assert verdict == "faster", text
    assert "g<=1e-02" not in text and "g<=1e-03" not in text    # warm-up targets not judged
    assert "g<=1e-04: 0.00-1.00 vs 1.00-2.00" in text           # counted from the refresh
    assert C.compare_speed(b, a, oracle, "corrected")[0] == "slower"
    # over the whole run the warm-up decides nothing (the same points), the rest does
    assert C.compare_speed(a, b, oracle, "run")[0] == "faster"
    same = _result("svrg", quick, oracle, refresh_steps=[1000])
    assert C.compare_speed(a, same, oracle, "corrected")[0] == "tie within resolution"
    # brackets come from the fine gap trace when a run has one
    fine = L.run_method("sgd", problem[1], problem[2],
                        L.Config(steps=200, eval_every=50, fine_every=5))
    assert [p[0] for p in fine.gap_trace] == list(range(0, 201, 5))
    assert [p[0] for p in fine.trace] == list(range(0, 201, 50))
    lo, hi = C.reach_bracket(fine.gap_trace, fine.gap_trace[7][2] + 1e-15)
    assert hi - lo == pytest.approx(5 * 5 / problem[1].n)
