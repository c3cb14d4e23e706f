"""``load_state_dict`` is a transaction (see ``test_transactional.py``): a corrupt state
dict (missing or invalid keys, counters, groups, state tensors, pending sums, another
optimizer's dict) is refused with a ValueError before anything changes, and a valid one
continues bit for bit like the optimizer it was saved from.
"""
import copy

import pytest
import torch
from hypothesis import given, settings, strategies as st

from transaction_rig import ALL, BACKENDS, FUSED, HYP, NAN, SEED, Rig, _hyp_params, names
from transaction_twins import assert_twins, run_case


#: tiny tensors: one thread is faster (and VONPoCo's small LAPACK calls much faster)
pytestmark = pytest.mark.usefixtures("one_thread")


# ============================================================================ load_state_dict
def _corrupt(sd, what, name):
    poco, groups, state = sd["poco"], sd["param_groups"], sd["state"]
    if what.startswith("no-"):                       # a missing top-level key
        del sd[what[3:]]
    elif what.startswith("poco-no-"):
        del poco[what[8:]]
    elif what == "seed=-1":
        poco["seed"] = -1
    elif what == "seed=2**70":
        poco["seed"] = 2 ** 70
    elif what == "step=-5":
        poco["step"] = -5
    elif what == "refreshes=-1":
        poco["refreshes"] = -1
    elif what == "step=str":
        poco["step"] = "3"
    elif what == "step=float":
        poco["step"] = 2.5
    elif what == "group1-no-lr":
        del groups[1]["lr"]
    elif what == "group1-lr=-1":
        groups[1]["lr"] = -1.0
    elif what.startswith("state-"):
        key = "mean"
        t = state[2][key]
        state[2][key] = {
            "state-shape": lambda: torch.zeros(t.numel() + 1),
            "state-int": lambda: torch.zeros(t.shape, dtype=torch.int64),
            "state-complex": lambda: torch.zeros(t.shape, dtype=torch.complex64),
            "state-nan": lambda: t.clone().fill_(NAN),
            "state-not-tensor": lambda: t.tolist(),
        }[what]()
    elif what == "class":
        poco["optimizer"] = "IVON" if name != "IVON" else "SVRG"
    elif what == "extra-group":
        groups.append(copy.deepcopy(groups[1]))
    elif what == "missing-group":
        groups.pop()
    elif what == "param-count":
        groups[0]["params"] = groups[0]["params"][:-1]
    elif what == "pending-counts-no-sums":
        poco["pending"]["count"] = {0: 1, 1: 1, 2: 0}
        poco["pending"]["draws"] = {0: 1, 1: 1, 2: 0}
        poco["pending"]["sums"] = {}
    elif what == "pending-no-count":
        del poco["pending"]["count"]
    elif what == "not-a-dict":
        return [sd]
    elif what == "pending-nan":
        sums = poco["pending"]["sums"]
        k = sorted(sums)[0]
        sums[k] = sums[k].clone().fill_(NAN)
    elif what == "pending-g-without-ge":              # (a family that estimates Hessians)
        sums = poco["pending"]["sums"]
        for k in [k for k in sums if k.endswith("/ge")]:
            del sums[k]
    elif what == "lazy-buffer-partial":               # momentum saved for one parameter less
        del state[1]["momentum_buffer"]
    elif what == "h-negative":                        # IVON's h + weight_decay must be > 0
        state[0]["h"] = -state[0]["h"]
    elif what == "exp-avg-sq-negative":
        state[0]["exp_avg_sq"] = state[0]["exp_avg_sq"] - 1.0
    else:
        raise AssertionError(what)
    return sd


