"""Argument checks shared by the optimizers: ranges of hyperparameters, and constructors
that refuse unknown keywords with the closest valid one named."""
from __future__ import annotations

import difflib
import functools
import inspect
import math
import numbers

import torch


#: the largest finite float32: hyperparameters reach the kernels as float32 constants
FLOAT32_MAX = 3.4028234663852886e38


def check(cond: bool, msg: str) -> None:
    """Raise ``ValueError(msg)`` unless ``cond``."""
    if not cond:
        raise ValueError(msg)


def readable(t: torch.Tensor) -> bool:
    """Whether a tensor hyperparameter's value is read to check its range: on the CPU,
    where that costs nothing."""
    return t.device.type == "cpu"


def check_range(group, key, lo=None, hi=None, lo_open=False, hi_open=False, kind=float,
                allow_inf=False, tensor=False):
    """Raise a ValueError naming ``key`` unless ``group[key]`` is a number in the range
    (``tensor``: or a one-element real float tensor holding one, as torch.optim takes
    ``lr``.  Its value is checked where reading it is free, on the CPU; on a GPU that
    would be a synchronisation per step, so there, as in ``torch.optim``, it is not)."""
    v = group[key]
    if tensor and isinstance(v, torch.Tensor):
        check(v.numel() == 1 and v.is_floating_point() and not v.is_complex()
              and v.device.type != "meta",
              f"invalid {key}: a tensor {key} must be a one-element real float tensor, got "
              f"{v.dtype} of shape {tuple(v.shape)}")
        if not readable(v):
            return
        v = float(v.detach().reshape(()))
    if kind is float:
        # (an int must fit torch's int64 scalars; the kernels take float32 constants:
        # finite there, or +inf where allowed)
        if isinstance(v, numbers.Real) and not isinstance(v, (bool, int, float)):
            v = float(v)                      # (a numpy scalar, as torch.optim takes)
        ok = (isinstance(v, float) or (isinstance(v, int) and not isinstance(v, bool)
                                       and abs(v) < 2 ** 63))
        if ok:
            try:
                f = float(v)
            except OverflowError:
                f = math.nan
            ok = abs(f) <= FLOAT32_MAX or (allow_inf and f == math.inf)
    else:
        ok = isinstance(v, int) and not isinstance(v, bool)
    if ok and lo is not None:
        ok = v > lo if lo_open else v >= lo
    if ok and hi is not None:
        ok = v < hi if hi_open else v <= hi
    if not ok:
        lb = "" if lo is None else ("(" if lo_open else "[") + str(lo)
        ub = "" if hi is None else str(hi) + (")" if hi_open else "]")
        raise ValueError(f"invalid {key}: {v!r} (expected a {kind.__name__} in "
                         f"{lb or '(-inf'}, {ub or 'inf)'})")


#: torch.optim's implementation flags that these optimizers do not take, and why
TORCH_FLAGS = {
    "maximize": "minimise the negated objective instead",
    "foreach": "the backend decides how the update runs (backend='torch', 'cpp' or 'triton')",
    "fused": "the fused kernels are backend='triton' (CUDA) and backend='cpp' (CPU)",
    "capturable": "the fused backends keep their counters on the device already",
    "differentiable": "the updates run under torch.no_grad()",
}


#: those that change what an update does (the others choose how torch runs it)
SEMANTIC_TORCH_FLAGS = ("maximize", "differentiable")


def torch_flag_error(owner: str, key: str) -> TypeError:
    """The error for a torch.optim flag these optimizers do not take."""
    return TypeError(f"{owner} does not take torch.optim's {key!r} flag: "
                     f"{TORCH_FLAGS[key]} (see docs/design.md, 'torch.optim conventions')")


