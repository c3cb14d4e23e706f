"""The host-time studies (``benchmarks/studies/host_*.py``) run at tiny sizes and write
their tables; what each subtracts and splits adds up.  (Speed is read from the studies'
own runs, never asserted here.)"""
import json
import os

import pytest

@pytest.mark.skipif(os.environ.get("POCO_KERNELS_NO_EXTENSION") == "1",
                    reason="measures the C++ backend")
def test_host_calls_study_splits_every_public_call_into_kernels_and_host(tmp_path):
    """The per-call host study at the 148 tiny tensors: every call of both protocols,
    each split into the kernels' part and the rest, and the per-iteration sum."""
    from benchmarks.studies import host_calls
    assert host_calls.main(["--device", "cpu", "--scale", "tiny", "--iters", "4",
                            "--warm", "1", "--refresh-every", "2", "--hook-rounds", "1",
                            "--out", str(tmp_path / "hc")]) == 0
    with open(tmp_path / "hc" / "host_calls.json") as f:
        rows = json.load(f)["rows"]
    assert set(rows) == {"ivon", "ivon_pocomo"}
    assert rows["ivon"]["tensors"] == 148
    for kind, r in rows.items():
        calls = r["calls"]
        want = {"zero_grad", "sample", "accumulate", "restore", "step", "step(closure)",
                "sampled()+step"}
        assert want <= set(calls), kind
        hooks = calls.pop("hooks in a backward")         # (inside autograd: no wall time)
        assert hooks["host_us"] >= 0 and hooks["calls_per_iteration"] == \
            calls["accumulate"]["calls_per_iteration"]
        for name, c in calls.items():
            assert 0 <= c["kernel_us"] <= c["wall_us"], (kind, name)
            assert c["host_us"] > 0, (kind, name)
        assert calls["step"]["kernel_us"] > 0            # the step kernel ran
        # (IVON-PoCoMo: the inner and the outer sample, and the refresh's every 2nd)
        assert calls["restore"]["calls_per_iteration"] == (2.5 if kind == "ivon_pocomo" else 1)
        assert r["protocol_host_us_per_iteration"] > calls["step"]["host_us"]
    assert {"refresh", "refresh(closures)"} <= set(rows["ivon_pocomo"]["calls"])
    assert "| step(closure) |" in (tmp_path / "hc" / "host_calls.md").read_text()


@pytest.mark.skipif(os.environ.get("POCO_KERNELS_NO_EXTENSION") == "1",
                    reason="measures the C++ backend")
def test_host_step_study_times_each_optimizer_less_its_gradient_writing(tmp_path):
    """The backward-free host study: every row, its gradient writing subtracted as many
    times as the closure runs, and the ratio to fused AdamW."""
    from benchmarks.studies import host_step
    assert host_step.main(["--device", "cpu", "--iters", "3", "--rounds", "1",
                           "--out", str(tmp_path / "hs")]) == 0
    with open(tmp_path / "hs" / "host_step.json") as f:
        rows = json.load(f)["rows"]
    assert set(rows) == {"adamw_fused", "ivon", "ivon_pocomo", "ivon_no_plan",
                         "ivon_pocomo_no_plan", "ivon_sampled", "ivon_pocomo_sampled"}
    assert rows["ivon_pocomo"]["closure_calls"] == 2 and rows["ivon"]["closure_calls"] == 1
    assert rows["ivon_pocomo_no_plan"]["closure_calls"] == 2
    assert rows["ivon_pocomo_sampled"]["closure_calls"] == 2
    for kind, r in rows.items():
        assert r["host_us"] == pytest.approx(
            r["iteration_us"] - r["closure_calls"] * r["gradient_writing_us"], abs=0.2), kind
        assert r["iteration_us"] > 0 and r["gradient_writing_us"] > 0
    assert rows["adamw_fused"]["x_fused_adamw"] == 1.0
    assert "| ivon_pocomo |" in (tmp_path / "hs" / "host_step.md").read_text()


@pytest.mark.skipif(os.environ.get("POCO_KERNELS_NO_EXTENSION") == "1",
                    reason="measures the C++ backend")
def test_host_closure_study_times_the_optimizer_beyond_each_closure(tmp_path):
    """The closure study: one row per closure, the optimizer's time beyond it (its own
    time timed inside it), medians no smaller than minima, over every kept iteration."""
    from benchmarks.studies import host_closure
    rows = host_closure.main(["--iters", "3", "--rounds", "2", "--kind", "ivon_pocomo",
                              "--out", str(tmp_path / "hcl")])
    assert set(rows) == set(host_closure.CLOSURES)
    for r in rows.values():
        assert 0 < r["min_us"] <= r["median_us"] and r["iterations"] == 6
    with open(tmp_path / "hcl" / "host_closure.json") as f:
        assert json.load(f)["rows"] == rows
    assert "| backward_detached |" in (tmp_path / "hcl" / "host_closure.md").read_text()
