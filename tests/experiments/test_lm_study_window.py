"""The LM study inside a device window (``--scale gpu-window``): its plan and predicted
time without a GPU, the time model and the clock that keep it inside the window, the
verdicts with arms a window did not run, the pipeline at its CPU smoke scale (cut by its
budget, then resumed), and the studies that check the time model and the 200-step run."""
import csv
import dataclasses
import json

import pytest

from poco_kernels.experiments import lm_study as S
from poco_kernels.experiments import lm_study_claims as C
from poco_kernels.experiments import lm_study_runner as R

from lm_synthetic import synthetic


def test_the_gpu_window_plan_fits_its_window():
    """``--scale gpu-window --dry-run`` without a GPU: the arms of claims (a)-(c), three
    seeds each, predicted (extrapolated to an H200 and an H100) inside the window, which
    is inside the issue's 8 minutes."""
    from poco_kernels.experiments import lm_study_time as T
    sc = S.SCALES["gpu-window"]
    assert sc.budget_s <= 8 * 60 and sc.device == "cuda" and not sc.ablations
    jobs = S.study_jobs(sc)
    arms = {j.arm for j in jobs}
    assert arms == {"adamw-lr=0.001", "adamw-lr=0.003", "ivon-lr=0.3", "ivon-lr=1", "adamw",
                    "ivon", "ivon-3x", "pocomo@1000", "pocomo@667"}
    assert not any(j.arm in ("adamw", "ivon") and j.seed == 0 for j in jobs)   # (the sweeps')
    assert {j.arm for j in S.plan(sc, 3e-3, 1.0)} == {"adamw", "ivon", "ivon-3x",
                                                      "pocomo@1000", "pocomo@667"}
    assert len(jobs) == 17 and sorted({j.seed for j in jobs}) == [0, 1, 2]
    lines = []
    text = S.dry_run("gpu-window", sc.jobs, log=lines.append)
    assert lines == [text] and text.count("window 450 s: fits") == 2
    assert "h200" in text and "h100" in text and f"at {sc.jobs} run(s) at a time" in text
    stages = [jobs[:4], jobs[4:]]                   # (the sweeps, then the arms)
    assert all(j.arm.startswith(("adamw-lr=", "ivon-lr=")) for j in stages[0])
    for dev in ("h200", "h100"):
        rates = T.extrapolated(S._model_settings(jobs), sc.batch, dev)
        total = sum(T.run_seconds(j, rates) for j in jobs)
        wall = T.wall_seconds(stages, rates, sc.jobs)
        assert f"predicted wall time {wall:.0f} s" in text
        assert wall <= sc.budget_s < rates.start_s + total, (dev, wall)   # (4 at a time)
        # an IVON-PoCoMo step is two passes and a refresh's share; IVON-3x's batch is one
        # pass on the GPU, whose host launches bound it as they bound IVON's
        assert rates.step_s["pocomo"] > 2.5 * rates.step_s["ivon"]
        assert rates.step_s["ivon"] <= rates.step_s["ivon-3x"] < 1.5 * rates.step_s["ivon"]
    assert all(j.cfg_dict()["micro_batch"] == j.cfg_dict()["batch_size"] for j in jobs)
    size = T.model_size(jobs[0].cfg_dict())
    assert 10e6 < size["params"] < 11e6 and size["seq"] == 256


