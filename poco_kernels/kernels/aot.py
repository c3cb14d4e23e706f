"""Ahead-of-time compilation of the Triton kernels for real GPU targets, no GPU needed.

Every kernel of :mod:`poco_kernels.kernels.triton_kernels` is compiled, in the code paths
that matter (:func:`variants`), with ``triton.compile`` for a ``GPUTarget("cuda", cc, 32)``;
the resource usage is parsed from the ``ptxas -v`` log of Triton's own cubin stage
(:func:`parse_ptxas_log`; a cached compilation: :func:`resource_report`, the same
flags): registers per thread, spill stores/loads and stack frame.  A kernel that spills,
or that does not compile at all for a target, shows here instead of on the first GPU run.

What a launch from :mod:`~poco_kernels.kernels.triton_ops` gets is mirrored exactly
(:func:`launch_signature` derives it from a launch's arguments by Triton's own rule, and
``tests/kernels/test_triton_aot.py`` checks it against recorded launches of the optimizers):
``num_warps``, ``BLOCK``, 16-byte-aligned pointers and a length ``n`` divisible by 16
(``tt.divisibility=16``: torch allocations are aligned, bucket buffers padded,
:mod:`poco_kernels._layout`), ``n`` and ``seed`` i64 (annotated in the kernels), the other
ints i32, default options otherwise.  ``step[ivon,full,fp32,unpadded]`` is the heaviest
step over an exact, odd length (a direct call on unpadded buffers: scalar loads).
Besides these hand-picked code paths, ``tests/kernels/test_triton_aot.py`` compiles every
distinct variant that recorded launches of the optimizers get (:func:`launch_variant`,
passed as :func:`to_spec` data: ``--specs FILE``) and fails on any spill there too.

Run ``python -m poco_kernels.kernels.aot`` for the table (made by
:mod:`~poco_kernels.kernels.aot_report`; ``--json`` for machine-readable rows, ``--cc 80
--cc 90`` to choose targets); the test fails on any compile error or spill.

Under ``TRITON_INTERPRET=1`` (the test suite) ``triton.jit`` makes interpreter wrappers
that ``triton.compile`` cannot take, so :func:`~poco_kernels.kernels.aot_report.report`
then compiles in a subprocess with the variable removed from its environment.
"""
from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import tempfile
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence

# the SASS classes and the PTX audit (re-exported)
from . import interface as iface
from .compiled_code import FORBIDDEN_PTX, audit_ptx, instruction_mix, sass

__all__ = ["Variant", "variants", "signature", "divisible", "launch_signature",
           "launch_variant", "to_spec", "from_spec", "compile_variant",
           "COMPILE_OPTIONS", "FORBIDDEN_PTX", "audit_ptx", "ptxas_path",
           "toolchain_status", "parse_ptxas_log", "resource_report", "sass", "instruction_mix"]


DEFAULT_CCS = (80, 90)

#: the options every launch of ``triton_ops`` passes besides ``num_warps``: no
#: floating-point contraction (the kernels' arithmetic is the C++ kernels', bit for bit)
COMPILE_OPTIONS = {"enable_fp_fusion": False}

# --------------------------------------------------------------------------- argument types
# Pointer arguments that hold parameters/gradients (their dtype is the parameters'); every
# other ``*_ptr`` is float32 state, except the int64 control tensor.
_PARAM_PTRS = {"param_ptr", "grad_ptr"}
_PTR_TYPES = {"ctl_ptr": "*i64", "found_inf_ptr": "*fp32", "grad_scale_ptr": "*fp32",
              "hp_ptr": "*fp64",
              # (untiled launches pass the control tensor for both; _TILES: tiled ones)
              "tiles_ptr": "*i64", "chunks_ptr": "*i64"}
#: a launch over a sharded bucket's shards (triton_ops.Tiles): its constexprs and types
_TILES = dict(padded=False, types={"chunks_ptr": "*i32"}, SHARD=2, TILED=True)
_I64 = {"n", "seed", "offset"}
_I32 = {"stream", "stream_at_out", "counter_slot", "slot", "counter"}
_FP32 = {"sign"}


class Variant(NamedTuple):
    """One compilation: a kernel, its full signature, its constexpr values, its warps;
    ``padded``: its length ``n`` is divisible by 16 (a padded bucket)."""
    name: str
    kernel: Any
    signature: Dict[str, str]
    constexprs: Dict[str, Any]
    num_warps: int
    padded: bool = True


