"""The benchmark command (``benchmarks/run.py``) runs end to end at tiny sizes and writes
the shared CSV schema and the tables; the memory section's measurements are right on
cases whose answer is known.  (Speed is read from the benchmark's own runs, never
asserted here.)"""
import csv
import json
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def bench_modules():
    """The benchmarks are the package ``benchmarks`` (the repository root is on
    ``sys.path``: conftest.py)."""
    from benchmarks import run
    from benchmarks.common import report as common
    from benchmarks.suite import memory
    return common, memory, run


@pytest.mark.skipif(os.environ.get("POCO_KERNELS_NO_EXTENSION") == "1",
                    reason="the CPU run benchmarks the C++ backend")
@pytest.mark.long
def test_run_writes_the_schema_and_tables(tmp_path, bench_modules):
    pytest.importorskip("ivon")
    common, _, run = bench_modules
    code = run.main(["--device", "cpu", "--sizes", "3001", "--dtypes", "float32", "bfloat16",
                     "--reps", "2", "--max-s", "1", "--copy-mib", "4", "--rotate-mib", "4",
                     "--gpt", "gpt-test", "--gpt-iters", "2", "--memory-numel", "30001",
                     "--pretrain-preset", "gpt-test", "--pretrain-batch", "4",
                     "--pretrain-steps", "12", "--table-scale", "smoke", "--table-reps", "3",
                     "--backends", "cpp", "torch", "--out", str(tmp_path)])
    assert code == 0, (tmp_path / "bench.md").read_text()
    with open(tmp_path / "bench.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == common.CSV_FIELDS
    got = {(r["kernel"], r["provider"], r["dtype"]) for r in rows}
    for dt in ("float32", "bfloat16"):
        for backend in ("cpp", "torch"):
            for k in ("sample_inner", "restore_accumulate", "ivon_step", "ivon_cycle",
                      "ivon_poco_step", "ivon_poco_cycle", "refresh_fold", "refresh_cycle"):
                assert (k, f"poco_kernels.{backend}", dt) in got, (k, backend, dt)
        for k in ("sample_inner", "restore_accumulate", "ivon_step", "ivon_cycle"):
            assert (k, "ivon-opt-0.1.3", dt) in got, (k, dt)
        for flag in ("foreach", "fused"):
            assert ("adamw_step", f"torch.AdamW({flag})", dt) in got
        assert ("step_kernel_poco", "poco_kernels.cpp(direct)", dt) in got
    assert ("copy", "torch.Tensor.copy_", "float32") in got
    for name in ("adamw", "ivon", "ivon_pocomo"):
        assert any(r["kernel"] == f"gpt_{name}_outside_fwd_bwd" for r in rows), name
        assert any(r["kernel"] == f"pretrain_{name}_step" for r in rows), name
    assert ("pretrain_ivon_opt_step", "ivon-opt-0.1.3", "float32") in got
    assert all(float(r["median"]) > 0 for r in rows if not r["kernel"].endswith("fwd_bwd"))
    # every microbenchmark row states its bytes, bandwidth and share of the ceiling
    for r in rows:
        if not r["kernel"].startswith(("gpt_", "pretrain_")):
            assert r["bytes_per_param"] and r["gbps"] and r["pct_of_copy"], r
    md = (tmp_path / "bench.md").read_text()
    for section in ("## Optimizer-step microbenchmarks", "## Memory",
                    "## Training step on a small GPT", "IVON-PoCoMo's inner step",
                    "## Pretraining throughput", "## The optimizer table"):
        assert section in md, section
    with open(tmp_path / "bench_report.json") as f:
        table = json.load(f)["optimizer_table"]
    from benchmarks.common.optimizer_table import KINDS, is_default
    assert list(table["rows"]) == [k for k in KINDS if not is_default(k, torch.device("cpu"))]
    for kind, r in table["rows"].items():
        for k in ("optimizer_ms", "ratio_to_fused_adamw", "host_us", "model_B_per_param",
                  "B_per_param_at_copy_bw", "resident_B_per_param"):
            assert r[k] is not None, (kind, k)
    rows = table["rows"]     # parameters and gradients float32: 8 B; AdamW's state 8 B
    # the protocol each of ours ran, and its byte model: the default parks where the
    # extension is built (the C++ backend here), else copies, and is counted as it ran
    from benchmarks.common.optimizer_table import model_bytes
    from poco_kernels import _sweeps
    assert rows["ivon"]["protocol"] == ("parked" if _sweeps.park is not None else "copy")
    assert (rows["ivon_copy"]["protocol"], rows["ivon_sample_ahead"]["protocol"]) == (
        "copy", "sample_ahead")
    cpu = torch.device("cpu")
    for kind, r in rows.items():
        assert r["model_B_per_param"] == round(model_bytes(kind, cpu, r.get("protocol")), 1)
    assert model_bytes("ivon", cpu, "copy") == model_bytes("ivon_copy", cpu) > \
        model_bytes("ivon", cpu, "parked")
    assert rows["adamw_fused"]["resident_B_per_param"] == 16.0
    assert rows["ivon"]["resident_B_per_param"] >= 20.0
    assert rows["ivon_pocomo_bf16_state"]["resident_B_per_param"] < rows[
        "ivon_pocomo_bf16_outer"]["resident_B_per_param"] < rows["ivon_pocomo"][
        "resident_B_per_param"]


def test_docs_document_the_benchmark_command():
    text = open(os.path.join(ROOT, "docs", "benchmarks.md")).read()
    assert ".venv/bin/python benchmarks/run.py" in text


def test_held_bytes_counts_known_state(bench_modules):
    """AdamW holds exp_avg and exp_avg_sq (8 B/param in float32; the step counters are
    scalars); ivon-opt holds momentum and hess in its param groups."""
    _, memory, _ = bench_modules
    p = torch.nn.Parameter(torch.randn(100003))
    p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([p], lr=1e-3, foreach=True)
    opt.step()
    held, per = memory.held_bytes(opt, [p])
    assert 8 * p.numel() <= held <= 8 * p.numel() + 64, per
    ivon = pytest.importorskip("ivon")
    q = torch.nn.Parameter(torch.randn(100003))
    io = ivon.IVON([q], lr=1e-3, ess=1.0)
    held, per = memory.held_bytes(io, [q])
    assert held == 8 * q.numel(), per


def test_count_allocations_sees_allocations(bench_modules):
    _, memory, _ = bench_modules
    n, nbytes = memory.count_allocations(lambda: torch.empty(1000), n=3)
    assert n == 1 and nbytes == 4000
    x, y = torch.zeros(1000), torch.ones(1000)
    n, nbytes = memory.count_allocations(lambda: x.add_(y), n=3)
    assert n == 0 and nbytes == 0


def test_fused_steady_state_allocates_nothing(backend, bench_modules):
    """A steady-state step and refresh of IVON-PoCoMo on a fused backend make no
    allocation (the torch backend allocates freely: it is not checked).  Triton runs
    here under its interpreter; on CUDA, run.py's memory section measures the same."""
    if backend == "torch":
        pytest.skip("the torch backend allocates temporaries by design")
    import poco_kernels as pk
    _, memory, _ = bench_modules
    params = [torch.nn.Parameter(torch.randn(n)) for n in (1001, 37)]
    grads = [torch.randn_like(p) for p in params]
    opt = pk.IVONPoCo(params, lr=1e-3, ess=10.0, rho1=0.6, rho2=0.1, backend=backend)

    def closure():
        for p, g in zip(params, grads):
            p.grad = g
    for _ in range(2):
        opt.step(closure)
        opt.refresh([closure, closure])
    assert memory.count_allocations(lambda: opt.step(closure)) == (0, 0)
    assert memory.count_allocations(lambda: opt.refresh([closure])) == (0, 0)


@pytest.mark.long
def test_bench_gpu_smoke_runs_the_suite_on_triton(tmp_path, bench_modules):
    """bench_gpu.py hands its benchmark section to run.py's suite (here on the Triton
    interpreter, tiny, memory, training and the optimizer table skipped: the table on
    Triton is the quick smoke run's, below, and took 220 s here); options after its own
    go to run.py."""
    pytest.importorskip("triton")
    from benchmarks import bench_gpu
    code = bench_gpu.main(["--smoke", "--only", "bench", "--backends", "triton", "--sizes",
                           "1031", "--dtypes", "float32", "--skip", "memory", "train",
                           "pretrain", "table", "--out", str(tmp_path)])
    assert code == 0
    with open(tmp_path / "bench.csv") as f:
        got = {(r["kernel"], r["provider"]) for r in csv.DictReader(f)}
    for k in ("ivon_poco_step", "refresh_fold", "sample_inner", "ivon_step"):
        assert (k, "poco_kernels.triton") in got, k
    assert ("step_kernel_poco", "poco_kernels.triton(direct)") in got
    assert (tmp_path / "bench_gpu_report.json").exists()


@pytest.mark.skipif(os.environ.get("POCO_KERNELS_NO_EXTENSION") == "1",
                    reason="the C++ kernels are the candidate")
def test_the_trajectory_gate_passes_the_kernels_and_fails_a_float32_beta2(bench_modules):
    """The closed-loop gate of the GPU check (gpu/parity.py), at smoke sizes on the CPU:
    the C++ kernels (the Triton kernels' bits) pass it against the torch backend; the same
    kernels with beta1 and beta2 rounded to float32 first (the Triton kernels' defect
    before their constants were made in double) fail it: the mean of both large buckets
    (float32 and bf16 parameters) and h, by 20-60 times at the 99th percentile here."""
    from benchmarks.gpu import parity as gpu_parity
    dev = torch.device("cpu")
    res, fails = gpu_parity.parity(dev, True, "cpp")
    assert fails == [], fails
    f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))  # noqa: E731
    res, fails = gpu_parity.parity(dev, True, "cpp", dict(beta1=f32(0.9), beta2=f32(0.9999)))
    bad = {(r["buffer"], r["bucket"]) for rs in res.values() for r in rs["rows"]
           if r["gated"] and not r["ok"]}
    assert {("mean", 0), ("mean", 1), ("h", 0)} <= bad, fails


