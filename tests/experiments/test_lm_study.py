"""The language-model study (poco_kernels.experiments.lm_study): the whole pipeline in its
quick mode (two worker processes, then a rerun that reuses every saved run), and the
verdict logic on constructed results, where each verdict must flip with the numbers."""
import csv
import dataclasses
import math

import pytest

from poco_kernels.experiments import lm_study as S
from poco_kernels.experiments import lm_study_claims as C
from poco_kernels.experiments import lm_study_runner as R

from lm_synthetic import synthetic


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    pytest.importorskip("matplotlib")
    out = tmp_path_factory.mktemp("lm_study")
    summary = S.main(["--quick", "--out-dir", str(out), "--jobs", "2", "--quiet"])
    return out, summary


@pytest.mark.long
def test_quick_study_writes_every_output(quick):
    out, summary = quick
    sc = S.SCALES["quick"]
    for f in ("claims.md", "claims.json", "curves.csv", "finals.csv", "curves.png",
              "starts.png", "ablations.png"):
        assert (out / f).stat().st_size > 0, f
    assert [c["id"] for c in summary["claims"]] == list("abcdef")
    words = ("holds", "does not hold", "inconclusive", "partly")
    for c in summary["claims"]:
        assert any(w in c["verdict"] for w in words), c
    finals = list(csv.DictReader((out / "finals.csv").open()))
    arms = {r["arm"] for r in finals}
    expected = {"adamw", "ivon", "ivon-3x", "alpha=0.5", "alpha=1", "sched=increasing",
                "sched=decreasing", "sched=one", "refresh=2", "refresh=20"}
    expected |= {f"pocomo@{s}" for s in sc.starts}
    assert expected <= arms
    for arm in expected:
        assert sorted(int(r["seed"]) for r in finals if r["arm"] == arm) == \
            list(range(sc.seeds)), arm
    # every run reached its last step, with a finite loss; the IVON family on the C++
    # kernels, AdamW on torch.optim's
    assert all(int(r["steps"]) == sc.steps and math.isfinite(float(r["final_val_loss"]))
               and r["backend"] == ("torch" if r["optimizer"] == "adamw" else "cpp")
               for r in finals)
    # gradient evaluations: IVON-3x three per step, IVON-PoCoMo 2 + mega/m once corrected;
    # every run's count is what the progress bar expected
    cost = {j.run_id: j.cost() for j in S.plan(sc, 1.0, 1.0)}
    for r in finals:
        if f"{r['arm']}/seed{r['seed']}" in cost:
            assert float(r["evals"]) == cost[f"{r['arm']}/seed{r['seed']}"], r["arm"]
    ev = {r["arm"]: float(r["evals"]) for r in finals if r["seed"] == "0"}
    assert ev["ivon"] == sc.steps and ev["ivon-3x"] == 3 * sc.steps
    corrected = sc.steps - sc.start
    assert ev[f"pocomo@{sc.start}"] == sc.steps + corrected + \
        math.ceil(corrected / sc.refresh_every) * sc.mega_batches
    # before its start IVON-PoCoMo is IVON bit for bit (claim a's pairing rests on it)
    (a,) = [c for c in summary["claims"] if c["id"] == "a"]
    assert len(a["result"]) == len(set(sc.starts) | {sc.start})
    assert all("identical to IVON up to" in line and line.endswith(": yes")
               for line in a["result"]), a["result"]
    assert a["verdict"].startswith("at once: ") and "within a tenth of the run: " in \
        a["verdict"]
    rows = list(csv.DictReader((out / "curves.csv").open()))
    assert set(rows[0]) == set(C.CURVE_FIELDS)
    text = (out / "claims.md").read_text()
    assert "| (e) an increasing alpha schedule" in text and "--quick" in text
    # the quick scale's verdicts are labelled as deciding nothing, wherever they appear
    assert C.SMOKE_NOTE in text and summary["table_text"].startswith(C.SMOKE_NOTE)
    assert summary["table_text"].count("(smoke scale: decides nothing)") == 6
    # wall times of sub-second runs are not printed as 0
    (c,) = [c for c in summary["claims"] if c["id"] == "c"]
    walls = c["result"][-1].split(": ", 1)[1]
    assert "IVON 0," not in walls and "." in walls, walls


