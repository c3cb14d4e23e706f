"""The kernels' noise, Triton (under TRITON_INTERPRET=1) and C++, against
:func:`poco_kernels.noise.randn`: int64 element indices far past 2**32, the shard offset
that moves the noise and the stochastic rounding, and the same bits from both kernel
sets."""
import pytest
import torch

from helpers import FUSED_BACKENDS
from kernel_parity import NV, SEED, _assert_same_bits
from kernel_parity import ops  # noqa: F401
from poco_kernels import noise
from poco_kernels.kernels import interface as K
from tolerances import NOISE, assert_close

pytestmark = pytest.mark.skipif(not FUSED_BACKENDS, reason="no kernels to test here")


if "triton" in FUSED_BACKENDS:
    import triton
    import triton.language as tl
    from poco_kernels.kernels import triton_noise as TK

    @triton.jit
    def _triton_noise_probe(out_ptr, pid0, seed, counter, stream, NOISE: tl.constexpr,
                            BLOCK: tl.constexpr):
        """The Triton kernels' ``noise`` of the blocks ``pid0 + program_id`` (element
        indices int64, as in the kernels), written from ``out[0]`` on."""
        pid = tl.program_id(0).to(tl.int64)
        idx = (pid0 + pid) * BLOCK + tl.arange(0, BLOCK)
        x = TK.noise(seed, idx, pid0 + pid, 0, counter, stream, NOISE, 0, BLOCK)
        tl.store(out_ptr + pid * BLOCK + tl.arange(0, BLOCK), x)


def _kernel_noise(ops, n, base, counter, stream, version=NV, branch_free=True):
    """The kernels' normals of element indices base .. base + n - 1 (Triton: with the
    compiled kernels' branch-free transform, or the interpreter's numpy one,
    ``triton_kernels.BRANCH_FREE``)."""
    if ops.__name__.endswith("cpp_ops"):
        return ops.randn(torch.empty(n), SEED, counter, stream, base, version)
    block = 256
    pid0, lead = divmod(base, block)
    nblocks = triton.cdiv(lead + n, block)
    out = torch.empty(nblocks * block)
    saved = TK.BRANCH_FREE
    TK.BRANCH_FREE = tl.constexpr(branch_free)
    try:
        _triton_noise_probe[(nblocks,)](out, pid0, SEED, counter, stream, NOISE=version,
                                        BLOCK=block)
    finally:
        TK.BRANCH_FREE = saved
    return out[lead:lead + n]


@pytest.mark.parametrize("version", noise.STREAM_VERSIONS)
@pytest.mark.parametrize("base", [0, 2 ** 31 - 5, 2 ** 32 - 1500, 3 * 2 ** 32 + 11])
def test_noise_of_element_indices_past_2_to_32(base, version, ops):
    """Element indices are int64 in every kernel: element i gets its stream value for i far
    past 2**31 and 2**32, also where the low word of the index (version 1) or of the
    Philox call (version 2: from 4 * 2**32 - 1502) wraps inside a block or a tile (a buffer that
    large does not fit this machine, so the noise code is driven with a large base
    index).  The C++ operator also starts at offsets that are not multiples of 4."""
    n = 3001
    if version == 2 and base == 2 ** 32 - 1500:
        base = 4 * 2 ** 32 - 1502        # (the call index is what wraps in version 2)
    out = _kernel_noise(ops, n, base, 7, 12345, version)
    exp = noise.randn(n, SEED, 7, 12345, offset=base, version=version)
    assert_close(out, exp, NOISE, f"base {base}")
    if version == 2 and not ops.__name__.endswith("cpp_ops"):   # the interpreter's transform
        assert_close(_kernel_noise(ops, n, base, 7, 12345, 2, branch_free=False), exp, NOISE,
                     f"base {base}, numpy transform")
    # guard: the tolerance tells neighbouring elements, counters and versions apart
    assert not torch.allclose(out[1:], exp[:-1], **NOISE)
    assert not torch.allclose(_kernel_noise(ops, n, base, 8, 12345, version), exp, **NOISE)
    other = noise.randn(n, SEED, 7, 12345, offset=base, version=3 - version)
    assert not torch.allclose(out, other, **NOISE)


