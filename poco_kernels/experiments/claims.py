"""The paper's claims about its logistic-regression runs (Sec. 5.1, Fig. 2 and 4), judged
on one study's results.

The claims, as the paper states them:

1. SGD, VSGD and IVON do not converge to the performance of the minimiser (L-BFGS);
2. SVRG, VSGD-PoCo and IVON-PoCo reach it;
3. after each refresh (a mega-batch gradient) the performance jumps;
4. IVON and IVON-PoCo converge faster than the first-order methods.

Each is decided by :data:`CRITERIA` on the relative train-objective gap ``g = (F(m) -
F*) / F*`` of the mean ``m`` to the L-BFGS minimum ``F*``: on a small test set several
methods tie with L-BFGS in accuracy, while the objective keeps telling them apart.  The
test accuracies are reported beside the verdicts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

__all__ = ["Claim", "CRITERIA", "TARGETS", "FASTER_PAIRS", "evaluate", "format_claims",
           "evals_to_reach", "reach_bracket", "phase_targets", "compare_speed", "classify",
           "refresh_jumps"]

TARGETS = (1e-2, 1e-3)
#: (the IVON-type method, the first-order one, the phase the comparison is measured in):
#: uncorrected methods over the whole run; corrected ones after their first refresh,
#: before which they are their uncorrected twins
FASTER_PAIRS = (("ivon", "sgd", "run"), ("ivon", "vsgd", "run"),
                ("ivon-poco", "svrg", "corrected"), ("ivon-poco", "vsgd-poco", "corrected"))
JUMP_FACTOR = 2.0
FLOAT_FLOOR = 1e-12            # gaps below this are float64 noise: no jump is measured

CRITERIA = """How the claims are judged, on the relative train-objective gap g = (F(m) - F*) / F* to L-BFGS:
* reaches L-BFGS: the final g is at most --reach-tol;
* stalls below L-BFGS: the final g is above --reach-tol and the median g over the last quarter of the run is less than 2x below the median over the third quarter ("still descending" otherwise);
* a jump after a refresh: with w a tenth of the inner loop, the median g over the w steps after the refresh is at least 2x below the median over the w steps before it, and that fall is at least twice the fall between the two w-windows before (refreshes where g is already below 1e-12 are not counted); "holds" if every refresh of SVRG, VSGD-PoCo and IVON-PoCo jumps, "partly" if some do;
* faster: fewer gradient evaluations per example to first reach each target, in the phase where the claim applies: IVON against SGD and VSGD over the whole run at g <= 1e-2, 1e-3, 1e-4; IVON-PoCo against SVRG and VSGD-PoCo after the first refresh (counted from it, mega-batch included) at the three decades below both gaps at that refresh. The gap is recorded every tenth of the trace's interval; a target is decided when the two first-reach brackets (last point above, first point at or below) do not overlap, or only one method reaches it; a pair is "faster" when it is faster at every decided target and at least one is decided; "holds" if every pair is faster (a tie at every target, or a mix, counts against; pairs where neither method reaches any target are left out).
Test accuracy is shown beside the verdicts ("= L-BFGS" within one test example)."""


@dataclass
class Claim:
    claim: str
    verdict: str                 # holds / does not hold / partly / n/a
    evidence: List[str]          # one entry per method (or pair of methods)


def _gap(f: float, oracle) -> float:
    return (f - oracle.f) / abs(oracle.f)


def _by_name(results):
    return {r.method: r for r in results}


def _ran(r) -> bool:
    return r is not None and not r.skipped and len(r.trace) > 1


def _acc_note(r, oracle, n_test: int) -> str:
    tol = 1.0 / max(n_test, 1) - 1e-12
    diff = r.test_acc - oracle.test_acc
    rel = "= L-BFGS" if abs(diff) <= tol else ("below L-BFGS" if diff < 0 else "above L-BFGS")
    return f"test acc {r.test_acc:.4f} ({rel})"


def _median_gap(r, oracle, lo: float, hi: float) -> Optional[float]:
    """Median relative gap over the recorded points with step in [lo, hi]."""
    gs = [_gap(p[2], oracle) for p in r.trace if lo <= p[0] <= hi]
    return _median(gs) if gs else None


def classify(r, oracle, reach_tol: float) -> str:
    """'reaches' (final g <= reach_tol), 'stalls' (the median g over the last quarter of the
    run is less than 2x below that over the third quarter), 'still descending', or the
    run's failure status."""
    if r.status != "ok":
        return r.status
    if _gap(r.trace[-1][2], oracle) <= reach_tol:
        return "reaches"
    T = r.trace[-1][0]
    q3, q4 = _median_gap(r, oracle, 0.5 * T, 0.75 * T), _median_gap(r, oracle, 0.75 * T, T)
    if q3 is None or q4 is None:
        return "still descending"
    return "stalls" if q3 < JUMP_FACTOR * q4 else "still descending"


def evals_to_reach(r, oracle, target: float) -> Optional[float]:
    """Gradient evaluations per example at the first recorded point with g <= target."""
    b = reach_bracket(_gap_points(r, oracle), target)
    return None if b is None else b[1]


