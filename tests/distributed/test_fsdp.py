"""FSDP2 (``fully_shard``) on the fused C++ backend: 2 gloo ranks on the CPU against one
process (tests/distributed/fsdp_ranks.py runs the ranks).

Every rank trains on the same batches, so FSDP2's gradient average over the ranks is exact
and the reductions are those of the single process: the sharded run must equal it bit for
bit, parameters and every piece of optimizer state, through refreshes (the correction
active), several Monte-Carlo draws (the ``g * eps`` sums) and bfloat16 state (stochastic
rounding at global positions).  A shard that drew the noise of its local position instead
fails these comparisons (checked when this was written)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import available_backends

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


COMMON = dict(steps=10, refresh_at=[2, 7])       # (the correction active from step 3)


def _ranks(tmp_path, name, **spec):
    spec = dict(dict(world=2, fsdp=True, backend="cpp", **COMMON), **spec,
                out=str(tmp_path / name))
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT] + [p for p in os.environ.get(
                   "PYTHONPATH", "").split(os.pathsep) if p]))
    r = subprocess.run([sys.executable, os.path.join(HERE, "fsdp_ranks.py"), str(path)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return [torch.load(tmp_path / name / f"rank{i}.pt") for i in range(spec["world"])]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The single-process run and the uninterrupted 2-rank FSDP2 run (fp32 state, one
    draw), shared by the tests below (each run is a few seconds of process start-up)."""
    d = tmp_path_factory.mktemp("runs")
    return {"single": _ranks(d, "single", world=1, fsdp=False), "fsdp": _ranks(d, "fsdp")}


def _whole(ranks, kind, name, key=None):
    """The unsharded tensor: the ranks' Shard(0) pieces in rank order (torch.chunk rows)."""
    parts = [r[kind][name] if key is None else r[kind][name][key] for r in ranks]
    return torch.cat([p.reshape(-1, *parts[0].shape[1:]) if p.dim() else p.reshape(1)
                      for p in parts])


def _assert_same(sharded, single):
    ref = single[0]
    assert [r["step"] for r in sharded] == [ref["step"]] * len(sharded)
    for name, p in ref["params"].items():
        got = _whole(sharded, "params", name).reshape(p.shape)
        assert got.dtype == p.dtype and torch.equal(got, p), name
        assert set(sharded[0]["state"][name]) == set(ref["state"][name])
        for key, v in ref["state"][name].items():
            got = _whole(sharded, "state", name, key).reshape(v.shape)
            assert got.dtype == v.dtype and torch.equal(got, v), (name, key)


def _check_layout(sharded):
    """The uneven shards really are uneven, and rank 1 holds an empty one."""
    assert sharded[0]["params"]["blocks.0.weight"].shape == (4, 13)
    assert sharded[1]["params"]["blocks.0.weight"].shape == (3, 13)
    assert sharded[1]["params"]["scale"].numel() == 0


@pytest.mark.long
def test_fsdp2_two_ranks_equal_one_process(runs):
    _check_layout(runs["fsdp"])
    _assert_same(runs["fsdp"], runs["single"])


@pytest.mark.long
def test_fsdp2_two_draws_and_bfloat16_state(tmp_path):
    """Two Monte-Carlo draws (the g * eps sums, fold_ge) and bfloat16 state (stochastic
    rounding at the shards' places)."""
    extra = {"mc_samples": 2, "state_dtype": "bfloat16"}
    single = _ranks(tmp_path, "single", world=1, fsdp=False, **extra)
    sharded = _ranks(tmp_path, "fsdp", **extra)
    _check_layout(sharded)
    _assert_same(sharded, single)


@pytest.mark.long
def test_fsdp2_two_ranks_on_triton_equal_one_process(tmp_path):
    """The Triton kernels (under the interpreter), one launch per sharded bucket over
    uneven shards at places that are not multiples of 4, rank 1 holding an empty one: 2
    ranks equal one process bit for bit, through a refresh, with bfloat16 state."""
    if "triton" not in available_backends():
        pytest.skip("Triton is not here")
    spec = dict(backend="triton", steps=4, refresh_at=[1], state_dtype="bfloat16")
    single = _ranks(tmp_path, "single", world=1, fsdp=False, **spec)
    sharded = _ranks(tmp_path, "fsdp", **spec)
    _check_layout(sharded)
    _assert_same(sharded, single)


