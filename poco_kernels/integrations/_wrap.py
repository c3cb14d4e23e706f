"""What the integrations hand a framework in place of the package's optimizer: a
``torch.optim.Optimizer`` that forwards everything to it but ``step`` (each integration
says what its ``step`` does)."""
from __future__ import annotations

import torch

__all__ = ["is_protocol_optimizer", "Forwarding"]


def is_protocol_optimizer(opt) -> bool:
    """Whether ``opt`` is one of this package's optimizers with the sampling protocol."""
    return hasattr(opt, "sampled") and type(opt).__module__.startswith("poco_kernels")


class Forwarding(torch.optim.Optimizer):
    """Forwards ``param_groups``, ``state``, ``defaults``, the state dict, ``zero_grad``
    and ``add_param_group`` to ``self.optimizer`` (the lr scheduler, accelerate and
    Lightning read and write them); subclasses define ``step``."""

    def __init__(self, optimizer):                  # noqa: no super().__init__ (a view)
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, group):
        self.optimizer.add_param_group(group)

    def __repr__(self):
        return f"{type(self).__name__}({self.optimizer!r})"

    def step(self, closure=None):
        raise NotImplementedError(f"{type(self).__name__} defines no step")
