"""VON-PoCo (Alg. 4, Thm. 3), the algorithm: Newton landing and the exact noise path on a
quadratic, SPD guards on the precision, reduction to plain VON, the refresh's gradients and
Hessians, block-diagonal precisions over several groups.

VON-PoCo closures RETURN the loss and do not call backward()."""
import copy
import math

import numpy as np
import pytest
import torch

from poco_kernels import noise as N_
from poco_kernels import reference as R
from poco_kernels._protocol import KIND_INNER, KIND_REFRESH
from poco_kernels.von_poco import VONPoCo
from poco_kernels.reference import blr_precision_term
from von_poco_problems import random_logreg


#: tiny LAPACK calls (31 x 31 eigh) are ~100x slower with several busy threads
pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------- helpers
def spd_quadratic(d, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    Q = torch.randn(d, d, generator=g, dtype=torch.float64)
    A = Q @ Q.T / d + 0.5 * torch.eye(d, dtype=torch.float64)
    x_star = torch.randn(d, generator=g, dtype=torch.float64)
    return A.to(dtype), x_star.to(dtype)


class Quadratic:
    """0.5 x^T A x - b^T x + c with x* = A^-1 b, over the parameters W (2 x 3) and v (1,)
    (d = 7) flattened in that order; every closure is the full loss."""

    def __init__(self, dtype=torch.float64, seed=0):
        self.A, self.x_star = spd_quadratic(7, seed, dtype)
        self.b = self.A @ self.x_star
        self.c = torch.tensor(1.7, dtype=dtype)
        self.W = torch.nn.Parameter(torch.zeros(2, 3, dtype=dtype))
        self.v = torch.nn.Parameter(torch.full((1,), 0.3, dtype=dtype))
        self.seen = []                         # parameters at every closure call

    def x(self):
        return torch.cat([self.W.reshape(-1), self.v])

    def closure(self):
        x = self.x()
        self.seen.append(x.detach().clone())
        return 0.5 * x @ self.A @ x - self.b @ x + self.c


def chol_offset(S, eps):
    """L^-T eps for S = L L^T (what the optimizer's samples add to the mean)."""
    L = torch.linalg.cholesky(S)
    return torch.linalg.solve_triangular(L.mT, eps.unsqueeze(-1), upper=True).squeeze(-1)


def inner_eps(d, seed, step, dtype, bucket=0):
    return N_.randn(d, seed, step, N_.stream_id(bucket, KIND_INNER, 0), dtype=dtype)


# ---------------------------------------------------------------------------- quadratic
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-4)])
def test_one_inner_step_after_refresh_lands_on_minimiser(dtype, tol):
    q = Quadratic(dtype)
    opt = VONPoCo([q.W, q.v], ess=13.0, lr=1.0, beta=1.0, alpha=1.0, noise_scale=0.0,
                  prior_precision=1.0, min_eig=1e-3, precision_update="paper")
    for _ in range(2):                  # a plain VON step first: m moves, S != A ess
        opt.step(q.closure)
    assert (q.x().detach() - q.x_star).abs().max() < tol   # beta = 1: Newton already
    with torch.no_grad():               # restart far from x*, keep S
        q.W.add_(2.0)
    opt.refresh([q.closure, q.closure, q.closure])         # three identical "chunks"
    q.seen.clear()
    opt.step(q.closure)
    assert len(q.seen) == 2             # theta_in, then theta_out
    err = (q.x().detach() - q.x_star).abs().max()
    assert err < tol, err
    S = opt.flat_state("precision")[0]
    assert torch.allclose(S, 13.0 * q.A, rtol=tol, atol=tol)


