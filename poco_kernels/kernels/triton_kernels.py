"""Triton kernels of the family, over flat per-bucket buffers.

Each kernel is the fused form of reference functions; the ``Reference:`` line of each
names them (:mod:`poco_kernels.reference`), and ``tests/test_kernels.py`` checks
each against them.  Host wrappers (launch, torch custom-op registration) are in
:mod:`poco_kernels.kernels.triton_ops`; the noise and the stored bits in
:mod:`poco_kernels.kernels.triton_noise`.

**Each kernel is the op-for-op twin of its C++ kernel** (``csrc/kernels_impl.h``): the
same float32 operations in the same order, on the same float32 constants, which both
compute in double from the float64 hyperparameters as ``csrc/ops.cpp`` does
(:func:`_step_constants`, :func:`_refresh_constants`).  Compiled without floating-point
contraction and with correctly rounded division and square root (``triton_ops``
launches with ``enable_fp_fusion=False``; ``tl.div_rn``, ``tl.sqrt_rn`` here), a kernel on
a GPU, the same kernel under Triton's interpreter and the C++ kernel give the same bits
(``tests/test_kernels.py`` compares the interpreter with C++ bit for bit;
``benchmarks/bench_gpu.py`` the GPU with the interpreter).

Conventions shared by all kernels:

* element indices are int64 (``pid * BLOCK + arange``, pid widened first), so buffers
  above 2**31 elements work;
* state is float32 (the buffer pointers' dtype), parameters and gradients float32,
  bfloat16 or float16 (cast on load and store); with ``state_dtype=torch.bfloat16`` the
  IVON family's momentum and outer buffers are bfloat16 (widened on load, stored with
  stochastic rounding, ``store_state``);
* the noise ``eps`` is regenerated, never stored: Philox4x32-10 keyed by ``seed`` with
  counters ``(call low word, call high word, counter, stream)``, exactly
  :func:`poco_kernels.noise.randn` of the stream definition ``NOISE`` (2: four normals per
  call; 1: one per element), transformed by the C++ kernels' branch-free log and
  sine/cosine; ``counter`` (the step or refresh count) is read from the device control
  tensor ``ctl`` so no host value changes per step;
* ``ctl`` (int64, per device): ``[steps taken, refreshes taken, bad-gradient flag,
  skipped updates]``.  An update reads ``found_inf`` (AMP) and the bad flag and, when
  either is set, writes no state (the parameters get the old mean back);
  :func:`finish_kernel` then advances the counters and clears the flag;
* hyperparameters are read from a float64 row on the device (``hp_ptr``: one value per
  field of ``StepHyper``, ``RefreshHyper`` or ``SampleHyper``,
  :mod:`poco_kernels.kernels.interface`): a new learning rate neither recompiles nor
  changes a launch argument, so a captured CUDA graph replays with the current values.
  Only the code path (which terms exist) is ``constexpr``.
"""
import triton
import triton.language as tl

# the code-path constants and the control-tensor layout, shared with the C++ kernels
from .interface import (CTL_BAD, CTL_REFRESHES, CTL_SIZE, CTL_SKIPPED,  # noqa: F401
                        CTL_STEPS, FAMILY_ADAMW, FAMILY_IVON, FAMILY_SGD, SIGMA_BUFFER,
                        SIGMA_CONST, SIGMA_IVON, SIGMA_NONE)
from .triton_noise import noise as _noise
from .triton_noise import store_state as _store_state
from .triton_noise import to_param as _to_param

# (the kernels read these by name; Triton takes module globals as constexpr only)
FAMILY_IVON, FAMILY_SGD, FAMILY_ADAMW = (tl.constexpr(v) for v in (FAMILY_IVON, FAMILY_SGD,
                                                                  FAMILY_ADAMW))
SIGMA_NONE, SIGMA_IVON, SIGMA_BUFFER, SIGMA_CONST = (
    tl.constexpr(v) for v in (SIGMA_NONE, SIGMA_IVON, SIGMA_BUFFER, SIGMA_CONST))

BLOCK = 1024
NUM_WARPS = 4

