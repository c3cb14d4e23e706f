"""The step and refresh kernels of the family (the conventions of every kernel are in
:mod:`~poco_kernels.kernels.triton_kernels`'s docstring)."""
import triton
import triton.language as tl

from .triton_common import (FAMILY_IVON, FAMILY_SGD, R_ESS, R_INV_N, R_RHO1, R_RHO2, R_SIGMA,
                            R_WD, S_INV_N_IN, S_INV_N_AT_OUT, S_MOM_FIRST, S_SIGN_AT_OUT, _NO_SPEC,
                            _inv_scale, _ivon_sigma, _noise, _skip_flag, _step_constants,
                            _store_state, _place, _to_param)


@triton.jit
def _estimate(acc_ptr, idx, mask, scale):
    """Mean gradient of a sample kind (sum * 1/count * 1/grad_scale)."""
    return tl.load(acc_ptr + idx, mask=mask, other=0.0) * scale


@triton.jit(do_not_specialize=_NO_SPEC)
def step_kernel(
        # state (read and written)
        mean_ptr, param_ptr, s1_ptr, s2_ptr,
        # gradient sums of the inner (in) and outer (o) samples
        g_in_ptr, ge_in_ptr, g_at_out_ptr, ge_at_out_ptr,
        # outer state (read)
        g_out_ptr, h_out_ptr, m_out_ptr, sigma_out_ptr,
        # control; a sharded bucket's shards (TILED: triton_kernels' module docstring); the
        # StepHyper row (poco_kernels/kernels/interface.py)
        ctl_ptr, found_inf_ptr, grad_scale_ptr, tiles_ptr, chunks_ptr, hp_ptr,
        # StepStreams
        n: tl.int64, offset: tl.int64, seed: tl.int64, stream, stream_at_out,
        # StepFlags
        FAMILY: tl.constexpr, CORR: tl.constexpr, GE_IN: tl.constexpr, GE_AT_OUT: tl.constexpr,
        SHARED_NOISE: tl.constexpr, NEXT_SAMPLE: tl.constexpr, HESS_CORR: tl.constexpr,
        FLOOR: tl.constexpr,
        CLIP: tl.constexpr, DEBIAS: tl.constexpr, MOMENTUM: tl.constexpr,
        NESTEROV: tl.constexpr, HAS_FOUND_INF: tl.constexpr, HAS_SCALE: tl.constexpr,
        NOISE: tl.constexpr, SHARD: tl.constexpr, TILED: tl.constexpr, BLOCK: tl.constexpr):
    """One inner step of every optimizer of the diagonal family, in one pass: ``step_ivon``,
    ``step_sgd`` and ``step_adamw`` of csrc/kernels_step.h, operation for operation.  The
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
    idx, mask, offset, pp = _place(param_ptr, tiles_ptr, chunks_ptr, pid, n, offset, SHARD,
                                   TILED, BLOCK)
    skip = _skip_flag(ctl_ptr, found_inf_ptr, HAS_FOUND_INF)
    wmask = mask & ((idx * 0 + skip) == 0)   # (a scalar mask, broadcast explicitly)
    steps = tl.load(ctl_ptr + 0)
    (alpha, lr, beta1, one_m_beta1, beta2, one_m_beta2, half_sq, wd, ess, hca, neg_floor,
     clip, inv_bias1, momentum, one_m_damp, decay, step_size, bias2_sqrt,
     eps) = _step_constants(hp_ptr, steps, tl.load(ctl_ptr + 1), CORR, FLOOR, CLIP, DEBIAS,
                            FAMILY)
    inv_gs = _inv_scale(grad_scale_ptr, HAS_SCALE)
    scale_in = tl.load(hp_ptr + S_INV_N_IN).to(tl.float32) * inv_gs
    scale_at_out = tl.load(hp_ptr + S_INV_N_AT_OUT).to(tl.float32) * inv_gs

    m = tl.load(mean_ptr + idx, mask=mask, other=0.0)
    g_in = _estimate(g_in_ptr, idx, mask, scale_in)
    ghat = g_in
    if CORR:
        g_at_out = _estimate(g_at_out_ptr, idx, mask, scale_at_out)
        g_out = tl.load(g_out_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        ghat = g_in - alpha * (g_at_out - g_out)

    if FAMILY == FAMILY_IVON:
        # every load is issued before the noise (Philox and the transform are ~100
        # instructions per element: the loads' latency hides behind them)
        g = tl.load(s1_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        h = tl.load(s2_ptr + idx, mask=mask, other=1.0)
        if GE_IN:
            ge_in = _estimate(ge_in_ptr, idx, mask, scale_in)
        if CORR:
            if GE_AT_OUT:
                ge_at_out = _estimate(ge_at_out_ptr, idx, mask, scale_at_out)
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
            if not GE_AT_OUT:
                if SHARED_NOISE:
                    eps_at_out = eps_i
                else:
                    eps_at_out = _noise(seed, idx, pid, offset, steps, stream_at_out, NOISE, SHARD,
                                   BLOCK)
                ge_at_out = g_at_out * (eps_at_out * tl.load(hp_ptr + S_SIGN_AT_OUT).to(tl.float32))
            h_at_out = tl.div_rn(ge_at_out, sigma_out)
            hhat = hhat - alpha * (h_at_out - h_out)
            fl = neg_floor * (h + wd)                  # -inf without a floor: a no-op
            hhat = tl.where(hhat < fl, fl, hhat)
            if HESS_CORR:
                extra = hca * (h_out - h_at_out) * (m - m_out)
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
    tl.store(pp, _to_param(m_param, param_ptr), mask=mask)


@triton.jit(do_not_specialize=_NO_SPEC)
def refresh_kernel(mean_ptr, h_ptr, acc_g_ptr, acc_ge_ptr, g_out_ptr, h_out_ptr, m_out_ptr,
                   sigma_out_ptr, ctl_ptr, found_inf_ptr, grad_scale_ptr, tiles_ptr, chunks_ptr,
                   hp_ptr, n: tl.int64, offset: tl.int64, seed: tl.int64, stream,
                   # RefreshFlags
                   FAMILY: tl.constexpr, GE: tl.constexpr, NOISY: tl.constexpr,
                   HAS_FOUND_INF: tl.constexpr, HAS_SCALE: tl.constexpr, NOISE: tl.constexpr,
                   SHARD: tl.constexpr, TILED: tl.constexpr, BLOCK: tl.constexpr):
    """The outer refresh, one pass: ``refresh_ivon`` and ``refresh_sgd`` of
    csrc/kernels_refresh.h, operation for operation (``hp_ptr``: the ``RefreshHyper`` row).

    ``FAMILY_IVON``: ``sigma``, the Price Hessian of the mega-batch gradient (noise of the
    refresh sample regenerated unless several draws were summed, ``GE``), the outer folds
    with outer momentum (the first refresh, or an outer momentum of 0, takes the estimate
    as it is), the snapshot ``m_out = m``, ``sigma_out = sigma``.  Reference: ivon_sigma,
    price_hessian, outer_fold.

    ``FAMILY_SGD``/``FAMILY_ADAMW``: ``g_out = gM`` and the refresh point
    ``theta_out = m (+ sigma eps)`` (``m_out_ptr``; ``sigma`` the constant of VSGD-PoCo).
    Reference: perturb.  ``TILED``: a sharded bucket's shards (their noise offsets), one
    launch for all.
    """
    pid = tl.program_id(0).to(tl.int64)
    idx, mask, offset, _ = _place(mean_ptr, tiles_ptr, chunks_ptr, pid, n, offset, SHARD,
                                  TILED, BLOCK)
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
