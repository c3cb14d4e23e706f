"""Triton kernels of the family, over flat per-bucket buffers.

Each kernel is the fused form of reference functions; the ``Reference:`` line of each
names them (:mod:`poco_kernels.reference`), and ``tests/kernels/test_kernels_*.py`` check
each against them.  Host wrappers (launch, torch custom-op registration) are in
:mod:`poco_kernels.kernels.triton_ops`; the noise and the stored bits in
:mod:`poco_kernels.kernels.triton_noise`.

**Each kernel is the op-for-op twin of its C++ kernel** (``csrc/kernels_*.h``): the
same float32 operations in the same order, on the same float32 constants, which both
compute in double from the float64 hyperparameters as ``csrc/ops_update.cpp`` does
(:func:`_step_constants`, :func:`_refresh_constants`).  Compiled without floating-point
contraction and with correctly rounded division and square root (``triton_ops``
launches with ``enable_fp_fusion=False``; ``tl.div_rn``, ``tl.sqrt_rn`` here), a kernel on
a GPU, the same kernel under Triton's interpreter and the C++ kernel give the same bits
(``tests/kernels/test_kernels_noise.py`` compares the interpreter with C++ bit for bit;
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
* ``TILED`` (sharded buckets, FSDP2; the accumulation of autograd's own gradients, read
  in place, each a "shard" at its parameter's offset): one launch covers every local
  shard of a bucket (``_place``).
  ``chunks_ptr`` (int32, one entry per program) names the shard a program works on and
  ``tiles_ptr`` (int64, five per shard) holds that shard's first element in the flat
  buffers, its length, its noise offset (its place in the unsharded bucket less its
  place in the flat buffers), the address of its own tensor (the local shard of the
  parameter, or its gradient), and its first program; a program covers ``BLOCK``
  elements of one shard (``triton_ops.Tiles``).  The elements get exactly what the
  launch per shard gives them (``SHARD`` 2: the noise of any offset);
* hyperparameters are read from a float64 row on the device (``hp_ptr``: one value per
  field of ``StepHyper``, ``RefreshHyper`` or ``SampleHyper``,
  :mod:`poco_kernels.kernels.interface`): a new learning rate neither recompiles nor
  changes a launch argument, so a captured CUDA graph replays with the current values.
  Only the code path (which terms exist) is ``constexpr``.
"""
import triton
import triton.language as tl

# (the constants re-exported: callers read them here)
from .triton_common import (  # noqa: F401
                            BLOCK, CTL_BAD, CTL_REFRESHES, CTL_SIZE, CTL_SKIPPED, CTL_STEPS,
                            FAMILY_ADAMW, FAMILY_IVON, FAMILY_SGD, NUM_WARPS, P_ESS, P_SIGMA,
                            P_WD, REFRESH_HP, R_ESS, R_INV_N, R_RHO1, R_RHO2, R_SIGMA, R_WD,
                            SAMPLE_HP, SIGMA_BUFFER, SIGMA_CONST, SIGMA_IVON, SIGMA_NONE,
                            STEP_HP, S_ALPHA, S_BETA1, S_BETA2, S_CLIP, S_DAMPENING, S_EPS,
                            S_ESS, S_FLOOR, S_HESS_CORR, S_INV_N_IN, S_INV_N_AT_OUT, S_LR,
                            S_MOMENTUM, S_MOM_FIRST, S_SIGN_AT_OUT, S_WD, _NO_SPEC, _ivon_sigma,
                            _noise, _skip_flag, _place, _to_param)
from .triton_step import refresh_kernel, step_kernel  # noqa: F401  (re-exported)


