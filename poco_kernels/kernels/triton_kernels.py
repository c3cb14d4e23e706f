"""Triton kernels of the family, over flat per-bucket buffers.

Each kernel is the fused form of reference functions; the ``Reference:`` line of each
names them (:mod:`poco_kernels.reference`), and ``tests/test_kernels.py`` checks
each against them.  Host wrappers (launch, torch custom-op registration) are in
:mod:`poco_kernels.kernels.triton_ops`.

Conventions shared by all kernels:

* element indices are int64 (``pid * BLOCK + arange``, pid widened first), so buffers
  above 2**31 elements work;
* state is float32 (the buffer pointers' dtype), parameters and gradients float32,
  bfloat16 or float16 (cast on load and store); with ``state_dtype=torch.bfloat16`` the
  IVON family's momentum and outer buffers are bfloat16 (widened on load, stored with
  stochastic rounding, ``_store_state``);
* the noise ``eps`` is regenerated, never stored: Philox4x32-10 keyed by ``seed`` with
  counters ``(call low word, call high word, counter, stream)``, exactly
  :func:`poco_kernels.noise.randn` of the stream definition ``NOISE`` (2: four normals per
  call, ``tl.randn4x``'s Box-Muller with our own branch-free log and sine/cosine, those of
  the C++ kernels; 1: one per element, ``tl.randn`` itself); ``counter`` (the
  step or refresh count) is read from the device control tensor ``ctl`` so no host value
  changes per step;
* ``ctl`` (int64, per device): ``[steps taken, refreshes taken, bad-gradient flag,
  skipped updates]``.  An update reads ``found_inf`` (AMP) and the bad flag and, when
  either is set, writes no state (the parameters get the old mean back);
  :func:`finish_kernel` then advances the counters and clears the flag;
* hyperparameters are run-time scalars (a new learning rate does not recompile); only
  the code path (which terms exist) is ``constexpr``.
"""
import os

import triton
import triton.language as tl

# the code-path constants and the control-tensor layout, shared with the C++ kernels
from .interface import (CTL_BAD, CTL_REFRESHES, CTL_SIZE, CTL_SKIPPED,  # noqa: F401
                        CTL_STEPS, FAMILY_ADAMW, FAMILY_IVON, FAMILY_SGD, SIGMA_BUFFER,
                        SIGMA_CONST, SIGMA_IVON, SIGMA_NONE)

BLOCK = 1024
NUM_WARPS = 4

#: noise version 2's transform: the branch-free polynomials (``_log_pos``,
#: ``_sincos_0_2pi``) when compiled for a GPU.  Under Triton's CPU interpreter each tensor
#: operation is a numpy call with a fixed overhead, and the polynomials' ~70 operations per
#: word pair made the test suite 2 minutes slower than numpy's own log, cos and sin (three
#: calls, the same values to the ulp); so the interpreter takes those, except where a test
#: sets this to True (``tests/test_kernels.py`` runs the polynomials against the reference
#: and the C++ kernels' bits).  The AOT compilation (``aot.py``) compiles the polynomials.
BRANCH_FREE = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")

# Run-time ints that must not create compiled variants (Triton specialises ints equal
# to 1 or divisible by 16).  ``n`` IS specialised: a length divisible by 16 (a padded
# bucket, poco_kernels._layout) lets the compiler vectorise the masked loads, and a
# bucket's length never changes.  ``n`` and ``seed`` are annotated ``tl.int64``: a launch
# would otherwise type them by value (i32 below 2**31), so a small explicit seed and the
# default 63-bit one would compile different kernels; annotated, every launch gets the
# types that poco_kernels.kernels.aot compiles (tests/test_triton_aot.py checks).
# ``stream`` (noise.stream_id: bucket << 16 | kind << 12 | draw) stays typed by value: i32
# for every bucket index below 32768, the variant compiled; a bucket index from 32768 on
# (65536 are allowed) gets an i64 ``stream`` with the same bits (``.to(tl.uint32)``) and
# bucket (``>> 16``), so the same numbers, from one more JIT compilation that the AOT
# test does not compile.
_NO_SPEC = ["seed", "stream", "stream_o", "counter_slot", "slot", "offset"]