@pytest.mark.parametrize("noise_scale", [1.0, 0.37])
def test_noise_path_is_exact_on_quadratic(noise_scale):
    """Full batch, lr = beta = alpha = 1, right after a refresh (m = m_out): the gradients
    at theta_out cancel, g_in = A (theta_in - x*), H_oi = 0, S_new = ess A, so
    m_new = m - A^-1 A (theta_in - x*), i.e. m_new - x* = -(theta_in - m): the landing error
    is minus the inner sample's offset, whatever the refresh sample."""
    q = Quadratic(torch.float64, seed=4)
    seed, ess, d = 1234, 9.0, 7
    opt = VONPoCo([q.W, q.v], ess=ess, lr=1.0, beta=1.0, alpha=1.0, noise_scale=noise_scale,
                  prior_precision=0.5, min_eig=1e-3, precision_update="paper", seed=seed)
    opt.step(q.closure)                 # plain VON step: S becomes ess A (not diagonal)
    with torch.no_grad():
        q.v.add_(-1.5)
    S = opt.flat_state("precision")[0].clone()
    m0 = q.x().detach().clone()
    q.seen.clear()
    opt.refresh([q.closure])
    theta_out = q.seen[0]
    eps_r = N_.randn(d, seed, 0, N_.stream_id(0, KIND_REFRESH, 0), dtype=torch.float64)
    assert torch.allclose(theta_out - m0, noise_scale * chol_offset(S, eps_r), atol=1e-12)
    assert torch.equal(opt.flat_state("theta_out")[0], theta_out)
    q.seen.clear()
    opt.step(q.closure)
    theta_in, theta_o = q.seen
    assert torch.equal(theta_o, theta_out)                  # the refresh sample is fixed
    offset = theta_in - m0
    eps = inner_eps(d, seed, 1, torch.float64)              # counter = step index (1)
    assert torch.allclose(offset, noise_scale * chol_offset(S, eps), atol=1e-12)
    # covariance noise_scale^2 S^-1, independently of the square root used:
    assert math.isclose(float(offset @ S @ offset), noise_scale ** 2 * float(eps @ eps),
                        rel_tol=1e-10)
    assert offset.norm() > 0.05
    landing = q.x().detach() - q.x_star
    assert torch.allclose(landing, -offset, atol=1e-10), (landing + offset).abs().max()


# ---------------------------------------------------------------------------- SPD guards
def _spd_problem():
    """4 examples, d = 5, large weights: per-example Hessians change a lot between
    theta_in and theta_out, so H_in = H_i(in) + H_out - H_i(out) is indefinite."""
    return random_logreg(n=4, d=5, seed=3, scale=3.0, delta=1e-2)


@pytest.mark.parametrize("update", ["paper", "blr"])
def test_precision_stays_spd_where_the_unguarded_update_is_indefinite(update):
    prob = _spd_problem()
    n, ess, min_eig, beta, lr = prob.n, 4.0, 1e-2, 1.0, 0.1
    opt = VONPoCo([prob.w], ess=ess, lr=lr, beta=beta, alpha=1.0, noise_scale=0.0,
                  prior_precision=1e-2, min_eig=min_eig, precision_update=update)
    full = torch.arange(n)
    negative = 0
    for t in range(40):
        if t % 10 == 0:
            opt.refresh([prob.closure(full)])
            g_out, H_out = prob.grad_hess(opt.flat_state("theta_out")[0], full)
            assert torch.allclose(opt.flat_state("g_out")[0], g_out, atol=1e-12)
            assert torch.allclose(opt.flat_state("H_out")[0], H_out, atol=1e-12)
        i = torch.tensor([t % n])
        m, S = opt.flat_state("mean")[0].clone(), opt.flat_state("precision")[0].clone()
        m_out = opt.flat_state("m_out")[0].clone()
        log = []
        opt.step(prob.closure(i, log=log))
        theta_in, theta_o = log
        g_i, H_i = prob.grad_hess(theta_in, i)
        g_at_out, H_at_out = prob.grad_hess(theta_o, i)
        kw = dict(lr=lr, beta=beta, ess=ess, alpha=1.0)
        # the unguarded update (make_spd with floor -inf only symmetrises)
        _, S_plain = R.von_poco_step(m, S, m_out, g_i, g_at_out, g_out, H_i, H_at_out, H_out,
                                     min_eig=-math.inf, **kw)
        H_extra = 0.0
        if update == "blr":
            H_in = H_i + (H_out - H_at_out)
            H_extra = blr_precision_term(S, ess * H_in, beta) / (beta * ess)
        if float(torch.linalg.eigvalsh(S_plain).min()) < 0:
            negative += 1
        m_ref, S_ref = R.von_poco_step(m, S, m_out, g_i, g_at_out, g_out, H_i + H_extra, H_at_out,
                                       H_out, min_eig=ess * min_eig, **kw)
        S_new = opt.flat_state("precision")[0]
        assert torch.allclose(S_new, S_ref, rtol=1e-9, atol=1e-10)
        assert torch.allclose(opt.flat_state("mean")[0], m_ref, rtol=1e-8, atol=1e-10)
        ev = torch.linalg.eigvalsh(S_new)
        assert float(ev.min()) >= ess * min_eig * (1 - 1e-9), ev
        if update == "blr":             # S can at most halve: S^-1/2 S_new S^-1/2 >= I / 2
            Li = torch.linalg.inv(torch.linalg.cholesky(S))
            assert float(torch.linalg.eigvalsh(Li @ S_new @ Li.T).min()) >= 0.5 - 1e-9
    assert negative >= 3, negative     # the guard mattered, repeatedly