@pytest.mark.parametrize("backend,check_finite", [("cpp", False), ("cpp", True),
                                                   ("torch", True)])
@pytest.mark.long
def test_a_nan_in_one_ranks_shard_skips_the_step_on_every_rank(tmp_path, backend,
                                                                check_finite):
    """A NaN in an inner gradient that only rank 1's shard holds: every rank skips the
    step (fused, check_finite=False) or refuses it (check_finite=True), as one process
    does, and the runs stay equal (the bad flag is all-reduced over the mesh)."""
    spec = dict(backend=backend, nan_at=4, check_finite=check_finite, steps=6)
    single = _ranks(tmp_path, "single", world=1, fsdp=False, **spec)
    sharded = _ranks(tmp_path, "fsdp", **spec)
    assert single[0]["step"] == 5
    assert [r["refused"] for r in sharded] == [single[0]["refused"]] * 2
    assert [r["skipped"] for r in sharded] == [single[0]["skipped"]] * 2
    _assert_same(sharded, single)


@pytest.mark.long
def test_dcp_checkpoints_reshard_2_1_2_bit_for_bit(tmp_path, runs):
    """torch.distributed.checkpoint through get_state_dict/set_state_dict: 2 FSDP2 ranks
    save mid-run (after a refresh, the correction active), one unsharded process loads
    that, runs on across a refresh and saves, 2 ranks load that and finish: parameters
    and state equal the uninterrupted 2-rank run bit for bit (the noise follows the
    element, not the rank).  The all-gathered state dict loads into a second optimizer
    over the shards (each rank takes its rows)."""
    _ranks(tmp_path, "first", save_at=5, save=str(tmp_path / "ck1"))
    one = _ranks(tmp_path, "one", world=1, fsdp=False, load=str(tmp_path / "ck1"),
                 save_at=8, save=str(tmp_path / "ck2"))
    two = _ranks(tmp_path, "two", load=str(tmp_path / "ck2"), check_full=True)
    _assert_same(one, _joined(runs["fsdp"]))
    _assert_same(two, _joined(runs["fsdp"]))
    assert all(r["full_ok"] for r in two)


def _joined(ranks):
    """The ranks' results as one process's (for ``_assert_same``)."""
    return [{"params": {n: _whole(ranks, "params", n) for n in ranks[0]["params"]},
             "state": {n: {k: _whole(ranks, "state", n, k) for k in ranks[0]["state"][n]}
                       for n in ranks[0]["state"]},
             "step": ranks[0]["step"]}]


@pytest.mark.long
def test_fsdp2_mixed_precision(tmp_path, runs):
    """MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) over float32 shards: the
    parameters and state stay float32 and 2 ranks equal 1 rank under the same policy."""
    one = _ranks(tmp_path, "one", world=1, mixed=True)
    two = _ranks(tmp_path, "two", mixed=True)
    for r in one + two:
        assert all(p.dtype == torch.float32 for p in r["params"].values())
        assert all(v.dtype == torch.float32 for s in r["state"].values() for v in s.values())
    _assert_same(two, one)
    # (the policy does change the run: bfloat16 forward and backward)
    assert not torch.equal(runs["single"][0]["params"]["head.weight"],
                           one[0]["params"]["head.weight"])


