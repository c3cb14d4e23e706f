"""How long the LM study's runs take (:mod:`.lm_study`): a time model, so that a study
planned for a device window (``Scale.budget_s``) fits it.

A run's time is its steps' (each kind of step at its own rate: an AdamW step, an IVON
step on the scale's batch or on 3x it, an IVON-PoCoMo step once corrected, its refreshes
included), its validation mini-batches', and a fixed cost per run and per process.  The
rates come from one of two places (:class:`Rates`):

* **measured** (:func:`measure`): a few steps of each kind trained on this device with the
  scale's model and settings (``--dry-run`` on a machine with the device);
* **extrapolated** (:func:`extrapolated`): for a GPU this machine does not have, from
  what this project measured on GPUs: a pass (forward and backward) costs the larger of
  its matrix products (GPT-2 124M on an H200, ``../shared/gpu-results/h200-2026-11-26``:
  about 287 TFLOP/s of model FLOPs) and its host's eager launches (the ``gpu-window``
  model on an H200, 2026-11-28: 15 ms a pass, where the FLOP model gives about 2 ms);
  :data:`GPU_ASSUMPTIONS` lists the numbers and what is assumed.

Several runs at a time (``--jobs N``, one process each) overlap one run's host work with
another's: :func:`speedup` is the throughput of N against one (N on the CPU's cores; on
a GPU an assumed efficiency per extra run, :attr:`Rates.parallel_efficiency`, not yet
measured), and until a run has finished the clock takes a run to last N / speedup(N)
times its prediction alone.  :func:`wall_seconds` plays the plan's schedule: the stages
one after the other (the lr sweeps, then the arms), each stage's runs in order on N
slots, the workers started once.

While a study runs, :class:`Clock` compares each finished run's time with its prediction
and scales the predictions of the runs still to start by the worst ratio seen, so a model
that was optimistic on a new device stops the study before it overruns, not after (and
one that was pessimistic does not skip runs that fit).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

__all__ = ["Rates", "step_kind", "run_seconds", "speedup", "wall_seconds", "extrapolated",
           "measure", "Clock", "plan_text", "GPU_ASSUMPTIONS", "KINDS"]

#: the kinds of training step whose rates differ
KINDS = ("adamw", "ivon", "ivon-3x", "pocomo")


@dataclass(frozen=True)
class Rates:
    """Seconds per unit of work on one device, for one scale's model."""
    device: str
    source: str                          # "measured ..." or "extrapolated ..."
    step_s: Dict[str, float]             # per kind of step (KINDS)
    val_s: float                         # one validation mini-batch (forward only)
    run_s: float                         # per run: model, optimizer, the first steps' warm-up
    start_s: float                       # per process: data, device context, kernels compiled
    parallel_efficiency: float = 1.0     # each run at a time beyond the first adds this
    #                                      much of a run's throughput (speedup)


def speedup(rates: Rates, n_jobs: int) -> float:
    """The throughput of ``n_jobs`` runs at a time against one."""
    return 1.0 + rates.parallel_efficiency * (max(n_jobs, 1) - 1)


def step_kind(optimizer: str, batch_scale: float, corrected: bool) -> str:
    if optimizer == "adamw":
        return "adamw"
    if optimizer == "ivon-pocomo" and corrected:
        return "pocomo"
    return "ivon-3x" if batch_scale > 1 else "ivon"