@pytest.mark.long
def test_bench_gpu_quick_smoke_runs_every_section(tmp_path, bench_modules):
    """``bench_gpu.py --quick --smoke``: every section of the GPU check runs on the CPU
    (the Triton interpreter, tiny sizes), passes, and is written to its own file as it
    finishes, with the summary in quick.md and quick.json."""
    pytest.importorskip("triton")
    from benchmarks import bench_gpu
    from benchmarks.gpu import quick as gpu_quick
    code = bench_gpu.main(["--quick", "--smoke", "--out", str(tmp_path)])
    md = (tmp_path / "quick.md").read_text()
    assert code == 0, md
    with open(tmp_path / "quick.json") as f:
        summary = json.load(f)
    assert set(summary["sections"]) == set(gpu_quick.NEEDS_S)
    for name in gpu_quick.NEEDS_S:
        with open(tmp_path / f"{name}.json") as f:
            assert json.load(f)["failures"] == [], name
        assert f"## {name}" in md
    with open(tmp_path / "optimizer_only.json") as f:
        rows = json.load(f)["result"]["rows"]
    assert rows["ivon_pocomo"]["ratio_to_fused_adamw"] > 0
    with open(tmp_path / "capture.json") as f:
        assert json.load(f)["result"]["graph"]["replay"] == "bitwise equal to eager"
    with open(tmp_path / "host_calls.json") as f:
        host = json.load(f)["result"]
    assert set(host["step"]) == {"adamw_fused", "ivon", "ivon_pocomo", "ivon_jit_launch",
                                 "ivon_pocomo_jit_launch", "ivon_no_plan",
                                 "ivon_pocomo_no_plan", "ivon_sampled",
                                 "ivon_pocomo_sampled"}
    assert "| ivon_pocomo |" in (tmp_path / "host_step.md").read_text()
    with open(tmp_path / "steady.json") as f:
        launch = json.load(f)["result"]["launch"]
    assert launch["differ"] == [] and launch["state_tensors"] > 0


