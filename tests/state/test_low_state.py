"""``state_dtype=torch.bfloat16`` (IVON family): the momentum and the outer buffers in
bfloat16 with stochastic rounding; ``outer_dtype=torch.bfloat16`` (IVON-PoCo(Mo)): the
outer estimates alone (docs/design.md, 'Low-precision state').  The kernels against the
reference are in tests/kernels/test_kernels_low_precision.py; here the optimizer: backends
agree, the rounding is unbiased, checkpoints resume bit for bit and convert, and a refused
step changes nothing."""
import copy

import pytest
import torch

import poco_kernels as pk
from helpers import Problem, available_backends, mlp, params_of
from poco_kernels import noise
from poco_kernels import reference as R
from tolerances import TRAJECTORY, assert_close

pytestmark = pytest.mark.usefixtures("one_thread")

BF16 = torch.bfloat16
LOW = ("momentum", "g_out", "h_out", "m_out", "sigma_out")
#: the two ways of keeping state in bfloat16: the options, and the buffers they make
#: bfloat16 (the others stay float32)
MODES = {"state": (dict(state_dtype=BF16), LOW),
         "outer": (dict(state_dtype=None, outer_dtype=BF16), ("g_out", "h_out"))}
BACKENDS = available_backends()


def _make(backend, state_dtype=BF16, cls=pk.IVONPoCoMo, mode=None, **kw):
    m = mlp()
    kw = dict(dict(lr=0.05, ess=200.0, seed=5, backend=backend, state_dtype=state_dtype),
              **(MODES[mode][0] if mode else {}), **kw)
    return m, cls(m.parameters(), **kw)


def _train(m, opt, steps, start=0, prob=None):
    prob = prob or Problem()
    batches = prob.batches(steps)
    for t in range(start, steps):
        if isinstance(opt, pk.IVONPoCo) and t % 3 == 0:
            opt.refresh([prob.closure(opt, m, c) for c in prob.chunks(2)])
        opt.step(prob.closure(opt, m, batches[t]))
    return m, opt


def _flat(opt):
    return {k: [t.clone() for t in opt.flat_state(k)] for k in ("mean", "h") + LOW
            if k in opt._buckets[0].buffers}


def test_stochastic_rounding_is_unbiased_and_brackets():
    """Each result is one of the two bfloat16 neighbours of the value; the mean over many
    draws is the value (round to nearest is off by the remainder: the guard)."""
    x = torch.tensor([1.0 + 2 ** -10, -3.3, 7.1e-5, 1234.567])
    n = 1 << 16
    vals = x.repeat_interleave(n)
    out = R.stochastic_round(vals, noise.rounding_bits(11, 2, 0, 0, vals.numel())).float()
    for i, v in enumerate(x.tolist()):
        got = out[i * n:(i + 1) * n]
        toward0 = torch.tensor(v).view(torch.int32) & ~0xFFFF
        below = toward0.view(torch.float32).item()
        above = (toward0 + 0x10000).view(torch.float32).item()
        assert set(got.unique().tolist()) == {below, above}, v
        ulp = abs(above - below)
        assert abs(got.mean().item() - v) < 0.01 * ulp, (v, got.mean().item())
        nearest = torch.tensor(v).to(BF16).item()
        assert abs(nearest - v) > 0.05 * ulp, v


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_agree_and_stay_near_float32_state(backend, mode):
    """Every backend follows the torch backend's trajectory with bfloat16 state (the same
    rounding bits), and the run stays near the float32-state run."""
    m_ref, o_ref = _train(*_make("torch", mode=mode), 7)
    m, o = _train(*_make(backend, mode=mode), 7)
    for a, b in zip(params_of(m), params_of(m_ref)):
        assert_close(a, b, TRAJECTORY[torch.float32], "parameters")
    for k in LOW:
        want = BF16 if k in MODES[mode][1] else torch.float32
        for a, b in zip(o.flat_state(k), o_ref.flat_state(k)):
            assert a.dtype == want and b.dtype == want, k
            assert_close(a, b, TRAJECTORY[want], k)
    m32, _ = _train(*_make(backend, None), 7)
    diff = max((a - b).abs().max().item() for a, b in zip(params_of(m), params_of(m32)))
    assert 0 < diff < 2e-2, diff


