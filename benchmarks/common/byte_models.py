"""Bytes per parameter each benchmarked operation must move through memory: the byte
models of the rows (``bytes_per_param`` in the CSV), from which the achieved bandwidth and
the share of the copy bandwidth follow.

Each input is read once and each output written once, counted from the kernels
(poco_kernels/kernels/triton_kernels.py and csrc/kernels_impl.h move the same bytes;
state is float32, S = 4 bytes; P = bytes of one parameter / gradient element: 4 for
float32, 2 for bf16).  The docstring of each ``b_*`` function gives its terms; ``run.py``
writes them into its JSON report (``BYTE_MODELS``).
"""
from __future__ import annotations

S = 4


def b_step_poco(P, L=S, E=None):
    """step kernel, FAMILY_IVON, CORR, HESS_CORR (hess_corr_scale 0.01 != 0), shared noise,
    one draw (GE_IN = GE_AT_OUT = False: eps regenerated, not read), no AMP:
    reads  mean, g_in sum, g_at_out sum, h (s2) (4 x S), momentum (s1), sigma_out, m_out
           (3 x L) and g_out, h_out (2 x E; the parameters are NOT read),
    writes momentum (L), h, mean (2 x S) and the parameters (P).
    L: bytes of the low-precision state (S; 2 with state_dtype=bfloat16); E: of the outer
    estimates (L; 2 with outer_dtype=bfloat16)."""
    E = L if E is None else E
    return 4 * S + 3 * L + 2 * E + L + 2 * S + P


def b_step_ivon(P, L=S):
    """step kernel, FAMILY_IVON, no CORR: reads mean, g_in sum, h (3 x S), momentum (L);
    writes momentum (L), h, mean (2 x S) and the parameters (P)."""
    return 3 * S + L + L + 2 * S + P


def b_sample_inner(P, sync):
    """sample kernel, SIGMA_IVON.  SYNC (float32 parameters holding the mean): reads the
    parameters (P), writes mean (S), reads h (S), writes the sample (P).  Otherwise (bf16):
    reads mean, h (2 x S), writes the sample (P)."""
    return (P + S + S + P) if sync else (2 * S + P)


def b_sample_outer(P, L=S):
    """sample kernel, SIGMA_BUFFER: reads m_out, sigma_out (2 x L), writes the sample (P)."""
    return 2 * L + P


def b_accumulate(P):
    """accumulate kernel, FIRST, no GE: reads the flat gradient (P), writes the sum (S)."""
    return P + S


def b_gather(P):
    """FusedEngine._gather_grads when .grad is not a view of the flat gradient buffer:
    one foreach copy, reads .grad (P), writes the flat buffer (P)."""
    return 2 * P


def b_restore(P):
    """FusedEngine.restore: reads mean (S), writes the parameters (P)."""
    return S + P


def b_refresh_kernel(P):
    """refresh kernel, FAMILY_IVON, one draw: reads mean, acc_g, h, g_out, h_out (5 x S);
    writes g_out, h_out, m_out, sigma_out (4 x S)."""
    return 5 * S + 4 * S


def b_poco_cycle(P, protocol):
    """One IVON-PoCo step with the correction on, optimizer side only.
    'flat':    .grad are views of the flat gradient buffer (no gather), lazy restores
               (what step(closure) does), accumulate(clear_grads=False);
    'closure': step(closure), the closure assigns .grad (separate tensors, as autograd
               leaves them): lazy restores, one gather copy per accumulate;
    'sampled': the public `with opt.sampled(...)` protocol: full restores, gather copies,
               and (float32) the mean re-read from the parameters before the outer sample."""
    sync = P == S
    inner = b_sample_inner(P, sync) + b_accumulate(P)
    outer = b_sample_outer(P) + b_accumulate(P)
    total = inner + outer + b_step_poco(P)
    if protocol in ("closure", "sampled"):
        total += 2 * b_gather(P)
    if protocol == "sampled":
        total += 2 * b_restore(P) + ((P + S) if sync else 0)
    return total


def b_ivon_cycle(P):
    """One plain IVON step through step(closure): inner sample, gather, accumulate, step."""
    return b_sample_inner(P, P == S) + b_gather(P) + b_accumulate(P) + b_step_ivon(P)


def b_refresh(P):
    """A refresh with one chunk, .grad views of the flat buffer: refresh sample (the
    parameters hold the mean), accumulate, full restore, refresh kernel."""
    return b_sample_inner(P, P == S) + b_accumulate(P) + b_restore(P) + b_refresh_kernel(P)