def strict_keywords(cls) -> None:
    """Make ``cls.__init__`` refuse an unknown keyword argument with a ``TypeError`` that
    names the closest valid one (Python's own message names none)."""
    init = cls.__dict__.get("__init__")
    if init is None or getattr(init, "_strict", False):
        return
    params = inspect.signature(init).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    names = [n for n, p in params.items() if n != "self" and p.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        for k in kwargs:
            if k in TORCH_FLAGS and k not in names:
                raise torch_flag_error(f"{cls.__name__}()", k)
            if k not in names:
                close = difflib.get_close_matches(k, names, n=1, cutoff=0.5)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise TypeError(f"{cls.__name__}() got an unexpected keyword argument {k!r}"
                                f"{hint} (valid: {', '.join(names[1:])})")
        init(self, *args, **kwargs)

    __init__._strict = True
    cls.__init__ = __init__


#: keys that tools put into parameter groups (lr schedulers, torch.optim's named
#: parameters, SWA): never taken for misspelled hyperparameters
TOOL_GROUP_KEYS = frozenset({"params", "param_names", "name", "initial_lr", "max_lr", "min_lr",
                             "base_lr", "base_momentum", "max_momentum", "swa_lr"})


def check_group_keys(group, defaults, where: str, misspelled: bool = True) -> None:
    """Refuse a group that lacks a hyperparameter, or (``misspelled``) has a key that
    looks like a misspelled one (``weight_decy``); other extra keys (a group's ``name``, a
    scheduler's ``initial_lr``) are the user's and kept."""
    missing = [k for k in defaults if k not in group]
    if missing:
        raise ValueError(f"{where}: missing hyperparameter(s) {', '.join(map(repr, missing))}")
    if not misspelled:
        # (a live or loaded group: torch.optim's own values of its flags, a torch.optim
        # state dict's, are kept; one that would change what the update does is refused)
        for k in SEMANTIC_TORCH_FLAGS:
            if group.get(k, False) not in (False, None, 0):
                raise torch_flag_error(where, k)
        return
    for k in group:
        if k in TORCH_FLAGS:
            raise torch_flag_error(where, k)
        if k in defaults or k in TOOL_GROUP_KEYS or not isinstance(k, str):
            continue
        close = difflib.get_close_matches(k, list(defaults), n=1, cutoff=0.75)
        if close:
            raise ValueError(f"{where}: unknown hyperparameter {k!r}; did you mean "
                             f"{close[0]!r}? (valid: {', '.join(defaults)})")


#: the hyperparameters that may be one-element tensors (as ``torch.optim`` takes ``lr``;
#: a scheduler ``fill_``\ s them in place): the fused backends hand them to the kernels
#: on the device, unread
TENSOR_HYPERPARAMETERS = ("lr", "alpha")


def hyperparameters(group, keep_tensors: bool = False):
    """A parameter group's hyperparameters for an update: a plain dict, one-element
    tensors (a tensor ``lr``) read as Python floats, or kept as they are
    (``keep_tensors``: the fused backends, whose kernels read them on the device)."""
    out = dict(group)                         # (the stored values: no alias is a key)
    out.pop("params", None)
    if not keep_tensors and any(issubclass(t, torch.Tensor) for t in set(map(type, out.values()))):
        for k, v in out.items():
            if isinstance(v, torch.Tensor):
                out[k] = float(v.detach().reshape(()))
    return out


def checked_low_dtypes(opt, state_dtype, outer_dtype):
    """``(state_dtype, outer_dtype)`` of ``opt`` as it keeps them (float32 is None), or a
    clear error: only bfloat16 is another dtype, and only for buffers its rule has."""
    name = type(opt).__name__
    if state_dtype == torch.float32:
        state_dtype = None
    check(state_dtype is None or state_dtype == torch.bfloat16,
          f"state_dtype must be None, torch.float32 or torch.bfloat16, got {state_dtype!r}")
    check(state_dtype is None or opt.rule.low_state_buffers,
          f"{name} has no state that state_dtype={state_dtype} applies to (it is for the "
          "IVON family's momentum and outer buffers)")
    if outer_dtype == torch.float32 and state_dtype is None:
        outer_dtype = None
    check(outer_dtype is None or outer_dtype == torch.bfloat16,
          "outer_dtype must be None or torch.bfloat16 (torch.float32 only with float32 "
          f"state: the outer estimates follow state_dtype), got {outer_dtype!r}")
    check(outer_dtype is None or opt.rule.outer_estimate_buffers,
          f"{name} has no outer estimates that outer_dtype={outer_dtype} applies to (it is "
          "for IVON-PoCo(Mo)'s g_out and h_out)")
    return state_dtype, outer_dtype
