"""Open-loop parity of the fused kernels: each operation, from one state and one set of
gradients, against the reference maths evaluated in float64, element by element, within
a bound justified by the operations the kernel performs.

For every case of :data:`CASES` (sample, accumulate, fold_ge, step and refresh, in their
code paths: IVON, IVON-PoCo(Mo) with every switch, SGD, AdamW; float32, bfloat16 and
float16 parameters; bfloat16 state), :func:`make_inputs` draws fresh random inputs of a
given (odd) size, :func:`run` applies one kernel set's operation (``cpp_ops`` or
``triton_ops``, on any device) and :func:`model` writes the same operation with
:class:`~poco_kernels.kernels.bounds.Tracked` values, in the kernels' order of operations
(``csrc/kernels_*.h``): each output's exact value (the reference maths in float64)
and the bound of a float32 computation of it.  :func:`compare` gives, per output, the
largest error in units of its bound (at most 1: parity) and in ulps of the result.

The noise is the kernel set's own (``ops.randn``, the stream the kernels regenerate):
the normals are checked separately, bit for bit (``docs/design.md``, Noise).
``tests/kernels/test_openloop.py`` runs this on the C++ kernels and under the Triton interpreter;
``benchmarks/bench_gpu.py`` on a GPU.
"""
from __future__ import annotations

import math
from typing import Dict, Optional

import torch
from torch import Tensor

from . import interface as iface
from .bounds import Tracked as T
from .openloop_model import model as _model

SEED = 987654321123
#: hyperparameters of the cases: beta2 close to 1 (the paper's), where a float32 ``1 -
#: beta2`` would be wrong in its fourth digit
HP = dict(lr=0.07, hess_init=0.3, beta1=0.9, beta2=0.9999, wd=2e-3, ess=1.0e4, alpha=0.7,
          hess_corr=0.5, floor=0.5, clip=0.4, rho1=0.6, rho2=0.1, momentum=0.9,
          dampening=0.1, eps=1e-8, sigma=0.03)

#: name -> (operation, options)
CASES: Dict[str, dict] = {
    "sample[none]": dict(op="sample", mode=iface.SIGMA_NONE),
    "sample[ivon]": dict(op="sample", mode=iface.SIGMA_IVON, sign=-1.0),
    "sample[ivon,sync]": dict(op="sample", mode=iface.SIGMA_IVON, sync=True, fp32_only=True),
    "sample[buffer]": dict(op="sample", mode=iface.SIGMA_BUFFER),
    "sample[buffer,low]": dict(op="sample", mode=iface.SIGMA_BUFFER, low=True),
    "sample[const]": dict(op="sample", mode=iface.SIGMA_CONST),
    "accumulate[first]": dict(op="accumulate", first=True),
    "accumulate[ge]": dict(op="accumulate", ge=True, sign=-1.0),
    "fold_ge": dict(op="fold_ge"),
    "step[ivon]": dict(op="step", family=iface.FAMILY_IVON),
    "step[ivon,nodebias,noclip]": dict(op="step", family=iface.FAMILY_IVON, debias=False,
                                       clip=False),
    "step[poco]": dict(op="step", family=iface.FAMILY_IVON, corr=True),
    "step[poco,independent]": dict(op="step", family=iface.FAMILY_IVON, corr=True,
                                   independent=True),
    "step[poco,mc2]": dict(op="step", family=iface.FAMILY_IVON, corr=True, mc=2),
    "step[poco,next]": dict(op="step", family=iface.FAMILY_IVON, corr=True, next=True),
    "step[poco,low]": dict(op="step", family=iface.FAMILY_IVON, corr=True, low=True),
    "step[poco,amp]": dict(op="step", family=iface.FAMILY_IVON, corr=True, amp=True),
    "step[poco,before-refresh]": dict(op="step", family=iface.FAMILY_IVON, corr=True,
                                      refreshes=0),
    "step[poco,skipped]": dict(op="step", family=iface.FAMILY_IVON, corr=True, next=True,
                               skip=True),
    "step[sgd]": dict(op="step", family=iface.FAMILY_SGD, corr=True, momentum=True,
                      nesterov=True),
    "step[sgd,first]": dict(op="step", family=iface.FAMILY_SGD, momentum=True, mom_first=True),
    "step[adamw]": dict(op="step", family=iface.FAMILY_ADAMW, corr=True),
    "step[adamw,beta1<0.5]": dict(op="step", family=iface.FAMILY_ADAMW, beta1=0.3),
    "refresh[ivon]": dict(op="refresh", family=iface.FAMILY_IVON),
    "refresh[ivon,first]": dict(op="refresh", family=iface.FAMILY_IVON, refreshes=0),
    "refresh[ivon,ge]": dict(op="refresh", family=iface.FAMILY_IVON, ge=True),
    "refresh[ivon,low]": dict(op="refresh", family=iface.FAMILY_IVON, low=True),
    "refresh[sgd]": dict(op="refresh", family=iface.FAMILY_SGD, noisy=True),
}


