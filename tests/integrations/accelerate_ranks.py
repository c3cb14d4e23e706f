"""Ranks for tests/integrations/test_accelerate.py: a small IVON-PoCoMo run under ``accelerate``
(``Accelerator(cpu=True)``: DDP on gloo when WORLD_SIZE > 1), each rank training on its
rows of the same global batches; writes the final parameters and optimizer state.

    python tests/integrations/accelerate_ranks.py WORLD OUT_DIR"""
from __future__ import annotations

import os
import sys

import torch


def batches(world: int, rank: int):
    """Global mini-batch t: 16 rows; rank r takes rows [16 r / world, 16 (r + 1) / world),
    as two micro-batches."""
    def rows(t, n=16):
        idx = (torch.arange(n) + 7 * t) % 64
        per = n // world
        mine = idx[rank * per:(rank + 1) * per]
        return [mine[: per // 2], mine[per // 2:]]
    return rows


def run(rank: int, world: int, out: str, port: int) -> None:
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import poco_kernels
    from accelerate import Accelerator
    from poco_kernels.integrations import accelerate as pa

    acc = Accelerator(cpu=True)
    assert acc.num_processes == world, acc.num_processes
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = poco_kernels.IVONPoCoMo(model.parameters(), lr=0.05, ess=64.0, alpha=0.7, seed=3,
                                  backend="cpp")
    g = torch.Generator().manual_seed(1)
    X, y = torch.randn(64, 5, generator=g), torch.randn(64, 1, generator=g)
    model, opt = pa.prepare(acc, model, opt)

    def loss_fn(m, idx):
        return torch.nn.functional.mse_loss(m(X[idx]), y[idx])
    rows = batches(world, rank)
    for t in range(10):
        if t >= 3 and (t - 3) % 3 == 0:
            pa.refresh(acc, model, opt, [rows(100 + t), rows(200 + t)], loss_fn)
        pa.train_step(acc, model, opt, rows(t), loss_fn)
    inner = pa.unwrap(opt)
    torch.save({"params": [p.detach().clone() for p in acc.unwrap_model(model).parameters()],
                "state": {i: {k: v.clone() for k, v in inner.state[p].items()}
                          for i, p in enumerate(inner.param_groups[0]["params"])},
                "refreshes": inner.refresh_count, "steps": inner.step_count},
               os.path.join(out, f"rank{rank}.pt"))
    acc.wait_for_everyone()
    acc.end_training()


def main(world: int, out: str) -> None:
    import socket
    os.makedirs(out, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if world == 1:
        run(0, 1, out, port)
    else:
        import torch.multiprocessing as mp
        mp.spawn(run, args=(world, out, port), nprocs=world, join=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