# ---------------------------------------------------------------------------- VON
def _hand_von(prob, steps, *, lr, beta, ess, pp, min_eig, noise_scale, seed, update):
    """Plain VON, written out independently: theta = m + ns L^-T eps,
    S <- spd((1 - beta) S + beta ess H [+ BLR term]), m <- m - lr ess S^-1 g."""
    d = prob.d
    m = prob.w.detach().clone()
    S = ess * pp * torch.eye(d, dtype=torch.float64)
    traj = []
    for t, idx in enumerate(steps):
        eps = inner_eps(d, seed, t, torch.float64)
        theta = m + noise_scale * chol_offset(S, eps)
        g, H = prob.grad_hess(theta, idx)
        G = ess * H
        S_new = (1 - beta) * S + beta * G
        if update == "blr":
            D = G - S
            S_new = S_new + 0.5 * beta ** 2 * D @ torch.linalg.solve(S, D)
        e, V = torch.linalg.eigh(0.5 * (S_new + S_new.T))
        S = (V * e.clamp_min(ess * min_eig)) @ V.T if bool((e < ess * min_eig).any()) \
            else 0.5 * (S_new + S_new.T)
        m = m - lr * ess * torch.linalg.solve(S, g)
        traj.append(m.clone())
    return traj


@pytest.mark.parametrize("update", ["paper", "blr"])
def test_alpha_zero_is_plain_von_with_or_without_refreshes(update):
    batches = [torch.randint(0, 40, (5,), generator=torch.Generator().manual_seed(t))
               for t in range(25)]
    kw = dict(ess=40.0, lr=0.3, beta=0.2, prior_precision=0.5, min_eig=1e-2,
              noise_scale=1.0, seed=11, precision_update=update)
    trajs, calls = [], []
    for alpha, refresh_every in ((0.0, 4), (0.0, None), (1.0, None)):
        prob = random_logreg()
        opt = VONPoCo([prob.w], alpha=alpha, **kw)
        traj, n_calls = [], 0
        for t, idx in enumerate(batches):
            if refresh_every and t % refresh_every == 0:
                opt.refresh(prob.chunks(3))
            log = []
            opt.step(prob.closure(idx, log=log))
            n_calls += len(log)
            traj.append((prob.w.detach().clone(), opt.flat_state("precision")[0].clone()))
        trajs.append(traj)
        calls.append(n_calls)
    assert calls == [25, 25, 25]        # no outer evaluation without an active correction
    for other in trajs[1:]:             # bit for bit
        for (m1, S1), (m2, S2) in zip(trajs[0], other):
            assert torch.equal(m1, m2) and torch.equal(S1, S2)
    prob = random_logreg()
    hand = _hand_von(prob, batches, lr=0.3, beta=0.2, ess=40.0, pp=0.5, min_eig=1e-2,
                     noise_scale=1.0, seed=11, update=update)
    for (m1, _), m2 in zip(trajs[0], hand):
        assert torch.allclose(m1, m2, rtol=1e-9, atol=1e-11), (m1 - m2).abs().max()