def test_the_gpu_extrapolation_agrees_with_the_h200_runs():
    """The extrapolated rates against the eight runs the H200's first window finished on
    2026-11-28 (``benchmarks/results/lm_study_gpu/h200_2026-11-28``; IVON-3x then made
    three passes a step): each run's time within 0.75-1.0 of its prediction (pessimistic,
    so a window is not overrun); then against the whole window of that evening."""
    from pathlib import Path
    from poco_kernels.experiments import lm_study_time as T
    sc = S.SCALES["gpu-window"]
    jobs = {j.run_id: j for j in S.study_jobs(sc)}
    rates = T.extrapolated(S._model_settings(list(jobs.values())), sc.batch)
    three = dataclasses.replace(rates, step_s={**rates.step_s, "ivon-3x": 3 * (
        rates.step_s["ivon"] - T.GPU_ASSUMPTIONS["opt_host_s"]["ivon"])
        + T.GPU_ASSUMPTIONS["opt_host_s"]["ivon"]})
    root = Path(__file__).resolve().parents[2] / "benchmarks/results/lm_study_gpu"
    seen = 0
    for f in sorted((root / "h200_2026-11-28" / "runs").glob("*/*/result.json")):
        r = json.loads(f.read_text())
        job = jobs.get(f"{r['arm']}/seed{r['seed']}")
        if job is None:                    # (the arms' seed 0 copied from the sweeps)
            continue
        ratio = r["run_s"] / T.run_seconds(job, three if r["arm"] == "ivon-3x" else rates)
        assert 0.75 <= ratio <= 1.0, (r["arm"], r["seed"], ratio)
        seen += 1
    assert seen == 8
    # the whole window, four runs at a time (``h200_2026-11-28_fresh``): every run within
    # 0.75-1.0 of its prediction but IVON-3x's (its 48 sequences cost more than the host
    # floor: up to 1.25), and the plan's wall time above the study's
    whole = root / "h200_2026-11-28_fresh"
    ratios = {}
    for f in sorted((whole / "runs").glob("*/*/result.json")):
        r = json.loads(f.read_text())
        job = jobs.get(f"{r['arm']}/seed{r['seed']}")
        if job is not None:
            ratios[job.run_id] = r["run_s"] / T.run_seconds(job, rates)
    assert len(ratios) == 17
    for run, ratio in ratios.items():
        assert 0.75 <= ratio <= (1.3 if run.startswith("ivon-3x/") else 1.0), (run, ratio)
    meta = json.loads((whole / "claims.json").read_text())["meta"]
    stages = [[j for j in jobs.values() if "-lr=" in j.arm],
              [j for j in jobs.values() if "-lr=" not in j.arm]]
    assert meta["runs"] == 17 and not meta["not_started"]
    assert meta["wall_s"] < T.wall_seconds(stages, rates, sc.jobs) <= sc.budget_s


def test_the_plan_plays_its_stages_on_its_slots():
    """wall_seconds: this process's and (with several slots) the workers' start, then
    each stage's makespan, its runs in order on the first slot to come free, each slowed
    by n / speedup(n)."""
    from poco_kernels.experiments import lm_study_time as T
    sc = S.SCALES["quick-window"]
    rates = T.Rates("x", "test", {k: 0.01 for k in T.KINDS}, 0.0, 0.0, 10.0, 1.0)
    runs = S.plan(sc, 1e-2, 1.0)[:3]
    t = [T.run_seconds(j, rates) for j in runs]
    assert T.wall_seconds([runs], rates, 1) == pytest.approx(10.0 + sum(t))
    # two slots: runs 0 and 1 start together, run 2 on the slot that frees first
    two = max(t[0] + (t[2] if t[0] <= t[1] else 0), t[1] + (t[2] if t[1] < t[0] else 0))
    assert T.wall_seconds([runs], rates, 2) == pytest.approx(20.0 + two)
    # a stage waits for the one before it (the lr sweeps before the arms)
    assert T.wall_seconds([runs[:1], runs[1:]], rates, 2) == pytest.approx(
        20.0 + t[0] + max(t[1], t[2]))
    slow = dataclasses.replace(rates, parallel_efficiency=0.5)    # (2 at 1.5x one)
    assert T.wall_seconds([runs[:1]], slow, 2) == pytest.approx(20.0 + t[0] * 2 / 1.5)