@pytest.mark.parametrize("version", noise.STREAM_VERSIONS)
def test_a_shard_offset_moves_the_noise_and_the_rounding(version, ops):
    """The operators' ``offset`` (an FSDP2 shard's place in its bucket): a launch over a
    slice at ``offset`` draws the stream's elements ``offset ..`` (the Triton kernels: 0, a
    multiple of 4 and any other offset are their ``SHARD`` 0, 1 and 2), and the stochastic
    rounding of bfloat16 state uses the same indices: the slice of a whole launch."""
    n, ctl = 1001, torch.zeros(4, dtype=torch.int64)
    g = torch.randn(n + 40, generator=torch.Generator().manual_seed(3))
    whole = torch.empty(n + 40)
    ops.fold_ge(g, whole, ctl, SEED, version, 9, 0, -1.0)
    for off in (0, 4, 7, 2 ** 31, 2 ** 32 - 4, 2 ** 32 + 3):
        out = torch.empty(n)
        ops.fold_ge(g[:n].clone(), out, ctl, SEED, version, 9, 0, -1.0, off)
        exp = g[:n] * -noise.randn(n, SEED, 0, 9, offset=off, version=version)
        assert_close(out, exp, NOISE, f"offset {off}")
        if off < 40:                # the slice of the whole launch, bit for bit
            part = torch.empty(n)
            ops.fold_ge(g[off:off + n].clone(), part, ctl, SEED, version, 9, 0, -1.0, off)
            assert torch.equal(part, whole[off:off + n]), off
    # rounding: a refresh into bfloat16 outer state over a slice at 7 = the whole's slice
    m, acc = (torch.randn(n + 40, generator=torch.Generator().manual_seed(s)) for s in (4, 5))
    h = torch.rand(n + 40, generator=torch.Generator().manual_seed(6)) + 0.5
    hp = K.RefreshHyper(1.0, 100.0, 1e-3, 0.5, 0.5, 0.0)
    flags = K.RefreshFlags(K.FAMILY_IVON, False, True)

    def refresh(lo, k, off):
        outs = [torch.zeros(k, dtype=torch.bfloat16) for _ in range(4)]
        ops.refresh(m[lo:lo + k].clone(), h[lo:lo + k].clone(), acc[lo:lo + k].clone(), None,
                    *outs, torch.zeros(4, dtype=torch.int64), None, None, SEED, version,
                    (3 << 16) | 2, hp, flags, off)
        return outs
    whole_outs, part_outs = refresh(0, n + 40, 0), refresh(7, n, 7)
    for w, q in zip(whole_outs, part_outs):
        _assert_same_bits(q, w[7:7 + n])
    shifted = refresh(7, n, 0)                  # (the offset matters to the rounding)
    assert not torch.equal(shifted[0], part_outs[0])


@pytest.mark.skipif(set(FUSED_BACKENDS) != {"cpp", "triton"}, reason="needs both kernel sets")
@pytest.mark.parametrize("version", noise.STREAM_VERSIONS)
@pytest.mark.parametrize("base", [0, 3 * 2 ** 32 + 1024])
def test_the_noise_is_the_same_bits_in_both_kernel_sets(base, version):
    """Both stream versions' transform is the same branch-free code in C++ and Triton (log,
    sine, cosine by polynomials, correctly rounded division and square root, no fused
    multiply-adds): the normals agree bit for bit, through the kernels' ``randn`` and
    inside a kernel (a compiled Triton kernel gives the interpreter's bits: the GPU check)."""
    from poco_kernels.kernels import cpp_ops, triton_ops
    n = 5000
    a = _kernel_noise(triton_ops, n, base, 7, 12345, version)
    b = _kernel_noise(cpp_ops, n, base, 7, 12345, version)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    saved = TK.BRANCH_FREE
    TK.BRANCH_FREE = tl.constexpr(True)
    try:
        c = triton_ops.randn(torch.empty(n), SEED, 7, 12345, base, version)
    finally:
        TK.BRANCH_FREE = saved
    assert torch.equal(c.view(torch.int32), b.view(torch.int32))
