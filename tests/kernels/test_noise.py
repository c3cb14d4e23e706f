"""Tests for poco_kernels.noise: Philox4x32-10 + Triton-compatible randn."""

import math
import random

import numpy as np
import pytest
import torch

from poco_kernels import noise
from poco_kernels.noise import MAX_BUCKETS, MAX_DRAWS, philox4x32, randn, stream_id

MASK32 = 0xFFFFFFFF


# ---------------------------------------------------------------------------
# Independent reference: Philox4x32-10 in plain Python ints, written in the
# Random123 style (mulhilo on full-width Python ints, key bump between rounds)
# rather than mirroring the module's code.
# ---------------------------------------------------------------------------
def ref_philox(ctr, key, rounds=10):
    m0, m1 = 0xD2511F53, 0xCD9E8D57  # PHILOX_M4x32_0, PHILOX_M4x32_1
    w0, w1 = 0x9E3779B9, 0xBB67AE85  # PHILOX_W32_0, PHILOX_W32_1
    x = list(ctr)
    k = list(key)
    for r in range(rounds):
        if r:  # Random123 bumps the key before every round but the first
            k = [(k[0] + w0) & MASK32, (k[1] + w1) & MASK32]
        p0 = m0 * x[0]
        p1 = m1 * x[2]
        x = [(p1 >> 32) ^ x[1] ^ k[0], p1 & MASK32, (p0 >> 32) ^ x[3] ^ k[1], p0 & MASK32]
    return tuple(x)


def ref_randn(seed, index, step, stream, version=2):
    """Element ``index`` of a stream on the reference Philox, with numpy float32 math:
    version 2 lane ``index % 4`` of call ``index // 4`` (``tl.randn4x``), version 1 the
    cosine branch of call ``index`` (``tl.randn``)."""
    call, lane = (index >> 2, index & 3) if version == 2 else (index, 0)
    o = ref_philox((call & MASK32, call >> 32, step, stream), (seed & MASK32, seed >> 32))

    def uniform(w):
        x = w - 2**32 if w >= 2**31 else w  # bitcast to int32
        x = -x - 1 if x < 0 else x
        return np.float32(x) * np.float32(4.6566127342e-10)

    pair = 2 * (lane >> 1)            # words (0, 1) for lanes 0, 1; (2, 3) for lanes 2, 3
    u1 = max(np.float32(1e-7), uniform(o[pair]))
    th = np.float32(6.283185307179586) * uniform(o[pair + 1])
    r = np.sqrt(np.float32(-2.0) * np.log(u1))
    return float(r * (np.sin(th) if lane & 1 else np.cos(th)))


def words(t):
    return tuple(int(v) for v in t)


# ---------------------------------------------------------------------------
# Philox known answers (Random123 kat_vectors, philox4x32_10)
# ---------------------------------------------------------------------------
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (
        (0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF),
        (0xFFFFFFFF, 0xFFFFFFFF),
        (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD),
    ),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("ctr,key,expected", KAT)
def test_reference_philox_matches_kat(ctr, key, expected):
    assert ref_philox(ctr, key) == expected


@pytest.mark.parametrize("ctr,key,expected", KAT)
def test_philox_kat_int_counters(ctr, key, expected):
    seed = key[0] | key[1] << 32
    out = philox4x32(seed, *ctr)
    assert all(o.dtype == torch.int64 and o.shape == () for o in out)
    assert words(out) == expected


@pytest.mark.parametrize("ctr,key,expected", KAT)
def test_philox_kat_tensor_counters(ctr, key, expected):
    seed = key[0] | key[1] << 32
    out = philox4x32(seed, *(torch.tensor([c, c]) for c in ctr))
    for o, e in zip(out, expected):
        assert o.tolist() == [e, e]


def test_philox_matches_reference_on_random_inputs():
    rng = random.Random(1234)
    for _ in range(20):
        seed = rng.getrandbits(64)
        ctrs = [[rng.getrandbits(32) for _ in range(50)] for _ in range(4)]
        out = philox4x32(seed, *(torch.tensor(c, dtype=torch.int64) for c in ctrs))
        for j in range(50):
            exp = ref_philox([c[j] for c in ctrs], (seed & MASK32, seed >> 32))
            assert tuple(int(o[j]) for o in out) == exp


