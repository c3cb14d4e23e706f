"""GPU check-and-benchmark of the Triton backend, in one call on a CUDA machine.

    python3 benchmarks/bench_gpu.py --quick --out $OUT    # the check: at most 4 minutes
    python3 benchmarks/bench_gpu.py --quick --smoke --out /tmp/q   # its CPU smoke run (CI)
    python3 benchmarks/bench_gpu.py --out $OUT            # CUDA: checks, then run.py's suite
    python3 benchmarks/bench_gpu.py --part 1 --out $OUT/p1  # one part of it (1-4, below)
    python3 benchmarks/bench_gpu.py --smoke --out /tmp/s  # CPU, TRITON_INTERPRET=1, tiny sizes

**Quick.** ``--quick`` runs ``gpu/quick.py``: open-loop and trajectory parity, the
steady-state checks, CUDA-graph capture and torch.compile, the optimizer-only and
end-to-end tables at GPT-2 124M shapes and the torch backend's sampling, each section
written to ``--out`` as it finishes (its docstring lists them).  Run it first on a lent
GPU; the parts below are the longer runs.

**Parts.** A device call is limited to 10 minutes, and the whole run does not fit one
(its JIT compilations alone take minutes), so it runs as four calls, each its own
``--part`` into its own ``--out``: 1 the checks (parity, no synchronisation, JIT cache
and memory, bf16 store, CUDA graph; each kernel variant compiled once here); 2 the
microbenchmarks, the optimizer table and memory; 3 the GPT training step's optimizer
share; 4 the pretraining throughput.  ``report["section_seconds"]`` records each section's time (the smoke run's
times size the parts: ``docs/benchmarks.md``).

Sections, in order (each one is written to ``--out`` as soon as it is done, so a crash
later keeps what came before):

1. **Device**: name, properties, versions, date (the copy bandwidth, the memory ceiling,
   is measured by the benchmark suite, section 3).
2. **Checks** (correctness first):
   * parity: the open-loop parity of every kernel operation (``gpu/openloop.py``) and the
     same trajectory (a quadratic loss, 30 steps, refresh at steps 5, 15, 25)
     with ``backend="torch"`` and ``backend="triton"`` on the device, for IVON-PoCo (Alg. 3
     defaults, several groups, fp32 and bf16 parameters, odd sizes), IVON-PoCo with the
     stabilisers (antithetic refresh pair, floor, 2 MC samples, independent outer noise)
     and plain IVON (2 MC samples).  Gate, per bucket buffer (the float32 ``mean`` and
     ``h`` of float32 buckets, the float32 master ``mean`` of bf16 buckets): the
     percentiles and the maximum of ``|a - b| / max|b|`` against those of the torch
     backend with its state moved by ``SENSITIVITY_ULPS`` ulp after every update
     (``gpu/parity.py``, ``gpu/config.py``);
   * no host synchronisation in steady-state ``sample``/``accumulate``/``restore``/``step``
     (``torch.cuda.set_sync_debug_mode``); no new Triton compilation when the learning
     rate changes every step; no growth of ``torch.cuda.memory_allocated`` across steps;
   * informational (not gating): the bits the kernels store into bf16 parameters against
     torch's float32 -> bfloat16 cast, on random values, rounding ties and specials;
   * CUDA-graph capture of a whole inner iteration and of a refresh, replayed with a
     scheduled learning rate and compared with the same steps run eagerly on a twin
     optimizer, bit for bit; torch.compile of a training step (``gpu/capture.py``).
3. **Benchmarks**: ``benchmarks/run.py``'s suite on the device (microbenchmarks of every
   backend beside ivon-opt and AdamW, memory, the GPT training step; see its docstring),
   plus the Triton-only rows of ``triton_extras`` in ``suite/micro.py`` (the step with
   ``.grad`` as views of the flat buffer, through a CUDA graph, and host-inclusive
   ``*_wall`` times).  Any option after this script's own (``--smoke``, ``--only``) goes
   to ``run.py`` (``--sizes``, ``--record``, ``--out``, ...).
4. Output in ``--out``: ``bench_gpu_report.json`` (device and checks) beside run.py's
   ``bench.csv``, ``bench.md`` and ``bench_report.json``; with ``--record``,
   ``benchmarks/results/suite/gpu_<device>_<date>[_partN].{csv,md}`` and, where checks
   ran, ``..._checks.json`` (a ``--part``'s files carry its name, so the four parts of one day
   keep four sets; a ``--skip`` given with ``--part`` adds to the part's skips).

Exit status: 0 all passed; otherwise the OR of 1 (parity above tolerance), 2 (a
synchronisation, JIT-cache, memory or graph-replay check failed) and 4 (a benchmark
raised).

ivon-opt is pure Python: where it is not installed (the CUDA image has no registry), a
wheel in ``<repo>/.whl/ivon_opt-*.whl`` is put on ``sys.path`` (zip import); without
either, its rows are skipped and the report says so.  To bring it to a machine without
network, on a machine with the package index: ``pip download ivon-opt==0.1.3 --no-deps -d
.whl`` at the repository root (``.whl/`` is ignored by git, never committed: ivon-opt is
GPL), then carry ``.whl`` with the command (the device tool's ``carry=[".whl"]``).
"""
from __future__ import annotations