def _python_fn(kernel):
    """The Python function behind a ``triton.jit`` object (compiled or interpreted)."""
    return getattr(kernel, "fn", kernel)


def constexpr_names(kernel) -> List[str]:
    """The arguments of ``kernel`` annotated ``tl.constexpr``, in order."""
    import triton.language as tl
    out = []
    for p in inspect.signature(_python_fn(kernel)).parameters.values():
        ann = p.annotation
        if ann is tl.constexpr or (isinstance(ann, str) and ann.split(".")[-1] == "constexpr"):
            out.append(p.name)
    return out


def signature(kernel, constexprs: Dict[str, Any], dtype: str = "fp32") -> Dict[str, str]:
    """The signature of ``kernel`` for ``triton.compile``: every argument of ``arg_names``,
    typed by name (``dtype`` is the parameters'/gradients' element type), constexpr
    arguments ``"constexpr"``.  An argument this module does not know, a constexpr without
    a value or a value for a non-constexpr argument raises: the variants must follow
    the kernels."""
    cnames = constexpr_names(kernel)
    missing = [c for c in cnames if c not in constexprs]
    extra = [c for c in constexprs if c not in cnames]
    if missing or extra:
        raise ValueError(f"{kernel.__name__}: constexprs without a value {missing}, "
                         f"values for non-constexpr arguments {extra}")
    sig = {}
    for a in kernel.arg_names:
        if a in cnames:
            sig[a] = "constexpr"
        elif a in _PARAM_PTRS:
            sig[a] = "*" + dtype
        elif a.endswith("_ptr"):
            sig[a] = _PTR_TYPES.get(a, "*fp32")
        elif a in _I64:
            sig[a] = "i64"
        elif a in _I32:
            sig[a] = "i32"
        elif a in _FP32:
            sig[a] = "fp32"
        else:
            raise ValueError(f"{kernel.__name__}: no type known for argument {a!r}; add it "
                             f"to poco_kernels.kernels.aot")
    return sig


_STEP_OFF = dict(FAMILY=0, CORR=False, GE_IN=False, GE_AT_OUT=False, SHARED_NOISE=False,
                 NEXT_SAMPLE=False, HESS_CORR=False, FLOOR=False, CLIP=False, DEBIAS=False, MOMENTUM=False,
                 NESTEROV=False, HAS_FOUND_INF=True, HAS_SCALE=True)


#: the pointers state_dtype=bfloat16 makes bfloat16 (the outer sample's centre, sigma)
_LOW_STATE = {"s1_ptr": "*bf16", "g_out_ptr": "*bf16", "h_out_ptr": "*bf16",
              "m_out_ptr": "*bf16", "sigma_out_ptr": "*bf16"}


