"""The engine's sweeps over a bucket's parameters, run in every public call of an
iteration: whether they are still the views of the flat buffer (their addresses), which
``.grad`` are the views handed out, whether the gradient buffers are still zero (their
version counters), which parameters are trainable; :func:`scan`, the first three and whether the presence
hooks are in place, in one pass.

With the C++ extension built (and not disabled) these are its functions
(``csrc/sweeps.cpp``), which read the C++ tensors' fields without a Python object per
tensor; else the Python twins below, which give the same results.  At GPT-2's 148
tensors a Python sweep costs 11-17 us on this project's CPUs, and an iteration runs
about ten.
"""
from __future__ import annotations

import itertools
import operator
from typing import List, Optional, Sequence, Tuple, Union

from torch import Tensor

_grad = operator.attrgetter("grad")
_version = operator.attrgetter("_version")
_requires_grad = operator.attrgetter("requires_grad")
_NONES = itertools.repeat(None)


def py_same_addresses(tensors: Sequence[Tensor], addresses: List[int]) -> bool:
    """Every ``tensors[i].data_ptr() == addresses[i]`` (and as many of each)."""
    return list(map(Tensor.data_ptr, tensors)) == list(addresses)


def py_versions(tensors: Sequence[Tensor]) -> List[int]:
    """Each tensor's version counter."""
    return list(map(_version, tensors))


def py_grads(params: Sequence[Tensor], views: Optional[Sequence[Tensor]]) -> Tuple[int, int]:
    """How many ``params[i].grad`` are not None, and how many are ``views[i]`` itself (0
    when ``views`` is None)."""
    gs = list(map(_grad, params))
    defined = sum(map(operator.is_not, gs, _NONES))
    if views is None:
        return defined, 0
    if len(views) != len(gs):
        raise ValueError("grads: as many views as parameters expected")
    return defined, sum(map(operator.is_, gs, views))


def py_readable_grads(params: Sequence[Tensor]) -> Tuple[Optional[list], Optional[tuple]]:
    """``(None, the tuple of their data pointers)`` when every ``params[i].grad`` is there,
    dense, contiguous, of its parameter's dtype and size, and without the negative bit
    (readable in place by the kernels); else ``(each params[i].grad, None where there is
    none; None)``."""
    gs = list(map(_grad, params))
    try:
        key = tuple(map(Tensor.data_ptr, gs))     # (a None, a sparse one: an error)
    except (TypeError, RuntimeError):
        return gs, None
    usable = all(g.is_contiguous() and g.dtype == p.dtype and g.numel() == p.numel()
                 and not g.is_neg() for p, g in zip(params, gs))
    return (None, key) if usable else (gs, None)


def py_set_grads(params: Sequence[Tensor], grads: Optional[Sequence[Tensor]]) -> None:
    """``params[i].grad = grads[i]`` (``grads`` None: every one None)."""
    if grads is not None and len(grads) != len(params):
        raise ValueError("set_grads: as many gradients as parameters expected")
    for p, g in zip(params, _NONES if grads is None else grads):
        p.grad = g


def py_grads_now(params: Sequence[Tensor]) -> List[Tuple[Tensor, Optional[Tensor], int]]:
    """``(p, p.grad, its version counter or 0 when None)`` for each parameter."""
    out = []
    for p in params:
        g = p.grad
        out.append((p, g, 0 if g is None else g._version))
    return out


def py_trainable(tensors: Sequence[Tensor]) -> int:
    """How many require grad."""
    return list(map(_requires_grad, tensors)).count(True)


def py_scan(params: Sequence[Tensor], addresses: Optional[List[int]],
            views: Optional[Sequence[Tensor]], clean: Union[List[int], None, bool], flags,
            owner: int) -> Tuple[bool, int, int, bool, bool]:
    """``(flat, defined, matching, clean, watched)``: :func:`py_same_addresses` (True
    when ``addresses`` is None), :func:`py_grads`, for ``clean`` True when the views'
    versions equal ``clean``, else (views given, ``clean`` not False: False asks for no
    versions) their versions, else False; and False for the hooks (Python cannot see
    them: the caller installs them again, which finds them in place)."""
    flat = addresses is None or py_same_addresses(params, addresses)
    defined, matching = py_grads(params, views)
    if views is None or clean is False:
        return flat, defined, matching, False, False
    now = py_versions(views)
    if clean is not None and len(clean) != len(now):
        raise ValueError("scan: as many views and versions as parameters expected")
    return flat, defined, matching, clean is not None and now == list(clean) or now, False


def _scan_with_versions(scan):
    """``scan`` of an extension that takes no ``clean=False``: asked for the versions,
    which are dropped."""
    def run(params, addresses, views, clean, flags, owner):
        out = scan(params, addresses, views, None if clean is False else clean, flags, owner)
        return out if clean is not False else (*out[:3], False, out[4])
    return run


def _load():
    from .kernels import cpp_status
    if cpp_status() is None:
        try:
            from ._C import (grads, grads_now, readable_grads, same_addresses, scan, set_grads,
                             trainable, versions)
        except ImportError:                   # (an extension built before them)
            pass
        else:
            try:
                scan([], None, [], False, None, 0)
            except TypeError:                 # (built before clean=False: no versions wanted)
                scan = _scan_with_versions(scan)
            return ("cpp", same_addresses, versions, grads, readable_grads, set_grads, trainable,
                    scan, grads_now)
    return ("python", py_same_addresses, py_versions, py_grads, py_readable_grads, py_set_grads,
            py_trainable, py_scan, py_grads_now)


#: "cpp" or "python": which implementation the functions below are
(IMPLEMENTATION, same_addresses, versions, grads, readable_grads, set_grads, trainable,
 scan, grads_now) = _load()


def _load_parking():
    if IMPLEMENTATION == "cpp":
        try:
            from ._C import park as pk, unpark as up
        except ImportError:                   # (an extension built before them)
            return None, None
        return pk, up
    return None, None


#: ``park(flat, mean, spare, params)`` and ``unpark(flat, mean, spare, params)``, each
#: ``-> (before, after)`` (unpark: None when the storage was given other memory while
#: parked): the flat parameter buffer's storage reads the mean's memory while its own waits
#: in the (empty) spare, and back; each of ``params`` has its version counter bumped; the
#: sums of their versions before and after (``csrc/park.cpp``).  No Python
#: twin: None without the extension (the engine does not park then,
#: ``backends/fused_park.py``)
park, unpark = _load_parking()
