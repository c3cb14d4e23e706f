"""Shared by the GPT pretraining tests (poco_kernels.experiments.pretrain): the small
run's command-line arguments, reading a run's saved states and comparing them, and the
stdlib corpus (a module-scoped fixture: import it into the test module)."""
import pytest
import torch

from poco_kernels.experiments import lm_data

# a 34k-parameter GPT on byte-level stdlib text; refreshes at steps 6, 10, 14, 18, 22
SMALL = ["--preset", "gpt-test", "--vocab-size", "256", "--batch-size", "8",
         "--micro-batch", "2", "--eval-every", "12", "--log-every", "1", "--ckpt-every", "100",
         "--quiet"]
POCO = ["--optimizer", "ivon-pocomo", "--max-steps", "24", "--poco-start", "6",
        "--refresh-every", "4", "--mega-batches", "3"]
# hess_init 1: updates mostly inside the clip radius, so rounding differences between
# reduction orders stay rounding differences (with hess_init 1e-3 nearly every
# coordinate is clipped, a sign update, and coordinates whose gradient is zero up to
# rounding, such as attention key biases, move by +-lr*clip on the sign of that rounding)
SMOOTH = ["--hess-init", "1.0"]


def _flat(d, pre=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{pre}{k}/"))
        elif torch.is_tensor(v):
            out[pre + str(k)] = v
    return out


def _load(path):
    return _flat(torch.load(path, map_location="cpu", weights_only=False))


def _max_rel(a, b):
    """Largest |a - b| per tensor relative to that tensor's largest |b|, and its key."""
    assert set(a) == set(b)
    worst = (-1.0, "")
    for k in a:
        if a[k].is_floating_point() and a[k].numel():
            d = (a[k].double() - b[k].double()).abs().max().item()
            s = b[k].double().abs().max().item()
            worst = max(worst, (d / max(s, 1e-30), k))
    return worst


@pytest.fixture(scope="module")
def stdlib():
    return lm_data.load_tokens("stdlib")
