"""torch.optim's parameter groups and learning rates for every optimizer (the table:
tests/conventions/torch_conventions.py): per-group lr and ``add_param_group``, two
optimizers over the same parameters, a tensor lr (the float lr's steps), every scheduler
of ``torch.optim.lr_scheduler`` (the lr and the momentum they cycle), and IVON groups'
``betas``.
"""
import warnings

import pytest
import torch
from torch.nn import Parameter
from torch.optim import lr_scheduler as LS

from tolerances import STATE, assert_close
from torch_conventions import (BACKENDS, BATCHES, CASES, CASES_RT, CPU_BACKENDS, KINDS, Tiny,
                               _cases, _other_lr, closure, drive, full_loss, lr_of, make, same,
                               snap)

#: tiny tensors: torch's thread pool only costs here (conftest's fixture)
pytestmark = pytest.mark.usefixtures("one_thread")


# ============================================================================ groups
@pytest.mark.parametrize("kind,backend", CASES)
def test_param_groups_lr_and_add_param_group(kind, backend):
    """torch's test_param_groups_lr (a group with lr 0 does not move) and add_param_group
    (defaults filled in, the new group steps, a parameter already there is refused)."""
    m = Tiny(extra=("u", "z"))
    o = make(kind, [{"params": [m.w, m.v]}, {"params": [m.u], "lr": 0.0}], backend)
    assert set(o.param_groups[1]) == set(o.param_groups[0])
    start = snap(m)
    drive(o, m, 0, 2)
    assert torch.equal(m.u, start[2])
    assert not torch.equal(m.w, start[0]) and not torch.equal(m.v, start[1])
    assert torch.equal(m.z, start[3])                 # in no group yet

    with pytest.raises(ValueError, match="more than one parameter group"):
        o.add_param_group({"params": [m.w]})
    o.add_param_group({"params": [m.z]})
    assert set(o.param_groups[2]) == set(o.param_groups[0])
    assert o.param_groups[2]["lr"] == lr_of(kind)
    drive(o, m, 2, 4)
    assert not torch.equal(m.z, start[3])
    assert torch.equal(m.u, start[2])


@pytest.mark.parametrize("kind,backend", CASES)
def test_two_optimizers_over_the_same_params(kind, backend):
    """IVON steps, a second optimizer over the same parameters steps, IVON steps again: the
    parameters are the source of truth (an optimizer with lr 0 leaves them as the other
    left them)."""
    m = Tiny()
    o1 = make("IVON", m.parameters(), backend)
    o1.step(closure(o1, m, BATCHES[0]))
    o2 = make(kind, m.parameters(), backend, seed=6)
    o2.step(closure(o2, m, BATCHES[1]))
    after2 = snap(m)
    o1.param_groups[0]["lr"] = 0.0
    o1.step(closure(o1, m, BATCHES[2]))
    assert same(snap(m), after2)
    o1.param_groups[0]["lr"] = lr_of("IVON")
    o1.step(closure(o1, m, BATCHES[3]))
    after1 = snap(m)
    assert not same(after1, after2) and all(torch.isfinite(p).all() for p in after1)
    o2.param_groups[0]["lr"] = 0.0
    o2.step(closure(o2, m, BATCHES[4]))
    assert same(snap(m), after1)


# ============================================================================ lr
@pytest.mark.parametrize("kind,backend", CASES)
@pytest.mark.parametrize("num_dim", [0, 1, 2])
def test_tensor_lr(kind, backend, num_dim):
    """lr as a one-element tensor of 0, 1 or 2 dimensions: the float lr's trajectory."""
    lr = lr_of(kind)
    m1, m2 = Tiny(), Tiny()
    o1 = make(kind, m1.parameters(), backend)
    o2 = make(kind, m2.parameters(), backend, lr=torch.tensor(lr).reshape([1] * num_dim))
    for t in range(3):
        drive(o1, m1, t, t + 1)
        drive(o2, m2, t, t + 1)
        for a, b in zip(snap(m1), snap(m2)):
            assert_close(b, a, STATE[torch.float32], f"step {t}")


