"""The inputs GPTQ calibrates each decoder linear on, one decoder layer at a time (true-sequential).

Each calibration sequence is prefilled through llmrt's own model and a paged KV cache. Instead of re-running the
model's prefix for every linear, the decoder layers already quantized *replay* their recorded outputs (the last
one's, for the sequence at hand), so a forward computes the embedding and the current layer only; within a layer,
once the linears before its attention are quantized, the attention replays its outputs too. The values are those
a full forward over the already-quantized layers computes, so the Hessians are unchanged.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from llmrt.errors import UnsupportedError
from llmrt.model.layers.attention import Attention
from llmrt.model.layers.linear import Linear
from llmrt.model.standalone import bind_fresh_kv, chunk_inputs

BLOCK_SIZE = 16


class _Stop(Exception):
    """Raised by a hook once what a pass needs is seen: the rest of the forward is not computed."""


def _clone(out: Any) -> Any:
    # The fused residual-add + norm updates its inputs in place: a replayed output must be a fresh copy each time.
    if isinstance(out, tuple):
        return tuple(_clone(t) for t in out)
    return out.clone() if isinstance(out, torch.Tensor) else out


def call_order(model: nn.Module, sample: list[int]) -> list[tuple[str, nn.Module]]:
    """The decoder's linear layers (not the LM head) and attention modules in the order one forward calls them."""
    order: list[tuple[str, nn.Module]] = []
    hooks = [m.register_forward_pre_hook(lambda mod, args, n=n: order.append((n, mod)))
             for n, m in model.named_modules()
             if (isinstance(m, Linear) and not n.endswith("lm_head")) or isinstance(m, Attention)]
    inputs = SequentialInputs(model, [sample[:8]])
    try:
        inputs.run()
    finally:
        inputs.close()
        for h in hooks:
            h.remove()
    seen: dict[str, nn.Module] = {}
    for n, m in order:
        seen.setdefault(n, m)
    return list(seen.items())


def decoder_layers(model: nn.Module, linear_name: str) -> tuple[str, nn.ModuleList]:
    """(name, module) of the list of decoder layers that holds the linear `linear_name`."""
    parts = linear_name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module = model.get_submodule(".".join(parts[:i]))
        if isinstance(module, nn.ModuleList):
            return ".".join(parts[:i]), module
    raise UnsupportedError(f"{linear_name} is not inside a list of decoder layers: cannot calibrate it layer by layer")


class SequentialInputs:
    """The calibration sequences, each prefilled in one chunk through one paged KV cache bound once; modules can be
    set to replay recorded outputs instead of computing."""

    def __init__(self, model: nn.Module, samples: list[list[int]]):
        self.model, self.samples, self.index = model, samples, 0
        device = next(model.parameters()).device
        backend = bind_fresh_kv(model, -(-max(map(len, samples)) // BLOCK_SIZE), BLOCK_SIZE, torch.float32)
        # Every sequence starts at block 0: each prefill overwrites the last one's KV.
        self.inputs = [chunk_inputs(tokens, 0, list(range(-(-len(tokens) // BLOCK_SIZE))), BLOCK_SIZE, backend,
                                    device) for tokens in samples]
        self.patched: dict[nn.Module, Any] = {}

    def run(self) -> None:
        """One forward per sequence, each stopped where a hook raises _Stop."""
        for i, args in enumerate(self.inputs):
            self.index = i
            try:
                self.model(*args)
            except _Stop:
                pass

    def replay(self, module: nn.Module, outputs: list[Any], copy: bool = True) -> None:
        """From now on `module` returns its recorded output for the sequence being run (a copy unless `copy` is
        False: for a module whose output only other replaying modules see)."""
        self.patched.setdefault(module, module.__dict__.get("forward"))
        if copy:
            module.forward = lambda *args, **kwargs: _clone(outputs[self.index])
        else:
            module.forward = lambda *args, **kwargs: outputs[self.index]

    def restore(self, module: nn.Module) -> None:
        """`module` computes again (its recorded outputs are released)."""
        if module not in self.patched:
            return
        forward = self.patched.pop(module)
        if forward is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = forward

    def outputs(self, module: nn.Module) -> list[Any]:
        """`module`'s output for every sequence (the forward stopped right after it)."""
        out: list[Any] = []

        def hook(mod: nn.Module, args: tuple, result: Any) -> None:
            out.append(_clone(result))
            raise _Stop

        handle = module.register_forward_hook(hook)
        try:
            self.run()
        finally:
            handle.remove()
        return out

    def hessian(self, layer: Linear, record: Optional[nn.Module] = None) -> tuple[torch.Tensor, list[Any]]:
        """(sum x x^T over every token's input to `layer`, the forward stopped right after it; the outputs of
        `record`, a module run before `layer`, on the same pass)."""
        h = torch.zeros(layer.in_features, layer.in_features, dtype=torch.float64, device=layer.weight.device)
        recorded: list[Any] = []

        def pre_hook(mod: nn.Module, args: tuple) -> None:
            x = args[0].reshape(-1, layer.in_features).float()
            h.add_((x.t() @ x).double())
            raise _Stop

        handles = [layer.register_forward_pre_hook(pre_hook)]
        if record is not None:
            handles.append(record.register_forward_hook(lambda mod, args, out: recorded.append(_clone(out))))
        try:
            self.run()
        finally:
            for handle in handles:
                handle.remove()
        return h, recorded

    def close(self) -> None:
        """Every module computes again; the KV cache is unbound."""
        for module in list(self.patched):
            self.restore(module)
        for layer in self.model.attention_layers():
            layer.bind(None, None, None)
