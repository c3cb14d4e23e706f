"""What the benchmarks write: the rows and their CSV schema, the JSON report, and the
markdown tables of ``bench.md``.

CSV schema (one for every script): kernel, provider, dtype, size, median, p20, p80
(seconds), bytes_per_param, gbps (model bytes / median), pct_of_copy (that bandwidth as a
percentage of the copy bandwidth measured in the same run), timing, device, date.
"""
from __future__ import annotations

import csv
import json
import math
import os
import statistics
import traceback

import torch

from benchmarks.common.device import REPO, release

#: the recorded results: ``results/<topic>/<device>_<date>...`` (``benchmarks/README.md``)
RESULTS = os.path.join(REPO, "benchmarks", "results")


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


def train_csv_rows(train_rows):
    """The training-step section's rows in the CSV schema (iteration and outside forward /
    backward per optimizer; no byte model)."""
    out = []
    for r in train_rows:
        if "error" in r or r["optimizer"].startswith("("):
            continue
        name = r["optimizer"].lower().replace("-", "_")
        out.append(dict(kernel=f"gpt_{name}_iteration", provider=r["provider"], dtype="float32",
                        size=r["numel"], median=r["iter_s"], p20=r["iter_p20_s"],
                        p80=r["iter_p80_s"], bytes_per_param=None, bandwidth_Bps=None,
                        frac_copy=None, timing="perf_counter+sync"))
        out.append(dict(kernel=f"gpt_{name}_outside_fwd_bwd", provider=r["provider"],
                        dtype="float32", size=r["numel"], median=r["outside_s"],
                        p20=r["outside_p20_s"], p80=r["outside_p80_s"], bytes_per_param=None,
                        bandwidth_Bps=None, frac_copy=None, timing="perf_counter+sync"))
    return out


def pretrain_csv_rows(rows):
    """The pretraining section's rows in the CSV schema (step time; no byte model)."""
    return [dict(kernel=f"pretrain_{r['optimizer'].replace('-', '_')}_step",
                 provider=r["provider"], dtype=r["dtype"], size=r["numel"], median=r["step_s"],
                 p20=r["step_p20_s"], p80=r["step_p80_s"], bytes_per_param=None,
                 bandwidth_Bps=None, frac_copy=None, timing="perf_counter+sync")
            for r in rows if "error" not in r]


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


def write_study(out_dir, stem, text, report):
    """A study's outputs: ``text`` logged and written to ``<stem>.md``, ``report`` to
    ``<stem>.json``, in ``out_dir`` (made if missing)."""
    os.makedirs(out_dir, exist_ok=True)
    log(text)
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(text + "\n")
    dump(os.path.join(out_dir, f"{stem}.json"), report)


# --------------------------------------------------------------------------- tables
PLAIN_SIZES = {2 ** k: f"2^{k}" for k in range(10, 40)}


def _size_label(n):
    return PLAIN_SIZES.get(n, str(n))


def micro_tables(rows, ceiling):
    """Per dtype: one line per (kernel, provider), one column per size: median ms and
    % of the copy bandwidth."""
    out = []
    bench = [r for r in rows if r["kernel"] not in ("copy", "inplace_add")
             and not r["kernel"].startswith("gpt_")]
    for dt in dict.fromkeys(r["dtype"] for r in bench):
        sel = [r for r in bench if r["dtype"] == dt]
        sizes = sorted({r["size"] for r in sel})
        keys = list(dict.fromkeys((r["kernel"], r["provider"]) for r in sel))
        out += [f"### {dt} parameters: median ms (% of copy bandwidth)", "",
                "| kernel | provider | B/param | " + " | ".join(_size_label(s) for s in sizes)
                + " |", "|---|---|---|" + "---|" * len(sizes)]
        for k, prov in keys:
            cells, bpp = [], ""
            for s in sizes:
                r = next((r for r in sel if (r["kernel"], r["provider"], r["size"])
                          == (k, prov, s)), None)
                if r is None:
                    cells.append("")
                    continue
                bpp = r["bytes_per_param"] or ""
                pct = f" ({100 * r['frac_copy']:.0f}%)" if r.get("frac_copy") else ""
                cells.append(f"{r['median'] * 1e3:.3g}{pct}")
            out.append(f"| `{k}` | {prov.replace('poco_kernels.', 'pk.')} | {bpp} | "
                       + " | ".join(cells) + " |")
        out.append("")
    return out


