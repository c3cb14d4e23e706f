"""The noise stream and the stored bits of the Triton kernels: counter-based normals
(:func:`poco_kernels.noise.randn`), float32 -> parameter dtype, and the stochastic
rounding of bfloat16 state (:func:`poco_kernels.reference.stochastic_round` with
:func:`poco_kernels.noise.rounding_bits`).

Every function here is the op-for-op twin of ``csrc/poco_math.h``: the same IEEE float32
operations in the same order, so that a compiled kernel, the Triton interpreter and the
C++ kernels give the same bits.  That holds because the kernels are compiled without
floating-point contraction (``enable_fp_fusion=False``: no ``a * b + c`` is fused into
one rounding) and with correctly rounded division and square root (``tl.div_rn``,
``tl.sqrt_rn``; plain ``/`` and ``tl.sqrt`` compile to approximate instructions).
``poco_kernels.kernels.aot.audit_ptx`` fails CI when a compiled variant contains an
approximate or fused instruction.
"""
import os

import triton
import triton.language as tl

#: noise version 2's transform: the branch-free polynomials (``_log_pos``,
#: ``_sincos_0_2pi``) when compiled for a GPU.  Under Triton's CPU interpreter each tensor
#: operation is a numpy call with a fixed overhead, and the polynomials' ~70 operations per
#: word pair made the test suite 2 minutes slower than numpy's own log, cos and sin (three
#: calls, within an ulp of the polynomials); so the interpreter takes those, unless
#: ``POCO_BRANCH_FREE=1`` asks for the compiled transform (the bit-for-bit checks:
#: ``tests/kernels/test_kernels_noise.py``, the GPU check's interpreter twin) or a test
#: sets this to True.
BRANCH_FREE = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1"
                           or os.environ.get("POCO_BRANCH_FREE", "0") == "1")


#: Philox under Triton's CPU interpreter: :func:`_philox_host`, the ten rounds in numpy
#: (the same words bit for bit: ``tests/kernels/test_noise_triton.py``) instead of
#: ``tl.philox``'s ~100 tensor operations at the interpreter's fixed cost each.  Compiled
#: for a GPU: ``tl.philox``.
HOST_PHILOX = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


def _philox_host(seed, c0, c1, c2, c3):
    """``tl.philox(seed, c0, c1, c2, c3)`` on the interpreter's tensors (numpy arrays in
    their handles; ``c0`` has the block's shape): four uint32 tensors of that shape.
    Philox4x32-10 as :mod:`poco_kernels._philox` states it, on numpy's uint32 and uint64
    (numpy, not torch: the interpreter's arithmetic allocates no torch memory)."""
    import numpy as np
    from triton.runtime.interpreter import TensorHandle
    from .. import _philox as P

    key = int(np.asarray(seed.handle.data).reshape(-1)[0]) & 0xFFFFFFFFFFFFFFFF
    k0, k1 = key & 0xFFFFFFFF, key >> 32
    x0, x1, x2, x3 = (np.broadcast_to(np.asarray(c.handle.data, dtype=np.uint32),
                                      c0.handle.data.shape) for c in (c0, c1, c2, c3))
    ra, rb, shift = np.uint64(P.PHILOX_ROUND_A), np.uint64(P.PHILOX_ROUND_B), np.uint64(32)
    for _ in range(P.PHILOX_ROUNDS):
        pb, pa = x2.astype(np.uint64) * rb, x0.astype(np.uint64) * ra
        x0 = (pb >> shift).astype(np.uint32) ^ x1 ^ np.uint32(k0)
        x2 = (pa >> shift).astype(np.uint32) ^ x3 ^ np.uint32(k1)
        x1, x3 = pb.astype(np.uint32), pa.astype(np.uint32)
        k0, k1 = (k0 + P.PHILOX_KEY_A) & 0xFFFFFFFF, (k1 + P.PHILOX_KEY_B) & 0xFFFFFFFF
    return tuple(tl.tensor(TensorHandle(np.ascontiguousarray(w), tl.uint32), c0.type)
                 for w in (x0, x1, x2, x3))


#: (a Triton kernel may name a plain function only as a constexpr)
_PHILOX_HOST = tl.constexpr(_philox_host)


@triton.jit
def _philox(seed, c0, c1, c2, c3):
    """``tl.philox`` of the uint32 counter blocks ``c0 .. c3`` (:data:`HOST_PHILOX`)."""
    if HOST_PHILOX:
        w0, w1, w2, w3 = _PHILOX_HOST(seed, c0, c1, c2, c3)
    else:
        w0, w1, w2, w3 = tl.philox(seed, c0, c1, c2, c3)
    return w0, w1, w2, w3