@pytest.mark.skipif(os.environ.get("POCO_KERNELS_NO_EXTENSION") == "1",
                    reason="measures the C++ backend beside the torch backend")
def test_host_overhead_writes_the_schema(tmp_path):
    from benchmarks.common.report import CSV_FIELDS
    from benchmarks.studies import host_overhead
    out = tmp_path / "host.csv"
    host_overhead.main(["--device", "cpu", "--tensors", "3", "--numel", "7", "--reps", "3",
                        "--backends", "cpp", "torch", "--out", str(out)])
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == CSV_FIELDS
    assert {(r["kernel"], r["provider"]) for r in rows} == {
        (k, f"poco_kernels.{b}")
        for k in ("protocol_step", "protocol_refresh", "protocol_step_skip")
        for b in ("cpp", "torch")}
    assert all(float(r["p20"]) <= float(r["median"]) <= float(r["p80"]) for r in rows)


@pytest.mark.skipif(os.environ.get("POCO_KERNELS_NO_EXTENSION") == "1",
                    reason="measures the C++ backend")
def test_host_profile_grad_views_and_engine_calls_studies_write_their_tables(tmp_path, monkeypatch):
    """Both studies at the optimizer table's smallest shapes: every requested row, with
    and without the gradient views, the profile of the chosen row."""
    from benchmarks.common import optimizer_table as ot
    from benchmarks.studies import grad_views, host_profile
    monkeypatch.setitem(ot.SCALES, "host", ot.SCALES["smoke"])    # (CI time)
    assert host_profile.main(["--device", "cpu", "--kinds", "adamw_fused", "ivon_pocomo",
                              "--iters", "3", "--warm", "1", "--profile", "ivon_pocomo",
                              "--profile-iters", "2", "--out", str(tmp_path / "hp")]) == 0
    with open(tmp_path / "hp" / "host_profile.json") as f:
        rows = json.load(f)["rows"]
    assert set(rows) == {"adamw_fused", "ivon_pocomo"}
    assert rows["ivon_pocomo"]["closure_calls"] == 2
    assert all(0 < r["closure_us"] < r["host_us"] for r in rows.values())
    text = (tmp_path / "hp" / "host_profile.md").read_text()
    # (the engine's functions: the slow path's, or a step plan's replay)
    assert "## cProfile: ivon_pocomo" in text and ("fused.py" in text or "fused_plan.py" in text)
    assert grad_views.main(["--device", "cpu", "--scales", "smoke", "--rounds", "1",
                            "--reps", "2", "--kinds", "adamw_fused", "ivon",
                            "--out", str(tmp_path / "gv")]) == 0
    with open(tmp_path / "gv" / "grad_views.csv") as f:
        got = {(r["row"], r["grad_views"]) for r in csv.DictReader(f)}
    assert got == {(k, v) for k in ("adamw_fused", "ivon") for v in ("True", "False")}
    assert "| smoke | ivon |" in (tmp_path / "gv" / "grad_views.md").read_text()
    from benchmarks.studies import engine_calls
    assert engine_calls.main(["--device", "cpu", "--calls", "3", "--rounds", "1",
                              "--out", str(tmp_path / "ec")]) == 0
    with open(tmp_path / "ec" / "engine_calls.json") as f:
        us = json.load(f)["us_per_call"]
    assert set(us) == {"hand_out", "unwritten", "zero_grad", "gather"}
    assert all(v > 0 for v in us.values())


