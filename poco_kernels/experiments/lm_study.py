"""Does posterior correction pay off?  The paper's language-model claims (Sec. 5.2, App.
'Ablations') rerun at CPU scale, with seeds, and judged from the numbers.

    python -m poco_kernels.experiments.lm_study            # the full study (~35 min, 2 cores)
    python -m poco_kernels.experiments.lm_study --quick    # the pipeline in about a minute
    python -m poco_kernels.experiments.lm_study --scale gpu-window            # one GPU, < 8 min
    python -m poco_kernels.experiments.lm_study --scale gpu-window --dry-run  # its plan and time

``--quick`` is a smoke scale (a tiny model, 40 steps): it exercises every stage, and its
verdicts, labelled so, decide nothing.

Every run is :class:`~poco_kernels.experiments.pretrain_loop.Trainer` (the package's
pretraining loop) on the built-in corpus (the source of Python's standard library as bytes,
:mod:`.lm_data`), with a small GPT (:data:`~.lm_study_config.SCALES`).  The arms (:func:`plan`), each over
``seeds`` seeds that fix the initialisation and the order of the training data (a run of
arm A and one of arm B with the same seed are paired):

* ``adamw-lr=*`` / ``ivon-lr=*``: learning-rate sweeps on seed 0; the best final
  validation loss picks the lr of ``adamw`` and of every IVON-type arm;
* ``adamw``, ``ivon``, ``ivon-3x`` (IVON on a 3x batch: the paper's "same compute" as
  IVON-PoCoMo; here 3 gradient evaluations a step against PoCoMo's 2 + mega/m);
* ``pocomo@S``: IVON-PoCoMo corrected from step S (plain IVON before, bit for bit);
* ``alpha=a``: constant alpha from the main start; ``sched=*``: alpha schedules from an
  early start; ``refresh=m``: a refresh every m steps (mega-batch fixed) from the main start.

A scale with a window (``Scale.budget_s``: ``gpu-window``, the claims (a)-(c) on one GPU
inside 8 minutes) runs seed by seed and starts no run that its time model
(:mod:`.lm_study_time`) says would end after the window; ``--dry-run`` prints the plan and
the predicted time (from a few steps of each kind timed on this machine's device, or
extrapolated to a GPU this machine does not have).

Outputs in ``--out-dir`` (default ``lm_study_out/``; ``gpu-window``:
``benchmarks/results/lm_study_gpu/<the GPU's name>/``): ``runs/<arm>/seed<k>/result.json``
(one per run; a rerun reuses every run whose settings are unchanged, so a stopped study
resumes), ``curves.csv`` (every run's evaluations), ``finals.csv``, ``claims.md`` (the
verdict table, :mod:`.lm_study_claims`), ``claims.json`` and PNG plots
(:mod:`.lm_study_plots`).  The scales and the arms' constants are in
:mod:`.lm_study_config`; docs/lm-study.md reports the full study.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .lm_study_config import ALPHA, SCALES, SCHEDULES, Scale
from .lm_study_runner import (Job, Workers, _run_dir, cached_result, device_name,
                              has_device, machine, run_jobs, warm_job)

__all__ = ["Scale", "SCALES", "Job", "plan", "sweep_jobs", "run_jobs", "run_study", "main"]



def _base_settings(sc: Scale, data: str) -> Dict[str, Any]:
    return dict(data=data, preset=sc.preset, n_layer=sc.n_layer, n_head=sc.n_head,
                n_embd=sc.n_embd, seq_len=sc.seq_len, batch_size=sc.batch,
                micro_batch=sc.batch, max_steps=sc.steps, lr_warmup=sc.lr_warmup,
                min_lr_ratio=0.1, eval_every=sc.eval_every, eval_batches=sc.eval_batches,
                log_every=sc.eval_every, ckpt_every=10 ** 9, device=sc.device,
                amp="none" if sc.device == "cpu" else "bf16", backend="auto",
                refresh_every=sc.refresh_every,
                mega_batches=sc.mega_batches, quiet=True,
                **{k: v for k, v in (("vocab_size", sc.vocab_size),
                                     ("block_size", sc.block_size)) if v is not None})


def _make(sc: Scale, arm: str, seed: int, optimizer: str, data: str = "stdlib", **over
          ) -> Job:
    s = _base_settings(sc, data)
    s.update(over, seed=seed)
    if optimizer != "adamw":
        s["beta2"] = sc.ivon_beta2
    if optimizer == "ivon-pocomo":
        s.setdefault("alpha", str(ALPHA))
    else:                                   # settings IVON-PoCoMo alone reads
        for k in ("refresh_every", "mega_batches", "alpha", "poco_start"):
            s.pop(k, None)
    return Job(arm, seed, optimizer, tuple(sorted(s.items())), sc.final_eval_batches,
               sc.batch)


def sweep_jobs(sc: Scale, data: str = "stdlib") -> List[Job]:
    """Stage 1: the learning-rate sweeps (seed 0)."""
    return ([_make(sc, f"adamw-lr={lr:g}", 0, "adamw", data, lr=lr) for lr in sc.adamw_lrs]
            + [_make(sc, f"ivon-lr={lr:g}", 0, "ivon", data, lr=lr) for lr in sc.ivon_lrs])


def plan(sc: Scale, adamw_lr: float, ivon_lr: float, data: str = "stdlib") -> List[Job]:
    """Stage 2: every arm at every seed, with the learning rates the sweeps picked.  The
    sweeps' seed-0 runs at those rates are seed 0 of ``adamw`` and ``ivon`` (reused);
    ``alpha=0.7`` and ``refresh=<refresh_every>`` are ``pocomo@<start>``."""
    jobs = []

    def _job(*args, **kw):
        return _make(*args, data=data, **kw)
    for seed in range(sc.seeds):
        jobs.append(_job(sc, "adamw", seed, "adamw", lr=adamw_lr))
        jobs.append(_job(sc, "ivon", seed, "ivon", lr=ivon_lr))
        # (on a GPU the 3x batch is one forward and backward: one pass's launches)
        whole = {} if sc.device == "cpu" else {"micro_batch": 3 * sc.batch}
        jobs.append(_job(sc, "ivon-3x", seed, "ivon", lr=ivon_lr, batch_size=3 * sc.batch,
                         **whole))
        for s in sorted(set(sc.starts) | {sc.start}, key=lambda s: (s != sc.start, s)):
            jobs.append(_job(sc, f"pocomo@{s}", seed, "ivon-pocomo", lr=ivon_lr, poco_start=s))
        if not sc.ablations:
            continue
        for a in sc.alphas:
            jobs.append(_job(sc, f"alpha={a:g}", seed, "ivon-pocomo", lr=ivon_lr,
                             poco_start=sc.start, alpha=str(a)))
        for name, spec in SCHEDULES.items():
            jobs.append(_job(sc, f"sched={name}", seed, "ivon-pocomo", lr=ivon_lr,
                             poco_start=sc.early, alpha=spec))
        for m in sc.refreshes:
            jobs.append(_job(sc, f"refresh={m}", seed, "ivon-pocomo", lr=ivon_lr,
                             poco_start=sc.start, refresh_every=m))
    return jobs


# --------------------------------------------------------------------------- one run


def _pick(results: List[Dict[str, Any]], prefix: str) -> Tuple[float, Dict[str, float]]:
    losses = {r["settings"]["lr"]: r["final_val_loss"] for r in results
              if r["arm"].startswith(prefix)}
    finite = {k: v for k, v in losses.items() if v == v and v != float("inf")}
    if not finite:
        raise RuntimeError(f"every {prefix}* run diverged: {losses}")
    return min(finite, key=finite.get), losses


def study_jobs(sc: Scale, data: str = "stdlib") -> List[Job]:
    """The runs a study trains, for its plan and time (``--dry-run``): the sweeps, then
    the arms at the sweeps' first lrs (the picked ones where a sweep has one lr), less
    the arms' runs that are sweep runs."""
    sweeps = sweep_jobs(sc, data)
    keys = {j.key() for j in sweeps}
    return sweeps + [j for j in plan(sc, sc.adamw_lrs[0], sc.ivon_lrs[0], data)
                     if j.key() not in keys]


