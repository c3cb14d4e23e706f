"""FSDP2 against DDP, 2 ranks on the CPU (gloo), IVON-PoCoMo on the C++ backend: per-rank
memory and time per iteration, both measured in one run of this script.

Each layout runs in its own pair of processes (spawned here; one intra-op thread each, so
the two ranks share the machine's cores evenly), on the same GPT (``--preset``, default
``gpt-small`` with a 4096-token vocabulary: about 12M parameters) and the same batches:
every iteration an inner sample, forward and backward, an outer sample, forward and
backward, and the step (the correction active: a refresh was taken in the warm-up).

Rows (``benchmarks/README.md``'s CSV schema; ``provider`` ``ddp`` or ``fsdp2``):

* ``fsdp_iteration``: the whole iteration, per rank (median, p20, p80 over ``--reps``);
* ``fsdp_optimizer``: the iteration minus its forward and backward calls (each timed):
  sampling, accumulating, the step; FSDP2's all-gathers and reduce-scatters run inside
  the forward and backward and count there;
* ``fsdp_step``: ``opt.step()`` alone.

Memory per rank, in the JSON beside the CSV: the parameters' and gradients' bytes this
rank holds (FSDP2: its shards), the bytes the optimizer object holds beyond them
(``held_bytes`` of ``suite/memory.py``), both per parameter of the whole model, and the
resident set.

    .venv/bin/python benchmarks/studies/fsdp.py [--preset gpt-small] [--reps 8] [--out F.csv]

The default ``--out`` is ``benchmarks/results/fsdp/<device>_<date>.csv``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

if __package__ in (None, ""):    # run as a script: the repository root, for ``benchmarks.*``
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__)))))

from benchmarks.common.device import device_info  # noqa: E402
from benchmarks.common.report import RESULTS, dump, write_csv  # noqa: E402
from benchmarks.common.timing import quantiles  # noqa: E402
# the resident set, freed heap trimmed first
from benchmarks.studies.iteration import _rss  # noqa: E402
from benchmarks.suite.memory import held_bytes  # noqa: E402


def _rank(rank: int, spec: dict) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{spec['dir']}/store", rank=rank,
                            world_size=2)
    try:
        out = _measure(rank, spec)
        with open(os.path.join(spec["dir"], f"{spec['layout']}{rank}.json"), "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()


def _measure(rank: int, spec: dict) -> dict:
    import poco_kernels as pk
    from poco_kernels.experiments.gpt import GPT, PRESETS
    from poco_kernels.experiments.pretrain_setup import shard_model
    cfg = PRESETS[spec["preset"]]
    cfg = type(cfg)(**{**cfg.as_dict(), "vocab_size": spec["vocab"]})
    torch.manual_seed(0)
    model = GPT(cfg)
    numel = sum(p.numel() for p in model.parameters())
    dev = torch.device("cpu")
    if spec["layout"] == "fsdp2":
        shard_model(model, dev, 2)
        net = model
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP
        net = DDP(model)
    opt = pk.IVONPoCo(model.parameters(), lr=1e-3, ess=1e6, hess_init=1.0, seed=1,
                      backend="cpp", rho1=0.9, rho2=0.9)
    g = torch.Generator().manual_seed(10 + rank)
    batch = [torch.randint(0, cfg.vocab_size, (spec["batch"], cfg.block_size), generator=g)
             for _ in range(2)]
    fb = [0.0]

    def grad(kind):
        t0 = time.perf_counter()
        x = batch[0] if kind == "inner" else batch[1]
        _, loss = net(x, x)
        loss.backward()
        fb[0] += time.perf_counter() - t0

    def iteration():
        with opt.sampled("inner"):
            grad("inner")
        with opt.sampled("outer"):
            grad("outer")
        t0 = time.perf_counter()
        opt.step()
        return time.perf_counter() - t0

    rss0 = _rss()
    with opt.sampled("refresh"):
        grad("refresh")
    opt.refresh()
    for _ in range(2):
        iteration()
    its, opts, steps = [], [], []
    for _ in range(spec["reps"]):
        fb[0] = 0.0
        t0 = time.perf_counter()
        st = iteration()
        t = time.perf_counter() - t0
        its.append(t)
        opts.append(t - fb[0])
        steps.append(st)
    params = list(model.parameters())

    def local(t):           # (a DTensor's shard)
        return t.to_local() if hasattr(t, "to_local") else t
    pbytes = sum(local(p.detach()).numel() * p.element_size() for p in params)
    gbytes = sum(local(p.grad).numel() * p.grad.element_size() for p in params
                 if p.grad is not None)
    held = held_bytes(opt, params)[0]
    return dict(numel=numel, iteration=its, optimizer=opts, step=steps,
                param_bytes_per_param=pbytes / numel, grad_bytes_per_param=gbytes / numel,
                held_bytes_per_param=held / numel, rss_growth_mb=(_rss() - rss0) / 2 ** 20,
                rss_mb=_rss() / 2 ** 20)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="gpt-small")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--out", default=None,
                    help="the CSV (default benchmarks/results/fsdp/<device>_<date>.csv)")
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp
    info = device_info(torch.device("cpu"))
    if args.out is None:
        args.out = os.path.join(RESULTS, "fsdp", f"{info['slug']}_{info['date'][:10]}.csv")
    results = {}
    with tempfile.TemporaryDirectory() as d:
        for layout in ("ddp", "fsdp2"):
            spec = dict(layout=layout, dir=d, preset=args.preset, vocab=args.vocab,
                        batch=args.batch, reps=args.reps)
            os.makedirs(d, exist_ok=True)
            if os.path.exists(os.path.join(d, "store")):
                os.remove(os.path.join(d, "store"))
            mp.spawn(_rank, args=(spec,), nprocs=2, join=True)
            results[layout] = [json.load(open(os.path.join(d, f"{layout}{r}.json")))
                               for r in range(2)]
    rows = []
    for layout, ranks in results.items():
        for what in ("iteration", "optimizer", "step"):
            ts = [t for r in ranks for t in r[what]]
            q = quantiles(ts)
            rows.append(dict(kernel=f"fsdp_{what}", provider=layout, dtype="float32",
                             size=ranks[0]["numel"], median=q[0], p20=q[1], p80=q[2],
                             timing="wall, per rank, both ranks' iterations"))
    write_csv(args.out, rows, info["device"], info["date"])
    mem = {layout: {k: [r[k] for r in ranks] for k in ranks[0]
                    if k not in ("iteration", "optimizer", "step")}
           for layout, ranks in results.items()}
    dump(os.path.splitext(args.out)[0] + ".json", dict(info=info, memory=mem, args=vars(args)))
    print(f"{info['device']}; {ranks[0]['numel']:,} parameters, 2 ranks, 1 thread each")
    print(f"{'layout':6} {'iteration ms':>24} {'optimizer ms':>24} {'step ms':>10} "
          f"{'param B':>8} {'grad B':>7} {'held B':>7} {'RSS MB':>7}")
    for layout, ranks in results.items():
        med = {w: [1e3 * x for x in quantiles([t for r in ranks for t in r[w]])]
               for w in ("iteration", "optimizer", "step")}
        m = mem[layout]
        print(f"{layout:6} {med['iteration'][0]:9.1f} ({med['iteration'][1]:.1f}-"
              f"{med['iteration'][2]:.1f}) {med['optimizer'][0]:9.1f} ({med['optimizer'][1]:.1f}-"
              f"{med['optimizer'][2]:.1f}) {med['step'][0]:10.1f} "
              f"{statistics.mean(m['param_bytes_per_param']):8.2f} "
              f"{statistics.mean(m['grad_bytes_per_param']):7.2f} "
              f"{statistics.mean(m['held_bytes_per_param']):7.2f} "
              f"{statistics.mean(m['rss_mb']):7.0f}")


if __name__ == "__main__":
    main()