def test_the_bytes_it_holds():
    """opt.state: mean and h float32, the rest bfloat16: IVON 10 bytes per parameter,
    IVON-PoCoMo 18 (float32: 12 and 28; float32 with bfloat16 outer estimates: 24)."""
    outer = {"outer_dtype": BF16}
    for cls, kw, bf16, f32 in ((pk.IVON, {}, 10, 12), (pk.IVONPoCoMo, {}, 18, 28),
                               (pk.IVONPoCoMo, outer, 18, 24)):
        for sd, w in ((BF16, bf16), (None, f32)):
            m, opt = _make("torch", sd, cls=cls, **kw)
            n = sum(p.numel() for p in m.parameters())
            held = sum(t.numel() * t.element_size() for b in opt._buckets
                       for t in b.buffers.values())
            assert held == w * n, (cls.__name__, sd, held / n)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoints_resume_bit_for_bit(backend, mode):
    """A state dict (and a deepcopy) taken mid-run continues exactly as the run."""
    m, o = _train(*_make(backend, mode=mode), 9)
    m2, o2 = _train(*_make(backend, mode=mode), 5)
    sd = copy.deepcopy(o2.state_dict())
    twin = copy.deepcopy((m2, o2))
    m3, o3 = _make(backend, mode=mode)
    m3.load_state_dict(m2.state_dict())
    o3.load_state_dict(sd)
    for mm, oo in ((m2, o2), twin, (m3, o3)):
        _train(mm, oo, 9, start=5)
        assert all(torch.equal(a, b) for a, b in zip(params_of(mm), params_of(m)))
        s, s_ref = _flat(oo), _flat(o)
        for k in s_ref:
            assert all(torch.equal(a, b) for a, b in zip(s[k], s_ref[k])), k
        assert (oo.state_dtype, oo.outer_dtype) == (o.state_dtype, o.outer_dtype)
        assert all(oo.flat_state(k)[0].dtype == BF16 for k in MODES[mode][1])


def test_state_dicts_convert_between_state_dtypes():
    """A float32-state checkpoint loads into a bfloat16-state optimizer (rounded to
    nearest) and back (widened exactly); both go on training."""
    m32, o32 = _train(*_make("cpp" if "cpp" in BACKENDS else "torch", None), 5)
    m, o = _make(o32.backend)
    m.load_state_dict(m32.state_dict())
    o.load_state_dict(o32.state_dict())
    for k in LOW:
        for a, b in zip(o.flat_state(k), o32.flat_state(k)):
            assert a.dtype == BF16 and torch.equal(a, b.to(BF16)), k
    m_back, o_back = _make(o32.backend, None)
    o_back.load_state_dict(o.state_dict())
    for k in LOW:
        for a, b in zip(o_back.flat_state(k), o.flat_state(k)):
            assert a.dtype == torch.float32 and torch.equal(a, b.float()), k
    _train(m, o, 7, start=5)
    assert all(torch.isfinite(p).all() for p in m.parameters())


def test_state_dicts_convert_to_and_from_bfloat16_outer_estimates():
    """Checkpoints of float32 state and of bfloat16 state load into an optimizer with
    bfloat16 outer estimates: each buffer takes its own dtype (rounded to nearest, or
    widened exactly), and the loaded optimizer's own checkpoint goes back the same way."""
    backend = "cpp" if "cpp" in BACKENDS else "torch"
    for src_mode in (None, "state"):
        m_src, o_src = _train(*_make(backend, None, mode=src_mode), 5)
        m, o = _make(backend, mode="outer")
        m.load_state_dict(m_src.state_dict())
        o.load_state_dict(o_src.state_dict())
        for k in LOW:
            want = BF16 if k in MODES["outer"][1] else torch.float32
            for a, b in zip(o.flat_state(k), o_src.flat_state(k)):
                assert a.dtype == want and torch.equal(a, b.to(want)), (src_mode, k)
        m_back, o_back = _make(backend, None, mode=src_mode)
        o_back.load_state_dict(o.state_dict())
        for k in LOW:
            for a, b in zip(o_back.flat_state(k), o.flat_state(k)):
                assert torch.equal(a, b.to(a.dtype)), (src_mode, k)
        _train(m, o, 7, start=5)
        assert all(torch.isfinite(p).all() for p in m.parameters())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_refused_step_changes_nothing(backend, mode):
    """A non-finite gradient raises (``check_finite``, which Triton leaves off by default);
    state (bfloat16 buffers included) and the steps that follow equal those of a twin that
    never saw it."""
    prob = Problem()
    m, o = _train(*_make(backend, mode=mode, check_finite=True), 5)
    twin = copy.deepcopy((m, o))

    def bad():
        o.zero_grad()
        loss = prob.loss(m, prob.batches(9)[5]) * float("nan")
        loss.backward()
        return loss

    with pytest.raises(ValueError, match="non-finite"):
        o.step(bad)
    for k in LOW:
        assert all(torch.equal(a, b) for a, b in zip(o.flat_state(k), twin[1].flat_state(k)))
    _train(m, o, 9, start=5)
    _train(*twin, 9, start=5)
    assert all(torch.equal(a, b) for a, b in zip(params_of(m), params_of(twin[0])))