def _opt(case: str, key: str, default=False):
    return CASES[case].get(key, default)


def make_inputs(case: str, n: int, pdtype: torch.dtype = torch.float32, seed: int = 0,
                device="cpu", hp: Optional[dict] = None) -> dict:
    """Fresh random inputs of ``case`` over ``n`` elements (parameters of ``pdtype``), on
    the CPU, with the hyperparameters ``hp`` (default :data:`HP`) and the counters."""
    c = CASES[case]
    g = torch.Generator().manual_seed(seed)

    def r(scale=1.0):
        return torch.randn(n, generator=g, dtype=torch.float32) * scale

    hp = dict(HP, **(hp or {}))
    if "beta1" in c:
        hp["beta1"] = c["beta1"]
    low = c.get("low", False)
    lowt = (lambda t: t.to(torch.bfloat16)) if low else (lambda t: t)
    x = dict(hp=hp, n=n, pdtype=pdtype, steps=6, refreshes=c.get("refreshes", 3),
             mc=c.get("mc", 1), device=device)
    x["stream"], x["stream_at_out"] = K_stream(2, 0), K_stream(2, 1 if c.get("independent") else 0)
    x["param"] = r().to(pdtype)
    x["mean"] = r()
    x["h"] = r(0.3).abs() + 0.05
    x["sigma_buf"] = lowt(r(0.1).abs() + 1e-3)
    x["centre"] = lowt(r())
    x["momentum"] = lowt(r(0.1))
    x["exp_avg"], x["exp_avg_sq"] = r(0.1), r(0.1).square()
    x["buf"] = r(0.1)
    x["acc_g"], x["acc_ge"] = r(), r()
    x["grad"] = r().to(pdtype)
    x["g_in"] = sum(r() for _ in range(x["mc"]))
    x["ge_in"] = sum(r() for _ in range(x["mc"])) if x["mc"] > 1 else None
    x["g_at_out"] = sum(r() for _ in range(x["mc"]))
    x["ge_at_out"] = sum(r() for _ in range(x["mc"])) if x["mc"] > 1 else None
    x["g_out"], x["h_out"] = lowt(r()), lowt(r(50.0))
    x["m_out"] = lowt(x["mean"] + r(0.05))
    sig = 1.0 / torch.sqrt(hp["ess"] * (x["h"] + r(0.01).abs() + hp["wd"]))
    x["sigma_out"] = lowt(sig)
    x["grad_scale"] = torch.tensor([1024.0]) if c.get("amp") else None
    x["found_inf"] = torch.tensor([1.0 if c.get("skip") else 0.0]) if c.get("amp") or \
        c.get("skip") else None
    return x


def K_stream(kind: int, draw: int) -> int:
    """A stream id of bucket 3 (any bucket: the stream words are the kernels')."""
    from ..noise import stream_id
    return stream_id(3, kind, draw)


def _ctl(x, device):
    return torch.tensor([x["steps"], x["refreshes"], 0, 0], dtype=torch.int64, device=device)


