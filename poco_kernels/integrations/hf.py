"""The Hugging Face ``Trainer`` with IVON and IVON-PoCoMo (docs/integrations.md).

:class:`PoCoTrainer` is a ``transformers.Trainer`` that runs the package's sampling
protocol inside ``Trainer.train``; everything else (data loading, gradient accumulation,
bf16, the lr scheduler, logging, evaluation, checkpoints and resume, DDP) is the
Trainer's own.  Per optimizer step ``t`` (``state.global_step``):

* IVON-PoCoMo, when ``t >= poco_start`` and ``(t - poco_start) % refresh_every == 0``:
  a refresh on a mega-batch of ``mega_batches`` mini-batches at ONE posterior sample,
  drawn from the train dataset by a generator seeded from ``(args.seed, refresh index)``
  (so a resumed run draws the same mega-batches), each mini-batch split into the
  Trainer's micro-batches and collated by its data collator;
* the step's micro-batches (``gradient_accumulation_steps`` of them) at ONE inner
  posterior sample (the Trainer's own ``training_step``: its loss scaling, its
  ``no_sync``); the Trainer's gradient clipping applies inside the sample;
* once the correction is active, the same micro-batches again at the outer sample
  (clipped the same way), then the update, the lr scheduler, ``zero_grad``.

Between steps the parameters hold the posterior mean, so evaluation, logging and saving
see the mean.  Checkpoints save the optimizer's state dict (refresh count and noise
counters included) and the model with one storage per tensor
(:func:`~poco_kernels.integrations.keep_state_dicts_separate`), so
``train(resume_from_checkpoint=...)`` continues bit for bit.

Other optimizers (``torch.optim.AdamW`` ...) train as under ``Trainer``.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, List, Optional, Union

import torch
from transformers import Trainer

from ._wrap import Forwarding, is_protocol_optimizer as _protocol_optimizer
from .state import keep_state_dicts_separate

__all__ = ["PoCoTrainer"]


class _ProtocolStep(Forwarding):
    """What the Trainer holds as its optimizer: the package's optimizer, whose ``step()``
    first closes the inner sample and, once the correction is active, runs the step's
    micro-batches at the outer sample."""

    def __init__(self, trainer: "PoCoTrainer", optimizer):
        super().__init__(optimizer)
        self.trainer = trainer

    def step(self, closure=None):
        if closure is not None:
            raise TypeError("under PoCoTrainer the Trainer runs the passes: step() takes "
                            "no closure")
        return self.trainer._poco_step()


class PoCoTrainer(Trainer):
    """``transformers.Trainer`` for the package's IVON-type optimizers.

    Give the optimizer as ``optimizers=(opt, scheduler_or_None)`` or
    ``optimizer_cls_and_kwargs=(poco_kernels.IVONPoCoMo, {...})``, as for any Trainer.

    ``poco_start`` (steps of plain IVON before the first refresh), ``refresh_every``
    (inner steps between refreshes, the paper's m) and ``mega_batches`` (mini-batches per
    refresh) set IVON-PoCoMo's schedule; ``alpha``: a float, or a callable of the step
    returning the correction weight (None: the optimizer's).  They are ignored for IVON.
    ``refresh_seed``: the mega-batches' seed (default ``args.seed``)."""

    def __init__(self, *args, poco_start: int = 0, refresh_every: int = 10,
                 mega_batches: int = 10,
                 alpha: Optional[Union[float, Callable[[int], float]]] = None,
                 refresh_seed: Optional[int] = None, **kwargs):
        super().__init__(*args, **kwargs)
        for name, v, lo in (("poco_start", poco_start, 0), ("refresh_every", refresh_every, 1),
                            ("mega_batches", mega_batches, 1)):
            if not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        self.poco_start, self.refresh_every, self.mega_batches = \
            poco_start, refresh_every, mega_batches
        self.poco_alpha = alpha
        self.refresh_seed = refresh_seed
        self._poco_inputs: List[Any] = []        # this step's micro-batches (outer replay)
        self._poco_open = False                  # an inner sample is in the parameters
        self._poco_model = None
        if self.model is not None:
            keep_state_dicts_separate(self.model)
        if self.optimizer is not None and _protocol_optimizer(self.optimizer):
            self.optimizer = _ProtocolStep(self, self.optimizer)

    # ------------------------------------------------------------------ set-up
    def create_optimizer(self, model=None):
        opt = super().create_optimizer(model)
        if _protocol_optimizer(opt):
            self.optimizer = _ProtocolStep(self, opt)
        return self.optimizer

    @property
    def poco_optimizer(self):
        """The package's optimizer (None before the Trainer built it, or for others)."""
        opt = self.optimizer
        while opt is not None and not _protocol_optimizer(opt) and hasattr(opt, "optimizer"):
            opt = opt.optimizer
        return opt if _protocol_optimizer(opt) else None

    # ------------------------------------------------------------------ the step
    def training_step(self, model, inputs, num_items_in_batch=None):
        opt = self.poco_optimizer
        if opt is None:
            return super().training_step(model, inputs, num_items_in_batch)
        if not self._poco_open:                       # the step's first micro-batch
            self._poco_model = model
            self._poco_inputs = []
            self._poco_begin(model)
            opt.sample("inner")
            self._poco_open = True
        self._poco_inputs.append((inputs, num_items_in_batch))
        return super().training_step(model, inputs, num_items_in_batch)

    def _poco_begin(self, model) -> None:
        """Before the step's inner sample: its alpha and, when due, a refresh."""
        opt, t = self.poco_optimizer, self.state.global_step
        if not getattr(getattr(opt, "rule", None), "has_correction", False):   # IVON: no outer loop
            return
        if self.poco_alpha is not None:
            a = self.poco_alpha(t) if callable(self.poco_alpha) else float(self.poco_alpha)
            for g in opt.param_groups:
                g["alpha"] = a
        if t >= self.poco_start and (t - self.poco_start) % self.refresh_every == 0:
            self._poco_refresh(model)

    def _poco_step(self):
        """The Trainer's ``optimizer.step()``: close the inner sample; the outer pass
        when the correction is active; the update."""
        opt, model = self.poco_optimizer, self._poco_model
        if not self._poco_open:
            raise RuntimeError("PoCoTrainer: step() without the step's micro-batches "
                               "(training_step opens the inner sample)")
        opt.accumulate()
        opt.restore()
        self._poco_open = False
        inputs, self._poco_inputs = self._poco_inputs, []
        if opt.correction_active():
            with opt.sampled("outer"):
                self._replay(model, inputs)
                if self.args.max_grad_norm and self.args.max_grad_norm > 0:
                    self._clip_grad_norm(model)
        return opt.step()

    def _replay(self, model, micro_batches) -> None:
        """The Trainer's forward/backward of each micro-batch, DDP's all-reduce at the
        last only, the loss scaled over ``len(micro_batches)``."""
        saved = getattr(self, "current_gradient_accumulation_steps", None)
        self.current_gradient_accumulation_steps = len(micro_batches)
        try:
            for i, (inputs, n) in enumerate(micro_batches):
                last = i == len(micro_batches) - 1
                ctx = contextlib.nullcontext() if last or self.accelerator.num_processes == 1 \
                    else self.accelerator.no_sync(model)
                with ctx:
                    Trainer.training_step(self, model, inputs, n)
        finally:
            self.current_gradient_accumulation_steps = saved

    # ------------------------------------------------------------------ refreshes
    def _mega_batch(self, index: int) -> List[List[Any]]:
        """Refresh ``index``'s mega-batch: ``mega_batches`` global mini-batches of the
        train dataset, drawn without replacement by a generator seeded from the seed and
        ``index``; this rank's rows, as the Trainer's micro-batches (collated, on the
        device), one list per mini-batch."""
        ds = self.train_dataset
        args = self.args
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        micro = args.per_device_train_batch_size
        per_rank = micro * args.gradient_accumulation_steps
        total = self.mega_batches * per_rank * world
        if len(ds) < total:
            raise ValueError(f"a mega-batch of {self.mega_batches} mini-batches needs "
                             f"{total} examples; the train dataset has {len(ds)}")
        seed = args.seed if self.refresh_seed is None else self.refresh_seed
        g = torch.Generator().manual_seed(int(seed) * 1_000_003 + index)
        order = torch.randperm(len(ds), generator=g)[:total].tolist()
        out = []
        for b in range(self.mega_batches):
            rows = order[(b * world + rank) * per_rank:(b * world + rank + 1) * per_rank]
            out.append([self._prepare_inputs(self.data_collator([ds[i] for i in
                                                                   rows[j:j + micro]]))
                        for j in range(0, per_rank, micro)])
        return out

    def _num_items(self, micro_batches) -> Optional[Any]:
        """``num_items_in_batch`` of a mini-batch, as the Trainer counts it."""
        _, n = self.get_batch_samples(iter(micro_batches), len(micro_batches), self.args.device)
        return n

    def _poco_refresh(self, model) -> None:
        opt = self.poco_optimizer
        chunks = self._mega_batch(opt.refresh_count)
        with opt.sampled("refresh", accumulate=False):
            for chunk in chunks:
                n = self._num_items(chunk)
                self._replay(model, [(mb, n) for mb in chunk])
                opt.accumulate()
        opt.refresh()

    # ------------------------------------------------------------------ checkpoints
    def _save_checkpoint(self, model, trial, *args, **kwargs):
        if self._poco_open:
            raise RuntimeError("PoCoTrainer: a checkpoint inside a step (the inner sample "
                               "is in the parameters)")
        return super()._save_checkpoint(model, trial, *args, **kwargs)