def _gap_points(r, oracle) -> List[Tuple[int, float, float]]:
    """(step, evals per example, g): the run's fine gap trace, else its trace."""
    if getattr(r, "gap_trace", None):
        return list(r.gap_trace)
    return [(t, e, _gap(f, oracle)) for t, e, f, _ in r.trace]


def reach_bracket(points, target: float, origin: float = 0.0
                  ) -> Optional[Tuple[float, float]]:
    """Where ``g <= target`` is first reached, as the bracket ``(lo, hi]`` of gradient
    evaluations per example counted from ``origin``: ``hi`` at the first recorded point
    with ``g <= target``, ``lo`` at the point before it (the crossing lies between: the
    recording's resolution).  None if never reached."""
    prev = None
    for _, e, g in points:
        if g <= target:
            lo = e if prev is None else prev
            return lo - origin, e - origin
        prev = e
    return None


def _phase(r, oracle, phase: str):
    """The points of ``phase`` and the evaluations they are counted from: the whole run
    ("run"), or from the start of the first refresh ("corrected": the mega-batch counts)."""
    pts = _gap_points(r, oracle)
    if phase == "run":
        return pts, 0.0
    if not r.refresh_steps:
        return [], 0.0
    s = r.refresh_steps[0]
    origin = r.refresh_evals[0][0] if getattr(r, "refresh_evals", None) else \
        next(e for t, e, _ in pts if t >= s)
    return [p for p in pts if p[0] >= s], origin


def phase_targets(a, b, oracle, phase: str) -> List[float]:
    """The gap targets a comparison in ``phase`` is decided at: TARGETS and the next decade
    over the whole run; after the first refresh, the three decades below both methods'
    gaps at that refresh (what the warm-up reached does not count), down to 1e-12."""
    if phase == "run":
        return list(TARGETS) + [TARGETS[-1] / 10]
    pa, pb = _phase(a, oracle, phase)[0], _phase(b, oracle, phase)[0]
    if not (pa and pb):
        return []
    start = min(pa[0][2], pb[0][2])
    if not start > FLOAT_FLOOR:
        return []
    k = math.floor(math.log10(start))
    top = 10.0 ** k if 10.0 ** k < start else 10.0 ** (k - 1)
    return [t for t in (top, top / 10, top / 100) if t >= FLOAT_FLOOR]


def compare_speed(a, b, oracle, phase: str) -> Tuple[str, str]:
    """Whether ``a`` reaches each of :func:`phase_targets` with fewer gradient evaluations
    per example than ``b`` within ``phase``: a target is decided when the two first-reach
    brackets do not overlap (touching brackets decide: one had reached the target where
    the other was still above it; one method reaching it and the other not decides too).
    Returns ('faster' / 'slower' / 'mixed' / 'tie within resolution' / 'neither reaches',
    the evidence)."""
    (pa, oa), (pb, ob) = _phase(a, oracle, phase), _phase(b, oracle, phase)
    wins, parts = [], []
    for t in phase_targets(a, b, oracle, phase):
        ba, bb = reach_bracket(pa, t, oa), reach_bracket(pb, t, ob)
        if ba is None and bb is None:
            parts.append(f"g<={t:.0e}: neither")
            continue
        if bb is None or (ba is not None and ba[1] <= bb[0]):
            wins.append(True)
        elif ba is None or bb[1] <= ba[0]:
            wins.append(False)
        else:
            wins.append(None)
        parts.append(f"g<={t:.0e}: {_fmt_b(ba)} vs {_fmt_b(bb)}"
                     + (" (tie within resolution)" if wins[-1] is None else ""))
    decided = [w for w in wins if w is not None]
    if not wins:
        verdict = "neither reaches"
    elif not decided:
        verdict = "tie within resolution"
    else:
        verdict = "faster" if all(decided) else ("slower" if not any(decided) else "mixed")
    where = ("over the run" if phase == "run" else
             "after the first refresh (evaluations counted from it, mega-batch included)")
    return verdict, f"{where}, evaluations/example to first reach: " + \
        (", ".join(parts) or "no target below both gaps at the refresh")


