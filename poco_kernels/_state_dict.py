"""The state dict of the family (``state_dict``/``load_state_dict``: every entry checked
before anything is loaded, so a bad one loses nothing), and copying and pickling an
optimizer (``copy.deepcopy``, ``pickle``), which go through it."""
from __future__ import annotations

import copy

from collections import OrderedDict
from typing import Any, Callable, Dict, Set

import torch
from torch import Tensor

from . import noise as _noise
from ._layout import as_local, as_saved, is_sharded
from ._protocol import Pending
from ._transaction import outside_dynamo, parking, reading
from ._validation import check


#: layout of the ``poco`` entry of the state dict (absent in the first layout: read as 1)
STATE_FORMAT = 2


class StateDictMixin:
    """``state_dict``, ``load_state_dict`` and their validation; ``__getstate__`` and
    ``__setstate__`` (a copy is the constructor's configuration plus the state dict)."""

    # ------------------------------------------------------------------ copy and pickle
    #: the attributes that __setstate__ rebuilds (the other public ones are copied)
    _REBUILT = frozenset({"defaults", "state", "param_groups", "seed", "backend", "check_finite",
                          "grad_views", "sample_ahead", "state_dtype", "outer_dtype",
                          "noise_version"})

    def __getstate__(self) -> Dict[str, Any]:
        """``copy.deepcopy`` and pickle: the parameter groups (with the parameters), the
        constructor's configuration and the state dict; :meth:`__setstate__` builds the
        optimizer again from them (buckets, backend, flat buffers: the copy's parameters
        become views of its own buffers) and loads the state dict, so the copy continues
        as the original would.  Hooks are not copied (as in ``torch.optim``); refused
        while a sample is in the parameters."""
        if self._active is not None:
            raise RuntimeError("copying or pickling the optimizer while a sample is in the "
                               "parameters: call restore() first")
        # the state dict without the user's state_dict hooks (a copy is not a checkpoint)
        hooks = (self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks)
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        try:
            sd = self.state_dict()
        finally:
            self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks = hooks
        backend, check_finite = self._requested
        if self.check_finite != (self._runner.check_finite_default if check_finite is None
                                 else check_finite):
            check_finite = self.check_finite        # set by hand since
        grad_views = self.grad_views             # (None: the copy's backend decides)
        if self._grad_views_requested is None and grad_views == self._runner.grad_views_default:
            grad_views = None
        return {"poco_copy": 1, "param_groups": self.param_groups, "defaults": self.defaults,
                "seed": self.seed, "backend": backend, "check_finite": check_finite,
                "grad_views": grad_views, "sample_ahead": self.sample_ahead,
                "state_dtype": self.state_dtype, "outer_dtype": self.outer_dtype,
                "ahead": not self._runner.params_hold_mean, "state_dict": sd, "skipped": self._read_counters()[2],
                "attributes": {k: v for k, v in self.__dict__.items()
                               if not k.startswith("_") and k not in self._REBUILT}}

    @parking
    def __setstate__(self, state: Dict[str, Any]) -> None:
        if "poco_copy" not in state:            # torch.optim's layout: nothing to rebuild from
            super().__setstate__(state)
            return
        groups = state["param_groups"]
        values = [p.detach().clone() for g in groups for p in g["params"]]
        # the hyperparameters only: the state dict brings back every key of the groups
        bare = [{"params": g["params"], **{k: g[k] for k in state["defaults"] if k in g}}
                for g in groups]
        self._initialise(bare, state["defaults"], seed=state["seed"],
                         backend=state["backend"], check_finite=state["check_finite"],
                         grad_views=state.get("grad_views", True),
                         sample_ahead=state.get("sample_ahead", False),
                         state_dtype=state.get("state_dtype"),
                         outer_dtype=state.get("outer_dtype"))
        self._plan_load(state["state_dict"])()
        with torch.no_grad():                   # the parameters as they were (the truth)
            for p, v in zip((p for g in self.param_groups for p in g["params"]), values):
                p.copy_(v)
        self._runner.set_skipped(state["skipped"])
        self.__dict__.update(state["attributes"])
        if state.get("ahead"):   # the original's parameters held its next sample: so do these
            self._runner.restore()
            self._runner.prefetch()

    # ------------------------------------------------------------------ state dict
    @outside_dynamo
    @reading
    def state_dict(self) -> Dict[str, Any]:
        """``torch.optim``'s state dict (``state`` keyed by parameter index, ``param_groups``)
        plus a ``poco`` entry: counters, seed, pending sums, per-bucket buffers.  Runs the
        hooks of ``register_state_dict_pre_hook``/``post_hook`` (a post hook sees, and may
        replace, the whole dict)."""
        if self._active is not None:
            raise RuntimeError("state_dict() while a sample is in the parameters: call restore() first")
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        self._check_trainable()           # (the layout of the current requires_grad flags)
        self._sync_mean()                 # the parameters are the truth (fused: re-linked)
        self._runner.prepare_state_dict()
        self._read_counters()
        sd = self._packed_state()
        extra = {}
        for b in self._buckets:       # buffers that are not per-parameter (VON-PoCo's S)
            for name, buf in b.buffers.items():
                if not b.is_flat_buffer(buf):
                    extra[f"{b.index}/{name}"] = buf
        meta = {"format": STATE_FORMAT, "noise": self.noise_version, "step": self._step,
                "refreshes": self._refreshes, "seed": self.seed,
                "optimizer": type(self).__name__, "awaiting_refresh": sorted(self._awaiting)}
        sd["poco"] = {**meta, "pending": self._pending.to_dict(), "bucket_buffers": extra}
        # torch.distributed.checkpoint keeps only 'state' and 'param_groups': each group
        # carries the counters too, and whether gradients were pending or a sample drawn
        # since the last update (what it drops)
        pending = any(self._pending.count.values()) or any(self._pending.draws.values())
        for g in sd["param_groups"]:
            g["poco"] = {**meta, "pending_gradients": pending}
        params = [p for g in self._groups for p in g["params"]]
        for i, p in enumerate(params):                # sharded: DTensors, as p is
            if is_sharded(p) and isinstance(sd["state"].get(i), dict):
                sd["state"][i] = {k: as_saved(v, p) for k, v in sd["state"][i].items()}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def _packed_state(self) -> Dict[str, Any]:
        """torch.optim's layout: parameters replaced by their index over all groups."""
        index: Dict[int, int] = {}
        groups = []
        for g in self._groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            for p in g["params"]:
                index.setdefault(id(p), len(index))
            packed["params"] = [index[id(p)] for p in g["params"]]
            groups.append(packed)
        state = {(index[id(k)] if isinstance(k, Tensor) else k): v  # (a hook's own keys)
                 for k, v in self.state.items()}
        return {"state": state, "param_groups": groups}

    @outside_dynamo
    @parking
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state dict of the same optimizer class over the same parameters (or one
        this class can continue: :meth:`_loadable_from`).  The hooks of
        ``register_load_state_dict_pre_hook`` run first (on a shallow copy; one may return
        a replacement) and ``post_hook`` last; the whole dict is validated (keys, types,
        ranges, shapes, dtypes, finiteness, format and noise versions) before anything
        changes."""
        if self._active is not None:
            raise RuntimeError("load_state_dict() while a sample is in the parameters: call "
                               "restore() first")
        if isinstance(state_dict, dict):
            state_dict = state_dict.copy()      # shallow, as torch.optim
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._runner.check_layout()      # (fused: re-links parameters taken off its buffers)
        self._check_trainable()
        commit = self._plan_load(state_dict)
        commit()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _plan_load(self, sd: Dict[str, Any]) -> Callable[[], None]:
        """Validate ``sd`` and return the function that commits it (which cannot fail)."""
        def is_int(v, lo, hi):
            return isinstance(v, int) and not isinstance(v, bool) and lo <= v < hi

        check(isinstance(sd, dict) and {"state", "param_groups"} <= set(sd),
              "not a poco_kernels optimizer state dict (missing 'state' or 'param_groups')")
        saved_state, saved_groups = sd["state"], sd["param_groups"]
        poco = sd["poco"] if "poco" in sd else self._poco_of_groups(saved_groups)
        check(isinstance(poco, dict), "state dict: 'poco' is not a dict")
        check(isinstance(saved_state, dict), "state dict: 'state' is not a dict")
        check(isinstance(saved_groups, (list, tuple)), "state dict: 'param_groups' is not a list")
        missing = [k for k in ("optimizer", "step", "refreshes", "seed", "pending")
                   if k not in poco]
        check(not missing, f"state dict: 'poco' lacks {', '.join(map(repr, missing))}")
        src = poco["optimizer"]
        fill = src in self._continues_from     # a subset of this class's state
        check(src == type(self).__name__ or src in self._loads_from or fill,
              f"state dict is for {src!r}, not {type(self).__name__!r}"
              + (f" (it loads those of {', '.join(self._loads_from + self._continues_from)})"
                 if self._loads_from or self._continues_from else ""))
        fmt = poco.get("format", 1)
        check(is_int(fmt, 1, STATE_FORMAT + 1),
              f"state dict format {fmt!r} is not one this version reads (1..{STATE_FORMAT})")
        nv = poco.get("noise", 1)       # (written before the key existed: version 1)
        check(type(nv) is int and nv in _noise.STREAM_VERSIONS,
              f"state dict was written with noise stream version {nv!r}; this version of "
              f"poco_kernels draws versions {_noise.STREAM_VERSIONS} (the run would continue "
              "with other samples than it was drawing)")
        for key in ("step", "refreshes"):
            check(is_int(poco[key], 0, _noise.MAX_COUNTER),
                  f"state dict: {key} must be an int in [0, 2**32), got {poco[key]!r}")
        check(not fill or poco["refreshes"] == 0,
              f"state dict: an {src} state dict has no refreshes, got {poco['refreshes']!r}")
        check(is_int(poco["seed"], 0, 2 ** 63),
              f"state dict: seed must be an int in [0, 2**63), got {poco['seed']!r}")
        groups = self._groups
        check(len(groups) == len(saved_groups),
              f"state dict has {len(saved_groups)} parameter groups, the optimizer {len(groups)}")
        awaiting = poco.get("awaiting_refresh", [])
        check(isinstance(awaiting, (list, tuple, set))
              and all(is_int(i, 0, len(groups)) for i in awaiting),
              f"state dict: awaiting_refresh must list group indices, got {awaiting!r}")
        check(not awaiting or poco["refreshes"] > 0,
              "state dict: groups awaiting a refresh before any refresh")
        # ---- groups
        saved_index, seen, new_groups = {}, set(), []
        for gi, (g, sg) in enumerate(zip(groups, saved_groups)):
            check(isinstance(sg, dict) and isinstance(sg.get("params"), (list, tuple)),
                  f"state dict: param group {gi} is not a dict with a 'params' list")
            check(len(g["params"]) == len(sg["params"]),
                  f"param group {gi}: state dict has {len(sg['params'])} parameters, the "
                  f"optimizer {len(g['params'])}")
            for i, p in zip(sg["params"], g["params"]):
                # (ints; names where torch.distributed.checkpoint's set_state_dict loads)
                check(isinstance(i, (int, str)) and not isinstance(i, bool) and i not in seen,
                      f"param group {gi}: parameter ids must be distinct ints or names, got "
                      f"{i!r}")
                seen.add(i)
                saved_index[id(p)] = i
            # (from a class with fewer hyperparameters, this optimizer's values stay)
            # (a copy, as torch.optim's: a tensor lr is this optimizer's own, not the
            # saved dict's, which a scheduler of the saving optimizer may write in place)
            sg = copy.deepcopy({k: v for k, v in sg.items() if k not in ("poco", "params")})
            merged = {**(g if fill else {}), **sg, "params": g["params"]}
            self._check_group(merged, gi)
            new_groups.append({k: v for k, v in merged.items() if k != "params"})
        # ---- per-parameter buffers: names, shapes, dtypes, values
        copies, lazy, drop, fresh = [], {}, set(), []

        def tensor_for(t, like: Tensor, what: str) -> Tensor:
            check(isinstance(t, Tensor), f"{what} is not a tensor")
            check(tuple(t.shape) == tuple(like.shape),
                  f"{what} has shape {tuple(t.shape)}, expected {tuple(like.shape)}")
            check(t.is_floating_point(), f"{what} has dtype {t.dtype}, expected a float dtype")
            check(bool(torch.isfinite(t).all()), f"{what} holds non-finite values")
            out = t.detach().to(device=like.device, dtype=like.dtype, copy=True)
            check(bool(torch.isfinite(out).all()),
                  f"{what} overflows {like.dtype} (its state dtype)")
            return out

        for b in self._buckets:
            group = new_groups[b.group_index]
            saved_of = []
            for p in b.params:
                idx = saved_index[id(p)]
                saved = saved_state.get(idx)
                check(saved is not None, f"state dict has no state for parameter {idx}")
                check(isinstance(saved, dict), f"parameter {idx}: state is not a dict")
                for name in saved:
                    check(name in b.buffers or name in self.rule.lazy_buffers,
                          f"parameter {idx}: unexpected state {name!r} in the state dict")
                saved_of.append((idx, saved))
            # a buffer made at its first use (momentum) is saved for all of a bucket or none
            for name in self.rule.lazy_buffers:
                have = [name in saved for _, saved in saved_of]
                if any(have) and not all(have):
                    idx = saved_of[have.index(False)][0]
                    raise ValueError(f"parameter {idx}: state dict lacks {name!r} (other "
                                     "parameters of its group have it)")
                if all(have) and have and name not in b.buffers:
                    lazy.setdefault(b.index, set()).add(name)
                elif not any(have) and name in b.buffers:
                    drop.add((b.index, name))     # saved before its first use
            if fill:        # buffers the source class lacks start at their initial values
                init = self._initial_buffers(b, group)
                names = [n for n in init if b.is_flat_buffer(b.buffers.get(n, init[n]))
                         and not any(n in saved for _, saved in saved_of)]
                fresh += [(b.index, n, init[n]) for n in names]
            for i, (p, (idx, saved)) in enumerate(zip(b.params, saved_of)):
                views = self.state[p]
                for name in b.buffers:
                    if fill and any(f[:2] == (b.index, name) for f in fresh):
                        continue
                    if b.is_flat_buffer(b.buffers[name]) and (b.index, name) not in drop:
                        check(name in saved, f"parameter {idx}: state dict lacks {name!r}")
                for name, t in saved.items():
                    like = views.get(name)
                    if like is None:
                        like = torch.empty(b.local(i).shape, device=b.device, dtype=b.dtype)
                    what = f"parameter {idx}: {name!r}"
                    t = tensor_for(as_local(t, p, what), like, what)
                    self.rule.check_state_value(name, t, group, what)
                    copies.append((b.index, p, name, t))
        extra = poco.get("bucket_buffers", {})
        check(isinstance(extra, dict), "state dict: 'bucket_buffers' is not a dict")
        bucket_copies = []
        for b in self._buckets:
            for name, buf in b.buffers.items():
                if not b.is_flat_buffer(buf):
                    key = f"{b.index}/{name}"
                    check(key in extra, f"state dict lacks bucket buffer {key!r} of shape "
                                        f"{tuple(buf.shape)}")
                    bucket_copies.append((buf, tensor_for(extra[key], buf,
                                                          f"bucket buffer {key!r}")))
        pend = Pending.validated(poco["pending"], self._buckets)
        self._check_pending(pend, set(awaiting))
        # ---- the commit: nothing below can fail
        step, refreshes, seed = poco["step"], poco["refreshes"], poco["seed"]

        def commit() -> None:
            for bi, name in drop:
                self._buckets[bi].buffers.pop(name, None)
            for bi, names in lazy.items():
                b = self._buckets[bi]
                for name in names:
                    if name not in b.buffers:
                        b.buffers[name] = b.new_buffer()
            for b in self._buckets:
                self._expose(b)
            with torch.no_grad():
                for bi, name, init in fresh:
                    self._buckets[bi].buffers[name].copy_(init)
                for bi, p, name, src in copies:
                    self.state[p][name].copy_(src)
                for dst, src in bucket_copies:
                    dst.copy_(src)
            for g, sg in zip(groups, new_groups):
                for k in [k for k in g if k != "params" and k not in sg]:
                    del g[k]
                g.update(sg)
            self._step, self._refreshes, self._seed = step, refreshes, seed
            self._noise_version = nv
            self._awaiting = set(awaiting)
            self._pending = pend
            self._eps_cache.clear()
            for b in self._buckets:
                b.write_params(b.buffers["mean"])
            self._runner.loaded()
        return commit

    def _poco_of_groups(self, groups) -> Dict[str, Any]:
        """The ``poco`` entry of a state dict that lost it (``torch.distributed.checkpoint``
        keeps only 'state' and 'param_groups'), from the copy of the counters every group
        carries; refused where that dict would have carried more (pending gradients, a
        bucket's dense buffers), so nothing is dropped without a word."""
        metas = [g.get("poco") if isinstance(g, dict) else None for g in groups]
        check(bool(metas) and all(isinstance(m, dict) for m in metas),
              "not a poco_kernels optimizer state dict (no 'poco' entry, and its param "
              "groups carry no copy of it; torch.distributed.checkpoint's "
              "flatten_optimizer_state_dict=True rebuilds the groups without it: use the "
              "default, False)")
        check(all(m == metas[0] for m in metas),
              "state dict: the param groups carry different 'poco' counters")
        meta = metas[0]
        check(not meta.get("pending_gradients"),
              "state dict was taken with gradients pending or a sample drawn (after "
              "sample()/accumulate(), before step() or refresh()) and lost them on the way "
              "(it has no 'poco' entry: torch.distributed.checkpoint keeps only 'state' and "
              "'param_groups'): take it between updates")
        dense = [f"{b.index}/{n}" for b in self._buckets for n, buf in b.buffers.items()
                 if not b.is_flat_buffer(buf)]
        check(not dense, f"state dict has no 'poco' entry, which holds {type(self).__name__}'s "
                         f"dense buffers ({', '.join(dense)}): save the whole state dict")
        return {**{k: v for k, v in meta.items() if k != "pending_gradients"},
                "pending": {"count": {}, "draws": {}, "sums": {}}, "bucket_buffers": {}}

    def _check_pending(self, pend: Pending, awaiting: Set[int]) -> None:
        """Refuse loaded pending sums that the next update could not use."""
        check(not any(pend.count.values()), "state dict: pending gradients for an optimizer "
                                            "without the sampling protocol")
