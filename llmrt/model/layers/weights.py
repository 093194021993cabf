"""Weight loaders: every parameter carries the function that copies a checkpoint tensor into it."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

# (param, checkpoint tensor, shard id or None) -> None; raises ValueError on a shape mismatch.
WeightLoader = Callable[[nn.Parameter, torch.Tensor, Optional[int]], None]


def copy_checked(target: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy `loaded` into `target` (casting dtype), refusing a different shape."""
    if tuple(target.shape) != tuple(loaded.shape):
        raise ValueError(f"has shape {tuple(loaded.shape)} but the model expects {tuple(target.shape)}")
    target.copy_(loaded)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[int] = None) -> None:
    """The whole parameter from one tensor."""
    if shard_id is not None:
        raise ValueError(f"is one tensor, but shard {shard_id} of it was given")
    copy_checked(param.data, loaded)


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> nn.Parameter:
    """Attach `loader` to `param` (the model loader calls `param.weight_loader`)."""
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def weight_loader_of(param: nn.Parameter) -> WeightLoader:
    """The parameter's own loader, or the default whole-tensor copy."""
    return getattr(param, "weight_loader", default_weight_loader)