@pytest.mark.parametrize("kind,backend", CASES_RT + _cases(
    ["SVRGAdamW"], [b for b in BACKENDS if b == "triton"]))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_tensor_lr_takes_the_float_lrs_steps_bit_for_bit(kind, backend, dtype):
    """A tensor lr that holds the float lr's value takes the float lr's steps bit for bit
    (5 steps, refreshes between them): nothing derived from lr (AdamW's weight-decay
    factor and bias-corrected step size, IVON's rescaled lr) is computed otherwise, or
    kept, for a tensor.  float64: a value float32 cannot hold (0.8 lr); float32: the
    table's power of two.  (``torch.tensor(0.01)`` is float32: it holds another number
    than the float 0.01, and AdamW's lr-dependent factors can then round apart in the
    last place, as docs/design.md says.)"""
    lr = lr_of(kind) * (0.8 if dtype == torch.float64 else 1.0)
    m1, m2 = Tiny(), Tiny()
    o1 = make(kind, m1.parameters(), backend, lr=lr)
    o2 = make(kind, m2.parameters(), backend, lr=torch.tensor(lr, dtype=dtype))
    for t in range(5):
        drive(o1, m1, t, t + 1)
        drive(o2, m2, t, t + 1)
        assert same(snap(m1), snap(m2)), f"step {t}"


@pytest.mark.parametrize("kind,backend", CASES)
def test_a_numpy_lr_takes_the_float_lrs_steps_bit_for_bit(kind, backend):
    """A numpy scalar lr (a schedule computed from a float32 table: ``0.5 * np.float32``
    stays one), which torch.optim takes, is taken as its float value, bit for bit."""
    np = pytest.importorskip("numpy")
    lr = float(np.float32(lr_of(kind) * 0.8))
    m1, m2 = Tiny(), Tiny()
    o1 = make(kind, m1.parameters(), backend, lr=lr)
    o2 = make(kind, m2.parameters(), backend, lr=np.float32(lr))
    for t in range(3):
        o2.param_groups[0]["lr"] = np.float32(lr)
        drive(o1, m1, t, t + 1)
        drive(o2, m2, t, t + 1)
        assert same(snap(m1), snap(m2)), f"step {t}"


@pytest.mark.parametrize("kind,backend", CASES)
@pytest.mark.parametrize("sched", ["StepLR", "ReduceLROnPlateau"])
def test_param_group_with_lrscheduler_goes_right_direction(kind, backend, sched):
    m = Tiny()
    o = make(kind, [{"params": [m.w]}, {"params": [m.v], "lr": _other_lr(kind)}], backend)
    s = (LS.StepLR(o, step_size=3, gamma=0.9) if sched == "StepLR"
         else LS.ReduceLROnPlateau(o))
    initial = full_loss(m)
    for t in range(8):
        loss = drive(o, m, t, t + 1)[0]
        if sched == "ReduceLROnPlateau":
            s.step(loss)
        else:
            s.step()
    assert full_loss(m) < initial


SCHEDULERS = {
    "LambdaLR": lambda o: LS.LambdaLR(o, lambda e: 0.5 ** e),
    "MultiplicativeLR": lambda o: LS.MultiplicativeLR(o, lambda e: 0.5),
    "StepLR": lambda o: LS.StepLR(o, step_size=2, gamma=0.5),
    "MultiStepLR": lambda o: LS.MultiStepLR(o, milestones=[1, 3], gamma=0.5),
    "ConstantLR": lambda o: LS.ConstantLR(o, factor=0.5, total_iters=2),
    "LinearLR": lambda o: LS.LinearLR(o, start_factor=0.25, total_iters=3),
    "ExponentialLR": lambda o: LS.ExponentialLR(o, gamma=0.5),
    "PolynomialLR": lambda o: LS.PolynomialLR(o, total_iters=4, power=2.0),
    "CosineAnnealingLR": lambda o: LS.CosineAnnealingLR(o, T_max=3),
    "CosineAnnealingWarmRestarts": lambda o: LS.CosineAnnealingWarmRestarts(o, T_0=2),
    "CyclicLR": lambda o, **kw: LS.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=2, **kw),
    "OneCycleLR": lambda o, **kw: LS.OneCycleLR(o, max_lr=0.1, total_steps=8, **kw),
    "ReduceLROnPlateau": lambda o: LS.ReduceLROnPlateau(o, factor=0.5, patience=0),
    "SequentialLR": lambda o: LS.SequentialLR(
        o, [LS.ConstantLR(o, factor=0.5, total_iters=2), LS.ExponentialLR(o, gamma=0.5)],
        milestones=[2]),
    "ChainedScheduler": lambda o: LS.ChainedScheduler(
        [LS.ConstantLR(o, factor=0.5, total_iters=2), LS.ExponentialLR(o, gamma=0.5)]),
}
CYCLING = ("CyclicLR", "OneCycleLR")


def _momentum(kind, group):
    name = KINDS[kind].info.momentum_key
    return group["betas"][0] if name == "betas" else group[name]


