"""The AOT report: every variant of :mod:`poco_kernels.kernels.aot` compiled for each target
in parallel, its registers, spills, stack, instruction mix and PTX audit, as rows or a table.

``python -m poco_kernels.kernels.aot`` runs :func:`main`."""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Dict, Iterable, List, Optional, Sequence

from .aot import (DEFAULT_CCS, _arch, _variant, audit_ptx, compile_variant, from_spec,
                  instruction_mix, interpreting, parse_ptxas_log, resource_report, sass,
                  variants)
from .compiled_code import layout_conversions

__all__ = ["report", "format_table", "json_subprocess", "main"]

def _compile_logged(variant, cc: int):
    """:func:`compile_variant` and the resource usage its own ``ptxas -v`` reported (Triton
    prints the log when ``knobs.nvidia.dump_ptxas_log`` is set); where the compilation came
    from Triton's cache (no log), a second ``ptxas -v`` of its PTX
    (:func:`resource_report`, the same flags: the same numbers)."""
    from triton import knobs
    out = io.StringIO()
    with knobs.nvidia.scope(), contextlib.redirect_stdout(out):
        knobs.nvidia.dump_ptxas_log = True
        compiled = compile_variant(variant, cc)
    try:
        return compiled, parse_ptxas_log(out.getvalue())
    except ValueError:
        res = resource_report(compiled.asm["ptx"], cc)
        res.pop("log")
        return compiled, res


def _row(name: str, cc: int, spec: Optional[Dict[str, Any]] = None,
         mix: bool = True) -> Dict[str, Any]:
    """Compile one variant (of :func:`variants` by name, or given as ``spec``) for one
    target and measure it (one pool task); ``mix``: and its SASS instruction mix (a
    disassembly, about half a second)."""
    row: Dict[str, Any] = {"variant": name, "cc": cc, "arch": None, "registers": None,
                           "spill_stores": None, "spill_loads": None, "stack": None,
                           "mix": None, "forbidden": None, "layout_conversions": None,
                           "seconds": None, "error": None}
    t0 = time.perf_counter()
    try:
        row["arch"] = _arch(cc)
        compiled, res = _compile_logged(from_spec(spec) if spec else _variant(name), cc)
        row.update(res)
        row["forbidden"] = audit_ptx(compiled.asm["ptx"])
        row["layout_conversions"] = layout_conversions(compiled.asm["ttgir"])
        if mix:
            text = sass(compiled.asm["cubin"])
            row["mix"] = instruction_mix(text)
            row["fast_mix"] = instruction_mix(text, fast_path=True)
    except Exception as exc:  # reported per row: one broken variant does not hide the rest
        row["error"] = f"{type(exc).__name__}: {exc}"
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


def _report_here(ccs: Sequence[int], workers: Optional[int],
                 specs: Optional[List[Dict[str, Any]]] = None,
                 mix: bool = True) -> List[Dict[str, Any]]:
    if specs is None:
        tasks = [(v.name, cc, None, mix) for cc in ccs for v in variants()]
    else:
        tasks = [(sp["name"], cc, sp, mix) for cc in ccs for sp in specs]
    workers = workers or min(len(tasks), os.cpu_count() or 1)
    if workers <= 1:
        return [_row(*t) for t in tasks]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(_row, *t) for t in tasks]
        return [f.result() for f in futures]