def run_seconds(job, rates: Rates) -> float:
    """The predicted time of one run (a :class:`~.lm_study_runner.Job`)."""
    s = job.cfg_dict()
    steps = s["max_steps"]
    scale = s["batch_size"] / job.base_batch
    start = s.get("poco_start", steps) if job.optimizer == "ivon-pocomo" else steps
    start = min(start, steps)
    t = (start * rates.step_s[step_kind(job.optimizer, scale, False)]
         + (steps - start) * rates.step_s[step_kind(job.optimizer, scale, True)])
    n_val = (steps // s["eval_every"] + 1) * s["eval_batches"] + job.final_eval_batches
    return t + n_val * rates.val_s + rates.run_s


# --------------------------------------------------------------------------- GPU
#: what the extrapolation to a GPU takes from the GPU runs of this project, and assumes
GPU_ASSUMPTIONS = {
    "tflops_h200_at_768": 287.0,       # measured: model FLOPs/s of GPT-2 124M's steps
    "narrow_derate": "linear in width below 768",    # small matmuls use the GPU less
    "h100_vs_h200": 0.8,               # H100 255.9k tokens/s against H200's 319k (124M)
    # fitted: the gpu-window model (6 layers, 384 wide, 16 x 256 tokens, bf16 autocast,
    # eager) took 15.4-16.8 ms an AdamW step, 15.5 an IVON step and 14.2-15.6 a pass of
    # IVON-3x and IVON-PoCoMo on the H200 of 2026-11-28 (their train times), where its
    # matrix products need about 2 ms by the FLOP model (not measured): the host's eager
    # launches (about 1,900 aten calls a pass) bound the step.  (GPT-2 124M's whole step
    # took 26.8 ms on another H200's host; 12 layers at this rate would be 28 ms of host
    # time: that host was faster, or its larger kernels hid part of the launches.)
    "host_s_per_layer": 2.2e-3,        # eager launches of one block, forward and backward
    "host_s_fixed": 2.0e-3,            # embeddings, head, loss, zero_grad, the data
    "kernel_floor_s": 4e-6,            # the least time of one kernel on the device
    "kernels_per_layer": 36, "kernels_fixed": 24,
    # measured there too (bench_gpu --quick, host_step: GPT-2's 148 tensors): fused
    # AdamW 0.76-1.0 ms of host time an iteration, IVON 0.66, IVON-PoCoMo 1.1
    "opt_host_s": {"adamw": 1.0e-3, "ivon": 7e-4, "pocomo": 1.1e-3},
    "opt_bytes_per_param": {"adamw": 28, "ivon": 56, "pocomo": 96},
    "bandwidth_bytes_s": 4.0e12,       # measured copy bandwidth (H200: 4.0-4.2 TB/s)
    "run_s": 4.0,                      # model built, first iterations, allocator warm
    "start_s": 40.0,                   # CUDA context, data, Triton's kernels compiled once
    # assumed, not measured: runs in separate processes on one GPU, each bound by its own
    # host core, interleave on the GPU while it has work from one of them only part of the
    # time; each run beyond the first adds this much of a run's throughput
    "parallel_efficiency": 0.75,
}


def model_size(settings: Dict) -> Dict[str, float]:
    """Weights of the study's GPT and its training FLOPs per token (6 per weight of the
    matrix products, the tied head included; attention 12 x layers x context x width)."""
    from .gpt import PRESETS
    p = PRESETS[settings["preset"]]
    v = settings.get("vocab_size") or p.vocab_size
    d, L = settings.get("n_embd") or p.n_embd, settings.get("n_layer") or p.n_layer
    block = settings.get("block_size") or p.block_size
    seq = settings.get("seq_len") or block
    matmul = v * d + L * 12 * d * d
    params = matmul + block * d + L * 13 * d + 2 * d
    return {"params": params, "flops_per_token": 6 * matmul + 12 * L * seq * d,
            "layers": L, "width": d, "seq": seq}


def extrapolated(settings: Dict, base_batch: int, device: str = "h200") -> Rates:
    """Rates on an H200 (or an H100) for the model of ``settings``, from
    :data:`GPU_ASSUMPTIONS`: a pass costs the larger of its GPU time and its host time, and
    IVON-3x's batch is one pass (the study's GPU scales train it whole)."""
    a = GPU_ASSUMPTIONS
    m = model_size(settings)
    tflops = a["tflops_h200_at_768"] * min(1.0, m["width"] / 768)
    if device == "h100":
        tflops *= a["h100_vs_h200"]
    tokens = base_batch * m["seq"]
    gpu = tokens * m["flops_per_token"] / (tflops * 1e12) + \
        (a["kernels_per_layer"] * m["layers"] + a["kernels_fixed"]) * a["kernel_floor_s"]
    host = a["host_s_per_layer"] * m["layers"] + a["host_s_fixed"]
    eval_s = max(gpu, host)

    def opt(kind):
        return a["opt_host_s"][kind] + \
            a["opt_bytes_per_param"][kind] * m["params"] / a["bandwidth_bytes_s"]
    refresh = settings.get("mega_batches", 0) / max(settings.get("refresh_every", 1), 1)
    step = {"adamw": eval_s + opt("adamw"), "ivon": eval_s + opt("ivon"),
            "ivon-3x": max(3 * gpu, host) + opt("ivon"),
            "pocomo": (2 + refresh) * eval_s + opt("pocomo")}
    val = max(gpu / 3, host / 3)           # (a forward: a third of a pass's launches)
    return Rates(device, f"extrapolated from this project's H200 runs ({device}; "
                 "lm_study_time.GPU_ASSUMPTIONS)", step, val, a["run_s"], a["start_s"],
                 a["parallel_efficiency"])


# --------------------------------------------------------------------------- measured
def measure(jobs: Sequence, device: str, steps: int = 0, log=print) -> Rates:
    """Rates measured here: a short run of each kind of step among ``jobs`` with its
    settings (AdamW, IVON, IVON on 3x the batch, IVON-PoCoMo corrected from its third
    step), timed after the first steps (IVON-PoCoMo's: after two refreshes, so that every
    kernel it uses is compiled); the validation batches timed too."""
    from .lm_study_workers import _tokens, short_run

    picked: Dict[str, object] = {}
    for j in jobs:
        s = j.cfg_dict()
        scale = s["batch_size"] / j.base_batch
        kinds = {step_kind(j.optimizer, scale, False)}
        if j.optimizer == "ivon-pocomo":
            kinds.add("pocomo")
        for k in kinds:
            picked.setdefault(k, j)
    step_s, val, runs = {}, [], []
    for kind, j in picked.items():
        m = j.cfg_dict().get("refresh_every", 1)
        # untimed: the first steps, and for IVON-PoCoMo two refreshes with the steps
        # between (every kernel a kind uses compiled, on a GPU, before the timing starts)
        warm = 4 + (2 * m if kind == "pocomo" else 0)
        warm += warm % 2
        n = steps or max(3 * m if kind == "pocomo" else 10, 10)
        n += n % 2
        _tokens(j.cfg_dict()["data"])         # (read before the timing)
        t0 = time.perf_counter()
        with short_run(j, warm + n, 2 if kind == "pocomo" else None, log_every=2) as tr:
            tr.train()
            spent = time.perf_counter() - t0
            rows = [r for r in tr.history if r.get("step_ms") and r["step"] > warm]
            t1 = time.perf_counter()
            tr.evaluate()                     # (it reads the loss back: synchronised)
            val.append((time.perf_counter() - t1) / tr.cfg.eval_batches)
        step_s[kind] = sum(r["step_ms"] for r in rows) / len(rows) / 1e3
        runs.append(spent - n * step_s[kind])
        log(f"  {kind:8s} {1e3 * step_s[kind]:9.2f} ms a step ({n} steps timed)")
    for k in KINDS:                           # (kinds no job has: from the closest)
        step_s.setdefault(k, 3 * step_s.get("ivon", 0.0) if k == "ivon-3x"
                          else step_s.get("ivon", 0.0))
    # (the first short run also paid what a process pays once: lazy initialisations,
    # kernels compiled; the others' fixed time is a run's)
    later = sorted(runs[1:]) or runs
    run_s = max(later[len(later) // 2], 0.0)
    on_gpu = jobs[0].cfg_dict().get("device", "cpu") != "cpu"
    return Rates(device, f"measured here ({', '.join(sorted(picked))}: "
                 f"{steps or 'a few'} steps each)", step_s, sum(val) / len(val),
                 run_s, max(runs[0] - run_s, 0.0),
                 GPU_ASSUMPTIONS["parallel_efficiency"] if on_gpu else 1.0)


# --------------------------------------------------------------------------- a study
@dataclass
class Clock:
    """The window of a study: predictions scaled by the worst ratio of a finished run's
    time to its prediction (until one finishes, by the slowdown ``n_jobs`` runs at a time
    are expected to cause each other); :meth:`fits` says whether a run may still start."""
    rates: Rates
    budget_s: Optional[float]
    t0: float = field(default_factory=time.perf_counter)
    n_jobs: int = 1
    ratio: float = field(init=False)     # (from n_jobs until a run finishes)
    skipped: List[str] = field(default_factory=list)
    ratios: List[float] = field(default_factory=list)

    def __post_init__(self):
        n = max(self.n_jobs, 1)
        self.ratio = n / speedup(self.rates, n)

    def predict(self, job) -> float:
        return run_seconds(job, self.rates) * self.ratio

    def fits(self, job, extra_s: float = 0.0) -> bool:
        """Whether ``job`` ends inside the window if it starts now (``extra_s``: time it
        waits for first, a worker process's start)."""
        if self.budget_s is None:
            return True
        ok = time.perf_counter() - self.t0 + extra_s + self.predict(job) <= self.budget_s
        if not ok:
            self.skipped.append(job.run_id)
        return ok

    def finished(self, job, seconds: float) -> None:
        """A run took ``seconds`` (its own time, its worker's start not included): the
        predictions scale by the worst ratio so far (below 1 too: measured rates that were
        pessimistic start no fewer runs than they could)."""
        self.ratios.append(seconds / max(run_seconds(job, self.rates), 1e-9))
        self.ratio = max(self.ratios)


def wall_seconds(stages: Sequence[Sequence], rates: Rates, n_jobs: int) -> float:
    """The predicted wall time of a study whose ``stages`` run one after the other:
    this process's start, with several slots the worker processes' start (once: they
    serve every stage), then per stage its runs in the order given, each on the first of
    ``n_jobs`` slots to come free, each lasting n_jobs / speedup times its time alone
    (the slowdown of runs at a time, in a stage's tail too)."""
    n = max(n_jobs, 1)
    slow = n / speedup(rates, n)
    wall = rates.start_s * (2 if n > 1 else 1)
    for runs in stages:
        if not runs:
            continue
        free = [0.0] * min(n, len(runs))
        for j in runs:
            i = free.index(min(free))
            free[i] += run_seconds(j, rates) * slow
        wall += max(free)
    return wall


def plan_text(jobs: Sequence, rates: Rates, n_jobs: int, budget_s: Optional[float],
              stages: Optional[Sequence[Sequence]] = None) -> str:
    """The plan of a study: each run's predicted time, the total against the window
    (``stages``: how ``jobs`` split into stages that run one after the other; default
    one)."""
    lines = [f"rates: {rates.source}"]
    lines.append("  step ms: " + ", ".join(f"{k} {1e3 * v:.2f}"
                                           for k, v in rates.step_s.items()))
    lines.append(f"  validation batch {1e3 * rates.val_s:.2f} ms; per run {rates.run_s:.1f} s; "
                 f"per process {rates.start_s:.0f} s")
    total = 0.0
    for j in jobs:
        t = run_seconds(j, rates)
        total += t
        lines.append(f"  {j.run_id:24s} {j.cost():8.0f} gradient evaluations  {t:7.1f} s")
    wall = wall_seconds([jobs] if stages is None else stages, rates, n_jobs)
    lines.append(f"{len(jobs)} runs, {total:.0f} s of runs; predicted wall time {wall:.0f} s "
                 f"({wall / 60:.1f} min) at {n_jobs} run(s) at a time"
                 + ("" if budget_s is None else
                    f"; window {budget_s:.0f} s: {'fits' if wall <= budget_s else 'OVERRUNS'}"))
    return "\n".join(lines)
