"""The greedy check for quantized checkpoints: our tokens against transformers on the dequantized weights."""
from __future__ import annotations

import torch


def assert_greedy_near_reference(model: torch.nn.Module, prompts: list[list[int]],
                                 outputs: list[list[int]]) -> None:
    """Each token we chose is the reference's argmax after the same prefix, or ties with it within 1% of that
    step's logit range: the int4/int8 kernels compute with bf16 activations and scales (8 significant bits), so
    a near-tie may break the other way; a conversion bug (a wrong nibble or zero) moves logits far more."""
    exact = 0
    with torch.no_grad():
        for p, out in zip(prompts, outputs):
            lg = model(torch.tensor([p + out])).logits[0]
            for i, tok in enumerate(out):
                row = lg[len(p) - 1 + i]
                gap = float(row.max() - row[tok])
                assert gap <= 0.01 * float(row.max() - row.min()), (i, tok, int(row.argmax()), gap)
                exact += gap == 0
    assert exact >= 0.9 * sum(map(len, outputs)), (exact, outputs)
