"""Copies of an optimizer (``copy.deepcopy``, pickle) continue bit-identically; several
optimizers over the same parameters (the fused backends re-link parameters taken off their
flat buffers); ``torch.compile`` of a training step that calls ``opt.step(closure)``."""
import copy
import pickle
import re

import pytest
import torch
import torch.nn.functional as F

import poco_kernels as pk
from helpers import FUSED_BACKENDS, available_backends
from optim_db import configs

BACKENDS = available_backends()

#: the optimizer database's copy configurations (tests/optim_db.py), by class name; a
#: configuration with an outer loop refreshes every 3 steps
CONFIGS = {c.optimizer: c for c in configs("copy")}
EVERY = 3
MODES = ["deepcopy", "deepcopy-pair", "pickle-pair"]


def _copy_cases():
    """Every backend; every mode for the representative configurations (IVON-PoCo, SVRG),
    the pair deepcopy for the others (CI time)."""
    out = []
    for c in CONFIGS.values():
        for b in c.runs_on():
            modes = MODES if c.representative else ["deepcopy-pair"]
            out += [pytest.param(c.optimizer, b, m, id=f"{c.id}-{b}-{m}") for m in modes]
    return out


COPY_CASES = _copy_cases()


class Prob:
    """Softmax regression on 32 points (3 classes, 4 features); fixed batches."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.X = torch.randn(32, 4, generator=g)
        self.Y = torch.randint(0, 3, (32,), generator=g)
        self.batches = [torch.randint(0, 32, (8,), generator=g) for _ in range(12)]
        self.chunks = list(torch.arange(32).chunk(2))

    def loss(self, ps, idx):
        return F.cross_entropy(F.linear(self.X[idx], ps[0], ps[1]), self.Y[idx])

    def closure(self, opt, ps, idx):
        if isinstance(opt, pk.VONPoCo):          # VON-PoCo closures return the loss only
            return lambda: self.loss(ps, idx)

        def c():
            for p in ps:
                p.grad = None
            loss = self.loss(ps, idx)
            loss.backward()
            return loss
        return c

    def drive(self, opt, ps, start, stop, every):
        losses = []
        for t in range(start, stop):
            if every and t % every == 0:
                opt.refresh([self.closure(opt, ps, c) for c in self.chunks])
            losses.append(opt.step(self.closure(opt, ps, self.batches[t])).detach())
        return losses


def build(name, backend, **kw):
    c = CONFIGS[name]
    torch.manual_seed(3)
    model = torch.nn.Linear(4, 3)
    ps = list(model.parameters())
    groups = [{"params": ps[:1]}, {"params": ps[1:], "lr": c.kwargs["lr"] * 0.5}]
    return model, c.make(groups, backend, seed=5, **kw), EVERY if c.info.has_refresh else None


def params_of(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def public(opt):
    return {k for k in opt.__dict__ if not k.startswith("_")}


def assert_same(o1, o2):
    """Same parameters, counters and state (pending sums included), bit for bit."""
    for a, b in zip(params_of(o1), params_of(o2)):
        assert torch.equal(a, b)
    assert (o1.step_count, o1.refresh_count, o1.skipped_updates) == \
        (o2.step_count, o2.refresh_count, o2.skipped_updates)
    s1, s2 = o1.state_dict(), o2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for i in s1["state"]:
        assert s1["state"][i].keys() == s2["state"][i].keys()
        for k in s1["state"][i]:
            assert torch.equal(s1["state"][i][k], s2["state"][i][k]), (i, k)
    p1, p2 = s1["poco"], s2["poco"]
    assert {k: v for k, v in p1.items() if k not in ("pending", "bucket_buffers")} == \
        {k: v for k, v in p2.items() if k not in ("pending", "bucket_buffers")}
    for k in p1["bucket_buffers"]:
        assert torch.equal(p1["bucket_buffers"][k], p2["bucket_buffers"][k]), k
    for k in ("count", "draws"):
        assert p1["pending"][k] == p2["pending"][k]
    assert p1["pending"]["sums"].keys() == p2["pending"]["sums"].keys()
    for k in p1["pending"]["sums"]:
        assert torch.equal(p1["pending"]["sums"][k], p2["pending"]["sums"][k]), k


def copied(mode, model, opt):
    """(model, optimizer) copied by ``mode``; ``model`` is None for a copy of the
    optimizer alone (its parameters are then new tensors of no module)."""
    if mode == "deepcopy":
        return None, copy.deepcopy(opt)
    if mode == "deepcopy-pair":
        return copy.deepcopy((model, opt))
    return pickle.loads(pickle.dumps((model, opt)))


def assert_flat(opt):
    """Fused backends: the parameters are views of the optimizer's own flat buffers."""
    for b in opt._buckets:
        if getattr(b, "flat_param", None) is not None:
            for p, off in zip(b.params, b.offsets):
                assert p.data_ptr() == b.flat_param.data_ptr() + off * p.element_size()


