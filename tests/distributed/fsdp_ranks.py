"""Ranks of the FSDP2 tests (tests/distributed/test_fsdp.py): ``python tests/distributed/fsdp_ranks.py SPEC.json``.

SPEC: ``world`` (processes, spawned here over gloo on the CPU; 1 with ``"fsdp": false`` is
the plain single-process run), ``fsdp``, ``mixed`` (FSDP2's MixedPrecisionPolicy with
bfloat16 compute and float32 reduction), ``backend``, ``steps``, ``refresh_at`` (steps
before which a refresh is taken), ``state_dtype`` (null or "bfloat16"), ``out`` (a
directory: ``rank<r>.pt`` per rank with the local parameters and optimizer state by name);
``load`` (a torch.distributed.checkpoint directory to start from, through ``get_state_dict``
/ ``set_state_dict``: the run continues from its step count), ``save_at`` and ``save``
(write one there before step ``save_at``); ``nan_at`` (a step: its inner gradient gets a
NaN at element [4, 2] of ``blocks.0.weight``, on rank 1 when sharded) with
``check_finite`` (the optimizer's; a refused step is caught and the run goes on).

Every rank trains on the same batches, so FSDP2's average of the gradients over the ranks
is exact ((g + g) / 2 = g) and the run equals the single-process run bit for bit where the
optimizer is right.  One intra-op thread everywhere (the forward and backward are then the
same computations in every process).
"""
from __future__ import annotations

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))


class Net(torch.nn.Module):
    """Odd sizes: rows that split unevenly over 2 ranks (7 -> 4 + 3, 3 -> 2 + 1, 1 -> 1 + 0)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Parameter(torch.randn(5, 13) * 0.5)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(13, 7), torch.nn.Linear(7, 13)])
        self.head = torch.nn.Linear(13, 3)
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, idx):
        x = self.emb[idx]
        x = x + self.blocks[1](torch.tanh(self.blocks[0](x)))
        return self.head(x) * self.scale


def batch(step: int, kind: str):
    g = torch.Generator().manual_seed(1000 * step + {"inner": 1, "outer": 2, "refresh": 3}[kind])
    idx = torch.randint(0, 5, (16,), generator=g)
    y = torch.randint(0, 3, (16,), generator=g)
    return idx, y


def run(rank: int, spec: dict) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    world = spec["world"]
    dist.init_process_group("gloo", init_method=f"file://{spec['out']}/store", rank=rank,
                            world_size=world)
    try:
        _train(rank, spec)
        dist.barrier()          # no rank tears gloo down while another still talks to it
    finally:
        dist.destroy_process_group()


def _train(rank: int, spec: dict) -> None:
    import poco_kernels as pk
    torch.manual_seed(0)
    model = Net()
    if spec["fsdp"]:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh("cpu", (spec["world"],))
        kw = {}
        if spec.get("mixed"):
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh, **kw)
        fully_shard(model, mesh=mesh, **kw)
    elif spec.get("mixed"):
        raise ValueError("mixed precision is FSDP2's policy here")
    sd = spec.get("state_dtype")
    opt = pk.IVONPoCo(model.parameters(), lr=0.05, ess=500.0, hess_init=0.5, seed=11,
                      backend=spec["backend"], mc_samples=spec.get("mc_samples", 1),
                      state_dtype=getattr(torch, sd) if sd else None,
                      check_finite=spec.get("check_finite"))
    lossf = torch.nn.CrossEntropyLoss()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    start = 0
    if spec.get("load"):
        msd, osd = get_state_dict(model, opt)
        both = {"model": msd, "optim": osd}
        dcp.load(both, checkpoint_id=spec["load"])
        set_state_dict(model, opt, model_state_dict=both["model"],
                       optim_state_dict=both["optim"])
        start = opt.step_count

    def grad_of(step, kind):
        idx, y = batch(step, kind)
        lossf(model(idx), y).backward()
        if step == 10 * spec.get("nan_at", -1) and kind == "inner":     # (draw 0)
            w = model.blocks[0].weight
            if not spec["fsdp"]:
                w.grad[4, 2] = float("nan")
            elif rank == 1:                       # rows 4..6 here: global row 4
                w.grad.to_local()[0, 2] = float("nan")

    refused = 0

    for step in range(start, spec["steps"]):
        if step == spec.get("save_at"):
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=spec["save"])
        if step in spec["refresh_at"]:
            for chunk in range(2):
                with opt.sampled("refresh"):
                    grad_of(step * 10 + chunk, "refresh")
            opt.refresh()
        for d in range(spec.get("mc_samples", 1)):
            with opt.sampled("inner"):
                grad_of(step * 10 + d, "inner")
        if opt.correction_active():
            with opt.sampled("outer"):
                grad_of(step, "outer")
        try:
            opt.step()
        except ValueError:
            refused += 1
    full_ok = None
    if spec.get("check_full"):
        # the state dict all-gathered (plain tensors of the whole shapes, by name) loads
        # into a second optimizer over the same shards: each takes its rows
        from torch.distributed.checkpoint.state_dict import StateDictOptions
        _, full = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
        assert not any(hasattr(v, "placements") for s in full["state"].values()
                       for v in s.values())
        twin = pk.IVONPoCo(model.parameters(), lr=0.05, ess=500.0, hess_init=0.5, seed=11,
                           backend=spec["backend"], mc_samples=spec.get("mc_samples", 1),
                           state_dtype=getattr(torch, sd) if sd else None)
        twin.load_state_dict(full)
        full_ok = twin.step_count == opt.step_count and all(
            torch.equal(twin.state[p][k], v) for p in opt.state for k, v in opt.state[p].items())
    from poco_kernels._layout import local
    params = {n: local(p.detach()).clone() for n, p in model.named_parameters()}
    state = {n: {k: v.clone() for k, v in opt.state[p].items()}
             for n, p in model.named_parameters()}
    torch.save({"params": params, "state": state, "step": opt.step_count, "full_ok": full_ok,
                "refused": refused, "skipped": opt.skipped_updates},
               os.path.join(spec["out"], f"rank{rank}.pt"))


def main(path: str) -> None:
    with open(path) as f:
        spec = json.load(f)
    os.makedirs(spec["out"], exist_ok=True)
    if spec["world"] == 1:
        run(0, spec)
    else:
        import torch.multiprocessing as mp
        mp.spawn(run, args=(spec,), nprocs=spec["world"], join=True)


if __name__ == "__main__":
    main(sys.argv[1])
