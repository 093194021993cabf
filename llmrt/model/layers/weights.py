"""Weight loaders: every parameter carries the function that copies a checkpoint tensor into it."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

# (param, checkpoint tensor, shard id or None) -> None; raises ValueError on a shape mismatch.
WeightLoader = Callable[[nn.Parameter, torch.Tensor, Optional[int]], None]


def copy_checked(target: torch.Tensor, loaded: "torch.Tensor | CheckpointTensor") -> None:
    """Copy `loaded` into `target` (casting dtype), refusing a different shape."""
    if isinstance(loaded, CheckpointTensor):
        if tuple(target.shape) != tuple(loaded.shape):
            raise ValueError(f"has shape {tuple(loaded.shape)} but the model expects {tuple(target.shape)}")
        loaded = loaded.load()
    if tuple(target.shape) != tuple(loaded.shape):
        raise ValueError(f"has shape {tuple(loaded.shape)} but the model expects {tuple(target.shape)}")
    target.copy_(loaded)


def reads_slices(loader: WeightLoader) -> WeightLoader:
    """Mark a loader that takes a lazy CheckpointTensor (and reads only its slice); other loaders get tensors."""
    loader.reads_slices = True  # type: ignore[attr-defined]
    return loader


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[int] = None) -> None:
    """The whole parameter from one tensor."""
    if shard_id is not None:
        raise ValueError(f"is one tensor, but shard {shard_id} of it was given")
    copy_checked(param.data, loaded)


reads_slices(default_weight_loader)


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> nn.Parameter:
    """Attach `loader` to `param` (the model loader calls `param.weight_loader`)."""
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def weight_loader_of(param: nn.Parameter) -> WeightLoader:
    """The parameter's own loader, or the default whole-tensor copy."""
    return getattr(param, "weight_loader", default_weight_loader)


class CheckpointTensor:
    """A checkpoint tensor read whole or in row/column slices; a safetensors slice reads only its bytes.

    `read(index)` returns the tensor's `index` (a tuple of slices); `transposed` views it as its transpose
    (GPT-2's Conv1D stores [in, out]), so a slice of rows of the view reads columns of the stored tensor.
    """

    def __init__(self, shape: tuple[int, ...], read: Callable[[tuple[slice, ...]], torch.Tensor],
                 transposed: bool = False):
        self._stored_shape = tuple(shape)
        self._read = read
        self.transposed = transposed

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "CheckpointTensor":
        """Wrap an in-memory tensor (GGUF, tests)."""
        return cls(tuple(tensor.shape), lambda index: tensor[index])

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape as the model sees it (transposed when `transposed`)."""
        return self._stored_shape[::-1] if self.transposed else self._stored_shape

    def t(self) -> "CheckpointTensor":
        """The transposed view (2-D only)."""
        return CheckpointTensor(self._stored_shape, self._read, not self.transposed)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) [start, start + length) of the model's view, read from the file."""
        ndim = len(self._stored_shape)
        stored_dim = (ndim - 1 - dim) if self.transposed else dim
        index = tuple(slice(start, start + length) if d == stored_dim else slice(None) for d in range(ndim))
        part = self._read(index)
        return part.t() if self.transposed else part

    def load(self) -> torch.Tensor:
        """The whole tensor."""
        whole = self._read(tuple(slice(None) for _ in self._stored_shape))
        return whole.t() if self.transposed else whole


def as_checkpoint_tensor(loaded: "torch.Tensor | CheckpointTensor") -> CheckpointTensor:
    """Either form as a CheckpointTensor."""
    return loaded if isinstance(loaded, CheckpointTensor) else CheckpointTensor.of(loaded)
