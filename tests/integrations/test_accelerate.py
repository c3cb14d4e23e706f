"""poco_kernels.integrations.accelerate on the CPU: save_state/load_state (safetensors)
resumes bit for bit; the helpers equal the protocol loop bit for bit; an lr scheduler sees
``train_step`` as the optimizer's step; 2 gloo ranks (DDP, accelerate_ranks.py) stay
bit-identical to each other and equal one process to float rounding."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import poco_kernels
from integration_common import HERE, ROOT, _net


# --------------------------------------------------------------------------- accelerate
def _accelerate_run(steps, save_at=None, state_dir=None, load=False, backend="cpp"):
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from poco_kernels.integrations import accelerate as pa
    acc = Accelerator(cpu=True)
    model = _net()
    opt = poco_kernels.IVONPoCoMo(model.parameters(), lr=0.05, ess=64.0, alpha=0.7, seed=3,
                                  backend=backend)
    g = torch.Generator().manual_seed(1)
    X, y = torch.randn(64, 5, generator=g), torch.randn(64, 3, generator=g)
    model, opt = pa.prepare(acc, model, opt)

    def loss_fn(m, idx):
        return torch.nn.functional.mse_loss(m(X[idx]), y[idx])
    start = 0
    if load:
        acc.load_state(state_dir)
        start = save_at
    for t in range(start, steps):
        if t == save_at and not load:
            acc.save_state(state_dir)            # safetensors, accelerate's default
            return
        if t >= 3 and (t - 3) % 3 == 0:
            pa.refresh(acc, model, opt, [[torch.arange(16), torch.arange(16, 32)],
                                         [torch.arange(32, 64)]], loss_fn)
        idx = (torch.arange(8) + 8 * t) % 64
        pa.train_step(acc, model, opt, [idx[:4], idx[4:]], loss_fn)
    return [p.detach().clone() for p in model.parameters()], pa.unwrap(opt)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_accelerate_save_state_resumes_bit_for_bit(tmp_path, backend):
    ref, opt = _accelerate_run(10, backend=backend)
    assert opt.refresh_count == 3
    state = str(tmp_path / "state")
    _accelerate_run(10, save_at=5, state_dir=state, backend=backend)
    assert "model.safetensors" in os.listdir(state)
    got, _ = _accelerate_run(10, save_at=5, state_dir=state, load=True, backend=backend)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


def test_accelerate_helpers_equal_the_protocol_loop_bit_for_bit():
    got, opt_a = _accelerate_run(10)
    model = _net()
    opt = poco_kernels.IVONPoCoMo(model.parameters(), lr=0.05, ess=64.0, alpha=0.7, seed=3,
                                  backend="cpp")
    g = torch.Generator().manual_seed(1)
    X, y = torch.randn(64, 5, generator=g), torch.randn(64, 3, generator=g)

    def backward(idx, n):
        (torch.nn.functional.mse_loss(model(X[idx]), y[idx]) / n).backward()
    for t in range(10):
        if t >= 3 and (t - 3) % 3 == 0:
            with opt.sampled("refresh", accumulate=False):
                for chunk in ([torch.arange(16), torch.arange(16, 32)], [torch.arange(32, 64)]):
                    for idx in chunk:
                        backward(idx, len(chunk))
                    opt.accumulate()
            opt.refresh()
        idx = (torch.arange(8) + 8 * t) % 64
        for kind in ["inner"] + (["outer"] if opt.correction_active() else []):
            with opt.sampled(kind):
                backward(idx[:4], 2)
                backward(idx[4:], 2)
        opt.step()
    assert opt.refresh_count == opt_a.refresh_count == 3
    for a, b in zip(got, model.parameters()):
        assert torch.equal(a, b)


def test_accelerate_train_step_is_the_step_an_lr_scheduler_sees():
    """An lr scheduler over the prepared optimizer, stepped after each ``train_step``
    (the right order): torch's check that ``optimizer.step()`` came first sees the
    step, so no 'lr_scheduler.step() before optimizer.step()' warning; the schedule
    reaches the package's optimizer."""
    pytest.importorskip("accelerate")
    import warnings
    from accelerate import Accelerator
    from poco_kernels.integrations import accelerate as pa
    acc = Accelerator(cpu=True)
    model = _net()
    opt = poco_kernels.IVONPoCoMo(model.parameters(), lr=0.05, ess=64.0, seed=3,
                                  backend="torch")
    g = torch.Generator().manual_seed(1)
    X, y = torch.randn(16, 5, generator=g), torch.randn(16, 3, generator=g)
    model, opt = pa.prepare(acc, model, opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def loss_fn(m, idx):
        return torch.nn.functional.mse_loss(m(X[idx]), y[idx])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=r"(?s).*optimizer\.step\(\)")
        for t in range(3):
            idx = torch.arange(8) + 8 * (t % 2)
            pa.train_step(acc, model, opt, [idx[:4], idx[4:]], loss_fn)
            sched.step()
    inner = pa.unwrap(opt)
    assert inner.step_count == 3
    assert inner.param_groups[0]["lr"] == pytest.approx(0.05 * 0.5 ** 3)


@pytest.mark.long
def test_accelerate_ddp_two_ranks_equal_one_process(tmp_path):
    pytest.importorskip("accelerate")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT] + [p for p in os.environ.get(
                   "PYTHONPATH", "").split(os.pathsep) if p]))
    for world in (1, 2):
        r = subprocess.run([sys.executable, os.path.join(HERE, "accelerate_ranks.py"),
                            str(world), str(tmp_path / f"w{world}")], env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    one = torch.load(tmp_path / "w1" / "rank0.pt")
    r0, r1 = (torch.load(tmp_path / "w2" / f"rank{i}.pt") for i in range(2))
    assert one["refreshes"] == r0["refreshes"] == 3 and r0["steps"] == 10
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b)                     # the ranks agree bit for bit
    for k in r0["state"]:
        assert all(torch.equal(r0["state"][k][n], r1["state"][k][n]) for n in r0["state"][k])
    for a, b in zip(one["params"], r0["params"]):    # DDP's mean over ranks: rounding only
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        assert not torch.equal(a, torch.zeros_like(a))
