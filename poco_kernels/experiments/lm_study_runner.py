"""The LM study's runs: :class:`Job` (an arm at a seed, and the key that decides whether a
saved result still holds), and running many (:func:`run_jobs`: saved ones reused, the
rest in this process or in worker processes, inside a window's clock, with a progress
bar counted in gradient evaluations). Training one run, and the worker processes, are
:mod:`.lm_study_workers`."""
from __future__ import annotations

import json
import os
import platform
import queue as queue_mod
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .lm_study_config import EVAL_SEED
from .lm_study_workers import Workers, _run_dir, _tokens, run_job, warm_job

__all__ = ["Job", "cached_result", "run_job", "run_jobs", "Workers", "machine",
           "device_name", "has_device"]


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
             quiet: bool = False, clock=None, workers: Optional[Workers] = None
             ) -> List[Dict[str, Any]]:
    """Every job's result, reusing saved ones; the rest run ``n_jobs`` at a time (worker
    processes of one thread each: ``workers``, or a pool of this call's; ``n_jobs=1``: in
    this process, with its threads), the longest first, with one progress bar in gradient
    evaluations.  A failed run stops the study (the queued runs are cancelled) with an
    error that names it.

    ``clock`` (a :class:`~.lm_study_time.Clock` with a budget): the runs go seed by seed
    in the order given, and a run the clock says would end after the window (counting
    the start of the worker it would start) is not started (its result is missing from
    the list; ``clock.skipped`` names it); each finished run's own time rescales it."""
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

    def next_job(start_s: float = 0.0) -> Optional[Job]:
        for j in queue:
            if clock is None or clock.fits(j, start_s):
                return j
            bar.update(j.cost())
        return None

    def done(j, r, seconds):
        results[j.run_id] = r
        if clock is not None:
            clock.finished(j, seconds)
        bar.set_postfix_str(j.run_id)
    own = None
    try:
        if n_jobs <= 1:
            while (j := next_job()) is not None:
                t0 = time.perf_counter()
                r = run_job(j, out, lambda rid, d: bar.update(d))
                done(j, r, time.perf_counter() - t0)
        elif todo:
            if workers is None:
                workers = own = Workers(n_jobs, warm_job(todo))
            pool, q = workers.pool, workers.queue
            futs: Dict[Any, Job] = {}

            def submit() -> bool:
                start = clock.rates.start_s if clock is not None and workers.fresh() else 0.0
                j = next_job(start)
                if j is not None:
                    futs[workers.submit(j, out)] = j
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
                    j = futs[f]
                    if f.exception() is not None:    # cancel what waits, let the
                        pool.shutdown(wait=True, cancel_futures=True)   # running end
                        raise RuntimeError(f"run {j.run_id} failed (the runs saved so "
                                           f"far are reused by a rerun): "
                                           f"{f.exception()!r}") from f.exception()
                    done(j, *f.result())
                pending -= finished
                for _ in finished:
                    if submit():
                        pending.add(next(reversed(futs)))
            drain(0.05)
    finally:
        bar.close()
        if own is not None:
            own.close(cancel=True)
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
