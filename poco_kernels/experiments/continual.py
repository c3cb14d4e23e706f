"""Continual pretraining (the paper's App. on continual pretraining): start IVON-PoCoMo
from a model and an IVON optimizer state saved by another run.

Accepted checkpoints (``torch.save``d dicts):

* this package's pretraining checkpoints (:mod:`~poco_kernels.experiments.pretrain`),
  whose optimizer state is ours (``IVON`` or ``IVONPoCo``) or ivon-opt's (runs with
  ``--optimizer ivon-opt``);
* nanoGPT-layout checkpoints, as the IVON authors' GPT-2 runs save them: ``"model"`` with
  nanoGPT's parameter names (``transformer.h.0.attn.c_attn.weight`` ...; a
  ``_orig_mod.`` prefix from ``torch.compile`` is dropped), ``"model_args"``,
  ``"iter_num"`` and ``"optimizer"``, an ivon-opt 0.1.3 state dict.

ivon-opt keeps ``hess`` and ``momentum`` as one flat vector per parameter group, in the
order the parameters were given to it.  nanoGPT gives them as two groups, the
parameters with ``dim >= 2`` (weight decay) then the others, each in
``named_parameters()`` order; :func:`decay_groups` makes the same split of this
package's GPT, whose parameters come in the same order under other names
(:func:`nanogpt_to_ours`).  ivon-opt does not save its step counter (needed for
debiasing the momentum): it is taken from the checkpoint's ``iter_num``/``step`` or
given explicitly.
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["decay_groups", "nanogpt_to_ours", "load_model_state", "ivon_moments",
           "load_ivon_moments", "checkpoint_step"]

_RENAMES = [
    (r"^transformer\.wte\.", "wte."), (r"^transformer\.wpe\.", "wpe."),
    (r"^transformer\.ln_f\.", "ln_f."), (r"^lm_head\.", "head."),
    (r"^transformer\.h\.(\d+)\.ln_1\.", r"blocks.\1.ln1."),
    (r"^transformer\.h\.(\d+)\.ln_2\.", r"blocks.\1.ln2."),
    (r"^transformer\.h\.(\d+)\.attn\.c_attn\.", r"blocks.\1.attn.qkv."),
    (r"^transformer\.h\.(\d+)\.attn\.c_proj\.", r"blocks.\1.attn.proj."),
    (r"^transformer\.h\.(\d+)\.mlp\.c_fc\.", r"blocks.\1.fc."),
    (r"^transformer\.h\.(\d+)\.mlp\.c_proj\.", r"blocks.\1.out."),
]


def decay_groups(model: torch.nn.Module, weight_decay: float) -> List[Dict[str, Any]]:
    """nanoGPT's two parameter groups: ``dim >= 2`` with ``weight_decay``, the rest
    without (``named_parameters()`` order, the tied head counted once)."""
    ps = [p for _, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}]


def nanogpt_to_ours(sd: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """A model state dict with nanoGPT's names (or ours) under this package's names.
    ``_orig_mod.``/``module.`` prefixes are dropped, and nanoGPT's causal-mask buffers."""
    out = {}
    for k, v in sd.items():
        for pre in ("_orig_mod.", "module."):
            if k.startswith(pre):
                k = k[len(pre):]
        if re.match(r"^transformer\.h\.\d+\.attn\.bias$", k):     # the mask, not a parameter
            continue
        for pat, rep in _RENAMES:
            k2 = re.sub(pat, rep, k)
            if k2 != k:
                k = k2
                break
        out[k] = v
    return out


def load_model_state(model: torch.nn.Module, sd: Dict[str, Tensor]) -> None:
    """Load ``sd`` (ours or nanoGPT's names) into ``model``; a missing or unexpected key,
    or a shape mismatch, is an error that names it (the model is left unchanged)."""
    sd = nanogpt_to_ours(sd)
    own = model.state_dict()
    missing = sorted(set(own) - set(sd))
    extra = sorted(set(sd) - set(own))
    if missing or extra:
        raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, "
                         f"unexpected {extra[:5]}")
    for k, v in own.items():
        if tuple(sd[k].shape) != tuple(v.shape):
            raise ValueError(f"checkpoint's {k} has shape {tuple(sd[k].shape)}, the model's "
                             f"{tuple(v.shape)}")
    model.load_state_dict(sd)