@pytest.mark.parametrize("kind,backend", CASES)
@pytest.mark.parametrize("sched", list(SCHEDULERS))
def test_every_lr_scheduler(kind, backend, sched):
    """Every scheduler of torch.optim.lr_scheduler drives the lr (and, CyclicLR and
    OneCycleLR, the momentum: IVON's beta1, SGD's momentum, AdamW's beta1) exactly as on
    torch's SGD / AdamW, between steps, without warnings; VON-PoCo has no momentum to
    cycle (torch's ValueError)."""
    m = Tiny()
    o = make(kind, m.parameters(), backend)
    dummy = Parameter(torch.zeros(1))
    lr = lr_of(kind)
    momentum = KINDS[kind].info.momentum_key
    ref = (torch.optim.AdamW([dummy], lr=lr) if momentum in ("betas", "beta1")
           else torch.optim.SGD([dummy], lr=lr, momentum=0.9))
    factory = SCHEDULERS[sched]
    if sched in CYCLING and momentum is None:
        with pytest.raises(ValueError, match="momentum"):
            factory(o)
        factory = lambda opt, f=factory: f(opt, cycle_momentum=False)  # noqa: E731
    s, s_ref = factory(o), factory(ref)
    cycles = sched in CYCLING and momentum is not None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(4):
            loss = drive(o, m, t, t + 1)[0]
            dummy.grad = torch.zeros_like(dummy)
            ref.step()
            if sched == "ReduceLROnPlateau":
                s.step(1.0)
                s_ref.step(1.0)
            else:
                s.step()
                s_ref.step()
            assert o.param_groups[0]["lr"] == ref.param_groups[0]["lr"], t
            if cycles:
                ref_m = (ref.param_groups[0]["betas"][0] if isinstance(ref, torch.optim.AdamW)
                         else ref.param_groups[0]["momentum"])
                assert _momentum(kind, o.param_groups[0]) == ref_m, t
            assert torch.isfinite(loss)
    assert not [w for w in caught if "lr_scheduler" in str(w.message)]
    assert all(torch.isfinite(p).all() for p in m.parameters())


@pytest.mark.parametrize("kind,backend", CASES)
def test_scheduled_lr_reaches_the_update(kind, backend):
    """The lr a scheduler writes is the one the next step uses (lr 0: nothing moves)."""
    m = Tiny()
    o = make(kind, m.parameters(), backend)
    s = LS.LambdaLR(o, lambda e: 0.0 if e >= 1 else 1.0)
    before = snap(m)
    drive(o, m, 0, 1)
    s.step()
    assert o.param_groups[0]["lr"] == 0.0 and not same(snap(m), before)
    before = snap(m)
    drive(o, m, 1, 3)
    assert same(snap(m), before)


#: the IVON family (beta1, beta2)
IVON_FAMILY = [k for k, c in KINDS.items() if c.info.momentum_key == "beta1"]


@pytest.mark.parametrize("kind,backend", _cases(IVON_FAMILY, CPU_BACKENDS))
def test_ivon_groups_answer_betas(kind, backend):
    """IVON groups read and write ``betas`` as ``(beta1, beta2)`` (what torch's
    schedulers cycle); it is not a key of its own: not in keys() nor the state dict."""
    m1, m2 = Tiny(), Tiny()
    o1 = make(kind, m1.parameters(), backend)
    g = o1.param_groups[0]
    assert g["betas"] == (g["beta1"], g["beta2"])
    g["betas"] = (0.5, 0.999)
    assert (g["beta1"], g["beta2"]) == (0.5, 0.999) and g["betas"] == (0.5, 0.999)
    assert "betas" not in list(g.keys())
    assert "betas" in g and "betas" in o1.defaults
    assert "betas" not in o1.state_dict()["param_groups"][0]
    with pytest.raises(ValueError, match="beta1, beta2"):
        g["betas"] = 0.5
    o2 = make(kind, m2.parameters(), backend, beta1=0.5, beta2=0.999)
    l1, l2 = drive(o1, m1, 0, 3), drive(o2, m2, 0, 3)
    assert torch.equal(l1, l2) and same(snap(m1), snap(m2))
    # a group given betas; dict updates go through the alias too
    o3 = make(kind, [{"params": [Parameter(torch.randn(3))], "betas": (0.5, 0.9)}], backend)
    g = o3.param_groups[0]
    assert (g["beta1"], g["beta2"]) == (0.5, 0.9)
    g.update({"betas": (0.5, 0.6)})
    assert (g["beta1"], g["beta2"]) == (0.5, 0.6) and "betas" not in g.keys()
    assert g.setdefault("betas", (0.1, 0.2)) == (0.5, 0.6)
    g |= {"betas": (0.7, 0.8)}
    assert g["beta1"] == 0.7
