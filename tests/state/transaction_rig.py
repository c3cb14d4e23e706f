"""The world of the transactional tests (``test_transactional.py`` and its siblings in
this directory): a tiny model with two parameter groups and a spare bias, its data, the
optimizers built from the optimizer database's transactional configuration, and
:class:`Rig`, an optimizer with its closures, its faults (a non-finite gradient, the user's
own exception) and the op language that histories and continuations are written in, see
:meth:`Rig.do`.

Also what several of those files share: the optimizers by property, the hypothesis
settings and parametrization, the misspelled hyperparameter of each optimizer, an exception
raised inside ``sampled()``, and the optimizer each kind of bad call runs on the Triton
interpreter.
"""
import re

import pytest
import torch
from hypothesis import HealthCheck, Phase

import poco_kernels as pk
from helpers import available_backends
from optim_db import configs, names as optimizers


BACKENDS = available_backends()
FUSED = [b for b in BACKENDS if b != "torch"]

# the optimizers by property (tests/optim_db.py)
GRAD = optimizers(grad_closure=True)                         # the .grad protocol
GRAD_CORR = optimizers(grad_closure=True, has_refresh=True)  # ... with a correction
NOISY_GRAD = optimizers(grad_closure=True, noisy=True)       # need a sample per step
ALL = optimizers()                                           # VONPoCo: torch backend only
CORR = optimizers(has_refresh=True)
NAN, INF = float("nan"), float("inf")
SEED = 7

#: deterministic, and no shrinking: a failing example is reported as generated (shrinking
#: would re-run the case dozens of times), and the first one stops the search
HYP = dict(deadline=None, derandomize=True, database=None, report_multiple_bugs=False,
           phases=[Phase.explicit, Phase.generate],
           suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def names(key, group=None):
    """A loose pattern for an error message naming hyperparameter ``key`` (and the parameter
    group ``group``: "group 1", "param group 1", "param_groups[1]", ...), in any order."""
    k = re.escape(key)
    if group is None:
        return k
    g = rf"group\w*\W{{0,3}}{group}\b"
    return rf"(?s)({k}.*{g}|{g}.*{k})"


# ============================================================================ the world
_g = torch.Generator().manual_seed(11)
X = torch.randn(24, 5, generator=_g)
Y = torch.randint(0, 2, (24,), generator=_g)
BATCHES = [torch.randint(0, 24, (8,), generator=_g) for _ in range(10)]
CHUNKS = [[torch.arange(0, 12), torch.arange(12, 24)],                       # refresh r: r % 2
          [torch.arange(0, 8), torch.arange(8, 16), torch.arange(16, 24)]]


def make_model():
    """Linear(5, 3) - Tanh - Linear(3, 2); the last bias is the *spare* parameter, not in
    the optimizer until a test adds it."""
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


#: group 1 (the second Linear's weight) differs from group 0 in some hyperparameter
GROUP1 = {"IVON": dict(lr=0.03), "IVONPoCo": dict(lr=0.03, alpha=0.8), "SVRG": dict(lr=0.02),
          "SVRGAdamW": dict(lr=5e-3), "VSGDPoCo": dict(lr=0.02), "VONPoCo": dict(lr=0.05)}
#: the optimizer database's transactional configuration of each optimizer
DEFAULTS = {c.optimizer: c.kwargs for c in configs("transactional")}


def build(name, groups, backend, check_finite=True, **kw):
    """``check_finite=True`` (VONPoCo: None, it always checks) unless given otherwise."""
    if name == "VONPoCo" and check_finite is True:
        check_finite = None
    args = dict(DEFAULTS[name], seed=SEED, backend=backend, check_finite=check_finite)
    args.update(kw)
    return getattr(pk, name)(groups, **args)


class Boom(Exception):
    """The user's own exception, raised inside a closure or a ``sampled()`` block."""


class _Poke(torch.autograd.Function):
    """Adds nothing to the loss and ``value`` (nan, inf, -inf) to the gradient of its input:
    a non-finite gradient for both closure conventions (``.grad`` and VONPoCo's)."""

    @staticmethod
    def forward(ctx, x, value):
        ctx.value = value
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, g):
        return g * ctx.value, None