def ivon_moments(opt_sd: Dict[str, Any], groups: Sequence[Sequence[Tensor]]
                 ) -> List[Dict[str, Tensor]]:
    """Per parameter (the order of ``groups``): ``{"h", "momentum"}`` from an optimizer
    state dict of ivon-opt 0.1.3 (flat vectors per group) or of this package's ``IVON``
    / ``IVONPoCo`` (per-parameter state).  ``groups``: the parameters, grouped as the
    saving run grouped them."""
    if not isinstance(opt_sd, dict) or "param_groups" not in opt_sd:
        raise ValueError("not an optimizer state dict (no 'param_groups')")
    saved = opt_sd["param_groups"]
    if len(saved) != len(groups):
        raise ValueError(f"the optimizer state has {len(saved)} parameter groups, the model "
                         f"{len(groups)} (see decay_groups)")
    out = []
    if "poco" in opt_sd:                           # ours
        name = opt_sd["poco"].get("optimizer")
        if name not in ("IVON", "IVONPoCo"):
            raise ValueError(f"the optimizer state is {name}'s, not IVON's")
        for gi, (sg, ps) in enumerate(zip(saved, groups)):
            if len(sg["params"]) != len(ps):
                raise ValueError(f"group {gi}: {len(sg['params'])} parameters saved, "
                                 f"{len(ps)} in the model")
            for idx in sg["params"]:                # shapes: checked by load_ivon_moments
                st = opt_sd["state"][idx]
                out.append({"h": st["h"], "momentum": st["momentum"]})
        return out
    for gi, (sg, ps) in enumerate(zip(saved, groups)):   # ivon-opt: flat per group
        if "hess" not in sg or "momentum" not in sg:
            raise ValueError("the optimizer state is neither this package's nor ivon-opt's "
                             "(no 'hess'/'momentum' in its parameter groups)")
        n = sum(p.numel() for p in ps)
        if sg["hess"].numel() != n or sg["momentum"].numel() != n:
            raise ValueError(f"group {gi}: ivon-opt's state has {sg['hess'].numel()} elements, "
                             f"the model's parameters {n}")
        off = 0
        for p in ps:
            k = p.numel()
            out.append({"h": sg["hess"][off:off + k].view_as(p),
                        "momentum": sg["momentum"][off:off + k].view_as(p)})
            off += k
    return out


def load_ivon_moments(opt, moments: Sequence[Dict[str, Tensor]], step: int) -> None:
    """Start ``opt`` (``IVON`` or ``IVONPoCo``) from saved IVON moments: ``h`` and the
    momentum per parameter (the order of ``opt.param_groups``), the step counter
    ``step`` (momentum debiasing, noise counter); the mean is the parameters, the outer
    estimates start empty.  Goes through ``load_state_dict``, so everything is checked
    before anything changes."""
    if not (isinstance(step, int) and step >= 0):
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    sd = opt.state_dict()
    params = [p for g in opt.param_groups for p in g["params"]]
    if len(moments) != len(params):
        raise ValueError(f"{len(moments)} saved parameters, the optimizer has {len(params)}")
    from .._layout import is_sharded, shard_start as _shard_start
    for i, (p, m) in enumerate(zip(params, moments)):
        st = dict(sd["state"][i])
        for k in ("h", "momentum"):
            v = m[k].detach()
            if tuple(v.shape) != tuple(p.shape):
                raise ValueError(f"parameter {i}: saved {k} has shape {tuple(v.shape)}, the "
                                 f"parameter {tuple(p.shape)}")
            if is_sharded(p):          # this rank's shard of the saved (full) moment
                start = _shard_start(p)
                v = v.reshape(-1)[start:start + st[k].numel()]
            st[k] = v.to(dtype=st[k].dtype, device=st[k].device).reshape(st[k].shape)
        sd["state"][i] = st
    sd["poco"] = {**sd["poco"], "step": int(step), "refreshes": 0}
    opt.load_state_dict(sd)


def checkpoint_step(ckpt: Dict[str, Any], given: Optional[int]) -> int:
    """The saving run's optimizer step count: ``given``, else the checkpoint's."""
    if given is not None:
        return int(given)
    opt = ckpt.get("optimizer", {})
    if isinstance(opt, dict) and "poco" in opt:
        return int(opt["poco"]["step"])
    for k in ("opt_step", "iter_num", "step"):
        if k in ckpt:
            return int(ckpt[k])
    raise ValueError("the checkpoint does not say how many steps its optimizer took "
                     "(ivon-opt does not save it): pass --init-step")
