"""One Triton launch over all the local shards of a sharded bucket (FSDP2; the kernels'
``TILED``, ``triton_ops.Tiles``) against one launch per shard, bit for bit, under the
interpreter: the parameters (or gradients) in the shards' own tensors, every flat buffer,
the noise at each shard's place in the unsharded bucket and the stochastic rounding of
bfloat16 state at the same places."""
import pytest
import torch

from helpers import FUSED_BACKENDS
from poco_kernels import noise
from poco_kernels.kernels import interface as K

pytestmark = pytest.mark.skipif("triton" not in FUSED_BACKENDS, reason="Triton is not here")

SEED = 1234567
NV = noise.STREAM_VERSION
#: (elements, place in the unsharded bucket) per local shard: odd lengths, one above a
#: block (1024), one of exactly a block, places of every alignment to 4
SHARDS = [(5, 0), (1500, 9), (1024, 3000), (3, 4098), (2100, 7001)]
STREAM = noise.stream_id(3, 0, 0)


def _T():
    from poco_kernels.kernels import triton_ops
    return triton_ops


def _layout():
    """(lo, n, place) per shard: the shards one after another in the flat buffers."""
    out, lo = [], 0
    for n, place in SHARDS:
        out.append((lo, n, place))
        lo += n
    return out, lo


def _rand(n, seed, scale=1.0, shift=0.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * scale + shift).to(dtype)


def _tiles(lay, tensors=None):
    return _T().Tiles([(lo, n, place - lo, 0 if tensors is None else t.data_ptr())
                       for (lo, n, place), t in zip(lay, tensors or [None] * len(lay))],
                      torch.device("cpu"))


def _same(a, b, what):
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    assert a.dtype == b.dtype and torch.equal(a.view(bits), b.view(bits)), what


def _shards(lay, seed, dtype):
    return [_rand(n, seed + i, dtype=dtype) for i, (_, n, _) in enumerate(lay)]


@pytest.mark.parametrize("pdtype,sync", [(torch.float32, False), (torch.bfloat16, False),
                                         (torch.float32, True)])
def test_sample_over_the_shards_in_one_launch(pdtype, sync):
    T = _T()
    lay, total = _layout()
    centre, h = _rand(total, 1), _rand(total, 2, 0.2).abs() + 0.1
    hp = K.SampleHyper(50.0, 1e-3, 0.0)
    outs = []
    for tiled in (False, True):
        prm, mean = _shards(lay, 10, pdtype), torch.zeros(total)
        ctl = torch.tensor([4, 1, 0, 0])
        if tiled:
            T.sample_shards(_tiles(lay, prm), prm[0], mean if sync else centre, mean, h, None,
                            ctl, SEED, NV, STREAM, 0, hp, -1.0, K.SIGMA_IVON, sync)
        else:
            for (lo, n, place), p in zip(lay, prm):
                T.sample(p, p if sync else centre[lo:lo + n], mean[lo:lo + n], h[lo:lo + n],
                         None, ctl, SEED, NV, STREAM, 0, hp, -1.0, K.SIGMA_IVON, sync, place)
        outs.append((prm, mean))
    for a, b in zip(outs[0][0], outs[1][0]):
        _same(a, b, "parameter shard")
    _same(outs[0][1], outs[1][1], "mean")
    assert not torch.equal(outs[1][0][1].float(), _shards(lay, 10, pdtype)[1].float())


@pytest.mark.parametrize("first", [True, False])
def test_accumulate_and_fold_over_the_shards_in_one_launch(first):
    T = _T()
    lay, total = _layout()
    grads = _shards(lay, 20, torch.bfloat16)
    grads[3][1] = float("nan")                  # a non-finite gradient in one shard: flagged
    outs = []
    for tiled in (False, True):
        acc_g, acc_ge = _rand(total, 30), _rand(total, 31)
        ctl = torch.tensor([2, 0, 0, 0])
        if tiled:
            T.accumulate_shards(_tiles(lay, grads), grads[0], acc_g, acc_ge, ctl, SEED, NV,
                                STREAM, 0, 1.0, first, True)
            T.fold_ge_shards(_tiles(lay), acc_g, acc_ge, ctl, SEED, NV, STREAM, 0, -1.0)
        else:
            for (lo, n, place), g in zip(lay, grads):
                T.accumulate(g, acc_g[lo:lo + n], acc_ge[lo:lo + n], ctl, SEED, NV, STREAM, 0,
                             1.0, first, True, place)
            for lo, n, place in lay:
                T.fold_ge(acc_g[lo:lo + n], acc_ge[lo:lo + n], ctl, SEED, NV, STREAM, 0, -1.0,
                          place)
        outs.append((acc_g, acc_ge, ctl))
    for a, b, what in zip(outs[0], outs[1], ("acc_g", "acc_ge", "ctl")):
        assert torch.equal(a, b) if what == "ctl" else _same(a, b, what) is None
    assert outs[1][2][K.CTL_BAD] == 1