@pytest.mark.long
def test_a_rerun_reuses_the_saved_runs(quick, monkeypatch):
    out, summary = quick

    def boom(*a, **k):
        raise AssertionError("a saved run was run again")
    monkeypatch.setattr(R, "run_job", boom)
    again = S.run_study("quick", str(out), n_jobs=1, quiet=True, log=lambda *_: None)
    assert again["table_md"] == summary["table_md"]
    # a changed setting is not reused
    job = S.sweep_jobs(S.SCALES["quick"])[0]
    changed = S.Job(job.arm, job.seed, job.optimizer,
                    tuple((k, 99 if k == "max_steps" else v) for k, v in job.settings),
                    job.final_eval_batches, job.base_batch)
    assert S.cached_result(out, job) is not None and S.cached_result(out, changed) is None
    # so is one whose recipe changed underneath (a setting the arms do not override)
    from poco_kernels.experiments import pretrain_config
    monkeypatch.setattr(R, "_KEYS", {})
    monkeypatch.setitem(pretrain_config.RECIPES["cpu"], "rho1", 0.5)
    pocomo = [j for j in S.plan(S.SCALES["quick"], 1e-2, 1.0) if j.arm.startswith("pocomo")]
    assert S.cached_result(out, pocomo[0]) is None


def test_a_failed_run_stops_the_study_and_names_the_run(tmp_path):
    job = S.sweep_jobs(S.SCALES["quick"])[0]
    bad = S.Job("broken", 0, job.optimizer,
                tuple((k, 1000 if k == "seq_len" else v) for k, v in job.settings),
                job.final_eval_batches, job.base_batch)      # longer than the model's context
    with pytest.raises(RuntimeError, match="run broken/seed0 failed.*seq_len 1000"):
        R.run_jobs([bad, job], tmp_path, n_jobs=2, quiet=True)


def test_progress_in_a_log_is_a_few_plain_lines():
    """Not a terminal (a log file, a pipe): a line at the start and at each tenth of the
    work, however many updates; no carriage returns, no run names."""
    import io
    log = io.StringIO()
    bar = R._bar(1000, "arms (3 to run)", quiet=False, file=log)
    for i in range(400):
        bar.update(2.5)
        bar.set_postfix_str(f"ivon/seed{i}")
    bar.close()
    lines = log.getvalue().splitlines()
    assert len(lines) == 11 and "\r" not in log.getvalue() and "seed" not in log.getvalue()
    assert lines[0] == "arms (3 to run): 1000 gradient evaluations"
    assert lines[-1].startswith("arms (3 to run): 100% after ")
    quiet = io.StringIO()
    R._bar(10, "x", quiet=True, file=quiet).update(10)
    assert quiet.getvalue() == ""


def test_the_stage_line_tells_shared_runs_from_saved_ones(tmp_path, monkeypatch):
    """On a first run the arms' stage has nothing saved: seed 0 of adamw and ivon are the
    lr sweeps' runs (copied), and it says so; a rerun has everything saved."""
    sc = S.SCALES["quick"]
    jobs = S.plan(sc, 1e-2, 1.0)
    copied = {"adamw/seed0", "ivon/seed0"}
    descs = []
    monkeypatch.setattr(R, "_bar", lambda total, desc, quiet: descs.append(desc) or
                        R._Null())
    saved = set(copied)
    monkeypatch.setattr(R, "cached_result", lambda out, j: (
        {"copied_from": "sweep"} if j.run_id in copied else {}) if j.run_id in saved else None)
    monkeypatch.setattr(R, "run_job", lambda j, out, report=None: saved.add(j.run_id) or {})
    R.run_jobs(jobs, tmp_path, n_jobs=1, desc="arms")
    R.run_jobs(jobs, tmp_path, n_jobs=1, desc="arms")
    n = len(jobs)
    assert descs == [f"arms ({n - 2} to run, 2 shared with the lr sweeps)",
                     f"arms (0 to run, {n - 2} saved by an earlier run, 2 shared with the "
                     f"lr sweeps)"]


