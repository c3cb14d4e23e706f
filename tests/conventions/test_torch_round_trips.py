"""torch.optim's round trips for every optimizer, the Triton kernels included (the table:
tests/conventions/torch_conventions.py): a state dict through torch.save and a
weights_only load, ``copy.deepcopy`` and pickle, each continuing bit for bit.
Whole-trajectory resumes at many cut points are tests/state/test_state_dict.py's.
"""
import copy
import io
import pickle

import pytest
import torch

from torch_conventions import CASES, CASES_RT, Tiny, assert_equal_dicts, drive, make, same, snap

#: tiny tensors: torch's thread pool only costs here (conftest's fixture)
pytestmark = pytest.mark.usefixtures("one_thread")


# ============================================================================ state dict
@pytest.mark.parametrize("kind,backend", CASES_RT)
def test_state_dict_deterministic(kind, backend):
    """A state dict saved with torch.save and read back with weights_only=True (torch's
    default) loads into an optimizer over equal but not identical parameters, which then
    runs step for step with the original; loading does not modify the dict; both
    optimizers' state dicts are then equal."""
    m1 = Tiny()
    o1 = make(kind, m1.parameters(), backend)
    drive(o1, m1, 0, 2)
    sd = o1.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert_equal_dicts(loaded, sd)
    kept = copy.deepcopy(loaded)

    m2 = Tiny(seed=7)
    with torch.no_grad():
        for a, b in zip(m2.parameters(), m1.parameters()):
            a.copy_(b)
    o2 = make(kind, m2.parameters(), backend, seed=99)
    o2.load_state_dict(loaded)
    assert_equal_dicts(loaded, kept, "the loaded dict")          # not modified by loading

    for t in range(2, 4):
        l1, l2 = drive(o1, m1, t, t + 1), drive(o2, m2, t, t + 1)
        assert torch.equal(l1, l2), t
        assert same(snap(m1), snap(m2)), t
    assert_equal_dicts(o1.state_dict(), o2.state_dict())


@pytest.mark.parametrize("kind,backend", CASES_RT)
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copy_continues_bit_identically(kind, backend, how):
    """``copy.deepcopy((model, opt))`` and a pickle round trip give an optimizer over the
    copied parameters (with every public attribute of the original) that continues
    exactly as the original, independently of it."""
    m1 = Tiny()
    o1 = make(kind, m1.parameters(), backend)
    drive(o1, m1, 0, 2)
    if how == "deepcopy":
        m2, o2 = copy.deepcopy((m1, o1))
    else:
        m2, o2 = pickle.loads(pickle.dumps((m1, o1)))
    public = lambda o: {k for k in o.__dict__ if not k.startswith("_")}  # noqa: E731
    assert public(o2) == public(o1)
    assert type(o2) is type(o1)
    assert [id(p) for g in o2.param_groups for p in g["params"]] == \
        [id(p) for p in m2.parameters()]
    before = snap(m1)
    l2 = drive(o2, m2, 2, 3)                  # the copy alone: the original is untouched
    assert same(snap(m1), before)
    l1 = drive(o1, m1, 2, 3)
    assert torch.equal(l1, l2) and same(snap(m1), snap(m2))
    assert not same(snap(m1), before)
    l1, l2 = drive(o1, m1, 3, 4), drive(o2, m2, 3, 4)
    assert torch.equal(l1, l2) and same(snap(m1), snap(m2))


@pytest.mark.parametrize("kind,backend", CASES)
def test_a_loaded_tensor_lr_is_the_optimizers_own(kind, backend):
    """As torch.optim copies the saved groups: an optimizer loaded from another's state
    dict holds its own tensor ``lr``, so a scheduler writing the saving optimizer's
    tensor in place (``fill_``) moves neither the loaded one nor the dict."""
    m1, m2 = Tiny(), Tiny()
    lr = float(make(kind, Tiny().parameters(), backend).param_groups[0]["lr"])
    o1 = make(kind, m1.parameters(), backend, lr=torch.tensor(lr))
    o2 = make(kind, m2.parameters(), backend, lr=torch.tensor(lr))
    sd = o1.state_dict()
    o2.load_state_dict(sd)
    assert o2.param_groups[0]["lr"] is not o1.param_groups[0]["lr"]
    assert o2.param_groups[0]["lr"] is not sd["param_groups"][0]["lr"]
    o1.param_groups[0]["lr"].fill_(lr / 2)
    assert float(o2.param_groups[0]["lr"]) == lr