@triton.jit
def _randn_v1(seed, idx, counter, stream):
    """Version 1: the normal of element ``idx`` (int64) of stream ``(seed, counter,
    stream)``, one Philox call per element, ``tl.randn``'s transform."""
    c0 = (idx & 0xFFFFFFFF).to(tl.uint32)
    c1 = (idx >> 32).to(tl.uint32)
    zero = c0 * 0
    c2 = zero + counter.to(tl.uint32)
    c3 = zero + stream.to(tl.uint32)
    o0, o1, _, _ = tl.philox(seed, c0, c1, c2, c3)
    u1 = tl.random.uint_to_uniform_float(o0)
    u2 = tl.random.uint_to_uniform_float(o1)
    n1, _ = tl.random.pair_uniform_to_normal(u1, u2)
    return n1


@triton.jit
def _log_pos(x):
    """log(x) for positive normal float32 ``x``: ``log_pos`` of csrc/poco_math.h, op for op
    (``x = 2^k (1 + f)``, ``log(1 + f) = 2 atanh(f / (2 + f))``, ``k ln 2`` in two parts).
    Branch-free, unlike libdevice's ``logf``."""
    ix = x.to(tl.uint32, bitcast=True) + (0x3F800000 - 0x3F3504F3)
    k = (ix >> 23).to(tl.int32) - 0x7F
    f = ((ix & 0x007FFFFF) + 0x3F3504F3).to(tl.float32, bitcast=True) - 1.0
    s = f / (2.0 + f)
    z = s * s
    r = z * (0.66666666666 + z * (0.4 + z * (0.28571428571 + z * 0.22222222222)))
    kf = k.to(tl.float32)
    return kf * 0.6923828125 + (kf * 7.6436804e-4 + (f - s * (f - r)))


@triton.jit
def _sincos_0_2pi(x):
    """``(cos x, sin x)`` for ``x`` in [0, 2 pi]: ``sincos_0_2pi`` of csrc/poco_math.h (one
    reduction by pi/2 in three parts, Taylor polynomials on |r| <= pi/4, the quadrant by
    selects).  Branch-free: libdevice's ``cosf``/``sinf`` carry an inlined Payne-Hanek
    reduction for large arguments that a Box-Muller angle never needs."""
    q = (x * 0.63661975 + 12582912.0) - 12582912.0      # rint (1.5 * 2^23: round to even)
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
    """Box-Muller of two Philox words, both branches (``tl.pair_uniform_to_normal`` with
    the branch-free log, sine and cosine above)."""
    u1 = tl.maximum(tl.random.uint_to_uniform_float(wa), 1.0e-7)
    th = 6.283185307179586 * tl.random.uint_to_uniform_float(wb)
    if BRANCH_FREE:
        r = tl.sqrt(-2.0 * _log_pos(u1))
        c, s = _sincos_0_2pi(th)
    else:                   # (the interpreter: numpy's, see BRANCH_FREE)
        r = tl.sqrt(-2.0 * tl.log(u1))
        c = tl.cos(th)
        s = tl.sin(th)
    return r * c, r * s


