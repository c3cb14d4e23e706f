"""The only place the benchmarks reach past the optimizers' public API.

Every access to a private attribute or argument of ``poco_kernels``' optimizers is here,
so that a change of the package's internals is followed in one file:

* ``opt._buckets`` and a bucket's ``buffers``, ``param_dtype``, ``numel``, ``grad_flat``,
  ``grad_views`` (the fused engine's flat layout);
* ``opt._active`` and ``opt._pending`` (the host's record of the open sample and of the
  collected gradient sums);
* ending a sample without restoring the mean (``opt._active = None``: what
  ``step(closure)`` does between its samples on the fused backends, whose next sample or
  step overwrites the parameters).
"""
from __future__ import annotations


def bucket_buffer_names(opt, names):
    """Those of ``names`` that the first bucket of ``opt`` holds a buffer for."""
    return [n for n in names if n in opt._buckets[0].buffers]


def bucket_dtypes(opt):
    """The parameter dtype of each bucket."""
    return [b.param_dtype for b in opt._buckets]


def bucket_numels(opt):
    """The number of elements of each bucket."""
    return [b.numel for b in opt._buckets]


def flat_grad_view(opt, grad):
    """Write ``grad`` into the first bucket's flat gradient buffer and return the view of
    it that belongs to the first parameter (a ``.grad`` the engine need not gather)."""
    bk = opt._buckets[0]
    bk.grad_flat.copy_(grad)
    return list(bk.grad_views)[0]


def lazy_restore(opt):
    """``restore`` that leaves the sample in the parameters (what ``step(closure)`` does
    between its samples)."""
    opt._active = None


def reset_host(opt):
    """After a failed capture or a phase that raised: end any sample left active and drop
    pending sums."""
    if opt._active is not None:
        opt.restore()
    opt._pending.clear((0, 1))