def test_philox_broadcast_mixed_ints_and_tensors():
    seed = 0x0123456789ABCDEF
    c0 = torch.arange(5).reshape(5, 1) * 0x10001
    c1 = torch.tensor([[0, 7, 0xFFFFFFFF]])
    out = philox4x32(seed, c0, c1, 42, 0x80000000)
    assert all(o.shape == (5, 3) for o in out)
    for a in range(5):
        for b in range(3):
            exp = ref_philox((int(c0[a, 0]), int(c1[0, b]), 42, 0x80000000), (seed & MASK32, seed >> 32))
            assert tuple(int(o[a, b]) for o in out) == exp


def test_philox_int32_tensors_are_bitcast():
    c = torch.tensor([-1, -(2**31), 5], dtype=torch.int32)
    out = philox4x32(7, c, 0, 0, 0)
    for j, u in enumerate([0xFFFFFFFF, 0x80000000, 5]):
        assert tuple(int(o[j]) for o in out) == ref_philox((u, 0, 0, 0), (7, 0))


def test_philox_chunking(monkeypatch):
    seed = 99
    c0 = torch.arange(1000)
    full = philox4x32(seed, c0, 1, 2, 3)
    monkeypatch.setattr(noise, "_CHUNK", 64)
    chunked = philox4x32(seed, c0, 1, 2, 3)
    for a, b in zip(full, chunked):
        assert torch.equal(a, b)


def test_philox_does_not_modify_inputs():
    cs = [torch.arange(300) * (j + 3) for j in range(4)]
    before = [c.clone() for c in cs]
    philox4x32(5, *cs)
    for c, b in zip(cs, before):
        assert torch.equal(c, b)


def test_philox_validation():
    with pytest.raises(ValueError, match="seed"):
        philox4x32(-1, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="seed"):
        philox4x32(2**64, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="c2"):
        philox4x32(0, 0, 0, 2**32, 0)
    with pytest.raises(ValueError, match="c0"):
        philox4x32(0, torch.zeros(3), 0, 0, 0)


# ---------------------------------------------------------------------------
# randn: exact transform and counter layout
# ---------------------------------------------------------------------------
def test_uniform_mapping_edges():
    # uint32 words at the edges of the int32 fold; all must land in [0, 1).
    w = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1])
    u = noise._uint_to_uniform_float(w)
    scale = np.float32(4.6566127342e-10)
    exp = [0.0, scale * 1, scale * np.float32(2**31 - 1), scale * np.float32(2**31 - 1), scale * 1, 0.0]
    assert u.dtype == torch.float32
    assert u.tolist() == [float(np.float32(e)) for e in exp]
    assert float(u.max()) < 1.0


@pytest.mark.parametrize(
    "seed,step,stream,offset",
    [
        (0, 0, 0, 0),
        (2**64 - 1, 2**32 - 1, 2**32 - 1, 0),
        (0x243F6A8885A308D3, 17, 0x12345, 2**32 - 20),  # crosses c1 = 0 -> 1
        (123, 5, 1, 2**40 + 3),
        (123, 5, 1, 2**64 - 40),  # last indices of the stream
    ],
)
@pytest.mark.parametrize("version", noise.STREAM_VERSIONS)
def test_randn_matches_reference(seed, step, stream, offset, version):
    n = 40
    got = randn(n, seed, step, stream, offset=offset, version=version)
    exp = torch.tensor([ref_randn(seed, offset + j, step, stream, version) for j in range(n)])
    torch.testing.assert_close(got, exp, atol=2e-6, rtol=1e-6)


def test_randn_counter_layout_via_philox():
    # version 1: element i is the cosine branch of philox(seed, i & 0xffffffff, i >> 32, ...)
    seed, step, stream, offset = 77, 3, stream_id(2, 1, 5), 2**33 - 7
    n = 16
    idx = torch.arange(n) + offset
    o0, o1, _, _ = philox4x32(seed, idx & MASK32, idx >> 32, step, stream)
    u1 = noise._uint_to_uniform_float(o0).clamp_min(1e-7)
    u2 = noise._uint_to_uniform_float(o1)
    exp = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(6.283185307179586 * u2)
    assert torch.equal(randn(n, seed, step, stream, offset=offset, version=1), exp)