def test_paired_interval_and_verdicts():
    d = C.paired({0: 1.0, 1: 2.0, 2: 3.0}, {0: 1.1, 1: 2.12, 2: 3.08})
    assert d.mean == pytest.approx(-0.1) and d.sd == pytest.approx(0.02)
    half = 4.303 * 0.02 / math.sqrt(3)
    assert (d.lo, d.hi) == pytest.approx((-0.1 - half, -0.1 + half))
    assert C.below(d) == "holds"
    assert C.below(C.paired({0: 1.1, 1: 2.12, 2: 3.08}, {0: 1.0, 1: 2.0, 2: 3.0})) == \
        "does not hold"
    noisy = C.paired({0: 1.0, 1: 2.0, 2: 3.0}, {0: 1.1, 1: 1.9, 2: 3.0})
    assert C.below(noisy) == "inconclusive"
    assert C.similar(noisy, margin=0.01) == "inconclusive"       # too wide to say
    assert C.similar(noisy, margin=1.0) == "holds"
    assert C.similar(d, margin=1.0) == "holds"      # equivalence: within the margin
    assert C.similar(d, margin=0.05) == "does not hold"           # wholly outside it
    assert C.similar(d, margin=0.11) == "inconclusive"            # straddles it
    assert C.below(C.paired({0: 1.0}, {1: 1.0})) == "inconclusive"   # nothing paired
    curve = [{"step": 0, "evals": 0, "val_loss": 4.0}, {"step": 10, "evals": 30,
                                                         "val_loss": 2.0}]
    assert C.loss_at(curve, 5) == 3.0 and C.loss_at(curve, 15, "evals") == 3.0
    assert math.isnan(C.loss_at(curve, 11))


def test_verdicts_follow_the_numbers():
    sc = S.SCALES["quick"]
    jitter = {0: 0.0, 1: 0.003, 2: -0.002}

    def paper(arm, seed, t):
        """The paper's story: correction drops the loss at once, PoCoMo < 3x ~ PoCoMo <
        IVON < AdamW, U over alpha and the refresh interval, the schedule order."""
        base = 3.0 - t / sc.steps + jitter[seed]
        gain = {"adamw": -0.2, "ivon-3x": 0.1, "alpha=0.5": 0.08, "alpha=1": 0.02,
                "sched=increasing": 0.2, "sched=decreasing": 0.05, "sched=one": 0.01,
                "refresh=2": 0.04, "refresh=20": 0.03}
        start = int(arm.split("@")[1]) if arm.startswith("pocomo@") else sc.start
        g = 0.1 if arm.startswith("pocomo@") else gain.get(arm, 0.0)
        if arm.startswith("pocomo@") or arm in gain and arm not in ("adamw", "ivon-3x"):
            return base - (g if t > start else 0.0)
        return base - g * t / sc.steps
    verdict = {c["id"]: c["verdict"] for c in C.judge(synthetic(sc, paper), sc, {})["claims"]}
    assert verdict["a"] == "at once: holds; within a tenth of the run: holds"
    assert verdict["b"] == "holds"
    assert verdict["d"] == "correction beats none: holds; U-shape: holds"
    assert verdict["e"] == "holds"
    assert verdict["f"] == "holds"
    # only a smoke scale (the quick one) says its verdicts decide nothing
    full = dataclasses.replace(sc, decisive=True)
    text = C.judge(synthetic(full, paper), full, {})["table_text"]
    assert C.SMOKE_NOTE not in text and "smoke" not in text

    def flat(arm, seed, t):            # nothing differs but noise that sums to 0 over seeds
        if arm.startswith("pocomo@") and t <= int(arm.split("@")[1]):
            arm = "ivon"               # IVON-PoCoMo is IVON before its start
        return 3.0 - t / sc.steps + jitter[seed] + 0.001 * ((seed + len(arm)) % 3 - 1)
    verdict = {c["id"]: c["verdict"] for c in C.judge(synthetic(sc, flat), sc, {})["claims"]}
    assert verdict["e"] == verdict["f"] == "inconclusive"
    assert verdict["a"] == "at once: inconclusive; within a tenth of the run: inconclusive"
    assert verdict["d"] == "correction beats none: inconclusive; U-shape: inconclusive"

    def reversed_(arm, seed, t):       # correction hurts: (a), (b) do not hold
        base = 3.0 - t / sc.steps + jitter[seed]
        if arm.startswith("pocomo@") and t > int(arm.split("@")[1]):
            return base + 0.1
        return base - (0.3 if arm == "adamw" else 0.0)
    verdict = {c["id"]: c["verdict"] for c in C.judge(synthetic(sc, reversed_), sc,
                                                       {})["claims"]}
    assert verdict["a"] == "at once: does not hold; within a tenth of the run: does not hold"
    assert verdict["b"] == "does not hold"

    def gradual(arm, seed, t):         # a gain that only builds up: not "at once"
        base = 3.0 - t / sc.steps + jitter[seed]
        if arm.startswith("pocomo@"):
            s = int(arm.split("@")[1])
            return base - 0.01 * max(0, t - s - 2 * sc.refresh_every)
        return base + (0.3 if arm == "adamw" else 0.0)
    long = dataclasses.replace(sc, steps=200)          # a tenth of the run: 20 steps
    verdict = {c["id"]: c["verdict"] for c in C.judge(synthetic(long, gradual), long,
                                                       {})["claims"]}
    assert verdict["a"] == "at once: inconclusive; within a tenth of the run: holds"


