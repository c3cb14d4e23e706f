"""The language-model study's verdicts (:mod:`.lm_study`): each of the paper's claims
judged on paired seed differences, and the tables, CSVs and plots that show them.

How a comparison is decided.  Runs of two arms with the same seed share the
initialisation and the training-data order, so each claim is judged on the per-seed
differences ``d_s = L_A(s) - L_B(s)`` of validation losses (nats; lower is better).
With ``n`` seeds, mean ``d``, standard error ``se = sd / sqrt(n)`` and Student's ``t`` at
95% two-sided with ``n - 1`` degrees of freedom, the interval is ``d +- t se``:

* "A below B" **holds** when the whole interval is below 0, **does not hold** when it is
  above 0, and is **inconclusive** when it contains 0 (the difference does not exceed
  the seed spread);
* "A about as good as B" holds when the whole interval lies within ``+-margin``
  (:func:`similar`), does not hold when it lies wholly outside, and is inconclusive
  otherwise.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence

from .lm_study_config import ALPHA
from .lm_study_report import (CURVE_FIELDS, SMOKE_NOTE, _mean, _sd, _secs,  # noqa: F401
                              claims_markdown, claims_text, write_outputs)

__all__ = ["Diff", "paired", "below", "above", "similar", "loss_at", "judge", "write_outputs",
           "T95", "NOT_RUN"]

#: the verdict of a claim whose arms a scale does not run
NOT_RUN = "not run at this scale"

#: on a GPU, the largest difference of IVON-PoCoMo's and IVON's validation curves before
#: the correction starts that still counts as the same run (nats: bf16 autocast and
#: non-deterministic kernels; a different trajectory differs by far more)
GPU_SAME_TOL = 0.02

#: Student's t, 97.5th percentile (95% two-sided), by degrees of freedom
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
       9: 2.262, 10: 2.228, 15: 2.131, 20: 2.086, 30: 2.042}


def _t95(df: int) -> float:
    if df in T95:
        return T95[df]
    ks = sorted(k for k in T95 if k <= df)
    return T95[ks[-1]] if ks else float("inf")


@dataclass
class Diff:
    """Per-seed differences A - B and their 95% interval."""
    diffs: List[float]
    mean: float
    sd: float
    lo: float
    hi: float

    def text(self) -> str:
        if not self.diffs:
            return "no paired runs"
        return (f"{self.mean:+.4f} [{self.lo:+.4f}, {self.hi:+.4f}] "
                f"(n={len(self.diffs)}, sd {self.sd:.4f})")


def paired(a: Dict[int, float], b: Dict[int, float]) -> Diff:
    """The differences ``a[s] - b[s]`` over the seeds both have, with a 95% interval."""
    ds = [a[s] - b[s] for s in sorted(set(a) & set(b))]
    n = len(ds)
    if n == 0:
        return Diff([], math.nan, math.nan, math.nan, math.nan)
    m = sum(ds) / n
    sd = math.sqrt(sum((d - m) ** 2 for d in ds) / (n - 1)) if n > 1 else math.inf
    half = _t95(n - 1) * sd / math.sqrt(n) if n > 1 else math.inf
    return Diff(ds, m, sd, m - half, m + half)


def below(d: Diff) -> str:
    """'A below B' from ``d = A - B``."""
    if not d.diffs or math.isnan(d.mean):
        return "inconclusive"
    if d.hi < 0:
        return "holds"
    if d.lo > 0:
        return "does not hold"
    return "inconclusive"


def similar(d: Diff, margin: float) -> str:
    """'A about as good as B' (an equivalence test): holds when the whole interval lies
    within +-margin, does not hold when it lies wholly outside, else inconclusive."""
    if not d.diffs or math.isnan(d.mean):
        return "inconclusive"
    if -margin < d.lo and d.hi < margin:
        return "holds"
    if d.lo >= margin or d.hi <= -margin:
        return "does not hold"
    return "inconclusive"


def _combine(vs: Sequence[str]) -> str:
    if vs and all(v == "holds" for v in vs):
        return "holds"
    if any(v == "does not hold" for v in vs):
        return "does not hold" if not any(v == "holds" for v in vs) else "partly"
    return "partly" if any(v == "holds" for v in vs) else "inconclusive"


def above(d: Diff) -> str:
    """'A above B' from ``d = A - B`` (the mirror of :func:`below`)."""
    return {"holds": "does not hold", "does not hold": "holds"}.get(below(d), "inconclusive")


def _u_shape(final, arm_at: Dict[Any, str], label) -> "tuple[str, str]":
    """Whether the final losses over a setting (``arm_at``: setting -> arm, in order)
    have an interior minimum with both ends significantly above it: (verdict, evidence).
    A lowest mean at an end does not hold when that end is significantly below its
    neighbour, and is inconclusive otherwise."""
    xs = sorted(arm_at)
    means = {x: _mean(final(arm_at[x])) for x in xs}
    ran = [x for x in xs if not math.isnan(means[x])]
    if len(ran) < 3:
        return "inconclusive", f"only {len(ran)} of the {len(xs)} settings ran"
    best = min(ran, key=means.get)
    if best in (xs[0], xs[-1]):
        nxt = xs[1] if best == xs[0] else xs[-2]
        other = paired(final(arm_at[best]), final(arm_at[nxt]))
        return ("does not hold" if below(other) == "holds" else "inconclusive",
                f"the lowest mean is at {label(best)}, an end of the range; minus "
                f"{label(nxt)}: {other.text()}")
    ends = [paired(final(arm_at[e]), final(arm_at[best])) for e in (xs[0], xs[-1])]
    return (_combine([above(d) for d in ends]),
            f"lowest mean at {label(best)}; {label(xs[0])} minus it {ends[0].text()}, "
            f"{label(xs[-1])} minus it {ends[1].text()}")


# --------------------------------------------------------------------------- curves
def loss_at(curve: Sequence[Dict[str, float]], x: float, key: str = "step") -> float:
    """The validation loss at ``x`` on ``curve`` (by ``key``: step, evals or wall_s),
    linearly interpolated; nan past the curve's end."""
    pts = [(p[key], p["val_loss"]) for p in curve]
    if not pts or x < pts[0][0] or x > pts[-1][0] + 1e-9:
        return math.nan
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[-1][1]


