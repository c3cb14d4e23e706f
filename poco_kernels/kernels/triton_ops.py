"""Host wrappers of :mod:`poco_kernels.kernels.triton_kernels`: launch, and registration as
torch custom ops.

Each wrapper launches one kernel over a flat buffer: over its padded length when every
buffer of the launch is padded (:func:`poco_kernels._layout.launch_numel`: the length is
then divisible by 16 and the loads and stores vectorised), else over its exact length.  In eager mode the kernel is launched
directly (no dispatcher overhead); while ``torch.compile`` traces, the same call goes
through a ``poco_kernels::*`` custom op that declares what it mutates, so a compiled
training step keeps the optimizer kernels as opaque nodes instead of breaking the graph.
Nothing here synchronises with the host, and nothing allocates when the hyperparameters
come as rows (the optimizers' case; a record is turned into a new row per call).
"""
from __future__ import annotations

import array
import inspect

from typing import List, Optional

import torch
import triton
from torch import Tensor

from .._layout import launch_numel
from . import triton_kernels as tk
from .triton_launch import Launcher
from .interface import (RefreshFlags, RefreshHyper, SampleHyper, StepFlags, StepHyper,
                        StepStreams, hyper_row, require)

__all__ = ["sample", "accumulate", "check", "fold_ge", "step", "refresh", "finish", "randn",
           "Tiles", "sample_shards", "accumulate_shards", "fold_ge_shards", "step_shards",
           "refresh_shards"]


def _grid(n: int):
    return (triton.cdiv(n, tk.BLOCK),)


