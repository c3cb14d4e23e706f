"""Counter-based standard-normal noise, bit-compatible with Triton's Philox.

This module generates Gaussian noise with plain torch integer/float ops (no
torch RNG state at all), so the value of every element is a pure function of
``(seed, step, stream, element index)``.  A Triton kernel can therefore
regenerate exactly the same noise on the fly with ``tl.philox`` instead of
reading it from memory, and the torch backend and the kernels agree.

Generator
---------
Philox4x32-10 exactly as ``triton.language.random.philox_impl`` (which is also
the Random123 ``philox4x32_10``): four 32-bit counter words ``c0..c3``, a
two-word key ``(k0, k1)``, ten rounds.  The 64-bit unsigned seed is split into
the key as ``k0 = seed & 0xffffffff``, ``k1 = seed >> 32``, which is what
``tl.philox(seed, c0, c1, c2, c3)`` does for 32-bit counters.

Uniforms exactly as ``tl.uint_to_uniform_float``: reinterpret a word as int32,
fold negatives with ``x -> -x - 1``, convert to float32, scale by
``float32(4.6566127342e-10)``.  Normals by the Box-Muller transform of
``tl.pair_uniform_to_normal``: for uniforms ``(u1, u2)``,
``r = sqrt(-2 log(max(1e-7, u1)))``, ``th = float32(2 pi) * u2`` and the pair
``(r cos th, r sin th)``.  All float math is float32.

The Philox words and the uniforms are bit-identical to Triton's.  The normals
go through ``log``/``sqrt``/``cos``/``sin``, whose float32 results can differ by
an ulp between math libraries: this module uses torch's, while the C++ and Triton
kernels share their own branch-free polynomials with correctly rounded division and
square root and no contraction, so the kernels agree bit for bit with each other
(compiled or interpreted, docs/design.md, Noise) and with this module to ~1e-6.

Stream definition, version 2 (the default; ``STREAM_VERSION``)
---------------------------------------------------------------
Four normals per Philox call.  Element ``i`` (``0 <= i < 2**64``) of a noise
buffer is lane ``i mod 4`` of call ``q = i div 4``::

    c0 = q & 0xffffffff        # low word of the call index
    c1 = q >> 32               # high word of the call index
    c2 = step & 0xffffffff     # optimizer step, 0 <= step < 2**32
    c3 = stream                # 32-bit stream id, see ``stream_id``
    key = seed                 # 64-bit seed, 0 <= seed < 2**64
    w0, w1, w2, w3 = philox(key, c0, c1, c2, c3)
    lane 0: r(w0) cos th(w1)   lane 1: r(w0) sin th(w1)
    lane 2: r(w2) cos th(w3)   lane 3: r(w2) sin th(w3)

with ``r(w) = sqrt(-2 log max(1e-7, uniform(w)))`` and ``th(w) = 2 pi uniform(w)``:
both Box-Muller branches of both word pairs, the four outputs of Triton's
``tl.randn4x``.  With ``step == stream == 0``, elements ``4q .. 4q + 3`` are
exactly ``tl.randn4x(seed, q)``.  One call (ten rounds, twenty 32x32-bit
products), two logarithms, two square roots and two angle reductions give four
normals: a quarter of version 1's Philox work and half of its transcendentals.

Stream definition, version 1 (checkpoints written before version 2)
-------------------------------------------------------------------
One call per element, the cosine branch of the first word pair only::

    c0, c1 = i & 0xffffffff, i >> 32      (the element index itself)
    c2, c3, key as above
    normal = r(w0) cos th(w1)

which is ``tl.randn(seed, i)`` for ``step == stream == 0``.  An optimizer whose
state dict was written under version 1 keeps drawing version 1 (bit-exact
resume); see ``BucketedOptimizer.noise_version``.

Implementation notes
--------------------
Words are held in int64 tensors with values in ``[0, 2**32)``.  The 32x32-bit
products that Philox needs (full 64-bit result) would overflow int64, so the
constant multiplier is split into 16-bit halves and the product is assembled
from two partial products that each fit in 48 bits (see ``_mulhilo``).
Counter words that are the same for every element (step, stream, usually the
high index word) stay Python ints until they mix with per-element words (after
at most two rounds); the remaining rounds run with in-place/``out=`` ops on a
reused workspace (:mod:`poco_kernels._philox`).  Large buffers are processed in chunks of ``_CHUNK``
elements, so temporary memory stays bounded (~12 MiB) whatever ``numel`` is.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from ._philox import (_CHUNK, _MASK16, _MASK32, PHILOX_KEY_A, PHILOX_KEY_B,  # noqa: F401
                      PHILOX_ROUND_A, PHILOX_ROUND_B, PHILOX_ROUNDS, Word, _check_int,
                      _pair_uniform_to_normal, _pair_uniform_to_normal_cos, _philox_rounds,
                      _split_seed, _uint_to_uniform_float, _workspace, philox4x32)


__all__ = [
    "PHILOX_KEY_A",
    "PHILOX_KEY_B",
    "PHILOX_ROUND_A",
    "PHILOX_ROUND_B",
    "PHILOX_ROUNDS",
    "MAX_BUCKETS",
    "MAX_DRAWS",
    "MAX_KINDS",
    "MAX_COUNTER",
    "STREAM_VERSION",
    "STREAM_VERSIONS",
    "philox4x32",
    "randn",
    "stream_id",
    "ROUND_TAGS",
    "rounding_bits",
    "rounding_salt",
]


# Stream-id packing: 16 bits bucket | 4 bits kind | 12 bits draw.
MAX_BUCKETS = 2**16
MAX_KINDS = 2**4
MAX_DRAWS = 2**12
#: the step counter is one 32-bit word: at most 2**32 steps (and refreshes) per seed
MAX_COUNTER = 2**32

#: version of the stream definition (module docstring) that new optimizers draw.  State
#: dicts record the version they were drawn under, and a resumed run keeps it.
STREAM_VERSION = 2
#: every version this module (and every kernel backend) can draw
STREAM_VERSIONS = (1, 2)


def randn(
    numel: int,
    seed: int,
    step: int,
    stream: int,
    *,
    offset: int = 0,
    device: Optional[Union[str, torch.device]] = None,
    dtype: torch.dtype = torch.float32,
    out: Optional[torch.Tensor] = None,
    version: int = STREAM_VERSION,
) -> torch.Tensor:
    """Standard normals for element indices ``offset .. offset + numel - 1``.

    Element ``j`` of the result is the noise of element index ``i = offset + j``
    of the stream ``(seed, step, stream)`` as defined in the module docstring;
    so ``randn(n, ..., offset=k)`` equals ``randn(n + k, ...)[k:]``.

    Args:
        numel: number of values, >= 0.
        seed: 64-bit key, ``0 <= seed < 2**64``.
        step: 32-bit step counter, ``0 <= step < 2**32``.
        stream: 32-bit stream id, ``0 <= stream < 2**32`` (see ``stream_id``).
        offset: first element index; ``offset + numel <= 2**64``.
        device: device of the result (default: CPU, or ``out``'s device).
        dtype: floating dtype of the result; values are computed in float32 and
            then cast.  Ignored when ``out`` is given.
        out: optional contiguous 1-D floating tensor of length ``numel``; the
            values are written into it (cast to its dtype) and it is returned.
        version: the stream definition, 1 or 2 (module docstring).
    """
    numel = _check_int("numel", numel, 0, 2**64)
    if type(version) is not int or version not in STREAM_VERSIONS:
        raise ValueError(f"version must be one of {STREAM_VERSIONS}, got {version!r}")
    k0, k1 = _split_seed(seed)
    step = _check_int("step", step, 0, 2**32)
    stream = _check_int("stream", stream, 0, 2**32)
    offset = _check_int("offset", offset, 0, 2**64)
    if offset + numel > 2**64:
        raise ValueError(f"offset + numel must be <= 2**64, got {offset} + {numel}")

    if out is None:
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating dtype, got {dtype}")
        out = torch.empty(numel, dtype=dtype, device=device)
    else:
        if not out.dtype.is_floating_point:
            raise ValueError(f"out must be a floating tensor, got dtype {out.dtype}")
        if out.dim() != 1 or out.numel() != numel or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous 1-D tensor of length {numel}, "
                f"got shape {tuple(out.shape)} (contiguous={out.is_contiguous()})"
            )
    if version == 1:
        _randn_v1(out, numel, offset, k0, k1, step, stream)
    else:
        _randn_v2(out, numel, offset, k0, k1, step, stream)
    return out


def _call_counters(first: int, n: int, dev) -> Tuple[Word, Word]:
    """``(c0, c1)``: the low and high words of the indices ``first .. first + n - 1``
    (``n <= _CHUNK``: the low word wraps past ``2**32`` at most once)."""
    lo0, hi0 = first & _MASK32, first >> 32
    idx = torch.arange(lo0, lo0 + n, dtype=torch.int64, device=dev)
    if lo0 + n <= 2**32:
        return idx, hi0  # the high word is a constant of the chunk
    return idx & _MASK32, (idx >> 32) + hi0


def _randn_v1(out, numel, offset, k0, k1, step, stream) -> None:
    """Version 1: one Philox call per element index, the cosine branch."""
    workspace = _workspace(min(numel, _CHUNK), out.device)
    for start in range(0, numel, _CHUNK):
        n = min(_CHUNK, numel - start)
        c0, c1 = _call_counters(offset + start, n, out.device)
        buffers = [b[:n] for b in workspace]
        o0, o1, _, _ = _philox_rounds(c0, c1, step, stream, k0, k1, n_out=2, buffers=buffers)
        normal = _pair_uniform_to_normal_cos(_uint_to_uniform_float(o0), _uint_to_uniform_float(o1))
        out[start : start + n] = normal  # casts to out.dtype if needed


def _randn_v2(out, numel, offset, k0, k1, step, stream) -> None:
    """Version 2: call ``q`` gives elements ``4q .. 4q + 3``, both Box-Muller branches of
    both word pairs."""
    if numel == 0:
        return
    q_first, q_end = offset >> 2, (offset + numel + 3) >> 2   # the calls that cover the range
    per = _CHUNK // 4                                        # calls per chunk
    workspace = _workspace(min(q_end - q_first, per), out.device)
    normals = torch.empty(min(q_end - q_first, per), 4, dtype=torch.float32, device=out.device)
    for q0 in range(q_first, q_end, per):
        m = min(per, q_end - q0)
        c0, c1 = _call_counters(q0, m, out.device)
        w = _philox_rounds(c0, c1, step, stream, k0, k1, buffers=[b[:m] for b in workspace])
        quad = normals[:m]
        u = [_uint_to_uniform_float(x) for x in w]
        _pair_uniform_to_normal(u[0], u[1], quad[:, 0], quad[:, 1])
        _pair_uniform_to_normal(u[2], u[3], quad[:, 2], quad[:, 3])
        # element indices 4 q0 .. 4 (q0 + m) - 1, clipped to offset .. offset + numel - 1
        lo, hi = max(4 * q0, offset), min(4 * (q0 + m), offset + numel)
        out[lo - offset : hi - offset] = quad.reshape(-1)[lo - 4 * q0 : hi - 4 * q0]


def stream_id(bucket: int, kind: int, draw: int) -> int:
    """Pack a 32-bit stream id: ``bucket << 16 | kind << 12 | draw``.

    ``bucket`` in ``[0, MAX_BUCKETS)`` (16 bits), ``kind`` in ``[0, 16)``
    (4 bits), ``draw`` in ``[0, MAX_DRAWS)`` (12 bits); ValueError otherwise.
    """
    bucket = _check_int("bucket", bucket, 0, MAX_BUCKETS)
    kind = _check_int("kind", kind, 0, MAX_KINDS)
    draw = _check_int("draw", draw, 0, MAX_DRAWS)
    return (bucket & 0xFFFF) << 16 | (kind & 0xF) << 12 | (draw & 0xFFF)


# --------------------------------------------------------------------------
# Rounding bits (stochastic rounding of low-precision state)
#
# 16 random bits per element and stored value, a pure function of (seed, counter,
# bucket, tag, element index), so every backend rounds a low-precision state buffer
# the same way.  A stochastic rounding needs bits that are uniform and independent of
# the value rounded, not a cryptographic generator: one multiplication by an odd
# constant (a bijection of the index's low word), a per-call salt, and MurmurHash3's
# 32-bit finaliser (a bijection with full avalanche).  For a fixed salt the 2**32
# low index words map one-to-one onto the 2**32 hash values, so the bits are exactly
# uniform over a block of 2**32 elements.  Written for 32-bit lanes: the C++ kernels
# (csrc/poco_dtypes.h, round_bits) and the Triton kernels (_round_bits) run it as is.
# --------------------------------------------------------------------------
ROUND_MUL_INDEX = 0x9E3779B1
ROUND_MUL_SEED = 0x85EBCA6B
ROUND_MUL_COUNTER = 0xC2B2AE35
ROUND_MUL_WHICH = 0x27D4EB2F
ROUND_MUL_INDEX_HI = 0x165667B1
FMIX_A = 0x85EBCA6B
FMIX_B = 0xC2B2AE35

#: the tag of each low-precision state buffer in its rounding bits
ROUND_TAGS = {"momentum": 0, "g_out": 1, "h_out": 2, "m_out": 3, "sigma_out": 4}


def _mul32(x: Word, m: int) -> Word:
    """``x * m mod 2**32`` for a 32-bit word ``x`` (int or int64 tensor) without int64
    overflow (the constant in 16-bit halves)."""
    return ((x * (m & _MASK16)) + (((x * (m >> 16)) & _MASK16) << 16)) & _MASK32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, FMIX_A)
    x = x ^ (x >> 13)
    x = _mul32(x, FMIX_B)
    return x ^ (x >> 16)


def rounding_salt(seed: int, counter: int, bucket: int, tag: int, index_hi: int = 0) -> int:
    """The per-call word of :func:`rounding_bits` (the same for all elements whose index
    has the high word ``index_hi``)."""
    lo, hi = _split_seed(seed)
    counter = _check_int("counter", counter, 0, MAX_COUNTER)
    bucket = _check_int("bucket", bucket, 0, MAX_BUCKETS)
    tag = _check_int("tag", tag, 0, 8)
    which = ((bucket << 3) | tag) + 1
    return (lo ^ _mul32(hi, ROUND_MUL_SEED) ^ _mul32(counter, ROUND_MUL_COUNTER)
            ^ _mul32(which, ROUND_MUL_WHICH) ^ _mul32(index_hi, ROUND_MUL_INDEX_HI))


def rounding_bits(seed: int, counter: int, bucket: int, tag: int, n: int,
                  device=None, offset: int = 0) -> torch.Tensor:
    """int64 tensor of ``n`` values in ``[0, 2**16)``: the rounding bits of elements
    ``offset .. offset + n - 1`` of a bucket's state buffer ``tag`` (``ROUND_TAGS``) at
    update ``counter`` (the step count for the momentum, the refresh count for the outer
    buffers).  ``offset``: a shard's place in the unsharded bucket (as :func:`randn`)."""
    offset = _check_int("offset", offset, 0, 2**64)
    out = torch.empty(n, dtype=torch.int64, device=device)
    pos = 0
    while pos < n:            # (the salt changes with the index's high word)
        start = offset + pos
        m = min(n - pos, 2 ** 32 - (start & _MASK32))
        lo = torch.arange(start & _MASK32, (start & _MASK32) + m, dtype=torch.int64,
                          device=device)
        salt = rounding_salt(seed, counter, bucket, tag, start >> 32)
        out[pos:pos + m] = _fmix32(_mul32(lo, ROUND_MUL_INDEX) ^ salt) >> 16
        pos += m
    return out
