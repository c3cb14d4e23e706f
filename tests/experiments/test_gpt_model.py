"""The GPT used by the training benchmark (and the pretraining entry point)."""
import pytest
import torch

from poco_kernels.experiments.gpt import GPT, PRESETS, GPTConfig


def test_shapes_loss_and_tied_head():
    torch.manual_seed(0)
    cfg = PRESETS["gpt-test"]
    m = GPT(cfg)
    idx = torch.randint(cfg.vocab_size, (3, 11))
    tgt = torch.randint(cfg.vocab_size, (3, 11))
    logits, loss = m(idx, tgt)
    assert logits.shape == (3, 11, cfg.vocab_size)
    # at initialisation the prediction is near uniform (random targets)
    assert abs(loss.item() - torch.log(torch.tensor(float(cfg.vocab_size))).item()) < 0.15
    assert m.head.weight is m.wte.weight
    assert m.num_params() == sum(p.numel() for p in set(m.parameters()))
    loss.backward()
    assert all(p.grad is not None for p in m.parameters())


def test_causal():
    """The logits at position t do not depend on tokens after t."""
    torch.manual_seed(1)
    cfg = PRESETS["gpt-test"]
    m = GPT(cfg).eval()
    a = torch.randint(cfg.vocab_size, (1, 9))
    b = a.clone()
    b[0, 6:] = (b[0, 6:] + 1) % cfg.vocab_size
    torch.testing.assert_close(m(a)[0, :6], m(b)[0, :6])
    assert not torch.allclose(m(a)[0, 6:], m(b)[0, 6:])


def test_gpt2_124m_size():
    """The paper's model: 124M parameters with GPT-2's padded vocabulary (counted from
    the config, without building it)."""
    c = PRESETS["gpt2-124m"]
    d, L = c.n_embd, c.n_layer
    per_block = 12 * d * d + 13 * d          # qkv, proj, fc, out (+ biases), two LayerNorms
    total = c.vocab_size * d + c.block_size * d + L * per_block + 2 * d
    assert 124e6 < total < 125e6


@pytest.mark.parametrize("bad", [dict(n_embd=30, n_head=4), dict(n_layer=0),
                                 dict(dropout=1.0)])
def test_bad_config(bad):
    with pytest.raises(ValueError):
        GPTConfig(**bad)


def test_too_long_sequence():
    cfg = PRESETS["gpt-test"]
    with pytest.raises(ValueError, match="block_size"):
        GPT(cfg)(torch.zeros(1, cfg.block_size + 1, dtype=torch.long))