def test_verdicts_at_the_ends_of_a_sweep_and_for_the_3x_batch():
    sc = S.SCALES["quick"]
    jitter = {0: 0.0, 1: 0.003, 2: -0.002}
    gains = {"alpha=0.5": 0.05, "alpha=1": 0.2, "refresh=2": 0.3, "refresh=20": 0.01}

    def ends(arm, seed, t):
        """alpha 1 and refreshing every 2 steps are best (the ends of their ranges);
        IVON-3x is as good as IVON-PoCoMo, and IVON-PoCoMo gains nothing per evaluation."""
        base = 3.0 - t / sc.steps + jitter[seed]
        start = int(arm.split("@")[1]) if arm.startswith("pocomo@") else sc.start
        g = 0.1 if arm.startswith("pocomo@") or arm == "ivon-3x" else gains.get(arm, 0.0)
        return base - (g if t > start else 0.0)
    claims = {c["id"]: c for c in C.judge(synthetic(sc, ends), sc, {})["claims"]}
    assert claims["d"]["verdict"] == "correction beats none: holds; U-shape: does not hold"
    assert "alpha 1, an end of the range; minus alpha 0.7" in claims["d"]["result"][-1]
    assert claims["f"]["verdict"] == "does not hold"
    assert "every 2, an end of the range; minus every 5" in claims["f"]["result"][-1]
    # (c): at IVON's evaluations PoCoMo is not ahead (it is IVON there); the 3x batch is
    # IVON-PoCoMo's equal within the margin
    assert claims["c"]["verdict"] == "holds", claims["c"]["result"]

    def far(arm, seed, t):            # the 3x batch far ahead: 'about as good' fails
        base = 3.0 - t / sc.steps + jitter[seed]
        if arm == "ivon-3x":
            return base - (0.5 if t == sc.steps else 0.0)
        pocomo = arm.startswith("pocomo@") and t > int(arm.split("@")[1])
        return base - (0.1 if pocomo else 0.0)
    (c,) = [c for c in C.judge(synthetic(sc, far), sc, {})["claims"] if c["id"] == "c"]
    assert "about as good: does not hold" in c["result"][2]


def test_missing_arms_one_seed_and_divergence_are_reported_not_crashed():
    sc = dataclasses.replace(S.SCALES["quick"], seeds=1)

    def plain(arm, seed, t):
        return 3.0 - t / sc.steps
    results = [r for r in synthetic(sc, plain) if not r["arm"].startswith("alpha=")
               and not r["arm"].startswith("refresh=")]
    results[0]["final_val_loss"] = float("nan")
    summary = C.judge(results, sc, {})
    verdicts = {c["id"]: c["verdict"] for c in summary["claims"]}
    assert verdicts["d"] == "correction beats none: inconclusive; U-shape: inconclusive"
    assert verdicts["f"] == "inconclusive" and verdicts["b"] == "inconclusive"
    assert summary["diverged"] == [f"{results[0]['arm']}/seed0"]
    assert "Diverged" in summary["table_md"] and "(one seed)" in summary["table_text"]
