"""The logistic-regression study's settings: the methods, :class:`Config` (the paper's
defaults), the presets, and the command-line flags of
``python -m poco_kernels.experiments.logreg`` (every setting has one)."""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from . import datasets

__all__ = ["FIRST_ORDER", "IVON_TYPE", "METHODS", "DATASETS", "Config", "PRESETS",
           "build_parser", "config_from_args"]

FIRST_ORDER = ("sgd", "svrg", "vsgd", "vsgd-poco")
IVON_TYPE = ("ivon", "ivon-poco", "ivon-poco-pair", "von-poco")
METHODS = FIRST_ORDER + IVON_TYPE
DATASETS = datasets.DATASETS


# ----------------------------------------------------------------------------- config
@dataclass
class Config:
    """Settings of one study; the defaults are the paper's (the ``paper`` preset)."""
    dataset: str = "breast_cancer"
    data_dir: str = "data"               # where mnist/, covertype/, cifar10/ live
    max_train: Optional[int] = None      # stratified subset of the training set
    features: str = "standardize"        # or "scale" (datasets.load)
    test_size: float = 0.2
    l2: float = 1e-2                     # lam of F (and every optimizer's weight_decay)
    n_synthetic: int = 20_000            # examples of the 'synthetic' data set
    methods: Tuple[str, ...] = METHODS
    steps: int = 80_000
    lr: float = 0.01
    batch: int = 5
    refresh_every: int = 10_000
    warmup: int = 20_000
    megabatch: int = 50_000              # the full training set when larger
    refresh_samples: int = 1             # posterior samples per refresh (IVON-PoCo; Alg. 3: 1)
    refresh_antithetic: bool = False     # mirrored refresh pairs (ivon-poco-pair always)
    hess_floor: Optional[float] = None   # IVON-PoCo: corrected hhat >= -c (h + wd)
    alpha: float = 1.0
    # VSGD
    vsgd_sigma: float = 0.01
    # IVON / IVON-PoCo
    ivon_lr: Optional[float] = None      # None: lr
    ess: Optional[float] = None          # None: ess_per_example * N
    ess_per_example: float = 100.0
    hess_init: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.99999
    clip_radius: float = math.inf
    mc_samples: int = 1
    rho1: float = 0.0
    rho2: float = 0.0
    hess_corr_scale: float = 0.01        # the paper's down-weighting of line 14's extra term
    outer_noise: str = "shared"
    # VON-PoCo
    von_lr: Optional[float] = None       # None: the IVON lr
    von_beta: Optional[float] = None     # None: the IVON lr
    von_schedule: float = 0.1            # fraction of steps / warm-up / refresh interval
    von_max_dim: int = 128               # larger problems skip VON-PoCo
    # bookkeeping
    seed: int = 0
    eval_every: int = 0                  # 0: steps // 400 (at least 1)
    fine_every: int = 0                  # the gap-only trace: 0: eval_every // 10
    log_every: int = 0                   # 0: no progress lines
    lbfgs_gtol: float = 1e-10
    blowup: float = 10.0                 # F(m) > blowup * F(0): the run has blown up
    reach_tol: float = 1e-6              # relative gap at which a method "reaches" L-BFGS


PRESETS: Dict[str, Dict[str, object]] = {
    "paper": dict(steps=80_000, warmup=20_000, refresh_every=10_000, megabatch=50_000,
                  lr=0.01),
    "quick": dict(steps=12_000, warmup=2_000, refresh_every=2_000, megabatch=50_000,
                  lr=0.05),
}