@triton.jit
def _log_pos(x):
    """log(x) for positive normal float32 ``x``: ``log_pos`` of csrc/poco_math.h, op for op
    (``x = 2^k (1 + f)``, ``log(1 + f) = 2 atanh(f / (2 + f))``, ``k ln 2`` in two parts).
    Branch-free, unlike libdevice's ``logf``."""
    ix = x.to(tl.uint32, bitcast=True) + (0x3F800000 - 0x3F3504F3)
    k = (ix >> 23).to(tl.int32) - 0x7F
    f = ((ix & 0x007FFFFF) + 0x3F3504F3).to(tl.float32, bitcast=True) - 1.0
    s = tl.div_rn(f, 2.0 + f)
    z = s * s
    r = z * (0.66666666666 + z * (0.4 + z * (0.28571428571 + z * 0.22222222222)))
    kf = k.to(tl.float32)
    return kf * 0.6923828125 + (kf * 7.6436804e-4 + (f - s * (f - r)))


@triton.jit
def _sincos_0_2pi(x):
    """``(cos x, sin x)`` for ``x`` in [0, 2 pi]: ``sincos_0_2pi`` of csrc/poco_math.h (one
    reduction by pi/2 in three parts, Taylor polynomials on |r| <= pi/4, the quadrant by
    selects).  Branch-free: libdevice's ``cosf``/``sinf`` carry an inlined Payne-Hanek
    reduction for large arguments that a Box-Muller angle never needs.  The rounding to an
    integer adds and subtracts 1.5 * 2^23 (round to even, as ``rintf``): two roundings,
    which a fused multiply-add would merge into one."""
    q = (x * 0.63661975 + 12582912.0) - 12582912.0
    r = ((x - q * 1.5703125) - q * 4.8375130e-4) - q * 7.5497901e-8
    r2 = r * r
    c = 1.0 + r2 * (-0.5 + r2 * (4.1666667e-2 + r2 * (-1.3888889e-3 + r2 * (2.4801587e-5
                                                                     + r2 * -2.7557319e-7))))
    s = r + r * r2 * (-0.16666667 + r2 * (8.3333333e-3 + r2 * (-1.9841270e-4 + r2 * (
        2.7557319e-6 + r2 * -2.5052108e-8))))
    qi = q.to(tl.int32)
    odd = (qi & 1) != 0
    vc = tl.where(odd, s, c)
    vs = tl.where(odd, c, s)
    return tl.where(((qi + 1) & 2) != 0, -vc, vc), tl.where((qi & 2) != 0, -vs, vs)


@triton.jit
def _normal_pair(wa, wb):
    """Box-Muller of two Philox words, both branches: ``normal_pair`` of csrc/poco_math.h
    (``tl.pair_uniform_to_normal``'s formula with the branch-free log, sine and cosine)."""
    u1 = tl.random.uint_to_uniform_float(wa)
    u1 = tl.where(u1 < 1.0e-7, 1.0e-7, u1)
    th = 6.283185307179586 * tl.random.uint_to_uniform_float(wb)
    if BRANCH_FREE:
        r = tl.sqrt_rn(-2.0 * _log_pos(u1))
        c, s = _sincos_0_2pi(th)
    else:                   # (the interpreter: numpy's, see BRANCH_FREE)
        r = tl.sqrt_rn(-2.0 * tl.log(u1))
        c = tl.cos(th)
        s = tl.sin(th)
    return r * c, r * s


@triton.jit
def _counter_words(call, counter, stream):
    """The four Philox counter words of the calls ``call`` (int64): the call index's low
    and high words, the step or refresh ``counter`` and the ``stream`` id (the stream
    definition of :mod:`poco_kernels.noise`)."""
    c0 = (call & 0xFFFFFFFF).to(tl.uint32)
    c1 = (call >> 32).to(tl.uint32)
    zero = c0 * 0
    return c0, c1, zero + counter.to(tl.uint32), zero + stream.to(tl.uint32)


@triton.jit
def _randn_v1(seed, idx, counter, stream):
    """Version 1: the normal of element ``idx`` (int64) of stream ``(seed, counter,
    stream)``, one Philox call per element, the cosine branch (``normal_of`` of
    csrc/poco_math.h: ``tl.randn``'s formula with the branch-free transform)."""
    c0, c1, c2, c3 = _counter_words(idx, counter, stream)
    o0, o1, _, _ = _philox(seed, c0, c1, c2, c3)
    n1, _ = _normal_pair(o0, o1)
    return n1


