"""Tests for poco_kernels.noise: the Triton-compatible randn (exact transform and counter
layout of both stream versions, statistics, stream properties, validation) and
stream_id."""
import math

import numpy as np
import pytest
import torch

from philox_reference import MASK32, ref_randn
from poco_kernels import noise
from poco_kernels.noise import MAX_BUCKETS, MAX_DRAWS, philox4x32, randn, stream_id


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