def _step_records(case: str, x: dict):
    c, hp = CASES[case], x["hp"]
    fam, corr = c["family"], c.get("corr", False)
    mc = x["mc"]
    if fam == iface.FAMILY_IVON:
        lr = hp["lr"] * (hp["hess_init"] + hp["wd"])
        shp = iface.StepHyper.ivon(lr=lr, beta1=hp["beta1"], beta2=hp["beta2"], wd=hp["wd"],
                                   ess=hp["ess"], alpha=hp["alpha"] if corr else 0.0,
                                   hess_corr=hp["hess_corr"] if corr else 0.0,
                                   floor=hp["floor"] if corr else 0.0,
                                   clip=hp["clip"] if c.get("clip", True) else 0.0)
        path = iface.StepFlags.ivon(hess_corr=corr, floor=corr, clip=c.get("clip", True),
                                    debias=c.get("debias", True))
    elif fam == iface.FAMILY_SGD:
        shp = iface.StepHyper.sgd(lr=hp["lr"], wd=hp["wd"], alpha=hp["alpha"] if corr else 0.0,
                                  momentum=hp["momentum"], dampening=hp["dampening"],
                                  mom_first=1.0 if c.get("mom_first") else 0.0)
        path = iface.StepFlags.sgd(momentum=c.get("momentum", False),
                                   nesterov=c.get("nesterov"))
    else:
        shp = iface.StepHyper.adamw(lr=hp["lr"], beta1=hp["beta1"], beta2=0.999, wd=hp["wd"],
                                    eps=hp["eps"], alpha=hp["alpha"] if corr else 0.0)
        path = iface.StepFlags.adamw()
    flags = path.routed(corr=corr, ge_in=x["ge_in"] is not None,
                        ge_at_out=corr and x["ge_at_out"] is not None,
                        shared_noise=(fam == iface.FAMILY_IVON and corr and mc == 1
                                      and not c.get("independent")),
                        next_sample=c.get("next", False))
    hyper = shp.counted(sign_at_out=-1.0 if c.get("independent") else 1.0,
                        inv_n_in=1.0 / mc, inv_n_at_out=1.0 / mc if corr else 0.0)
    return hyper, flags


def run(ops, case: str, x: dict) -> Dict[str, Tensor]:
    """Apply ``case``'s operation of the kernel set ``ops`` (``cpp_ops``/``triton_ops``) to
    copies of the inputs ``x`` on ``x["device"]``; its outputs, on the CPU."""
    c, hp, dev = CASES[case], x["hp"], x["device"]
    cp = {k: (v.clone().to(dev) if isinstance(v, Tensor) else v) for k, v in x.items()}
    ctl = _ctl(x, dev)
    op = c["op"]
    if op == "sample":
        out = dict(param=cp["param"], mean=cp["mean"])
        sync = c.get("sync", False)
        ops.sample(cp["param"], cp["param"] if sync else cp["centre"], cp["mean"], cp["h"],
                   cp["sigma_buf"], ctl, SEED, 2, x["stream"], 0,
                   iface.SampleHyper(hp["ess"], hp["wd"], hp["sigma"]), c.get("sign", 1.0),
                   c["mode"], sync)
    elif op == "accumulate":
        out = dict(acc_g=cp["acc_g"], acc_ge=cp["acc_ge"])
        ops.accumulate(cp["grad"], cp["acc_g"], cp["acc_ge"] if c.get("ge") else None, ctl,
                       SEED, 2, x["stream"], 1, c.get("sign", 1.0), c.get("first", False),
                       c.get("ge", False))
    elif op == "fold_ge":
        out = dict(acc_ge=cp["acc_ge"])
        ops.fold_ge(cp["acc_g"], cp["acc_ge"], ctl, SEED, 2, x["stream"], 1, -1.0)
    elif op == "step":
        hyper, flags = _step_records(case, x)
        fam = c["family"]
        s1 = {iface.FAMILY_IVON: "momentum", iface.FAMILY_SGD: "buf",
              iface.FAMILY_ADAMW: "exp_avg"}[fam]
        s2 = {iface.FAMILY_IVON: "h", iface.FAMILY_SGD: None, iface.FAMILY_ADAMW: "exp_avg_sq"}[fam]
        out = dict(mean=cp["mean"], param=cp["param"], s1=cp[s1])
        if s2:
            out["s2"] = cp[s2]
        corr = c.get("corr", False)
        o = (lambda k: cp[k] if corr else None)
        ops.step(cp["mean"], cp["param"], cp[s1] if (fam != iface.FAMILY_SGD or
                                                    c.get("momentum")) else None,
                 cp[s2] if s2 else None, cp["g_in"], cp["ge_in"], o("g_at_out"), o("ge_at_out"),
                 o("g_out"), o("h_out") if fam == iface.FAMILY_IVON else None,
                 o("m_out") if fam == iface.FAMILY_IVON else None,
                 o("sigma_out") if fam == iface.FAMILY_IVON else None, ctl,
                 cp["found_inf"], cp["grad_scale"],
                 iface.StepStreams(SEED, x["stream"], x["stream_at_out"]), hyper, flags)
    else:
        fam = c["family"]
        k = 3
        if fam == iface.FAMILY_IVON:
            out = {n: cp[n] for n in ("g_out", "h_out", "m_out", "sigma_out")}
            rhp = iface.RefreshHyper.ivon(ess=hp["ess"], wd=hp["wd"], rho1=hp["rho1"],
                                          rho2=hp["rho2"])
            ops.refresh(cp["mean"], cp["h"], cp["acc_g"], cp["acc_ge"] if c.get("ge") else None,
                        cp["g_out"], cp["h_out"], cp["m_out"], cp["sigma_out"], ctl, None,
                        None, SEED, 2, x["stream"], rhp.counted(inv_n=1.0 / k),
                        iface.RefreshFlags(fam, ge=c.get("ge", False), noisy=True))
        else:
            out = dict(g_out=cp["g_out"], m_out=cp["m_out"])
            ops.refresh(cp["mean"], None, cp["acc_g"], None, cp["g_out"], None, cp["m_out"],
                        None, ctl, None, None, SEED, 2, x["stream"],
                        iface.RefreshHyper.sgd(sigma=hp["sigma"]).counted(inv_n=1.0 / k),
                        iface.RefreshFlags(fam, ge=False, noisy=True))
    return {k: v.cpu() for k, v in out.items()}