def _step_inputs(total, low):
    st = dict(mean=_rand(total, 40), h=_rand(total, 41, 0.3).abs() + 0.05,
              momentum=_rand(total, 42, 0.1))
    if low:
        st["momentum"] = st["momentum"].to(torch.bfloat16)
    sums = dict(g_in=_rand(total, 43), g_at_out=_rand(total, 44), g_out=_rand(total, 45),
                h_out=_rand(total, 46, 0.5), m_out=_rand(total, 47),
                sigma_out=_rand(total, 48, 0.1).abs() + 0.05)
    return st, sums


@pytest.mark.parametrize("low,next_sample", [(False, True), (True, False)])
def test_step_over_the_shards_in_one_launch(low, next_sample):
    """IVON-PoCoMo's step with the correction, floor, Hessian correction and clipping;
    the next sample written into the shards, or bfloat16 momentum (rounding at each
    element's place)."""
    T = _T()
    lay, total = _layout()
    flags = K.StepFlags.ivon(hess_corr=True, floor=True, clip=True, debias=True).routed(
        corr=True, ge_in=False, ge_at_out=False, shared_noise=True, next_sample=next_sample)
    hp = K.StepHyper.ivon(lr=0.05, beta1=0.9, beta2=0.999, wd=1e-3, ess=80.0, alpha=0.7,
                          hess_corr=0.5, floor=0.2, clip=0.3).counted(
        sign_at_out=1.0, inv_n_in=1.0, inv_n_at_out=1.0)
    streams = K.StepStreams(SEED, STREAM, STREAM, NV)
    outs = []
    for tiled in (False, True):
        st, sums = _step_inputs(total, low)
        prm = _shards(lay, 50, torch.bfloat16)
        ctl = torch.tensor([5, 2, 0, 0])
        bufs = [sums[k] for k in ("g_in",)] + [None, sums["g_at_out"], None] + [
            sums[k] for k in ("g_out", "h_out", "m_out", "sigma_out")]
        if tiled:
            T.step_shards(_tiles(lay, prm), st["mean"], prm[0], st["momentum"], st["h"], *bufs,
                          ctl, None, None, streams, hp, flags)
        else:
            for (lo, n, place), p in zip(lay, prm):
                cut = [None if t is None else t[lo:lo + n] for t in bufs]
                T.step(st["mean"][lo:lo + n], p, st["momentum"][lo:lo + n], st["h"][lo:lo + n],
                       *cut, ctl, None, None, streams, hp, flags, place)
        outs.append((st, prm))
    for k in ("mean", "h", "momentum"):
        _same(outs[0][0][k], outs[1][0][k], k)
    for a, b in zip(outs[0][1], outs[1][1]):
        _same(a, b, "parameter shard")


@pytest.mark.parametrize("low", [False, True])
def test_refresh_over_the_shards_in_one_launch(low):
    T = _T()
    lay, total = _layout()
    flags = K.RefreshFlags(K.FAMILY_IVON, False, True)
    hp = K.RefreshHyper(0.5, 80.0, 1e-3, 0.6, 0.1, 0.0)
    dt = torch.bfloat16 if low else torch.float32
    outs = []
    for tiled in (False, True):
        mean, h, acc = _rand(total, 60), _rand(total, 61, 0.3).abs() + 0.05, _rand(total, 62)
        state = [_rand(total, 63 + i).to(dt) for i in range(4)]    # g_out, h_out, m_out, sigma
        ctl = torch.tensor([7, 3, 0, 0])
        if tiled:
            T.refresh_shards(_tiles(lay), mean, h, acc, None, *state, ctl, None, None, SEED, NV,
                             STREAM, hp, flags)
        else:
            for lo, n, place in lay:
                T.refresh(mean[lo:lo + n], h[lo:lo + n], acc[lo:lo + n], None,
                          *(s[lo:lo + n] for s in state), ctl, None, None, SEED, NV, STREAM, hp,
                          flags, place)
        outs.append(state)
    for a, b, what in zip(outs[0], outs[1], ("g_out", "h_out", "m_out", "sigma_out")):
        _same(a, b, what)


def test_tiles_cover_every_element_once():
    """The tile table: one row per shard, a program per block of each shard, and an empty
    set of shards launches nothing."""
    T = _T()
    lay, total = _layout()
    t = _tiles(lay)
    assert t.count == sum(-(-n // 1024) for _, n, _ in lay)
    assert t.table[:, 4].tolist() == [0, 1, 3, 4, 5]
    assert torch.bincount(t.chunks, minlength=len(lay)).tolist() == [1, 2, 1, 1, 3]
    empty = T.Tiles([], torch.device("cpu"))
    assert empty.count == 0
    T.fold_ge_shards(empty, torch.zeros(3), torch.ones(3), torch.zeros(4, dtype=torch.int64),
                     SEED, NV, STREAM, 0, 1.0)
