"""The GPU compute budget of the Triton kernels, measured offline (no GPU needed).

Every variant of :func:`poco_kernels.kernels.aot.variants` (and, for the kernels that draw
noise, its twin under noise stream version 1) is compiled ahead of time for sm_80 and
sm_90a; the cubin is disassembled by the ``nvdisasm`` Triton bundles, and the SASS
instructions are counted by class (:func:`instruction_mix`).  Each kernel is
straight-line code over ``BLOCK / (32 * num_warps)`` elements per thread, so the static
count divided by that is the instructions per element.

The model (:func:`budget`), for an A100 80GB SXM (108 SMs at 1.41 GHz boost, 2.0 TB/s
HBM2e): per SM and clock, 4 warp schedulers issue at most 128 thread-instructions; the
32-bit float (FADD/FMUL/FFMA, compares, min/max) and the integer multiply-add (IMAD*,
which the compiler also uses for moves and adds) share 64 lanes; other integer and logic
operations (IADD3, LOP3, SHF, ISETP, SEL, ...) have 64 lanes; the special-function unit
(MUFU: log2, exp2, sin, cos, rsqrt, rcp) and conversions (I2F, F2I, F2F, FRND) have 16
(NVIDIA, CUDA C++ Programming Guide, "Arithmetic Instructions" throughput table, compute
capability 8.0).  The instruction time per element is the largest of the issue time and
each unit's time; the memory time per element is the kernel's bytes per element (the
byte model of :data:`BYTES`, the same terms as ``benchmarks/common/byte_models.py``) over
2.0 TB/s.  A ratio below 1 means the kernel can run at memory speed; the goal is 0.5
(a 2x margin for latency, address arithmetic the model does not see, and clocks below
boost).

    python -m poco_kernels.kernels.budget [--cc 80] [--markdown]

Under ``TRITON_INTERPRET=1`` the compilation runs in a subprocess without it (as in
:mod:`~poco_kernels.kernels.aot`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Dict, List, Optional, Sequence

from . import aot, aot_report
from .aot import instruction_mix, sass  # noqa: F401  (re-exported)

__all__ = ["BYTES", "A100", "budget_variants", "sass", "instruction_mix", "budget", "rows",
           "markdown", "main"]

#: the machine of the model: A100 80GB SXM
A100 = dict(sms=108, clock_hz=1.41e9, hbm_Bps=2.0e12, issue=128, fma=64, alu=64, sfu=16,
            conv=16)

S = 4   # float32 state
#: bytes per element each variant moves (reads + writes), by its name's kernel and path:
#: the terms of benchmarks/common/byte_models.py for the rows it has
BYTES = {
    "sample[ivon,sync,fp32]": 4 + S + S + 4,          # params (the mean), mean, h, sample
    "sample[buffer,bf16]": 2 + 2 + 2,                 # m_out, sigma_out (bf16 state), sample
    "accumulate[ge,bf16]": 2 + 2 * S + 2 * S,         # grad, acc_g and acc_ge read + write
    "accumulate[ge,fp32]": 4 + 2 * S + 2 * S,
    "check[fp32]": 4,
    "fold_ge": 2 * S,                                 # acc_g read, acc_ge written
    "step[ivon,full,fp32]": 4 * S + 5 * S + S + 2 * S + 4,
    "step[ivon,full,bf16]": 4 * S + 5 * S + S + 2 * S + 2,
    "step[ivon,full,next,fp32]": 4 * S + 5 * S + S + 2 * S + 4,
    "step[ivon,full,next,lowstate,fp32]": 4 * S + 5 * 2 + 2 + 2 * S + 4,
    "step[ivon,full,next,lowouter,fp32]": 4 * S + 3 * S + 2 * 2 + S + 2 * S + 4,
    "step[ivon,full,fp32,unpadded]": 4 * S + 5 * S + S + 2 * S + 4,
    "step[ivon,nocorr,bf16]": 3 * S + S + S + 2 * S + 2,
    "step[ivon,ge_in+ge_at_out,fp32]": 6 * S + 5 * S + S + 2 * S + 4,
    "step[sgd,mom+nesterov+corr,bf16]": S + 3 * S + 2 * S + 2,   # mean, g_in, g_at_out, g_out, buf
    "step[adamw,corr,fp32]": 3 * S + 2 * S + 3 * S + 4,          # mean, g_in, g_at_out, g_out, m, v
    "refresh[ivon]": 5 * S + 4 * S,                   # mean, h, acc_g, g_out, h_out; 4 outputs
    "refresh[ivon,lowstate]": 3 * S + 2 * 2 + 4 * 2,
    "refresh[sgd,noisy]": 2 * S + 2 * S,              # mean, acc_g; g_out, theta_out
    "finish": 0,
}

def budget_variants() -> List[aot.Variant]:
    """The AOT variants and, for each that draws noise under version 2, its version-1 twin
    (``",noise1"`` appended), for the before/after of noise stream version 2."""
    out = []
    for v in aot.variants():
        out.append(v)
        if v.constexprs.get("NOISE") == 2:
            name = _twin(v.name)
            if name not in {x.name for x in aot.variants()}:
                out.append(v._replace(name=name, constexprs=dict(v.constexprs, NOISE=1)))
    return out


def _twin(name: str) -> str:
    """The name of a variant's noise-version-1 twin: ``k[a,b]`` -> ``k[a,b,noise1]``."""
    return name[:-1] + ",noise1]" if name.endswith("]") else name + "[noise1]"


