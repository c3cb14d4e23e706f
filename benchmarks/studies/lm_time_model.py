"""The LM study's time model checked on this machine: rates measured from a few steps of
each kind (``lm_study_time.measure``: what ``--dry-run`` prints on a machine with the
device), then real runs of the study, each run's time against its prediction.

Rows: one per run trained (``--scale``'s runs, at most ``--runs`` of them, one of each arm
first; one at a time, in this process), with the predicted and measured seconds (the
measured time is ``run_job``'s whole call: model built, training, evaluations), their
ratio, and the measurement's own cost.  Writes ``<out>.md`` and ``<out>.json``.

    .venv/bin/python benchmarks/studies/lm_time_model.py --scale quick-window --out F
    .venv/bin/python benchmarks/studies/lm_time_model.py --scale full --runs 4 \
        --arms adamw-lr=0.003 ivon-lr=1 ivon-3x pocomo@500 --out F
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):    # run as a script: the repository root, for ``benchmarks.*``
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__)))))

from benchmarks.common.device import device_info  # noqa: E402


def main(argv=None) -> dict:
    from poco_kernels.experiments import lm_study as S
    from poco_kernels.experiments import lm_study_time as T
    from poco_kernels.experiments.lm_study_runner import (device_name, has_device, machine,
                                                          run_job)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", default="quick-window", choices=tuple(S.SCALES))
    p.add_argument("--runs", type=int, default=None, help="at most this many runs")
    p.add_argument("--arms", nargs="+", default=None, help="only these arms' runs")
    p.add_argument("--out", required=True, help="output path without extension")
    a = p.parse_args(argv)
    sc = S.SCALES[a.scale]
    if not has_device(sc.device):
        raise SystemExit(f"--scale {a.scale} needs a {sc.device} device")
    jobs = [j for j in S.study_jobs(sc) if a.arms is None or j.arm in a.arms]
    first = {}
    for j in jobs:                            # (one run of each arm first)
        first.setdefault(j.arm, j)
    order = list(first.values()) + [j for j in jobs if first[j.arm] is not j]
    order = order[:a.runs] if a.runs else order
    t0 = time.perf_counter()
    rates = T.measure(order, device_name(sc.device))
    measure_s = time.perf_counter() - t0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for j in order:
            t1 = time.perf_counter()
            run_job(j, Path(tmp))
            took = time.perf_counter() - t1
            pred = T.run_seconds(j, rates)
            rows.append({"run": j.run_id, "evals": j.cost(), "predicted_s": pred,
                         "measured_s": took, "ratio": took / pred})
            print(f"  {j.run_id:24s} predicted {pred:8.2f} s, took {took:8.2f} s "
                  f"({took / pred:.2f}x)", flush=True)
    total_p = sum(r["predicted_s"] for r in rows)
    total_m = sum(r["measured_s"] for r in rows)
    info = device_info(__import__("torch").device(sc.device))
    report = {"scale": a.scale, "machine": machine(), "device": info,
              "date": time.strftime("%Y-%m-%d"), "rates": rates.__dict__,
              "measure_s": measure_s, "rows": rows, "predicted_s": total_p,
              "measured_s": total_m}
    lines = [f"# The LM study's time model, scale {a.scale}", "",
             f"{machine()}; {report['date']}. Rates {rates.source}, measured in "
             f"{measure_s:.1f} s; then each run trained alone, in this process.", "",
             "| run | gradient evaluations | predicted s | measured s | measured / predicted |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['run']} | {r['evals']:.0f} | {r['predicted_s']:.2f} | "
              f"{r['measured_s']:.2f} | {r['ratio']:.2f} |" for r in rows]
    lines += ["", f"All {len(rows)} runs: predicted {total_p:.1f} s, measured {total_m:.1f} s "
              f"({total_m / total_p:.2f}x).", ""]
    Path(a.out + ".md").write_text("\n".join(lines))
    Path(a.out + ".json").write_text(json.dumps(report, indent=1, default=str))
    print("\n".join(lines))
    return report


if __name__ == "__main__":
    main()
