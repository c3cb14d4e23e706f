"""Tolerances of every backend against the reference, stated once (per dtype).

* ``STATE``: float32 optimizer state computed by a kernel against the same formulas in
  torch, on the same inputs.  The only differences are float32 rounding (fused
  multiply-adds, ``x / y`` vs ``x * (1/y)``, ``beta ** t`` as ``exp2(t log2 beta)``) and
  the standard normals, which differ by ~1 ulp between numpy/libdevice and torch
  (``tests/test_noise.py``).
* ``PARAM``: parameters written in their dtype: the rounding of nearly equal float32
  values can land one unit in the last place apart; and Triton's CPU interpreter
  truncates float32 -> bfloat16 where the GPU (and torch) round to nearest even, one ulp.
* ``TRAJECTORY``: whole trajectories (tens of steps, refreshes included): the per-step
  differences above, compounded by the dynamics.  For bf16/fp16 parameters the gradients
  are taken at rounded parameters, so one ulp of difference in a parameter feeds back.
"""
import torch

STATE = {torch.float32: dict(rtol=2e-5, atol=1e-6)}
PARAM = {
    torch.float32: dict(rtol=2e-5, atol=1e-6),
    torch.bfloat16: dict(rtol=2 ** -7, atol=1e-5),      # one bf16 ulp (2**-8 relative) x 2
    torch.float16: dict(rtol=2 ** -10, atol=1e-5),      # one fp16 ulp (2**-11 relative) x 2
}
TRAJECTORY = {
    torch.float32: dict(rtol=1e-4, atol=1e-6),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-3),
    torch.float16: dict(rtol=5e-3, atol=5e-4),
}


def assert_close(actual, expected, tol, what=""):
    """``torch.testing.assert_close`` with a named tolerance set; NaN never passes."""
    assert not torch.isnan(actual).any(), f"{what}: NaN"
    torch.testing.assert_close(actual.float(), expected.float(), **tol, msg=lambda m: f"{what}: {m}")