# --------------------------------------------------------------------------- copies
@pytest.mark.parametrize("name,backend,mode", COPY_CASES)
def test_a_copy_continues_bit_identically(name, backend, mode, one_thread):
    prob = Prob()
    model, opt, every = build(name, backend)
    prob.drive(opt, params_of(opt), 0, 4, every)          # refreshes at 0 and 3
    opt.note = "kept"                                     # a user's attribute
    m2, o2 = copied(mode, model, opt)
    assert type(o2) is type(opt) and o2.backend == opt.backend
    assert public(o2) == public(opt) and o2.note == "kept"
    assert (o2.seed, o2.check_finite, o2.defaults) == (opt.seed, opt.check_finite, opt.defaults)
    ps1, ps2 = params_of(opt), params_of(o2)
    assert all(a is not b and a.data_ptr() != b.data_ptr() for a, b in zip(ps1, ps2))
    if m2 is not None:                                    # the copied model's parameters
        assert all(a is b for a, b in zip(m2.parameters(), ps2))
    assert_flat(o2)
    assert_flat(opt)
    assert_same(opt, o2)
    l1 = prob.drive(opt, ps1, 4, 11, every)               # steps and refreshes after
    l2 = prob.drive(o2, ps2, 4, 11, every)
    assert all(torch.equal(a, b) for a, b in zip(l1, l2))
    assert_same(opt, o2)


#: pending gradients: the representatives and the configuration without an outer loop;
#: both kinds of pending sums where the optimizer is noisy and refreshes
PENDING = [pytest.param(c.optimizer, b, k, id=f"{c.id}-{b}-{k}")
           for c in configs("copy", grad_closure=True)
           if c.representative or not c.info.has_refresh
           for b in c.runs_on()
           for k in (("inner", "refresh") if c.info.has_refresh and c.info.noisy
                     else ("inner",))]


@pytest.mark.parametrize("name,backend,kind", PENDING)
def test_a_copy_keeps_pending_gradients(name, backend, kind):
    """Gradients accumulated but not yet used by step()/refresh() are copied (two draws:
    the fused backends' gradient * eps sums too)."""
    prob = Prob()
    model, opt, every = build(name, backend)
    prob.drive(opt, params_of(opt), 0, 2, every)
    kinds = [kind] + (["outer"] if kind == "inner" and opt.correction_active() else [])
    for k in kinds:
        for idx in prob.batches[5:7]:
            with opt.sampled(k):
                prob.loss(params_of(opt), idx).backward()
    m2, o2 = copy.deepcopy((model, opt))
    assert_same(opt, o2)
    for o in (opt, o2):
        o.refresh() if kind == "refresh" else o.step()
    assert_same(opt, o2)
    prob.drive(opt, params_of(opt), 2, 5, every)
    prob.drive(o2, params_of(o2), 2, 5, every)
    assert_same(opt, o2)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "triton"])
