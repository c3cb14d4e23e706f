"""Ahead-of-time compilation of every Triton kernel for real GPU targets (no GPU needed).

Each variant of :func:`poco_kernels.kernels.aot.variants` is compiled with ``triton.compile``
for sm_80 and sm_90a and assembled by Triton's bundled ``ptxas -v``; the test fails on a
compile error, on a register count outside (0, 255] and on any spill.  The register table
is printed (``pytest -s`` or ``-rA`` shows it).  The tests run under ``TRITON_INTERPRET=1``
(conftest), so :func:`aot_report.report` compiles in a subprocess without it.
"""
import time

import pytest

pytest.importorskip("triton")

from poco_kernels.kernels import aot, aot_report  # noqa: E402

CCS = (80, 90)
MAX_REGISTERS = 255  # architectural limit per thread on sm_80/sm_90


def _problems(rows, expected):
    """What is wrong with the rows of one target: missing variants, compile errors,
    register counts out of range, spills, layout conversions."""
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
        if r.get("layout_conversions"):
            out.append(f"{tag}: {r['layout_conversions']} layout conversions in the Triton "
                       f"GPU IR (shared memory and a barrier in every block)")
        if r.get("forbidden"):
            out.append(f"{tag}: approximate or fused float instructions in the PTX "
                       f"{r['forbidden']} (the kernels are the C++ kernels' IEEE arithmetic)")
    return out


@pytest.fixture(scope="module")
def aot_rows(tmp_path_factory):
    """All targets compiled in one (parallel) run: {cc: rows}, and its wall time.  A fresh
    Triton cache: every variant is really compiled, and ~/.triton is left alone."""
    ccs = [cc for cc in CCS if aot.toolchain_status(cc) is None]
    t0 = time.perf_counter()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton_cache")))
        rows = aot_report.report(ccs, timeout=600) if ccs else []
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


def _recorded_launches(monkeypatch):
    """Every kernel launch (kernel, arguments by name) of short runs of the optimizers on
    the Triton backend (interpreted here): IVON-PoCoMo with a refresh and AMP arguments,
    float32 and bfloat16 parameters, the default 63-bit seed and a small explicit one;
    float16 parameters with bfloat16 outer estimates; a resumed pre-v2 run (noise version
    1) with bfloat16 state; IVON with two draws and sample_ahead; SVRG-AdamW."""
    import torch
    import poco_kernels as pk
    from helpers import Problem, mlp, run
    from poco_kernels.kernels import triton_kernels as K
    launches = []

    class Spy:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            launch = self.kernel[grid]

            def call(*args, **kwargs):
                # every launch compiles with the options the AOT variants are compiled with
                assert {k: kwargs.get(k) for k in aot.COMPILE_OPTIONS} == aot.COMPILE_OPTIONS
                named = dict(zip(self.kernel.arg_names, args))
                named.update({k: v for k, v in kwargs.items()
                              if k != "num_warps" and k not in aot.COMPILE_OPTIONS})
                launches.append((self.kernel, named, kwargs.get("num_warps", 4)))
                return launch(*args, **kwargs)
            return call

    for name, obj in list(vars(K).items()):
        if name.endswith("_kernel") and hasattr(obj, "arg_names"):
            monkeypatch.setattr(K, name, Spy(obj))
    prob = Problem()
    for dtype, seed in ((torch.float32, None), (torch.bfloat16, 5)):
        m = mlp(dtype=dtype)
        opt = pk.IVONPoCo(m.parameters(), lr=0.05, ess=200.0, alpha=0.5, rho1=0.5, rho2=0.2,
                          backend="triton", seed=seed)
        run(opt, m, prob, 3, refresh_every=2, warmup=1)
        opt.step(prob.closure(opt, m, prob.batches(1)[0]), grad_scale=torch.tensor(2.0),
                 found_inf=torch.tensor(0.0))
    for dtype, version, low in ((torch.float16, 2, dict(outer_dtype=torch.bfloat16)),
                                (torch.float32, 1, dict(state_dtype=torch.bfloat16))):
        m = mlp(dtype=dtype)
        opt = pk.IVONPoCo(m.parameters(), lr=0.05, ess=200.0, alpha=0.5, backend="triton",
                          **low)
        opt.noise_version = version
        run(opt, m, prob, 3, refresh_every=2, warmup=1)
    for version in (2, 1):
        m = mlp()
        opt = pk.IVON(m.parameters(), lr=0.05, ess=200.0, mc_samples=2, backend="triton",
                      sample_ahead=True)
        opt.noise_version = version
        run(opt, m, prob, 2)
    m = mlp()
    opt = pk.SVRGAdamW(m.parameters(), lr=1e-3, backend="triton")
    run(opt, m, prob, 3, refresh_every=2, warmup=1)
    return launches


