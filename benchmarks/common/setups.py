"""What a benchmark is built from: the optimizer under test with its parameter and
gradient (``poco_opt``), the prepared buffers and launcher of the fused step operator
(``step_buffers``, ``step_launcher``), and ivon-opt, the published implementation
(``import_ivon``)."""
from __future__ import annotations

import glob
import os
import sys

import torch

from benchmarks.common.device import REPO


def import_ivon():
    """(the ivon-opt module, None) or (None, why not).  Where it is not installed (a lent
    GPU machine reaches no registry), a wheel in ``<repo>/.whl/ivon_opt-*.whl`` is imported
    from the zip (ivon-opt is pure Python)."""
    try:
        import ivon
        return ivon, None
    except ImportError as exc:
        err = f"{type(exc).__name__}: {exc}"
    for whl in sorted(glob.glob(os.path.join(REPO, ".whl", "ivon_opt-*.whl"))):
        sys.path.insert(0, whl)
        try:
            import ivon
            return ivon, None
        except ImportError as exc:
            err = f"{type(exc).__name__}: {exc} (from {whl})"
    return None, err


def step_buffers(n, dt, dev, ess=1.0, wd=1e-4, seed=None):
    """The buffers of one bucket's inner step, with plausible values (h near 1)."""
    g = torch.Generator(device=dev).manual_seed(n % 9973 if seed is None else seed)

    def r(scale=1.0, shift=0.0):
        return torch.randn(n, device=dev, generator=g) * scale + shift
    h = 1.0 + 0.1 * torch.rand(n, device=dev, generator=g)
    b = dict(mean=r(), s1=r(0.01), s2=h, g_in=r(), g_at_out=r(), g_out=r(), h_out=r(0.1, 1.0),
             m_out=r(), sigma_out=torch.rsqrt(ess * (h + wd)))
    b["param"] = b["mean"].to(dt)
    b["ctl"] = torch.tensor([5, 1, 0, 0], device=dev, dtype=torch.int64)
    return b


def step_launcher(ops, b, corr, ess=1.0, wd=1e-4, noise=None, next_sample=False):
    """The step operator of a kernel set (``triton_ops`` or ``cpp_ops``) on ``b``:
    IVON-PoCoMo (correction, shared noise, Hessian correction, debiasing) or plain IVON;
    ``noise``: the stream version (default: the current one); ``next_sample``: the step
    also writes the next inner sample (``sample_ahead``)."""
    from poco_kernels import noise as N
    from poco_kernels.kernels import interface as K
    flags = K.StepFlags.ivon(hess_corr=corr, floor=False, clip=False, debias=True).routed(
        corr=corr, ge_in=False, ge_at_out=False, shared_noise=corr, next_sample=next_sample)
    hp = K.StepHyper.ivon(lr=1e-3, beta1=0.9, beta2=0.99999, wd=wd, ess=ess,
                          alpha=1.0 if corr else 0.0, hess_corr=0.01 if corr else 0.0,
                          floor=0.0, clip=0.0).counted(
        sign_at_out=1.0, inv_n_in=1.0, inv_n_at_out=1.0 if corr else 0.0)
    # the row made once, on the device, as the optimizers keep theirs: a record passed at
    # each call becomes a new row per call, a pageable host-to-device copy that waits for
    # the kernels queued before it (on a GPU the timed loop would then measure a launch
    # latency per call, not the kernel)
    hp = K.hyper_row(hp, K.StepHyper, b["mean"].device)
    args = (b["mean"], b["param"], b["s1"], b["s2"], b["g_in"], None,
            b["g_at_out"] if corr else None, None,
            b["g_out"] if corr else None, b["h_out"] if corr else None,
            b["m_out"] if corr else None, b["sigma_out"] if corr else None,
            b["ctl"], None, None,
            K.StepStreams(7, 0, 0, N.STREAM_VERSION if noise is None else noise), hp, flags)
    return lambda: ops.step(*args)


def poco_opt(n, dt, dev, backend, cls="IVONPoCo", seed=3):
    """One parameter of ``n`` elements, its optimizer and a gradient.  ess = 1: the timed
    loops repeat thousands of steps on ONE fixed gradient, and with ess 1e6 (1/sigma =
    1000) IVON-PoCo at Alg. 3 defaults runs to non-finite state in ~100 such steps (the
    instability of docs/logreg-study.md, 'Stability of IVON-PoCo'; the torch backend then
    raises).  With ess = 1 both IVON and
    IVON-PoCo stay finite and h stays within [0.69, 1.24] over 6000 steps (checked on the
    torch backend, 2**14 elements).  The values do not change the work done."""
    import poco_kernels as pk
    g = torch.Generator(device=dev).manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(n, device=dev, generator=g).to(dt))
    kw = dict(lr=1e-3, ess=1.0, seed=seed, backend=backend)
    opt = getattr(pk, cls)([p], **kw)
    grad = torch.randn(n, device=dev, generator=g).to(dt)
    return p, opt, grad