def test_copy_drops_hooks_and_is_refused_during_a_sample(backend):
    prob = Prob()
    model, opt, every = build("IVONPoCo", backend)
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("step"))
    opt.register_state_dict_post_hook(lambda o, sd: calls.append("state_dict"))
    prob.drive(opt, params_of(opt), 0, 2, every)
    calls.clear()
    opt.sample()
    with pytest.raises(RuntimeError, match="restore"):
        copy.deepcopy(opt)
    opt.restore()
    o2 = copy.deepcopy(opt)
    assert calls == []                   # the state dict's hooks did not run for the copy
    assert not o2._optimizer_step_pre_hooks and not o2._optimizer_state_dict_post_hooks
    prob.drive(o2, params_of(o2), 2, 4, every)
    assert calls == [] and o2.step_count == 4
    prob.drive(opt, params_of(opt), 2, 4, every)
    assert calls.count("step") == 2
    assert_same(opt, o2)


@pytest.mark.parametrize("fused", FUSED_BACKENDS)
def test_a_copy_keeps_the_skipped_updates_count(fused):
    prob = Prob()
    model, opt, every = build("IVON", fused, check_finite=False)
    opt.step(prob.closure(opt, params_of(opt), prob.batches[0]), found_inf=torch.ones(1))
    assert opt.skipped_updates == 1 and opt.step_count == 0
    o2 = pickle.loads(pickle.dumps(opt))
    assert o2.skipped_updates == 1 and o2.check_finite is False
    assert_same(opt, o2)


# --------------------------------------------------------------------------- sharing
@pytest.mark.parametrize("backend", BACKENDS)
def test_ivon_warmup_then_ivonpoco_over_the_same_parameters(backend):
    """The paper's workflow: IVON warm-up, IVON-PoCo built over the same parameters while
    the IVON object lives; both keep working, each from the parameters' current values
    (the parameters are the truth), as separate models would."""
    prob = Prob()
    model, ivon, _ = build("IVON", backend)
    prob.drive(ivon, params_of(ivon), 0, 3, None)
    ref_model, ref_ivon = copy.deepcopy((model, ivon))    # the same, unshared
    c, every = CONFIGS["IVONPoCo"], EVERY
    poco = c.make(model.parameters(), backend, seed=9)
    ref_poco = c.make(ref_model.parameters(), backend, seed=9)
    prob.drive(poco, params_of(poco), 3, 8, every)
    prob.drive(ref_poco, params_of(ref_poco), 3, 8, every)
    assert_same(poco, ref_poco)
    # back to IVON, from where IVON-PoCo left the parameters
    prob.drive(ivon, params_of(ivon), 8, 10, None)
    prob.drive(ref_ivon, params_of(ref_ivon), 8, 10, None)
    assert_same(ivon, ref_ivon)
    assert_flat(ivon)
    # and IVON-PoCo again
    prob.drive(poco, params_of(poco), 10, 12, every)
    prob.drive(ref_poco, params_of(ref_poco), 10, 12, every)
    assert_same(poco, ref_poco)
    assert_flat(poco)


@pytest.mark.parametrize("fused", FUSED_BACKENDS)
def test_replaced_storage_of_the_same_layout_is_relinked(fused):
    """``p.data = t`` (same shape, dtype, device) counts as writing ``t`` into ``p``."""
    prob = Prob()
    m1, o1, every = build("SVRG", fused)
    m2, o2, _ = build("SVRG", fused)
    prob.drive(o1, params_of(o1), 0, 2, every)
    prob.drive(o2, params_of(o2), 0, 2, every)
    with torch.no_grad():
        w1, w2 = params_of(o1)[0], params_of(o2)[0]
        w1.data = (w1 + 0.5).t().contiguous().t()         # new, non-contiguous storage
        w2.add_(0.5)                                      # in place
    assert torch.equal(w1, w2)
    prob.drive(o1, params_of(o1), 2, 5, every)
    prob.drive(o2, params_of(o2), 2, 5, every)
    assert_same(o1, o2)
    assert_flat(o1)


