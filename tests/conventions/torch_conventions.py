"""The table, the problem and the drivers shared by tests/conventions/test_torch_*.py: the
conventions every ``torch.optim`` optimizer follows, as PyTorch's own optimizer suite checks
them (``test/test_optim.py``'s generic tests over ``optim_db``, the error inputs of
``torch/testing/_internal/common_optimizers.py``, the lr schedulers of
``torch.optim.lr_scheduler``), parametrized over every optimizer of the tests' optimizer
database (tests/optim_db.py, its ``conventions`` configurations) and every backend that
runs on the CPU.

Adapted to the package: IVON-family and VSGD-PoCo steps take a closure (zero grads,
forward, backward, return the loss); VON-PoCo closures return the loss WITHOUT calling
backward; the kinds with an outer loop also refresh.  Design differences that are NOT
checked for torch's behaviour: state is allocated at construction (not lazily), duplicate
parameters are refused (ValueError, torch warns), and a step in which no trainable
parameter received a gradient is an error (torch: a no-op).

The Triton backend runs through its CPU interpreter (slow): it takes the round trips
(state dict, deepcopy, pickle, hooks) and missing gradients, for every fused optimizer
(the other checks are the engine's, which the backends share).
"""
import pytest
import torch
from torch.nn import Parameter

import poco_kernels as pk
from helpers import available_backends
from optim_db import configs

# ----------------------------------------------------------------------------- the table
#: the optimizer database's conventions configurations (tests/optim_db.py), by class name.
#: Their lr values are powers of two: a float lr and the same lr as a float32 tensor are
#: then the same number whatever the implementation rounds through.
KINDS = {c.optimizer: c for c in configs("conventions")}
#: the optimizers whose closures call backward (.grad-based)
CLOSURE_KINDS = [k for k, c in KINDS.items() if c.info.grad_closure]

BACKENDS = available_backends()
CPU_BACKENDS = [b for b in BACKENDS if b != "triton"]


def _cases(kinds, backends):
    """``kinds`` on ``backends`` (those of them that their class runs)."""
    return [pytest.param(k, b, id=f"{k}-{b}") for k in kinds for b in backends
            if b in KINDS[k].info.backends]


def _own_cases(backends):
    """Every optimizer on the backends of ``backends`` that its configuration runs."""
    return [pytest.param(k, b, id=f"{k}-{b}") for k, c in KINDS.items()
            for b in c.runs_on() if b in backends]


#: every optimizer on the torch backend and the C++ kernels
CASES = _own_cases(CPU_BACKENDS)
#: ... and the Triton kernels (the round trips and missing gradients)
CASES_RT = CASES + _own_cases(["triton"])
OMIT = object()


def lr_of(kind):
    return KINDS[kind].kwargs["lr"]


def make(kind, params, backend, seed=5, **over):
    """The table's optimizer ``kind``; ``seed=OMIT`` passes no seed."""
    if seed is not OMIT:
        over["seed"] = seed
    return KINDS[kind].make(params, backend, **over)


# ----------------------------------------------------------------------------- the problem
_G = torch.Generator().manual_seed(1234)
X = torch.randn(24, 5, generator=_G)
Y = torch.randn(24, 3, generator=_G)
T = torch.randn(7, generator=_G)
BATCHES = [torch.randint(0, 24, (6,), generator=_G) for _ in range(12)]
CHUNKS = list(torch.arange(24).chunk(2))
FULL = torch.arange(24)


class Tiny(torch.nn.Module):
    """Trainable ``w`` (3, 5) and ``v`` (7,); ``extra`` names more trainable tensors (4,),
    ``frozen`` tensors (4,) with requires_grad=False that the loss also reads."""

    def __init__(self, seed=3, extra=(), frozen=()):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = Parameter(torch.randn(3, 5, generator=g))
        self.v = Parameter(torch.randn(7, generator=g))
        for n in extra:
            setattr(self, n, Parameter(torch.randn(4, generator=g)))
        for n in frozen:
            setattr(self, n, Parameter(torch.randn(4, generator=g), requires_grad=False))
        self.extra, self.frozen = tuple(extra), tuple(frozen)

    def loss(self, idx, skip=()):
        out = ((X[idx] @ self.w.T - Y[idx]) ** 2).mean() + ((self.v - T) ** 2).mean()
        for n in self.extra:
            if n not in skip:
                out = out + ((getattr(self, n) - 0.5) ** 2).mean()
        for n in self.frozen:
            out = out + 0.1 * (getattr(self, n) * self.v[:4]).sum()
        return out


def has_outer(opt):
    return not isinstance(opt, pk.IVON) or isinstance(opt, pk.IVONPoCo)


def closure(opt, model, idx, skip=(), backward=True):
    if isinstance(opt, pk.VONPoCo):
        return lambda: model.loss(idx, skip)

    def c():
        opt.zero_grad()
        loss = model.loss(idx, skip)
        if backward:
            loss.backward()
        return loss
    return c


def refresh(opt, model):
    return opt.refresh([closure(opt, model, c) for c in CHUNKS])


def drive(opt, model, start, stop):
    """Steps ``start..stop-1``; the kinds with an outer loop refresh before every odd step
    (the correction is on from step 1)."""
    losses = []
    for t in range(start, stop):
        if has_outer(opt) and t % 2 == 1:
            refresh(opt, model)
        losses.append(opt.step(closure(opt, model, BATCHES[t])).detach().reshape(()))
    return torch.stack(losses)


def snap(model):
    return [p.detach().clone() for p in model.parameters()]


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def full_loss(model):
    with torch.no_grad():
        return float(model.loss(FULL))


def assert_equal_dicts(a, b, where="state dict"):
    """Equal nested containers, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {set(a) ^ set(b)}"
        for k in a:
            assert_equal_dicts(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal_dicts(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _other_lr(kind):
    return lr_of(kind) / 2