def test_compiled_variants_take_the_types_real_launches_get(monkeypatch):
    """The AOT variants are compiled with the argument types and divisibility that real
    launches get: for every launch of the optimizers (recorded), Triton's specialisation of
    its arguments (``aot.launch_signature``) types every scalar as ``aot.signature`` does
    and marks exactly the pointers and the (padded) length ``n`` divisible by 16, as
    ``aot.divisible`` compiles a padded variant.  (A launch typing ``n`` or ``seed`` by
    value, as before they were annotated, fails here: a small seed gives i32.)"""
    launches = _recorded_launches(monkeypatch)
    kernels = {k.__name__ for k, _, _ in launches}
    assert {"sample_kernel", "accumulate_kernel", "step_kernel", "refresh_kernel",
            "finish_kernel"} <= kernels, kernels
    seen = set()
    for kernel, args, _ in launches:
        sig, div = aot.launch_signature(kernel, args)
        cnames = aot.constexpr_names(kernel)
        want = aot.signature(kernel, {c: args[c] for c in cnames if c in args} |
                             {c: None for c in cnames if c not in args})
        for a, t in sig.items():
            if not t.startswith("*"):
                assert t == want[a], (kernel.__name__, a, t, want[a])
        variant = aot.Variant("launch", kernel, sig, {}, 4, padded="n" in args)
        assert div == sorted(aot.divisible(variant)), (kernel.__name__, div)
        seen.add((kernel.__name__, tuple(sig.items())))
    assert len(seen) > 5


#: the targets the launched variants are compiled for: the GPUs the package is run on
#: (H100, H200); the hand-picked variants, the heaviest of each kernel, are compiled for
#: sm_80 too (aot_rows)
LAUNCH_CCS = (90,)


@pytest.fixture(scope="module")
def launch_rows(tmp_path_factory):
    """Every distinct variant the recorded launches of the optimizers compile
    (``aot.launch_variant``: their types, divisibility, constexprs and warps), compiled for
    LAUNCH_CCS: {cc: rows}, and the variants."""
    with pytest.MonkeyPatch.context() as mp:
        launches = _recorded_launches(mp)
    specs = {}
    for kernel, args, warps in launches:
        v = aot.launch_variant(kernel, args, warps)
        specs.setdefault(v.name, aot.to_spec(v))
    ccs = [cc for cc in LAUNCH_CCS if aot.toolchain_status(cc) is None]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton_cache_launch")))
        rows = (aot_report.report(ccs, timeout=600, specs=list(specs.values()), mix=False)
                if ccs else [])
    return {cc: [r for r in rows if r["cc"] == cc] for cc in ccs}, specs


@pytest.mark.parametrize("cc", LAUNCH_CCS)
def test_the_variants_real_launches_compile_without_spills(cc, launch_rows):
    """Each distinct kernel variant that the recorded launches of the optimizers get
    (IVON-PoCoMo with and without AMP arguments, bf16 and fp16 parameters, noise version 1,
    IVON with two draws and
    sample_ahead, SVRG-AdamW) compiles for the target without a spill, as launched."""
    if aot.toolchain_status(cc) is not None:
        pytest.skip(aot.toolchain_status(cc))
    rows, specs = launch_rows
    assert len(specs) > 15
    problems = _problems(rows[cc], list(specs))
    print(f"\n{len(rows[cc])} launched variants on sm_{cc}:\n" + aot_report.format_table(rows[cc]))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("cc", CCS)