import os
import sys

# The interpreter must be chosen before anything (torch included) imports triton.
SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402

if __package__ in (None, ""):    # run as a script: the repository root, for ``benchmarks.*``
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# configuration, the parity check, the steady-state and graph checks: gpu/config.py,
# gpu/parity.py, gpu/checks.py, gpu/capture.py; report: common/report.py (shared with run.py)
from benchmarks.common.device import device_info  # noqa: E402
from benchmarks.common.report import dump, json_default, log  # noqa: E402
from benchmarks.gpu.capture import check_compile, check_graph  # noqa: E402
from benchmarks.gpu.checks import (check_bf16_store, check_jit_and_memory,  # noqa: E402
                                   check_sync)
from benchmarks.gpu.config import (MAX_FACTOR, QUANTILE_FACTOR, SENSITIVITY_RUNS,  # noqa: E402
                                   SENSITIVITY_ULPS, SMOKE_SUITE_ARGS)
from benchmarks.gpu.parity import parity  # noqa: E402


#: part -> (sections, run.py sections skipped): each fits one 10-minute device call
PARTS = {1: (["parity", "checks", "graph"], []),
         2: (["bench"], ["train", "pretrain"]),
         3: (["bench"], ["micro", "memory", "pretrain", "table"]),
         4: (["bench"], ["micro", "memory", "train", "table"])}


