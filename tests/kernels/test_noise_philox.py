"""Tests for poco_kernels.noise: Philox4x32-10 against the Random123 known answers and an
independent reference, its broadcasting, chunking and validation."""
import random

import pytest
import torch

from philox_reference import MASK32, ref_philox
from poco_kernels import noise
from poco_kernels.noise import philox4x32


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

