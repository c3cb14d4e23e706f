"""What the Triton kernels share: the code-path constants as ``constexpr``, where each
field of the hyperparameter rows is, the launch typing, and the scalar helpers (the
constants each program makes in double from its float64 row, as ``csrc/ops_update.cpp``
does).
The kernels are in :mod:`~poco_kernels.kernels.triton_kernels` (sample, accumulate, check,
fold, randn, finish) and :mod:`~poco_kernels.kernels.triton_step` (step, refresh)."""
import triton
import triton.language as tl

# the code-path constants and the control-tensor layout, shared with the C++ kernels
from .interface import (CTL_BAD, CTL_REFRESHES, CTL_SIZE, CTL_SKIPPED,  # noqa: F401
                        CTL_STEPS, FAMILY_ADAMW, FAMILY_IVON, FAMILY_SGD, SIGMA_BUFFER,
                        SIGMA_CONST, SIGMA_IVON, SIGMA_NONE)
from .triton_noise import noise as _noise  # noqa: F401  (for the kernels)
from .triton_noise import store_state as _store_state  # noqa: F401
from .triton_noise import to_param as _to_param  # noqa: F401

# (the kernels read these by name; Triton takes module globals as constexpr only)
FAMILY_IVON, FAMILY_SGD, FAMILY_ADAMW = (tl.constexpr(v) for v in (FAMILY_IVON, FAMILY_SGD,
                                                                  FAMILY_ADAMW))
SIGMA_NONE, SIGMA_IVON, SIGMA_BUFFER, SIGMA_CONST = (
    tl.constexpr(v) for v in (SIGMA_NONE, SIGMA_IVON, SIGMA_BUFFER, SIGMA_CONST))

BLOCK = 1024
NUM_WARPS = 4

# Where each field of the hyperparameter rows is (the records' field order, which
# tests/repo/test_architecture.py checks against interface.py and csrc/poco_kernels.h).
STEP_HP = ("sign_at_out", "inv_n_in", "inv_n_at_out", "lr", "beta1", "beta2", "wd", "ess", "alpha",
           "hess_corr", "floor", "clip", "momentum", "dampening", "eps", "mom_first")
(S_SIGN_AT_OUT, S_INV_N_IN, S_INV_N_AT_OUT, S_LR, S_BETA1, S_BETA2, S_WD, S_ESS, S_ALPHA,
 S_HESS_CORR, S_FLOOR, S_CLIP, S_MOMENTUM, S_DAMPENING, S_EPS, S_MOM_FIRST) = (
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
# types that poco_kernels.kernels.aot compiles (tests/kernels/test_triton_aot.py checks).
# ``stream`` (noise.stream_id: bucket << 16 | kind << 12 | draw) stays typed by value: i32
# for every bucket index below 32768, the variant compiled; a bucket index from 32768 on
# (65536 are allowed) gets an i64 ``stream`` with the same bits (``.to(tl.uint32)``) and
# bucket (``>> 16``), so the same numbers, from one more JIT compilation that the AOT
# test does not compile.
_NO_SPEC = ["seed", "stream", "stream_at_out", "counter_slot", "slot", "offset", "counter"]


# --------------------------------------------------------------------------- scalars
@triton.jit
def _pow_steps(b, e):
    """``b ** e`` for a float64 ``b`` and an int64 ``e >= 0``, by squaring: ``pow_steps``
    of csrc/ops_common.h, multiplication for multiplication."""
    r = b * 0.0 + 1.0
    while e > 0:
        r = tl.where((e & 1) != 0, r * b, r)
        b = b * b
        e = e >> 1
    return r


@triton.jit
def _place(own_ptr, tiles_ptr, chunks_ptr, pid, n, offset, SHARD: tl.constexpr,
           TILED: tl.constexpr, BLOCK: tl.constexpr):
    """Where program ``pid`` works: its elements' indices in the flat buffers, their mask,
    the noise offset, and a pointer to those elements in their own tensor (``own_ptr``'s
    dtype).  Untiled: the block ``pid`` of ``n`` elements, ``offset`` as given, the
    pointer into ``own_ptr``.  ``TILED`` (:mod:`~poco_kernels.kernels.triton_kernels`):
    a piece of one tensor of the table (``triton_ops.Tiles``: a sharded bucket's local
    shards, or gradients read in place), its row's offset, the pointer into the tensor at
    its row's address (unused where the table holds none)."""
    if TILED:
        tl.static_assert(SHARD == 2, "tiles: the noise of any offset")
        row = tiles_ptr + tl.load(chunks_ptr + pid).to(tl.int64) * 5
        j = (pid - tl.load(row + 4)) * BLOCK + tl.arange(0, BLOCK)
        own = tl.load(row + 3).to(tl.pointer_type(own_ptr.dtype.element_ty)) + j
        return tl.load(row) + j, j < tl.load(row + 1), tl.load(row + 2), own
    else:
        # (contiguous in fours, told to the compiler: each thread then takes 4 elements of
        # every buffer, 16 bytes of a float32 one and 8 of a 16-bit one; told nothing, it
        # gives 16-bit buffers 8 per thread and converts between the two layouts through
        # shared memory, with a barrier, in every block that mixes them)
        idx = tl.max_contiguous(pid * BLOCK + tl.arange(0, BLOCK), 4)
        return idx, idx < n, offset, own_ptr + idx


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
    ``step_op`` of csrc/ops_update.cpp computes them.  (Written inline: under the
    interpreter every call of a jit function costs about a millisecond.)"""
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