def test_compiles_without_spills(cc, aot_rows):
    reason = aot.toolchain_status(cc)
    if reason is not None:
        pytest.skip(reason)
    by_cc, elapsed = aot_rows
    rows = by_cc[cc]
    print(f"\nTriton AOT, cc {cc} (all targets compiled in {elapsed:.1f} s):")
    print(aot_report.format_table(rows))
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
    row = dict(variant="step[x]", cc=90, arch="sm_90a", error=None, forbidden={}, **res)
    assert _problems([row], ["step[x]"]) == [
        "step[x] [sm_90a]: spills 8 bytes stores, 12 bytes loads"]
    assert _problems([dict(row, spill_stores=0, spill_loads=0)], ["step[x]"]) == []
    assert _problems([dict(row, spill_stores=0, spill_loads=0, registers=0)], ["step[x]"])
    assert _problems([dict(row, error="CompilationError: boom")], ["step[x]"])
    assert _problems([dict(row, spill_stores=0, spill_loads=0,
                           forbidden=aot.audit_ptx("\tfma.rn.f32 %r1, %r2, %r3, %r4;"))],
                     ["step[x]"]) == ["step[x] [sm_90a]: approximate or fused float "
                                      "instructions in the PTX {'fma.rn.f32': 1} (the kernels "
                                      "are the C++ kernels' IEEE arithmetic)"]
    assert _problems([dict(row, spill_stores=0, spill_loads=0, layout_conversions=7)],
                     ["step[x]"]) == ["step[x] [sm_90a]: 7 layout conversions in the Triton "
                                      "GPU IR (shared memory and a barrier in every block)"]
    from poco_kernels.kernels.compiled_code import layout_conversions
    assert layout_conversions(
        "%23 = ttg.convert_layout %h_new_417 : tensor<1024xf32, #blocked> -> tensor<1024xf32,"
        " #blocked2> loc(#loc246)\n%24 = arith.addf %a, %b : tensor<1024xf32, #blocked>") == 1
    assert _problems([], ["step[x]"]) == ["step[x]: not compiled"]
    with pytest.raises(ValueError):
        aot.parse_ptxas_log("ptxas fatal   : something else")


@pytest.mark.parametrize("cc", CCS)
def test_noise_v2_makes_a_quarter_of_the_philox_multiplies(cc, aot_rows):
    """From the SASS of the heaviest step (three noise streams per element: inner, outer,
    next sample): version 2 (one Philox call per four normals) issues at most 30% of
    version 1's 32 x 32 -> 64-bit multiplies, and fewer instructions in all."""
    reason = aot.toolchain_status(cc)
    if reason is not None:
        pytest.skip(reason)
    rows = {r["variant"]: r for r in aot_rows[0][cc]}
    v2, v1 = rows["step[ivon,full,next,fp32]"]["mix"], rows["step[ivon,full,next,fp32,noise1]"]["mix"]
    print(f"\nsm_{cc} step[ivon,full,next,fp32] SASS per thread (8 elements): v2 {v2}, v1 {v1}")
    assert v1["mulhi"] > 0 and v2["mulhi"] <= 0.3 * v1["mulhi"], (v2, v1)
    assert v2["total"] < v1["total"]


_SASS = """\
        /*0000*/                   IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0018*/              @!P1 LDG.E.128 R16, [R4.64] ;
        /*0020*/              @!P0 IMAD.HI.U32 R2, R3, -0x2daee0ad, RZ ;
        /*0030*/                   IMAD.WIDE.U32 R4, R5, 0x4, R6 ;
        /*0040*/                   LOP3.LUT R2, R2, R7, R8, 0x96, !PT ;
        /*0050*/                   FFMA R9, R9, R10, R11 ;
        /*0060*/                   MUFU.LG2 R12, R12 ;
        /*0070*/                   I2F R13, R13 ;
        /*0080*/                   LDG.E R14, [R4.64] ;
        /*0088*/               @P2 STG.E [R4.64], R14 ;
        /*0090*/               @P1 BRA `(.L_x_1) ;
.L_x_1:
        /*00a0*/                   EXIT ;
"""


_SASS_DIV_RN = """\
        /*0000*/                   MUFU.RCP R39, R22 ;
        /*0010*/                   FCHK P0, R5, R22 ;
        /*0020*/                   FFMA R4, R39, -R22, 1 ;
        /*0030*/              @!P0 BRA `(.L_x_25) ;
        /*0040*/                   MOV R4, R22 ;
        /*0050*/                   CALL.REL.NOINC `($__internal_1_$__cuda_sm3x_div_rn_noftz_f32_slowpath) ;
        /*0060*/                   MOV R39, R3 ;
.L_x_25:
        /*0070*/                   BSYNC B2 ;
        /*0080*/                   STG.E [R4.64], R39 ;
        /*0090*/                   EXIT ;
$__internal_1_$__cuda_sm3x_div_rn_noftz_f32_slowpath:
        /*00a0*/                   FFMA R3, R3, R4, RZ ;
        /*00b0*/                   RET.REL.NODEC R40 ;
"""


def test_fast_path_leaves_out_the_slow_paths():
    """The fast path of a correctly rounded division: its out-of-line slow path (the block
    that calls it, and the subroutine) is left out of the count (the test can fail)."""
    from poco_kernels.kernels import budget as B
    full, fast = B.instruction_mix(_SASS_DIV_RN), B.instruction_mix(_SASS_DIV_RN, fast_path=True)
    assert full["total"] == 12 and fast["total"] == 7
    assert fast["fp32"] == 2 and fast["mem"] == 1 and fast["control"] == 3