class _Runs:
    def __init__(self, results):
        self.by: Dict[str, Dict[int, Dict[str, Any]]] = {}
        for r in results:
            self.by.setdefault(r["arm"], {})[r["seed"]] = r

    def final(self, arm: str) -> Dict[int, float]:
        return {s: r["final_val_loss"] for s, r in self.by.get(arm, {}).items()}

    def at(self, arm: str, x: float, key: str = "step") -> Dict[int, float]:
        out = {s: loss_at(r["curve"], x, key) for s, r in self.by.get(arm, {}).items()}
        return {s: v for s, v in out.items() if not math.isnan(v)}

    def evals(self, arm: str) -> float:
        rs = list(self.by.get(arm, {}).values())
        return sum(r["evals"] for r in rs) / max(len(rs), 1)

    def wall(self, arm: str) -> float:
        rs = list(self.by.get(arm, {}).values())
        return sum(r["train_wall_s"] for r in rs) / max(len(rs), 1)

    def stat(self, arm: str) -> str:
        v = list(self.final(arm).values())
        if not v:
            return "not run"
        m = sum(v) / len(v)
        if len(v) == 1:
            return f"{m:.4f} (one seed)"
        sd = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1))
        return f"{m:.4f} +- {sd:.4f} (ppl {math.exp(min(m, 50.0)):.2f})"

    def gap_until(self, arm: str, other: str, step: int) -> float:
        """The largest difference of the paired curves of ``arm`` and ``other`` up to
        ``step`` (0.0: identical; inf: a curve of another length; nan: no pair)."""
        pairs = [(r, self.by[other][s]) for s, r in self.by.get(arm, {}).items()
                 if s in self.by.get(other, {})]
        if not pairs:
            return math.nan
        gap = 0.0
        for a, b in pairs:
            va = [p["val_loss"] for p in a["curve"] if p["step"] <= step]
            vb = [p["val_loss"] for p in b["curve"] if p["step"] <= step]
            if len(va) != len(vb):
                return math.inf
            gap = max([gap] + [abs(x - y) for x, y in zip(va, vb)])
        return gap