def b_adamw(P):
    """torch AdamW (fused), state in the parameter dtype: reads param, grad, exp_avg,
    exp_avg_sq; writes param, exp_avg, exp_avg_sq."""
    return 7 * P


def b_ivonopt_step(P):
    """The fewest bytes of IVON's update as ivon-opt states it (state in the parameter
    dtype): reads param, avg_grad, avg_nxg, momentum, hess; writes param, momentum, hess.
    (ivon-opt runs it as ~15 separate torch ops, so it moves several times this.)"""
    return 8 * P


def b_ivonopt_sample(P):
    """Fewest bytes of ivon-opt's sample (entering ``sampled_params``): reads param, hess;
    writes the noise and the sample (ivon-opt also copies the mean with ``torch.cat``)."""
    return 4 * P


def b_ivonopt_restore(P):
    """Fewest bytes of ivon-opt's restore with ``train=True`` (leaving ``sampled_params``):
    the mean is put back by pointer; reads grad, noise; writes avg_grad, avg_nxg."""
    return 4 * P


def b_ivonopt_cycle(P):
    """Fewest bytes of ivon-opt's cycle: its sample, restore + collect, then its step."""
    return b_ivonopt_sample(P) + b_ivonopt_restore(P) + b_ivonopt_step(P)


def b_accumulate_restore(P):
    """Ours, leaving ``sampled(...)`` (closure-assigned .grad, not views of the flat
    buffer): gather copy, accumulate, restore."""
    return b_gather(P) + b_accumulate(P) + b_restore(P)




def b_check(P):
    """A gradient buffer adopted as its sum, checked for non-finite values (the check
    kernel: reads P)."""
    return P


def b_zero(P):
    """A consumed gradient buffer zeroed before it is handed out again as ``.grad`` views
    (one memset: writes P)."""
    return P


def b_direct(P):
    """Autograd's own ``.grad`` read in place by the accumulate kernel (Triton without
    views): reads .grad (P), writes the flat buffer (P), the non-finite check fused."""
    return 2 * P


def b_iteration(name, provider, P=S, views_default=False, direct=True):
    """One training iteration, optimizer side (``studies/iteration.py``), float32, the closure
    zeroing with the optimizer's ``zero_grad()``:
    AdamW: its step (the closure's zero_grad sets .grad to None: nothing moves);
    ours, ``.grad`` views of the flat buffers (``views_default``, or ``grad_views`` in
    ``provider``): per gradient a check of the adopted buffer and a zeroing of it after
    the update; without views (Triton's default on a GPU, or ``no_grad_views``), autograd's
    own tensors: read in place where the backend can (``direct``: Triton), else gathered
    and checked (C++); IVON: inner sample
    (float32 parameters hold the mean: sync) + step; IVON-PoCoMo: inner sample + outer
    sample + step with the correction.  The inner sample only with the copy protocol
    (``copy`` in ``provider``: ``sample_ahead=False``); otherwise the step wrote it (its
    parameter write is the step's), parked by default (``sample_ahead=None``: nothing
    moves) or left in the parameters (``sample_ahead``); ``bf16_state``:
    state_dtype=bfloat16 (momentum and outer buffers 2 bytes); ``bf16_outer``:
    outer_dtype=bfloat16 (g_out and h_out 2 bytes).  Nothing to zero without
    views; the in-place add the views cost autograd is the closure's, not counted here."""
    if name == "AdamW":
        return b_adamw(P)
    L = 2 if "bf16_state" in provider else S
    grads = 1 if name == "IVON" else 2
    views = "no_grad_views" not in provider and ("grad_views" in provider or views_default)
    if views:
        total = grads * (b_check(P) + b_zero(P))
    elif direct:
        total = grads * b_direct(P)
    else:
        total = grads * (b_gather(P) + b_check(P))
    if "copy" in provider:
        total += b_sample_inner(P, P == S)
    if name == "IVON":
        return total + b_step_ivon(P, L)
    E = 2 if "bf16_outer" in provider else L
    return total + b_sample_outer(P, L) + b_step_poco(P, L, E)


BYTE_MODELS = (b_step_poco, b_step_ivon, b_sample_inner, b_sample_outer, b_accumulate,
               b_gather, b_restore, b_refresh_kernel, b_poco_cycle, b_ivon_cycle, b_refresh,
               b_accumulate_restore, b_adamw, b_ivonopt_step, b_ivonopt_sample,
               b_ivonopt_restore, b_ivonopt_cycle, b_check, b_zero, b_direct, b_iteration)
