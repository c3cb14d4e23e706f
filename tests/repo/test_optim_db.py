"""The tests' optimizer database (tests/optim_db.py) describes the package: every optimizer
class has its entry, the properties the suites select by are the classes' own, and every
configuration builds on the backends it names."""
import pytest
import torch

import optim_db as db
import poco_kernels as pk
from helpers import available_backends, mlp


def test_every_optimizer_class_has_an_entry_and_configurations():
    """Every optimizer the package exports is in the database (IVONPoCoMo as the IVON-PoCo
    whose defaults differ: its configurations are IVON-PoCo's), with configurations."""
    exported = {n for n in pk.__all__ if isinstance(getattr(pk, n), type)
                and issubclass(getattr(pk, n), torch.optim.Optimizer)}
    assert exported - {"IVONPoCoMo"} == set(db.OPTIMIZERS)
    assert issubclass(pk.IVONPoCoMo, db.OPTIMIZERS["IVONPoCo"].cls)
    for name in db.OPTIMIZERS:
        assert [c for c in db.CONFIGS.values() if c.optimizer == name], name


def _closure(opt, model, idx, grad_closure):
    x = torch.randn(8, 9, generator=torch.Generator().manual_seed(idx))

    def c():
        if grad_closure:
            opt.zero_grad()
        loss = model(x).pow(2).mean()
        if grad_closure:
            loss.backward()
        return loss
    return c


@pytest.mark.parametrize("info", list(db.OPTIMIZERS.values()), ids=lambda i: i.name)
def test_the_properties_are_the_classes(info):
    """``noisy``, ``has_refresh`` (a refresh is an error without an outer loop),
    ``momentum_key``, ``sample_ahead``, ``state_dtype`` and ``outer_dtype`` (taken or
    refused), ``fused`` (the C++ backend refuses a class without kernels)."""
    kw = db.config("conventions", info.name).kwargs
    model = mlp()
    opt = info.cls(model.parameters(), **kw)
    assert opt.noisy == info.noisy
    opt.step(_closure(opt, model, 0, info.grad_closure))
    if info.has_refresh:
        opt.refresh([_closure(opt, model, 1, info.grad_closure)])
        assert opt.refresh_count == 1
    else:
        with pytest.raises(RuntimeError):
            opt.refresh([_closure(opt, model, 1, info.grad_closure)])
    if info.momentum_key is not None:
        assert info.momentum_key in opt.param_groups[0]
    for flag, value in (("sample_ahead", True), ("state_dtype", torch.bfloat16),
                        ("outer_dtype", torch.bfloat16)):
        if getattr(info, flag):
            info.cls(mlp().parameters(), **kw, **{flag: value})
        else:
            with pytest.raises(TypeError, match=flag):
                info.cls(mlp().parameters(), **kw, **{flag: value})
    if not info.fused and "cpp" in available_backends():
        with pytest.raises(RuntimeError, match="no C\\+\\+ kernels"):
            info.cls(mlp().parameters(), backend="cpp", **kw)


@pytest.mark.parametrize("cfg", list(db.CONFIGS.values()), ids=lambda c: c.id)
def test_every_configuration_builds(cfg):
    """On every backend it runs here; the suites it names exist; a historical
    configuration is the legacy checkpoints' only."""
    assert cfg.uses and cfg.uses <= {"trajectory", "resume", "copy", "conventions",
                                      "transactional", "legacy"}
    assert (cfg.legacy is not None) == ("legacy" in cfg.uses)
    assert not cfg.historical or cfg.uses == {"legacy"}
    assert set(cfg.backends or ()) <= set(cfg.info.backends)
    for backend in cfg.runs_on():
        opt = cfg.make(mlp().parameters(), backend, seed=0)
        assert type(opt) is cfg.cls and opt.backend == backend


def test_each_suite_has_one_configuration_per_optimizer():
    """The suites that key their configurations by optimizer have one each (the legacy
    checkpoints and the trajectories keep several)."""
    for use in ("resume", "copy", "conventions", "transactional"):
        names = [c.optimizer for c in db.configs(use)]
        assert len(names) == len(set(names)), use
    ids = [c.id for c in db.CONFIGS.values()]
    assert len(ids) == len(set(ids))