def _base(name: str) -> str:
    return name.replace(",noise1]", "]").replace("[noise1]", "")


def budget(mix: Dict[str, int], per_thread: int, bytes_per_element: float,
           machine: Dict[str, float] = A100) -> Dict[str, float]:
    """Instruction and memory time per element (ns) of a kernel whose threads each run the
    ``mix`` over ``per_thread`` elements, and their ratio."""
    per = {k: v / per_thread for k, v in mix.items()}
    clocks = max(per["total"] / machine["issue"], (per["fp32"] + per["imad"]) / machine["fma"],
                 per["alu"] / machine["alu"], per["mufu"] / machine["sfu"],
                 per["conv"] / machine["conv"])       # SM clocks per element
    t_instr = clocks / (machine["sms"] * machine["clock_hz"])
    t_mem = bytes_per_element / machine["hbm_Bps"]
    return {"instr_per_element": round(per["total"], 1),
            "instr_ns": t_instr * 1e9, "mem_ns": t_mem * 1e9,
            "ratio": (t_instr / t_mem) if t_mem else float("inf")}


def _row(name: str, cc: int) -> Dict[str, Any]:
    v = next(x for x in budget_variants() if x.name == name)
    row: Dict[str, Any] = {"variant": name, "cc": cc, "error": None}
    try:
        compiled = aot.compile_variant(v, cc)
        mix = instruction_mix(sass(compiled.asm["cubin"]), fast_path=True)
        per_thread = v.constexprs.get("BLOCK", 1) // (32 * v.num_warps) or 1
        base = _base(name)
        row.update(mix=mix, per_thread=per_thread, bytes=BYTES.get(base),
                   **(budget(mix, per_thread, BYTES[base]) if BYTES.get(base) else {}))
    except Exception as exc:      # reported per row
        row["error"] = f"{type(exc).__name__}: {exc}"
    return row


def rows(ccs: Sequence[int] = (80,), workers: Optional[int] = None,
         timeout: Optional[float] = None) -> List[Dict[str, Any]]:
    """One row per (budget variant, cc); in a subprocess when this process interprets."""
    ccs = tuple(int(c) for c in ccs)
    if aot.interpreting():
        return aot_report.json_subprocess("poco_kernels.kernels.budget",
                                   [a for cc in ccs for a in ("--cc", str(cc))], timeout)
    tasks = [(v.name, cc) for cc in ccs for v in budget_variants()]
    workers = workers or min(len(tasks), os.cpu_count() or 1)
    with ProcessPoolExecutor(max_workers=workers) as pool:
        out = [f.result() for f in [pool.submit(_row, n, cc) for n, cc in tasks]]
    # a twin whose code is its variant's draws no noise on that path: left out
    mixes = {(r["variant"], r["cc"]): r.get("mix") for r in out}
    return [r for r in out if _base(r["variant"]) == r["variant"]
            or r.get("mix") != mixes.get((_base(r["variant"]), r["cc"]))]


def markdown(rs: Sequence[Dict[str, Any]]) -> str:
    """The rows as a markdown table (instructions per element by class; global load
    instructions per thread, those 16 bytes wide and those before the first Philox
    multiply; times in ns per element on the A100 model, their ratio)."""
    out = ["| variant | arch | instr/elem | IMAD | fp32 | other int | MUFU | conv | mem "
           "| LDG (16 B, before Philox) | B/elem | instr ns | mem ns | instr / mem |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rs:
        if r.get("error"):
            out.append(f"| {r['variant']} | sm_{r['cc']} | error: {r['error'][:80]} |")
            continue
        m, k = r["mix"], r["per_thread"]
        f = lambda c: f"{m[c] / k:.1f}"  # noqa: E731
        if r.get("bytes"):
            tail = f"| {r['bytes']} | {r['instr_ns']:.4f} | {r['mem_ns']:.4f} | {r['ratio']:.2f} |"
        else:
            tail = "| - | - | - | - |"
        out.append(f"| {r['variant']} | sm_{r['cc']} | {m['total'] / k:.1f} | {f('imad')} | "
                   f"{f('fp32')} | {f('alu')} | {f('mufu')} | {f('conv')} | {f('mem')} "
                   f"| {m['ldg']} ({m['ldg_vec']}, {m['ldg_before_philox']}) " + tail)
    return "\n".join(out) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m poco_kernels.kernels.budget",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--cc", type=int, action="append", help="compute capability (default 80)")
    ap.add_argument("--json", action="store_true", help="print the rows as one JSON line")
    args = ap.parse_args(argv)
    rs = rows(tuple(args.cc or (80,)))
    if args.json:
        print(json.dumps(rs))
    else:
        print(markdown(rs))
    return 0 if not any(r.get("error") for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
