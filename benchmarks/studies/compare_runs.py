"""Compare two sets of benchmark CSVs (the suite's schema, ``benchmarks/common/report.py``)
row by row: the median over each set's runs of every row's median, and their ratio, as a
markdown table; the rows of code neither side changed (torch, ivon-opt) are the noise
control.  For a before/after study: alternate the two sides' runs back to back, then

    python -m benchmarks.studies.compare_runs --base 'base_run*.csv' --new 'new_run*.csv'
"""
from __future__ import annotations

import argparse
import collections
import csv
import glob
import statistics
import sys
from typing import Dict, List, Tuple


def load(pattern: str) -> Dict[Tuple[str, ...], List[float]]:
    """Every row's medians over the files ``pattern`` matches, keyed by
    (kernel, provider, dtype, size); the copy rows (the ceiling) left out."""
    rows: Dict[Tuple[str, ...], List[float]] = collections.defaultdict(list)
    files = sorted(glob.glob(pattern))
    if not files:
        raise SystemExit(f"no file matches {pattern!r}")
    for f in files:
        with open(f) as fh:
            for r in csv.DictReader(fh):
                if r["kernel"] != "copy":
                    rows[(r["kernel"], r["provider"], r["dtype"], r["size"])].append(
                        float(r["median"]))
    return rows


def compare(base, new) -> str:
    lines = ["| kernel | provider | dtype | size | base ms | new ms | new / base |",
             "|---|---|---|---|---|---|---|"]
    ours, control = [], []
    for key in sorted(set(base) & set(new)):
        b, n = statistics.median(base[key]), statistics.median(new[key])
        (ours if key[1].startswith("poco_kernels") else control).append(n / b)
        lines.append(f"| {' | '.join(key)} | {b * 1e3:.3f} | {n * 1e3:.3f} | {n / b:.2f} |")
    for name, rs in (("poco_kernels rows", ours), ("control rows (unchanged code)", control)):
        if rs:
            lines.append(f"\n{name}: {len(rs)}, new / base median {statistics.median(rs):.3f},"
                         f" range {min(rs):.2f} to {max(rs):.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="glob of the base side's CSVs")
    ap.add_argument("--new", required=True, help="glob of the new side's CSVs")
    a = ap.parse_args(argv)
    print(compare(load(a.base), load(a.new)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
