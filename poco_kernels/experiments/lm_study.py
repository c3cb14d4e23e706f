"""Does posterior correction pay off?  The paper's language-model claims (Sec. 5.2, App.
'Ablations') rerun at CPU scale, with seeds, and judged from the numbers.

    python -m poco_kernels.experiments.lm_study            # the full study (~35 min, 2 cores)
    python -m poco_kernels.experiments.lm_study --quick    # the pipeline in about a minute

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

Outputs in ``--out-dir`` (default ``lm_study_out/``): ``runs/<arm>/seed<k>/result.json``
(one per run; a rerun reuses every run whose settings are unchanged, so a stopped study
resumes), ``curves.csv`` (every run's evaluations), ``finals.csv``, ``claims.md`` (the
verdict table, :mod:`.lm_study_claims`), ``claims.json`` and PNG plots
(:mod:`.lm_study_plots`).  The scales and the arms' constants are in
:mod:`.lm_study_config`; docs/lm-study.md reports the full study.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import platform
import queue as queue_mod
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .lm_study_config import ALPHA, EVAL_SEED, SCALES, SCHEDULES, Scale

__all__ = ["Scale", "SCALES", "Job", "plan", "sweep_jobs", "run_jobs", "run_study", "main"]

@dataclass(frozen=True)
class Job:
    """One run: an arm at a seed."""
    arm: str
    seed: int
    optimizer: str
    settings: Tuple[Tuple[str, Any], ...]   # resolve_config overrides (sorted)
    final_eval_batches: int
    base_batch: int

    @property
    def run_id(self) -> str:
        return f"{self.arm}/seed{self.seed}"

    def cfg_dict(self) -> Dict[str, Any]:
        return dict(self.settings)

    def cost(self) -> float:
        """Gradient evaluations in base mini-batches (the progress bar's unit)."""
        s = self.cfg_dict()
        steps, scale = s["max_steps"], s["batch_size"] / self.base_batch
        if self.optimizer != "ivon-pocomo":
            return steps * scale
        corrected = max(steps - s["poco_start"], 0)
        refreshes = -(-corrected // s["refresh_every"])
        return steps + corrected + refreshes * s["mega_batches"]

    def key(self) -> str:
        """What decides the run's result: every setting of its resolved
        :class:`~.pretrain_config.RunConfig` (the recipe's too), the evaluation, the data's
        fingerprint and the package version.  A saved run is reused only when it equals."""
        if self not in _KEYS:
            from .. import __version__
            from .pretrain_config import resolve_config
            cfg = asdict(resolve_config(self.optimizer, "cpu", **self.cfg_dict()))
            for k in ("out_dir", "quiet"):
                cfg.pop(k)
            _KEYS[self] = json.dumps(
                {"config": cfg, "final_eval_batches": self.final_eval_batches,
                 "base_batch": self.base_batch, "eval_seed": EVAL_SEED,
                 "data": _tokens(cfg["data"]).fingerprint, "version": __version__},
                sort_keys=True, default=str)
        return _KEYS[self]


_KEYS: Dict[Job, str] = {}


def _base_settings(sc: Scale, data: str) -> Dict[str, Any]:
    return dict(data=data, preset=sc.preset, n_layer=sc.n_layer, n_head=sc.n_head,
                n_embd=sc.n_embd, seq_len=sc.seq_len, batch_size=sc.batch,
                micro_batch=sc.batch, max_steps=sc.steps, lr_warmup=sc.lr_warmup,
                min_lr_ratio=0.1, eval_every=sc.eval_every, eval_batches=sc.eval_batches,
                log_every=sc.eval_every, ckpt_every=10 ** 9, device=sc.device,
                amp="none" if sc.device == "cpu" else "bf16", backend="auto",
                refresh_every=sc.refresh_every,
                mega_batches=sc.mega_batches, quiet=True)


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
        jobs.append(_job(sc, "ivon-3x", seed, "ivon", lr=ivon_lr, batch_size=3 * sc.batch))
        for s in sorted(set(sc.starts) | {sc.start}):
            jobs.append(_job(sc, f"pocomo@{s}", seed, "ivon-pocomo", lr=ivon_lr, poco_start=s))
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
_DATA: Dict[str, Any] = {}


def _tokens(source: str):
    if source not in _DATA:
        from .lm_data import load_tokens
        _DATA[source] = load_tokens(source)
    return _DATA[source]


def _run_dir(out: Path, job: Job) -> Path:
    return out / "runs" / job.arm / f"seed{job.seed}"


def cached_result(out: Path, job: Job) -> Optional[Dict[str, Any]]:
    """The saved result of ``job`` when its settings are unchanged."""
    p = _run_dir(out, job) / "result.json"
    if not p.exists():
        return None
    try:
        r = json.loads(p.read_text())
    except ValueError:
        return None
    return r if r.get("key") == job.key() else None


def run_job(job: Job, out: Path, report: Optional[Callable[[str, float], None]] = None
            ) -> Dict[str, Any]:
    """Train ``job`` and write ``result.json``: its curve (step, gradient evaluations in
    base mini-batches, wall seconds outside evaluation, validation loss at the posterior
    mean on fixed windows), the final validation loss on ``final_eval_batches`` windows."""
    import torch
    from .pretrain_config import resolve_config
    from .pretrain_loop import Trainer

    rdir = _run_dir(out, job)
    if rdir.exists():
        shutil.rmtree(rdir)
    rdir.mkdir(parents=True)
    cfg = resolve_config(job.optimizer, "cpu", out_dir=str(rdir), **job.cfg_dict())
    data = _tokens(cfg.data)
    base, seq = job.base_batch, cfg.seq_len
    done = [0.0]

    class StudyTrainer(Trainer):
        def evaluate(self, batches: Optional[int] = None) -> float:
            """Mean loss at the posterior mean over fixed validation windows: the same
            for every arm and seed (:data:`EVAL_SEED`), whatever the batch size."""
            model, was = self.raw, self.raw.training
            model.eval()
            n = batches or cfg.eval_batches
            total = 0.0
            with torch.no_grad():
                for i in range(n):
                    x, y = data.batch("val", i, base, seq, EVAL_SEED, 0, base)
                    with self._autocast():
                        total += float(model(x.to(self.dev), y.to(self.dev))[1])
            model.train(was)
            return total / n

        def _record(self, step, loss, evaluate, rate) -> None:
            super()._record(step, loss, evaluate, rate)
            if report is not None:
                now = self.tokens / (base * seq)
                report(job.run_id, now - done[0])
                done[0] = now

    tr = StudyTrainer(cfg, data=data)
    t0 = time.perf_counter()
    tr.train()
    total = time.perf_counter() - t0
    final = tr.evaluate(job.final_eval_batches)
    curve, wall = [], 0.0
    prev = 0
    for row in tr.history:
        if row.get("step_ms") is not None:
            wall += row["step_ms"] * (row["step"] - prev) / 1e3
        prev = row["step"]
        if row["val_loss"] is not None:
            curve.append({"step": row["step"], "evals": row["tokens"] / (base * seq),
                          "wall_s": wall, "val_loss": row["val_loss"],
                          "train_loss": row["train_loss"], "alpha": row["alpha"],
                          "lr": row["lr"]})
    result = {"key": job.key(), "arm": job.arm, "seed": job.seed,
              "optimizer": job.optimizer, "settings": job.cfg_dict(),
              "final_val_loss": final, "final_eval_batches": job.final_eval_batches,
              "steps": tr.step, "evals": tr.tokens / (base * seq), "train_wall_s": wall,
              "run_s": total, "refreshes": getattr(tr.opt, "refresh_count", 0),
              "backend": getattr(tr.opt, "backend", "torch"), "curve": curve}
    for f in ("ckpt.pt", "log.csv", "summary.json"):     # the result holds what matters
        (rdir / f).unlink(missing_ok=True)
    (rdir / "result.json").write_text(json.dumps(result, indent=1))
    return result


def _worker(job: Job, out: str, q) -> Dict[str, Any]:
    import torch
    torch.set_num_threads(1)
    return run_job(job, Path(out), (lambda rid, d: q.put((rid, d))) if q is not None else None)


# --------------------------------------------------------------------------- many runs
class _Null:
    """No progress (``--quiet``)."""
    def __init__(self):
        self.n = 0.0

    def update(self, d):
        self.n += d

    def set_postfix_str(self, s):
        pass

    def close(self):
        pass


class _Lines(_Null):
    """Progress for a log that is not a terminal: a plain line at the start and at each
    tenth of the work done (at most eleven lines a stage; no carriage returns, no run
    names)."""
    def __init__(self, total: float, desc: str, file):
        super().__init__()
        self.total, self.desc, self.file = total, desc, file
        self.tenths, self.t0 = 0, time.perf_counter()
        print(f"{desc}: {total:.0f} gradient evaluations", file=file, flush=True)

    def update(self, d):
        self.n += d
        tenths = min(int(10 * self.n / self.total), 10) if self.total > 0 else 10
        if tenths > self.tenths:
            self.tenths = tenths
            print(f"{self.desc}: {10 * tenths}% after {time.perf_counter() - self.t0:.0f} s",
                  file=self.file, flush=True)


def _bar(total: float, desc: str, quiet: bool, file=None):
    """A tqdm bar on a terminal, occasional plain lines in a log, nothing when quiet."""
    file = sys.stderr if file is None else file
    if quiet or file is None:
        return _Null()
    try:
        from tqdm import tqdm
    except ImportError:                     # progress is optional
        tqdm = None
    isatty = getattr(file, "isatty", None)
    if tqdm is None or not (isatty is not None and isatty()):
        return _Lines(total, desc, file)
    return tqdm(total=round(total), desc=desc, unit="grad", dynamic_ncols=True,
                smoothing=0.05, mininterval=2.0, file=file)


def _stage_text(desc: str, n_runs: int, n_todo: int, n_shared: int) -> str:
    """``arms (37 to run, 2 shared with the lr sweeps)``: the runs to train, those saved
    by an earlier call, and those that are the lr sweeps' runs (seed 0 of ``adamw`` and
    ``ivon``, copied, not trained again)."""
    saved = n_runs - n_todo - n_shared
    parts = [f"{n_todo} to run"]
    if saved:
        parts.append(f"{saved} saved by an earlier run")
    if n_shared:
        parts.append(f"{n_shared} shared with the lr sweeps")
    return f"{desc} ({', '.join(parts)})"


def run_jobs(jobs: Sequence[Job], out: Path, n_jobs: int = 2, desc: str = "runs",
             quiet: bool = False) -> List[Dict[str, Any]]:
    """Every job's result, reusing saved ones; the rest run ``n_jobs`` at a time (worker
    processes of one thread each; ``n_jobs=1``: in this process, with its threads), the
    longest first, with one progress bar in gradient evaluations.  A failed run stops the
    study (the queued runs are cancelled) with an error that names it."""
    results: Dict[str, Dict[str, Any]] = {}
    todo = []
    for j in jobs:
        r = cached_result(out, j)
        if r is not None:
            results[j.run_id] = r
        else:
            todo.append(j)
    todo.sort(key=lambda j: -j.cost())
    shared = sum(1 for r in results.values() if r.get("copied_from"))
    bar = _bar(sum(j.cost() for j in todo),
               _stage_text(desc, len(jobs), len(todo), shared), quiet)
    try:
        if n_jobs <= 1:
            for j in todo:
                results[j.run_id] = run_job(j, out, lambda rid, d: bar.update(d))
                bar.set_postfix_str(j.run_id)
        elif todo:
            ctx = mp.get_context("spawn")
            with mp.Manager() as manager, cf.ProcessPoolExecutor(
                    n_jobs, mp_context=ctx) as pool:
                q = manager.Queue()
                futs = {pool.submit(_worker, j, str(out), q): j for j in todo}
                pending = set(futs)

                def drain(timeout):
                    try:
                        while True:
                            _, d = q.get(timeout=timeout)
                            bar.update(d)
                    except queue_mod.Empty:
                        pass
                while pending:
                    drain(0.2)
                    finished = {f for f in pending if f.done()}
                    for f in finished:
                        j = futs[f]
                        if f.exception() is not None:    # cancel what waits, let the
                            pool.shutdown(wait=True, cancel_futures=True)   # running end
                            raise RuntimeError(f"run {j.run_id} failed (the runs saved so "
                                               f"far are reused by a rerun): "
                                               f"{f.exception()!r}") from f.exception()
                        results[j.run_id] = f.result()
                        bar.set_postfix_str(j.run_id)
                    pending -= finished
                drain(0.05)
    finally:
        bar.close()
    return [results[j.run_id] for j in jobs]


# --------------------------------------------------------------------------- the study
def _pick(results: List[Dict[str, Any]], prefix: str) -> Tuple[float, Dict[str, float]]:
    losses = {r["settings"]["lr"]: r["final_val_loss"] for r in results
              if r["arm"].startswith(prefix)}
    finite = {k: v for k, v in losses.items() if v == v and v != float("inf")}
    if not finite:
        raise RuntimeError(f"every {prefix}* run diverged: {losses}")
    return min(finite, key=finite.get), losses


def machine() -> str:
    """The CPU's model name and the ISA the C++ kernels run."""
    from ..kernels import cpp_ops
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical CPUs, C++ kernels {cpp_ops.isa()}"


def run_study(scale: str = "full", out_dir: str = "lm_study_out", n_jobs: int = 2,
              quiet: bool = False, log=print, data: str = "stdlib") -> Dict[str, Any]:
    """Both stages, then the tables, verdicts and plots; returns the claims' summary."""
    from .lm_study_claims import judge, write_outputs
    sc = SCALES[scale]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    sweeps = run_jobs(sweep_jobs(sc, data), out, n_jobs, "lr sweeps", quiet)
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
    results = run_jobs(jobs, out, n_jobs, "arms", quiet)
    meta = {"scale": asdict(sc), "adamw_lr": adamw_lr, "ivon_lr": ivon_lr,
            "adamw_sweep": adamw_sweep, "ivon_sweep": ivon_sweep,
            "machine": machine(), "jobs": n_jobs, "torch_threads_per_run": 1,
            "wall_s": time.perf_counter() - t0,           # this call (saved runs are reused)
            "runs": len({r["key"] for r in sweeps + results}),     # trained, copies once
            "run_s_total": sum({r["key"]: r["run_s"] for r in sweeps + results}.values()),
            "date": time.strftime("%Y-%m-%d"),
            "data": data,
            "command": "python -m poco_kernels.experiments.lm_study"
                       + {"full": "", "quick": " --quick"}.get(scale, f" --scale {scale}")
                       + ("" if data == "stdlib" else f" --data {data}")}
    summary = judge(results, sc, meta)
    write_outputs(out, results, sweeps, summary, sc, meta)
    log(summary["table_text"])
    log(f"wrote {out}/claims.md, curves.csv, finals.csv and the plots")
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m poco_kernels.experiments.lm_study",
        description="The paper's LLM claims (IVON-PoCoMo against IVON and AdamW, alpha, "
                    "its schedules, the refresh interval) at CPU scale, over seeds.")
    p.add_argument("--quick", action="store_true",
                   help="a smoke scale (--scale quick): a tiny model and 40 steps, the "
                        "whole pipeline in about a minute; its verdicts decide nothing")
    p.add_argument("--scale", default="full", choices=tuple(SCALES),
                   help="full: the CPU study (about 35 min on 2 cores); ablation-33m: the "
                        "paper's ablation model on a GPU (with --data)")
    p.add_argument("--data", default="stdlib", help="'stdlib' (the built-in corpus) or a "
                   "directory with nanoGPT's uint16 train.bin and val.bin")
    p.add_argument("--out-dir", default=None,
                   help="default lm_study_out (lm_study_out/quick with --quick)")
    p.add_argument("--jobs", type=int, default=None,
                   help="runs at a time, one thread each (1: in this process); default 2 "
                        "on the CPU, 1 on a GPU")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv=None) -> Dict[str, Any]:
    a = build_parser().parse_args(argv)
    scale = "quick" if a.quick else a.scale
    jobs = a.jobs if a.jobs is not None else (
        1 if SCALES[scale].device != "cpu" else min(2, os.cpu_count() or 1))
    if jobs < 1:
        raise SystemExit("--jobs must be >= 1")
    if a.data != "stdlib" and not os.path.isdir(a.data):
        raise SystemExit(f"--data {a.data!r}: not 'stdlib' nor a directory")
    out = a.out_dir or ("lm_study_out" if scale == "full" else f"lm_study_out/{scale}")
    return run_study(scale, out, jobs, a.quiet, data=a.data)


if __name__ == "__main__":
    main()