@triton.jit
def _randn_v2(seed, pid, offset, counter, stream, BLOCK: tl.constexpr):
    """Version 2: the normals of elements ``offset + pid * BLOCK .. offset + pid * BLOCK +
    BLOCK - 1`` (``offset`` a multiple of 4), from the ``BLOCK // 4`` Philox calls that
    cover them: call ``q`` gives elements ``4q .. 4q + 3``, both Box-Muller branches of
    both word pairs (``tl.randn4x``), interleaved in element order by two joins and a
    reshape."""
    # (the sum first: the interpreter hands an int offset in [2^31, 2^32) over as a uint32)
    q = ((pid * BLOCK + offset) >> 2) + tl.arange(0, BLOCK // 4)
    c0, c1, c2, c3 = _counter_words(q, counter, stream)
    w0, w1, w2, w3 = _philox(seed, c0, c1, c2, c3)
    n0, n1 = _normal_pair(w0, w1)
    n2, n3 = _normal_pair(w2, w3)
    # [q, b, a] = n_(2b + a): element 4q + 2b + a
    return tl.reshape(tl.join(tl.join(n0, n2), tl.join(n1, n3)), [BLOCK])


@triton.jit
def _randn_v2_at(seed, gidx, counter, stream):
    """Version 2 at element indices ``gidx`` in any alignment: element ``i`` runs call
    ``i >> 2`` itself and keeps lane ``i & 3`` (the word pair ``lane >> 1``, the branch
    ``lane & 1``): the numbers of :func:`_randn_v2`, at four times its Philox work (a
    shard whose place in its bucket is not a multiple of 4)."""
    q = gidx >> 2
    lane = (gidx & 3).to(tl.int32)
    c0 = (q & 0xFFFFFFFF).to(tl.uint32)
    c1 = (q >> 32).to(tl.uint32)
    zero = c0 * 0
    w0, w1, w2, w3 = _philox(seed, c0, c1, zero + counter.to(tl.uint32),
                             zero + stream.to(tl.uint32))
    hi = lane >= 2
    a, b = _normal_pair(tl.where(hi, w2, w0), tl.where(hi, w3, w1))
    return tl.where((lane & 1) == 0, a, b)


@triton.jit
def noise(seed, idx, pid, offset, counter, stream, NOISE: tl.constexpr,
          SHARD: tl.constexpr, BLOCK: tl.constexpr):
    """The normals of this block's elements ``idx = pid * BLOCK + arange(BLOCK)``, which
    are elements ``offset + idx`` of stream ``(seed, counter, stream)``, stream definition
    ``NOISE`` (1 or 2): :func:`poco_kernels.noise.randn`.  ``SHARD``: 0, a whole bucket
    (``offset`` is 0 and unused: the variants audited in docs/gpu-budget.md); 1, a shard
    at ``offset``, a multiple of 4; 2, a shard at any other ``offset``."""
    if NOISE == 1:
        if SHARD == 0:
            eps = _randn_v1(seed, idx, counter, stream)
        else:
            eps = _randn_v1(seed, idx + offset, counter, stream)
    elif SHARD == 0:
        eps = _randn_v2(seed, pid, 0, counter, stream, BLOCK)
    elif SHARD == 1:
        eps = _randn_v2(seed, pid, offset, counter, stream, BLOCK)
    else:
        eps = _randn_v2_at(seed, idx + offset, counter, stream)
    return eps


@triton.jit
def to_param(x, ptr):
    """float32 -> the parameters' dtype, rounding to nearest even.  For bfloat16 it is
    spelled out in integer ops (what the GPU's ``cvt.rn.bf16.f32`` does; Triton's CPU
    interpreter would truncate), so every backend writes the same bits."""
    if ptr.dtype.element_ty == tl.bfloat16:
        raw = x.to(tl.uint32, bitcast=True)
        bits = raw + (0x7FFF + ((raw >> 16) & 1))
        bits = tl.where(x != x, (raw >> 16 & 0x8000) | 0x7FC0, bits >> 16)  # NaN: quiet NaN
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(ptr.dtype.element_ty)


@triton.jit
def _round_bits(idx, seed, counter, bucket, TAG: tl.constexpr):
    """16 rounding bits of element ``idx`` of state buffer ``TAG``: exactly
    :func:`poco_kernels.noise.rounding_bits` (uint32 arithmetic wraps as it must)."""
    s64 = seed.to(tl.uint64)
    which = ((bucket.to(tl.uint32) << 3) | TAG) + 1
    salt = ((s64 & 0xFFFFFFFF).to(tl.uint32) ^ ((s64 >> 32).to(tl.uint32) * 0x85EBCA6B)
            ^ (counter.to(tl.uint32) * 0xC2B2AE35) ^ (which * 0x27D4EB2F))
    x = ((idx & 0xFFFFFFFF).to(tl.uint32) * 0x9E3779B1) ^ salt
    x = x ^ ((idx >> 32).to(tl.uint32) * 0x165667B1)
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    x = x ^ (x >> 16)
    return x >> 16


@triton.jit
def store_state(ptr, idx, offset, x, mask, seed, counter, bucket, TAG: tl.constexpr,
                SHARD: tl.constexpr):
    """Store float32 state ``x``; into a bfloat16 buffer (``state_dtype``) with stochastic
    rounding, :func:`poco_kernels.reference.stochastic_round` (the bits of element
    ``offset + idx``, as the noise: ``SHARD``)."""
    if ptr.dtype.element_ty == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        finite = (u & 0x7F800000) != 0x7F800000
        special = (u >> 16) | tl.where((u & 0x007FFFFF) != 0, 0x40, 0).to(tl.uint32)
        if SHARD == 0:
            r = _round_bits(idx, seed, counter, bucket, TAG)
        else:
            r = _round_bits(idx + offset, seed, counter, bucket, TAG)
        bits = tl.where(finite, (u + r) >> 16, special)
        tl.store(ptr + idx, bits.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptr + idx, x, mask=mask)
