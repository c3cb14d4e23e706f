"""torch.optim habits that took a decision here (docs/design.md, 'torch.optim conventions'),
beyond the generic checks of tests/conventions/test_torch_*.py (missing gradients,
frozen parameters, the seed, ``betas``, ``refresh(closure)``, torch's flags: there, for
every optimizer): a gradient missing at some samples only, unfreezing and freezing
parameters mid-run, IVON -> IVON-PoCo(Mo), parameters shared with another optimizer, the
first momentum step, VON-PoCo's checks."""
import pytest
import torch

import poco_kernels as pk
from helpers import FUSED_BACKENDS, Problem, mlp, params_of
from tolerances import TRAJECTORY, assert_close

pytestmark = pytest.mark.usefixtures("one_thread")

CPU_BACKENDS = ["torch"] + [b for b in FUSED_BACKENDS if b == "cpp"]


# ---------------------------------------------------------------- None gradients
# (a parameter without a gradient at every sample: tests/conventions/test_torch_gradients.py)
def test_none_at_some_samples_counts_as_zero_there():
    """With two samples, a gradient missing at one of them counts as zero for that one:
    the step equals one whose closure gives a zero gradient there."""
    prob = Problem()
    out = []
    for zero in (False, True):
        model = mlp()
        p = model[0].weight
        opt = pk.IVON(model.parameters(), lr=0.05, ess=200.0, mc_samples=2, seed=2,
                      backend="torch")
        calls = []

        def c():
            opt.zero_grad()
            loss = prob.loss(model, torch.arange(8))
            loss.backward()
            calls.append(1)
            if len(calls) % 2 == 0:
                if zero:
                    p.grad.zero_()
                else:
                    p.grad = None
            return loss
        opt.step(c)
        out.append(params_of(model))
    for a, b in zip(*out):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- frozen parameters
def test_frozen_parameters_are_never_sampled_nor_moved_and_unfreezing_works():
    runs = {be: _frozen_scenario(be) for be in CPU_BACKENDS}
    for be, out in runs.items():
        for a, b in zip(runs["torch"], out):
            assert_close(b, a, TRAJECTORY[torch.float32], be)


def _frozen_scenario(be):
    prob = Problem()
    model = mlp()
    frozen = model[0].weight
    frozen.requires_grad_(False)
    w0 = frozen.detach().clone()
    opt = pk.IVONPoCo(model.parameters(), lr=0.05, ess=50.0, seed=1, backend=be)
    assert frozen not in opt.state
    seen = []

    def closure(idx):
        def c():
            opt.zero_grad()
            seen.append(frozen.detach().clone())
            loss = prob.loss(model, idx)
            loss.backward()
            return loss
        return c
    batches = prob.batches(8)
    opt.step(closure(batches[0]))
    opt.refresh(closure(batches[1]))
    opt.step(closure(batches[2]))
    assert all(torch.equal(s, w0) for s in seen) and torch.equal(frozen, w0)
    # unfreeze: the next step lays the buckets out again; the group waits for a refresh
    frozen.requires_grad_(True)
    kept = {k: v.clone() for k, v in opt.state[model[2].weight].items()}
    with opt.sampled(accumulate=False):                # (lays the buckets out again)
        pass
    for k, v in kept.items():                          # state carried over
        assert torch.equal(opt.state[model[2].weight][k], v), k
    assert torch.equal(opt.state[frozen]["h"], torch.ones_like(frozen))    # hess_init
    assert torch.equal(opt.state[frozen]["mean"], w0)
    assert not opt.correction_active()                 # the group awaits the next refresh
    opt.step(closure(batches[3]))
    assert not torch.equal(frozen, w0)
    opt.refresh(closure(batches[4]))
    assert opt.correction_active()
    # freeze another: it keeps its value, loses its state
    b = model[2].bias
    b.requires_grad_(False)
    b0 = b.detach().clone()
    opt.step(closure(batches[5]))
    assert torch.equal(b, b0) and b not in opt.state
    # a state dict of the new layout loads into an optimizer built with it
    sd = opt.state_dict()
    twin_model = mlp()
    twin_model.load_state_dict(model.state_dict())
    twin_model[2].bias.requires_grad_(False)
    twin = pk.IVONPoCo(twin_model.parameters(), lr=0.05, ess=50.0, backend=be)
    twin.load_state_dict(sd)
    for o, m, idx in ((opt, model, batches[6]), (twin, twin_model, batches[6])):
        o.step(prob.closure(o, m, idx))
    for x, y in zip(params_of(model), params_of(twin_model)):
        assert torch.equal(x, y)
    return params_of(model)


