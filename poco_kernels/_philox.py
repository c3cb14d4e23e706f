"""Philox4x32-10 in plain torch integer ops, and Triton's float transform of its words.

The primitives under :mod:`poco_kernels.noise`: the generator exactly as
``triton.language.random.philox_impl`` (bit for bit), ``tl.uint_to_uniform_float`` and
``tl.pair_uniform_to_normal`` (Box-Muller), and the range checks of counter words.  What
a stream is (which counters, which lanes) is :mod:`poco_kernels.noise`'s business."""

from __future__ import annotations

import operator
from typing import Optional, Tuple, Union

import torch

# --------------------------------------------------------------------------
# Constants (identical to triton.language.random.philox_impl, 32-bit words)
# --------------------------------------------------------------------------
PHILOX_KEY_A = 0x9E3779B9  # key bump for k0 (golden ratio)
PHILOX_KEY_B = 0xBB67AE85  # key bump for k1 (sqrt(3) - 1)
PHILOX_ROUND_A = 0xD2511F53  # multiplier applied to c0
PHILOX_ROUND_B = 0xCD9E8D57  # multiplier applied to c2
PHILOX_ROUNDS = 10

_MASK32 = 0xFFFFFFFF
_MASK16 = 0xFFFF


# Float32 constants of tl.randn's transform.  Triton rounds the Python float
# literals to float32 when they meet a float32 tensor, so we do the same.
_UNIFORM_SCALE = 4.6566127342e-10  # ~ (2**23 - 1) / 2**23 * 2**-31
_TWO_PI = 6.283185307179586
_U1_MIN = 1.0e-7

# Elements per chunk.  A chunk keeps ~12 int64 buffers alive (1 MiB each at
# 2**17 elements), so memory stays bounded for any numel.  2**17 measured
# fastest on a 2-core CPU: smaller chunks pay more per-op Python/threading
# overhead, larger ones fall out of cache.
_CHUNK = 2**17

# Number of int64 buffers the in-place rounds need: 2 scratch + 2 x 4 words.
_N_BUFFERS = 10

Word = Union[int, torch.Tensor]


# --------------------------------------------------------------------------
# Philox core
#
# 64-bit products without overflow: a Philox round needs the high and low
# 32-bit words of m * x for a 32-bit constant m and a 32-bit word x.  That
# product needs 64 *unsigned* bits, which int64 cannot hold, so we split
# m = m_hi * 2**16 + m_lo and compute
#
#     a  = m_lo * x                 # < 2**48
#     t  = m_hi * x + (a >> 16)     # < 2**49;  m * x == t * 2**16 + (a & 0xffff)
#     hi = t >> 16                  # == floor(m * x / 2**32)
#     lo = (t & 0xffff) * 2**16 + (a & 0xffff)     # == m * x mod 2**32
#
# Every intermediate fits comfortably in int64.
#
# Two implementations of the rounds share this arithmetic:
#   * ``_round_generic`` works on Python ints and/or tensors with ordinary
#     operators.  Counter words that are the same for every element (step,
#     stream, usually the high index word) stay Python ints and cost nothing
#     until they mix with per-element words (after at most two rounds).
#   * ``_rounds_inplace`` takes over once all four words are tensors and runs
#     the remaining rounds with ``out=``/in-place ops into preallocated
#     buffers; this avoids allocator traffic and is ~2x faster on CPU.
# --------------------------------------------------------------------------
def _mulhilo(m: int, x: Word) -> Tuple[Word, Word]:
    """``(hi, lo)`` words of ``m * x`` (see above); ``x`` is an int or tensor."""
    m_hi, m_lo = m >> 16, m & _MASK16
    a = x * m_lo
    t = x * m_hi + (a >> 16)
    hi = t >> 16
    lo = (t & _MASK16) * 65536 + (a & _MASK16)
    return hi, lo


def _mulhilo_into(m: int, x: torch.Tensor, hi, lo, a, t) -> None:
    """In-place ``_mulhilo``: writes into ``hi``/``lo``; ``a``/``t`` are scratch."""
    m_hi, m_lo = m >> 16, m & _MASK16
    torch.mul(x, m_lo, out=a)  # a = m_lo * x
    torch.bitwise_right_shift(a, 16, out=t)
    torch.add(t, x, alpha=m_hi, out=t)  # t = m_hi * x + (a >> 16)
    torch.bitwise_right_shift(t, 16, out=hi)  # hi = t >> 16
    t.bitwise_and_(_MASK16)
    a.bitwise_and_(_MASK16)
    torch.add(a, t, alpha=65536, out=lo)  # lo = (t & 0xffff) * 2**16 + (a & 0xffff)


