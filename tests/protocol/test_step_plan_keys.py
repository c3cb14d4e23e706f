"""What a step plan is made from and when it applies (``poco_kernels._step_plan``): two
agreeing iterations make it, a schedule's new values replay it, the groups' stamp and the
engine's buffers it was made from must be the ones in place, and no plan where a group
holds a tensor, AMP arguments come, a CUDA graph is captured or the rule does not declare
plans."""
import pytest
import torch

import poco_kernels as pk
from poco_kernels._step_plan import StepPlan
from helpers import FUSED_BACKENDS, Problem, mlp
from plan_twins import make_twins, same_run

pytestmark = pytest.mark.usefixtures("one_thread")

CPP = [b for b in FUSED_BACKENDS if b == "cpp"]


@pytest.mark.parametrize("backend", CPP)
def test_a_plan_is_made_from_two_agreeing_iterations_and_kept_through_a_new_value(backend):
    (m, opt), _ = make_twins(pk.IVONPoCoMo, backend)
    prob = Problem()
    opt.refresh([prob.closure(opt, m, 3)])
    kinds = []
    for t in range(6):
        opt.step(prob.closure(opt, m, t % 5))
        kinds.append(type(opt._step_plan).__name__)
    assert "StepPlan" in kinds[:3] and kinds[-3:] == ["StepPlan"] * 3, kinds
    plan = opt._step_plan
    assert [k for k, *_ in plan.samples] == [0, 1]       # inner, outer
    stamp = plan.stamp
    opt.param_groups[0]["beta2"] = 0.9999                 # derived again, then planned
    opt.step(prob.closure(opt, m, 0))
    assert opt._step_plan is plan and plan.stamp is not stamp
    opt.param_groups[0]["debias"] = not opt.param_groups[0]["debias"]   # another variant
    opt.step(prob.closure(opt, m, 1))
    assert opt._step_plan is not plan


@pytest.mark.parametrize("backend", CPP)
@pytest.mark.parametrize("cls", [pk.IVON, pk.IVONPoCoMo])
def test_a_schedule_replays_with_its_new_values(cls, backend, monkeypatch):
    """A learning rate (and an ess) set before every iteration: the launches are derived
    again, found to be the planned ones with new values in their rows, and replayed."""
    twins = make_twins(cls, backend)
    prob = Problem()
    replays = []
    real = type(twins[0][1])._replay
    monkeypatch.setattr(type(twins[0][1]), "_replay",
                        lambda self, *a: replays.append(self) or real(self, *a))
    for t in range(12):
        for m, opt in twins:
            if cls is not pk.IVON and t % 4 == 1:
                opt.refresh([prob.closure(opt, m, 3)])
            opt.param_groups[0]["lr"] = 0.05 * (1 - t / 20)
            opt.param_groups[0]["ess"] = 200.0 + t
            opt.step(prob.closure(opt, m, t % 5))
        same_run(*twins)
    assert len([o for o in replays if o is twins[0][1]]) >= 7


@pytest.mark.parametrize("backend", CPP)
def test_no_plan_where_a_group_holds_a_tensor_or_amp_arguments_come(backend):
    (m, opt), _ = make_twins(pk.IVON, backend, lr=torch.tensor(0.05))
    prob = Problem()
    for t in range(4):
        opt.step(prob.closure(opt, m, t))
    assert opt._step_plan is None
    (m, opt), _ = make_twins(pk.IVON, backend)
    for t in range(4):
        opt.step(prob.closure(opt, m, t), grad_scale=torch.tensor(1.0),
                 found_inf=torch.tensor(0.0))
    assert opt._step_plan is None


@pytest.mark.parametrize("backend", CPP)
def test_a_plan_fits_only_the_buffers_it_was_made_from(backend):
    (m, opt), _ = make_twins(pk.IVON, backend)
    prob = Problem()
    for t in range(4):
        opt.step(prob.closure(opt, m, t))
    plan, corr = opt._step_plan, opt._corrected_buckets()
    assert isinstance(plan, StepPlan) and opt._planned(corr) is plan
    b = opt._buckets[0]
    h = b.buffers["h"]
    b.buffers["h"] = h.clone()                # (what the launches read is another tensor)
    assert opt._planned(corr) is None
    b.buffers["h"] = h
    assert opt._planned(corr) is plan


@pytest.mark.parametrize("backend", CPP)
def test_no_plan_is_replayed_or_recorded_while_a_cuda_graph_is_captured(backend, monkeypatch):
    """A capture holds the slow path's launches (as it did before plans)."""
    from poco_kernels.backends import fused_grads
    twins = make_twins(pk.IVONPoCoMo, backend)
    prob = Problem()
    for m, opt in twins:
        opt.refresh([prob.closure(opt, m, 3)])
        for t in range(4):
            opt.step(prob.closure(opt, m, t))
    assert isinstance(twins[0][1]._step_plan, StepPlan)
    monkeypatch.setattr(fused_grads, "_capturing", lambda: True)
    cls = type(twins[0][1])
    calls, real = [], cls._replay
    monkeypatch.setattr(cls, "_replay", lambda self, *a: calls.append(self) or real(self, *a))
    for t in range(2):
        for m, opt in twins:
            opt.step(prob.closure(opt, m, t))
        same_run(*twins)
    assert calls == [] and twins[0][1]._step_plan is None


@pytest.mark.parametrize("backend", CPP)
def test_only_rules_that_declare_it_are_planned(backend):
    """VSGD-PoCo (its momentum buffer made at the first step) runs the slow path."""
    m, prob = mlp(), Problem()
    opt = pk.VSGDPoCo(m.parameters(), lr=0.05, sigma=0.01, momentum=0.9, backend=backend)
    for t in range(5):
        opt.step(prob.closure(opt, m, t))
    assert not opt.rule.step_plans and opt._step_plan is None


@pytest.mark.parametrize("backend", CPP)
def test_the_group_stamp_is_what_was_validated(backend):
    """``_check_groups`` keeps the groups' stamp (the plans' key): the same object while
    nothing in a group is replaced, a new one when a value is, None while a group is
    refused or holds a value that changes in place (a tensor)."""
    from poco_kernels._step_plan import group_stamp
    (m, opt), _ = make_twins(pk.IVON, backend)
    prob = Problem()
    opt.step(prob.closure(opt, m, 0))
    s0 = group_stamp(opt)
    assert s0 is not None and s0[0][0] is opt.param_groups[0]
    opt.step(prob.closure(opt, m, 1))
    assert group_stamp(opt) is s0
    g = opt.param_groups[0]
    g["lr"] = 0.04
    opt.step(prob.closure(opt, m, 2))
    s1 = group_stamp(opt)
    assert s1 is not s0 and any(x is g["lr"] for x in s1[0][1])
    g["lr"] = -1.0
    with pytest.raises(ValueError):
        opt.step(prob.closure(opt, m, 3))
    assert group_stamp(opt) is None
    g["lr"] = 0.04
    opt.step(prob.closure(opt, m, 3))
    s2 = group_stamp(opt)
    assert s2 is not None and s2 is not s1
    g["params"] = list(g["params"])           # (the same parameters, a new list)
    opt.step(prob.closure(opt, m, 4))
    s3 = group_stamp(opt)
    assert s3 is not None and s3 is not s2
    g["lr"] = torch.tensor(0.04)
    opt.step(prob.closure(opt, m, 5))
    assert group_stamp(opt) is None