# ----------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    """The flags of ``python -m poco_kernels.experiments.logreg``."""
    p = argparse.ArgumentParser(
        prog="python -m poco_kernels.experiments.logreg",
        description="Sec. 5.1 of the paper: SGD/SVRG/VSGD/VSGD-PoCo/IVON/IVON-PoCo/VON-PoCo "
                    "on L2-regularised logistic regression against full-batch L-BFGS "
                    "(float64): plots, a table, and the paper's claims checked.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = Config()
    p.add_argument("--preset", choices=sorted(PRESETS), default="paper",
                   help="defaults for --steps/--warmup/--refresh-every/--megabatch/--lr: "
                        + "; ".join(f"{k}: {v}" for k, v in PRESETS.items()))
    p.add_argument("--dataset", choices=DATASETS, default=d.dataset,
                   help="bundled with scikit-learn, or read from --data-dir (mnist, "
                        "covertype, cifar10; see poco_kernels/experiments/datasets.py)")
    p.add_argument("--data-dir", default=d.data_dir,
                   help="folder holding mnist/, covertype/, cifar10/ (nothing is downloaded)")
    p.add_argument("--max-train", type=int, default=None,
                   help="keep a stratified subset of this many training examples")
    p.add_argument("--features", choices=datasets.FEATURES, default=d.features,
                   help="standardize every feature, or only scale it to [-1, 1] (uncentred)")
    p.add_argument("--methods", default=",".join(d.methods),
                   help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--out-dir", default="logreg_out",
                   help="where the plot, report and CSVs go ('' for none)")
    p.add_argument("--steps", type=int, default=None, help="inner steps (preset)")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate of every method (preset)")
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--refresh-every", type=int, default=None, help="inner steps between "
                   "refreshes (preset)")
    p.add_argument("--warmup", type=int, default=None,
                   help="inner steps before the first refresh (preset)")
    p.add_argument("--megabatch", type=int, default=None,
                   help="mega-batch size; the full training set when larger (preset)")
    p.add_argument("--refresh-samples", type=int, default=d.refresh_samples,
                   help="IVON-PoCo: posterior samples per refresh, averaged (Alg. 3: 1)")
    p.add_argument("--refresh-antithetic", action="store_true",
                   help="IVON-PoCo: refresh samples in mirrored pairs +eps, -eps")
    p.add_argument("--hess-floor", type=float, default=None,
                   help="IVON-PoCo: floor the corrected Hessian estimate at -c (h + wd)")
    p.add_argument("--alpha", type=float, default=d.alpha, help="correction weight")
    p.add_argument("--l2", type=float, default=d.l2, help="lam of the objective = "
                   "weight_decay of every optimizer")
    p.add_argument("--test-size", type=float, default=d.test_size)
    p.add_argument("--n-synthetic", type=int, default=d.n_synthetic)
    p.add_argument("--vsgd-sigma", type=float, default=d.vsgd_sigma)
    p.add_argument("--ivon-lr", type=float, default=None, help="IVON(-PoCo) lr (default --lr)")
    p.add_argument("--ess", type=float, default=None,
                   help="IVON effective sample size (default: --ess-per-example x N)")
    p.add_argument("--ess-per-example", type=float, default=d.ess_per_example,
                   help="ess as a multiple of the number N of training examples")
    p.add_argument("--hess-init", type=float, default=d.hess_init)
    p.add_argument("--beta1", type=float, default=d.beta1)
    p.add_argument("--beta2", type=float, default=d.beta2)
    p.add_argument("--clip-radius", type=float, default=d.clip_radius)
    p.add_argument("--mc-samples", type=int, default=d.mc_samples)
    p.add_argument("--rho1", type=float, default=d.rho1,
                   help="outer momentum on g_out (Alg. 3 convention: 0 = none)")
    p.add_argument("--rho2", type=float, default=d.rho2,
                   help="outer momentum on h_out (Alg. 3 convention: 0 = none)")
    p.add_argument("--hess-corr-scale", type=float, default=d.hess_corr_scale)
    p.add_argument("--outer-noise", choices=("shared", "independent"), default=d.outer_noise)
    p.add_argument("--von-lr", type=float, default=None, help="VON-PoCo lr (default: IVON's)")
    p.add_argument("--von-beta", type=float, default=None,
                   help="VON-PoCo precision rate (default: IVON's lr)")
    p.add_argument("--von-schedule", type=float, default=d.von_schedule,
                   help="VON-PoCo's steps, warm-up and refresh interval as a fraction of "
                        "the others'")
    p.add_argument("--von-max-dim", type=int, default=d.von_max_dim,
                   help="skip VON-PoCo above this many weights")
    p.add_argument("--reach-tol", type=float, default=d.reach_tol,
                   help="relative objective gap at which a method has reached L-BFGS, i.e. "
                        "matches its objective to about 6 digits (the claims)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--eval-every", type=int, default=d.eval_every,
                   help="record F(m) and the test accuracy every this many steps "
                        "(0: steps/400)")
    p.add_argument("--fine-every", type=int, default=d.fine_every,
                   help="record the objective gap alone every this many steps, for the "
                        "'faster' claim's first-reach brackets (0: eval-every/10)")
    p.add_argument("--log-every", type=int, default=None,
                   help="progress line every this many steps (default: steps/10; 0: none)")
    p.add_argument("--blowup", type=float, default=d.blowup,
                   help="stop a run as 'blow-up' once F(m) > BLOWUP * F(0) at a recorded step")
    p.add_argument("--csv", default=None, metavar="PATH", help="also write the table here")
    p.add_argument("--no-plot", action="store_true", help="no PNG (no matplotlib needed)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads (one thread is fastest for these small models)")
    return p


