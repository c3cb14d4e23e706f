"""Open-loop parity of the compiled kernels on the device (``bench_gpu.py``'s first
section), from :mod:`poco_kernels.kernels.openloop`:

* **bounds**: every case (each operation in each code path, float32 and bfloat16
  parameters) on fresh inputs of an odd size, on the device, against the reference maths
  in float64 within the kernel's running error bound (what ``tests/kernels/test_openloop.py``
  checks on the C++ kernels and under the interpreter);
* **bits**: the same cases and the noise stream (both versions, at offsets where the
  index words wrap), compiled on the device against the Triton interpreter on the host
  (a subprocess with ``TRITON_INTERPRET=1 POCO_BRANCH_FREE=1``, the compiled transform),
  bit for bit: the kernels compile to correctly rounded, unfused IEEE arithmetic, so the
  GPU computes what the interpreter and the C++ kernels do;
* **PTX**: every kernel variant this process compiled has no approximate or fused float
  instruction (``poco_kernels.kernels.aot.audit_ptx``).

Run as a module, it is the interpreter twin: ``python -m benchmarks.gpu.openloop --twin FILE
--n N`` from the repository root.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import torch

from benchmarks.common.device import REPO

PDTYPES = (torch.float32, torch.bfloat16)
NOISE_OFFSETS = (0, 2 ** 31 - 5, 4 * 2 ** 32 - 1502, 3 * 2 ** 32 + 11)


#: the cases of ``--smoke`` (one per operation and family: the code runs in CI, the
#: interpreter's parity is tests/kernels/test_openloop.py's)
SMOKE_CASES = ("sample[ivon]", "accumulate[ge]", "fold_ge", "step[poco,next]", "step[sgd]",
               "step[adamw]", "refresh[ivon]")
#: the cases run with bfloat16 parameters too on a GPU (every case runs with float32; each
#: distinct kernel variant costs a compilation, about a second, of the 4-minute budget)
BF16_CASES = ("sample[ivon]", "sample[buffer,low]", "accumulate[ge]", "step[poco]",
              "step[poco,next]", "step[poco,low]")


def _cases(smoke=False):
    from poco_kernels.kernels import openloop as OL
    return [(c, d) for c in OL.CASES for d in PDTYPES
            if not (OL.CASES[c].get("fp32_only") and d != torch.float32)
            and (d == torch.float32 or c in BF16_CASES)
            and (not smoke or c in SMOKE_CASES)]


def _seed(case, dt):
    return sum(map(ord, case + str(dt))) % 2 ** 31


def outputs(dev, n):
    """Every case's outputs and the noise stream samples on ``dev`` (CPU tensors)."""
    from poco_kernels.kernels import openloop as OL
    from poco_kernels.kernels import triton_ops
    out = {}
    for case, dt in _cases():
        x = OL.make_inputs(case, n, dt, seed=_seed(case, dt), device=dev)
        for k, v in OL.run(triton_ops, case, x).items():
            out[f"{case}|{dt}|{k}"] = v
    for version in (1, 2):
        for off in NOISE_OFFSETS:
            t = triton_ops.randn(torch.empty(n, device=dev), 12345, 7, 0x30001, off, version)
            out[f"noise|v{version}|{off}"] = t.cpu()
    return out


def start_twin(n, path):
    """The interpreter twin in a subprocess (started now, read with :func:`read_twin`; four
    CPU threads, leaving the others to the compilations of this process)."""
    env = dict(os.environ, TRITON_INTERPRET="1", POCO_BRANCH_FREE="1", OMP_NUM_THREADS="4",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-m", "benchmarks.gpu.openloop", "--twin", path,
                             "--n", str(n)], env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def read_twin(proc, path, timeout):
    out, _ = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"interpreter twin failed ({proc.returncode}): {out[-2000:]}")
    return torch.load(path)


def bounds(dev, n, smoke=False):
    """Each case on ``dev`` against its bound: {case|dtype: {output: ratio, ...}}, failures."""
    from poco_kernels.kernels import openloop as OL
    from poco_kernels.kernels import triton_ops
    res, failures = {}, []
    worst = 0.0
    for case, dt in _cases(smoke):
        x = OL.make_inputs(case, n, dt, seed=_seed(case, dt) + 1, device=dev)
        out = OL.run(triton_ops, case, x)
        cmp = OL.compare(out, OL.model(case, dict(x, device="cpu"),
                                       OL.noise_of(triton_ops, case, x)))
        key = f"{case}|{str(dt).replace('torch.', '')}"
        res[key] = {k: {"ratio": round(r["ratio"], 3), "ulps": r["ulps"],
                        "bound_ulps_median": round(r["bound_ulps_median"], 2)}
                    for k, r in cmp.items()}
        worst = max([worst] + [r["ratio"] for r in cmp.values()])
        if not OL.passed(cmp):
            failures.append(f"openloop {key}: outside the bound "
                            f"{ {k: r['ratio'] for k, r in cmp.items() if r['ratio'] > 1} }")
    return res, failures, worst