def json_subprocess(module: str, args: Sequence[str],
                    timeout: Optional[float] = None) -> Any:
    """Run ``python -m module --json *args`` in a process without ``TRITON_INTERPRET``
    (from the repository root, the package on its path) and return the JSON of its last
    output line: how an interpreting process compiles for real targets."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    cmd = [sys.executable, "-m", module, "--json", *args]
    p = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return json.loads(lines[-1])


def _report_subprocess(ccs: Sequence[int], workers: Optional[int],
                       timeout: Optional[float],
                       specs: Optional[List[Dict[str, Any]]] = None,
                       mix: bool = True) -> List[Dict[str, Any]]:
    args = [a for cc in ccs for a in ("--cc", str(cc))]
    if workers:
        args += ["--workers", str(workers)]
    if not mix:
        args.append("--no-mix")
    with tempfile.TemporaryDirectory(prefix="poco_aot_specs_") as d:
        if specs is not None:
            path = os.path.join(d, "specs.json")
            with open(path, "w") as f:
                json.dump(specs, f)
            args += ["--specs", path]
        return json_subprocess("poco_kernels.kernels.aot", args, timeout)


def report(ccs: Iterable[int] = DEFAULT_CCS, workers: Optional[int] = None,
           timeout: Optional[float] = None,
           specs: Optional[List[Dict[str, Any]]] = None,
           mix: bool = True) -> List[Dict[str, Any]]:
    """One row per (variant, cc): ``variant, cc, arch, registers, spill_stores, spill_loads,
    stack, mix`` (SASS instructions by class, :func:`poco_kernels.kernels.budget.
    instruction_mix`; None with ``mix=False``), ``seconds, error`` (``error`` is None when
    it compiled).  Compiles in parallel processes; in a subprocess without
    ``TRITON_INTERPRET`` when this one interprets.  ``specs``: compile these variants
    (:func:`to_spec` data) instead of :func:`variants`."""
    ccs = tuple(int(c) for c in ccs)
    if interpreting():
        return _report_subprocess(ccs, workers, timeout, specs, mix)
    return _report_here(ccs, workers, specs, mix)


def format_table(rows: Sequence[Dict[str, Any]]) -> str:
    """The rows as a text table."""
    head = ("variant", "arch", "regs", "spill st", "spill ld", "stack", "s")
    body = []
    for r in rows:
        if r.get("error"):
            body.append((r["variant"], r.get("arch") or f"cc{r['cc']}", "ERROR", "", "", "",
                         str(r.get("seconds", ""))))
        else:
            body.append((r["variant"], r["arch"], str(r["registers"]), str(r["spill_stores"]),
                         str(r["spill_loads"]), str(r["stack"]), str(r["seconds"])))
    w = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    fmt = lambda x: "  ".join(c.ljust(w[0]) if i == 0 else c.rjust(w[i])  # noqa: E731
                              for i, c in enumerate(x))
    lines = [fmt(head), fmt(tuple("-" * n for n in w))] + [fmt(x) for x in body]
    lines += [f"{r['variant']} [{r.get('arch') or r['cc']}]: {r['error']}"
              for r in rows if r.get("error")]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m poco_kernels.kernels.aot",
                                 description=_aot_doc())
    ap.add_argument("--cc", type=int, action="append",
                    help="compute capability (repeatable; default 80 and 90)")
    ap.add_argument("--workers", type=int, default=None, help="parallel compile processes")
    ap.add_argument("--specs", default=None,
                    help="a JSON file of variants (to_spec data) to compile instead")
    ap.add_argument("--no-mix", action="store_true",
                    help="leave out the SASS instruction mix (no disassembly)")
    ap.add_argument("--json", action="store_true", help="print the rows as one JSON line")
    args = ap.parse_args(argv)
    ccs = tuple(args.cc or DEFAULT_CCS)
    t0 = time.perf_counter()
    specs = None
    if args.specs:
        with open(args.specs) as f:
            specs = json.load(f)
    rows = report(ccs, args.workers, specs=specs, mix=not args.no_mix)
    if args.json:
        print(json.dumps(rows))
    else:
        print(format_table(rows))
        print(f"{len(rows)} compilations in {time.perf_counter() - t0:.1f} s")
    bad = any(r["error"] or r["spill_stores"] or r["spill_loads"] or r["forbidden"]
              for r in rows)
    return 1 if bad and not args.json else 0


def _aot_doc() -> str:
    from . import aot
    return aot.__doc__.split("\n\n")[0]


if __name__ == "__main__":
    sys.exit(main())