@pytest.mark.parametrize("fused", FUSED_BACKENDS)
def test_step_and_restore_write_into_parameters_another_optimizer_took(fused):
    prob = Prob()
    model, opt, every = build("IVON", fused)
    ps = params_of(opt)
    prob.drive(opt, ps, 0, 2, every)
    with opt.sampled():
        prob.loss(ps, prob.batches[3]).backward()
    pk.IVON(model.parameters(), lr=0.1, ess=10.0, backend=fused)    # takes the parameters
    opt.step()                                  # gradients collected before: the new mean
    mean = opt.flat_state("mean")
    assert all(torch.equal(p.reshape(-1), mean[i]) for i, p in enumerate(ps))
    assert_flat(opt)
    pk.IVON(model.parameters(), lr=0.1, ess=10.0, backend=fused)
    with torch.no_grad():
        ps[0].add_(1.0)                          # the other optimizer's parameters now
    opt.restore()
    assert torch.equal(ps[0].reshape(-1), opt.flat_state("mean")[0])
    assert_flat(opt)


@pytest.mark.parametrize("fused", FUSED_BACKENDS)
@pytest.mark.parametrize("change", ["dtype", "shape"])
def test_a_changed_layout_still_raises_naming_it(fused, change):
    prob = Prob()
    model, opt, every = build("IVON", fused)
    ps = params_of(opt)
    prob.drive(opt, ps, 0, 1, every)
    before = [p.detach().clone() for p in ps]
    ps[1].data = ps[1].detach().double() if change == "dtype" else torch.zeros(1, 3)
    was = "torch.float32 -> torch.float64" if change == "dtype" else "(3,) -> (1, 3)"
    with pytest.raises(RuntimeError, match=re.escape(
            f"parameter 0 of param group 1: its storage was replaced by one of another "
            f"{change} ({was})")):
        opt.step(prob.closure(opt, ps, prob.batches[1]))
    assert opt.step_count == 1 and torch.equal(ps[0], before[0])
    opt.restore()                                # no error: the mean where it can go


# --------------------------------------------------------------------------- compile
@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name,backend", [(n, "auto") for n in ("IVONPoCo", "SVRG", "VONPoCo")]
                         + [("IVONPoCo", "torch")])
def test_compiled_training_step_with_a_closure(name, backend, fresh_dynamo, one_thread):
    """``torch.compile`` (inductor) of a function that calls ``opt.step(closure)`` (and
    ``opt.refresh(closures)``) gives the eager results: the optimizer's protocol runs
    outside Dynamo, which would drop its writes to the optimizer's attributes."""
    prob = Prob()
    results = []
    for compiled in (False, True):
        model, opt, every = build(name, backend)
        ps = params_of(opt)

        def train_step(idx):
            return opt.step(prob.closure(opt, ps, idx))

        def refresh_step():
            return opt.refresh([prob.closure(opt, ps, c) for c in prob.chunks])

        if compiled:
            train_step, refresh_step = torch.compile(train_step), torch.compile(refresh_step)
        losses = []
        for t in range(4):
            if every and t % every == 0:
                refresh_step()
            losses.append(train_step(prob.batches[t]).detach())
        results.append((opt, losses))
    (o1, l1), (o2, l2) = results
    assert all(torch.equal(a, b) for a, b in zip(l1, l2))
    assert_same(o1, o2)


def test_compiling_step_alone_still_works(fresh_dynamo):
    prob = Prob()
    opts = []
    for compiled in (False, True):
        model, opt, _ = build("IVON", "auto")
        ps = params_of(opt)
        step = torch.compile(opt.step) if compiled else opt.step
        for t in range(3):
            with opt.sampled():
                prob.loss(ps, prob.batches[t]).backward()
            step()
        opts.append(opt)
    assert_same(*opts)