def test_instruction_mix_and_budget_model():
    """The SASS classifier and the A100 model on a known snippet (both can fail)."""
    from poco_kernels.kernels import budget as B
    mix = B.instruction_mix(_SASS)
    assert mix == dict(mufu=1, conv=1, imad=3, fp32=1, mem=3, control=3, alu=1, total=13,
                       mulhi=2, ldg=2, ldg_vec=1, stg=1, stg_vec=0, ldg_before_philox=1)
    # 128 fp32 instructions per element: 2 clocks of the FMA lanes per element per SM
    b = B.budget(dict(mix, fp32=128 * 8, imad=0, total=128 * 8), per_thread=8,
                 bytes_per_element=8.0)
    sm_clocks = 2.0 / (B.A100["sms"] * B.A100["clock_hz"])
    assert b["instr_ns"] == pytest.approx(sm_clocks * 1e9)
    assert b["mem_ns"] == pytest.approx(8.0 / 2.0e12 * 1e9)
    assert b["ratio"] == pytest.approx(b["instr_ns"] / b["mem_ns"])
    # the special-function unit (16 lanes) binds before the issue rate
    b2 = B.budget(dict(mix, mufu=64 * 8, total=64 * 8), per_thread=8, bytes_per_element=8.0)
    assert b2["instr_ns"] == pytest.approx(4.0 / (B.A100["sms"] * B.A100["clock_hz"]) * 1e9)


#: instruction time / memory time per element on the A100 model of
#: poco_kernels.kernels.budget (docs/gpu-budget.md), from the fast path's instructions
#: (the correctly rounded divisions' and square roots' slow paths left out), as measured
#: at this commit for sm_80 and sm_90a (the larger) plus 15%: a regression guard.  The goal is 0.5 for every
#: kernel; docs/gpu-budget.md says which are above it and why.
RATIO_LIMITS = {
    "sample[ivon,sync,fp32]": 0.88,
    "sample[buffer,bf16]": 1.9,
    "accumulate[ge,bf16]": 0.66,
    "accumulate[ge,fp32]": 0.57,
    "check[fp32]": 0.39,
    "fold_ge": 1.37,
    "step[ivon,full,fp32]": 0.7,
    "step[ivon,full,bf16]": 0.74,
    "step[ivon,full,next,fp32]": 0.96,
    "step[ivon,full,next,lowstate,fp32]": 1.27,
    "step[ivon,full,next,lowouter,fp32]": 1.04,
    "step[ivon,full,next,fp32,noise1]": 1.65,
    "step[ivon,full,fp32,unpadded]": 0.7,
    "step[ivon,nocorr,bf16]": 0.7,
    "step[ivon,ge_in+ge_at_out,fp32]": 0.26,
    "step[sgd,mom+nesterov+corr,bf16]": 0.21,
    "step[adamw,corr,fp32]": 0.25,
    "refresh[ivon]": 0.47,
    "refresh[ivon,lowstate]": 0.96,
    "refresh[sgd,noisy]": 0.71,
}


@pytest.mark.parametrize("cc", CCS)
def test_instruction_budget_stays_within_its_limits(cc, aot_rows):
    """Each kernel's SASS instruction time per element against its memory time on the A100
    model, from the compilations above: within the limits of RATIO_LIMITS."""
    from poco_kernels.kernels import budget as B
    reason = aot.toolchain_status(cc)
    if reason is not None:
        pytest.skip(reason)
    variants = {v.name: v for v in aot.variants()}
    over, table = [], []
    for r in aot_rows[0][cc]:
        name = r["variant"]
        nbytes = B.BYTES.get(B._base(name))
        if not nbytes:
            continue
        v = variants[name]
        b = B.budget(r["fast_mix"], v.constexprs["BLOCK"] // (32 * v.num_warps), nbytes)
        table.append(f"{name:40s} {b['instr_per_element']:7.1f} instr/elem  ratio {b['ratio']:.2f}")
        if b["ratio"] > RATIO_LIMITS[name]:
            over.append(f"{name}: {b['ratio']:.2f} > {RATIO_LIMITS[name]}")
    print(f"\nsm_{cc}, instruction time / memory time on the A100 model:\n" + "\n".join(table))
    assert len(table) == len(RATIO_LIMITS)
    assert not over, "\n".join(over)