def config_from_args(args: argparse.Namespace) -> Config:
    """The :class:`Config` of parsed flags: the preset's values where a flag is unset,
    checked (a clear exit on a bad value)."""
    preset = PRESETS[args.preset]
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"unknown method {m!r} (expected some of {','.join(METHODS)})")
    pick = lambda v, k: preset[k] if v is None else v  # noqa: E731
    steps = pick(args.steps, "steps")
    cfg = Config(
        dataset=args.dataset, data_dir=args.data_dir, max_train=args.max_train,
        features=args.features,
        test_size=args.test_size, l2=args.l2, n_synthetic=args.n_synthetic, methods=methods,
        steps=steps, lr=pick(args.lr, "lr"), batch=args.batch,
        refresh_every=pick(args.refresh_every, "refresh_every"),
        warmup=pick(args.warmup, "warmup"), megabatch=pick(args.megabatch, "megabatch"),
        refresh_samples=args.refresh_samples, refresh_antithetic=args.refresh_antithetic,
        hess_floor=args.hess_floor, ess_per_example=args.ess_per_example,
        alpha=args.alpha, vsgd_sigma=args.vsgd_sigma, ivon_lr=args.ivon_lr, ess=args.ess,
        hess_init=args.hess_init, beta1=args.beta1, beta2=args.beta2,
        clip_radius=args.clip_radius, mc_samples=args.mc_samples, rho1=args.rho1,
        rho2=args.rho2, hess_corr_scale=args.hess_corr_scale, outer_noise=args.outer_noise,
        von_lr=args.von_lr, von_beta=args.von_beta, von_schedule=args.von_schedule,
        von_max_dim=args.von_max_dim, reach_tol=args.reach_tol,
        seed=args.seed, eval_every=args.eval_every, fine_every=args.fine_every,
        blowup=args.blowup,
        log_every=max(steps // 10, 1) if args.log_every is None else args.log_every)
    for k in ("steps", "batch", "refresh_every", "megabatch", "refresh_samples"):
        if getattr(cfg, k) < 1:
            raise SystemExit(f"--{k.replace('_', '-')} must be positive")
    if cfg.warmup < 0:
        raise SystemExit("--warmup must be non-negative")
    for k in ("eval_every", "fine_every"):
        if getattr(cfg, k) < 0:
            raise SystemExit(f"--{k.replace('_', '-')} must be non-negative (0: the default)")
    if not 0 < cfg.von_schedule <= 1:
        raise SystemExit("--von-schedule must be in (0, 1]")
    return cfg