# ---------------------------------------------------------------------------- Hessians
def test_refresh_stores_chunk_mean_gradient_and_hessian_with_outer_momentum():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Tanh(), torch.nn.Linear(2, 1))
    net = net.double()
    X = torch.randn(12, 3, dtype=torch.float64)
    Y = torch.randn(12, 1, dtype=torch.float64)
    names = [n for n, _ in net.named_parameters()]
    shapes = [p.shape for p in net.parameters()]
    d = sum(p.numel() for p in net.parameters())
    chunks = torch.arange(12).chunk(3)

    def chunk_loss(flat, idx):
        ps, i = {}, 0
        for n, s in zip(names, shapes):
            k = int(np.prod(s))
            ps[n] = flat[i:i + k].view(s)
            i += k
        out = torch.func.functional_call(net, ps, (X[idx],))
        return ((out - Y[idx]) ** 2).mean() + 0.01 * (flat ** 4).sum()

    def closures():
        return [lambda idx=idx: ((net(X[idx]) - Y[idx]) ** 2).mean()
                + 0.01 * sum((p ** 4).sum() for p in net.parameters()) for idx in chunks]

    opts = [VONPoCo(net.parameters(), ess=12.0, rho1=0.5, rho2=0.25, noise_scale=0.3)]
    expected_g = expected_H = None
    for r in range(2):
        opts[0].refresh(closures())
        th = opts[0].flat_state("theta_out")[0]
        mean_fn = lambda u: sum(chunk_loss(u, idx) for idx in chunks) / 3  # noqa: E731
        g = torch.autograd.functional.jacobian(mean_fn, th)
        H = torch.autograd.functional.hessian(mean_fn, th)
        if r == 0:
            expected_g, expected_H = g, H
        else:
            expected_g = 0.5 * expected_g + 0.5 * g
            expected_H = 0.25 * expected_H + 0.75 * H
        assert opts[0].flat_state("H_out")[0].shape == (d, d)
        assert torch.allclose(opts[0].flat_state("g_out")[0], expected_g, atol=1e-12)
        assert torch.allclose(opts[0].flat_state("H_out")[0], expected_H, atol=1e-12)
        opts[0].step(closures()[0])
    # the row-by-row fallback gives the same Hessians as the batched call
    H_batched = opts[0].flat_state("H_out")[0].clone()
    sd = copy.deepcopy(opts[0].state_dict())
    opt_loop = VONPoCo(net.parameters(), ess=12.0, rho1=0.5, rho2=0.25, noise_scale=0.3)
    opt_loop.load_state_dict(sd)
    opt_loop.batched_hessian = False
    opts[0].refresh(closures())
    opt_loop.load_state_dict(sd)
    opt_loop.refresh(closures())
    assert not torch.equal(H_batched, opts[0].flat_state("H_out")[0])
    assert torch.allclose(opt_loop.flat_state("H_out")[0], opts[0].flat_state("H_out")[0],
                          atol=1e-13)


def test_several_groups_give_a_block_diagonal_precision():
    """A separable loss has a block-diagonal Hessian: one group over (a, b) and two groups
    (a), (b) follow the same noise-free trajectory; each group has its own S block."""
    g = torch.Generator().manual_seed(2)
    Xa, Xb = torch.randn(30, 3, generator=g).double(), torch.randn(30, 4, generator=g).double()
    ya = torch.where(torch.rand(30, generator=g) < 0.5, -1.0, 1.0).double()
    yb = torch.where(torch.rand(30, generator=g) < 0.5, -1.0, 1.0).double()

    def make(groups):
        a = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
        b = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
        params = [{"params": [a, b]}] if groups == 1 else [{"params": [a]}, {"params": [b]}]
        opt = VONPoCo(params, ess=30.0, lr=0.5, beta=0.5, noise_scale=0.0, min_eig=1e-3,
                      prior_precision=0.1)

        def closure(idx):
            return lambda: (torch.nn.functional.softplus(-ya[idx] * (Xa[idx] @ a)).mean()
                            + torch.nn.functional.softplus(-yb[idx] * (Xb[idx] @ b)).mean()
                            + 0.05 * (a @ a + b @ b))
        return opt, (a, b), closure

    runs = []
    for groups in (1, 2):
        opt, (a, b), closure = make(groups)
        traj = []
        for t in range(12):
            if t % 4 == 0:
                opt.refresh([closure(torch.arange(30))])
            opt.step(closure(torch.arange(t % 6 * 5, t % 6 * 5 + 5)))
            traj.append(torch.cat([a.detach(), b.detach()]).clone())
        runs.append((opt, traj))
    (o1, t1), (o2, t2) = runs
    assert [S.shape for S in o2.flat_state("precision")] == [(3, 3), (4, 4)]
    S1 = o1.flat_state("precision")[0]
    assert torch.equal(S1[:3, 3:], torch.zeros(3, 4, dtype=torch.float64))
    assert torch.allclose(torch.block_diag(*o2.flat_state("precision")), S1, rtol=1e-10)
    for x, y in zip(t1, t2):
        assert torch.allclose(x, y, rtol=1e-9, atol=1e-12)
    assert float((t1[-1] - t1[0]).norm()) > 0.1