def noise_of(ops, case: str, x: dict) -> Dict[str, Tensor]:
    """The normals ``case``'s operation draws, by the kernel set's own generator: the inner
    (and outer) draw at the step counter, the next step's, the refresh's."""
    dev, n = x["device"], x["n"]

    def eps(counter, stream):
        return ops.randn(torch.empty(n, device=dev), SEED, counter, stream).cpu()

    c = CASES[case]
    if c["op"] in ("sample", "fold_ge", "refresh"):
        counter = {"sample": x["steps"], "fold_ge": x["refreshes"],
                   "refresh": x["refreshes"]}[c["op"]]
        return dict(eps=eps(counter, x["stream"]))
    if c["op"] == "accumulate":
        return dict(eps=eps(x["refreshes"], x["stream"]))
    return dict(eps=eps(x["steps"], x["stream"]), eps_at_out=eps(x["steps"], x["stream_at_out"]),
                eps_next=eps(x["steps"] + 1, x["stream"]))


def model(case: str, x: dict, noise: Dict[str, Tensor]) -> Dict[str, T]:
    """``case``'s outputs as exact values (the reference maths in float64) and bounds
    (:mod:`poco_kernels.kernels.openloop_model`), from the inputs ``x`` and the normals
    ``noise`` of the kernel set that ran it (:func:`noise_of`)."""
    return _model(CASES[case], x, noise)


def compare(out: Dict[str, Tensor], expected: Dict[str, T],
            exact: Optional[Dict[str, Tensor]] = None) -> Dict[str, dict]:
    """Per output: ``ratio`` (the largest ``|out - v| / e``: at most 1 is parity),
    ``ulps`` (the largest error in float32 ulps of the exact value), ``bound_ulps`` (the
    bound in ulps: median and largest), ``n``; ``exact``: outputs that must equal a tensor
    bit for bit (``equal``)."""
    res = {}
    for name, t in expected.items():
        got = out[name]
        ratio = t.check(got)
        ulp = _ulp32(t.v)
        err = (got.double() - t.v).abs() / ulp
        b = t.e / ulp
        res[name] = dict(ratio=_max(ratio), ulps=_max(err), n=int(got.numel()),
                         bound_ulps_median=float(b.median()) if b.numel() else 0.0,
                         bound_ulps_max=_max(b))
    for name, want in (exact or {}).items():
        got = out[name]
        res[name] = dict(equal=bool(torch.equal(got.view(torch.uint8), want.view(torch.uint8))),
                         n=int(got.numel()))
    return res


def _max(t: Tensor) -> float:
    if t.numel() == 0:
        return 0.0
    m = t.max()
    return float(m) if torch.isfinite(m) else math.inf


def _ulp32(v: Tensor) -> Tensor:
    """The float32 ulp at each (float64) value (the smallest subnormal's at zero)."""
    a = v.abs().to(torch.float32).clamp_min(2.0 ** -126)
    e = torch.floor(torch.log2(a.double()))
    return torch.exp2(e - 23.0)


def passed(res: Dict[str, dict]) -> bool:
    return all(r.get("equal", True) and r.get("ratio", 0.0) <= 1.0 for r in res.values())
