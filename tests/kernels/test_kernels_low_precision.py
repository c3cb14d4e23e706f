"""Low precision in the kernels, Triton (under TRITON_INTERPRET=1) and C++: bfloat16
optimizer state (``state_dtype``, ``outer_dtype``) stored with the reference's
stochastic rounding by the step and refresh kernels and read back by the outer sample;
bfloat16 / float16 parameters and gradients converted exactly as torch casts them."""
import pytest
import torch

from helpers import FUSED_BACKENDS
from kernel_parity import (IVON_CASES, NV, SEED, _assert_same_bits, _ctl, _eps, _gen,
                           _ivon_expected, _ivon_group, _run_ivon_step, _step_args)
from kernel_parity import ops  # noqa: F401
from poco_kernels import noise
from poco_kernels import reference as R
from poco_kernels.ivon import ivon_refresh_update
from poco_kernels.kernels import interface as K
from tolerances import LOW_STATE_EQUAL, PARAM, STATE, assert_close

pytestmark = pytest.mark.skipif(not FUSED_BACKENDS, reason="no kernels to test here")


# --------------------------------------------------------------------------- low-precision state
def _assert_low_state(got, exact, bits, what):
    """``got`` (bfloat16, a kernel's) against the reference's stochastic rounding of the
    float32 ``exact`` with ``bits``: within STATE[bf16], and bit-equal almost everywhere
    (other rounding bits would disagree on about half the elements)."""
    assert got.dtype == torch.bfloat16, what
    exp = R.stochastic_round(exact, bits)
    assert_close(got, exp, STATE[torch.bfloat16], what)
    same = (got.view(torch.int16) == exp.view(torch.int16)).float().mean().item()
    assert same >= LOW_STATE_EQUAL, f"{what}: only {same:.3f} of the elements bit-equal"
    # guard: not round-to-nearest (the rounding is stochastic)
    assert not torch.equal(got, exact.to(torch.bfloat16)), what


#: the buffers each way of keeping state in bfloat16 stores so: ``state_dtype`` and
#: ``outer_dtype`` (the outer estimates alone, the rest float32)
LOW_BUFFERS = {"state": ("momentum", "g_out", "h_out", "m_out", "sigma_out"),
               "outer": ("g_out", "h_out")}


@pytest.mark.parametrize("pdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case,low", [("ivon", "state"), ("poco-shared", "state"),
                                      ("poco-shared", "outer")])
def test_step_kernel_low_precision_state(pdtype, case, low, ops):
    """state_dtype=bfloat16: momentum and outer buffers read as bfloat16, the new momentum
    stored with the reference's stochastic rounding (bits of the step counter, the
    bucket in the inner stream, tag 0); mean and h as with float32 state.  outer_dtype:
    g_out and h_out read as bfloat16, the rest float32."""
    n = 2125
    a = _step_args(IVON_CASES[case], _ivon_group(), n, pdtype, seed=n * 11 + len(case))
    a["mean_n"] = n
    lows = LOW_BUFFERS[low]
    if "momentum" in lows:
        a["st"]["momentum"] = a["st"]["momentum"].to(torch.bfloat16)
    if a["outer"] is not None:
        for k in (k for k in lows if k != "momentum"):
            a["outer"][k] = a["outer"][k].to(torch.bfloat16)
    wide = dict(a, st={k: (v.float() if k == "momentum" else v.clone())
                       for k, v in a["st"].items()},
                outer=None if a["outer"] is None else {
                    k: (v.float() if v is not None else None) for k, v in a["outer"].items()})
    exp = _ivon_expected(wide)
    _run_ivon_step(ops, a)
    for k in ("mean", "h") + (() if "momentum" in lows else ("momentum",)):
        assert a["st"][k].dtype == torch.float32, k
        assert_close(a["st"][k], exp[k], STATE[torch.float32], f"{case}: {k}")
    if "momentum" in lows:
        bits = noise.rounding_bits(SEED, a["steps"], 2, noise.ROUND_TAGS["momentum"], n)
        _assert_low_state(a["st"]["momentum"], exp["momentum"], bits, f"{case}: momentum")
    assert_close(a["st"]["param"], exp["mean"].to(pdtype), PARAM[pdtype], f"{case}: param")