# --------------------------------------------------------------------------- kernels
@triton.jit(do_not_specialize=_NO_SPEC)
def sample_kernel(param_ptr, centre_ptr, mean_ptr, h_ptr, sigma_ptr, ctl_ptr, tiles_ptr,
                  chunks_ptr, hp_ptr, n: tl.int64, offset: tl.int64, seed: tl.int64, stream,
                  counter_slot, sign,
                  SIGMA_MODE: tl.constexpr, SYNC: tl.constexpr, NOISE: tl.constexpr,
                  SHARD: tl.constexpr, TILED: tl.constexpr, BLOCK: tl.constexpr):
    """Write the posterior sample ``theta = centre + sigma * sign * eps`` into the flat
    parameters, in their dtype (``hp_ptr``: the ``SampleHyper`` row).  ``SYNC``: the
    parameters hold the mean (float32 parameters, torch.optim convention) and are first
    copied to the ``mean`` buffer, which is then the centre.  ``TILED``: the parameters
    are a sharded bucket's local shards, one launch for all (see ``TILED`` in the module
    docstring).  Reference: perturb, ivon_sigma."""
    pid = tl.program_id(0).to(tl.int64)
    idx, mask, offset, pp = _place(param_ptr, tiles_ptr, chunks_ptr, pid, n, offset, SHARD,
                                   TILED, BLOCK)
    if SYNC:
        centre = tl.load(pp, mask=mask).to(tl.float32)
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
    tl.store(pp, _to_param(theta, param_ptr), mask=mask)


@triton.jit(do_not_specialize=_NO_SPEC)
def accumulate_kernel(grad_ptr, acc_g_ptr, acc_ge_ptr, ctl_ptr, tiles_ptr, chunks_ptr,
                      n: tl.int64, offset: tl.int64,
                      seed: tl.int64, stream, counter_slot,
                      sign, FIRST: tl.constexpr, GE: tl.constexpr, NOISE: tl.constexpr,
                      SHARD: tl.constexpr, TILED: tl.constexpr, BLOCK: tl.constexpr):
    """Fold one gradient (flat, parameter dtype) into the running sums of its sample kind:
    ``acc_g (+)= g``; with ``GE`` (several draws of the kind) also ``acc_ge += g * eps``
    of the active draw.  A non-finite gradient sets the control tensor's bad flag (one
    atomic per block that has one), so the update that follows is skipped on device.
    ``TILED``: the gradients are a sharded bucket's local shards, or an unsharded bucket's
    gradients where autograd left them, one launch for all."""
    pid = tl.program_id(0).to(tl.int64)
    idx, mask, offset, gp = _place(grad_ptr, tiles_ptr, chunks_ptr, pid, n, offset, SHARD,
                                   TILED, BLOCK)
    g = tl.load(gp, mask=mask, other=0.0).to(tl.float32)
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
def fold_ge_kernel(acc_g_ptr, acc_ge_ptr, ctl_ptr, tiles_ptr, chunks_ptr, n: tl.int64,
                   offset: tl.int64, seed: tl.int64, stream, counter_slot, sign,
                   NOISE: tl.constexpr, SHARD: tl.constexpr, TILED: tl.constexpr,
                   BLOCK: tl.constexpr):
    """``acc_ge = acc_g * eps`` of draw 0: when a second draw of a kind starts, the sum of
    ``g * eps`` that the update would otherwise regenerate is materialised.  ``TILED``:
    a sharded bucket's shards (their noise offsets), one launch for all."""
    pid = tl.program_id(0).to(tl.int64)
    idx, mask, offset, _ = _place(acc_g_ptr, tiles_ptr, chunks_ptr, pid, n, offset, SHARD,
                                  TILED, BLOCK)
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


@triton.jit(do_not_specialize=_NO_SPEC)
def finish_kernel(ctl_ptr, found_inf_ptr, slot, HAS_FOUND_INF: tl.constexpr):
    """After an update: advance the counter in ``slot`` (steps or refreshes) unless the
    update was skipped, count skipped updates, clear the bad-gradient flag."""
    skip = _skip_flag(ctl_ptr, found_inf_ptr, HAS_FOUND_INF)
    s = skip.to(tl.int64)
    tl.store(ctl_ptr + slot, tl.load(ctl_ptr + slot) + 1 - s)
    tl.store(ctl_ptr + 3, tl.load(ctl_ptr + 3) + s)
    tl.store(ctl_ptr + 2, s * 0)