def test_randn_v2_layout_via_philox():
    # version 2: elements 4q .. 4q + 3 are (r0 cos th1, r0 sin th1, r2 cos th3, r2 sin th3)
    # of the words of philox(seed, q & 0xffffffff, q >> 32, ...)
    seed, step, stream, q0 = 77, 3, stream_id(2, 1, 5), 2**33 - 3
    q = torch.arange(8) + q0
    w = [noise._uint_to_uniform_float(x) for x in philox4x32(seed, q & MASK32, q >> 32, step,
                                                             stream)]
    r0, r2 = (torch.sqrt(-2.0 * torch.log(u.clamp_min(1e-7))) for u in (w[0], w[2]))
    th1, th3 = (6.283185307179586 * u for u in (w[1], w[3]))
    exp = torch.stack([r0 * torch.cos(th1), r0 * torch.sin(th1), r2 * torch.cos(th3),
                       r2 * torch.sin(th3)], dim=1).reshape(-1)
    got = randn(32, seed, step, stream, offset=4 * q0)
    torch.testing.assert_close(got, exp, atol=1e-6, rtol=0)
    # an offset that is not a multiple of 4 starts inside a call
    torch.testing.assert_close(randn(29, seed, step, stream, offset=4 * q0 + 3), exp[3:],
                               atol=1e-6, rtol=0)


def test_randn_versions_differ_and_default_is_current():
    a = randn(1000, 5, 1, 2)
    assert torch.equal(a, randn(1000, 5, 1, 2, version=noise.STREAM_VERSION))
    assert noise.STREAM_VERSION == 2 and noise.STREAM_VERSIONS == (1, 2)
    assert (a == randn(1000, 5, 1, 2, version=1)).sum() < 5
    for bad in (0, 3, True, "2"):
        with pytest.raises(ValueError, match="version"):
            randn(10, 5, 1, 2, version=bad)


# ---------------------------------------------------------------------------
# randn: statistics and stream properties
# ---------------------------------------------------------------------------
N_STAT = 1_000_000
SIGMAS = 6.0


def test_randn_distribution():
    x = randn(N_STAT, seed=2024, step=1, stream=0).double()
    assert x.dtype == torch.float64 and x.shape == (N_STAT,)
    assert torch.isfinite(x).all()
    n = x.numel()
    # mean: standard error 1/sqrt(n)
    assert abs(x.mean().item()) < SIGMAS / math.sqrt(n)
    # variance: standard error of the sample variance of N(0,1) is sqrt(2/n)
    assert abs(x.var().item() - 1.0) < SIGMAS * math.sqrt(2.0 / n)
    # tails: P(|x| > 2) = 0.04550026, binomial standard error
    p = 0.04550026389635842
    frac = (x.abs() > 2).double().mean().item()
    assert abs(frac - p) < SIGMAS * math.sqrt(p * (1 - p) / n)
    # Box-Muller with u1 >= 1e-7 bounds |x| by sqrt(-2 log 1e-7) ~ 5.68
    assert x.abs().max().item() < 5.7


def test_streams_are_uncorrelated():
    n = N_STAT // 4
    base = randn(n, 5, 0, 0).double()
    for other in (randn(n, 5, 1, 0), randn(n, 5, 0, 1), randn(n, 6, 0, 0), randn(n, 5, 0, 0, offset=n)):
        corr = torch.corrcoef(torch.stack([base, other.double()]))[0, 1].item()
        assert abs(corr) < SIGMAS / math.sqrt(n)


def test_different_arguments_give_different_values():
    n = 1000
    base = randn(n, 1, 0, 0)
    variants = [
        randn(n, 2, 0, 0),  # seed, low word
        randn(n, 1 + 2**32, 0, 0),  # seed, high word
        randn(n, 1, 1, 0),  # step
        randn(n, 1, 0, 1),  # stream
        randn(n, 1, 0, stream_id(1, 0, 0)),
        randn(n, 1, 0, stream_id(0, 1, 0)),
    ]
    for v in variants:
        # unrelated streams: essentially no element coincides
        assert (v == base).sum().item() < 5
    for a in range(len(variants)):
        for b in range(a + 1, len(variants)):
            assert not torch.equal(variants[a], variants[b])


def test_same_arguments_identical_bits():
    a = randn(12345, 0xDEADBEEFCAFEF00D, 99, 1234, offset=77)
    b = randn(12345, 0xDEADBEEFCAFEF00D, 99, 1234, offset=77)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_randn_does_not_touch_global_rng():
    torch.manual_seed(0)
    state = torch.get_rng_state()
    randn(100, 1, 2, 3)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("k", [0, 1, 999, noise._CHUNK - 1, noise._CHUNK + 3])
