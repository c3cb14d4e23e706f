"""The LM study's runs: :class:`Job` (an arm at a seed, and the key that decides whether a
saved result still holds), training one (:func:`run_job`), and running many in worker
processes with a progress bar counted in gradient evaluations (:func:`run_jobs`)."""
from __future__ import annotations

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

from .lm_study_config import EVAL_SEED

__all__ = ["Job", "cached_result", "run_job", "run_jobs", "machine", "device_name",
           "has_device"]

#: the corpora read so far, by source (read once per process)
_DATA: Dict[str, Any] = {}


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
            key = {"config": cfg, "final_eval_batches": self.final_eval_batches,
                   "base_batch": self.base_batch, "eval_seed": EVAL_SEED,
                   "data": _tokens(cfg["data"]).fingerprint, "version": __version__}
            if cfg["device"] != "cpu":        # (runs of two GPUs in one directory: apart)
                key["gpu"] = device_name(cfg["device"])
            _KEYS[self] = json.dumps(key, sort_keys=True, default=str)
        return _KEYS[self]


_KEYS: Dict[Job, str] = {}


def has_device(device: str) -> bool:
    """A run on ``device`` can train here (a CUDA scale needs a GPU)."""
    import torch
    return device != "cuda" or torch.cuda.is_available()


def device_name(device: str) -> str:
    """What trains a run on ``device`` here: the GPU's name, or :func:`machine`."""
    import torch
    if device == "cuda":
        return torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return machine()


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
             quiet: bool = False, clock=None) -> List[Dict[str, Any]]:
    """Every job's result, reusing saved ones; the rest run ``n_jobs`` at a time (worker
    processes of one thread each; ``n_jobs=1``: in this process, with its threads), the
    longest first, with one progress bar in gradient evaluations.  A failed run stops the
    study (the queued runs are cancelled) with an error that names it.

    ``clock`` (a :class:`~.lm_study_time.Clock` with a budget): the runs go seed by seed
    in the order given, and a run the clock says would end after the window is not
    started (its result is missing from the list; ``clock.skipped`` names it)."""
    results: Dict[str, Dict[str, Any]] = {}
    todo = []
    for j in jobs:
        r = cached_result(out, j)
        if r is not None:
            results[j.run_id] = r
        else:
            todo.append(j)
    budget = clock is not None and clock.budget_s is not None
    if budget:
        todo.sort(key=lambda j: j.seed)       # (stable: the plan's order within a seed)
    else:
        todo.sort(key=lambda j: -j.cost())
    shared = sum(1 for r in results.values() if r.get("copied_from"))
    bar = _bar(sum(j.cost() for j in todo),
               _stage_text(desc, len(jobs), len(todo), shared), quiet)
    queue = iter(todo)

    def next_job() -> Optional[Job]:
        for j in queue:
            if clock is None or clock.fits(j):
                return j
            bar.update(j.cost())
        return None

    def done(j, r, t0):
        results[j.run_id] = r
        if clock is not None:
            clock.finished(j, time.perf_counter() - t0)
        bar.set_postfix_str(j.run_id)
    try:
        if n_jobs <= 1:
            while (j := next_job()) is not None:
                t0 = time.perf_counter()
                done(j, run_job(j, out, lambda rid, d: bar.update(d)), t0)
        elif todo:
            ctx = mp.get_context("spawn")
            with mp.Manager() as manager, cf.ProcessPoolExecutor(
                    n_jobs, mp_context=ctx) as pool:
                q = manager.Queue()
                futs: Dict[Any, Tuple[Job, float]] = {}

                def submit() -> bool:
                    j = next_job()
                    if j is not None:
                        futs[pool.submit(_worker, j, str(out), q)] = (j, time.perf_counter())
                    return j is not None

                while len(futs) < n_jobs and submit():
                    pass
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
                        j, t0 = futs[f]
                        if f.exception() is not None:    # cancel what waits, let the
                            pool.shutdown(wait=True, cancel_futures=True)   # running end
                            raise RuntimeError(f"run {j.run_id} failed (the runs saved so "
                                               f"far are reused by a rerun): "
                                               f"{f.exception()!r}") from f.exception()
                        done(j, f.result(), t0)
                    pending -= finished
                    for _ in finished:
                        if submit():
                            pending.add(next(reversed(futs)))
                drain(0.05)
    finally:
        bar.close()
    return [results[j.run_id] for j in jobs if j.run_id in results]


# --------------------------------------------------------------------------- the study
def machine() -> str:
    """The CPU's model name and the ISA the C++ kernels run (or that they are not built:
    a GPU machine may not have built them)."""
    try:
        from ..kernels import cpp_ops
        isa = cpp_ops.isa()
    except Exception:                         # (ImportError: no extension built here)
        isa = "not built"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical CPUs, C++ kernels {isa}"