def test_bench_gpu_parts_cover_every_section_once(tmp_path, bench_modules, monkeypatch):
    """``--part 1..4`` (one 10-minute device call each): together they run every check
    and every benchmark section exactly once, and each report times its sections."""
    pytest.importorskip("triton")
    from benchmarks import bench_gpu
    from benchmarks import run as suite_mod
    from benchmarks.gpu import openloop as gpu_openloop
    ran = []
    monkeypatch.setattr(bench_gpu, "parity", lambda dev, smoke: (ran.append("parity") or {}, []))
    monkeypatch.setattr(gpu_openloop, "run",
                        lambda dev, smoke, log: (ran.append("openloop") or {}, []))
    for name in ("check_sync", "check_jit_and_memory", "check_graph", "check_compile"):
        monkeypatch.setattr(bench_gpu, name,
                            lambda dev, smoke, name=name: (ran.append(name) or {}, []))
    monkeypatch.setattr(bench_gpu, "check_bf16_store",
                        lambda dev: {"mismatches": 0, "examples": []})
    sections = ("micro", "memory", "train", "pretrain", "table")

    def suite(bargs, dev, info):
        ran.extend(s for s in sections if s not in bargs.skip)
        return 0, None
    monkeypatch.setattr(suite_mod, "suite", suite)
    for part in sorted(bench_gpu.PARTS):
        out = tmp_path / f"p{part}"
        assert bench_gpu.main(["--smoke", "--part", str(part), "--out", str(out)]) == 0
        with open(out / "bench_gpu_report.json") as f:
            secs = json.load(f)["section_seconds"]
        assert set(secs) == set(bench_gpu.PARTS[part][0]), (part, secs)
    assert sorted(ran) == sorted(["openloop", "parity", "check_sync", "check_jit_and_memory",
                                  "check_graph", "check_compile", *sections])
    assert bench_gpu.main(["--smoke", "--part", "1", "--only", "bench"]) == 8
    # a user's --skip adds to the part's: never a section of another part
    seen = {}

    def suite2(bargs, dev, info):
        seen.update(skip=set(bargs.skip), tag=bargs.record_tag)
        return 0, None
    monkeypatch.setattr(suite_mod, "suite", suite2)
    for part, skip, runs in ((2, ["memory"], {"micro", "table"}), (3, ["memory"], {"train"}),
                             (4, ["micro", "pretrain"], set())):
        assert bench_gpu.main(["--smoke", "--part", str(part), "--skip", *skip,
                               "--out", str(tmp_path / "q")]) == 0
        assert set(sections) - seen["skip"] == runs, (part, seen)
        assert seen["tag"] == f"part{part}"
    # recordings of different parts on one day are different files
    info = {"slug": "gpu_X", "date": "2026-11-24T10:00:00"}
    names = {suite_mod.record_base(info, suite_mod.build_parser().parse_args(
        ["--record", "--record-tag", t])) for t in ("", "part2", "part3", "part 4/x")}
    assert len(names) == 4 and all(
        os.path.dirname(n).endswith(os.path.join("benchmarks", "results", "suite")) for n in names)
    assert {os.path.basename(n) for n in names} == {
        "gpu_X_2026-11-24", "gpu_X_2026-11-24_part2", "gpu_X_2026-11-24_part3",
        "gpu_X_2026-11-24_part_4_x"}