def default_rates(sc: Scale, data: str = "stdlib", log=print):
    """The time model's rates for ``sc`` (:mod:`.lm_study_time`): measured on this
    machine's device, or, for a GPU this machine does not have, extrapolated to an
    H200."""
    from . import lm_study_time as T
    jobs = study_jobs(sc, data)
    if has_device(sc.device):
        log(f"measuring the rates of {sc.name}'s steps on {device_name(sc.device)}:")
        return T.measure(jobs, device_name(sc.device), log=log)
    return T.extrapolated(_model_settings(jobs), sc.batch)


def _model_settings(jobs: List[Job]) -> Dict[str, Any]:
    """An IVON-PoCoMo run's settings (the refresh's too), else the first run's."""
    return next((j.cfg_dict() for j in jobs if j.optimizer == "ivon-pocomo"),
                jobs[0].cfg_dict())


def _stages(sc: Scale, out: Path, n_jobs: int, quiet: bool, log, data: str, clock,
            workers) -> Tuple[List[Dict[str, Any]], List[Job], List[Dict[str, Any]], tuple]:
    """The lr sweeps, then the arms at the picked rates: (sweep results, the arms' jobs,
    their results, (adamw_lr, adamw_sweep, ivon_lr, ivon_sweep))."""
    sweeps = run_jobs(sweep_jobs(sc, data), out, n_jobs, "lr sweeps", quiet, clock,
                      workers)
    if len(sweeps) < len(sweep_jobs(sc, data)):
        raise RuntimeError(f"the lr sweeps do not fit the window of {clock.budget_s:.0f} s "
                           f"(not started: {clock.skipped}); the runs saved so far are "
                           "reused by a rerun")
    adamw_lr, adamw_sweep = _pick(sweeps, "adamw-lr=")
    ivon_lr, ivon_sweep = _pick(sweeps, "ivon-lr=")
    log(f"lr sweeps (seed 0, final val loss): AdamW {adamw_sweep} -> {adamw_lr:g}; "
        f"IVON {ivon_sweep} -> {ivon_lr:g}")
    jobs = plan(sc, adamw_lr, ivon_lr, data)
    # seed 0 of adamw and ivon: the sweep runs at the picked rates, copied
    for j in jobs:
        src = {"adamw": f"adamw-lr={adamw_lr:g}", "ivon": f"ivon-lr={ivon_lr:g}"}.get(j.arm)
        if src is not None and j.seed == 0 and cached_result(out, j) is None:
            s = json.loads((out / "runs" / src / "seed0" / "result.json").read_text())
            if s["settings"] != j.cfg_dict():
                raise RuntimeError(f"{src}/seed0 does not have {j.run_id}'s settings")
            s.update(arm=j.arm, key=j.key(), copied_from=f"{src}/seed0")
            d = _run_dir(out, j)
            d.mkdir(parents=True, exist_ok=True)
            (d / "result.json").write_text(json.dumps(s, indent=1))
    results = run_jobs(jobs, out, n_jobs, "arms", quiet, clock, workers)
    return sweeps, jobs, results, (adamw_lr, adamw_sweep, ivon_lr, ivon_sweep)