@pytest.mark.parametrize("low", ["state", "outer"])
def test_refresh_and_outer_sample_kernels_low_precision_state(low, ops):
    """The refresh writes its bfloat16 buffers (g_out, h_out, m_out, sigma_out with
    state_dtype; g_out, h_out with outer_dtype) with stochastic rounding (tags 1-4, the
    refresh counter), the others as float32; the outer sample reads the centre and sigma
    as they are stored."""
    n, refreshes = 2125, 3
    r = _gen(n, 4242)
    grp = dict(ess=80.0, weight_decay=1e-3, rho1=0.6, rho2=0.1)
    mean, h = r(), r(0.3).abs() + 0.05
    dt = {k: torch.bfloat16 if k in LOW_BUFFERS[low] else torch.float32
          for k in ("g_out", "h_out", "m_out", "sigma_out")}
    outs = {"g_out": r().to(dt["g_out"]), "h_out": r().to(dt["h_out"]),
            "m_out": torch.zeros(n, dtype=dt["m_out"]),
            "sigma_out": torch.zeros(n, dtype=dt["sigma_out"])}
    acc_g = r()
    stream = noise.stream_id(4, 2, 0)
    before = {k: v.float() for k, v in outs.items()}
    ops.refresh(mean, h, acc_g, None, outs["g_out"], outs["h_out"], outs["m_out"],
                outs["sigma_out"], _ctl(9, refreshes), None, None, SEED, NV, stream,
                K.RefreshHyper.ivon(ess=grp["ess"], wd=grp["weight_decay"],
                                                   rho1=grp["rho1"],
                                                           rho2=grp["rho2"]).counted(inv_n=1.0),
                K.RefreshFlags(K.FAMILY_IVON, ge=False, noisy=True))
    exp = ivon_refresh_update(mean=mean, h=h, gM=acc_g, geM=acc_g * _eps(n, refreshes, stream),
                              g_out=before["g_out"], h_out=before["h_out"], group=grp,
                              first=False)
    for name, t in outs.items():
        if t.dtype == torch.float32:
            assert_close(t, exp[name], STATE[torch.float32], name)
            continue
        bits = noise.rounding_bits(SEED, refreshes, 4, noise.ROUND_TAGS[name], n)
        _assert_low_state(t, exp[name], bits, name)
    param, counter, s_o = torch.empty(n), 7, noise.stream_id(4, 0, 0)
    ops.sample(param, outs["m_out"], torch.empty(n), None, outs["sigma_out"], _ctl(counter),
               SEED, NV, s_o, 0, K.SampleHyper(1.0, 0.0, 0.0), 1.0, K.SIGMA_BUFFER, False)
    expect = R.perturb(outs["m_out"].float(), outs["sigma_out"].float(), _eps(n, counter, s_o))
    assert_close(param, expect, PARAM[torch.float32], "outer sample")


# --------------------------------------------------------------------------- dtype conversions
def test_bfloat16_parameters_round_to_nearest_even_and_keep_nan(ops):
    """The kernels' float32 -> bfloat16 store equals torch's cast bit for bit, specials
    (every NaN payload, infinities, overflow to inf, subnormals) included."""
    n = 4099
    x = torch.randn(n) * torch.logspace(-40, 38, n)
    specials = torch.tensor([0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0x7FC00000, 0x7F800000,
                             0xFF800000, 0x7F7FFFFF, 0x00000001, 0x80000000, 0x3F808000,
                             0x3F818000], dtype=torch.int64).to(torch.int32)
    x[:len(specials)] = specials.view(torch.float32)
    p = torch.empty(n, dtype=torch.bfloat16)
    ops.sample(p, x, x, None, None, _ctl(), SEED, NV, 0, 0, K.SampleHyper(1.0, 0.0, 0.0), 1.0,
               K.SIGMA_NONE, False)
    _assert_same_bits(p, x.to(torch.bfloat16))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # numpy, on purpose
def test_float16_parameters_and_gradients_convert_like_torch(ops):
    """float32 -> float16 stores (round to nearest even, overflow to inf, subnormals, NaN
    stays NaN) and float16 -> float32 loads (all 65536 encodings) equal torch's casts."""
    n = 70001
    x = torch.randn(n) * torch.logspace(-12, 6, n)
    ties = torch.tensor([65504.0, 65519.0, 65520.0, 2.0 ** -24, 3 * 2.0 ** -25, 2.0 ** -25,
                         2.0 ** -14 - 2.0 ** -25, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11,
                         float("inf"), -float("inf"), float("nan"), -0.0, 1e-30])
    x[:len(ties)] = ties
    p = torch.empty(n, dtype=torch.float16)
    ops.sample(p, x, x, None, None, _ctl(), SEED, NV, 0, 0, K.SampleHyper(1.0, 0.0, 0.0), 1.0,
               K.SIGMA_NONE, False)
    _assert_same_bits(p, x.to(torch.float16))
    # loads: every float16 encoding through accumulate (acc_g = g as float32)
    g = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    acc = torch.empty(g.numel())
    ctl = _ctl()
    ops.accumulate(g, acc, None, ctl, SEED, NV, 0, 0, 1.0, True, False)
    _assert_same_bits(acc, g.float())
    assert int(ctl[K.CTL_BAD]) == 1        # the encodings include inf and NaN
