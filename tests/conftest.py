import os
import sys

# Triton runs through its CPU interpreter in the tests: this must be set before anything
# (torch included) imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
