"""Which parameters autograd accumulated a gradient into since their ``.grad`` views were
handed out: a byte per parameter of a bucket, set by a hook on the parameter.

A handed-out view that no backward reached still holds zeros; it counts as no gradient,
as a ``.grad`` of None does with ``torch.optim`` (:meth:`GradsMixin.unwritten
<poco_kernels.backends.fused_grads.GradsMixin.unwritten>`).  The hook that says which
were reached runs for every parameter in every backward, so it must cost nothing: with
the C++ extension it is a store in C++ (``csrc/presence.cpp``, ``poco_kernels._C.watch``:
no Python per parameter; measured at GPT-2's 148 tensors on the CPU, a Python hook adds
0.7-2.3 us per parameter to every backward); without it, or while compiled autograd is
configured (``torch._dynamo.config.compiled_autograd``, which traces Python hooks and
not this one; read at each hand-out), a Python post-accumulate-grad hook.  The engine
calls :meth:`Watcher.watch` at every hand-out of views (before a sample's backward
passes); a call finds the hooks in place and does nothing (about 10 us for 148
parameters), or puts back one that other code displaced.  A byte left 0 means "read the
view": where a hook did not run, the view is read instead, and only a gradient that is
exactly zero everywhere is then taken for none.  That happens under compiled autograd
entered without the config set at the hand-out (its context manager, or the config
patched around the backward alone), and, until the next hand-out, in the backward passes
after a parameter's first Python post-accumulate-grad hook was registered between a
hand-out and them (torch's registration takes the C++ hook's slot; the next ``watch``
wraps it).
"""
from __future__ import annotations

import ctypes
import itertools
import sys
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

_owners = itertools.count(1)


def _cpp_watch():
    """``poco_kernels._C.watch`` when the extension is usable, else None."""
    from ..kernels import cpp_status
    if cpp_status() is not None:
        return None
    try:
        from .._C import watch
    except ImportError:                       # (an extension built before it)
        return None
    return watch


def _compiled_autograd() -> bool:
    """Compiled autograd is configured (it runs Python hooks, not the C++ one)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return False
    config = dynamo.config
    if _ENTRY[0] is not config:
        _ENTRY[:] = [config, *_unset_entry(config)]
    _, entry, unset = _ENTRY
    if entry is not None and entry.user_override.get() is unset:
        return bool(entry.default)            # (never set: torch's getattr, 2 us, says so)
    return bool(getattr(config, "compiled_autograd", False))


#: the config module last read, its ``compiled_autograd`` entry (or None) and torch's
#: "never set" sentinel
_ENTRY: list = [None, None, None]


def _unset_entry(config) -> tuple:
    """``(entry, sentinel)``: the config's entry for ``compiled_autograd`` where only a
    user's setting (its ``user_override``, torch's sentinel while never set) can make its
    value other than its default: no alias, environment or justknob value, not hidden;
    else ``(None, None)`` (read by ``getattr``, as torch's own code reads it)."""
    try:
        from torch.utils import _config_module as cm
        e = config._config["compiled_autograd"]
        unset = cm._UNSET_SENTINEL
        if (e.alias is None and e.env_value_force is unset and e.env_value_default is unset
                and e.justknob is None and not e.hide and e.user_override.get() is unset):
            return e, unset
    except Exception:                         # (another torch's config module)
        pass
    return None, None


class Presence:
    """The bytes of one bucket's parameters: ``clear`` before a backward, ``all`` /
    ``reached(i)`` after (C-speed reads of the byte array, no torch op)."""

    __slots__ = ("flags", "addr", "n", "mem", "bytes", "zeros", "__weakref__")

    def __init__(self, n: int):
        self.flags = torch.zeros(max(n, 1), dtype=torch.uint8)     # (its storage: the hooks')
        self.n = n
        self.addr = self.flags.data_ptr()
        self.mem = (ctypes.c_ubyte * max(n, 1)).from_address(self.addr)
        #: the same bytes as a memoryview (slice assignment and ``tobytes``: a memcpy,
        #: about a tenth of a ctypes call's cost)
        self.bytes = memoryview(self.mem).cast("B")[:n]
        self.zeros = bytes(n)

    def clear(self) -> None:
        self.bytes[:] = self.zeros

    def all(self) -> bool:
        """Every parameter was reached."""
        return b"\0" not in self.bytes.tobytes()

    def reached(self, i: int) -> bool:
        return self.mem[i] != 0

    def mark(self, i: int) -> None:
        self.mem[i] = 1


class Watcher:
    """Installs the hooks of an engine's buckets (re-pointing a parameter's hook when a
    new layout moves it, never stacking them)."""

    def __init__(self):
        self.owner = next(_owners)
        self._op = _cpp_watch()
        #: the Python hooks' targets: parameter -> (its bucket's Presence, its index)
        self._where = WeakIdKeyDictionary()
        #: parameter -> the handle of its Python hook
        self._hooked = WeakIdKeyDictionary()

    def watch(self, params, presence: Presence, in_place: bool = False) -> None:
        """Hooks on ``params`` (a bucket's, in order; those that do not require grad are
        skipped) that mark ``presence``: C++ ones, or Python ones without the extension
        and while compiled autograd is configured (removed once it is not).
        ``in_place``: a :func:`~poco_kernels._sweeps.scan` found every C++ hook in place
        (nothing to do unless Python hooks are to be put in or taken out)."""
        if self._op is not None and not _compiled_autograd():
            if in_place and not self._hooked:
                return
            if self._hooked:
                for p in params:
                    handle = self._hooked.pop(p, None)
                    if handle is not None:
                        handle.remove()
            self._op(params, presence.flags, self.owner)
            return
        ref = weakref.ref(presence)
        for i, p in enumerate(params):
            if not p.requires_grad:
                continue
            self._where[p] = (ref, i)
            if p not in self._hooked:
                self._hooked[p] = p.register_post_accumulate_grad_hook(
                    self._python_hook(weakref.ref(self)))

    @staticmethod
    def _python_hook(me):
        def hook(param):
            w = me()
            if w is not None:
                loc = w._where.get(param)
                if loc is not None and loc[0]() is not None:
                    loc[0]().mark(loc[1])
        return hook