class Tiles:
    """The local shards of a sharded bucket as the tiles of one launch (the kernels'
    ``TILED``, :mod:`~poco_kernels.kernels.triton_kernels`): ``pieces``, per shard with
    elements, ``(lo, n, noise_offset, address)``: its first element in the bucket's flat
    buffers, its length, its place in the unsharded bucket less ``lo``, and the address of
    its own tensor (the parameter's local shard, or its gradient; 0 where the kernel
    reads none).  ``table`` (int64, five per shard: those four and its first program) and
    ``chunks`` (int32, the shard of each program) live on ``device``; ``count`` programs
    of ``BLOCK`` elements each."""

    __slots__ = ("table", "chunks", "count")

    def __init__(self, pieces, device):
        rows, sizes, first = [], [], 0
        for lo, n, off, addr in pieces:
            k = -(-n // tk.BLOCK)
            rows.append((lo, n, off, addr, first))
            sizes.append(k)
            first += k
        self.count = first
        table = torch.tensor(rows, dtype=torch.int64).reshape(-1, 5)
        chunks = torch.repeat_interleave(torch.arange(len(rows), dtype=torch.int32),
                                         torch.tensor(sizes, dtype=torch.int64))
        self.table = _to_device(table, device)
        self.chunks = _to_device(chunks, device)

    def readdress(self, addresses) -> None:
        """Point the rows at new tensors of the same sizes (``addresses``, one per row, in
        order): one asynchronous copy into the table, ordered after the launches already
        queued on the stream that read it."""
        col = torch.frombuffer(array.array("q", addresses), dtype=torch.int64)
        self.table[:, 3].copy_(_to_device(col, self.table.device))


def _to_device(t: Tensor, device) -> Tensor:
    """``t`` (a new CPU tensor) on ``device``: on CUDA from pinned memory, asynchronously
    (a pageable copy would wait for the queued kernels; torch's host allocator keeps a
    pinned block until its copy is done)."""
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _geometry(n: int, offset: int, tiles: Optional[Tiles], dummy: Tensor):
    """A launch's grid, its tile arguments (``tiles_ptr``, ``chunks_ptr``: ``dummy`` when
    untiled) and its ``SHARD``/``TILED`` constexprs."""
    if tiles is None:
        return _grid(n), (dummy, dummy), dict(SHARD=_shard(offset), TILED=False)
    return (tiles.count,), (tiles.table, tiles.chunks), dict(SHARD=2, TILED=True)


def _shard(offset: int) -> int:
    """The kernels' ``SHARD``: 0 for a whole bucket (offset 0), 1 for a shard at a multiple
    of 4, 2 for another shard (``triton_kernels._noise``)."""
    return 0 if offset == 0 else (1 if offset % 4 == 0 else 2)


def _compiling() -> bool:
    return torch.compiler.is_compiling()


# --------------------------------------------------------------------------- launches
class _Launchers:
    """Each kernel's :class:`~poco_kernels.kernels.triton_launch.Launcher`: on a GPU, the
    compiled kernel cached per specialisation and launched without the JIT's binding."""

    def __init__(self):
        self.sample = Launcher(tk, "sample_kernel")
        self.accumulate = Launcher(tk, "accumulate_kernel")
        self.check = Launcher(tk, "check_kernel")
        self.fold_ge = Launcher(tk, "fold_ge_kernel")
        self.step = Launcher(tk, "step_kernel")
        self.refresh = Launcher(tk, "refresh_kernel")
        self.finish = Launcher(tk, "finish_kernel")
        self.randn = Launcher(tk, "randn_kernel")


_L = _Launchers()
#: every launch: no floating-point contraction (the C++ kernels' arithmetic, bit for bit;
#: ``triton_kernels``), and the warps of a block
_OPTS = dict(num_warps=tk.NUM_WARPS, enable_fp_fusion=False)


def _sample(param: Tensor, centre: Tensor, mean: Tensor, h: Optional[Tensor],
            sigma: Optional[Tensor], ctl: Tensor, seed: int, noise: int, stream: int,
            counter_slot: int, hp, sign: float, sigma_mode: int, sync: bool,
            offset: int = 0, tiles: Optional[Tiles] = None) -> None:
    n = 0 if tiles is not None else launch_numel(param.numel(), param, centre, mean, h, sigma)
    if (n if tiles is None else tiles.count) == 0:
        return
    grid, targs, tc = _geometry(n, offset, tiles, ctl)
    row = hyper_row(hp, SampleHyper, param.device)
    _L.sample[grid](
        param, centre, mean, h if h is not None else mean, sigma if sigma is not None else mean,
        ctl, *targs, row, n, offset, seed, stream, counter_slot, sign,
        SIGMA_MODE=sigma_mode, SYNC=sync, NOISE=noise, **tc, BLOCK=tk.BLOCK, **_OPTS)


def _accumulate(grad: Tensor, acc_g: Tensor, acc_ge: Optional[Tensor], ctl: Tensor, seed: int,
                noise: int, stream: int, counter_slot: int, sign: float, first: bool,
                ge: bool, offset: int = 0, tiles: Optional[Tiles] = None) -> None:
    n = 0 if tiles is not None else launch_numel(grad.numel(), grad, acc_g, acc_ge)
    if (n if tiles is None else tiles.count) == 0:
        return
    grid, targs, tc = _geometry(n, offset, tiles, ctl)
    _L.accumulate[grid](
        grad, acc_g, acc_ge if acc_ge is not None else acc_g, ctl, *targs, n, offset, seed,
        stream, counter_slot, sign, FIRST=first, GE=ge, NOISE=noise, **tc,
        BLOCK=tk.BLOCK, **_OPTS)


def _check(grad: Tensor, ctl: Tensor) -> None:
    n = launch_numel(grad.numel(), grad)
    if n == 0:
        return
    _L.check[_grid(n)](grad, ctl, n, BLOCK=tk.BLOCK, **_OPTS)


def _fold_ge(acc_g: Tensor, acc_ge: Tensor, ctl: Tensor, seed: int, noise: int, stream: int,
             counter_slot: int, sign: float, offset: int = 0,
             tiles: Optional[Tiles] = None) -> None:
    n = 0 if tiles is not None else launch_numel(acc_g.numel(), acc_g, acc_ge)
    if (n if tiles is None else tiles.count) == 0:
        return
    grid, targs, tc = _geometry(n, offset, tiles, ctl)
    _L.fold_ge[grid](acc_g, acc_ge, ctl, *targs, n, offset, seed, stream, counter_slot,
                     sign, NOISE=noise, **tc, BLOCK=tk.BLOCK, **_OPTS)


def _step(mean: Tensor, param: Tensor, s1: Optional[Tensor], s2: Optional[Tensor],
          g_in: Tensor, ge_in: Optional[Tensor], g_at_out: Optional[Tensor],
          ge_at_out: Optional[Tensor],
          g_out: Optional[Tensor], h_out: Optional[Tensor], m_out: Optional[Tensor],
          sigma_out: Optional[Tensor], ctl: Tensor, found_inf: Optional[Tensor],
          grad_scale: Optional[Tensor], streams: StepStreams, hp, flags: StepFlags,
          offset: int = 0, tiles: Optional[Tiles] = None) -> None:
    n = 0 if tiles is not None else launch_numel(mean.numel(), mean, param, s1, s2, g_in, ge_in, g_at_out,
                                     ge_at_out, g_out, h_out, m_out, sigma_out)
    if (n if tiles is None else tiles.count) == 0:
        return
    grid, targs, tc = _geometry(n, offset, tiles, ctl)
    d = mean
    row = hyper_row(hp, StepHyper, mean.device)
    _L.step[grid](
        mean, param, s1 if s1 is not None else d, s2 if s2 is not None else d,
        g_in, ge_in if ge_in is not None else d, g_at_out if g_at_out is not None else d,
        ge_at_out if ge_at_out is not None else d, g_out if g_out is not None else d,
        h_out if h_out is not None else d, m_out if m_out is not None else d,
        sigma_out if sigma_out is not None else d,
        ctl, found_inf if found_inf is not None else ctl,
        grad_scale if grad_scale is not None else ctl, *targs, row,
        n, offset, streams.seed, streams.stream, streams.stream_at_out,
        **flags.constexprs(), NOISE=streams.noise, **tc,
        HAS_FOUND_INF=found_inf is not None, HAS_SCALE=grad_scale is not None,
        BLOCK=tk.BLOCK, **_OPTS)


def _refresh(mean: Tensor, h: Optional[Tensor], acc_g: Tensor, acc_ge: Optional[Tensor],
             g_out: Tensor, h_out: Optional[Tensor], m_out: Tensor, sigma_out: Optional[Tensor],
             ctl: Tensor, found_inf: Optional[Tensor], grad_scale: Optional[Tensor], seed: int,
             noise: int, stream: int, hp, flags: RefreshFlags, offset: int = 0,
             tiles: Optional[Tiles] = None) -> None:
    n = 0 if tiles is not None else launch_numel(mean.numel(), mean, h, acc_g, acc_ge, g_out, h_out,
                                     m_out, sigma_out)
    if (n if tiles is None else tiles.count) == 0:
        return
    grid, targs, tc = _geometry(n, offset, tiles, ctl)
    d = mean
    row = hyper_row(hp, RefreshHyper, mean.device)
    _L.refresh[grid](
        mean, h if h is not None else d, acc_g, acc_ge if acc_ge is not None else d, g_out,
        h_out if h_out is not None else d, m_out, sigma_out if sigma_out is not None else d,
        ctl, found_inf if found_inf is not None else ctl,
        grad_scale if grad_scale is not None else ctl, *targs, row,
        n, offset, seed, stream, **flags.constexprs(), NOISE=noise, **tc,
        HAS_FOUND_INF=found_inf is not None, HAS_SCALE=grad_scale is not None,
        BLOCK=tk.BLOCK, **_OPTS)


def _finish(ctl: Tensor, found_inf: Optional[Tensor], slot: int) -> None:
    _L.finish[(1,)](ctl, found_inf if found_inf is not None else ctl, slot,
                    HAS_FOUND_INF=found_inf is not None, num_warps=1, enable_fp_fusion=False)


def randn(out: Tensor, seed: int, counter: int, stream: int, offset: int = 0,
          version: int = 2) -> Tensor:
    """``out[j]`` = the normal of element ``offset + j`` of stream ``(seed, counter,
    stream)``: :func:`poco_kernels.noise.randn` (of that ``version``) by the kernels' own
    noise code, the C++ kernels' ``randn``.  ``out``: a contiguous float32 tensor."""
    n = out.numel()
    if n:
        _L.randn[_grid(n)](out, n, offset, seed, counter, stream, NOISE=version,
                           SHARD=_shard(offset), BLOCK=tk.BLOCK, **_OPTS)
    return out


# --------------------------------------------------------------------------- custom ops
@torch.library.custom_op("poco_kernels::sample", mutates_args=("param", "mean"))
def _sample_op(param: Tensor, centre: Tensor, mean: Tensor, h: Optional[Tensor],
               sigma: Optional[Tensor], ctl: Tensor, seed: int, noise: int, stream: int,
               counter_slot: int, hp: Tensor, sign: float, sigma_mode: int, sync: bool,
               offset: int = 0) -> None:
    _sample(param, centre, mean, h, sigma, ctl, seed, noise, stream, counter_slot, hp, sign,
            sigma_mode, sync, offset)


@torch.library.custom_op("poco_kernels::accumulate", mutates_args=("acc_g", "acc_ge", "ctl"))
def _accumulate_op(grad: Tensor, acc_g: Tensor, acc_ge: Optional[Tensor], ctl: Tensor,
                   seed: int, noise: int, stream: int, counter_slot: int, sign: float,
                   first: bool, ge: bool, offset: int = 0) -> None:
    _accumulate(grad, acc_g, acc_ge, ctl, seed, noise, stream, counter_slot, sign, first, ge,
                offset)


@torch.library.custom_op("poco_kernels::check", mutates_args=("ctl",))
def _check_op(grad: Tensor, ctl: Tensor) -> None:
    _check(grad, ctl)


@torch.library.custom_op("poco_kernels::fold_ge", mutates_args=("acc_ge",))
def _fold_ge_op(acc_g: Tensor, acc_ge: Tensor, ctl: Tensor, seed: int, noise: int,
                stream: int, counter_slot: int, sign: float, offset: int = 0) -> None:
    _fold_ge(acc_g, acc_ge, ctl, seed, noise, stream, counter_slot, sign, offset)


@torch.library.custom_op("poco_kernels::step", mutates_args=("mean", "param", "s1", "s2"))
def _step_op(mean: Tensor, param: Tensor, s1: Optional[Tensor], s2: Optional[Tensor],
             g_in: Tensor, ge_in: Optional[Tensor], g_at_out: Optional[Tensor],
             ge_at_out: Optional[Tensor], g_out: Optional[Tensor], h_out: Optional[Tensor],
             m_out: Optional[Tensor], sigma_out: Optional[Tensor], ctl: Tensor,
             found_inf: Optional[Tensor], grad_scale: Optional[Tensor], streams: List[int],
             hp: Tensor, flags: List[int], offset: int = 0) -> None:
    _step(mean, param, s1, s2, g_in, ge_in, g_at_out, ge_at_out, g_out, h_out, m_out, sigma_out,
          ctl, found_inf, grad_scale, StepStreams(*streams), hp,
          StepFlags(flags[0], *(bool(v) for v in flags[1:])), offset)


@torch.library.custom_op("poco_kernels::refresh",
                         mutates_args=("g_out", "h_out", "m_out", "sigma_out"))
def _refresh_op(mean: Tensor, h: Optional[Tensor], acc_g: Tensor, acc_ge: Optional[Tensor],
                g_out: Tensor, h_out: Optional[Tensor], m_out: Tensor,
                sigma_out: Optional[Tensor], ctl: Tensor, found_inf: Optional[Tensor],
                grad_scale: Optional[Tensor], seed: int, noise: int, stream: int,
                hp: Tensor, flags: List[int], offset: int = 0) -> None:
    _refresh(mean, h, acc_g, acc_ge, g_out, h_out, m_out, sigma_out, ctl, found_inf,
             grad_scale, seed, noise, stream, hp,
             RefreshFlags(flags[0], *(bool(v) for v in flags[1:])), offset)


@torch.library.custom_op("poco_kernels::finish", mutates_args=("ctl",))
def _finish_op(ctl: Tensor, found_inf: Optional[Tensor], slot: int) -> None:
    _finish(ctl, found_inf, slot)


for _op in (_sample_op, _accumulate_op, _check_op, _fold_ge_op, _step_op, _refresh_op, _finish_op):
    _op.register_fake(lambda *args, **kwargs: None)


def _dispatch(direct, op):
    def call(*args):
        return (op if _compiling() else direct)(*args)
    call.__name__ = direct.__name__.lstrip("_")
    call.__doc__ = (f"Launch ``{call.__name__}`` (directly in eager mode, through the custom op "
                    f"``{op._qualname}`` under torch.compile).")
    return call


def _record_args(direct, op, records, rows):
    """Like :func:`_dispatch`, for a launch that takes typed records (checked here): under
    torch.compile they travel through the custom op as lists of numbers.  ``records``:
    parameter name -> record class; ``rows``: the parameters that are hyperparameter rows
    (name -> record class: a record, or its float64 row: made here,
    :func:`~poco_kernels.kernels.interface.hyper_row`, on the device of the first
    argument).  Names are looked up in ``direct``'s signature, never by position."""
    names = list(inspect.signature(direct).parameters)
    records = {names.index(k): (cls, k) for k, cls in records.items()}
    rows = {names.index(k): cls for k, cls in rows.items()}

    def call(*args):
        args = list(args)
        for i, (cls, what) in records.items():
            require(args[i], cls, what)
        for i, cls in rows.items():
            args[i] = hyper_row(args[i], cls, args[0].device)
        if not _compiling():
            return direct(*args)
        for i in records:
            args[i] = [int(v) if isinstance(v, bool) else v for v in args[i]]
        return op(*args)
    call.__name__ = direct.__name__.lstrip("_")
    call.__doc__ = (f"Launch ``{call.__name__}`` (directly in eager mode, through the custom op "
                    f"``{op._qualname}`` under torch.compile); records of "
                    ":mod:`~poco_kernels.kernels.interface` by name, hyperparameters as a "
                    "record or its row.")
    return call


sample = _record_args(_sample, _sample_op, {}, {"hp": SampleHyper})
accumulate = _dispatch(_accumulate, _accumulate_op)
check = _dispatch(_check, _check_op)
fold_ge = _dispatch(_fold_ge, _fold_ge_op)
step = _record_args(_step, _step_op, {"streams": StepStreams, "flags": StepFlags},
                    {"hp": StepHyper})
refresh = _record_args(_refresh, _refresh_op, {"flags": RefreshFlags}, {"hp": RefreshHyper})
finish = _dispatch(_finish, _finish_op)


def prepare(name: str, args: tuple):     # (a step plan's call: the launchers keep the rest)
    return globals()[name], tuple(args)


# --------------------------------------------------------------------------- one launch per bucket
# A sharded bucket's operation in one launch over all its local shards (eager only: the
# engine launches per shard while torch.compile traces).  The arguments are the per-launch
# functions' with the bucket's whole flat buffers, ``param`` (or ``grad``) any tensor of
# the shards' dtype (the shards themselves are in ``tiles``), and ``tiles`` for ``offset``.
def sample_shards(tiles: Tiles, param: Tensor, centre: Tensor, mean: Tensor,
                  h: Optional[Tensor], sigma: Optional[Tensor], ctl: Tensor, seed: int,
                  noise: int, stream: int, counter_slot: int, hp, sign: float,
                  sigma_mode: int, sync: bool) -> None:
    """:func:`sample` over every shard of ``tiles`` (the parameters' local shards)."""
    _sample(param, centre, mean, h, sigma, ctl, seed, noise, stream, counter_slot, hp, sign,
            sigma_mode, sync, 0, tiles)


def accumulate_shards(tiles: Tiles, grad: Tensor, acc_g: Tensor, acc_ge: Optional[Tensor],
                      ctl: Tensor, seed: int, noise: int, stream: int, counter_slot: int,
                      sign: float, first: bool, ge: bool) -> None:
    """:func:`accumulate` of every shard's gradient in ``tiles``."""
    _accumulate(grad, acc_g, acc_ge, ctl, seed, noise, stream, counter_slot, sign, first, ge,
                0, tiles)


def fold_ge_shards(tiles: Tiles, acc_g: Tensor, acc_ge: Tensor, ctl: Tensor, seed: int,
                   noise: int, stream: int, counter_slot: int, sign: float) -> None:
    """:func:`fold_ge` over every shard of ``tiles``."""
    _fold_ge(acc_g, acc_ge, ctl, seed, noise, stream, counter_slot, sign, 0, tiles)


def step_shards(tiles: Tiles, mean: Tensor, param: Tensor, s1: Optional[Tensor],
                s2: Optional[Tensor], g_in: Tensor, ge_in: Optional[Tensor],
                g_at_out: Optional[Tensor], ge_at_out: Optional[Tensor],
                g_out: Optional[Tensor], h_out: Optional[Tensor], m_out: Optional[Tensor],
                sigma_out: Optional[Tensor], ctl: Tensor, found_inf: Optional[Tensor],
                grad_scale: Optional[Tensor], streams: StepStreams, hp,
                flags: StepFlags) -> None:
    """:func:`step` over every shard of ``tiles`` (the parameters' local shards)."""
    require(streams, StepStreams, "streams")
    require(flags, StepFlags, "flags")
    _step(mean, param, s1, s2, g_in, ge_in, g_at_out, ge_at_out, g_out, h_out, m_out, sigma_out,
          ctl, found_inf, grad_scale, streams, hp, flags, 0, tiles)


def refresh_shards(tiles: Tiles, mean: Tensor, h: Optional[Tensor], acc_g: Tensor,
                   acc_ge: Optional[Tensor], g_out: Tensor, h_out: Optional[Tensor],
                   m_out: Tensor, sigma_out: Optional[Tensor], ctl: Tensor,
                   found_inf: Optional[Tensor], grad_scale: Optional[Tensor], seed: int,
                   noise: int, stream: int, hp, flags: RefreshFlags) -> None:
    """:func:`refresh` over every shard of ``tiles``."""
    require(flags, RefreshFlags, "flags")
    _refresh(mean, h, acc_g, acc_ge, g_out, h_out, m_out, sigma_out, ctl, found_inf,
             grad_scale, seed, noise, stream, hp, flags, 0, tiles)