def test_several_runs_at_a_time_slow_each_other_until_one_finishes():
    from poco_kernels.experiments import lm_study_time as T
    rates = T.Rates("x", "test", {k: 0.01 for k in T.KINDS}, 0.0, 0.0, 0.0, 0.75)
    assert T.speedup(rates, 1) == 1.0 and T.speedup(rates, 4) == pytest.approx(3.25)
    assert T.speedup(dataclasses.replace(rates, parallel_efficiency=1.0), 2) == 2.0
    job = S.plan(S.SCALES["quick-window"], 1e-2, 1.0)[0]
    clock = T.Clock(rates, 100.0, n_jobs=4)
    assert clock.predict(job) == pytest.approx(T.run_seconds(job, rates) * 4 / 3.25)
    clock.finished(job, T.run_seconds(job, rates) * 1.1)     # (measured: it replaces)
    assert clock.ratio == pytest.approx(1.1)


def test_the_time_model_counts_each_kind_of_step():
    from poco_kernels.experiments import lm_study_time as T
    sc = S.SCALES["quick-window"]
    rates = T.Rates("x", "test", {"adamw": 1.0, "ivon": 2.0, "ivon-3x": 5.0, "pocomo": 7.0},
                    val_s=0.5, run_s=3.0, start_s=10.0)
    jobs = {j.arm: j for j in S.plan(sc, 1e-2, 1.0) if j.seed == 0}
    n_val = (sc.steps // sc.eval_every + 1) * sc.eval_batches + sc.final_eval_batches
    fixed = n_val * 0.5 + 3.0
    assert T.run_seconds(jobs["adamw"], rates) == sc.steps * 1.0 + fixed
    assert T.run_seconds(jobs["ivon-3x"], rates) == sc.steps * 5.0 + fixed
    s = sc.start
    assert T.run_seconds(jobs[f"pocomo@{s}"], rates) == s * 2.0 + (sc.steps - s) * 7.0 + fixed


def test_the_clock_starts_no_run_that_would_end_after_the_window():
    from poco_kernels.experiments import lm_study_time as T
    sc = S.SCALES["quick-window"]
    rates = T.Rates("x", "test", {k: 0.01 for k in T.KINDS}, 0.0, 0.0, 0.0)
    job = S.plan(sc, 1e-2, 1.0)[0]
    need = T.run_seconds(job, rates)                  # (0.3 s)
    clock = T.Clock(rates, budget_s=10 * need)
    assert clock.fits(job) and clock.skipped == []
    clock.finished(job, 4 * need)                     # (a run took 4x its prediction)
    assert clock.predict(job) == pytest.approx(4 * need)
    clock.finished(job, need)                         # (the worst ratio stays)
    assert clock.ratio == pytest.approx(4.0)
    clock.t0 -= 7 * need                              # (7 of the 10 spent)
    assert not clock.fits(job) and clock.skipped == [job.run_id]
    assert T.Clock(rates, None).fits(job)
    fast = T.Clock(rates, budget_s=10 * need)         # (rates that were pessimistic)
    fast.finished(job, need / 2)
    assert fast.predict(job) == pytest.approx(need / 2)


def test_a_scale_without_ablations_says_so_for_claims_d_to_f():
    sc = S.SCALES["quick-window"]

    def loss(arm, seed, t):
        return (3.0 - t / sc.steps + 0.01 * seed + (0.2 if arm == "adamw" else 0.0)
                - (0.1 if arm.startswith("pocomo") and t > sc.start else 0.0))
    summary = C.judge(synthetic(sc, loss), sc, {"scale": "quick-window"})
    verdicts = {c["id"]: c["verdict"] for c in summary["claims"]}
    assert [verdicts[k] for k in "def"] == [C.NOT_RUN] * 3
    assert verdicts["b"] == "holds"           # (PoCoMo below IVON below AdamW, by construction)
    assert verdicts["a"].startswith("at once: ")


def test_claim_a_with_a_start_not_run_or_a_gpu_that_is_not_bit_exact():
    """An IVON-PoCoMo arm with no runs (a window that ended first) is "not run", not a
    reason to call the claim invalid; on a GPU, curves before the start that differ by
    less than ``GPU_SAME_TOL`` count as the same run (on the CPU, only identical ones)."""
    sc = S.SCALES["quick-window"]

    def loss(arm, seed, t):
        return 3.0 - t / sc.steps + 0.01 * seed - (0.1 if arm.startswith("pocomo") and
                                                     t > int(arm.split("@")[1]) else 0.0)
    res = [r for r in synthetic(sc, loss) if r["arm"] != f"pocomo@{sc.starts[0]}"]
    (a,) = [c for c in C.judge(res, sc, {})["claims"] if c["id"] == "a"]
    assert not a["verdict"].startswith("invalid") and a["verdict"].startswith("at once")
    assert f"start {sc.starts[0]}: not run" in a["result"]
    res = [r for r in res if not r["arm"].startswith("pocomo")]
    (a,) = [c for c in C.judge(res, sc, {})["claims"] if c["id"] == "a"]
    assert a["verdict"] == C.NOT_RUN
    noisy = synthetic(sc, loss)
    for r in noisy:                           # (every curve point a little off IVON's)
        if r["arm"].startswith("pocomo"):
            for p in r["curve"]:
                p["val_loss"] += C.GPU_SAME_TOL / 4
    gpu = dataclasses.replace(sc, device="cuda")
    verdicts = [[c["verdict"] for c in C.judge(noisy, s, {})["claims"] if c["id"] == "a"][0]
                for s in (sc, gpu)]
    assert verdicts[0].startswith("invalid") and not verdicts[1].startswith("invalid")
    for r in noisy:
        if r["arm"].startswith("pocomo"):
            r["curve"][0]["val_loss"] += C.GPU_SAME_TOL
    (a,) = [c for c in C.judge(noisy, gpu, {})["claims"] if c["id"] == "a"]
    assert a["verdict"].startswith("invalid")


@pytest.mark.long
def test_the_window_pipeline_stops_at_its_budget_and_resumes(tmp_path):
    """The quick window on the CPU, two runs at a time in worker processes (as a GPU
    window runs them): a budget that the IVON-PoCoMo runs do not fit leaves them
    unstarted (the verdicts say which runs ran), and a rerun without it, in this process,
    trains only those."""
    pytest.importorskip("matplotlib")
    from poco_kernels.experiments import lm_study_time as T
    sc = S.SCALES["quick-window"]
    rates = T.Rates("cpu", "test", {"adamw": 1e-3, "ivon": 1e-3, "ivon-3x": 1e-3,
                                    "pocomo": 60.0}, 0.0, 0.0, 0.0)
    logs = []
    first = S.run_study("quick-window", str(tmp_path), n_jobs=2, quiet=True,
                        log=logs.append, rates=rates, budget_s=300.0)
    pocomo = {j.run_id for j in S.plan(sc, 1e-2, 1.0) if j.arm.startswith("pocomo")}
    assert set(first["meta"]["not_started"]) == pocomo
    assert any("the window ended before 6 runs started" in str(x) for x in logs)
    assert "Not started (the window ended first)" in (tmp_path / "claims.md").read_text()
    assert not (tmp_path / "ablations.png").exists() and (tmp_path / "starts.png").exists()
    again = S.run_study("quick-window", str(tmp_path), n_jobs=1, quiet=True,
                        log=lambda *_: None, rates=rates, budget_s=1e9)
    assert again["meta"]["not_started"] == []
    finals = list(csv.DictReader((tmp_path / "finals.csv").open()))
    assert {r["arm"] for r in finals} >= {"adamw", "ivon", "ivon-3x"} | \
        {p.split("/")[0] for p in pocomo}
    verdicts = {c["id"]: c["verdict"] for c in again["claims"]}
    assert [verdicts[k] for k in "def"] == [C.NOT_RUN] * 3


@pytest.mark.long
def test_a_run_in_a_worker_is_timed_without_the_workers_start(tmp_path):
    """Runs in worker processes report their own time: the clock's ratios stay near
    those of the same runs in this process (a worker's first run would otherwise count
    the worker's start: spawning, importing torch, reading the corpus, several times a
    quick-window run's time)."""
    from poco_kernels.experiments import lm_study_time as T
    sc = S.SCALES["quick-window"]
    jobs = S.sweep_jobs(sc)
    rates = T.measure(jobs, "cpu", log=lambda *_: None)
    clock = T.Clock(rates, None, n_jobs=2)
    with R.Workers(2, R.warm_job(jobs)) as workers:
        got = R.run_jobs(jobs, tmp_path, 2, quiet=True, clock=clock, workers=workers)
    assert len(got) == len(jobs) == len(clock.ratios) == workers.submitted
    assert max(clock.ratios) < 3.0, clock.ratios


@pytest.mark.long
def test_measured_rates_predict_the_window_pipeline_on_the_cpu(tmp_path):
    """``--dry-run`` of a CPU scale times each kind of step here; its plan lists every
    run."""
    lines = []
    text = S.dry_run("quick-window", 1, log=lines.append)
    assert "measured here" in text and text.count("/seed") == 15
    for kind in ("adamw", "ivon", "pocomo"):
        assert any(line.strip().startswith(kind) for line in lines[:-1]), kind


def test_the_machine_line_needs_no_cpp_extension(monkeypatch):
    """A GPU machine may not have built the C++ kernels: the study's outputs still name
    the machine (this line is written after every run has trained)."""
    from poco_kernels.kernels import cpp_ops

    def missing():
        raise ImportError("No module named 'poco_kernels._C'")
    monkeypatch.setattr(cpp_ops, "isa", missing)
    assert R.machine().endswith("C++ kernels not built")


@pytest.mark.long
def test_lm_time_model_study_predicts_each_run(tmp_path):
    """Every run of the quick window trained, each with a positive prediction and
    measured time, and the table and the JSON written."""
    from benchmarks.studies import lm_time_model
    rep = lm_time_model.main(["--scale", "quick-window", "--runs", "3", "--out",
                              str(tmp_path / "t")])
    assert len(rep["rows"]) == 3 and {r["run"].split("/")[0] for r in rep["rows"]} == \
        {"adamw-lr=0.01", "ivon-lr=1", "ivon-3x"}
    for r in rep["rows"]:
        assert r["predicted_s"] > 0 and r["measured_s"] > 0
        assert r["ratio"] == pytest.approx(r["measured_s"] / r["predicted_s"])
    assert "| ivon-3x/seed0 |" in (tmp_path / "t.md").read_text()
    step_s = json.loads((tmp_path / "t.json").read_text())["rates"]["step_s"]
    assert sorted(step_s) == sorted(["adamw", "ivon", "ivon-3x", "pocomo"])
    assert all(v > 0 for v in step_s.values())


@pytest.mark.long
def test_short_horizon_study_pairs_pocomo_with_ivon_per_setting(tmp_path):
    from benchmarks.studies import short_horizon
    rows = short_horizon.main(["--steps", "6", "--seeds", "2", "--jobs", "1", "--out",
                               str(tmp_path / "s")])
    assert set(rows) == set(short_horizon.SETTINGS)
    for r in rows.values():
        assert sorted(r["ivon"]) == sorted(r["pocomo"]) == [0, 1]
        diffs = [r["pocomo"][s] - r["ivon"][s] for s in (0, 1)]
        assert r["diff_mean"] == pytest.approx(sum(diffs) / 2)
    assert "| lr 0.3, beta2 0.99999 |" in (tmp_path / "s.md").read_text()
