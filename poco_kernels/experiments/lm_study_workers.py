"""Where the LM study's runs train: one run (:func:`run_job`: train, evaluate, write
``result.json``), in this process or in the worker processes that train several at a
time (:class:`Workers`: spawned once per study, one thread each, each warmed by a few
throwaway steps before its first run, each run timed inside its worker, so that the time
model's clock compares a run's own time with its prediction, a process's start apart).
:mod:`.lm_study_runner` schedules the runs."""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import multiprocessing as mp
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from .lm_study_config import EVAL_SEED

#: a run: :class:`.lm_study_runner.Job` (not imported: the runner imports this module)
Job = Any

__all__ = ["Workers", "warm_job", "run_job", "short_run"]

#: the corpora read so far, by source (read once per process)
_DATA: Dict[str, Any] = {}


def _tokens(source: str):
    if source not in _DATA:
        from .lm_data import load_tokens
        _DATA[source] = load_tokens(source)
    return _DATA[source]


def _run_dir(out: Path, job: Job) -> Path:
    return out / "runs" / job.arm / f"seed{job.seed}"


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


@contextlib.contextmanager
def short_run(job: Job, steps: int, poco_start: Optional[int] = None,
              log_every: int = 10 ** 9):
    """A Trainer of ``job``'s settings cut to ``steps`` steps (a one-step lr warm-up, no
    curve evaluations, quiet; IVON-PoCoMo corrected from ``poco_start`` where given),
    writing into a temporary folder: the time model's rates and a worker's warm-up."""
    from .pretrain_config import resolve_config
    from .pretrain_loop import Trainer
    s = dict(job.cfg_dict())
    s.update(max_steps=steps, lr_warmup=1, eval_every=10 ** 9, log_every=log_every,
             quiet=True)
    if poco_start is not None and job.optimizer == "ivon-pocomo":
        s["poco_start"] = poco_start
    with tempfile.TemporaryDirectory() as tmp:
        yield Trainer(resolve_config(job.optimizer, "cpu", out_dir=tmp, **s),
                      data=_tokens(s["data"]))


def _warm_worker(warm: Optional[Job]) -> None:
    """A worker process's start, before its first run: one thread, and a few steps of
    ``warm`` (corrected from its first step, where it is IVON-PoCoMo) trained and thrown
    away, so that what a process does once (imports, the corpus read, the device's
    context, its libraries' and kernels' first calls) is the time model's process start
    and not its first run's time."""
    import torch
    torch.set_num_threads(1)
    if warm is None:
        return
    steps = min(warm.cfg_dict()["max_steps"], 2 + warm.cfg_dict().get("refresh_every", 0))
    try:
        with short_run(warm, steps, poco_start=1) as tr:
            tr.train()
            tr.evaluate()
    except Exception:         # (the run itself then fails, or pays the warm-up, and says so)
        pass


def _worker(job: Job, out: str, q) -> Tuple[Dict[str, Any], float]:
    """A run in a worker process: its result and its own seconds."""
    t0 = time.perf_counter()
    r = run_job(job, Path(out), (lambda rid, d: q.put((rid, d))) if q is not None else None)
    return r, time.perf_counter() - t0


def warm_job(jobs: Sequence[Job]) -> Optional[Job]:
    """The job whose first steps warm a worker: an IVON-PoCoMo one where there is one (it
    uses the most kernels), else the first."""
    return next((j for j in jobs if j.optimizer == "ivon-pocomo"), jobs[0] if jobs else None)


class Workers:
    """``n`` worker processes (spawned, one thread each, each warmed by a few steps of
    ``warm`` before its first run: :func:`_warm_worker`) and a progress queue, kept
    across the stages of a study (the workers start once); a context manager."""

    def __init__(self, n: int, warm: Optional[Job] = None):
        self.n, self.submitted = n, 0
        self._manager = mp.get_context("spawn").Manager()
        self.queue = self._manager.Queue()
        self.pool = cf.ProcessPoolExecutor(n, mp_context=mp.get_context("spawn"),
                                           initializer=_warm_worker, initargs=(warm,))

    def fresh(self) -> bool:
        """Whether the next run submitted starts a worker process (the first ``n``)."""
        return self.submitted < self.n

    def submit(self, job: Job, out: Path):
        self.submitted += 1
        return self.pool.submit(_worker, job, str(out), self.queue)

    def close(self, cancel: bool = False) -> None:
        self.pool.shutdown(wait=True, cancel_futures=cancel)
        self._manager.shutdown()

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc) -> None:
        self.close(cancel=exc[0] is not None)