# Where each field of the hyperparameter rows is (the records' field order, which
# tests/test_architecture.py checks against interface.py and csrc/poco_kernels.h).
STEP_HP = ("sign_o", "inv_n_in", "inv_n_o", "lr", "beta1", "beta2", "wd", "ess", "alpha",
           "hess_corr", "floor", "clip", "momentum", "dampening", "eps", "mom_first")
(S_SIGN_O, S_INV_N_IN, S_INV_N_O, S_LR, S_BETA1, S_BETA2, S_WD, S_ESS, S_ALPHA, S_HESS_CORR,
 S_FLOOR, S_CLIP, S_MOMENTUM, S_DAMPENING, S_EPS, S_MOM_FIRST) = (
    tl.constexpr(i) for i in range(len(STEP_HP)))
REFRESH_HP = ("inv_n", "ess", "wd", "rho1", "rho2", "sigma")
R_INV_N, R_ESS, R_WD, R_RHO1, R_RHO2, R_SIGMA = (tl.constexpr(i) for i in range(len(REFRESH_HP)))
SAMPLE_HP = ("ess", "wd", "sigma")
P_ESS, P_WD, P_SIGMA = (tl.constexpr(i) for i in range(len(SAMPLE_HP)))

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
_NO_SPEC = ["seed", "stream", "stream_o", "counter_slot", "slot", "offset", "counter"]


# --------------------------------------------------------------------------- scalars
@triton.jit
def _pow_steps(b, e):
    """``b ** e`` for a float64 ``b`` and an int64 ``e >= 0``, by squaring: ``pow_steps``
    of csrc/ops.cpp, multiplication for multiplication."""
    r = b * 0.0 + 1.0
    while e > 0:
        r = tl.where((e & 1) != 0, r * b, r)
        b = b * b
        e = e >> 1
    return r


@triton.jit
def _ivon_sigma(h, ess, wd):
    """Reference: ivon_sigma (``1.0f / sqrtf(ess * (h + wd))``)."""
    return tl.div_rn(1.0, tl.sqrt_rn(ess * (h + wd)))


@triton.jit
def _skip_flag(ctl_ptr, found_inf_ptr, HAS_FOUND_INF: tl.constexpr):
    """True when this update must not change the state: AMP overflow or a non-finite
    gradient seen by ``accumulate_kernel``."""
    skip = (tl.load(ctl_ptr + 2) != 0).to(tl.int32)
    if HAS_FOUND_INF:
        skip = tl.maximum(skip, (tl.load(found_inf_ptr) != 0).to(tl.int32))
    return skip


@triton.jit
def _inv_scale(grad_scale_ptr, HAS_SCALE: tl.constexpr):
    """``1.0f / (float)grad_scale`` (1 without AMP)."""
    inv = 1.0
    if HAS_SCALE:
        inv = tl.div_rn(1.0, tl.load(grad_scale_ptr).to(tl.float32))
    return inv


