"""Training frameworks: the package's optimizers where LLM users already train.

* :mod:`poco_kernels.integrations.hf`: ``PoCoTrainer``, the Hugging Face ``Trainer``
  running the sampling protocol (``pip install poco-kernels[hf]``);
* :mod:`poco_kernels.integrations.accelerate`: Hugging Face ``accelerate``
  (``Accelerator.prepare``, DDP, ``save_state``/``load_state``);
* :mod:`poco_kernels.integrations.lightning`: ``PoCoLightningModule``, PyTorch Lightning's
  manual optimization running the protocol (``pip install poco-kernels[lightning]``);
* :func:`own_storage` / :func:`keep_state_dicts_separate` (no extra dependency): the fused
  backends keep a bucket's parameters as views of one flat buffer, which safetensors
  (``save_model``, ``accelerate.save_state``, ``save_pretrained``, the Hugging Face
  Trainer's checkpoints) refuses or, worse, saves with tensors dropped.  These give the
  state dict one storage per tensor (docs/integrations.md).

Each framework module imports its framework only when imported itself.
"""
from __future__ import annotations

from .state import keep_state_dicts_separate, own_storage

__all__ = ["own_storage", "keep_state_dicts_separate"]