# --------------------------------------------------------------------------- main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, add_help=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes on the CPU under TRITON_INTERPRET=1 (CUDA-only parts skipped)")
    ap.add_argument("--quick", action="store_true",
                    help="the check that fits one short device call (gpu/quick.py)")
    ap.add_argument("--only", nargs="*", default=None,
                    choices=["parity", "checks", "graph", "bench"],
                    help="sections to run (default: all)")
    ap.add_argument("--part", type=int, choices=sorted(PARTS), default=None,
                    help="one of the four parts that each fit a 10-minute device call "
                         "(sections and benchmark skips of PARTS)")
    ap.add_argument("-h", "--help", action="store_true")
    args, rest = ap.parse_known_args(argv)
    from benchmarks import run as suite_mod
    if args.help:
        ap.print_help()
        print("\nBenchmark options (benchmarks/run.py):")
        suite_mod.build_parser().print_help()
        return 0
    if args.quick:
        from benchmarks.gpu import quick as gpu_quick
        qa = argparse.ArgumentParser()
        qa.add_argument("--out", default="bench_out/quick")
        qa.add_argument("--budget-s", type=float, default=gpu_quick.BUDGET_S)
        qa.add_argument("--sections", nargs="*", default=None)
        q = qa.parse_args(rest)
        if not args.smoke and not torch.cuda.is_available():
            log("no CUDA device: run with --smoke for the CPU (interpreter) check")
            return 8
        return gpu_quick.main(q.out, args.smoke, q.budget_s, q.sections)
    sections = set(args.only or ["parity", "checks", "graph", "bench"])
    if args.part is not None:
        if args.only is not None:
            log("--part and --only are exclusive")
            return 8
        sections = set(PARTS[args.part][0])
    if args.smoke:
        rest = SMOKE_SUITE_ARGS + rest
        dev = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            log("no CUDA device: run with --smoke for the CPU (interpreter) check")
            return 8
        dev = torch.device("cuda", torch.cuda.current_device())
    bargs = suite_mod.build_parser().parse_args(rest)
    if args.part is not None:
        # a user's --skip adds to the part's (never runs what another part runs), and a
        # recording names its part, so four parts on one day keep four files
        bargs.skip = sorted(set(bargs.skip) | set(PARTS[args.part][1]))
        bargs.record_tag = bargs.record_tag or f"part{args.part}"
    if not args.smoke and bargs.ref_max_size is None:
        # the torch backend's rows at 2^20 only: they are the parity target, not a fast
        # path, and at every size they took most of a 10-minute call
        bargs.ref_max_size = 2 ** 20
    if args.smoke and bargs.record:
        log("    --record ignored with --smoke (results/ holds device measurements)")
        bargs.record = False
    t_start = time.perf_counter()
    os.makedirs(bargs.out, exist_ok=True)
    report_path = os.path.join(bargs.out, "bench_gpu_report.json")

    # 1. device
    info = device_info(dev)
    report = {"info": info, "trajectory_gate": {"SENSITIVITY_ULPS": SENSITIVITY_ULPS,
                                                "SENSITIVITY_RUNS": SENSITIVITY_RUNS,
                                                "QUANTILE_FACTOR": QUANTILE_FACTOR,
                                                "MAX_FACTOR": MAX_FACTOR}}
    log(f"[1] device: {info['device']} | torch {info['torch']} | triton {info['triton']} | "
        f"{info['date']}")
    for k in ("capability", "sm_count", "total_memory_gib", "l2_cache_mib", "cuda",
              "nvidia_smi", "git_head"):
        if k in info:
            log(f"    {k}: {info[k]}")
    dump(report_path, report)

    failures = {"parity": [], "checks": [], "bench": []}
    warns = []                                   # reported, not gating
    # 2. checks
    secs = report["section_seconds"] = {}
    t_sec = time.perf_counter()
    if "parity" in sections:
        log(f"[2] parity: open loop, and trajectories torch vs triton on {dev} (gate: "
            f"{QUANTILE_FACTOR:g} x the sensitivity to {SENSITIVITY_ULPS} ulp per update at "
            f"the 90th and 99th percentiles, {MAX_FACTOR:g} x at the maximum)")
        try:
            from benchmarks.gpu import openloop as gpu_openloop
            report["openloop"], failures["parity"] = gpu_openloop.run(dev, args.smoke, log)
            report["parity"], fails = parity(dev, args.smoke)
            failures["parity"] += fails
        except Exception as exc:
            traceback.print_exc()
            failures["parity"].append(f"parity raised {type(exc).__name__}: {exc}")
            report["parity"] = f"RAISED: {exc}"
        secs["parity"], t_sec = time.perf_counter() - t_sec, time.perf_counter()
        dump(report_path, report)
    if "checks" in sections:
        log("[2b] steady state: synchronisation, JIT cache, memory")
        for name, fn in (("sync", check_sync), ("jit_memory", check_jit_and_memory)):
            try:
                res, fails = fn(dev, args.smoke)
            except Exception as exc:
                traceback.print_exc()
                res, fails = f"RAISED: {exc}", [f"{name} raised {type(exc).__name__}: {exc}"]
            report[name] = res
            failures["checks"] += fails
            log(f"    {name}: {json.dumps(res, default=json_default)[:1500]}")
        try:
            report["bf16_store"] = check_bf16_store(dev)
            if report["bf16_store"]["mismatches"]:
                warns.append(f"bf16 store differs from torch's cast on "
                             f"{report['bf16_store']['mismatches']} values "
                             f"({'; '.join(report['bf16_store']['examples'][:3])})")
        except Exception as exc:
            traceback.print_exc()
            report["bf16_store"] = f"RAISED: {exc}"
            warns.append(f"bf16 store check raised {type(exc).__name__}: {exc}")
        secs["checks"], t_sec = time.perf_counter() - t_sec, time.perf_counter()
        dump(report_path, report)
    if "graph" in sections:
        log("[2c] CUDA graphs of an iteration and a refresh (replays vs an eager twin), "
            "torch.compile")
        for key, fn in (("graph", check_graph), ("compile", check_compile)):
            try:
                res, fails = fn(dev, args.smoke)
            except Exception as exc:
                traceback.print_exc()
                res, fails = f"RAISED: {exc}", [f"{key} raised {type(exc).__name__}: {exc}"]
            report[key] = res
            failures["checks"] += fails
        log(f"    graph: {json.dumps(res, default=json_default)[:1500]}")
        secs["graph"], t_sec = time.perf_counter() - t_sec, time.perf_counter()
        dump(report_path, report)

    # 3. the benchmarks: benchmarks/run.py's suite, on this device
    if "bench" in sections:
        log("[3] benchmarks (benchmarks/run.py)")
        try:
            code, _ = suite_mod.suite(bargs, dev, info)
            if code:
                failures["bench"].append(f"benchmark suite exit {code} (see bench.md)")
        except Exception as exc:
            traceback.print_exc()
            failures["bench"].append(f"benchmark suite raised {type(exc).__name__}: {exc}")
        secs["bench"] = time.perf_counter() - t_sec
    report["failures"] = failures
    report["warnings"] = warns
    report["seconds"] = time.perf_counter() - t_start
    dump(report_path, report)
    if bargs.record and sections - {"bench"}:     # the checks' report beside the tables
        path = suite_mod.record_base(info, bargs) + "_checks.json"
        shutil.copyfile(report_path, path)
        log(f"    recorded {path}")

    code = (1 if failures["parity"] else 0) | (2 if failures["checks"] else 0) | (
        4 if failures["bench"] else 0)
    log("-" * 96)
    for k, v in failures.items():
        for msg in v:
            log(f"FAIL [{k}] {msg}")
    for msg in warns:
        log(f"WARN (not gating) {msg}")
    gr = report.get("graph", "not run")
    log(f"graph capture: {gr.get('capture') if isinstance(gr, dict) else gr}; "
        f"replay: {gr.get('replay') if isinstance(gr, dict) else '-'}")
    log("sections: " + ", ".join(f"{k} {v:.0f} s" for k, v in secs.items()))
    log(f"{'PASS' if code == 0 else 'FAIL'} (exit {code}) in {report['seconds']:.0f} s; "
        f"outputs in {bargs.out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