def variants() -> List[Variant]:
    """Every kernel, in the code paths that matter (the heaviest ones included)."""
    from ..noise import STREAM_VERSION
    from . import triton_kernels as tk

    block, warps = tk.BLOCK, tk.NUM_WARPS
    out: List[Variant] = []

    def add(name, kernel, dtype="fp32", num_warps=warps, types=None, padded=True,
            **constexprs):
        if "BLOCK" in constexpr_names(kernel):
            constexprs.setdefault("BLOCK", block)
        if "NOISE" in constexpr_names(kernel):      # the current stream definition
            constexprs.setdefault("NOISE", STREAM_VERSION)
        if "SHARD" in constexpr_names(kernel):      # a whole bucket (offset 0)
            constexprs.setdefault("SHARD", 0)
        if "TILED" in constexpr_names(kernel):      # one buffer, not a bucket's shards
            constexprs.setdefault("TILED", False)
        sig = signature(kernel, constexprs, dtype)
        sig.update(types or {})
        out.append(Variant(name, kernel, sig, constexprs, num_warps, padded))

    # samples
    add("sample[ivon,sync,fp32]", tk.sample_kernel, "fp32", SIGMA_MODE=iface.SIGMA_IVON, SYNC=True)
    add("sample[buffer,bf16]", tk.sample_kernel, "bf16", SIGMA_MODE=iface.SIGMA_BUFFER, SYNC=False)
    # gradient sums (FIRST=False: the read-modify-write of acc_g, the heavier path)
    add("accumulate[ge,bf16]", tk.accumulate_kernel, "bf16", FIRST=False, GE=True)
    add("accumulate[ge,fp32]", tk.accumulate_kernel, "fp32", FIRST=False, GE=True)
    add("check[fp32]", tk.check_kernel, "fp32")
    add("fold_ge", tk.fold_ge_kernel)
    # steps
    ivon_full = dict(_STEP_OFF, FAMILY=iface.FAMILY_IVON, CORR=True, HESS_CORR=True, FLOOR=True,
                     CLIP=True, DEBIAS=True)
    add("step[ivon,full,fp32]", tk.step_kernel, "fp32", **ivon_full)
    add("step[ivon,full,bf16]", tk.step_kernel, "bf16", **ivon_full)
    # sample_ahead: the next sample's noise and sigma on top of the heaviest path
    add("step[ivon,full,next,fp32]", tk.step_kernel, "fp32", **dict(ivon_full, NEXT_SAMPLE=True))
    # state_dtype=bfloat16: momentum, outer buffers bfloat16 (outer_dtype: g_out, h_out)
    add("step[ivon,full,next,lowstate,fp32]", tk.step_kernel, "fp32", types=_LOW_STATE,
        **dict(ivon_full, NEXT_SAMPLE=True))
    add("step[ivon,full,next,lowouter,fp32]", tk.step_kernel, "fp32", types=dict(
        g_out_ptr="*bf16", h_out_ptr="*bf16"), **dict(ivon_full, NEXT_SAMPLE=True))
    # the noise of checkpoints written before version 2 (one Philox call per element)
    add("step[ivon,full,next,fp32,noise1]", tk.step_kernel, "fp32",
        **dict(ivon_full, NEXT_SAMPLE=True, NOISE=1))
    # an exact, odd length: no tt.divisibility on n, so every load and store is scalar
    add("step[ivon,full,fp32,unpadded]", tk.step_kernel, "fp32", padded=False, **ivon_full)
    # shards of FSDP2 (exact lengths) at a place in their bucket that is a multiple of 4,
    # and that is not (every element runs its own Philox call)
    add("step[ivon,full,next,fp32,shard]", tk.step_kernel, "fp32", padded=False,
        **dict(ivon_full, NEXT_SAMPLE=True, SHARD=1))
    add("step[ivon,full,next,fp32,shard-unaligned]", tk.step_kernel, "fp32", padded=False,
        **dict(ivon_full, NEXT_SAMPLE=True, SHARD=2))
    # one launch over all the shards of a sharded bucket (triton_ops.Tiles: each program
    # reads its shard's place and tensor from a table), the heaviest paths
    add("sample[ivon,sync,fp32,tiles]", tk.sample_kernel, "fp32", SIGMA_MODE=iface.SIGMA_IVON,
        SYNC=True, **_TILES)
    add("accumulate[ge,bf16,tiles]", tk.accumulate_kernel, "bf16", FIRST=False, GE=True,
        **_TILES)
    add("step[ivon,full,next,lowstate,bf16,tiles]", tk.step_kernel, "bf16",
        **dict(_TILES, types=dict(_LOW_STATE, chunks_ptr="*i32"),
               **dict(ivon_full, NEXT_SAMPLE=True)))
    add("refresh[ivon,lowstate,tiles]", tk.refresh_kernel, FAMILY=iface.FAMILY_IVON, GE=False,
        NOISY=False, HAS_FOUND_INF=True, HAS_SCALE=True,
        **dict(_TILES, types={"chunks_ptr": "*i32",
                              **{k: v for k, v in _LOW_STATE.items() if k != "s1_ptr"}}))
    add("step[ivon,nocorr,bf16]", tk.step_kernel, "bf16",
        **dict(_STEP_OFF, FAMILY=iface.FAMILY_IVON, CLIP=True, DEBIAS=True))
    add("step[ivon,ge_in+ge_at_out,fp32]", tk.step_kernel, "fp32",
        **dict(ivon_full, GE_IN=True, GE_AT_OUT=True))
    add("step[sgd,mom+nesterov+corr,bf16]", tk.step_kernel, "bf16",
        **dict(_STEP_OFF, FAMILY=iface.FAMILY_SGD, CORR=True, MOMENTUM=True, NESTEROV=True))
    add("step[adamw,corr,fp32]", tk.step_kernel, "fp32",
        **dict(_STEP_OFF, FAMILY=iface.FAMILY_ADAMW, CORR=True))
    # refreshes
    add("refresh[ivon]", tk.refresh_kernel, FAMILY=iface.FAMILY_IVON, GE=False, NOISY=False,
        HAS_FOUND_INF=True, HAS_SCALE=True)
    add("refresh[ivon,lowstate]", tk.refresh_kernel,
        types={k: v for k, v in _LOW_STATE.items() if k != "s1_ptr"}, FAMILY=iface.FAMILY_IVON,
        GE=False, NOISY=False, HAS_FOUND_INF=True, HAS_SCALE=True)
    add("refresh[sgd,noisy]", tk.refresh_kernel, FAMILY=iface.FAMILY_SGD, GE=False, NOISY=True,
        HAS_FOUND_INF=True, HAS_SCALE=True)
    # bookkeeping (launched with one warp, see triton_ops._finish)
    add("finish", tk.finish_kernel, num_warps=1, HAS_FOUND_INF=True)
    # the stream itself (the torch backend's noise on a GPU, the GPU check)
    add("randn", tk.randn_kernel)
    return out


