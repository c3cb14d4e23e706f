"""Ahead-of-time compilation of every Triton kernel for real GPU targets (no GPU needed).

Each variant of :func:`poco_kernels.kernels.aot.variants` is compiled with ``triton.compile``
for sm_80 and sm_90a and assembled by Triton's bundled ``ptxas -v``; the test fails on a
compile error, on a register count outside (0, 255] and on any spill.  The register table
is printed (``pytest -s`` or ``-rA`` shows it).  The tests run under ``TRITON_INTERPRET=1``
(conftest), so :func:`aot.report` compiles in a subprocess without it.
"""
import time

import pytest

pytest.importorskip("triton")

from poco_kernels.kernels import aot  # noqa: E402

CCS = (80, 90)
MAX_REGISTERS = 255  # architectural limit per thread on sm_80/sm_90


def _problems(rows, expected):
    """What is wrong with the rows of one target: missing variants, compile errors,
    register counts out of range, spills."""
    out = []
    names = [r["variant"] for r in rows]
    out += [f"{n}: not compiled" for n in expected if n not in names]
    for r in rows:
        tag = f"{r['variant']} [{r.get('arch') or r['cc']}]"
        if r.get("error"):
            out.append(f"{tag}: compile failed: {r['error']}")
            continue
        if not 0 < r["registers"] <= MAX_REGISTERS:
            out.append(f"{tag}: {r['registers']} registers (expected 1..{MAX_REGISTERS})")
        if r["spill_stores"] or r["spill_loads"]:
            out.append(f"{tag}: spills {r['spill_stores']} bytes stores, "
                       f"{r['spill_loads']} bytes loads")
    return out


@pytest.fixture(scope="module")
def aot_rows(tmp_path_factory):
    """All targets compiled in one (parallel) run: {cc: rows}, and its wall time.  A fresh
    Triton cache: every variant is really compiled, and ~/.triton is left alone."""
    ccs = [cc for cc in CCS if aot.toolchain_status(cc) is None]
    t0 = time.perf_counter()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton_cache")))
        rows = aot.report(ccs, timeout=600) if ccs else []
    elapsed = time.perf_counter() - t0
    return {cc: [r for r in rows if r["cc"] == cc] for cc in ccs}, elapsed


def test_variants_cover_every_kernel():
    from poco_kernels.kernels import triton_kernels as K
    kernels = {name for name, obj in vars(K).items()
               if name.endswith("_kernel") and hasattr(obj, "arg_names")}
    vs = aot.variants()
    assert kernels <= {v.kernel.__name__ for v in vs}
    assert len({v.name for v in vs}) == len(vs)
    for v in vs:
        assert list(v.signature) == list(v.kernel.arg_names), v.name
        cnames = aot.constexpr_names(v.kernel)
        assert sorted(v.constexprs) == sorted(cnames), v.name
        assert [a for a, t in v.signature.items() if t == "constexpr"] == cnames, v.name
    # parameters/gradients in both dtypes where they are read or written
    for kernel in ("sample_kernel", "step_kernel", "accumulate_kernel"):
        ptr = "grad_ptr" if kernel == "accumulate_kernel" else "param_ptr"
        seen = {v.signature[ptr] for v in vs if v.kernel.__name__ == kernel}
        assert {"*bf16", "*fp32"} <= seen, (kernel, seen)


@pytest.mark.parametrize("cc", CCS)
def test_compiles_without_spills(cc, aot_rows):
    reason = aot.toolchain_status(cc)
    if reason is not None:
        pytest.skip(reason)
    by_cc, elapsed = aot_rows
    rows = by_cc[cc]
    print(f"\nTriton AOT, cc {cc} (all targets compiled in {elapsed:.1f} s):")
    print(aot.format_table(rows))
    problems = _problems(rows, [v.name for v in aot.variants()])
    assert not problems, "\n".join(problems)


_PTXAS_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'step_kernel' for 'sm_90a'
ptxas info    : Function properties for step_kernel
    24 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 0 barriers, 504 bytes cmem[0]
"""


def test_spill_check_can_fail():
    """The parser reads spills and the check above rejects them (the test can fail)."""
    res = aot.parse_ptxas_log(_PTXAS_LOG)
    assert res == {"registers": 255, "spill_stores": 8, "spill_loads": 12, "stack": 24}
    row = dict(variant="step[x]", cc=90, arch="sm_90a", error=None, **res)
    assert _problems([row], ["step[x]"]) == [
        "step[x] [sm_90a]: spills 8 bytes stores, 12 bytes loads"]
    assert _problems([dict(row, spill_stores=0, spill_loads=0)], ["step[x]"]) == []
    assert _problems([dict(row, spill_stores=0, spill_loads=0, registers=0)], ["step[x]"])
    assert _problems([dict(row, error="CompilationError: boom")], ["step[x]"])
    assert _problems([], ["step[x]"]) == ["step[x]: not compiled"]
    with pytest.raises(ValueError):
        aot.parse_ptxas_log("ptxas fatal   : something else")