@triton.jit
def _step_constants(hp_ptr, steps, refreshes, CORR: tl.constexpr, FLOOR: tl.constexpr,
                    CLIP: tl.constexpr, DEBIAS: tl.constexpr, FAMILY: tl.constexpr):
    """The float32 constants of a step from its float64 row and the counters, each
    computed in double and rounded once (``.to(tl.float32)``: ``(float)x`` of C++), as
    ``step_op`` of csrc/ops.cpp computes them.  (Written inline: under the interpreter
    every call of a jit function costs about a millisecond.)"""
    f32 = tl.float32
    alpha = tl.load(hp_ptr + S_ALPHA)
    if CORR:
        alpha = tl.where(refreshes > 0, alpha, 0.0)   # the correction once a refresh is taken
    else:
        alpha = alpha * 0.0
    beta1 = tl.load(hp_ptr + S_BETA1)
    beta2 = tl.load(hp_ptr + S_BETA2)
    lr = tl.load(hp_ptr + S_LR)
    wd = tl.load(hp_ptr + S_WD)
    t = steps + 1
    one = (beta1 * 0.0 + 1.0).to(f32)
    inv_bias1 = one
    if DEBIAS:
        inv_bias1 = (1.0 / (1.0 - _pow_steps(beta1, t))).to(f32)    # (float64: div.rn.f64)
    neg_floor = one * float("-inf")
    if FLOOR:
        neg_floor = (-tl.load(hp_ptr + S_FLOOR)).to(f32)
    clip = one * float("inf")
    if CLIP:
        clip = tl.load(hp_ptr + S_CLIP).to(f32)
    decay = one
    step_size = one
    bias2_sqrt = one
    if FAMILY == FAMILY_ADAMW:
        bc1 = 1.0 - _pow_steps(beta1, t)
        bc2 = 1.0 - _pow_steps(beta2, t)
        decay = (1.0 - lr * wd).to(f32)
        step_size = (lr / bc1).to(f32)
        bias2_sqrt = tl.sqrt(bc2).to(f32)                            # (float64: sqrt.rn.f64)
    return (alpha.to(f32), lr.to(f32), beta1.to(f32), (1.0 - beta1).to(f32), beta2.to(f32),
            (1.0 - beta2).to(f32), (0.5 * (1.0 - beta2) * (1.0 - beta2)).to(f32), wd.to(f32),
            tl.load(hp_ptr + S_ESS).to(f32), (tl.load(hp_ptr + S_HESS_CORR) * alpha).to(f32),
            neg_floor, clip, inv_bias1, tl.load(hp_ptr + S_MOMENTUM).to(f32),
            (1.0 - tl.load(hp_ptr + S_DAMPENING)).to(f32), decay, step_size, bias2_sqrt,
            tl.load(hp_ptr + S_EPS).to(f32))