def _round_generic(words, k0: int, k1: int, only_c0_c1: bool):
    """One Philox round on ints/tensors, as in ``philox_impl``.

    Returns new objects only (never mutates its inputs).  With
    ``only_c0_c1`` the A-product is skipped and ``c2``/``c3`` are ``None``.
    """
    c0, c1, c2, c3 = words  # _c0, _c2 = c0, c2: new words use the old ones
    hi_b, lo_b = _mulhilo(PHILOX_ROUND_B, c2)
    new_c0 = hi_b ^ c1 ^ k0  # umulhi(B, _c2) ^ c1 ^ k0
    if only_c0_c1:
        return [new_c0, lo_b, None, None]
    hi_a, lo_a = _mulhilo(PHILOX_ROUND_A, c0)
    new_c2 = hi_a ^ c3 ^ k1  # umulhi(A, _c0) ^ c3 ^ k1
    return [new_c0, lo_b, new_c2, lo_a]  # c1 = B*_c2, c3 = A*_c0 (mod 2**32)


def _rounds_inplace(words, k0: int, k1: int, n_rounds: int, only_c0_c1: bool, buffers):
    """The remaining ``n_rounds`` Philox rounds on four tensor words.

    ``buffers`` is a list of ``_N_BUFFERS`` int64 tensors of the broadcast
    shape (or None to allocate them).  The input words are only read: round
    outputs alternate between two sets of four buffers.  The returned words
    live in ``buffers``.  ``only_c0_c1`` as in ``_round_generic`` (applies to
    the last round).
    """
    shape = torch.broadcast_shapes(*(w.shape for w in words))
    if buffers is None:
        buffers = [torch.empty(shape, dtype=torch.int64, device=words[0].device) for _ in range(_N_BUFFERS)]
    a, t = buffers[0], buffers[1]
    sets = (buffers[2:6], buffers[6:10])
    for r in range(n_rounds):
        c0, c1, c2, c3 = words
        n0, n1, n2, n3 = sets[r % 2]  # never an input of this round
        _mulhilo_into(PHILOX_ROUND_B, c2, n0, n1, a, t)  # n0 = umulhi(B, _c2), n1 = B * _c2
        n0.bitwise_xor_(c1).bitwise_xor_(k0)  # c0 = umulhi(B, _c2) ^ c1 ^ k0
        if only_c0_c1 and r == n_rounds - 1:
            return [n0, n1, None, None]
        _mulhilo_into(PHILOX_ROUND_A, c0, n2, n3, a, t)  # n2 = umulhi(A, _c0), n3 = A * _c0
        n2.bitwise_xor_(c3).bitwise_xor_(k1)  # c2 = umulhi(A, _c0) ^ c3 ^ k1
        words = [n0, n1, n2, n3]
        k0 = (k0 + PHILOX_KEY_A) & _MASK32  # raise the key (mod 2**32)
        k1 = (k1 + PHILOX_KEY_B) & _MASK32
    return words


def _philox_rounds(
    c0: Word, c1: Word, c2: Word, c3: Word, k0: int, k1: int, n_out: int = 4, buffers=None
) -> Tuple[Optional[Word], ...]:
    """Philox4x32-10 (``triton.language.random.philox_impl``) on ints/tensors.

    Words are Python ints or int64 tensors in [0, 2**32); tensors broadcast.
    Inputs are never modified.  With ``n_out == 2`` only the first two output
    words are computed (the others are None) -- all that ``randn`` needs.
    ``buffers``: optional workspace for ``_rounds_inplace``.
    """
    words = [c0, c1, c2, c3]
    for r in range(PHILOX_ROUNDS):
        last = r == PHILOX_ROUNDS - 1
        if all(isinstance(w, torch.Tensor) for w in words):
            return tuple(_rounds_inplace(words, k0, k1, PHILOX_ROUNDS - r, n_out == 2, buffers))
        words = _round_generic(words, k0, k1, last and n_out == 2)
        k0 = (k0 + PHILOX_KEY_A) & _MASK32  # raise the key (mod 2**32)
        k1 = (k1 + PHILOX_KEY_B) & _MASK32
    return tuple(words)


def _workspace(n: int, device) -> list:
    """``_N_BUFFERS`` int64 buffers of length ``n``, reused across chunks."""
    return [torch.empty(n, dtype=torch.int64, device=device) for _ in range(_N_BUFFERS)]


# --------------------------------------------------------------------------
# Float transform (tl.randn)
# --------------------------------------------------------------------------
def _uint_to_uniform_float(x: torch.Tensor) -> torch.Tensor:
    """``tl.uint_to_uniform_float`` for uint32 words held in int64 in [0, 2**32).

    Triton bitcasts to int32 and maps negatives with ``~x == -x - 1``.  For the
    uint32 value ``u`` with the sign bit set that is ``-(u - 2**32) - 1 ==
    u ^ 0xffffffff``, so the folded value is ``u ^ (0xffffffff if u >= 2**31
    else 0)``, in [0, 2**31).  Converting that non-negative int64 to float32
    rounds exactly like Triton's int32 -> float32 conversion (same value,
    round-to-nearest-even), then we multiply by the float32 scale.
    """
    folded = (x >> 31) * _MASK32  # 0 or 0xffffffff
    folded ^= x
    u = folded.to(torch.float32)
    u *= _UNIFORM_SCALE  # python float -> float32 scalar, float32 multiply
    return u


