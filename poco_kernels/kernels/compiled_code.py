"""What a compiled kernel contains: its SASS (by ``nvdisasm``), counted by instruction class
on its fast path, its PTX audited for instructions the kernels must not use, and the
layout conversions of its Triton GPU IR.

:mod:`poco_kernels.kernels.aot` compiles the kernels for real targets and reports each
variant with these; :mod:`poco_kernels.kernels.budget` turns the counts into time per
element; ``benchmarks/gpu/openloop.py`` audits the PTX of the kernels a GPU compiled.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from typing import Dict, List

__all__ = ["sass", "instruction_mix", "FORBIDDEN_PTX", "audit_ptx", "layout_conversions"]


_CLASS = [
    ("mufu", re.compile(r"^MUFU")),
    ("conv", re.compile(r"^(I2F|F2I|F2F|FRND|I2I)")),
    ("imad", re.compile(r"^(IMAD|IMUL)")),
    ("fp32", re.compile(r"^(FADD|FMUL|FFMA|FMNMX|FSETP|FSEL|FCHK|FSET)")),
    ("mem", re.compile(r"^(LDG|STG|LDS|STS|LD|ST|ATOM|ATOMG|RED|LDC|ULDC)")),
    ("control", re.compile(r"^(BRA|EXIT|BAR|NOP|BSSY|BSYNC|WARPSYNC|RET|CALL|S2R|S2UR|"
                           r"CS2R|VOTE|YIELD|BPT|MEMBAR|ERRBAR|CCTL|DEPBAR)")),
]
#: Philox4x32's round multipliers 0xD2511F53 and 0xCD9E8D57 as SASS immediates
_PHILOX_CONST = re.compile(r"-0x2daee0ad|-0x326172a9|0xd2511f53|0xcd9e8d57", re.I)
_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_.]*)")


def sass(cubin: bytes) -> str:
    """The SASS of a cubin, by the ``nvdisasm`` bundled with Triton."""
    from triton.backends.nvidia.compiler import get_ptxas
    tool = os.path.join(os.path.dirname(get_ptxas(80).path), "nvdisasm")
    with tempfile.TemporaryDirectory(prefix="poco_budget_") as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        p = subprocess.run([tool, "-c", path], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"nvdisasm failed ({p.returncode}): {p.stderr}")
    return p.stdout


_LABEL = re.compile(r"^\s*(\.L\w+|\$[\w$.]+):")


def _fast_path(sass_text: str) -> List[str]:
    """The instruction lines of the kernel's own function that its fast path runs: the
    subroutines after it (the out-of-line slow paths of ``div.rn``/``sqrt.rn``, called
    for zero, infinite, subnormal or huge operands) and the blocks that call them are
    left out.  A block ends at a label and after a branch; each correctly rounded division
    or square root has one such block, skipped by a predicated branch."""
    blocks: List[List[str]] = [[]]
    for line in sass_text.splitlines():
        if _LABEL.match(line):
            if line.strip().startswith("$"):          # a subroutine: the kernel is over
                break
            blocks.append([])
            continue
        m = _INSTR.search(line)
        if not m:
            continue
        blocks[-1].append(line)
        if m.group(1).startswith(("BRA", "EXIT", "RET")):
            blocks.append([])
    return [ln for b in blocks if not any("CALL" in _INSTR.search(x).group(1) for x in b)
            for ln in b]


def instruction_mix(sass_text: str, fast_path: bool = False) -> Dict[str, int]:
    """SASS instructions by class: ``mufu``, ``conv``, ``imad``, ``fp32``, ``mem``,
    ``control``, ``alu`` (the other integer and logic operations), and ``total``; and
    ``mulhi``, the 32 x 32 -> 64-bit multiplies among the ``imad`` (``IMAD.HI``,
    ``IMAD.WIDE``: Philox's and 64-bit addresses').  Global memory: ``ldg``, ``stg`` (the
    load and store instructions), ``ldg_vec``, ``stg_vec`` (those 16 bytes wide), and
    ``ldg_before_philox``, the loads issued before the first multiply by a Philox
    round constant (all loads, when no noise is drawn).  ``fast_path``: only the
    instructions a thread runs on the kernel's fast path (:func:`_fast_path`: without the
    rare slow paths of the correctly rounded divisions and square roots), which is what
    runs for the finite, normal operands of an optimizer step; else every instruction of
    the cubin (the static count)."""
    mix = {k: 0 for k in ("mufu", "conv", "imad", "fp32", "mem", "control", "alu", "total",
                          "mulhi", "ldg", "ldg_vec", "stg", "stg_vec", "ldg_before_philox")}
    philox = False
    lines = _fast_path(sass_text) if fast_path else sass_text.splitlines()
    for line in lines:
        m = _INSTR.search(line)
        if not m:
            continue
        op = m.group(1)
        cls = next((c for c, rx in _CLASS if rx.match(op)), "alu")
        mix[cls] += 1
        mix["total"] += 1
        if op.startswith(("IMAD.HI", "IMAD.WIDE")):
            mix["mulhi"] += 1
            philox = philox or bool(_PHILOX_CONST.search(line))
        for kind in ("ldg", "stg"):
            if op.startswith(kind.upper()):
                mix[kind] += 1
                mix[kind + "_vec"] += op.endswith(".128")
                if kind == "ldg" and not philox:
                    mix["ldg_before_philox"] += 1
    return mix


#: PTX instructions the kernels must not contain: approximate transcendentals, division,
#: reciprocal and square root, flush-to-zero float arithmetic, and fused multiply-adds
#: of floats (``enable_fp_fusion=False`` and ``tl.div_rn``/``tl.sqrt_rn`` keep them out;
#: ptxas still uses FFMA inside the correctly rounded ``div.rn``/``sqrt.rn`` sequences,
#: whose results are exact roundings)
FORBIDDEN_PTX = re.compile(
    r"^\s*(?:@%?!?\w+\s+)?("
    r"(?:sqrt|div|rcp|rsqrt|ex2|lg2|sin|cos|tanh)\.approx[\w.]*"
    r"|div\.full[\w.]*"
    r"|(?:fma|mad)(?:\.r[nzmp])?(?:\.ftz)?(?:\.sat)?\.f(?:16|32|64)[\w.]*"
    r"|\w+\.ftz[\w.]*"
    r")\b", re.M)


def audit_ptx(ptx: str) -> Dict[str, int]:
    """The forbidden instructions (:data:`FORBIDDEN_PTX`) in ``ptx``, with their counts
    (empty: the kernel computes only correctly rounded, unfused IEEE operations)."""
    out: Dict[str, int] = {}
    for m in FORBIDDEN_PTX.finditer(ptx):
        out[m.group(1)] = out.get(m.group(1), 0) + 1
    return out


def layout_conversions(ttgir: str) -> int:
    """The ``ttg.convert_layout`` operations of a kernel's Triton GPU IR.  The kernels are
    elementwise over one block: every value can live in the layout of the loads, and a
    conversion is a round trip through shared memory with a barrier (what a 16-bit buffer
    beside float32 ones cost, each taking its own vector width, until the block's indices
    told the compiler to give every buffer four elements a thread)."""
    return len(re.findall(r"\bttg\.convert_layout\b", ttgir))
