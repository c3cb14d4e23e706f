"""IVON-PoCoMo against IVON over a short run corrected from a third of it, on the CPU: the
shape of the one GPU run where IVON-PoCoMo ended last (``bench_gpu.py --part 4``: GPT-2
124M, 200 steps, correction from step 66, the paper's IVON settings lr 0.3 and beta2
0.99999, one seed), at the LM study's CPU model, over seeds, under the paper's IVON
settings, the study's (lr 1, beta2 = 1 - 1/steps), and each with the other's lr.

Runs: ``ivon`` and ``pocomo@<start>`` for each setting and seed, the LM study's runner
and settings otherwise (``SCALES["full"]``'s model and batch, refresh every 10 steps on
10 mini-batches, alpha 0.7).  Writes ``<out>.md`` (final validation loss, IVON-PoCoMo
minus IVON per seed with the 95% interval) and ``<out>.json``.

    .venv/bin/python benchmarks/studies/short_horizon.py --out F [--steps 200] [--seeds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):    # run as a script: the repository root, for ``benchmarks.*``
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__)))))

#: IVON's lr and beta2: the paper's (the GPU run's recipe), the LM study's, and the two
#: crossings (None: the study's beta2, 1 - 1/steps)
SETTINGS = {"paper": (0.3, 0.99999), "study": (1.0, None), "paper-lr": (0.3, None),
            "paper-beta2": (1.0, 0.99999)}


def main(argv=None) -> dict:
    from poco_kernels.experiments import lm_study as S
    from poco_kernels.experiments import lm_study_claims as C
    from poco_kernels.experiments.lm_study_runner import machine, run_jobs
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", required=True, help="output path without extension")
    a = p.parse_args(argv)
    start = a.steps // 3
    sc = replace(S.SCALES["full"], steps=a.steps, lr_warmup=max(1, a.steps // 10),
                 eval_every=max(1, a.steps // 10), ivon_beta2=1 - 1 / a.steps)
    jobs = []
    for name, (lr, beta2) in SETTINGS.items():
        for seed in range(a.seeds):
            for arm, over in (("ivon", {}), (f"pocomo@{start}", {"poco_start": start})):
                j = S._make(sc, f"{name}:{arm}", seed,
                            "ivon" if arm == "ivon" else "ivon-pocomo", lr=lr, **over)
                if beta2 is not None:
                    j = replace(j, settings=tuple(sorted({**j.cfg_dict(),
                                                          "beta2": beta2}.items())))
                jobs.append(j)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        results = run_jobs(jobs, Path(tmp), a.jobs, "short runs", quiet=True)
    wall = time.perf_counter() - t0
    final = {}
    for r in results:
        final.setdefault(r["arm"], {})[r["seed"]] = r["final_val_loss"]
    lines = [f"# IVON-PoCoMo against IVON over {a.steps} steps, corrected from step {start}",
             "", f"{machine()}; {time.strftime('%Y-%m-%d')}; {len(results)} runs in "
             f"{wall:.0f} s, {a.jobs} at a time. The LM study's CPU model and settings "
             f"(`SCALES['full']`), {a.steps} steps, lr warm-up {sc.lr_warmup}, refresh every "
             f"{sc.refresh_every} steps on {sc.mega_batches} mini-batches, alpha 0.7; final "
             f"validation loss on {sc.final_eval_batches} mini-batches.", "",
             "| IVON settings | IVON | IVON-PoCoMo | IVON-PoCoMo - IVON, mean [95%] | "
             "PoCoMo below IVON |", "|---|---|---|---|---|"]
    rows = {}
    for name, (lr, beta2) in SETTINGS.items():
        iv, po = final[f"{name}:ivon"], final[f"{name}:pocomo@{start}"]
        d = C.paired(po, iv)
        rows[name] = {"ivon": iv, "pocomo": po, "diff_mean": d.mean, "lo": d.lo, "hi": d.hi,
                      "verdict": C.below(d)}
        b2 = beta2 if beta2 is not None else sc.ivon_beta2
        lines.append(f"| lr {lr:g}, beta2 {b2:g} | "
                     f"{', '.join(f'{v:.4f}' for _, v in sorted(iv.items()))} | "
                     f"{', '.join(f'{v:.4f}' for _, v in sorted(po.items()))} | "
                     f"{d.text()} | {C.below(d)} |")
    lines.append("")
    Path(a.out + ".md").write_text("\n".join(lines))
    Path(a.out + ".json").write_text(json.dumps(
        {"steps": a.steps, "start": start, "seeds": a.seeds, "machine": machine(),
         "wall_s": wall, "rows": rows, "runs": [{k: r[k] for k in (
             "arm", "seed", "final_val_loss", "settings", "curve")} for r in results]},
        indent=1, default=str))
    print("\n".join(lines))
    return rows


if __name__ == "__main__":
    main()