# --------------------------------------------------------------------------- kernels
@triton.jit(do_not_specialize=_NO_SPEC)
def sample_kernel(param_ptr, centre_ptr, mean_ptr, h_ptr, sigma_ptr, ctl_ptr, hp_ptr,
                  n: tl.int64, offset: tl.int64, seed: tl.int64, stream,
                  counter_slot, sign,
                  SIGMA_MODE: tl.constexpr, SYNC: tl.constexpr, NOISE: tl.constexpr,
                  SHARD: tl.constexpr, BLOCK: tl.constexpr):
    """Write the posterior sample ``theta = centre + sigma * sign * eps`` into the flat
    parameters, in their dtype (``hp_ptr``: the ``SampleHyper`` row).  ``SYNC``: the
    parameters hold the mean (float32 parameters, torch.optim convention) and are first
    copied to the ``mean`` buffer, which is then the centre.  Reference: perturb,
    ivon_sigma."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    if SYNC:
        centre = tl.load(param_ptr + idx, mask=mask).to(tl.float32)
        tl.store(mean_ptr + idx, centre, mask=mask)
    else:
        centre = tl.load(centre_ptr + idx, mask=mask).to(tl.float32)   # (bfloat16: m_out)
    if SIGMA_MODE == SIGMA_NONE:
        theta = centre
    else:
        if SIGMA_MODE == SIGMA_IVON:
            sigma = _ivon_sigma(tl.load(h_ptr + idx, mask=mask, other=1.0),
                                tl.load(hp_ptr + P_ESS).to(tl.float32),
                                tl.load(hp_ptr + P_WD).to(tl.float32))
        elif SIGMA_MODE == SIGMA_BUFFER:
            sigma = tl.load(sigma_ptr + idx, mask=mask).to(tl.float32)
        else:
            sigma = tl.load(hp_ptr + P_SIGMA).to(tl.float32)
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


@triton.jit(do_not_specialize=_NO_SPEC)
def randn_kernel(out_ptr, n: tl.int64, offset: tl.int64, seed: tl.int64, counter, stream,
                 NOISE: tl.constexpr, SHARD: tl.constexpr, BLOCK: tl.constexpr):
    """``out[i]`` = the normal of element ``offset + i`` of stream ``(seed, counter,
    stream)``: :func:`poco_kernels.noise.randn` by the kernels' own noise code (the C++
    kernels' ``randn``)."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    eps = _noise(seed, idx, pid, offset, counter, stream, NOISE, SHARD, BLOCK)
    tl.store(out_ptr + idx, eps, mask=idx < n)


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
        # control; the StepHyper row (poco_kernels/kernels/interface.py)
        ctl_ptr, found_inf_ptr, grad_scale_ptr, hp_ptr,
        # StepStreams
        n: tl.int64, offset: tl.int64, seed: tl.int64, stream, stream_o,
        # StepFlags
        FAMILY: tl.constexpr, CORR: tl.constexpr, GE_IN: tl.constexpr, GE_O: tl.constexpr,
        SHARED_NOISE: tl.constexpr, NEXT_SAMPLE: tl.constexpr, HESS_CORR: tl.constexpr,
        FLOOR: tl.constexpr,
        CLIP: tl.constexpr, DEBIAS: tl.constexpr, MOMENTUM: tl.constexpr,
        NESTEROV: tl.constexpr, HAS_FOUND_INF: tl.constexpr, HAS_SCALE: tl.constexpr,
        NOISE: tl.constexpr, SHARD: tl.constexpr, BLOCK: tl.constexpr):
    """One inner step of every optimizer of the diagonal family, in one pass: ``step_ivon``,
    ``step_sgd`` and ``step_adamw`` of csrc/kernels_impl.h, operation for operation.  The
    switches are the fields of ``StepFlags``, the scalars those of the ``StepHyper`` row
    (:mod:`poco_kernels.kernels.interface`).

    ``FAMILY_IVON`` (IVON, IVON-PoCo(Mo); ``s1`` = momentum ``g``, ``s2`` = Hessian ``h``):
    regenerate the inner (and outer) noise, form the Price Hessian estimates of both
    gradients, the control variates of gradient and Hessian, the optional floor, momentum,
    the positivity-preserving Hessian update, debiasing, weight decay, the
    Hessian-correction term, clipping, the mean; write the mean into the parameters.
    Reference: price_hessian, control_variate, hessian_floor, ivon_momentum, ivon_hessian,
    ivon_direction, ivon_hessian_correction, ivon_mean (``lr`` already ``ivon_lr``).  Two
    divisions of the reference are multiplications, as in C++ (``g eps / sigma = g eps
    sqrt(ess (h + wd))``; ``g / (1 - beta1^t)`` by its reciprocal, rounded once).
    ``NEXT_SAMPLE``: the parameters get the next step's inner sample (draw 0 of the inner
    stream at the new step count; this step's again when the update is skipped) instead
    of the mean, as ``sample_kernel`` computes it (reference: perturb, ivon_sigma).

    ``FAMILY_SGD`` (SVRG, alpha-SVRG, VSGD-PoCo; ``s1`` = momentum buffer): control
    variate, then torch.optim.SGD's update.  Reference: control_variate, sgd_step.

    ``FAMILY_ADAMW`` (alpha-SVRG over AdamW; ``s1`` = exp_avg, ``s2`` = exp_avg_sq):
    control variate, then torch.optim.AdamW's update (``torch.lerp``'s two formulas).
    Reference: adamw_step.

    The correction (``CORR``) is weighted by ``alpha`` once a refresh has been taken
    (``ctl[1] > 0``), by 0 before.  ``ctl[0]`` is the number of steps taken (the noise
    counter; ``t = ctl[0] + 1`` debiases).
    """
    tl.static_assert(not (SHARED_NOISE and GE_IN), "shared noise is regenerated, not summed")
    tl.static_assert(not NEXT_SAMPLE or FAMILY == FAMILY_IVON, "the next sample is IVON's")
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    skip = _skip_flag(ctl_ptr, found_inf_ptr, HAS_FOUND_INF)
    wmask = mask & ((idx * 0 + skip) == 0)   # (a scalar mask, broadcast explicitly)
    steps = tl.load(ctl_ptr + 0)
    (alpha, lr, beta1, one_m_beta1, beta2, one_m_beta2, half_sq, wd, ess, hca, neg_floor,
     clip, inv_bias1, momentum, one_m_damp, decay, step_size, bias2_sqrt,
     eps) = _step_constants(hp_ptr, steps, tl.load(ctl_ptr + 1), CORR, FLOOR, CLIP, DEBIAS,
                            FAMILY)
    inv_gs = _inv_scale(grad_scale_ptr, HAS_SCALE)
    scale_in = tl.load(hp_ptr + S_INV_N_IN).to(tl.float32) * inv_gs
    scale_o = tl.load(hp_ptr + S_INV_N_O).to(tl.float32) * inv_gs

    m = tl.load(mean_ptr + idx, mask=mask, other=0.0)
    g_in = _estimate(g_in_ptr, idx, mask, scale_in)
    ghat = g_in
    if CORR:
        g_o = _estimate(g_o_ptr, idx, mask, scale_o)
        g_out = tl.load(g_out_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        ghat = g_in - alpha * (g_o - g_out)

    if FAMILY == FAMILY_IVON:
        # every load is issued before the noise (Philox and the transform are ~100
        # instructions per element: the loads' latency hides behind them)
        g = tl.load(s1_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        h = tl.load(s2_ptr + idx, mask=mask, other=1.0)
        if GE_IN:
            ge_in = _estimate(ge_in_ptr, idx, mask, scale_in)
        if CORR:
            if GE_O:
                ge_o = _estimate(ge_o_ptr, idx, mask, scale_o)
            sigma_out = tl.load(sigma_out_ptr + idx, mask=mask, other=1.0).to(tl.float32)
            h_out = tl.load(h_out_ptr + idx, mask=mask, other=0.0).to(tl.float32)
            if HESS_CORR:
                m_out = tl.load(m_out_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        if not GE_IN:
            eps_i = _noise(seed, idx, pid, offset, steps, stream, NOISE, SHARD, BLOCK)
            ge_in = g_in * eps_i
        inv_sigma = tl.sqrt_rn(ess * (h + wd))          # 1 / sigma, unrounded
        hhat = ge_in * inv_sigma
        extra = 0.0
        if CORR:
            if not GE_O:
                if SHARED_NOISE:
                    eps_o = eps_i
                else:
                    eps_o = _noise(seed, idx, pid, offset, steps, stream_o, NOISE, SHARD,
                                   BLOCK)
                ge_o = g_o * (eps_o * tl.load(hp_ptr + S_SIGN_O).to(tl.float32))
            h_o = tl.div_rn(ge_o, sigma_out)
            hhat = hhat - alpha * (h_o - h_out)
            fl = neg_floor * (h + wd)                  # -inf without a floor: a no-op
            hhat = tl.where(hhat < fl, fl, hhat)
            if HESS_CORR:
                extra = hca * (h_out - h_o) * (m - m_out)
        g_new = beta1 * g + one_m_beta1 * ghat
        d = h - hhat
        h_new = (beta2 * h + one_m_beta2 * hhat) + tl.div_rn(half_sq * (d * d), h + wd)
        num = g_new * inv_bias1 + wd * m
        if HESS_CORR:
            num = num + extra
        u = tl.div_rn(num, h_new + wd)
        u = tl.where(u < -clip, -clip, tl.where(u > clip, clip, u))   # inf: no clipping
        m_new = m - lr * u
        _store_state(s1_ptr, idx, offset, g_new, wmask, seed, steps, stream >> 16, 0, SHARD)
        tl.store(s2_ptr + idx, h_new, mask=wmask)
        h_param = tl.where(wmask, h_new, h)
    elif FAMILY == FAMILY_SGD:
        d_p = ghat + wd * m
        if MOMENTUM:
            buf = tl.load(s1_ptr + idx, mask=mask, other=0.0)
            buf = tl.where(tl.load(hp_ptr + S_MOM_FIRST) != 0.0, d_p,
                           momentum * buf + one_m_damp * d_p)
            tl.store(s1_ptr + idx, buf, mask=wmask)
            if NESTEROV:
                d_p = d_p + momentum * buf
            else:
                d_p = buf
        m_new = m - lr * d_p
        h_param = m
    else:
        ea0 = tl.load(s1_ptr + idx, mask=mask, other=0.0)
        eas0 = tl.load(s2_ptr + idx, mask=mask, other=0.0)
        m_dec = m * decay
        ea = tl.where(one_m_beta1 < 0.5, ea0 + one_m_beta1 * (ghat - ea0),
                      ghat - (ghat - ea0) * (1.0 - one_m_beta1))      # torch.lerp's two
        eas = eas0 * beta2 + one_m_beta2 * ghat * ghat
        denom = tl.div_rn(tl.sqrt_rn(eas), bias2_sqrt) + eps
        m_new = m_dec - step_size * tl.div_rn(ea, denom)
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
                   sigma_out_ptr, ctl_ptr, found_inf_ptr, grad_scale_ptr, hp_ptr,
                   n: tl.int64, offset: tl.int64, seed: tl.int64, stream,
                   # RefreshFlags
                   FAMILY: tl.constexpr, GE: tl.constexpr, NOISY: tl.constexpr,
                   HAS_FOUND_INF: tl.constexpr, HAS_SCALE: tl.constexpr, NOISE: tl.constexpr,
                   SHARD: tl.constexpr, BLOCK: tl.constexpr):
    """The outer refresh, one pass: ``refresh_ivon`` and ``refresh_sgd`` of
    csrc/kernels_impl.h, operation for operation (``hp_ptr``: the ``RefreshHyper`` row).

    ``FAMILY_IVON``: ``sigma``, the Price Hessian of the mega-batch gradient (noise of the
    refresh sample regenerated unless several draws were summed, ``GE``), the outer folds
    with outer momentum (the first refresh, or an outer momentum of 0, takes the estimate
    as it is), the snapshot ``m_out = m``, ``sigma_out = sigma``.  Reference: ivon_sigma,
    price_hessian, outer_fold.

    ``FAMILY_SGD``/``FAMILY_ADAMW``: ``g_out = gM`` and the refresh point
    ``theta_out = m (+ sigma eps)`` (``m_out_ptr``; ``sigma`` the constant of VSGD-PoCo).
    Reference: perturb.
    """
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    skip = _skip_flag(ctl_ptr, found_inf_ptr, HAS_FOUND_INF)
    wmask = mask & ((idx * 0 + skip) == 0)   # (a scalar mask, broadcast explicitly)
    scale = tl.load(hp_ptr + R_INV_N).to(tl.float32) * _inv_scale(grad_scale_ptr, HAS_SCALE)
    refreshes = tl.load(ctl_ptr + 1)
    m = tl.load(mean_ptr + idx, mask=mask, other=0.0)
    gM = _estimate(acc_g_ptr, idx, mask, scale)
    if FAMILY == FAMILY_IVON:
        ess = tl.load(hp_ptr + R_ESS).to(tl.float32)
        wd = tl.load(hp_ptr + R_WD).to(tl.float32)
        rho1 = tl.load(hp_ptr + R_RHO1)
        rho2 = tl.load(hp_ptr + R_RHO2)
        r1, r2 = rho1.to(tl.float32), rho2.to(tl.float32)
        omr1, omr2 = (1.0 - rho1).to(tl.float32), (1.0 - rho2).to(tl.float32)
        h = tl.load(h_ptr + idx, mask=mask, other=1.0)
        g_old = tl.load(g_out_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        h_old = tl.load(h_out_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        if GE:
            geM = _estimate(acc_ge_ptr, idx, mask, scale)
        sigma_r = _ivon_sigma(h, ess, wd)
        if not GE:
            geM = gM * _noise(seed, idx, pid, offset, refreshes, stream, NOISE, SHARD,
                              BLOCK)
        hM = tl.div_rn(geM, sigma_r)
        keep_g = (refreshes == 0) | (r1 == 0.0)
        keep_h = (refreshes == 0) | (r2 == 0.0)
        g_new = tl.where(keep_g, gM, r1 * g_old + omr1 * gM)
        h_new = tl.where(keep_h, hM, r2 * h_old + omr2 * hM)
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
            theta = m + tl.load(hp_ptr + R_SIGMA).to(tl.float32) * _noise(
                seed, idx, pid, offset, refreshes, stream, NOISE, SHARD, BLOCK)
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
