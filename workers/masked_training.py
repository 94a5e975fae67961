"""Training inside a mask: every coordinate outside it stays bit for bit what it was.

Zeroing gradients outside the mask is not enough: AdamW's weight decay shrinks every weight, an optimizer
state carried over (a resumed run) moves weights with a zero gradient, and gradient clipping reads the
norm of gradients that will never be applied. So ``mask_optimizer`` attaches to a torch optimizer:

- each parameter's gradient is masked as autograd writes it (a tensor hook), before any clipping;
- the optimizer's weight decay is taken over and applied inside the mask only (decoupled for AdamW and
  Adam(decoupled_weight_decay=True), added to the masked gradient otherwise);
- after each step, optimizer state shaped like a parameter (Adam's moments, SGD's momentum) is zeroed
  outside the mask, so a frozen coordinate's update is 0 whatever the state held.

Any trainer that takes an optimizer works: ``transformers.Trainer`` and TRL's ``GRPOTrainer`` through
``optimizers=(mask_optimizer(...), None)`` (README: training inside a Fisher mask).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn


class MaskMismatch(ValueError):
    """Masks that do not fit the model (a parameter missing, or another shape)."""


@dataclass
class MaskedOptimizer:
    """The hooks ``mask_optimizer`` attached; ``remove()`` detaches them (weight decay given back)."""

    optimizer: torch.optim.Optimizer
    # bool per parameter, True outside the mask: every hook fills these coordinates, so the complement of
    # the trainable mask is taken once, not at every backward and step
    frozen: dict[nn.Parameter, torch.Tensor]
    decay: list[float]
    handles: list = field(default_factory=list)

    def _before_step(self, optimizer, args, kwargs) -> None:
        for group, weight_decay in zip(optimizer.param_groups, self.decay, strict=True):
            decoupled = group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
            for param in group["params"]:
                frozen = self.frozen.get(param)
                if frozen is None or param.grad is None:
                    continue
                param.grad.masked_fill_(frozen, 0.0)  # a gradient written by other means than backward
                if not weight_decay:
                    continue
                with torch.no_grad():
                    if decoupled:
                        # times exactly 1.0 outside the mask: the stored bits do not move
                        factor = torch.where(frozen, 1.0, 1.0 - group["lr"] * weight_decay)
                        param.mul_(factor.to(param.dtype))
                    else:
                        param.grad.add_(param.detach().masked_fill(frozen, 0.0), alpha=weight_decay)

    def _after_step(self, optimizer, args, kwargs) -> None:
        self.zero_state_outside()

    def zero_state_outside(self) -> None:
        for param, frozen in self.frozen.items():
            for value in self.optimizer.state.get(param, {}).values():
                if isinstance(value, torch.Tensor) and value.shape == param.shape:
                    value.masked_fill_(frozen, 0)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        for group, weight_decay in zip(self.optimizer.param_groups, self.decay, strict=True):
            if "weight_decay" in group:
                group["weight_decay"] = weight_decay
        self.handles = []


def mask_optimizer(
    optimizer: torch.optim.Optimizer, model: nn.Module, trainable: Mapping[str, torch.Tensor]
) -> torch.optim.Optimizer:
    """``optimizer`` (over ``model``'s parameters), changed so that it trains only where ``trainable``
    (``{param name: bool}``, True = trainable, e.g. ``workers.mask_formats.trainable_masks``) is True.
    Returns the optimizer itself; its ``masked`` attribute holds the hooks."""
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(trainable))
    unknown = sorted(set(trainable) - set(params))
    if missing or unknown:
        which = f"no mask for {missing[0]!r}" if missing else f"a mask for {unknown[0]!r}, not a parameter"
        raise MaskMismatch(f"the masks do not fit this model: {which}")
    frozen = {}
    for name, param in params.items():
        mask = trainable[name]
        if tuple(mask.shape) != tuple(param.shape):
            raise MaskMismatch(
                f"the mask of {name!r} is {list(mask.shape)}, the parameter {list(param.shape)}"
            )
        frozen[param] = ~mask.to(device=param.device, dtype=torch.bool)
    decay = [float(group.get("weight_decay", 0.0) or 0.0) for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        if "weight_decay" in group:
            group["weight_decay"] = 0.0
    masked = MaskedOptimizer(optimizer, frozen, decay)
    for param, outside in frozen.items():
        if param.requires_grad:
            masked.handles.append(param.register_hook(lambda grad, out=outside: grad.masked_fill(out, 0.0)))
    masked.handles.append(optimizer.register_step_pre_hook(masked._before_step))
    masked.handles.append(optimizer.register_step_post_hook(masked._after_step))
    masked.zero_state_outside()  # a resumed optimizer's state would move frozen weights
    optimizer.masked = masked  # type: ignore[attr-defined]
    return optimizer
