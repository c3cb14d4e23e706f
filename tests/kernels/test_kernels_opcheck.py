"""Each kernel of both sets, C++ and Triton (under TRITON_INTERPRET=1), as a torch
operator: ``torch.library.opcheck`` of its schema and fake kernel."""
import pytest
import torch

from helpers import FUSED_BACKENDS
from kernel_parity import NV, SEED, _ctl
from kernel_parity import ops  # noqa: F401
from poco_kernels.kernels import interface as K

pytestmark = pytest.mark.skipif(not FUSED_BACKENDS, reason="no kernels to test here")


def test_operators_pass_opcheck(ops):
    """Each kernel is a torch operator whose schema declares exactly what it mutates and
    whose fake kernel works: what torch.compile and export rely on (torch.library.opcheck:
    schema, fake tensors, autograd registration, AOT dispatch)."""
    ns = torch.ops.poco_kernels_cpp if ops.__name__.endswith("cpp_ops") else torch.ops.poco_kernels
    n = 1000
    g = torch.Generator().manual_seed(1)
    r = lambda: torch.randn(n, generator=g)  # noqa: E731
    ctl = _ctl(3, 1)
    flags = K.StepFlags.ivon(hess_corr=True, floor=False,
                                                          clip=False,
                                                                  debias=True).routed(corr=True,
                                                                  ge_in=False, ge_at_out=False,
                                                                  shared_noise=True,
                                                                  next_sample=False)
    hp = K.StepHyper.ivon(lr=0.01, beta1=0.9, beta2=0.999, wd=1e-4, ess=50.0,
                                      alpha=0.7, hess_corr=0.01, floor=0.0,
                                              clip=0.0).counted(sign_at_out=1.0, inv_n_in=1.0,
                                              inv_n_at_out=1.0)
    rflags = K.RefreshFlags(K.FAMILY_IVON, ge=False, noisy=True)
    # the operators' own schemas: the C++ ones take the streams and flags as numbers, the
    # Triton custom ops as lists; both take the hyperparameters as their float64 row
    cpp = ns is torch.ops.poco_kernels_cpp
    streams = (SEED, NV, 5, 5) if cpp else ([SEED, 5, 5, NV],)
    row = K.hyper_row(hp, K.StepHyper)
    step_tail = (row, flags.family, flags.bits()) if cpp else (row, [int(v) for v in flags])
    refresh_tail = ((rflags.family, rflags.bits()) if cpp else ([int(v) for v in rflags],))
    cases = {
        "sample": (r().bfloat16(), r(), r(), r().abs() + 0.1, None, ctl, SEED, NV, 5, 0,
                   K.hyper_row(K.SampleHyper(50.0, 1e-4, 0.0), K.SampleHyper), 1.0,
                   K.SIGMA_IVON, False),
        "accumulate": (r(), r(), r(), ctl.clone(), SEED, NV, 5, 0, 1.0, False, True),
        "check": (r(), ctl.clone()),
        "fold_ge": (r(), r(), ctl, SEED, NV, 5, 0, 1.0),
        "step": (r(), r().bfloat16(), r(), r().abs() + 0.5, r(), None, r(), None, r(), r(),
                 r(), r().abs() + 0.1, ctl, None, None, *streams, *step_tail),
        "refresh": (r(), r().abs() + 0.5, r(), None, r(), r(), r(), r(), ctl, None, None, SEED, NV,
                    5, K.hyper_row(K.RefreshHyper(1.0, 50.0, 1e-4, 0.5, 0.1, 0.0), K.RefreshHyper),
                    *refresh_tail),
        "finish": (ctl.clone(), None, 0),
    }
    for name, args in cases.items():
        torch.library.opcheck(getattr(ns, name), args)
