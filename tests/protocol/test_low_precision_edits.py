"""bfloat16 and float16 parameters keep a float32 master copy of the mean in the state.
Written in place between public calls (a weight load after the optimizer was built, an
initialisation, a pruning mask) or given other memory (``p.data = t``), they are the
truth, as float32 parameters are: the master copy takes the elements they changed and
keeps the others (docs/design.md, 'What the fused backends do differently'), on every
backend.  A write through ``p.data``, which torch's version counters do not see, is not."""
import pytest
import torch

import poco_kernels as pk
from helpers import Problem, available_backends

pytestmark = pytest.mark.usefixtures("one_thread")

BACKENDS = available_backends()
#: lr=0: the mean does not move, so the parameters must end as the edit left them
MAKERS = {"IVON": lambda ps, b: pk.IVON(ps, lr=0.0, ess=1e4, hess_init=1.0, seed=3, backend=b),
          "SVRG": lambda ps, b: pk.SVRG(ps, lr=0.0, momentum=0.9, backend=b),
          "SVRGAdamW": lambda ps, b: pk.SVRGAdamW(ps, lr=0.0, backend=b)}


def _edit(model, how):
    torch.manual_seed(11)
    new = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    with torch.no_grad():
        if how == "load_state_dict":
            model.load_state_dict(new)
        elif how == "mask":                   # half of one weight zeroed in place
            w = model[0].weight
            w.mul_((torch.arange(w.numel()).reshape(w.shape) % 2).to(w.dtype))
        elif how == "copy_":
            for p in model.parameters():
                p.copy_(new[next(k for k, q in model.named_parameters() if q is p)])
        else:                                 # other memory
            for name, p in model.named_parameters():
                p.data = new[name].clone()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", sorted(MAKERS))
@pytest.mark.parametrize("how", ["load_state_dict", "mask", "copy_", "data"])
def test_an_edit_between_steps_is_the_new_mean(backend, dtype, kind, how):
    prob = Problem()
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(9, 13), torch.nn.Tanh(),
                                torch.nn.Linear(13, 3)).to(dtype)
    opt = MAKERS[kind](model.parameters(), backend)
    for t in range(2):
        opt.step(prob.closure(opt, model, torch.arange(8 * t, 8 * t + 8)))
    edited = _edit(model, how)
    for t in range(2, 4):
        opt.step(prob.closure(opt, model, torch.arange(8 * t, 8 * t + 8)))
    for p, want in zip(model.parameters(), edited):
        assert torch.equal(p.detach(), want)
    if kind != "IVON":                        # and the state dict's mean is the edit's
        return
    sd = opt.state_dict()
    for i, want in enumerate(edited):
        assert torch.equal(sd["state"][i]["mean"].to(dtype), want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sample_ahead", [None, False])
def test_an_edit_between_sampled_blocks_and_step_is_the_mean_it_steps_from(
        backend, dtype, sample_ahead):
    """The parameters hold the mean between ``sampled()`` and ``step()`` too: an edit
    there is the mean the step updates, whatever the backend or protocol (the torch
    backend and the copy protocol stepped from the mean before the edit)."""
    if backend == "torch" and sample_ahead is None:
        sample_ahead = False                  # (the torch backend's default)
    prob = Problem()
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(9, 13), torch.nn.Tanh(),
                                torch.nn.Linear(13, 3)).to(dtype)
    opt = pk.IVON(model.parameters(), lr=0.0, ess=1e4, hess_init=1.0, seed=3, backend=backend,
                  sample_ahead=sample_ahead)
    for t in range(3):
        with opt.sampled():
            prob.loss(model, torch.arange(8 * t, 8 * t + 8)).backward()
        if t == 1:
            edited = _edit(model, "mask")
        opt.step()
    for p, want in zip(model.parameters(), edited):
        assert torch.equal(p.detach(), want)
