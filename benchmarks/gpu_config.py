"""What ``bench_gpu.py`` checks against and on: the parity tolerances, the parity
configurations and parameter layout, and the tiny ``run.py`` options of ``--smoke``."""
from __future__ import annotations

import os

import torch

from device import REPO

# --------------------------------------------------------------------------- tolerances
# Gate: max|a - b| / max|b| over a bucket buffer.  float32: tests/tolerances.py's
# TRAJECTORY rtol for float32 (whole trajectories, 1e-4) where that file is there, else
# 1e-4.  bf16 parameters: their float32 master mean at 1e-3 (tests/tolerances.py has no
# entry for the master copy; its bf16 TRAJECTORY rtol, 2e-2, is for the bf16 parameters).
RTOL_FP32 = 1e-4           # float32 parameters: mean and h buffers
RTOL_BF16_MASTER = 1e-3    # bf16 parameters: the float32 master mean buffer
TOLERANCE_SOURCE = "stated in gpu_config.py"


def _load_tolerances():
    global RTOL_FP32, TOLERANCE_SOURCE
    path = os.path.join(REPO, "tests", "tolerances.py")
    if not os.path.exists(path):
        return
    try:
        import importlib.util
        spec = importlib.util.spec_from_file_location("_poco_tolerances", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        RTOL_FP32 = float(mod.TRAJECTORY[torch.float32]["rtol"])
        TOLERANCE_SOURCE = "float32 from tests/tolerances.py TRAJECTORY; bf16 master stated here"
    except Exception as exc:  # keep the stated values
        TOLERANCE_SOURCE = f"stated in gpu_config.py (tests/tolerances.py unreadable: {exc})"


_load_tolerances()


def parity_layout(smoke):
    """(sizes, dtypes, group of each parameter): three groups; group 2 mixes dtypes (two
    buckets); odd sizes."""
    if smoke:
        sizes = [1003, 37, 1001, 17, 513, 33]
    else:
        sizes = [1_000_003, 4097, 1_000_003, 129, 65_537, 999]
    dtypes = [torch.float32, torch.float32, torch.bfloat16, torch.bfloat16, torch.float32,
              torch.bfloat16]
    groups = [0, 0, 1, 1, 2, 2]
    return sizes, dtypes, groups


PARITY_CONFIGS = {
    # Alg. 3 defaults except beta2: 0.99999 barely moves h in 30 steps; 0.999 without the
    # stabilisers drives h + wd toward 0 (docs/logreg-study.md, 'Stability of IVON-PoCo'), which amplifies
    # float rounding ~16x (measured on the smoke sizes) so the comparison would measure the
    # trajectory's conditioning instead of the kernels.  Per-group lr / weight decay /
    # outer momentum / clip.
    "ivon_poco": dict(
        cls="IVONPoCo", kw=dict(lr=0.1, ess=1e4, beta2=0.9999, seed=11),
        groups=[{}, {"lr": 0.05, "weight_decay": 1e-3}, {"rho1": 0.6, "rho2": 0.1,
                                                          "clip_radius": 0.5}]),
    # stabilisers: antithetic refresh pair, floor, 2 MC samples (GE sums, fold_ge),
    # independent outer noise
    "ivon_poco_stabilised": dict(
        cls="IVONPoCo", kw=dict(lr=0.1, ess=1e4, beta2=0.999, seed=12, mc_samples=2,
                                refresh_samples=2, refresh_antithetic=True, hess_floor=0.0,
                                outer_noise="independent"),
        groups=[{}, {"lr": 0.05}, {"alpha": 0.5}]),
    "ivon": dict(
        cls="IVON", kw=dict(lr=0.1, ess=1e4, beta2=0.999, seed=13, mc_samples=2),
        groups=[{}, {"lr": 0.05}, {"weight_decay": 1e-3}]),
}


# run.py's options under --smoke (the CPU, the Triton interpreter, tiny sizes), before any
# given on the command line
SMOKE_SUITE_ARGS = ["--device", "cpu", "--sizes", "1024", "2053", "--reps", "2", "--max-s", "1",
                    "--copy-mib", "4", "--rotate-mib", "4", "--memory-numel", "3001",
                    "--gpt", "gpt-test", "--gpt-iters", "2"]