def _variant(name: str) -> Variant:
    for v in variants():
        if v.name == name:
            return v
    raise KeyError(name)


# --------------------------------------------------------------------------- toolchain
def interpreting() -> bool:
    """True when ``triton.jit`` objects are interpreter wrappers (not compilable here)."""
    import triton
    from . import triton_kernels as tk
    return not isinstance(tk.step_kernel, triton.runtime.JITFunction)


def ptxas_path(cc: int) -> str:
    """Triton's bundled ptxas for ``cc`` (``ptxas-blackwell`` from sm_90 on)."""
    from triton.backends.nvidia.compiler import get_ptxas
    return get_ptxas(cc).path


def toolchain_status(cc: int) -> Optional[str]:
    """None when ``cc`` can be compiled for here; else the reason it cannot."""
    try:
        import triton  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except Exception as exc:
        return f"triton (with its compiler) cannot be imported: {type(exc).__name__}: {exc}"
    try:
        path = ptxas_path(cc)
    except Exception as exc:
        return f"no ptxas for sm_{cc}: {type(exc).__name__}: {exc}"
    if not (path and os.path.isfile(path) and os.access(path, os.X_OK)):
        return f"ptxas for sm_{cc} not found or not executable: {path!r}"
    return None


def _arch(cc: int) -> str:
    from triton.backends.nvidia.compiler import sm_arch_from_capability
    return sm_arch_from_capability(cc)  # sm_80, sm_90a


# --------------------------------------------------------------------------- compile
def divisible(variant: Variant, aligned: bool = True) -> List[str]:
    """The arguments of ``variant`` compiled with ``tt.divisibility=16``: the pointers
    (``aligned``: torch allocations are 16-byte aligned) and ``n`` when ``padded``."""
    return [a for a in variant.kernel.arg_names
            if (aligned and variant.signature[a].startswith("*"))
            or (a == "n" and variant.padded)]


def launch_signature(kernel, args: Dict[str, Any]):
    """``(signature, divisible)`` of a launch of ``kernel`` with arguments ``args`` (by
    name, constexprs included) by Triton's own specialisation (``native_specialize_impl``,
    the kernel's annotations and ``do_not_specialize``): each argument's type (or
    ``"constexpr"``), and the sorted names of those it specialises as divisible by 16.
    What :func:`compile_variant` compiles for a variant must equal this for the launches
    the variant stands for."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import _normalize_ty
    from . import triton_kernels as tk

    params = inspect.signature(_python_fn(kernel)).parameters
    cnames = set(constexpr_names(kernel))
    sig, div = {}, []
    for a in kernel.arg_names:
        if a in cnames:
            sig[a] = "constexpr"
            continue
        ann = params[a].annotation
        ann = "" if ann is inspect.Parameter.empty else _normalize_ty(ann)
        ty, key = native_specialize_impl(BaseBackend, args[a], False, a not in tk._NO_SPEC, True)
        sig[a] = ann or ty
        if key == "D":
            div.append(a)
    return sig, sorted(div)


def compile_variant(variant: Variant, cc: int, aligned: bool = True):
    """``triton.compile`` of ``variant`` for ``cuda:cc`` (warp size 32); the compiled kernel
    (``.asm['ptx']``, ``.asm['cubin']``).  ``aligned``: pointers carry
    ``tt.divisibility=16``, as a launch on torch allocations (16-byte aligned) gets; so
    does ``n`` of a ``padded`` variant (:func:`divisible`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not isinstance(variant.kernel, triton.runtime.JITFunction):
        raise RuntimeError("the kernels are Triton interpreter wrappers (TRITON_INTERPRET is "
                           "set): compile in a process without it (report() does)")
    div = set(divisible(variant, aligned))
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(variant.kernel.arg_names)
             if a in div}
    src = ASTSource(fn=variant.kernel, signature=dict(variant.signature),
                    constexprs=dict(variant.constexprs), attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", cc, 32),
                          options={"num_warps": variant.num_warps, **COMPILE_OPTIONS})