def refresh_jumps(r, oracle, refresh_every: int):
    """Per refresh at step s, with w a tenth of the inner loop: the median gaps m0 over
    [s - 2w, s - w), m1 over [s - w, s] and m2 over (s, s + w]; returns (s, m1 / m2 = the
    fall after, m0 / m1 = the fall before, the test-accuracy change over (s, s + w]).
    Refreshes with m1 below 1e-12 (float64 noise) or without points around are skipped."""
    out = []
    w = max(refresh_every // 10, 1)
    for s in r.refresh_steps:
        pts0 = [p for p in r.trace if s - 2 * w <= p[0] < s - w]
        pts1 = [p for p in r.trace if s - w <= p[0] <= s]
        pts2 = [p for p in r.trace if s < p[0] <= s + w]
        if not (pts0 and pts1 and pts2):
            continue
        m0, m1, m2 = (_median([_gap(p[2], oracle) for p in pts]) for pts in (pts0, pts1, pts2))
        if m1 <= FLOAT_FLOOR:
            continue
        at = max(pts1, key=lambda p: p[0])
        out.append((s, m1 / max(m2, FLOAT_FLOOR), m0 / m1, pts2[-1][3] - at[3]))
    return out


def _verdict(flags: List[bool]) -> str:
    if not flags:
        return "n/a"
    return "holds" if all(flags) else ("partly" if any(flags) else "does not hold")


def evaluate(results, oracle, cfg, prob) -> List[Claim]:
    by = _by_name(results)
    n_test = prob.Xte.shape[0]
    claims = []

    def outcomes(methods, wanted):
        """(whether each method that ran has the outcome ``wanted``, evidence lines)."""
        flags, ev = [], []
        for m in methods:
            r = by.get(m)
            if not _ran(r):
                continue
            c = classify(r, oracle, cfg.reach_tol)
            flags.append(c == wanted)
            ev.append(f"{m}: g = {r.rel_gap:.2e}, {c}, {_acc_note(r, oracle, n_test)}")
        return flags, ev

    # 1. stall
    flags, ev = outcomes(("sgd", "vsgd", "ivon"), "stalls")
    claims.append(Claim("SGD, VSGD and IVON stall below L-BFGS", _verdict(flags),
                        ev or ["not run"]))

    # 2. reach
    flags, ev = outcomes(("svrg", "vsgd-poco", "ivon-poco"), "reaches")
    extra = [f"{m}: g = {by[m].rel_gap:.2e}, {classify(by[m], oracle, cfg.reach_tol)}"
             for m in ("ivon-poco-pair", "von-poco") if _ran(by.get(m))]
    if extra:
        ev.append("(not in the claim) " + ", ".join(extra))
    claims.append(Claim("SVRG, VSGD-PoCo and IVON-PoCo reach L-BFGS", _verdict(flags),
                        ev or ["not run"]))

    # 3. jumps
    flags, ev = [], []
    for m in ("svrg", "vsgd-poco", "ivon-poco", "ivon-poco-pair", "von-poco"):
        r = by.get(m)
        if not _ran(r) or not r.refresh_steps:
            continue
        every = cfg.refresh_every
        if m == "von-poco":
            every = max(1, round(cfg.refresh_every * cfg.von_schedule))
        js = refresh_jumps(r, oracle, every)
        if not js:
            ev.append(f"{m}: no refresh measurable (g below 1e-12 or no later point)")
            continue
        hits = [fa >= JUMP_FACTOR and fa >= JUMP_FACTOR * fb for _, fa, fb, _ in js]
        if m in ("svrg", "vsgd-poco", "ivon-poco"):
            flags.append("all" if all(hits) else ("some" if any(hits) else "none"))
        first = js[0]
        status = "" if r.status == "ok" else f" before its {r.status}"
        later = (f"later median /{_median([j[1] for j in js[1:]]):.3g} vs "
                 f"/{_median([j[2] for j in js[1:]]):.3g}" if len(js) > 1 else "no later one")
        ev.append(f"{m}: jumps at {sum(hits)}/{len(hits)} refreshes{status} (first: g /{first[1]:.3g} "
                  f"after vs /{first[2]:.3g} before, acc {first[3]:+.4f}; {later})")
    verdict = ("n/a" if not flags else "holds" if all(f == "all" for f in flags)
               else "does not hold" if all(f == "none" for f in flags) else "partly")
    claims.append(Claim("a jump after each refresh (SVRG, VSGD-PoCo, IVON-PoCo)", verdict,
                        ev or ["not run"]))

    # 4. faster
    flags, ev = [], []
    for fast, slow, phase in FASTER_PAIRS:
        a, b = by.get(fast), by.get(slow)
        if not (_ran(a) and _ran(b)):
            continue
        verdict, text = compare_speed(a, b, oracle, phase)
        if verdict != "neither reaches":        # a tie or a mix is not faster
            flags.append(verdict == "faster")
        ev.append(f"{fast} vs {slow}, {text} -> {verdict}")
    claims.append(Claim("IVON-type methods faster than first-order ones", _verdict(flags),
                        ev or ["not run"]))
    return claims


def _fmt(x: Optional[float]) -> str:
    return "never" if x is None else f"{x:.1f}"


def _fmt_b(b: Optional[Tuple[float, float]]) -> str:
    """A first-reach bracket ``(lo, hi]``, as ``lo-hi``."""
    return "never" if b is None else (f"{b[1]:.2f}" if b[0] == b[1] else
                                      f"{b[0]:.2f}-{b[1]:.2f}")


def _median(xs: Sequence[float]) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = len(xs) // 2
    return xs[k] if len(xs) % 2 else 0.5 * (xs[k - 1] + xs[k])


def format_claims(claims: Sequence[Claim], markdown: bool = False) -> str:
    if markdown:
        rows = ["| claim | here | evidence |", "|---|---|---|"]
        rows += [f"| {c.claim} | **{c.verdict}** | {'<br>'.join(c.evidence)} |"
                 for c in claims]
        return "\n".join(rows)
    out = []
    for c in claims:
        out.append(f"[{c.verdict:>13s}] {c.claim}")
        out += [f"                {part}" for part in c.evidence]
    return "\n".join(out)