def run_study(scale: str = "full", out_dir: str = "lm_study_out", n_jobs: int = 2,
              quiet: bool = False, log=print, data: str = "stdlib", rates=None,
              budget_s: Optional[float] = None) -> Dict[str, Any]:
    """Both stages, then the tables, verdicts and plots; returns the claims' summary.
    ``budget_s`` (default the scale's window): no run starts that the time model
    (``rates``, measured first where none are given) says would end after it."""
    from .lm_study_claims import judge, write_outputs
    from .lm_study_time import Clock
    sc = SCALES[scale]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    budget = sc.budget_s if budget_s is None else budget_s
    clock = None
    if budget is not None:
        clock = Clock(rates or default_rates(sc, data, log=log), budget, t0, n_jobs)
    workers = (Workers(n_jobs, warm_job(study_jobs(sc, data))) if n_jobs > 1
               else None)                          # (started once, for both stages)
    try:
        sweeps, jobs, results, picks = _stages(sc, out, n_jobs, quiet, log, data, clock,
                                               workers)
    finally:
        if workers is not None:
            workers.close()
    adamw_lr, adamw_sweep, ivon_lr, ivon_sweep = picks
    missing = [j.run_id for j in jobs if j.run_id not in {r["arm"] + "/seed" + str(r["seed"])
                                                        for r in results}]
    meta = {"scale": asdict(sc), "adamw_lr": adamw_lr, "ivon_lr": ivon_lr,
            "adamw_sweep": adamw_sweep, "ivon_sweep": ivon_sweep,
            "machine": machine(), "device": device_name(sc.device), "jobs": n_jobs,
            "torch_threads_per_run": 1 if n_jobs > 1 else None,
            "wall_s": time.perf_counter() - t0,           # this call (saved runs are reused)
            "runs": len({r["key"] for r in sweeps + results}),     # trained, copies once
            "run_s_total": sum({r["key"]: r["run_s"] for r in sweeps + results}.values()),
            "date": time.strftime("%Y-%m-%d"),
            "data": data,
            "budget_s": budget, "not_started": missing,
            "time_model": None if clock is None else {
                "rates": clock.rates.source, "worst_ratio": clock.ratio,
                "ratios": [round(r, 3) for r in clock.ratios],
                "parallel_efficiency": clock.rates.parallel_efficiency},
            "command": "python -m poco_kernels.experiments.lm_study"
                       + {"full": "", "quick": " --quick"}.get(scale, f" --scale {scale}")
                       + ("" if data == "stdlib" else f" --data {data}")}
    summary = judge(results, sc, meta)
    write_outputs(out, results, sweeps, summary, sc, meta)
    log(summary["table_text"])
    if missing:
        log(f"the window ended before {len(missing)} runs started ({', '.join(missing)}): "
            "the verdicts use the runs that finished; a rerun trains the rest")
    log(f"wrote {out}/claims.md, curves.csv, finals.csv and the plots")
    return summary