class Rig:
    """An optimizer over a tiny model (two groups; the spare bias outside), the closures,
    and the op language of histories and continuations."""

    def __init__(self, name, backend, check_finite=True, **kw):
        self.name, self.backend = name, backend
        self.model = make_model()
        self.spare = self.model[2].bias
        groups = [{"params": list(self.model[0].parameters())},
                  {"params": [self.model[2].weight], **GROUP1[name]}]
        self.opt = build(name, groups, backend, check_finite, **kw)
        self.von = name == "VONPoCo"
        self.calls = 0          # loss evaluations since the last arm()
        self.poke = None        # (value, evaluation, parameter index, element)
        self.boom_at = None     # the evaluation that raises Boom

    # ------------------------------------------------------------------ faults
    def arm(self, poke=None, boom_at=None):
        self.calls, self.poke, self.boom_at = 0, poke, boom_at
        return self

    def disarm(self):
        self.poke = self.boom_at = None

    # ------------------------------------------------------------------ losses, closures
    def loss(self, idx):
        self.calls += 1
        if self.boom_at == self.calls:
            raise Boom(f"evaluation {self.calls}")
        out = torch.nn.functional.cross_entropy(self.model(X[idx]), Y[idx])
        if self.poke is not None and self.poke[1] == self.calls:
            value, _, pi, e = self.poke
            p = list(self.model.parameters())[pi]
            out = out + _Poke.apply(p.reshape(-1)[e % p.numel()], value)
        return out

    def closure_on(self, idx):
        if self.von:
            return lambda: self.loss(idx)

        def c():
            self.opt.zero_grad()
            loss = self.loss(idx)
            loss.backward()
            return loss
        return c

    def closure(self, t):
        return self.closure_on(BATCHES[t])

    def chunks(self, r):
        return [self.closure_on(c) for c in CHUNKS[r % 2]]

    def backward(self, idx):
        self.opt.zero_grad()
        self.loss(idx).backward()

    def block(self, kind, idx):
        """``with opt.sampled(kind): loss.backward()``."""
        self.opt.zero_grad()
        with self.opt.sampled(kind):
            self.loss(idx).backward()

    # ------------------------------------------------------------------ ops
    def do(self, op):
        """One op of a history: a letter and an optional batch/chunk number.

        ``sN`` step(closure N)       ``rN`` refresh(chunks N)
        ``iN`` sampled inner (+ sampled outer when the correction is active) on batch N
        ``IN`` sampled inner only    ``ON`` sampled outer (nothing if correction inactive)
        ``fN`` sample('refresh'), every chunk of N accumulated, restore
        ``FN`` sampled refresh on chunk N of the 3-chunk split
        ``S`` step()  ``R`` refresh()  ``+`` sample('inner')
        ``AN`` backward at the active sample on batch N, accumulate, restore
        ``bN`` zero_grad and a plain backward at the mean   ``z`` zero_grad()
        """
        letter, num = op[0], int(op[1:]) if len(op) > 1 else None
        opt = self.opt
        if letter == "s":
            opt.step(self.closure(num))
        elif letter == "r":
            opt.refresh(self.chunks(num))
        elif letter == "i":
            self.block("inner", BATCHES[num])
            if opt.correction_active():
                self.block("outer", BATCHES[num])
        elif letter == "I":
            self.block("inner", BATCHES[num])
        elif letter == "O":
            if opt.correction_active():
                self.block("outer", BATCHES[num])
        elif letter == "f":
            opt.zero_grad()
            opt.sample("refresh")
            for c in CHUNKS[num % 2]:
                self.loss(c).backward()
                opt.accumulate()
            opt.restore()
        elif letter == "F":
            self.block("refresh", CHUNKS[1][num])
        elif letter == "S":
            opt.step()
        elif letter == "R":
            opt.refresh()
        elif letter == "+":
            opt.zero_grad()
            opt.sample("inner")
        elif letter == "A":
            self.loss(BATCHES[num]).backward()
            opt.accumulate()
            opt.restore()
        elif letter == "b":
            self.backward(BATCHES[num])
        elif letter == "z":
            opt.zero_grad()
        else:
            raise AssertionError(op)

    def run(self, ops):
        for op in ops.split():
            self.do(op)

    def warm(self):
        """The shared history: two steps, with a refresh between them where there is one
        (the correction is then active)."""
        return "s0 r0 s1" if self.opt.rule.has_correction else "s0 s1"

    def tail(self):
        """Three more steps, with a refresh after the first where there is one."""
        return "s5 r1 s6 s7" if self.opt.rule.has_correction else "s5 s6 s7"

    def finish_pending(self):
        c = self.opt._pending.count
        return "S " if c[0] else "R " if c[2] else ""


MISSPELLED = {"IVON": ("weight_decy", "weight_decay"), "IVONPoCo": ("weight_decy", "weight_decay"),
              "SVRG": ("weight_decy", "weight_decay"), "SVRGAdamW": ("weight_decy", "weight_decay"),
              "VSGDPoCo": ("weight_decy", "weight_decay"), "VONPoCo": ("min_eigs", "min_eig")}


def _raise_inside(rig, kind, backward):
    rig.opt.zero_grad()
    with rig.opt.sampled(kind):
        if backward:
            rig.loss(BATCHES[2]).backward()
        raise Boom("inside sampled()")


#: the optimizer each kind runs on the Triton interpreter (the kinds that
#: ``test_transactional._kernel_kind`` selects; the cheap SVRG family unless the kind is
#: about the maths)
TRITON_PICK = {
    "step-skip-nonfinite-inner": "IVONPoCo", "step-skip-nonfinite-outer": "SVRGAdamW",
    "step-found-inf": "SVRG", "step-found-inf-low-level": "SVRGAdamW",
    "step-low-level-skip-nonfinite": "VSGDPoCo",
    "refresh-skip-nonfinite": "IVONPoCo", "first-refresh-skip-nonfinite": "SVRG",
    "refresh-found-inf": "SVRGAdamW", "first-refresh-found-inf": "VSGDPoCo",
    "step-closure-nonfinite-then-raises": "SVRG", "refresh-closure-nonfinite-then-raises": "SVRG",
    "sampled-raises-inside": "VSGDPoCo", "add-group-float64": "SVRG",
}


def _hyp_params(examples, triton=("SVRG",)):
    """(name, backend, examples): every optimizer on torch and C++, ``triton`` on Triton."""
    out = []
    for name in ALL:
        for backend in (["torch"] if name == "VONPoCo" else BACKENDS):
            if backend == "triton" and name not in triton:
                continue
            out.append(pytest.param(name, backend, examples[backend], id=f"{name}-{backend}"))
    return out
