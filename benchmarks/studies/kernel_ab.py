"""The C++ kernels of a git revision against the work tree's, in ONE process, their calls
interleaved rep by rep: a before/after of a kernel change that this project's shared,
noisy CPU can resolve.  Two builds of the extension timed in alternating processes move
by 10-30% between runs here, which hides a 5% change; two kernel trees in one binary,
each call of one beside the same call of the other, give a ratio per rep whose median
holds to about 2%.

The base tree's headers (``csrc/*.h``) come from ``git archive REV``; each tree is
compiled for one instruction set (``--isa``: the extension's ``avx512`` or ``avx2``, the
best this CPU runs by default) into its own namespace, with the extension's flags
(``setup.py``), and ``kernel_ab_driver.cpp`` runs
the cases it names on the same buffers.  The kernels' interface (the structs of
``poco_kernels.h``) must be the same in both trees: the driver is compiled against the
work tree's.  Per case, the medians of each tree and the median of the per-rep ratios
work / base, to ``--out`` (CSV in the benchmarks' schema, and a markdown table beside it)::

    python -m benchmarks.studies.kernel_ab [--base HEAD] [--isa avx2] [--numel 16777216]
        [--reps 12] [--threads 2] [--out bench_out/kernel_ab.csv]

Compiling the two trees takes one to two minutes on two cores.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile

if __package__ in (None, ""):    # run as a script: the repository root, for ``benchmarks.*``
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__)))))

from benchmarks.common.device import REPO  # noqa: E402

#: the extension's compile flags (setup.py) and its instruction sets (kernels_<isa>.cpp)
FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off",
         "-std=c++20"]
ISAS = {"avx512": ("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,bmi,bmi2,f16c,lzcnt,popcnt,"
                   "movbe,prefer-vector-width=512", 512),
        "avx2": ("avx2,fma,bmi,bmi2,f16c,lzcnt,popcnt,movbe", 256)}
DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel_ab_driver.cpp")

_WRAPPER = """#include <cstdint>
#include <cstring>
#include <immintrin.h>
#pragma GCC target("{target}")
#define POCO_ISA {isa}_{tree}
#define POCO_ISA_NAME "{isa}_{tree}"
#define POCO_TABLE kKernels_{tree}
#define POCO_SIMD {simd}
#include "{dir}/kernels_impl.h"
namespace poco {{ int64_t tile_{tree}() {{ return kTile; }} }}
"""


def interface(header_text: str) -> str:
    """The part of ``poco_kernels.h`` the driver depends on: its declarations without
    comments, blank lines and the tile size."""
    text = re.sub(r"//[^\n]*", "", header_text)
    lines = [ln.strip() for ln in text.splitlines()]
    return "\n".join(ln for ln in lines if ln and not ln.startswith("constexpr int64_t kTile"))


def best_isa() -> str:
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    return "avx512" if re.search(r"\bavx512bw\b", flags) else "avx2"


def build(base: str, isa: str, workdir: str, cxx: str) -> str:
    """The driver binary with the kernels of ``base`` (a git revision) and of the work
    tree; raises RuntimeError if the trees' kernel interfaces differ or a compile fails."""
    os.makedirs(os.path.join(workdir, "base"))
    tar = os.path.join(workdir, "base.tar")
    out = subprocess.run(["git", "-C", REPO, "archive", "--format=tar", "-o", tar, base, "csrc"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"git archive {base} csrc: {out.stderr.strip()}")
    with tarfile.open(tar) as t:
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        t.extractall(os.path.join(workdir, "base"),
                     members=[m for m in t.getmembers() if m.name.endswith(".h")], **safe)
    base_dir = os.path.join(workdir, "base", "csrc")
    work_dir = os.path.join(REPO, "csrc")
    with open(os.path.join(base_dir, "poco_kernels.h")) as f, \
            open(os.path.join(work_dir, "poco_kernels.h")) as g:
        if interface(f.read()) != interface(g.read()):
            raise RuntimeError(f"the kernels' interface (csrc/poco_kernels.h) differs between "
                               f"{base} and the work tree: compare them with the benchmarks")
    target, simd = ISAS[isa]
    jobs, objs = [], []
    for tree, d in (("base", base_dir), ("work", work_dir)):
        src = os.path.join(workdir, f"kernels_{tree}.cpp")
        with open(src, "w") as f:
            f.write(_WRAPPER.format(target=target, isa=isa, tree=tree, simd=simd, dir=d))
        objs.append(src[:-4] + ".o")
        jobs.append([cxx, *FLAGS, "-c", src, "-o", objs[-1]])
    objs.append(os.path.join(workdir, "driver.o"))
    jobs.append([cxx, *FLAGS, "-I", work_dir, "-c", DRIVER, "-o", objs[-1]])
    procs = [subprocess.Popen(j, stderr=subprocess.PIPE, text=True) for j in jobs]
    for j, p in zip(jobs, procs):
        _, err = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(j)} failed:\n{err}")
    exe = os.path.join(workdir, "kernel_ab")
    subprocess.run([cxx, "-fopenmp", *objs, "-o", exe], check=True)
    return exe