def bits(dev, n, twin):
    """The device's outputs against the interpreter twin's, bit for bit."""
    mine = outputs(dev, n)
    differ = []
    for k, v in mine.items():
        w = twin.get(k)
        if w is None or w.dtype != v.dtype or w.shape != v.shape or \
                not torch.equal(w.view(torch.uint8), v.view(torch.uint8)):
            nd = None if w is None or w.shape != v.shape else int(
                (w.view(torch.uint8) != v.view(torch.uint8)).sum())
            differ.append(f"{k} ({nd} bytes differ)")
    return {"compared": len(mine), "differing": differ[:20], "n_differing": len(differ)}


def ptx_audit():
    """Forbidden instructions in the PTX of every kernel compiled in this process."""
    from poco_kernels.kernels import aot
    from poco_kernels.kernels import triton_kernels as K
    found, n = {}, 0
    for name, fn in vars(K).items():
        caches = getattr(fn, "device_caches", None)
        if not name.endswith("_kernel") or caches is None:
            continue
        for v in list(caches.values()):
            kc = v[0] if isinstance(v, (tuple, list)) else v
            for compiled in list(kc.values()):
                ptx = getattr(compiled, "asm", {}).get("ptx")
                if ptx is None:
                    continue
                n += 1
                bad = aot.audit_ptx(ptx)
                if bad:
                    found[f"{name}#{n}"] = bad
    if n == 0:
        raise RuntimeError("no compiled kernel found in the JIT caches to audit (has the "
                           "cache layout of this triton version changed?)")
    return {"variants_audited": n, "forbidden": found}


def run(dev, smoke, log, budget_s=90.0):
    """The section: (results, failures).  ``budget_s``: the most it may wait for the twin."""
    import time
    t0 = time.perf_counter()
    res, failures = {}, []
    n_bits = 1023 if smoke else 4099
    tmp = tempfile.mkdtemp(prefix="poco_twin_")
    path = os.path.join(tmp, "twin.pt")
    proc = start_twin(n_bits, path) if dev.type == "cuda" else None
    try:
        try:
            res["bounds"], fails, worst = bounds(dev, 1023 if smoke else 16_411, smoke)
            failures += fails
            log(f"    open loop: {len(res['bounds'])} cases within their float64 bounds: "
                f"{'yes' if not fails else 'NO'} (worst {worst:.3f} of a bound)")
        except Exception as exc:
            res["bounds"] = f"RAISED: {type(exc).__name__}: {exc}"[:1000]
            failures.append("bounds: " + res["bounds"])
        if proc is None:
            res["bits"] = ("the CPU runs the interpreter itself: tests/kernels/test_openloop.py "
                           "compares it with the C++ kernels, bit for bit")
        else:
            try:
                left = max(10.0, budget_s - (time.perf_counter() - t0))
                twin = read_twin(proc, path, timeout=left)
                res["bits"] = bits(dev, n_bits, twin)
                if res["bits"]["n_differing"]:
                    failures.append(f"bits: {res['bits']['n_differing']} outputs differ from "
                                    f"the interpreter: {res['bits']['differing'][:5]}")
                log(f"    open loop: {res['bits']['compared']} outputs and noise samples "
                    f"compiled vs interpreted: {res['bits']['n_differing']} differ")
            except Exception as exc:
                res["bits"] = f"RAISED: {type(exc).__name__}: {exc}"[:1000]
                failures.append("bits: " + res["bits"][:300])
        if dev.type == "cuda":
            try:
                res["ptx"] = ptx_audit()
                if res["ptx"]["forbidden"]:
                    failures.append(f"ptx: forbidden instructions {res['ptx']['forbidden']}")
                log(f"    PTX of {res['ptx']['variants_audited']} compiled variants: "
                    f"{'clean' if not res['ptx']['forbidden'] else res['ptx']['forbidden']}")
            except Exception as exc:
                res["ptx"] = f"RAISED: {type(exc).__name__}: {exc}"[:500]
                failures.append("ptx: " + res["ptx"])
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
    res["seconds"] = time.perf_counter() - t0
    return res, failures


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--twin", required=True)
    ap.add_argument("--n", type=int, default=4099)
    a = ap.parse_args()
    torch.save(outputs(torch.device("cpu"), a.n), a.twin)