def test_offset_slicing_consistent(k):
    n = 2000
    assert torch.equal(randn(n, 11, 2, 3, offset=k), randn(n + k, 11, 2, 3)[k:])


def test_chunking_does_not_change_values(monkeypatch):
    offset = 2**32 - 100  # a chunk straddles the c1 carry
    full = randn(1000, 3, 4, 5, offset=offset)
    monkeypatch.setattr(noise, "_CHUNK", 64)
    assert torch.equal(randn(1000, 3, 4, 5, offset=offset), full)
    assert torch.equal(randn(900, 3, 4, 5, offset=offset + 100), full[100:])


def test_indices_above_2_pow_32():
    hi = randn(100, 8, 0, 0, offset=2**32 + 5)
    lo = randn(100, 8, 0, 0, offset=5)
    assert torch.isfinite(hi).all()
    assert (hi == lo).sum().item() < 5
    # contiguous across the 2**32 boundary
    span = randn(20, 8, 0, 0, offset=2**32 - 10)
    assert torch.equal(span[15:], randn(5, 8, 0, 0, offset=2**32 + 5)[:5])


def test_zero_numel():
    assert randn(0, 1, 2, 3).shape == (0,)


def test_dtype_and_out():
    ref = randn(1000, 4, 5, 6)
    assert ref.dtype == torch.float32
    for dt in (torch.float64, torch.float16, torch.bfloat16):
        got = randn(1000, 4, 5, 6, dtype=dt)
        assert got.dtype == dt
        assert torch.equal(got, ref.to(dt))
        buf = torch.full((1000,), float("nan"), dtype=dt)
        res = randn(1000, 4, 5, 6, out=buf)
        assert res is buf
        assert torch.equal(buf, ref.to(dt))


def test_out_validation():
    with pytest.raises(ValueError):
        randn(10, 1, 0, 0, out=torch.empty(11))
    with pytest.raises(ValueError):
        randn(10, 1, 0, 0, out=torch.empty(2, 5))
    with pytest.raises(ValueError):
        randn(10, 1, 0, 0, out=torch.empty(20)[::2])
    with pytest.raises(ValueError):
        randn(10, 1, 0, 0, out=torch.empty(10, dtype=torch.int32))
    with pytest.raises(ValueError):
        randn(10, 1, 0, 0, dtype=torch.int64)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(seed=-1), "seed"),
        (dict(seed=2**64), "seed"),
        (dict(seed=1.5), "seed"),
        (dict(step=-1), "step"),
        (dict(step=2**32), "step"),
        (dict(stream=2**32), "stream"),
        (dict(stream=-3), "stream"),
        (dict(offset=-1), "offset"),
        (dict(offset=2**64 - 5), "offset"),  # offset + numel > 2**64
        (dict(numel=-1), "numel"),
    ],
)
def test_randn_validation(kwargs, match):
    args = dict(numel=10, seed=1, step=0, stream=0)
    args.update(kwargs)
    numel = args.pop("numel")
    with pytest.raises(ValueError, match=match):
        randn(numel, **args)


def test_seed_step_bounds_accepted():
    x = randn(10, 2**64 - 1, 2**32 - 1, 2**32 - 1)
    assert torch.isfinite(x).all()
    # numpy integers are accepted like Python ints
    assert torch.equal(randn(10, np.uint64(5), np.int64(3), 2), randn(10, 5, 3, 2))


# ---------------------------------------------------------------------------
# stream_id
# ---------------------------------------------------------------------------
def test_stream_id_packing():
    assert MAX_BUCKETS == 2**16 and MAX_DRAWS == 2**12
    assert stream_id(0, 0, 0) == 0
    assert stream_id(1, 2, 3) == (1 << 16) | (2 << 12) | 3
    assert stream_id(MAX_BUCKETS - 1, 15, MAX_DRAWS - 1) == 0xFFFFFFFF
    # fields do not overlap: all ids distinct on a sample grid
    ids = {stream_id(b, k, d) for b in (0, 1, 255, 65535) for k in (0, 1, 15) for d in (0, 1, 4095)}
    assert len(ids) == 4 * 3 * 3


@pytest.mark.parametrize(
    "args",
    [(MAX_BUCKETS, 0, 0), (0, 16, 0), (0, 0, MAX_DRAWS), (-1, 0, 0), (0, -1, 0), (0, 0, -1)],
)
def test_stream_id_validation(args):
    with pytest.raises(ValueError):
        stream_id(*args)