def run(exe: str, numel: int, reps: int, threads: int) -> dict:
    """{case: {tree: [ms per rep]}} from the driver's lines."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run([exe, str(numel), str(reps)], capture_output=True, text=True,
                         env=env, check=True).stdout
    times = collections.defaultdict(lambda: collections.defaultdict(list))
    for line in out.splitlines():
        case, tree, _, ms = line.split(",")
        times[case][tree].append(float(ms))
    return times


def summary(times: dict) -> list:
    """Per case: each tree's median ms and the median of the per-rep ratios work / base."""
    def pct(xs, q):                   # (nearest rank)
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    rows = []
    for case, t in times.items():
        ratios = [w / b for b, w in zip(t["base"], t["work"])]
        rows.append(dict(case=case, base_ms=statistics.median(t["base"]),
                         work_ms=statistics.median(t["work"]),
                         base_p=(pct(t["base"], 0.2), pct(t["base"], 0.8)),
                         work_p=(pct(t["work"], 0.2), pct(t["work"], 0.8)),
                         ratio=statistics.median(ratios), reps=len(ratios)))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="the git revision to compare with")
    ap.add_argument("--isa", default=None, choices=sorted(ISAS))
    ap.add_argument("--numel", type=int, default=2 ** 24)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="bench_out/kernel_ab.csv")
    args = ap.parse_args(argv)
    import datetime

    import torch

    from benchmarks.common.report import write_csv
    isa = args.isa or best_isa()
    threads = args.threads or torch.get_num_threads()
    cxx = os.environ.get("CXX") or shutil.which("c++") or "g++"
    rev = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", args.base],
                         capture_output=True, text=True).stdout.strip() or args.base
    with tempfile.TemporaryDirectory() as workdir:
        exe = build(args.base, isa, workdir, cxx)
        rows = summary(run(exe, args.numel, args.reps, threads))
    from benchmarks.common.device import device_info
    cpu = device_info(torch.device("cpu"))
    device = f"cpu: {cpu['name']}, {threads} threads, C++ kernels {isa}"
    date = datetime.date.today().isoformat()
    csv_rows = []
    for r in rows:
        for tree, ms, (p20, p80) in ((f"kernels@{rev}", r["base_ms"], r["base_p"]),
                                     ("kernels@work tree", r["work_ms"], r["work_p"])):
            csv_rows.append(dict(kernel=r["case"], provider=tree, dtype="float32",
                                 size=args.numel, median=ms / 1e3, p20=p20 / 1e3,
                                 p80=p80 / 1e3, timing="steady_clock, interleaved"))
    write_csv(args.out, csv_rows, device, date)
    md = [f"Device: {device}; {args.numel} float32 elements; {args.reps} reps, the two trees' "
          f"calls interleaved in one process; medians.", "",
          f"| case | {rev} ms | work tree ms | work / base (median of per-rep ratios) |",
          "|---|---|---|---|"]
    md += [f"| {r['case']} | {r['base_ms']:.2f} | {r['work_ms']:.2f} | {r['ratio']:.3f} |"
           for r in rows]
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    return rows


if __name__ == "__main__":
    main()
