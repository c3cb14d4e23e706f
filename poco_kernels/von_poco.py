"""VON-PoCo: variational online Newton with posterior correction, Alg. 4 / Thm. 3 of the paper.

A full-covariance Gaussian ``q = N(m, S^-1)`` over the (small) parameter vector, with the
Newton-like "SVRG + SVRH" update of Thm. 3 (gradient AND Hessian corrections).  The maths
is :func:`poco_kernels.reference.von_poco_step`; this module supplies the samples, the
gradients and Hessians, the outer loop and the bookkeeping.

Closure convention (differs from the rest of the package!)
----------------------------------------------------------
VON-PoCo needs the Hessian of every mini-batch loss, which the ``.grad``-based protocol of
:class:`~poco_kernels._posterior.PosteriorOptimizer` (``sample()``/``accumulate()``) cannot
give.  So a ``VONPoCo`` closure **returns the loss and does NOT call** ``backward()``::

    def closure():
        return loss_fn(model(x), y)          # a scalar tensor, graph attached; no backward

The optimizer differentiates the returned loss twice with :mod:`torch.autograd`
(``create_graph=True``, then all Hessian rows in one ``is_grads_batched`` call, falling
back to a row loop for operations without a batching rule).  ``.grad`` is neither read
nor written.  A closure that calls ``backward()`` itself frees the graph and gets a clear
error.  ``sample()``, ``accumulate()`` and ``sampled()`` are refused.

A step calls its closure at ``theta_in`` and, once the correction is active, a second time
at ``theta_out`` on the SAME mini-batch: the closure must be deterministic (no dropout).
The :class:`~poco_kernels.driver.DoubleLoop` driver works unchanged (its gradient count is
right; each evaluation also costs a Hessian, i.e. ``d`` extra backward passes)::

    opt = VONPoCo(model.parameters(), ess=N, lr=0.2, beta=0.1,
                  prior_precision=delta, min_eig=delta)      # delta: the loss's L2 weight
    for epoch in range(E):
        opt.refresh([lambda i=i: loss_fn(model(X[i]), Y[i]) for i in chunks])
        for i in batches:
            opt.step(lambda: loss_fn(model(X[i]), Y[i]))
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional

import torch
from torch import Tensor

from . import reference as R
from ._arguments import hyperparameter
from ._derivatives import grads_and_hessians
from ._layout import Bucket
from ._groups import as_closures
from ._optimizer import BucketedOptimizer
from ._protocol import KIND_INNER, KIND_OUTER, KIND_REFRESH
from ._transaction import outside_dynamo
from ._validation import check, check_range
from .rules.von_poco import MAX_DIM, VONPoCoRule  # noqa: F401 (MAX_DIM: re-exported)

__all__ = ["VONPoCo"]

PRECISION_UPDATES = ("paper", "blr")


class VONPoCo(BucketedOptimizer):
    """Variational Online Newton with Posterior Correction (Alg. 4, Thm. 3).

    **Closures return the loss WITHOUT calling backward()** (see the module docstring):
    ``opt.step(lambda: loss_fn(model(x), y))``.  Losses are MEANS over their batch.

    Posterior ``q = N(m, S^-1)``; ``m`` lives in the parameters, ``S`` is a dense
    ``d x d`` state buffer ``"precision"`` per bucket.  Samples are
    ``theta = m + noise_scale * L^-T eps`` with ``S = L L^T`` (Cholesky), so
    ``Cov(theta) = noise_scale^2 S^-1``; ``eps`` comes from the package's counter-based
    stream (nothing about noise is stored).

    :meth:`refresh` (``closures``: one per equal-size chunk of the mega-batch or full batch)
    draws ONE sample ``theta_out = m + L^-T eps_r`` for all chunks and stores the mean
    gradient ``g_out`` and mean Hessian ``H_out`` over the chunks (with outer momentum
    ``rho1``/``rho2``, App. D.1: ``x_out <- rho x_out + (1 - rho) x_M``; ``rho`` weights the
    OLD estimate, 0 = none; the first refresh takes ``x_M`` as it is), ``m_out = m`` and
    ``theta_out`` (FIXED for the inner loop, Alg. 4 line 5).

    :meth:`step` (``closure``: the mini-batch loss) evaluates the closure at
    ``theta_in = m + L^-T eps_t`` and then, once the correction is active, at
    ``theta_out`` (same mini-batch, in that order), and applies
    :func:`~poco_kernels.reference.von_poco_step` (S before m)::

        g_in = g_B(theta_in) - alpha (g_B(theta_out) - g_out)
        H_oi = alpha (H_out - H_B(theta_out));   H_in = H_B(theta_in) + H_oi
        S    = spd((1 - beta) S + beta ess H_in  [+ 0.5 beta^2 D S^-1 D,  D = ess H_in - S])
        m    = m - lr ess S^-1 (g_in + H_oi (m - m_out))

    Before the first refresh, or with ``alpha = 0``, this is plain VON (one closure
    evaluation per step).  ``noise_scale = 0`` (delta method) is a deterministic
    Newton-SVRG; with ``precision_update="paper"``, ``lr = beta = alpha = 1`` and full
    batches it is Newton's method.

    Several parameter groups, devices or dtypes give several buckets; ``S`` is then
    block-diagonal (one block per bucket, cross-bucket Hessian blocks are ignored).
    Parameters must be float32 or float64 and require grad; a bucket may hold at most
    ``MAX_DIM`` scalars.  No AMP (``grad_scale``/``found_inf``) and no ``mc_samples``;
    ``backend`` can only be the torch backend, and ``check_finite`` is always on.

    Steps and refreshes are transactions: every closure is evaluated and every new buffer
    computed and checked (finite losses, gradients, Hessians, results; ``S`` Cholesky-
    factorisable) before anything is committed; on an error the state and the parameters
    are as before.

    {arguments}
    """

    rule = VONPoCoRule()

    #: try one batched (vmap) backward for all Hessian rows before falling back to a loop
    batched_hessian = True

    ess: float = hyperparameter(doc="``N``, the number of examples (``> 0``); losses are means.")
    lr: float = hyperparameter(default=0.1, doc="""\
        the paper's ``alpha`` of Alg. 4, step size of the mean (``>= 0``).""")
    beta: float = hyperparameter(default=0.1, doc="rate of the precision update, in ``(0, 1]``.")
    alpha: float = hyperparameter(default=1.0, doc="""\
        correction weight in ``[0, 1]`` (1 = exact PoCo, 0 = VON).""")
    prior_precision: float = hyperparameter(default=1.0, doc="""\
        ``S`` starts at ``ess * prior_precision * I``, i.e. the initial guess of the
        per-example (mean-loss) Hessian, as IVON's ``hess_init``.  It does NOT add a
        regulariser: as in the paper, the prior ``l_0 / N`` belongs in the loss.  If the
        mean loss holds ``0.5 * delta * |theta|^2``, ``prior_precision = delta`` starts
        ``q`` at the prior's precision (and ``min_eig = delta`` is then the natural floor:
        the true Hessian of such a loss is ``>= delta``).""")
    min_eig: float = hyperparameter(default=1e-4, doc="""\
        floor, per-example units: after every update all eigenvalues of ``S`` are at least
        ``ess * min_eig``.  Must be in ``(0, prior_precision]``.  In float32 keep
        ``max eig(S) / (ess * min_eig)`` well below ``1e6``: a step whose ``S`` is not
        Cholesky-factorisable is refused (FloatingPointError, state unchanged).""")
    noise_scale: float = hyperparameter(default=1.0, doc="""\
        multiplies the sampling noise (``>= 0``; 0 = no sampling).""")
    rho1: float = hyperparameter(default=0.0, doc="outer momentum of ``g_out``, in ``[0, 1)``.")
    rho2: float = hyperparameter(default=0.0, doc="outer momentum of ``H_out``, in ``[0, 1)``.")
    precision_update: str = hyperparameter(default="blr", doc="""\
        how ``S`` is kept positive definite.  The corrected ``H_in`` is indefinite in
        general, even for convex losses (it is a difference of Hessians).

        - ``"blr"``: the positivity-preserving Bayesian-learning-rule update (Lin, Schmidt
          & Khan 2020; the matrix form of IVON's ``h`` update), i.e. the paper's update
          plus ``0.5 beta^2 D S^-1 D``
          (:func:`poco_kernels.reference.blr_precision_term`): positive definite for any
          ``H_in``, ``S`` can at most halve per step, then the ``min_eig`` floor.  Same
          fixed points as the paper's update and the same to first order in ``beta``.
        - ``"paper"``: Alg. 4 line 11 exactly, then every eigenvalue below the floor is
          raised to it (:func:`~poco_kernels.reference.make_spd`, the Frobenius-nearest
          such matrix).  A clamped direction gets curvature ``ess * min_eig``, so the mean
          update along it is ``1 / min_eig`` times the gradient: on mini-batches this often
          diverges (measured in tests/protocol/test_von_poco_logreg.py: breast-cancer logistic
          regression, batch 10-32, the ``H_oi (m - m_out)`` term feeding back far from
          ``m_out``).""")

    # ------------------------------------------------------------------ construction
    def _validate_group(self, group):
        check_range(group, "lr", lo=0.0, tensor=True)
        check_range(group, "beta", lo=0.0, hi=1.0, lo_open=True)
        check_range(group, "ess", lo=0.0, lo_open=True)
        check_range(group, "alpha", lo=0.0, hi=1.0)
        check_range(group, "prior_precision", lo=0.0, lo_open=True)
        check_range(group, "min_eig", lo=0.0, lo_open=True)
        check(group["min_eig"] <= group["prior_precision"],
               f"invalid min_eig: {group['min_eig']!r} exceeds prior_precision "
               f"{group['prior_precision']!r} (the initial S = ess * prior_precision * I must "
               "satisfy the floor ess * min_eig)")
        check_range(group, "noise_scale", lo=0.0)
        for k in ("rho1", "rho2"):
            check_range(group, k, lo=0.0, hi=1.0, hi_open=True)
        check(group["precision_update"] in PRECISION_UPDATES,
               f"invalid precision_update: {group['precision_update']!r} (expected one of "
               f"{PRECISION_UPDATES})")

    # ------------------------------------------------------------------ refused base API
    def _refuse(self, *_, **__):
        raise RuntimeError(
            "VONPoCo needs Hessians, which .grad does not carry: use step(closure) and "
            "refresh(closures) with closures that RETURN the loss without calling backward()")

    sample = accumulate = sampled = _refuse

    # ------------------------------------------------------------------ samples
    @staticmethod
    def _cholesky(S: Tensor, what: str) -> Tensor:
        L, info = torch.linalg.cholesky_ex(S)
        if int(info) != 0:
            raise FloatingPointError(
                f"{what} is not numerically positive definite (Cholesky failed): raise min_eig "
                "or use float64 parameters")
        return L

    def _draw(self, b: Bucket, group, kind: int, counter: int) -> Tensor:
        """``m + noise_scale * L^-T eps`` (``S = L L^T``); exactly ``m`` without noise."""
        m = b.buffers["mean"]
        ns = float(group["noise_scale"])
        if ns == 0.0:
            return m.clone()
        L = self._cholesky(b.buffers["precision"], "the precision S")
        eps = self._eps(b, kind, 0, counter)
        delta = torch.linalg.solve_triangular(L.mT, eps.unsqueeze(-1), upper=True).squeeze(-1)
        return m + ns * delta

    def _evaluate(self, closure: Callable, thetas: List[Tensor], kind: int):
        """Write ``thetas`` into the parameters, run the closure, differentiate, restore."""
        self._active = (kind, 0)
        try:
            for b in self._buckets:
                b.write_params(thetas[b.index])
            with torch.enable_grad():
                loss = closure()
                gh = grads_and_hessians(loss, self._buckets, self.batched_hessian)
        finally:
            self._runner.restore()
            self._active = None
        return loss.detach(), gh

    def _begin(self):
        if self._active is not None:
            raise RuntimeError("VONPoCo.step()/refresh() called while a sample is in the "
                               "parameters (from inside a closure?)")
        self._check_groups()
        self._check_trainable()
        self._sync_mean()

    def _commit_checked(self, new: Dict[int, Dict[str, Tensor]]) -> None:
        self._runner.check_new(new)
        for bufs in new.values():
            if "precision" in bufs:
                self._cholesky(bufs["precision"], "the updated precision S (step refused, "
                               "state unchanged)")
        self._runner.commit(new)

    # ------------------------------------------------------------------ step
    @outside_dynamo           # (torch.compile: see PosteriorOptimizer.sample)
    def step(self, closure: Optional[Callable] = None):
        """One inner step on the mini-batch of ``closure`` (returns the loss, NO backward).

        The closure is called at ``theta_in`` and, once the correction is active, again at
        the fixed refresh sample ``theta_out``.  Returns the loss at ``theta_in``."""
        if closure is None:
            raise RuntimeError("VONPoCo.step() needs a closure that returns the mini-batch "
                               "loss (without calling backward())")
        self._begin()
        thetas = [self._draw(b, self._groups[b.group_index], KIND_INNER, self._step)
                  for b in self._buckets]
        loss, gh_in = self._evaluate(closure, thetas, KIND_INNER)
        corr = self._corrected_buckets()      # a group added since the last refresh: plain VON
        gh_at_out = (self._evaluate(closure, [b.buffers["theta_out"] if b.index in corr
                                         else b.buffers["mean"] for b in self._buckets],
                               KIND_OUTER)[1] if corr else None)
        new = {}
        for b in self._buckets:
            group = self._group(b)
            g_i, H_i = gh_in[b.index]
            m, S = b.buffers["mean"], b.buffers["precision"]
            if b.index in corr:
                g_at_out, H_at_out = gh_at_out[b.index]
                outer = dict(m_out=b.buffers["m_out"], g_out=b.buffers["g_out"],
                             H_out=b.buffers["H_out"], alpha=float(group["alpha"]))
            else:                              # plain VON: no outer estimate
                g_at_out, H_at_out = torch.zeros_like(g_i), torch.zeros_like(H_i)
                outer = dict(m_out=m, g_out=torch.zeros_like(g_i), H_out=torch.zeros_like(H_i),
                             alpha=0.0)
            ess = float(group["ess"])
            blr = group["precision_update"] == "blr"
            m_new, S_new = R.von_poco_step(
                m, S, outer["m_out"], g_i, g_at_out, outer["g_out"], H_i, H_at_out, outer["H_out"],
                lr=float(group["lr"]), beta=float(group["beta"]), ess=ess,
                alpha=outer["alpha"], min_eig=ess * float(group["min_eig"]),
                precision_update=group["precision_update"],
                L=self._cholesky(S, "the precision S") if blr else None)
            new[b.index] = {"mean": m_new, "precision": S_new}
        self._commit_checked(new)
        self._step += 1
        return loss

    # ------------------------------------------------------------------ refresh
    @outside_dynamo
    def refresh(self, closures: Optional[Iterable[Callable]] = None):
        """Outer estimate from a mega-batch (or the full batch) at ONE posterior sample.

        ``closures``: one closure, or one per equal-size chunk, each RETURNING its mean loss
        (no backward).
        ``g_out``/``H_out`` are the means over the chunks.  Returns the mean loss."""
        if closures is None:
            raise RuntimeError("VONPoCo.refresh() needs closures (one per chunk of the "
                               "mega-batch) that return their loss without calling backward()")
        closures = as_closures(closures)
        self._begin()
        thetas = [self._draw(b, self._groups[b.group_index], KIND_REFRESH, self._refreshes)
                  for b in self._buckets]
        sums: Optional[List[List[Tensor]]] = None
        losses = []
        for c in closures:
            loss, gh = self._evaluate(c, thetas, KIND_REFRESH)
            losses.append(loss)
            if sums is None:
                sums = [[g.clone(), H.clone()] for g, H in gh]
            else:
                for s, (g, H) in zip(sums, gh):
                    s[0] += g
                    s[1] += H
        if sums is None:
            raise ValueError("refresh() needs at least one chunk of the mega-batch")
        n = len(losses)
        new = {}
        for b in self._buckets:
            group = self._group(b)
            first = self._first_refresh(b)
            gM, HM = sums[b.index][0] / n, sums[b.index][1] / n
            new[b.index] = {
                "g_out": R.outer_fold(b.buffers["g_out"], gM, float(group["rho1"]), first),
                "H_out": R.outer_fold(b.buffers["H_out"], HM, float(group["rho2"]), first),
                "m_out": b.buffers["mean"].clone(),
                "theta_out": thetas[b.index],
            }
        self._commit_checked(new)
        self._refresh_taken()
        return sum(losses) / n

    # ------------------------------------------------------------------ state dict
    def _plan_load(self, state_dict: Dict[str, Any]):
        """As the base class, and the saved precisions must be symmetric positive definite
        (checked before anything changes, after the load pre-hooks)."""
        extra = state_dict.get("poco", {}).get("bucket_buffers", {}) \
            if isinstance(state_dict, dict) and isinstance(state_dict.get("poco"), dict) else {}
        for b in self._buckets:
            S = extra.get(f"{b.index}/precision")
            if isinstance(S, Tensor) and tuple(S.shape) == (b.numel, b.numel):
                S = S.to(dtype=b.dtype)
                check(bool(torch.isfinite(S).all()) and
                       bool(torch.allclose(S, S.mT, rtol=1e-5, atol=0.0)),
                       f"state dict's precision of bucket {b.index} is not finite and symmetric")
                check(int(torch.linalg.cholesky_ex(S)[1]) == 0,
                       f"state dict's precision of bucket {b.index} is not positive definite")
        return super()._plan_load(state_dict)