# --------------------------------------------------------------------------- ptxas
_RE_REGS = re.compile(r"Used (\d+) registers")
_RE_SPILL_ST = re.compile(r"(\d+) bytes spill stores")
_RE_SPILL_LD = re.compile(r"(\d+) bytes spill loads")
_RE_STACK = re.compile(r"(\d+) bytes stack frame")


def parse_ptxas_log(log: str) -> Dict[str, int]:
    """Resource usage from ``ptxas -v`` output: the most registers of any function, and
    spill stores/loads and stack frame summed over every function in the log (a kernel
    is one entry; any non-inlined callee counts against it)."""
    regs = [int(x) for x in _RE_REGS.findall(log)]
    if not regs:
        raise ValueError(f"no 'Used N registers' line in the ptxas output:\n{log}")
    return {"registers": max(regs),
            "spill_stores": sum(int(x) for x in _RE_SPILL_ST.findall(log)),
            "spill_loads": sum(int(x) for x in _RE_SPILL_LD.findall(log)),
            "stack": sum(int(x) for x in _RE_STACK.findall(log))}


def resource_report(ptx: str, cc: int) -> Dict[str, Any]:
    """Assemble ``ptx`` with ``ptxas -v`` for ``cc`` (Triton's flags: ``-lineinfo
    --regAllocOptLevel=2``) and parse its resource usage (:func:`parse_ptxas_log`); the raw
    log is under ``"log"``."""
    with tempfile.TemporaryDirectory(prefix="poco_aot_") as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [ptxas_path(cc), "-lineinfo", "-v", "--regAllocOptLevel=2",
               f"--gpu-name={_arch(cc)}", src, "-o", os.path.join(d, "k.cubin")]
        p = subprocess.run(cmd, capture_output=True, text=True)
    log = p.stdout + p.stderr
    if p.returncode != 0:
        raise RuntimeError(f"ptxas failed ({p.returncode}): {' '.join(cmd)}\n{log}")
    return dict(parse_ptxas_log(log), log=log)


def to_spec(v: Variant) -> Dict[str, Any]:
    """A variant as plain data (JSON): kernel by name, signature, constexprs, warps,
    padding."""
    return {"name": v.name, "kernel": v.kernel.__name__, "signature": dict(v.signature),
            "constexprs": dict(v.constexprs), "num_warps": v.num_warps, "padded": v.padded}


def from_spec(spec: Dict[str, Any]) -> Variant:
    """The variant of :func:`to_spec`'s data."""
    from . import triton_kernels as tk
    return Variant(spec["name"], getattr(tk, spec["kernel"]), dict(spec["signature"]),
                   dict(spec["constexprs"]), int(spec["num_warps"]), bool(spec["padded"]))


def launch_variant(kernel, args: Dict[str, Any], num_warps: int) -> Variant:
    """The variant a launch of ``kernel`` with ``args`` (by name, constexprs included)
    compiles: :func:`launch_signature`'s types, its constexpr values, ``padded`` when it
    specialises ``n`` as divisible by 16; named by its kernel and constexprs."""
    sig, div = launch_signature(kernel, args)
    cx = {c: args[c] for c in constexpr_names(kernel)}
    ptrs = ",".join(f"{a[:-4]}:{t[1:]}" for a, t in sig.items() if t.startswith("*")
                    and t != "*fp32" and a not in ("ctl_ptr",))
    flags = [k if v is True else f"{k}={int(v)}" for k, v in cx.items()
             if k != "BLOCK" and v is not False]
    unpadded = "n" in sig and "n" not in div
    name = (f"launch:{kernel.__name__[:-7]}[" + ",".join(flags) + (f";{ptrs}" if ptrs else "")
            + (";unpadded" if unpadded else "") + "]")
    return Variant(name, kernel, sig, cx, num_warps, not unpadded)


if __name__ == "__main__":   # the report (aot_report imports this module, not the reverse)
    import importlib

    sys.exit(importlib.import_module("poco_kernels.kernels.aot_report").main())
