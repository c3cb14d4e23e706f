"""What the benchmarks write: the rows and their CSV schema, and the JSON report.

CSV schema (one for every script): kernel, provider, dtype, size, median, p20, p80
(seconds), bytes_per_param, gbps (model bytes / median), pct_of_copy (that bandwidth as a
percentage of the copy bandwidth measured in the same run), timing, device, date.
"""
from __future__ import annotations

import csv
import json
import math
import os
import traceback

import torch

from device import release


def log(msg=""):
    print(msg, flush=True)


def dtype_name(dt):
    return str(dt).replace("torch.", "")


# --------------------------------------------------------------------------- rows
def copy_row(cb, timing):
    """The copy measurement as a row of the table (its own ceiling: 100%)."""
    return dict(kernel="copy", provider="torch.Tensor.copy_", dtype="float32",
                size=cb["bytes_each_way"] // 4, median=cb["median_s"], p20=cb["p20_s"],
                p80=cb["p80_s"], bytes_per_param=8, bandwidth_Bps=cb["bandwidth_Bps"],
                frac_copy=1.0, timing=timing)


def inplace_row(ib, timing):
    """The in-place update measurement as a row (fraction filled in by the caller)."""
    return dict(kernel="inplace_add", provider="torch.Tensor.add_", dtype="float32",
                size=ib["bytes_each_way"] // 4, median=ib["median_s"], p20=ib["p20_s"],
                p80=ib["p80_s"], bytes_per_param=12, bandwidth_Bps=ib["bandwidth_Bps"],
                frac_copy=None, timing=timing)


class Bench:
    """Collects the rows: each gets its byte model, achieved bandwidth and fraction of the
    copy bandwidth; a failing benchmark is recorded and the run goes on."""

    def __init__(self, dev, timer, copy_bw):
        self.dev, self.timer, self.copy_bw = dev, timer, copy_bw
        self.rows, self.errors = [], []

    def add(self, kernel, provider, dt, size, t, bpp, wall=False):
        med, p20, p80 = t
        nbytes = bpp * size if bpp is not None else None
        bw = nbytes / med if nbytes else None
        frac = bw / self.copy_bw if (bw and self.copy_bw) else None
        row = dict(kernel=kernel, provider=provider, dtype=dtype_name(dt), size=size,
                   median=med, p20=p20, p80=p80, bytes_per_param=bpp,
                   bandwidth_Bps=bw, frac_copy=frac,
                   timing="wall" if wall else ("events" if self.dev.type == "cuda"
                                               else "perf_counter"))
        self.rows.append(row)
        log(f"  {kernel:22s} {provider:34s} {dtype_name(dt):8s} {size:>10d} "
            f"median {med * 1e3:9.4f} ms [p20 {p20 * 1e3:.4f}, p80 {p80 * 1e3:.4f}]"
            + (f"  {bw / 1e9:7.1f} GB/s" if bw else "")
            + (f"  {100 * frac:5.1f}% copy" if frac else ""))
        return row

    def run(self, label, fn):
        try:
            fn()
        except Exception as exc:
            msg = f"{label}: {type(exc).__name__}: {exc}"
            self.errors.append(msg)
            log(f"  ERROR {msg}")
            traceback.print_exc()
        finally:
            release(self.dev)


# --------------------------------------------------------------------------- files
CSV_FIELDS = ["kernel", "provider", "dtype", "size", "median", "p20", "p80", "bytes_per_param",
              "gbps", "pct_of_copy", "timing", "device", "date"]


def write_csv(path, rows, device, date):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:
            bw, fr = r.get("bandwidth_Bps"), r.get("frac_copy")
            w.writerow(dict(kernel=r["kernel"], provider=r["provider"], dtype=r["dtype"],
                            size=r["size"], median=f"{r['median']:.6g}", p20=f"{r['p20']:.6g}",
                            p80=f"{r['p80']:.6g}", bytes_per_param=r.get("bytes_per_param") or "",
                            gbps="" if bw is None else f"{bw / 1e9:.2f}",
                            pct_of_copy="" if fr is None else f"{100 * fr:.1f}",
                            timing=r.get("timing", ""), device=device, date=date))


def json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, (torch.dtype, torch.device)):
        return str(o)
    return repr(o)


def dump(path, report):
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=json_default)