CORRUPTIONS = (["no-state", "no-param_groups", "no-poco"]
               + [f"poco-no-{k}" for k in ("step", "refreshes", "seed", "pending", "optimizer")]
               + ["seed=-1", "seed=2**70", "step=-5", "refreshes=-1", "step=str", "step=float",
                  "group1-no-lr", "group1-lr=-1", "state-shape", "state-int", "state-complex",
                  "state-nan", "state-not-tensor", "class", "other-class", "extra-group",
                  "missing-group", "param-count", "pending-counts-no-sums", "pending-no-count",
                  "not-a-dict"])
_LSD_MATCH = {"group1-no-lr": names("lr", 1), "group1-lr=-1": names("lr", 1),
              "seed=-1": "seed", "seed=2**70": "seed", "step=-5": "step",
              "refreshes=-1": "refreshes", "step=str": "step", "step=float": "step",
              "poco-no-step": "step", "poco-no-refreshes": "refreshes", "poco-no-seed": "seed",
              "poco-no-pending": "pending", "poco-no-optimizer": "optimizer|class"}


def _lsd_case(name, backend, what):
    donor = Rig(name, backend)
    donor.run(donor.warm() + " s2" + ("" if donor.von else " i3"))    # elsewhere, pending
    if what == "other-class":
        # (an IVON state dict loads into IVONPoCo: IVON-PoCo continues IVON runs)
        other = {"IVON": "IVONPoCo", "IVONPoCo": "VSGDPoCo", "SVRG": "SVRGAdamW"}.get(name,
                                                                                  "SVRG")
        o = Rig(other, backend)
        o.run(o.warm())
        sd = copy.deepcopy(o.opt.state_dict())
    else:
        sd = _corrupt(copy.deepcopy(donor.opt.state_dict()), what, name)
    run_case(name, backend, raises=ValueError, match=_LSD_MATCH.get(what),
             bad=lambda r: r.opt.load_state_dict(sd))


@pytest.mark.parametrize("name, what", [
    ("IVONPoCo", "pending-nan"), ("SVRG", "pending-nan"), ("IVONPoCo", "pending-g-without-ge"),
    ("SVRG", "lazy-buffer-partial"), ("IVONPoCo", "h-negative"),
    ("SVRGAdamW", "exp-avg-sq-negative")])
@pytest.mark.parametrize("backend", BACKENDS[:2])
def test_state_dict_the_next_update_could_not_use_is_refused(name, what, backend):
    """Pending sums that are not finite or lack their ``gradient * eps`` sum, a momentum
    buffer saved for some of a group's parameters only, state outside its domain."""
    _lsd_case(name, backend, what)


@pytest.mark.parametrize("what", CORRUPTIONS)
@pytest.mark.parametrize("name", ["IVONPoCo", "SVRG"])
def test_corrupt_state_dict_is_refused_before_anything_changes(name, what):
    _lsd_case(name, "torch", what)


@pytest.mark.parametrize("name, backend, n",
                         [p for p in _hyp_params({"torch": 5, "cpp": 5, "triton": 2})
                          if p.values[:2] not in (("IVONPoCo", "torch"), ("SVRG", "torch"))])
def test_corrupt_state_dict_other_optimizers_and_backends(name, backend, n):
    @settings(max_examples=n, **HYP)
    @given(what=st.sampled_from(CORRUPTIONS))
    def check(what):
        _lsd_case(name, backend, what)
    check()


@pytest.mark.parametrize("name", ALL)
def test_valid_state_dict_continues_bit_identically(name):
    backends = ["torch"] if name == "VONPoCo" else ["torch"] + FUSED[:1]
    for backend in backends:
        a = Rig(name, backend)
        a.run(a.warm() + " s2")
        sd = copy.deepcopy(a.opt.state_dict())
        b = Rig(name, backend, seed=SEED + 1)     # everything must come from the dict
        b.opt.load_state_dict(sd)
        with torch.no_grad():
            for p, q in zip(b.model.parameters(), a.model.parameters()):
                p.copy_(q)
        assert_twins(a, b, "right after load_state_dict")
        for op in a.tail().split():
            a.do(op)
            b.do(op)
            assert_twins(a, b, f"after {op!r}")