def test_state_dtype_is_validated_and_carried():
    with pytest.raises(ValueError, match="state_dtype must be"):
        _make("torch", torch.float16)
    with pytest.raises(TypeError, match="state_dtype"):
        pk.SVRG(mlp().parameters(), lr=0.1, state_dtype=BF16)
    m, ivon = _make("torch", cls=pk.IVON)
    assert ivon.state_dtype == BF16
    assert _make("torch", torch.float32)[1].state_dtype is None
    poco = pk.IVONPoCoMo.from_ivon(ivon)
    assert poco.state_dtype == BF16 and poco.state[m[0].weight]["g_out"].dtype == BF16
    assert poco.outer_dtype is None


def test_outer_dtype_is_validated_and_carried():
    for bad in (torch.float16, "bfloat16"):
        with pytest.raises(ValueError, match="outer_dtype must be"):
            _make("torch", None, outer_dtype=bad)
    with pytest.raises(ValueError, match="outer_dtype must be"):      # (bf16 state)
        _make("torch", BF16, outer_dtype=torch.float32)
    with pytest.raises(TypeError, match="outer_dtype"):
        pk.IVON(mlp().parameters(), lr=0.1, outer_dtype=BF16)
    assert _make("torch", None, outer_dtype=torch.float32)[1].outer_dtype is None
    m, ivon = _make("torch", None, cls=pk.IVON)
    poco = pk.IVONPoCoMo.from_ivon(ivon, outer_dtype=BF16)
    assert poco.outer_dtype == BF16 and poco.state_dtype is None
    dt = {k: poco.state[m[0].weight][k].dtype for k in LOW}
    assert dt == {k: BF16 if k in MODES["outer"][1] else torch.float32 for k in LOW}
    twin = copy.deepcopy(poco)
    assert twin.outer_dtype == BF16 and twin.flat_state("g_out")[0].dtype == BF16


def test_a_shard_rounds_as_its_place_in_the_unsharded_bucket():
    """FSDP2 shards (the torch backend): the rounding bits of a shard's elements are
    those of their places in the unsharded bucket, as its noise, so a sharded run takes
    the unsharded run's steps (here one shard from element 40, set as build_buckets
    does)."""
    n, s = 64, 40
    g = torch.Generator().manual_seed(0)
    p0, target = torch.randn(n, generator=g), torch.randn(n, generator=g)

    def run(sharded):
        p = torch.nn.Parameter(p0[s:].clone() if sharded else p0.clone())
        o = pk.IVON([p], lr=0.05, ess=200.0, seed=5, backend="torch", state_dtype=BF16)
        if sharded:
            o._buckets[0].segments = [(0, n - s, s)]
        tgt = target[s:] if sharded else target

        def closure():
            o.zero_grad()
            loss = ((p - tgt) ** 2 * 3).sum()
            loss.backward()
            return loss
        for _ in range(5):
            o.step(closure)
        return p.detach(), o.flat_state("momentum")[0]

    p_full, mom_full = run(False)
    p_shard, mom_shard = run(True)
    assert torch.equal(p_shard, p_full[s:])
    assert torch.equal(mom_shard, mom_full[s:])
    bits = noise.rounding_bits(5, 3, 0, 0, 10, offset=2 ** 32 - 4)      # across 2**32
    whole = torch.cat([noise.rounding_bits(5, 3, 0, 0, 4, offset=2 ** 32 - 4),
                       noise.rounding_bits(5, 3, 0, 0, 6, offset=2 ** 32)])
    assert torch.equal(bits, whole)


def test_a_value_that_overflows_bfloat16_is_refused_on_load():
    m32, o32 = _make("torch", None, cls=pk.IVON)
    sd = o32.state_dict()
    sd["state"][0]["momentum"].view(-1)[0] = 3.4e38
    m, o = _make("torch", cls=pk.IVON)
    before = [t.clone() for t in o.flat_state("momentum")]
    with pytest.raises(ValueError, match="overflows"):
        o.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(o.flat_state("momentum"), before))
