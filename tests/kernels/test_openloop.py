"""Open-loop parity of the fused kernels (:mod:`poco_kernels.kernels.openloop`): every
operation, from one state and one set of gradients, within its running error bound of the
reference maths evaluated in float64, element by element; and the two kernel sets, C++
and Triton (interpreted, with the compiled transform), equal bit for bit.

The bound of an element is what the float32 operations of the kernel on its path can
lose (:mod:`poco_kernels.kernels.bounds`): half an ulp per rounding, propagated.  Where
the inputs do not cancel it is a few ulps of the result (the median is printed per
output); where they do, it grows with the cancellation, as the error does.
"""
import math

import pytest
import torch

from helpers import FUSED_BACKENDS
from poco_kernels import reference as R
from poco_kernels.ivon import ivon_inner_update, ivon_refresh_update
from poco_kernels.kernels import interface as K
from poco_kernels.kernels import ops_for
from poco_kernels.kernels import openloop as OL
from poco_kernels.kernels.bounds import U, Tracked

pytestmark = pytest.mark.skipif(not FUSED_BACKENDS, reason="no kernels to test here")

N = 2125                    # odd: not a multiple of Triton's block (1024) or the C++ tile (128)
PDTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _dtypes(case):
    return [torch.float32] if OL.CASES[case].get("fp32_only") else PDTYPES


def _cases():
    return [(c, d) for c in OL.CASES for d in _dtypes(c)
            # the parameters' dtype only matters where parameters are read or written
            if d == torch.float32 or OL.CASES[c]["op"] in ("sample", "step", "accumulate")]


def _bound_cases():
    """Every case on the C++ kernels; on the Triton interpreter the float32 ones (with
    every dtype where the C++ kernels are not built): the interpreter gives the C++ bits
    (test_triton_and_cpp_kernels_give_the_same_bits), and the GPU check runs every case
    on the compiled kernels."""
    out = []
    for backend in FUSED_BACKENDS:
        for case, pdtype in _cases():
            if backend == "cpp" or pdtype == torch.float32 or "cpp" not in FUSED_BACKENDS:
                out.append((backend, case, pdtype))
    return out


@pytest.mark.parametrize("backend, case, pdtype", _bound_cases(),
                         ids=lambda v: str(v).replace("torch.", ""))
def test_each_operation_is_within_its_bound_of_the_float64_reference(backend, case, pdtype):
    ops = ops_for(backend)
    x = OL.make_inputs(case, N, pdtype, seed=hash((case, str(pdtype))) % 2 ** 31)
    out = OL.run(ops, case, x)
    res = OL.compare(out, OL.model(case, x, OL.noise_of(ops, case, x)))
    print(f"\n{case} {pdtype}: " + "; ".join(
        f"{k}: {r['ratio']:.2f} of the bound (median bound {r['bound_ulps_median']:.2g} ulp)"
        for k, r in res.items()))
    assert OL.passed(res), res


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_a_float32_one_minus_beta2_is_outside_the_bound(backend):
    """The test can fail: a kernel that formed ``1 - beta2`` from a float32 ``beta2`` (a
    relative error of 1.4e-4 at 0.9999, what the Triton kernels did before their constants
    were made in double) is far outside the bound of ``h``."""
    ops = ops_for(backend)
    case = "step[poco]"
    x = OL.make_inputs(case, N, seed=3)
    b32 = float(torch.tensor(x["hp"]["beta2"], dtype=torch.float32))
    out = OL.run(ops, case, dict(x, hp=dict(x["hp"], beta2=b32)))
    res = OL.compare(out, OL.model(case, x, OL.noise_of(ops, case, x)))
    assert not OL.passed(res)
    assert res["s2"]["ratio"] > 10


@pytest.mark.skipif(set(FUSED_BACKENDS) != {"cpp", "triton"}, reason="needs both kernel sets")
@pytest.mark.parametrize("case, pdtype", _cases(), ids=lambda v: str(v).replace("torch.", ""))
def test_triton_and_cpp_kernels_give_the_same_bits(case, pdtype, branch_free):
    """The Triton kernels are op-for-op twins of the C++ kernels (IEEE float32, no fused
    multiply-adds, constants made in double alike): every output equal bit for bit.  A
    compiled Triton kernel computes what the interpreter does (``bench_gpu.py`` checks
    that on a GPU)."""
    x = OL.make_inputs(case, N, pdtype, seed=hash((case, "bits")) % 2 ** 31)
    a, b = OL.run(ops_for("cpp"), case, x), OL.run(ops_for("triton"), case, x)
    for k in a:
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), (case, k)


# --------------------------------------------------------------------------- the models
def _group(hp, **kw):
    g = dict(lr=hp["lr"], ess=hp["ess"], hess_init=hp["hess_init"], beta1=hp["beta1"],
             beta2=hp["beta2"], weight_decay=hp["wd"], clip_radius=hp["clip"], debias=True,
             rescale_lr=True, alpha=hp["alpha"], hess_corr_scale=hp["hess_corr"],
             hess_floor=hp["floor"], rho1=hp["rho1"], rho2=hp["rho2"])
    g.update(kw)
    return g


def _d(t):
    return None if t is None else t.double()


@pytest.mark.parametrize("case", ["step[ivon]", "step[poco]", "step[poco,mc2]",
                                  "step[poco,independent]", "step[poco,next]"])