# ---------------------------------------------------------------------------
# Triton compatibility (interpreter mode, runs on CPU)
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def triton_kernels():
    """Triton kernels built under TRITON_INTERPRET=1; skipped without triton.

    The variable is set before triton is imported (and while the kernels are
    defined and launched) and restored when this module's tests are done, so
    other test modules are unaffected.
    """
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        try:
            import triton
            import triton.language as tl
        except Exception as exc:  # ImportError, or a broken install
            pytest.skip(f"triton not available ({type(exc).__name__}: {exc})")

        @triton.jit
        def tl_randn_kernel(out_ptr, seed, base, n, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            x = tl.randn(seed, offs + base)  # base: int32 -> int32 offsets, int64 -> int64
            tl.store(out_ptr + offs, x, mask=offs < n)

        @triton.jit
        def tl_philox_kernel(
            c0_ptr, c1_ptr, c2_ptr, c3_ptr, words_ptr, uniform_ptr, normal_ptr, seed, n, BLOCK: tl.constexpr
        ):
            offs = tl.arange(0, BLOCK)
            mask = offs < n
            # int32 counters: tl.philox bitcasts them to uint32
            c0 = tl.load(c0_ptr + offs, mask=mask)
            c1 = tl.load(c1_ptr + offs, mask=mask)
            c2 = tl.load(c2_ptr + offs, mask=mask)
            c3 = tl.load(c3_ptr + offs, mask=mask)
            o0, o1, o2, o3 = tl.philox(seed, c0, c1, c2, c3)
            tl.store(words_ptr + 0 * n + offs, o0.to(tl.int32, bitcast=True), mask=mask)
            tl.store(words_ptr + 1 * n + offs, o1.to(tl.int32, bitcast=True), mask=mask)
            tl.store(words_ptr + 2 * n + offs, o2.to(tl.int32, bitcast=True), mask=mask)
            tl.store(words_ptr + 3 * n + offs, o3.to(tl.int32, bitcast=True), mask=mask)
            # tl.randn's transform, applied to the first two words
            u1 = tl.random.uint_to_uniform_float(o0)
            u2 = tl.random.uint_to_uniform_float(o1)
            tl.store(uniform_ptr + 0 * n + offs, u1, mask=mask)
            tl.store(uniform_ptr + 1 * n + offs, u2, mask=mask)
            x, _ = tl.random.pair_uniform_to_normal(u1, u2)
            tl.store(normal_ptr + offs, x, mask=mask)

        @triton.jit
        def tl_randn4x_kernel(out_ptr, seed, base, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            n1, n2, n3, n4 = tl.randn4x(seed, offs + base)      # calls base .. base + BLOCK - 1
            tl.store(out_ptr + 4 * offs, n1)
            tl.store(out_ptr + 4 * offs + 1, n2)
            tl.store(out_ptr + 4 * offs + 2, n3)
            tl.store(out_ptr + 4 * offs + 3, n4)

        global triton_noise         # (the interpreter runs a kernel on its module's globals)
        from poco_kernels.kernels import triton_noise

        @triton.jit
        def host_philox_kernel(c0_ptr, c1_ptr, c2_ptr, c3_ptr, words_ptr, seed, n,
                               BLOCK: tl.constexpr):
            # the kernels' Philox, which the interpreter runs in numpy (HOST_PHILOX)
            offs = tl.arange(0, BLOCK)
            mask = offs < n
            c = [tl.load(ptr + offs, mask=mask).to(tl.uint32, bitcast=True)
                 for ptr in (c0_ptr, c1_ptr, c2_ptr, c3_ptr)]
            o0, o1, o2, o3 = triton_noise._philox(seed, c[0], c[1], c[2], c[3])
            tl.store(words_ptr + 0 * n + offs, o0.to(tl.int32, bitcast=True), mask=mask)
            tl.store(words_ptr + 1 * n + offs, o1.to(tl.int32, bitcast=True), mask=mask)
            tl.store(words_ptr + 2 * n + offs, o2.to(tl.int32, bitcast=True), mask=mask)
            tl.store(words_ptr + 3 * n + offs, o3.to(tl.int32, bitcast=True), mask=mask)

        tl_philox_kernel.host = host_philox_kernel
        yield tl_randn_kernel, tl_philox_kernel, tl_randn4x_kernel


def _as_int32(x):
    """int64 words in [0, 2**32) -> int32 tensor with the same bit pattern."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


@pytest.mark.parametrize("seed", [0, 12345, 0x0123456789ABCDEF])
def test_triton_tl_randn_matches(triton_kernels, seed):
    tl_randn_kernel, _, tl_randn4x_kernel = triton_kernels
    n = 1001
    out = torch.empty(n, dtype=torch.float32)
    tl_randn_kernel[(1,)](out, seed, 0, n, BLOCK=1024)
    torch.testing.assert_close(randn(n, seed, step=0, stream=0, version=1), out, atol=1e-6,
                               rtol=2e-7)
    # version 2: elements 4q .. 4q + 3 are tl.randn4x(seed, q)
    out4 = torch.empty(4 * 256, dtype=torch.float32)
    tl_randn4x_kernel[(1,)](out4, seed, 0, BLOCK=256)
    torch.testing.assert_close(randn(4 * 256, seed, step=0, stream=0), out4, atol=1e-6,
                               rtol=2e-7)


def test_triton_tl_randn_int64_offsets_match(triton_kernels):
    tl_randn_kernel, _, tl_randn4x_kernel = triton_kernels
    n, base, seed = 1001, 2**32 + 5, 42
    out = torch.empty(n, dtype=torch.float32)
    tl_randn_kernel[(1,)](out, seed, base, n, BLOCK=1024)
    torch.testing.assert_close(randn(n, seed, 0, 0, offset=base, version=1), out, atol=1e-6,
                               rtol=2e-7)
    out4 = torch.empty(4 * 256, dtype=torch.float32)
    tl_randn4x_kernel[(1,)](out4, seed, base, BLOCK=256)
    torch.testing.assert_close(randn(4 * 256, seed, 0, 0, offset=4 * base), out4, atol=1e-6,
                               rtol=2e-7)


@pytest.mark.parametrize(
    "seed,step,stream,offset",
    [
        (7, 1, 2, 0),
        (0x9E3779B97F4A7C15, 0xDEADBEEF, stream_id(MAX_BUCKETS - 1, 15, MAX_DRAWS - 1), 2**32 * 3 - 500),
    ],
)
def test_triton_tl_philox_matches(triton_kernels, seed, step, stream, offset):
    """tl.philox, the kernels' Philox as the interpreter runs it (numpy) and ours (torch)
    give the same words; the uniforms are exact, the normals within an ulp."""
    _, tl_philox_kernel, _ = triton_kernels
    n = 1001
    idx = torch.arange(n, dtype=torch.int64) + offset
    counters = [idx & MASK32, idx >> 32, torch.full((n,), step), torch.full((n,), stream)]
    words_out = torch.empty(4 * n, dtype=torch.int32)
    uniform_out = torch.empty(2 * n, dtype=torch.float32)
    normal_out = torch.empty(n, dtype=torch.float32)
    tl_philox_kernel[(1,)](
        *(_as_int32(c) for c in counters), words_out, uniform_out, normal_out, seed, n, BLOCK=1024
    )

    # the interpreter's numpy Philox (the kernels' `_philox` under TRITON_INTERPRET)
    assert triton_noise.HOST_PHILOX
    host_out = torch.empty(4 * n, dtype=torch.int32)
    tl_philox_kernel.host[(1,)](*(_as_int32(c) for c in counters), host_out, seed, n, BLOCK=1024)

    ours = philox4x32(seed, *counters)
    for j in range(4):
        tri = words_out[j * n : (j + 1) * n].to(torch.int64) & MASK32
        assert torch.equal(ours[j], tri), f"philox output word {j} differs"
        host = host_out[j * n : (j + 1) * n].to(torch.int64) & MASK32
        assert torch.equal(host, tri), f"the interpreter's numpy philox: word {j} differs"
    # The integer -> uniform float mapping is exact (bitwise) ...
    assert torch.equal(noise._uint_to_uniform_float(ours[0]), uniform_out[:n])
    assert torch.equal(noise._uint_to_uniform_float(ours[1]), uniform_out[n:])
    # ... and only log/cos/sqrt may differ by an ulp between math libraries (version 1:
    # one call per element index, the counters above)
    torch.testing.assert_close(randn(n, seed, step, stream, offset=offset, version=1), normal_out,
                               atol=1e-6, rtol=2e-7)