# --------------------------------------------------------------------------- one process
@pytest.fixture
def mesh1(tmp_path):
    """A one-rank gloo group and its 1-D mesh (DTensor parameters in this process)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _sharded(mesh, tensors, placement=None):
    from torch.distributed.tensor import Shard, distribute_tensor
    return [torch.nn.Parameter(distribute_tensor(t.detach().clone(), mesh,
                                                 [placement or Shard(0)])) for t in tensors]


def test_sharded_buckets_in_one_process(mesh1):
    """Shard(0) DTensor parameters: one launch per shard at its place in the bucket (35:
    not a multiple of 4, Triton's unaligned noise path); each fused backend equals itself
    on plain parameters bit for bit, and the torch backend to float rounding."""
    import poco_kernels as pk
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(7, 5, generator=g), torch.randn(3, generator=g)]
    kw = dict(lr=0.1, ess=1e4, hess_init=1.0, seed=0)
    runs = {}
    fused = [b for b in ("cpp", "triton") if b in available_backends()]
    for name, backend, sharded in ([(f"plain-{b}", b, False) for b in fused]
                                   + [(b, b, True) for b in fused + ["torch"]]):
        ps = _sharded(mesh1, ts) if sharded else [torch.nn.Parameter(t.clone()) for t in ts]
        opt = pk.IVONPoCo(ps, backend=backend, **kw)
        if sharded:
            assert opt._buckets[0].segments == [(0, 35, 0), (35, 3, 35)]
        for i in range(4):
            if i == 1:
                with opt.sampled("refresh"):
                    sum((p ** 3).sum() for p in ps).backward()
                opt.refresh()
            with opt.sampled("inner"):
                sum((p ** 3).sum() for p in ps).backward()
            if opt.correction_active():
                with opt.sampled("outer"):
                    sum((p ** 3).sum() for p in ps).backward()
            opt.step()
        from poco_kernels._layout import local
        runs[name] = ([local(p.detach()).clone() for p in ps],
                      [dict(opt.state[p]) for p in ps])
    assert "cpp" in fused
    for b in fused:
        for x, y in zip(runs[f"plain-{b}"][0], runs[b][0]):
            assert torch.equal(x, y), b
        for x, y in zip(runs[f"plain-{b}"][1], runs[b][1]):
            assert all(torch.equal(x[k], y[k]) for k in x), b
        for x, y in zip(runs["torch"][0], runs[b][0]):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_bad_sharding_is_refused_and_changes_nothing(mesh1):
    """A placement other than Shard(0) and a partly sharded model get clear errors; a
    refused add_param_group leaves the optimizer as its twin."""
    import poco_kernels as pk
    from torch.distributed.tensor import Shard
    w = torch.randn(7, 5)
    for backend in ("cpp", "torch"):
        with pytest.raises(ValueError, match="Shard\\(0\\)"):
            pk.IVON(_sharded(mesh1, [w], Shard(1)), lr=0.1, ess=1e4, backend=backend)
        with pytest.raises(ValueError, match="partly sharded"):
            pk.IVON(_sharded(mesh1, [w]) + [torch.nn.Parameter(torch.randn(3))], lr=0.1,
                    ess=1e4, backend=backend)
    # add_param_group: refused, nothing changed (a twin that never saw the call)
    ps, twin_ps = _sharded(mesh1, [w]), _sharded(mesh1, [w])
    opt, twin = (pk.IVONPoCo(q, lr=0.1, ess=1e4, seed=3, backend="cpp") for q in (ps, twin_ps))
    def steps(o, q, k):
        for _ in range(k):
            with o.sampled("inner"):
                (q[0] ** 3).sum().backward()
            o.step()
    steps(opt, ps, 2)
    steps(twin, twin_ps, 2)
    with pytest.raises(ValueError, match="partly sharded"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3))]})
    assert len(opt.param_groups) == 1 and len(opt._buckets) == 1
    steps(opt, ps, 2)
    steps(twin, twin_ps, 2)
    assert torch.equal(ps[0].to_local(), twin_ps[0].to_local())
    assert all(torch.equal(opt.state[ps[0]][k], twin.state[twin_ps[0]][k])
               for k in opt.state[ps[0]])


def test_a_state_dict_that_lost_its_pending_gradients_is_refused(mesh1):
    """Taken with gradients pending, a state dict keeps them in its 'poco' entry; without
    that entry (torch.distributed.checkpoint keeps 'state' and 'param_groups') loading is
    refused and changes nothing; between updates it loads from the groups' copy."""
    import poco_kernels as pk
    w = torch.randn(7, 5)
    ps, twin_ps = _sharded(mesh1, [w]), _sharded(mesh1, [w])
    opt, twin = (pk.IVONPoCo(q, lr=0.1, ess=1e4, seed=3, backend="cpp") for q in (ps, twin_ps))

    def both_step():
        for o, q in ((opt, ps), (twin, twin_ps)):
            with o.sampled("inner"):
                (q[0] ** 3).sum().backward()
            o.step()
    both_step()
    src = pk.IVONPoCo(_sharded(mesh1, [w * 2]), lr=0.1, ess=1e4, seed=3, backend="cpp")
    with src.sampled("inner"):
        (src.param_groups[0]["params"][0] ** 3).sum().backward()
    sd = src.state_dict()
    assert sd["param_groups"][0]["poco"]["pending_gradients"]
    assert hasattr(sd["state"][0]["mean"], "placements")       # sharded: DTensor state
    del sd["poco"]
    with pytest.raises(ValueError, match="gradients pending"):
        opt.load_state_dict(sd)
    both_step()
    assert torch.equal(ps[0].to_local(), twin_ps[0].to_local())
    assert all(torch.equal(opt.state[ps[0]][k], twin.state[twin_ps[0]][k])
               for k in opt.state[ps[0]])
    src.step()
    sd = src.state_dict()                            # between updates
    del sd["poco"]
    with src.sampled("inner", accumulate=False):     # a draw taken, no gradient kept
        pass
    drawn = src.state_dict()
    del drawn["poco"]
    with pytest.raises(ValueError, match="sample drawn"):
        opt.load_state_dict(drawn)
    opt.load_state_dict(sd)
    assert opt.step_count == 1 and torch.equal(ps[0].to_local(), src.param_groups[0]["params"][0].to_local())


def test_triton_launches_once_per_sharded_bucket_as_the_launches_per_shard_do(mesh1):
    """Triton: every operation on a sharded bucket is one launch over all its local shards
    (``triton_ops.Tiles``), where one launch per shard was (the engine's ``tiled`` off):
    the same parameters and state bit for bit, through refreshes, two Monte-Carlo draws
    (the ``g * eps`` sums and their fold) and bfloat16 state (rounding at each element's
    place)."""
    if "triton" not in available_backends():
        pytest.skip("Triton is not here")
    import types

    import poco_kernels as pk
    from poco_kernels._layout import local
    g = torch.Generator().manual_seed(1)
    ts = [torch.randn(7, 5, generator=g), torch.randn(3, generator=g),
          torch.randn(2, 600, generator=g)]
    runs, counts = {}, {}
    for tiled in (True, False):
        ps = _sharded(mesh1, ts)
        opt = pk.IVONPoCoMo(ps, backend="triton", lr=0.1, ess=1e4, hess_init=1.0, seed=0,
                            mc_samples=2, state_dtype=torch.bfloat16)
        eng = opt._runner
        eng.tiled = tiled
        calls = counts[tiled] = {}
        real = eng.ops

        def counted(name, fn):
            def run(*a, **k):
                calls[name] = calls.get(name, 0) + 1
                return fn(*a, **k)
            return run
        eng.ops = types.SimpleNamespace(**{n: counted(n, getattr(real, n)) if callable(
            getattr(real, n)) and not n[0].isupper() else getattr(real, n)
            for n in dir(real) if not n.startswith("__")})

        def closure():
            opt.zero_grad()
            loss = sum((p ** 3).sum() for p in ps)
            loss.backward()
            return loss
        for i in range(3):
            if i == 1:
                opt.refresh([closure, closure])
            opt.step(closure)
        runs[tiled] = ([local(p.detach()).clone() for p in ps],
                       [dict(opt.state[p]) for p in ps])
    for x, y in zip(runs[True][0], runs[False][0]):
        assert torch.equal(x, y)
    for x, y in zip(runs[True][1], runs[False][1]):
        assert set(x) == set(y) and all(torch.equal(x[k], y[k]) for k in x)
    shards = len(ts)
    for op in ("sample", "accumulate", "fold_ge", "step", "refresh"):
        assert counts[True].get(op, 0) == 0, op
        assert counts[True][f"{op}_shards"] * shards == counts[False][op], op