def test_the_step_models_are_the_reference_maths(case):
    """The values of a bound model are the reference functions' in float64 (the models
    are written in the kernels' order of operations, the same maths)."""
    c = OL.CASES[case]
    x = OL.make_inputs(case, 301, seed=5)
    g = torch.Generator().manual_seed(9)
    noise = {k: torch.randn(301, generator=g) for k in ("eps", "eps_at_out", "eps_next")}
    exp = OL.model(case, x, noise)
    corr, mc = c.get("corr", False), x["mc"]
    g_in = x["g_in"].double() / mc
    ge_in = _d(x["ge_in"]) / mc if x["ge_in"] is not None else g_in * noise["eps"].double()
    outer = None
    if corr:
        g_at_out = x["g_at_out"].double() / mc
        eps_at_out = -noise["eps_at_out"] if c.get("independent") else noise["eps"]
        ge_at_out = (_d(x["ge_at_out"]) / mc if x["ge_at_out"] is not None
                     else g_at_out * eps_at_out.double())
        outer = dict(g_at_out=g_at_out, ge_at_out=ge_at_out, **{k: x[k].double() for k in
                                            ("g_out", "h_out", "m_out", "sigma_out")})
    grp = _group(x["hp"], hess_floor=x["hp"]["floor"] if corr else None,
                 hess_corr_scale=x["hp"]["hess_corr"] if corr else 0.0,
                 alpha=x["hp"]["alpha"] if corr else 0.0)
    ref = ivon_inner_update(mean=x["mean"].double(), h=x["h"].double(),
                            g=x["momentum"].double(), g_in=g_in, ge_in=ge_in, outer=outer,
                            group=grp, step=x["steps"] + 1)
    for name, key in (("mean", "mean"), ("s2", "h"), ("s1", "momentum")):
        torch.testing.assert_close(exp[name].v, ref[key], rtol=1e-12, atol=1e-14)
    if c.get("next"):
        sigma = R.ivon_sigma(ref["h"], grp["ess"], grp["weight_decay"])
        torch.testing.assert_close(exp["param"].v, R.perturb(ref["mean"], sigma,
                                                             noise["eps_next"].double()),
                                   rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("first", [False, True])
def test_the_refresh_model_is_the_reference_maths(first):
    case = "refresh[ivon,first]" if first else "refresh[ivon]"
    x = OL.make_inputs(case, 301, seed=6)
    eps = torch.randn(301, generator=torch.Generator().manual_seed(2))
    exp = OL.model(case, x, dict(eps=eps))
    gM = x["acc_g"].double() / 3
    ref = ivon_refresh_update(mean=x["mean"].double(), h=x["h"].double(), gM=gM,
                              geM=gM * eps.double(), g_out=x["g_out"].double(),
                              h_out=x["h_out"].double(), group=_group(x["hp"]), first=first)
    for name in ("g_out", "h_out", "m_out", "sigma_out"):
        torch.testing.assert_close(exp[name].v, ref[name], rtol=1e-12, atol=1e-14)


def test_the_adamw_and_sgd_models_are_the_reference_maths():
    x = OL.make_inputs("step[adamw]", 301, seed=8)
    exp = OL.model("step[adamw]", x, {})
    hp = x["hp"]
    ghat = R.control_variate(x["g_in"].double(), x["g_at_out"].double(), x["g_out"].double(),
                             hp["alpha"])
    m, ea, eas = R.adamw_step(x["mean"].double(), ghat, x["exp_avg"].double(),
                              x["exp_avg_sq"].double(), step=x["steps"] + 1, lr=hp["lr"],
                              beta1=hp["beta1"], beta2=0.999, eps=hp["eps"],
                              weight_decay=hp["wd"])
    for name, ref in (("mean", m), ("s1", ea), ("s2", eas)):
        torch.testing.assert_close(exp[name].v, ref, rtol=1e-11, atol=1e-14)
    x = OL.make_inputs("step[sgd]", 301, seed=9)
    exp = OL.model("step[sgd]", x, {})
    ghat = R.control_variate(x["g_in"].double(), x["g_at_out"].double(), x["g_out"].double(),
                             hp["alpha"])
    m, buf = R.sgd_step(x["mean"].double(), ghat, x["buf"].double(), lr=hp["lr"],
                        momentum=hp["momentum"], dampening=hp["dampening"],
                        weight_decay=hp["wd"], nesterov=True)
    torch.testing.assert_close(exp["mean"].v, m, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(exp["s1"].v, buf, rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------- the bounds
def test_running_bounds_hold_for_float32_arithmetic_and_are_tight():
    """A float32 evaluation of an expression with cancellation, division and a square
    root is within the bound of its float64 value everywhere, and the bound is not loose
    (the worst element uses a good part of it); a result off by a few bound widths is
    outside."""
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(100_000, generator=g) for _ in range(3))
    got = ((a - b) * c + torch.sqrt(a * a + 1.0)) / (b * b + 0.5)
    ta, tb, tc = Tracked.exact(a), Tracked.exact(b), Tracked.exact(c)
    t = ((ta - tb) * tc + (ta * ta + 1.0).sqrt()) / (tb * tb + 0.5)
    ratio = t.check(got)
    assert float(ratio.max()) <= 1.0
    assert float(ratio.max()) > 0.2
    assert float(t.check(got.double() + 3 * t.e).max()) > 1.0
    # a constant made in double and rounded once: its rounding is exact
    k = Tracked.const(1.0 - 0.9999)
    assert float(k.e) == abs(float(torch.tensor(1.0 - 0.9999, dtype=torch.float32)) - (1 - 0.9999))
    assert float((Tracked.const(1.0) + 1.0).e) <= 2 * U * 2 + 1e-40


def test_a_bound_is_infinite_where_a_divisor_may_vanish():
    t = Tracked.exact(torch.tensor([1.0])) / Tracked(torch.tensor([1e-9]), torch.tensor([2e-9]))
    assert math.isinf(float(t.e))