def test_requires_grad_changed_while_pending_is_refused():
    prob = Problem()
    model = mlp()
    opt = pk.IVON(model.parameters(), lr=0.05, ess=50.0, mc_samples=2, seed=1)
    with opt.sampled():
        prob.loss(model, torch.arange(8)).backward()
    model[0].bias.requires_grad_(False)
    with pytest.raises(RuntimeError, match="pending"):
        opt.sample()
    model[0].bias.requires_grad_(True)
    with opt.sampled():
        prob.loss(model, torch.arange(8)).backward()
    opt.step()


def test_von_poco_refuses_a_changed_trainable_set():
    model = torch.nn.Linear(3, 1)
    opt = pk.VONPoCo(model.parameters(), ess=10.0)
    model.bias.requires_grad_(False)
    with pytest.raises(RuntimeError, match="build the optimizer again"):
        opt.step(lambda: model(torch.randn(4, 3)).pow(2).mean())


# ---------------------------------------------------------------- IVON -> IVON-PoCo(Mo)
@pytest.mark.parametrize("be", CPU_BACKENDS)
@pytest.mark.parametrize("how", ["from_ivon", "from_ivon-mo", "load_state_dict"])
def test_ivon_poco_continues_an_ivon_run(be, how):
    """``IVONPoCo.from_ivon(ivon, **poco_kwargs)``, ``IVONPoCoMo.from_ivon(ivon)`` and
    ``poco.load_state_dict(ivon.state_dict())`` continue an IVON run (IVON-PoCo is IVON
    until its first refresh: the same steps bit for bit), with IVON's seed, backend, step
    count, lr and ess, and the PoCo hyperparameters given (IVONPoCoMo's defaults
    otherwise); then refresh and the corrected step work."""
    prob = Problem()
    batches = prob.batches(8)
    ma, mb = mlp(), mlp()
    a = pk.IVON(ma.parameters(), lr=0.05, ess=100.0, seed=5, backend=be)
    b = pk.IVON(mb.parameters(), lr=0.05, ess=100.0, seed=5, backend=be)
    for t in range(3):
        a.step(prob.closure(a, ma, batches[t]))
        b.step(prob.closure(b, mb, batches[t]))
    b.param_groups[0]["name"] = "all"
    poco_kw = dict(alpha=0.25, rho1=0.5, rho2=0.125)
    if how == "from_ivon":
        c = pk.IVONPoCo.from_ivon(b, **poco_kw)
    elif how == "from_ivon-mo":
        c = pk.IVONPoCoMo.from_ivon(b, alpha=0.5)
        poco_kw = dict(alpha=0.5, rho1=0.6, rho2=0.1)
    else:
        c = pk.IVONPoCo(mb.parameters(), lr=1.0, ess=1.0, seed=0, backend=be, **poco_kw)
        c.load_state_dict(b.state_dict())
    assert isinstance(c, pk.IVONPoCoMo if how == "from_ivon-mo" else pk.IVONPoCo)
    assert (c.seed, c.backend, c.step_count) == (5, b.backend, 3)
    g = c.param_groups[0]
    assert {k: g[k] for k in poco_kw} == poco_kw
    assert (g["lr"], g["ess"]) == (0.05, 100.0)
    if how != "load_state_dict":
        assert g["name"] == "all"
    for t in range(3, 6):                              # before a refresh: IVON's steps
        la = a.step(prob.closure(a, ma, batches[t]))
        lc = c.step(prob.closure(c, mb, batches[t]))
        assert torch.equal(la, lc), t
    for x, y in zip(params_of(ma), params_of(mb)):
        assert torch.equal(x, y)
    c.refresh(prob.closure(c, mb, batches[0]))
    c.step(prob.closure(c, mb, batches[6]))
    assert c.correction_active() and c.refresh_count == 1
    assert all(torch.isfinite(x).all() for x in mb.parameters())
    with pytest.raises(TypeError, match="IVON's hyperparameters"):
        pk.IVONPoCo.from_ivon(a, lr=0.1)
    with pytest.raises(TypeError, match="IVON optimizer"):
        pk.IVONPoCo.from_ivon(pk.SVRG(ma.parameters()))


def test_ivon_poco_mo_is_ivon_poco_with_outer_momentum():
    assert "IVONPoCoMo" in pk.__all__ and issubclass(pk.IVONPoCoMo, pk.IVONPoCo)
    g = pk.IVONPoCoMo(mlp().parameters(), lr=0.125, ess=100.0, backend="torch").param_groups[0]
    assert (g["rho1"], g["rho2"]) == (0.6, 0.1)        # the paper's GPT-2 settings
    g = pk.IVONPoCoMo(mlp().parameters(), lr=0.125, ess=100.0, rho1=0.3,
                      backend="torch").param_groups[0]
    assert g["rho1"] == 0.3