def dry_run(scale: str, n_jobs: int, data: str = "stdlib", log=print) -> str:
    """The plan of a study and its predicted time, without training it: from rates
    measured on this machine's device (a few steps of each kind), or, for a GPU scale
    without a GPU, from rates extrapolated to an H200 and an H100."""
    from . import lm_study_time as T
    sc = SCALES[scale]
    jobs = study_jobs(sc, data)
    n_sweeps = len(sweep_jobs(sc, data))              # (study_jobs: the sweeps first)
    stages = [jobs[:n_sweeps], sorted(jobs[n_sweeps:], key=lambda j: j.seed)]
    if has_device(sc.device):
        texts = [T.plan_text(jobs, default_rates(sc, data, log), n_jobs, sc.budget_s,
                             stages)]
    else:
        texts = [T.plan_text(jobs, T.extrapolated(_model_settings(jobs), sc.batch, dev),
                             n_jobs, sc.budget_s, stages) for dev in ("h200", "h100")]
    text = f"{scale}: {len(jobs)} runs (the arms' seed 0 of AdamW and IVON are the lr " \
           "sweeps' runs)\n" + "\n\n".join(texts)
    log(text)
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m poco_kernels.experiments.lm_study",
        description="The paper's LLM claims (IVON-PoCoMo against IVON and AdamW, alpha, "
                    "its schedules, the refresh interval) at CPU scale, over seeds.")
    p.add_argument("--quick", action="store_true",
                   help="a smoke scale (--scale quick): a tiny model and 40 steps, the "
                        "whole pipeline in about a minute; its verdicts decide nothing")
    p.add_argument("--scale", default="full", choices=tuple(SCALES),
                   help="full: the CPU study (about 35 min on 2 cores); gpu-window: claims "
                        "(a)-(c) on one GPU inside 8 minutes; ablation-33m: the paper's "
                        "ablation model on a GPU (with --data); quick, quick-window: smoke "
                        "scales of the pipelines")
    p.add_argument("--data", default="stdlib", help="'stdlib' (the built-in corpus) or a "
                   "directory with nanoGPT's uint16 train.bin and val.bin")
    p.add_argument("--out-dir", default=None,
                   help="default lm_study_out (full), lm_study_out/<scale> (the others), "
                        "benchmarks/results/lm_study_gpu/<the GPU's name> (gpu-window)")
    p.add_argument("--jobs", type=int, default=None,
                   help="runs at a time, one thread each (1: in this process); default the "
                        "scale's (gpu-window 4), else 2 on the CPU, 1 on a GPU")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan and its predicted time, train nothing (rates from a few "
                        "steps of each kind on this machine's device, or extrapolated to a "
                        "GPU it does not have)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="the window in seconds: no run starts that would end after it "
                        "(default: the scale's; gpu-window 450)")
    return p


def main(argv=None) -> Dict[str, Any]:
    a = build_parser().parse_args(argv)
    scale = "quick" if a.quick else a.scale
    jobs = a.jobs if a.jobs is not None else SCALES[scale].jobs or (
        1 if SCALES[scale].device != "cpu" else min(2, os.cpu_count() or 1))
    if jobs < 1:
        raise SystemExit("--jobs must be >= 1")
    if a.data != "stdlib" and not os.path.isdir(a.data):
        raise SystemExit(f"--data {a.data!r}: not 'stdlib' nor a directory")
    if a.dry_run:
        return {"plan": dry_run(scale, jobs, a.data)}
    if not has_device(SCALES[scale].device):
        raise SystemExit(f"--scale {scale} trains on a GPU and none is here: --dry-run "
                         "prints its plan")
    out = a.out_dir or ("lm_study_out" if scale == "full" else
                        f"benchmarks/results/lm_study_gpu/{_slug(device_name('cuda'))}"
                        if scale == "gpu-window" else f"lm_study_out/{scale}")
    return run_study(scale, out, jobs, a.quiet, data=a.data, budget_s=a.budget_s)


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


if __name__ == "__main__":
    main()
