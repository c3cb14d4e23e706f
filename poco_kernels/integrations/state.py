"""State dicts with one storage per tensor, for serializers that refuse shared storage.

The fused backends (``"cpp"``, ``"triton"``) hold each bucket's parameters as views of one
flat buffer: ``p.data`` of every parameter in the bucket shares one storage.  ``torch.save``
handles that (it writes the storage once), but safetensors groups tensors by storage and
keeps only a name that covers it whole: with no such name, ``safetensors.torch.save_model``
drops all but one tensor of the bucket (with a warning) and ``load_model`` refuses the file.
"""
from __future__ import annotations

from typing import Dict, MutableMapping

import torch

__all__ = ["own_storage", "keep_state_dicts_separate"]


def _view_key(t: torch.Tensor):
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
            tuple(t.stride()), t.dtype)


def own_storage(state_dict: MutableMapping[str, object]) -> MutableMapping[str, object]:
    """Replace, in place, every tensor of ``state_dict`` that shares its storage with a
    different tensor of the dict by a contiguous copy; returns the dict.  Entries that
    are the same view (tied weights) share one copy, as they shared one tensor; tensors
    that own their storage are left as they are (no copy)."""
    groups: Dict[int, set] = {}
    tensors = [(k, v) for k, v in state_dict.items() if isinstance(v, torch.Tensor)
               and v.device.type != "meta"]
    for _, v in tensors:
        groups.setdefault(v.untyped_storage().data_ptr(), set()).add(_view_key(v))
    copies: Dict[tuple, torch.Tensor] = {}
    for k, v in tensors:
        if len(groups[v.untyped_storage().data_ptr()]) > 1:
            key = _view_key(v)
            if key not in copies:
                copies[key] = v.detach().clone(memory_format=torch.contiguous_format)
            state_dict[k] = copies[key]
    return state_dict


def _hook(module, state_dict, prefix, local_metadata) -> None:
    own_storage(state_dict)


def keep_state_dicts_separate(model: torch.nn.Module):
    """Make ``model.state_dict()`` return :func:`own_storage` copies from now on (a
    state-dict post-hook on ``model``; remove it with the returned handle's
    ``remove()``).  Loading is unchanged: ``load_state_dict`` copies into the views."""
    return model.register_state_dict_post_hook(_hook)