def memory_table(rows):
    out = ["| optimizer | provider | dtype | state B/param (in `opt.state` + elsewhere) | "
           "allocations / step (bytes) | allocations / refresh (bytes) |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['optimizer']} | {r['provider']} | {r['dtype']} | error: "
                       f"{r['error'][:80]} | | |")
            continue

        def al(a, b):
            return "n/a" if a is None else f"{a:g} ({b:,.0f})"
        per_refresh = (al(r["allocs_per_refresh"], r["alloc_bytes_per_refresh"])
                       if "allocs_per_refresh" in r else "")
        cuda = (f"; allocator {r['allocator_bytes_per_param']:g}, peak +"
                f"{r['peak_extra_bytes_per_param']:g}" if "allocator_bytes_per_param" in r
                else "")
        out.append(f"| {r['optimizer']} | {r['provider'].replace('poco_kernels.', 'pk.')} | "
                   f"{r['dtype']} | {r['state_bytes_per_param']:g} "
                   f"({r['opt_state_bytes_per_param']:g} + {r['other_bytes_per_param']:g}{cuda})"
                   f" | {al(r['allocs_per_step'], r['alloc_bytes_per_step'])} | {per_refresh} |")
    return out


def train_table(rows):
    out = ["| optimizer | provider | gradient evaluations / iteration | iteration ms | "
           "forward + backward ms | outside ms | share outside |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['optimizer']} | | error: {r['error'][:80]} | | | | |")
            continue
        out.append(f"| {r['optimizer']} | {r['provider'].replace('poco_kernels.', 'pk.')} | "
                   f"{r['evals_per_iter']:g} | {r['iter_s'] * 1e3:.2f} | "
                   f"{r['fwd_bwd_s'] * 1e3:.2f} | {r['outside_s'] * 1e3:.2f} | "
                   f"{100 * r['outside_share']:.1f}% |")
    return out


def headline(rows, dev):
    """The comparison a user asks for first, at the largest float32 size."""
    def find(kernel, provider):
        c = [r for r in rows if r["kernel"] == kernel and r["provider"] == provider
             and r["dtype"] == "float32"]
        return max(c, key=lambda r: r["size"]) if c else None
    ours = "poco_kernels.triton" if dev.type == "cuda" else "poco_kernels.cpp"
    step = find("ivon_poco_step", ours)
    if step is None:
        return []
    n = step["size"]
    lines = [f"At {_size_label(n)} float32 parameters, IVON-PoCoMo's inner step "
             f"({ours.replace('poco_kernels.', 'pk.')}) takes {step['median'] * 1e3:.3g} ms, "
             f"{step['bytes_per_param']} B/param: "
             + (f"{100 * step['frac_copy']:.0f}% of the copy bandwidth" if step.get("frac_copy")
                else "no copy bandwidth measured") + "."]
    for kernel, prov, what in (("adamw_step", "torch.AdamW(fused)", "fused AdamW's step"),
                               ("adamw_step", "torch.AdamW(foreach)", "foreach AdamW's step"),
                               ("ivon_step", "ivon-opt-0.1.3", "ivon-opt's IVON step"),
                               ("ivon_cycle", "ivon-opt-0.1.3", "ivon-opt's IVON cycle"),
                               ("ivon_poco_step", "poco_kernels.torch",
                                "the torch backend's inner step")):
        r = next((r for r in rows if r["kernel"] == kernel and r["provider"] == prov
                  and r["dtype"] == "float32" and r["size"] == n), None)
        if r is not None:
            lines.append(f"- {what}: {r['median'] * 1e3:.3g} ms "
                         f"({r['median'] / step['median']:.2f}x the inner step's time)")
    return lines


