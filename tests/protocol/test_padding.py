"""Padding of the fused backends' flat buffers (to a multiple of 16 elements, so the
Triton launches vectorise): which buffers count as padded, and that the padding of the
gradient buffers stays zero while they are lent as pending sums and written."""
import pytest
import torch

import poco_kernels as pk
from helpers import FUSED_BACKENDS, Problem, mlp, run


def test_launch_length_is_padded_only_for_padded_buffers():
    """``launch_numel``: the padded length only when every buffer of the launch is a live
    padded flat buffer of that length; a clone, a slice or a user's tensor gives the exact
    length (the kernel then stays inside it)."""
    from poco_kernels._layout import alloc_flat, is_padded, launch_numel, padded_copy
    a, b = alloc_flat(37, "cpu", torch.float32), alloc_flat(37, "cpu", torch.bfloat16, 2.0)
    assert is_padded(a) and b.untyped_storage().nbytes() == 48 * 2 and float(b[-1]) == 2.0
    assert launch_numel(37, a, None, b) == 48
    assert launch_numel(37, a, a.clone()) == 37
    assert launch_numel(37, a, torch.zeros(37)) == 37
    assert launch_numel(36, alloc_flat(40, "cpu", torch.float32)[:36]) == 36
    assert launch_numel(32, torch.zeros(32)) == 32             # (already a multiple of 16)
    c = padded_copy(torch.arange(5.0))
    assert is_padded(c) and padded_copy(c) is c and torch.equal(c, torch.arange(5.0))


@pytest.mark.skipif("triton" not in FUSED_BACKENDS, reason="triton not available")
@pytest.mark.parametrize("views", [True, False])
def test_gradient_padding_stays_zero_though_lent_sums_are_written(views):
    """The non-finite check reads the gradient buffers over their padded length, so their
    padding must stay zero: with two draws per step, a gradient buffer lent as the pending
    sum is written by ``accumulate`` (checked: it happens), a NaN gradient's step is
    skipped, and every gradient buffer's padding is still zero, every bucket's length not
    a multiple of 16.  With views and with autograd's gradients read in place."""
    from poco_kernels._layout import PAD
    from poco_kernels.kernels import triton_ops
    written = []

    def spy(name, at):
        real = getattr(triton_ops, name)

        def call(*args):
            written.append(id(args[at]))           # (the sum written)
            return real(*args)
        return call
    prob = Problem()
    m = mlp()
    opt = pk.IVONPoCo(m.parameters(), lr=0.05, ess=200.0, alpha=0.5, mc_samples=2,
                      backend="triton", seed=1, grad_views=views)
    assert all(b.numel % PAD for b in opt._buckets)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(triton_ops, "accumulate", spy("accumulate", 1))
        mp.setattr(triton_ops, "accumulate_shards", spy("accumulate_shards", 2))
        run(opt, m, prob, 3, refresh_every=2, warmup=0)

        def nan_closure():
            opt.zero_grad()
            loss = prob.loss(m, prob.batches(1)[0]) * float("nan")
            loss.backward()
            return loss
        opt.step(nan_closure)
        run(opt, m, prob, 2, refresh_every=2, warmup=0)
    assert opt.skipped_updates == 1
    grad_ids = {id(g.flat) for b in opt._buckets for g in b.grad_bufs}
    assert grad_ids & set(written)              # a lent gradient buffer was written
    for b in opt._buckets:
        for g in b.grad_bufs:
            storage = torch.empty(0, dtype=g.flat.dtype).set_(g.flat.untyped_storage())
            assert storage.numel() > b.numel
            assert torch.equal(storage[b.numel:], torch.zeros_like(storage[b.numel:]))
