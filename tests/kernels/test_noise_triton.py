"""Tests for poco_kernels.noise against Triton (interpreter mode, runs on CPU): tl.randn,
tl.randn4x and tl.philox, and the kernels' own Philox as the interpreter runs it, give
randn's values and Philox's words."""
import pytest
import torch

from philox_reference import MASK32
from poco_kernels import noise
from poco_kernels.noise import MAX_BUCKETS, MAX_DRAWS, philox4x32, randn, stream_id


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