@triton.jit
def _randn_v2(seed, pid, offset, counter, stream, BLOCK: tl.constexpr):
    """Version 2: the normals of elements ``offset + pid * BLOCK .. offset + pid * BLOCK +
    BLOCK - 1`` (``offset`` a multiple of 4), from the ``BLOCK // 4`` Philox calls that
    cover them: call ``q`` gives elements ``4q .. 4q + 3``, both Box-Muller branches of
    both word pairs (``tl.randn4x``), interleaved in element order by two joins and a
    reshape."""
    # (the sum first: the interpreter hands an int offset in [2^31, 2^32) over as a uint32)
    q = ((pid * BLOCK + offset) >> 2) + tl.arange(0, BLOCK // 4)
    c0 = (q & 0xFFFFFFFF).to(tl.uint32)
    c1 = (q >> 32).to(tl.uint32)
    zero = c0 * 0
    c2 = zero + counter.to(tl.uint32)
    c3 = zero + stream.to(tl.uint32)
    w0, w1, w2, w3 = tl.philox(seed, c0, c1, c2, c3)
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
    w0, w1, w2, w3 = tl.philox(seed, c0, c1, zero + counter.to(tl.uint32),
                               zero + stream.to(tl.uint32))
    hi = lane >= 2
    a, b = _normal_pair(tl.where(hi, w2, w0), tl.where(hi, w3, w1))
    return tl.where((lane & 1) == 0, a, b)


@triton.jit
def _noise(seed, idx, pid, offset, counter, stream, NOISE: tl.constexpr,
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
def _to_param(x, ptr):
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
def _store_state(ptr, idx, offset, x, mask, seed, counter, bucket, TAG: tl.constexpr,
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


@triton.jit
def _ivon_sigma(h, ess, wd):
    """Reference: ivon_sigma."""
    return 1.0 / tl.sqrt(ess * (h + wd))


@triton.jit
def _skip_flag(ctl_ptr, found_inf_ptr, HAS_FOUND_INF: tl.constexpr):
    """True when this update must not change the state: AMP overflow or a non-finite
    gradient seen by ``accumulate_kernel``."""
    skip = (tl.load(ctl_ptr + 2) != 0).to(tl.int32)
    if HAS_FOUND_INF:
        skip = tl.maximum(skip, (tl.load(found_inf_ptr) != 0).to(tl.int32))
    return skip


@triton.jit(do_not_specialize=_NO_SPEC)
def sample_kernel(param_ptr, centre_ptr, mean_ptr, h_ptr, sigma_ptr, ctl_ptr, n: tl.int64,
                  offset: tl.int64, seed: tl.int64, stream,
                  counter_slot, ess, wd, sigma_const, sign,
                  SIGMA_MODE: tl.constexpr, SYNC: tl.constexpr, NOISE: tl.constexpr,
                  SHARD: tl.constexpr, BLOCK: tl.constexpr):
    """Write the posterior sample ``theta = centre + sigma * sign * eps`` into the flat
    parameters, in their dtype.  ``SYNC``: the parameters hold the mean (float32
    parameters, torch.optim convention) and are first copied to the ``mean`` buffer,
    which is then the centre.  Reference: perturb, ivon_sigma."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    if SYNC:
        centre = tl.load(param_ptr + idx, mask=mask).to(tl.float32)
        tl.store(mean_ptr + idx, centre, mask=mask)
    else:
        centre = tl.load(centre_ptr + idx, mask=mask).to(tl.float32)   # (bfloat16: m_out)
    if SIGMA_MODE == 0:
        theta = centre
    else:
        if SIGMA_MODE == 1:
            sigma = _ivon_sigma(tl.load(h_ptr + idx, mask=mask, other=1.0), ess, wd)
        elif SIGMA_MODE == 2:
            sigma = tl.load(sigma_ptr + idx, mask=mask).to(tl.float32)
        else:
            sigma = sigma_const
        counter = tl.load(ctl_ptr + counter_slot)
        eps = _noise(seed, idx, pid, offset, counter, stream, NOISE, SHARD, BLOCK) * sign
        theta = centre + sigma * eps
    tl.store(param_ptr + idx, _to_param(theta, param_ptr), mask=mask)


@triton.jit(do_not_specialize=_NO_SPEC)
def accumulate_kernel(grad_ptr, acc_g_ptr, acc_ge_ptr, ctl_ptr, n: tl.int64, offset: tl.int64,
                      seed: tl.int64, stream, counter_slot,
                      sign, FIRST: tl.constexpr, GE: tl.constexpr, NOISE: tl.constexpr,
                      SHARD: tl.constexpr, BLOCK: tl.constexpr):
    """Fold one gradient (flat, parameter dtype) into the running sums of its sample kind:
    ``acc_g (+)= g``; with ``GE`` (several draws of the kind) also ``acc_ge += g * eps``
    of the active draw.  A non-finite gradient sets the control tensor's bad flag (one
    atomic per block that has one), so the update that follows is skipped on device."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    g = tl.load(grad_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    nonfinite = tl.sum(((g != g) | (tl.abs(g) == float("inf"))).to(tl.int32), axis=0)
    if nonfinite > 0:
        tl.atomic_max(ctl_ptr + 2, 1)
    if FIRST:
        tl.store(acc_g_ptr + idx, g, mask=mask)
    else:
        tl.store(acc_g_ptr + idx, tl.load(acc_g_ptr + idx, mask=mask) + g, mask=mask)
    if GE:
        ge = tl.load(acc_ge_ptr + idx, mask=mask)          # (loads before the noise)
        counter = tl.load(ctl_ptr + counter_slot)
        eps = _noise(seed, idx, pid, offset, counter, stream, NOISE, SHARD, BLOCK) * sign
        tl.store(acc_ge_ptr + idx, ge + g * eps, mask=mask)


@triton.jit
def check_kernel(grad_ptr, ctl_ptr, n: tl.int64, BLOCK: tl.constexpr):
    """Flag a non-finite gradient element in the control tensor (a gradient buffer adopted
    as its own sum: read only; one atomic per block that has one)."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    g = tl.load(grad_ptr + idx, mask=idx < n, other=0.0).to(tl.float32)
    nonfinite = tl.sum(((g != g) | (tl.abs(g) == float("inf"))).to(tl.int32), axis=0)
    if nonfinite > 0:
        tl.atomic_max(ctl_ptr + 2, 1)


@triton.jit(do_not_specialize=_NO_SPEC)
def fold_ge_kernel(acc_g_ptr, acc_ge_ptr, ctl_ptr, n: tl.int64, offset: tl.int64,
                   seed: tl.int64, stream, counter_slot, sign,
                   NOISE: tl.constexpr, SHARD: tl.constexpr, BLOCK: tl.constexpr):
    """``acc_ge = acc_g * eps`` of draw 0: when a second draw of a kind starts, the sum of
    ``g * eps`` that the update would otherwise regenerate is materialised."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    g = tl.load(acc_g_ptr + idx, mask=mask)
    counter = tl.load(ctl_ptr + counter_slot)
    eps = _noise(seed, idx, pid, offset, counter, stream, NOISE, SHARD, BLOCK) * sign
    tl.store(acc_ge_ptr + idx, g * eps, mask=mask)


@triton.jit
def _estimate(acc_ptr, idx, mask, scale):
    """Mean gradient of a sample kind (sum * 1/count * 1/grad_scale)."""
    return tl.load(acc_ptr + idx, mask=mask, other=0.0) * scale


@triton.jit(do_not_specialize=_NO_SPEC)
def step_kernel(
        # state (read and written)
        mean_ptr, param_ptr, s1_ptr, s2_ptr,
        # gradient sums of the inner (in) and outer (o) samples
        g_in_ptr, ge_in_ptr, g_o_ptr, ge_o_ptr,
        # outer state (read)
        g_out_ptr, h_out_ptr, m_out_ptr, sigma_out_ptr,
        # control
        ctl_ptr, found_inf_ptr, grad_scale_ptr,
        n: tl.int64, offset: tl.int64, seed: tl.int64, stream, stream_o,
        # StepHyper (poco_kernels/kernels/interface.py)
        sign_o, inv_n_in, inv_n_o,
        lr, beta1, beta2, wd, ess, alpha, hess_corr, floor, clip, momentum, dampening, eps,
        mom_first,
        # StepFlags
        FAMILY: tl.constexpr, CORR: tl.constexpr, GE_IN: tl.constexpr, GE_O: tl.constexpr,
        SHARED_NOISE: tl.constexpr, NEXT_SAMPLE: tl.constexpr, HESS_CORR: tl.constexpr,
        FLOOR: tl.constexpr,
        CLIP: tl.constexpr, DEBIAS: tl.constexpr, MOMENTUM: tl.constexpr,
        NESTEROV: tl.constexpr, HAS_FOUND_INF: tl.constexpr, HAS_SCALE: tl.constexpr,
        NOISE: tl.constexpr, SHARD: tl.constexpr, BLOCK: tl.constexpr):
    """One inner step of every optimizer of the diagonal family, in one pass.  The scalars
    and switches are the fields of ``StepStreams``, ``StepHyper`` and ``StepFlags``
    (:mod:`poco_kernels.kernels.interface`), by name.

    ``FAMILY_IVON`` (IVON, IVON-PoCo(Mo); ``s1`` = momentum ``g``, ``s2`` = Hessian ``h``):
    regenerate the inner (and outer) noise, form the Price Hessian estimates of both
    gradients, the control variates of gradient and Hessian, the optional floor, momentum,
    the positivity-preserving Hessian update, debiasing, weight decay, the
    Hessian-correction term, clipping, the mean; write the mean into the parameters.
    Reference: price_hessian, control_variate, hessian_floor, ivon_momentum, ivon_hessian,
    ivon_direction, ivon_hessian_correction, ivon_mean (``lr`` already ``ivon_lr``).
    ``NEXT_SAMPLE``: the parameters get the next step's inner sample (draw 0 of the inner
    stream at the new step count; this step's again when the update is skipped) instead
    of the mean, as ``sample_kernel`` computes it (reference: perturb, ivon_sigma).

    ``FAMILY_SGD`` (SVRG, alpha-SVRG, VSGD-PoCo; ``s1`` = momentum buffer): control
    variate, then torch.optim.SGD's update.  Reference: control_variate, sgd_step.

    ``FAMILY_ADAMW`` (alpha-SVRG over AdamW; ``s1`` = exp_avg, ``s2`` = exp_avg_sq):
    control variate, then torch.optim.AdamW's update.  Reference: adamw_step.

    The correction (``CORR``) is weighted by ``alpha`` once a refresh has been taken
    (``ctl[1] > 0``), by 0 before.  ``ctl[0]`` is the number of steps taken (the noise
    counter; ``t = ctl[0] + 1`` debiases).
    """
    tl.static_assert(not (SHARED_NOISE and GE_IN), "shared noise is regenerated, not summed")
    tl.static_assert(not NEXT_SAMPLE or FAMILY == 0, "the next sample is IVON's")
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    skip = _skip_flag(ctl_ptr, found_inf_ptr, HAS_FOUND_INF)
    wmask = mask & ((idx * 0 + skip) == 0)   # (a scalar mask, broadcast explicitly)
    steps = tl.load(ctl_ptr + 0)
    t = (steps + 1).to(tl.float32)
    scale = 1.0
    if HAS_SCALE:
        scale = 1.0 / tl.load(grad_scale_ptr).to(tl.float32)

    m = tl.load(mean_ptr + idx, mask=mask, other=0.0)
    g_in = _estimate(g_in_ptr, idx, mask, inv_n_in * scale)
    ghat = g_in
    if CORR:
        a = tl.where(tl.load(ctl_ptr + 1) > 0, alpha, 0.0)
        g_o = _estimate(g_o_ptr, idx, mask, inv_n_o * scale)
        g_out = tl.load(g_out_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        ghat = g_in - a * (g_o - g_out)

    if FAMILY == 0:
        # every load is issued before the noise (Philox and the transform are ~100
        # instructions per element: the loads' latency hides behind them)
        g = tl.load(s1_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        h = tl.load(s2_ptr + idx, mask=mask, other=1.0)
        if GE_IN:
            ge_in = _estimate(ge_in_ptr, idx, mask, inv_n_in * scale)
        if CORR:
            if GE_O:
                ge_o = _estimate(ge_o_ptr, idx, mask, inv_n_o * scale)
            sigma_out = tl.load(sigma_out_ptr + idx, mask=mask, other=1.0).to(tl.float32)
            h_out = tl.load(h_out_ptr + idx, mask=mask, other=0.0).to(tl.float32)
            if HESS_CORR:
                m_out = tl.load(m_out_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        sigma = _ivon_sigma(h, ess, wd)
        if not GE_IN:
            eps_i = _noise(seed, idx, pid, offset, steps, stream, NOISE, SHARD, BLOCK)
            ge_in = g_in * eps_i
        hhat = ge_in / sigma
        extra = 0.0
        if CORR:
            if not GE_O:
                if SHARED_NOISE:
                    eps_o = eps_i
                else:
                    eps_o = _noise(seed, idx, pid, offset, steps, stream_o, NOISE, SHARD,
                                   BLOCK)
                ge_o = g_o * (eps_o * sign_o)
            h_o = ge_o / sigma_out
            hhat = hhat - a * (h_o - h_out)
            if FLOOR:
                hhat = tl.maximum(hhat, -floor * (h + wd))
            if HESS_CORR:
                extra = (hess_corr * a) * (h_out - h_o) * (m - m_out)
        g_new = beta1 * g + (1.0 - beta1) * ghat
        d = h - hhat
        h_new = (beta2 * h + (1.0 - beta2) * hhat
                 + (0.5 * (1.0 - beta2) * (1.0 - beta2)) * d * d / (h + wd))
        if DEBIAS:
            gbar = g_new / (1.0 - tl.exp2(t * tl.log2(beta1)))
        else:
            gbar = g_new
        u = (gbar + wd * m + extra) / (h_new + wd)
        if CLIP:
            u = tl.minimum(tl.maximum(u, -clip), clip)
        m_new = m - lr * u
        _store_state(s1_ptr, idx, offset, g_new, wmask, seed, steps, stream >> 16, 0, SHARD)
        tl.store(s2_ptr + idx, h_new, mask=wmask)
        h_param = tl.where(wmask, h_new, h)
    elif FAMILY == 1:
        d_p = ghat + wd * m
        if MOMENTUM:
            buf = tl.load(s1_ptr + idx, mask=mask, other=0.0)
            buf = tl.where(mom_first != 0, d_p, momentum * buf + (1.0 - dampening) * d_p)
            tl.store(s1_ptr + idx, buf, mask=wmask)
            if NESTEROV:
                d_p = d_p + momentum * buf
            else:
                d_p = buf
        m_new = m - lr * d_p
        h_param = m
    else:
        ea = tl.load(s1_ptr + idx, mask=mask, other=0.0)
        eas = tl.load(s2_ptr + idx, mask=mask, other=0.0)
        m_dec = m * (1.0 - lr * wd)
        ea = ea + (1.0 - beta1) * (ghat - ea)
        eas = beta2 * eas + (1.0 - beta2) * ghat * ghat
        bc1 = 1.0 - tl.exp2(t * tl.log2(beta1))
        bc2 = 1.0 - tl.exp2(t * tl.log2(beta2))
        denom = tl.sqrt(eas) / tl.sqrt(bc2) + eps
        m_new = m_dec - (lr / bc1) * ea / denom
        tl.store(s1_ptr + idx, ea, mask=wmask)
        tl.store(s2_ptr + idx, eas, mask=wmask)
        h_param = m
    tl.store(mean_ptr + idx, m_new, mask=wmask)
    # the parameters always get the mean back (the old one when the update is skipped), or
    # with NEXT_SAMPLE the inner sample of the state they keep
    m_param = tl.where(wmask, m_new, m)
    if NEXT_SAMPLE:
        eps_next = _noise(seed, idx, pid, offset, steps + 1 - skip, stream, NOISE, SHARD,
                          BLOCK)
        m_param = m_param + _ivon_sigma(h_param, ess, wd) * eps_next
    tl.store(param_ptr + idx, _to_param(m_param, param_ptr), mask=mask)


@triton.jit(do_not_specialize=_NO_SPEC)
def refresh_kernel(mean_ptr, h_ptr, acc_g_ptr, acc_ge_ptr, g_out_ptr, h_out_ptr, m_out_ptr,
                   sigma_out_ptr, ctl_ptr, found_inf_ptr, grad_scale_ptr,
                   n: tl.int64, offset: tl.int64, seed: tl.int64, stream,
                   # RefreshHyper (poco_kernels/kernels/interface.py)
                   inv_n, ess, wd, rho1, rho2, sigma,
                   # RefreshFlags
                   FAMILY: tl.constexpr, GE: tl.constexpr, NOISY: tl.constexpr,
                   HAS_FOUND_INF: tl.constexpr, HAS_SCALE: tl.constexpr, NOISE: tl.constexpr,
                   SHARD: tl.constexpr, BLOCK: tl.constexpr):
    """The outer refresh, one pass.

    ``FAMILY_IVON``: ``sigma``, the Price Hessian of the mega-batch gradient (noise of the
    refresh sample regenerated unless several draws were summed, ``GE``), the outer folds
    with outer momentum (the first refresh takes the estimate as it is), the snapshot
    ``m_out = m``, ``sigma_out = sigma``.  Reference: ivon_sigma, price_hessian, outer_fold.

    ``FAMILY_SGD``/``FAMILY_ADAMW``: ``g_out = gM`` and the refresh point
    ``theta_out = m (+ sigma eps)`` (``m_out_ptr``; ``sigma`` the constant of VSGD-PoCo).
    Reference: perturb.
    """
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    skip = _skip_flag(ctl_ptr, found_inf_ptr, HAS_FOUND_INF)
    wmask = mask & ((idx * 0 + skip) == 0)   # (a scalar mask, broadcast explicitly)
    scale = 1.0
    if HAS_SCALE:
        scale = 1.0 / tl.load(grad_scale_ptr).to(tl.float32)
    refreshes = tl.load(ctl_ptr + 1)
    m = tl.load(mean_ptr + idx, mask=mask, other=0.0)
    gM = _estimate(acc_g_ptr, idx, mask, inv_n * scale)
    if FAMILY == 0:
        h = tl.load(h_ptr + idx, mask=mask, other=1.0)
        g_old = tl.load(g_out_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        h_old = tl.load(h_out_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        if GE:
            geM = _estimate(acc_ge_ptr, idx, mask, inv_n * scale)
        sigma_r = _ivon_sigma(h, ess, wd)
        if not GE:
            geM = gM * _noise(seed, idx, pid, offset, refreshes, stream, NOISE, SHARD,
                              BLOCK)
        hM = geM / sigma_r
        first = refreshes == 0
        g_new = tl.where(first, gM, rho1 * g_old + (1.0 - rho1) * gM)
        h_new = tl.where(first, hM, rho2 * h_old + (1.0 - rho2) * hM)
        # (bfloat16 buffers, state_dtype: stochastically rounded, tags of noise.ROUND_TAGS)
        bucket = stream >> 16
        _store_state(g_out_ptr, idx, offset, g_new, wmask, seed, refreshes, bucket, 1, SHARD)
        _store_state(h_out_ptr, idx, offset, h_new, wmask, seed, refreshes, bucket, 2, SHARD)
        _store_state(m_out_ptr, idx, offset, m, wmask, seed, refreshes, bucket, 3, SHARD)
        _store_state(sigma_out_ptr, idx, offset, sigma_r, wmask, seed, refreshes, bucket, 4,
                     SHARD)
    else:
        tl.store(g_out_ptr + idx, gM, mask=wmask)
        if NOISY:
            theta = m + sigma * _noise(seed, idx, pid, offset, refreshes, stream, NOISE,
                                       SHARD, BLOCK)
        else:
            theta = m
        tl.store(m_out_ptr + idx, theta, mask=wmask)


@triton.jit(do_not_specialize=_NO_SPEC)
def finish_kernel(ctl_ptr, found_inf_ptr, slot, HAS_FOUND_INF: tl.constexpr):
    """After an update: advance the counter in ``slot`` (steps or refreshes) unless the
    update was skipped, count skipped updates, clear the bad-gradient flag."""
    skip = _skip_flag(ctl_ptr, found_inf_ptr, HAS_FOUND_INF)
    s = skip.to(tl.int64)
    tl.store(ctl_ptr + slot, tl.load(ctl_ptr + slot) + 1 - s)
    tl.store(ctl_ptr + 3, tl.load(ctl_ptr + 3) + s)
    tl.store(ctl_ptr + 2, s * 0)
