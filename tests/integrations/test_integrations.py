"""poco_kernels.integrations, what the Hugging Face Trainer, accelerate and Lightning
integrations share, on the CPU with the fused C++ backend: safetensors saves every
parameter of a fused bucket once the state dict owns its storage (and drops them
without); the examples run.  Each integration's own tests: test_hf_trainer.py,
test_accelerate.py, test_lightning.py."""
from __future__ import annotations

import os

import pytest
import torch

import poco_kernels
from integration_common import ROOT, _net
from poco_kernels.integrations import keep_state_dicts_separate, own_storage


# --------------------------------------------------------------------------- storage
def test_safetensors_keeps_every_parameter_of_a_fused_bucket(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    model = _net()
    poco_kernels.IVON(model.parameters(), lr=0.1, ess=10.0, backend="cpp")
    ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(ptrs) == 1                            # one flat bucket: the problem
    # without separate storage, safetensors keeps one name of the bucket at best
    try:
        st.save_model(model, str(tmp_path / "plain.safetensors"))
        plain = st.load_file(str(tmp_path / "plain.safetensors"))
        assert len(plain) < len(model.state_dict())
    except RuntimeError:
        pass                                         # or refuses outright
    handle = keep_state_dicts_separate(model)
    sd = model.state_dict()
    assert len({v.untyped_storage().data_ptr() for v in sd.values()}) == len(sd)
    st.save_model(model, str(tmp_path / "sep.safetensors"))
    twin = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    st.load_model(twin, str(tmp_path / "sep.safetensors"))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    handle.remove()
    assert len({v.untyped_storage().data_ptr() for v in model.state_dict().values()}) == 1


def test_own_storage_keeps_ties_and_leaves_owners_alone():
    w = torch.zeros(12)
    a, b = w[:6].view(2, 3), w[6:].view(2, 3)
    lone = torch.ones(4)
    sd = own_storage({"a": a, "tied": a, "b": b, "lone": lone, "step": 3})
    assert sd["a"] is sd["tied"] and sd["a"].untyped_storage().data_ptr() != \
        w.untyped_storage().data_ptr()
    assert sd["lone"] is lone and sd["step"] == 3 and torch.equal(sd["b"], b)


# --------------------------------------------------------------------------- examples
@pytest.mark.parametrize("name", ["hf_trainer_gpt2", "accelerate_gpt2", "lightning_gpt2"])
def test_the_examples_run(name, tmp_path):
    pytest.importorskip("transformers")
    if name.startswith("lightning"):
        pytest.importorskip("lightning")
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples",
                                                                     name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    short = ["--steps-per-epoch", "2"] if name.startswith("lightning") else ["--steps", "4"]
    out = mod.main(short + ["--out-dir", str(tmp_path)])
    loss = out["eval_loss"] if isinstance(out, dict) else out
    assert 0.0 < loss < 10.0