def markdown(info, ceiling, inplace_bw, rows, mem_rows, train_rows, notes, pre_rows=(),
             table=None):
    out = [f"# poco_kernels benchmarks: {info['device']}", "",
           f"{info['date']}; torch {info['torch']}; triton {info.get('triton')}; "
           f"{info['threads']} threads; git {str(info.get('git_head'))[:10]}."]
    if "caches" in info:
        out.append(f"Caches: {info['caches']}.")
    out.append("")
    if ceiling:
        out.append(f"Copy bandwidth (the ceiling): {ceiling / 1e9:.1f} GB/s"
                   + (f"; in-place add {inplace_bw / 1e9:.1f} GB/s" if inplace_bw else "")
                   + ".")
        out.append("")
    out += headline(rows, torch.device("cuda" if "gpu_" in info["slug"] else "cpu"))
    if rows:
        out += ["", "## Optimizer-step microbenchmarks", ""] + micro_tables(rows, ceiling)
    if table:
        out += ["## The optimizer table", "",
                f"One training iteration per optimizer at GPT-2 124M's shapes (`{table['scale']}`"
                f": {table['n_params'] / 1e6:.2f}M parameters), float32 parameters; the closure "
                f"(zero_grad, backward of sum(p * c)) takes {table['closure_ms']:.3f} ms and is "
                "subtracted; host us: the same at 41k parameters "
                "(`benchmarks/common/optimizer_table.py`).", ""] + optimizer_table_md(table) + [""]
    if mem_rows:
        out += ["## Memory", ""] + memory_table(mem_rows) + [""]
    if train_rows:
        r0 = train_rows[0]
        out += ["## Training step on a small GPT", "",
                f"Preset `{r0['preset']}`, {r0['numel'] / 1e6:.2f}M parameters; medians "
                "per iteration.", ""] + train_table(train_rows) + [""]
    good = [r for r in pre_rows if "error" not in r]
    if pre_rows:
        r0 = good[0] if good else {}
        out += ["## Pretraining throughput", "",
                (f"`poco_kernels.experiments.pretrain`, preset `{r0['preset']}` "
                 f"({r0['numel'] / 1e6:.2f}M parameters), {r0['batch']} x {r0['seq']} tokens "
                 f"per step, {r0['dtype']}, {r0['steps']} steps, IVON-PoCoMo corrected from "
                 f"step {r0['poco_start']}. Over the steps after the first tenth (IVON-PoCoMo: its "
                 "corrected steps, refreshes included); tokens/s: mini-batch tokens per "
                 "second of wall time."
                 if r0 else ""), ""] + pretrain_table(pre_rows) + [""]
    if notes:
        out += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return out


def optimizer_table_md(table):
    out = ["| optimizer | protocol | ms per iteration | x fused AdamW | host us | "
           "model B/param | B/param at copy bw | share of copy | resident B/param |",
           "|---|---|---|---|---|---|---|---|---|"]
    for kind, r in table["rows"].items():
        if "optimizer_ms" not in r:
            out.append(f"| {kind} | | {r.get('error') or r.get('skipped')} | | | | | | |")
            continue
        out.append(f"| {kind} | {r.get('protocol', '')} | {r['optimizer_ms']:.3f} | "
                   f"{r['ratio_to_fused_adamw']} | {r['host_us']} | {r['model_B_per_param']} | "
                   f"{r['B_per_param_at_copy_bw']} | {r['share_of_copy']} | "
                   f"{r['resident_B_per_param']} |")
    return out


def pretrain_table(rows):
    out = ["| optimizer | provider | tokens/s | all tokens/s | step ms (p20-p80) | "
           "outside fwd/bwd | val loss start -> end |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['optimizer']} | | error: {r['error'][:80]} | | | | |")
            continue
        out.append(f"| {r['optimizer']} | {r['provider']} | {r['tok_s']:,.0f} | "
                   f"{r['all_tok_s']:,.0f} | {r['step_s'] * 1e3:.1f} "
                   f"({r['step_p20_s'] * 1e3:.1f}-{r['step_p80_s'] * 1e3:.1f}) | "
                   f"{100 * r['outside_share']:.1f}% | {r['val_first']:.3f} -> "
                   f"{r['val_last']:.3f} |")
    return out


def cpp_targets(rows, size, inplace):
    """The C++ backend's performance targets at ``size``, float32: its IVON-PoCoMo step at
    70% of the copy bandwidth or more, 4x the torch backend's step and ivon-opt's cycle
    (reported, not gating)."""
    def get(kernel, provider):
        return next((r for r in rows if (r["kernel"], r["provider"], r["dtype"], r["size"])
                     == (kernel, provider, "float32", size)), None)
    k = get("step_kernel_poco", "poco_kernels.cpp(direct)")
    if k is None:
        return []
    out = [f"C++ target, IVON-PoCoMo step at >= 70% of copy bandwidth: "
           f"{100 * k['frac_copy']:.0f}% ({_size_label(size)}, float32)"]
    for kernel, prov, what in (("ivon_poco_step", "poco_kernels.torch", "the torch backend's step"),
                               ("ivon_cycle", "ivon-opt-0.1.3", "ivon-opt's IVON cycle")):
        r = get(kernel, prov)
        if r is not None:
            out.append(f"C++ target, >= 4x faster than {what}: "
                       f"{r['median'] / k['median']:.1f}x")
    if inplace:
        bw = statistics.median(x["bandwidth_Bps"] for x in inplace)
        out.append(f"the same step at {k['bandwidth_Bps'] / bw:.0%} of the in-place add "
                   f"bandwidth ({bw / 1e9:.1f} GB/s)")
    return out