def _pair_uniform_to_normal_cos(u1: torch.Tensor, u2: torch.Tensor) -> torch.Tensor:
    """Cosine half of ``tl.pair_uniform_to_normal`` (Box-Muller), in float32 (version 1).
    Overwrites its arguments."""
    u1 = torch.clamp_min_(u1, _U1_MIN)  # max(1e-7, u1)
    th = u2.mul_(_TWO_PI)  # 6.283185307179586 * u2, float32
    r = u1.log_().mul_(-2.0).sqrt_()  # sqrt(-2 * log(u1))
    return r.mul_(th.cos_())  # r * cos(th)


def _pair_uniform_to_normal(u1: torch.Tensor, u2: torch.Tensor, out_cos: torch.Tensor,
                            out_sin: torch.Tensor) -> None:
    """``tl.pair_uniform_to_normal`` (Box-Muller, both branches) in float32, into
    ``out_cos``/``out_sin`` (version 2).  Overwrites ``u1`` and ``u2``."""
    r = torch.clamp_min_(u1, _U1_MIN).log_().mul_(-2.0).sqrt_()  # sqrt(-2 log max(1e-7, u1))
    th = u2.mul_(_TWO_PI)  # 6.283185307179586 * u2, float32
    torch.cos(th, out=out_cos).mul_(r)
    torch.sin(th, out=out_sin).mul_(r)


# --------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------
def _check_int(name: str, value, lo: int, hi: int) -> int:
    """Return ``value`` as an int, raising ValueError unless lo <= value < hi."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got bool {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None
    if not lo <= value < hi:
        raise ValueError(f"{name} must be in [{lo}, {hi:#x}), got {value}")
    return value


def _split_seed(seed) -> Tuple[int, int]:
    seed = _check_int("seed", seed, 0, 2**64)
    return seed & _MASK32, seed >> 32


def _as_word(name: str, c, device) -> Word:
    """A counter word: Python ints are range-checked, tensors taken mod 2**32.

    Integer tensors of any width are reduced to their low 32 bits, so an int32
    tensor behaves like Triton's bitcast of int32 to uint32.
    """
    if isinstance(c, torch.Tensor):
        if c.dtype.is_floating_point or c.dtype.is_complex or c.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got dtype {c.dtype}")
        return c.to(device=device, dtype=torch.int64) & _MASK32
    return _check_int(name, c, 0, 2**32)


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------
def philox4x32(seed: int, c0: Word, c1: Word, c2: Word, c3: Word) -> Tuple[torch.Tensor, ...]:
    """Philox4x32-10 of counters ``(c0, c1, c2, c3)`` under the 64-bit ``seed``.

    Equivalent to ``tl.philox(seed, c0, c1, c2, c3)`` with uint32 counters.
    Counters may be Python ints in ``[0, 2**32)`` or integer tensors (reduced
    mod 2**32, i.e. int32 values are read as their uint32 bit pattern); they
    broadcast against each other.  Returns four int64 tensors of the broadcast
    shape with values in ``[0, 2**32)`` (0-dim CPU tensors if all counters are
    ints).
    """
    k0, k1 = _split_seed(seed)
    tensors = [c for c in (c0, c1, c2, c3) if isinstance(c, torch.Tensor)]
    device = tensors[0].device if tensors else torch.device("cpu")
    words = [_as_word(f"c{j}", c, device) for j, c in enumerate((c0, c1, c2, c3))]
    shape = torch.broadcast_shapes(*(w.shape for w in words if isinstance(w, torch.Tensor)))

    # Flatten the tensor counters to the broadcast shape and run in chunks.
    numel = 1
    for s in shape:
        numel *= s
    flat = [
        w.expand(shape).reshape(-1) if isinstance(w, torch.Tensor) else w for w in words
    ]
    outs = [torch.empty(numel, dtype=torch.int64, device=device) for _ in range(4)]
    workspace = _workspace(min(numel, _CHUNK), device)
    for start in range(0, numel, _CHUNK):
        stop = min(start + _CHUNK, numel)
        chunk = [w[start:stop] if isinstance(w, torch.Tensor) else w for w in flat]
        res = _philox_rounds(*chunk, k0, k1, buffers=[b[: stop - start] for b in workspace])
        for o, r in zip(outs, res):
            o[start:stop] = r  # r is a Python int if every counter was an int
    return tuple(o.reshape(shape) for o in outs)