def test_an_ivon_state_dict_loads_into_ivon_poco_and_pocomo_interload():
    prob = Problem()
    model = mlp()
    ivon = pk.IVON(model.parameters(), lr=0.05, ess=100.0, seed=3, backend="torch")
    ivon.step(prob.closure(ivon, model, torch.arange(8)))
    poco = pk.IVONPoCo(model.parameters(), lr=1.0, ess=1.0, alpha=0.3, rho1=0.5,
                       backend="torch")
    poco.step(prob.closure(poco, model, torch.arange(8)))
    poco.refresh(prob.closure(poco, model, torch.arange(8)))     # g_out nonzero
    poco.load_state_dict(ivon.state_dict())
    g = poco.param_groups[0]
    assert (g["lr"], g["ess"], g["alpha"], g["rho1"]) == (0.05, 100.0, 0.3, 0.5)
    assert (poco.seed, poco.step_count, poco.refresh_count) == (3, 1, 0)
    assert not poco.correction_active()
    for name in ("g_out", "h_out", "m_out", "sigma_out"):
        assert not any(t.abs().sum() for t in poco.flat_state(name))
    assert torch.equal(poco.flat_state("h")[0], ivon.flat_state("h")[0])
    mo = pk.IVONPoCoMo(model.parameters(), lr=0.05, ess=100.0)
    mo.load_state_dict(poco.state_dict())
    poco.load_state_dict(mo.state_dict())
    with pytest.raises(ValueError, match="is for 'IVONPoCo'"):
        ivon.load_state_dict(poco.state_dict())


# ---------------------------------------------------------------- requires_grad, sharing, momentum
@pytest.mark.parametrize("be", CPU_BACKENDS)
def test_state_dicts_and_copies_follow_requires_grad_changes(be):
    """A state dict (or copy) taken after a requires_grad change has the new layout, and
    freezing a parameter keeps its group's correction (the others' outer state holds)."""
    import copy
    prob = Problem()
    model = mlp()
    opt = pk.IVONPoCo(model.parameters(), lr=0.05, ess=50.0, seed=2, backend=be)
    opt.step(prob.closure(opt, model, torch.arange(8)))
    opt.refresh(prob.closure(opt, model, torch.arange(16)))
    model[2].bias.requires_grad_(False)
    sd = opt.state_dict()
    assert opt.correction_active()
    opt.load_state_dict(sd)
    model[2].bias.requires_grad_(True)
    m2, o2 = copy.deepcopy((model, opt))
    for o, m in ((opt, model), (o2, m2)):
        o.step(prob.closure(o, m, torch.arange(8)))
    for a, b in zip(params_of(model), params_of(m2)):
        assert torch.equal(a, b)


def test_bf16_parameters_taken_by_another_optimizer_keep_its_changes():
    if "cpp" not in CPU_BACKENDS:
        pytest.skip("needs the C++ extension")
    w = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    a = pk.SVRG([w], lr=0.5, backend="cpp")
    b = pk.SVRG([w], lr=0.25, backend="cpp")
    for opt in (a, b, a):
        w.grad = torch.ones(3, dtype=torch.bfloat16)
        opt.step()
    assert w.tolist() == [-0.25] * 3


@pytest.mark.parametrize("be", CPU_BACKENDS)
def test_a_first_momentum_step_not_taken_leaves_no_buffer(be):
    """SGD's momentum buffer is made at the first step taken: a refused or skipped first
    step leaves none (the next step starts it as torch.optim.SGD does)."""
    ws = [torch.nn.Parameter(torch.ones(3)) for _ in range(2)]
    opts = [pk.SVRG([w], lr=0.1, momentum=0.9, dampening=0.5, backend=be) for w in ws]
    ws[1].grad = torch.tensor([1.0, float("nan"), 1.0])
    with pytest.raises(ValueError, match="non-finite"):
        opts[1].step()
    ws[1].grad = torch.ones(3)
    opts[1].step(found_inf=torch.tensor(1.0))
    assert "momentum_buffer" not in opts[1].state[ws[1]]
    for w, o in zip(ws, opts):
        for _ in range(2):
            w.grad = torch.ones(3)
            o.step()
    assert torch.equal(ws[0], ws[1])


def test_von_poco_checks_a_precision_a_load_pre_hook_returns():
    model = torch.nn.Linear(3, 1)
    opt = pk.VONPoCo(model.parameters(), ess=10.0, seed=0)
    good = opt.state_dict()
    bad = {**good, "poco": {**good["poco"], "bucket_buffers": {
        k: -torch.eye(v.shape[0]) for k, v in good["poco"]["bucket_buffers"].items()}}}
    opt.register_load_state_dict_pre_hook(lambda o, sd: bad)
    before = opt.flat_state("mean")[0].clone()
    with pytest.raises(ValueError, match="positive definite"):
        opt.load_state_dict(good)
    assert torch.equal(opt.flat_state("mean")[0], before)
