"""Invalid hyperparameters are refused before anything changes (see
``test_transactional.py``): ``param_groups`` edited to an invalid value before a step or a
refresh (a ValueError naming the hyperparameter and the group, the optimizer as before and
as its twin), and refused constructors (misspelled keys, invalid values, float64, complex
or duplicate parameters), which must leave the parameters' values and storage untouched.
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from transaction_rig import (ALL, BACKENDS, CORR, FUSED, HYP, INF, MISSPELLED, NAN, Rig,
                             _hyp_params, build, make_model, names)
from transaction_twins import _group_edit, _outcome, run_case


#: tiny tensors: one thread is faster (and VONPoCo's small LAPACK calls much faster)
pytestmark = pytest.mark.usefixtures("one_thread")


#: invalid values of every hyperparameter, per optimizer
_COMMON_BAD = [("lr", -1.0), ("lr", NAN), ("lr", INF), ("lr", "0.1"), ("lr", None)]
_IVON_BAD = _COMMON_BAD + [
    ("ess", 0.0), ("ess", -3.0), ("ess", NAN), ("hess_init", 0.0), ("beta1", 1.0),
    ("beta1", -0.1), ("beta2", 1.0), ("beta2", 1.5), ("weight_decay", -1e-4),
    ("mc_samples", 0), ("mc_samples", 1.5), ("mc_samples", 5000), ("clip_radius", 0.0),
    ("debias", "yes"), ("rescale_lr", 1)]
_SVRG_BAD = _COMMON_BAD + [("alpha", 1.5), ("alpha", -0.1), ("momentum", -0.1),
                           ("dampening", -1.0), ("weight_decay", -1.0), ("nesterov", "no")]
BAD_HP = {
    "IVON": _IVON_BAD,
    "IVONPoCo": _IVON_BAD + [("alpha", 1.5), ("alpha", -0.1), ("rho1", 1.0), ("rho2", -0.5),
                             ("hess_corr_scale", -1.0), ("outer_noise", "same"),
                             ("refresh_samples", 0), ("hess_floor", -1.0)],
    "SVRG": _SVRG_BAD,
    "SVRGAdamW": _COMMON_BAD + [("betas", (0.9, 1.0)), ("betas", (1.0, 0.9)), ("betas", 0.9),
                                ("eps", -1e-8), ("weight_decay", -0.1), ("alpha", 2.0)],
    "VSGDPoCo": _SVRG_BAD + [("sigma", -1.0), ("sigma", NAN), ("mc_samples", 0)],
    "VONPoCo": _COMMON_BAD + [("beta", 0.0), ("beta", 1.5), ("ess", 0.0), ("alpha", 1.5),
                              ("prior_precision", 0.0), ("min_eig", 0.0), ("min_eig", 2.0),
                              ("noise_scale", -1.0), ("rho1", 1.0), ("precision_update", "exact")],
}


_CALLS = {
    "step": (lambda r: r.opt.step(r.closure(2)), "", False),
    "step-pending": (lambda r: r.opt.step(), " i2", False),
    "refresh": (lambda r: r.opt.refresh(r.chunks(1)), "", True),
    "refresh-pending": (lambda r: r.opt.refresh(), " f2", True),
}


@pytest.mark.parametrize("name, backend, n", _hyp_params({"torch": 8, "cpp": 4, "triton": 2}))
def test_invalid_group_value_is_refused_before_anything_changes(name, backend, n):
    """param_groups edited to an invalid value (any hyperparameter, either group) before
    step/refresh (closures or pending low-level gradients): a ValueError naming the
    hyperparameter (and 'group 1' when the second group is at fault), nothing changed,
    pending sums kept."""
    calls = [c for c, (_, _, needs_corr) in _CALLS.items()
             if (not needs_corr or name in CORR) and (name != "VONPoCo" or "pending" not in c)]

    @settings(max_examples=n, **HYP)
    @given(bad=st.sampled_from(BAD_HP[name]), gi=st.sampled_from([0, 1]),
           call=st.sampled_from(calls))
    def check(bad, gi, call):
        key, value = bad
        f, extra, _ = _CALLS[call]
        probe = Rig(name, backend)
        match = names(key, 1 if gi == 1 else None)
        run_case(name, backend, history=probe.warm() + extra, raises=ValueError, match=match,
                 bad=_group_edit(key, value, gi, f))
    check()


# ============================================================================ constructor
def _ctor_cases():
    out = []
    for name in ALL:
        wrong, right = MISSPELLED[name]
        backends = ["torch"] if name == "VONPoCo" else BACKENDS
        for backend in backends:
            out.append(pytest.param(name, backend, {wrong: 0.5}, None, TypeError, right,
                                    id=f"misspelled-kw-{name}-{backend}"))
            out.append(pytest.param(name, backend, {}, {wrong: 0.5}, (ValueError, TypeError),
                                    right, id=f"misspelled-group-key-{name}-{backend}"))
            out.append(pytest.param(name, backend, {"lr": -1.0}, None, ValueError, "lr",
                                    id=f"bad-lr-{name}-{backend}"))
            out.append(pytest.param(name, backend, {}, {"lr": -1.0}, ValueError,
                                    names("lr", 1),
                                    id=f"bad-lr-group1-{name}-{backend}"))
            out.append(pytest.param(name, backend, {"seed": -1}, None, ValueError, "seed",
                                    id=f"bad-seed-{name}-{backend}"))
            out.append(pytest.param(name, backend, {"seed": 2 ** 70}, None, ValueError, "seed",
                                    id=f"huge-seed-{name}-{backend}"))
            out.append(pytest.param(name, backend, {"check_finite": "yes"}, None, ValueError,
                                    "check_finite", id=f"bad-check-finite-{name}-{backend}"))
        if name != "VONPoCo":
            for backend in FUSED:
                out.append(pytest.param(name, backend, {}, "float64", (RuntimeError, ValueError),
                                        "float64", id=f"float64-{name}-{backend}"))
        out.append(pytest.param(name, "torch", {}, "complex", ValueError, "complex",
                                id=f"complex-{name}-torch"))
        out.append(pytest.param(name, "torch", {}, "duplicate", ValueError,
                                "more than one|already", id=f"duplicate-{name}-torch"))
    return out


@pytest.mark.parametrize("name, backend, kw, group1, raises, match", _ctor_cases())
def test_refused_construction_leaves_parameters_untouched(name, backend, kw, group1, raises,
                                                          match):
    """A refused constructor leaves the parameters as they were: same values AND same
    storage (the fused backends re-point ``p.data`` into flat buffers on success)."""
    model = make_model()
    extra = []
    if group1 == "float64":
        extra = [torch.nn.Parameter(torch.randn(3, dtype=torch.float64))]
    elif group1 == "complex":
        extra = [torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))]
    elif group1 == "duplicate":
        extra = [model[0].weight]
    groups = [{"params": list(model[0].parameters())},
              {"params": [model[2].weight] + extra,
               **(group1 if isinstance(group1, dict) else {})}]
    everything = list(model.parameters()) + extra
    values = [p.detach().clone() for p in everything]
    ptrs = [p.data_ptr() for p in everything]
    problem = _outcome(lambda _: build(name, groups, backend, **kw), None, raises, match)
    if problem is None or not problem.startswith("did not raise"):
        for i, (p, v, ptr) in enumerate(zip(everything, values, ptrs)):
            assert p.data_ptr() == ptr, (f"parameter {i}: storage re-pointed by a refused "
                                         f"constructor (and the call {problem})")
            assert torch.equal(p.detach(), v), (f"parameter {i}: value changed by a refused "
                                                f"constructor (and the call {problem})")
    assert problem is None, f"the constructor {problem}"
    # and a correct construction over the same parameters works (torch.optim fills the
    # defaults into the caller's group dicts: fresh ones here)
    build(name, [{"params": list(model[0].parameters())}, {"params": [model[2].weight]}],
          backend)


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=10, **HYP)
@given(data=st.data())
def test_invalid_hyperparameter_at_construction_names_it(name, data):
    """Any invalid hyperparameter, given as a default or in group 1: a ValueError naming it
    (and 'group 1' for the second group), the parameters untouched."""
    key, value = data.draw(st.sampled_from(BAD_HP[name]))
    in_group1 = data.draw(st.booleans())
    backend = data.draw(st.sampled_from(["torch"] if name == "VONPoCo" else BACKENDS))
    model = make_model()
    g1 = {"params": [model[2].weight], **({key: value} if in_group1 else {})}
    groups = [{"params": list(model[0].parameters())}, g1]
    ptrs = [p.data_ptr() for p in model.parameters()]
    values = [p.detach().clone() for p in model.parameters()]
    match = names(key, 1 if in_group1 else None)
    kw = {} if in_group1 else {key: value}
    problem = _outcome(lambda _: build(name, groups, backend, **kw), None, (ValueError, TypeError),
                       match)
    assert [p.data_ptr() for p in model.parameters()] == ptrs, f"storage re-pointed ({problem})"
    assert all(torch.equal(p.detach(), v) for p, v in zip(model.parameters(), values)), problem
    assert problem is None, f"the constructor with {key}={value!r} {problem}"