# --------------------------------------------------------------------------- claims
def judge(results: List[Dict[str, Any]], sc, meta: Dict[str, Any]) -> Dict[str, Any]:
    """Every claim's verdict, with the numbers behind it."""
    R = _Runs(results)
    main = f"pocomo@{sc.start}"
    m = sc.refresh_every
    claims = []

    def add(cid, claim, setting, result, verdict):
        claims.append({"id": cid, "claim": claim, "setting": setting, "result": result,
                       "verdict": verdict})

    # (a) a drop in validation loss every time correction starts: at once (two
    # refreshes after the start) and within a tenth of the run
    parts, vs_once, vs_soon = [], [], []
    soon = max(sc.steps // 10, 2 * m)
    # a device whose runs are not bit-exact (cuDNN, atomics): the curves before the start
    # agree to within its noise, not bit for bit; the CPU's must be identical
    tol = 0.0 if getattr(sc, "device", "cpu") == "cpu" else GPU_SAME_TOL
    gaps = {}                                 # (start: IVON-PoCoMo's gap to IVON before it)
    for s in sorted(set(sc.starts) | {sc.start}):
        arm = f"pocomo@{s}"
        if not R.by.get(arm):
            parts.append(f"start {s}: not run")
            continue
        d = paired(R.at(arm, s + 2 * m), R.at("ivon", s + 2 * m))
        d_soon = paired(R.at(arm, s + soon), R.at("ivon", s + soon))
        end = paired(R.final(arm), R.final("ivon"))
        vs_once.append(below(d))
        if d_soon.diffs:
            vs_soon.append(below(d_soon))
        course = ", ".join(f"+{k}: {paired(R.at(arm, s + k), R.at('ivon', s + k)).mean:+.4f}"
                           for k in sorted({m, 2 * m, 5 * m, soon, 2 * soon})
                           if s + k <= sc.steps)
        gap = gaps[s] = R.gap_until(arm, "ivon", s)
        same = ("yes" if gap == 0.0 else f"within {gap:.2g}" if gap <= tol else "NO")
        parts.append(f"start {s}: at +{2 * m} steps {d.text()} -> {vs_once[-1]}; at "
                     f"+{soon} {d_soon.text()} -> {below(d_soon)}; mean by steps after the "
                     f"start {course}; at the end {end.text()}; identical to IVON up to "
                     f"{s}: {same}")
    verdict_a = (f"at once: {_combine(vs_once)}; within a tenth of the run: "
                 f"{_combine(vs_soon)}")
    if not gaps:
        verdict_a = NOT_RUN
    elif not all(g <= tol for g in gaps.values()):
        verdict_a = "invalid: IVON-PoCoMo differs from IVON before its start"
    add("a", "every time correction starts, validation loss drops at once",
        f"IVON-PoCoMo minus IVON (same seed): 'at once' {2 * m} steps (two refreshes) "
        f"after each start, then within a tenth of the run ({soon} steps)", parts,
        verdict_a)

    # (b) same steps: PoCoMo < IVON < AdamW
    d1 = paired(R.final(main), R.final("ivon"))
    d2 = paired(R.final("ivon"), R.final("adamw"))
    v1, v2 = below(d1), below(d2)
    add("b", "at the same number of steps IVON-PoCoMo ends below IVON, which ends below "
        "AdamW", f"final validation loss after {sc.steps} steps ({sc.final_eval_batches} "
        f"validation mini-batches); IVON-PoCoMo corrected from {sc.start}",
        [f"IVON-PoCoMo {R.stat(main)}; IVON {R.stat('ivon')}; AdamW {R.stat('adamw')}",
         f"IVON-PoCoMo - IVON: {d1.text()} -> {v1}",
         f"IVON - AdamW: {d2.text()} -> {v2}"], _combine([v1, v2]))

    # (c) per gradient evaluation: not faster than IVON; about IVON with a 3x batch
    e_ivon = R.evals("ivon")
    d3 = paired(R.at(main, e_ivon, "evals"), R.at("ivon", e_ivon, "evals"))
    v3 = above(d3)
    gain3x = paired(R.final("ivon-3x"), R.final("ivon"))
    d4 = paired(R.final(main), R.final("ivon-3x"))
    margin = abs(gain3x.mean) / 2 if gain3x.diffs else 0.0
    v4 = similar(d4, margin)
    e_main = R.evals(main)
    d5 = paired(R.at(main, e_main, "evals"), R.at("ivon-3x", e_main, "evals"))
    add("c", "per gradient evaluation IVON-PoCoMo is not faster than IVON, and it is about "
        "as good as IVON with a 3x batch (the same compute)",
        f"validation loss at IVON's {e_ivon:.0f} gradient evaluations (curve points, "
        f"{sc.eval_batches} mini-batches; IVON's lr has annealed there, IVON-PoCoMo's not "
        f"yet); final losses of IVON-PoCoMo ({e_main:.0f} evaluations) and IVON-3x "
        f"({R.evals('ivon-3x'):.0f}; the paper: the same compute) after {sc.steps} steps; "
        f"'about as good': the interval within +-half the 3x batch's gain over IVON",
        [f"at {e_ivon:.0f} evaluations, IVON-PoCoMo - IVON: {d3.text()} -> not faster: {v3}",
         f"IVON-3x {R.stat('ivon-3x')}; its gain over IVON {gain3x.text()}",
         f"same steps, IVON-PoCoMo - IVON-3x: {d4.text()}, margin +-{margin:.4f} -> "
         f"about as good: {v4} (below: {below(d4)})",
         f"at {e_main:.0f} evaluations (IVON-3x's curve), IVON-PoCoMo - IVON-3x: {d5.text()}",
         f"train wall time (s, mean): IVON {_secs(R.wall('ivon'))}, IVON-PoCoMo "
         f"{_secs(R.wall(main))}, IVON-3x {_secs(R.wall('ivon-3x'))}"],
        _combine([v3, v4]))

    if not getattr(sc, "ablations", True):
        for cid, claim in (("d", "over alpha, correction beats no correction, with a U-shape"),
                           ("e", "an increasing alpha schedule (0.2 -> 0.8) beats warm-up "
                                 "then 0.5, which beats decreasing (0.8 -> 0.2), which beats "
                                 "alpha = 1"),
                           ("f", "refreshing too often or too seldom both hurt")):
            add(cid, claim, f"no alpha, schedule or refresh arms at the {sc.name} scale",
                [], NOT_RUN)
        return _summary(R, claims, sc, meta)

    # (d) alpha: correction beats none; U-shape
    alphas = sorted(set(sc.alphas) | {ALPHA})
    arm_of = {a: (main if abs(a - ALPHA) < 1e-12 else f"alpha={a:g}") for a in alphas}
    arm_of[0.0] = "ivon"
    grid = sorted(arm_of)
    vs_none, parts = [], []
    for a in grid:
        if a == 0.0:
            continue
        d = paired(R.final(arm_of[a]), R.final("ivon"))
        v = below(d)
        if a < 1.0:
            vs_none.append(v)
        parts.append(f"alpha {a:g}: {R.stat(arm_of[a])}; minus IVON {d.text()} -> {v}")
    v_none = _combine(vs_none)
    v_u, u_text = _u_shape(R.final, arm_of, lambda a: f"alpha {a:g}")
    parts.append(u_text)
    add("d", "over alpha, correction beats no correction, with a U-shape",
        f"constant alpha from step {sc.start} (alpha 0: IVON), final validation loss "
        f"after {sc.steps} steps", parts,
        f"correction beats none: {v_none}; U-shape: {v_u}")

    # (e) schedules: increasing < warm-up then 0.5 < decreasing < alpha 1
    order = [("increasing 0.2 -> 0.8", "sched=increasing"),
             (f"0 until {sc.start}, then 0.5", "alpha=0.5"),
             ("decreasing 0.8 -> 0.2", "sched=decreasing"),
             ("alpha = 1", "sched=one")]
    parts = [f"{name}: {R.stat(arm)}" for name, arm in order]
    vs = []
    for (n1, a1), (n2, a2) in zip(order, order[1:]):
        d = paired(R.final(a1), R.final(a2))
        v = below(d)
        vs.append(v)
        parts.append(f"{n1} minus {n2}: {d.text()} -> {v}")
    d = paired(R.final("sched=increasing"), R.final("sched=decreasing"))
    parts.append(f"(outside the chain) increasing minus decreasing: {d.text()} -> {below(d)}")
    add("e", "an increasing alpha schedule (0.2 -> 0.8) beats warm-up then 0.5, which "
        "beats decreasing (0.8 -> 0.2), which beats alpha = 1",
        f"ramps over the corrected steps from step {sc.early} (the warm-up schedule from "
        f"{sc.start}); final validation loss after {sc.steps} steps", parts, _combine(vs))

    # (f) refresh interval: too often and too seldom both hurt
    ms = sorted(set(sc.refreshes) | {m})
    arm_m = {k: (main if k == m else f"refresh={k}") for k in ms}
    parts = [f"every {k}: {R.stat(arm_m[k])}, {R.evals(arm_m[k]):.0f} gradient "
             f"evaluations, {_secs(R.wall(arm_m[k]))} s" for k in ms]
    v_f, u_text = _u_shape(R.final, arm_m, lambda k: f"every {k}")
    parts.append(u_text)
    add("f", "refreshing too often or too seldom both hurt",
        f"mega-batch fixed at {sc.mega_batches} mini-batches, alpha {ALPHA:g} from "
        f"step {sc.start}; final validation loss after {sc.steps} steps (same steps: more "
        f"refreshes cost more evaluations)", parts, v_f)

    return _summary(R, claims, sc, meta)


def _summary(R: _Runs, claims, sc, meta) -> Dict[str, Any]:
    spreads = {arm: _sd(R.final(arm)) for arm in R.by}
    diverged = sorted(f"{arm}/seed{s}" for arm, runs in R.by.items()
                      for s, r in runs.items() if not math.isfinite(r["final_val_loss"]))
    summary = {"claims": claims, "meta": meta, "diverged": diverged,
               "decisive": getattr(sc, "decisive", True),
               "arms": {arm: {"final": R.final(arm), "stat": R.stat(arm),
                              "evals": R.evals(arm), "wall_s": R.wall(arm),
                              "sd": spreads[arm]} for arm in sorted(R.by)}}
    summary["table_md"] = claims_markdown(summary)
    summary["table_text"] = claims_text(summary)
    return summary