def test_compare_runs_takes_medians_per_side(tmp_path):
    """The before/after comparison: per row, the median over each side's runs, then the
    ratio; our rows and the control rows summarised apart."""
    from benchmarks.common.report import CSV_FIELDS
    from benchmarks.studies import compare_runs

    def write(name, rows):
        with open(tmp_path / name, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
            w.writeheader()
            for kernel, provider, median in rows:
                w.writerow({**{k: "" for k in CSV_FIELDS}, "kernel": kernel,
                            "provider": provider, "dtype": "float32", "size": "8",
                            "median": median})
    for i, (ours, ctl) in enumerate([(1.0, 2.0), (3.0, 2.0), (2.0, 2.0)]):
        write(f"base_{i}.csv", [("ivon_step", "poco_kernels.cpp", ours),
                                ("adamw_step", "torch.AdamW(fused)", ctl), ("copy", "x", 9)])
        write(f"new_{i}.csv", [("ivon_step", "poco_kernels.cpp", 2 * ours),
                               ("adamw_step", "torch.AdamW(fused)", ctl)])
    text = compare_runs.compare(compare_runs.load(str(tmp_path / "base_*.csv")),
                                compare_runs.load(str(tmp_path / "new_*.csv")))
    assert "| ivon_step | poco_kernels.cpp | float32 | 8 | 2000.000 | 4000.000 | 2.00 |" in text
    assert "poco_kernels rows: 1, new / base median 2.000" in text
    assert "control rows (unchanged code): 1, new / base median 1.000" in text
    assert "copy" not in text


def test_direct_reads_study_times_accumulate_with_the_kernels_out(tmp_path):
    """The in-place reading study: accumulate's host time with every kernel wrapper a
    no-op (the wrappers are put back after), and the address tables it kept."""
    from benchmarks.studies import direct_reads
    from poco_kernels.kernels import triton_ops
    before = {n: getattr(triton_ops, n) for n in direct_reads.STUBBED}
    assert direct_reads.main(["--device", "cpu", "--iters", "3", "--warm", "1",
                              "--out", str(tmp_path / "dr")]) == 0
    assert {n: getattr(triton_ops, n) for n in direct_reads.STUBBED} == before
    with open(tmp_path / "dr" / "direct_reads.json") as f:
        res = json.load(f)
    assert res["accumulate_host_us_median"] > 0 and res["tensors"] == 148
    assert 1 <= res["tables_kept"] <= 8        # (read in place: an address table was made)
    assert "| median us |" in (tmp_path / "dr" / "direct_reads.md").read_text()

